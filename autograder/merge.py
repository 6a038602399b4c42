"""`python -m autograder merge OUT SHARD_DIR...`: combine the output folders of sliced grading jobs.

Each slice (`grade --shard K/N`) wrote its own output folder: done-markers, feedback, graded notebooks, a
gradebook and grades.csv for its students, and `class.json`. The merge checks that every slice graded the
same assignment from the same source, verifies every done-marker under its slice's key (anything else is not
taken), refuses a student graded in two slices, then writes one gradebook.db, grades.csv, feedback folder and
summary as a single run would, re-sealing the markers under the merged folder's key. Given the submissions
folder (or a roster CSV), it also names every student that no slice graded.
"""

from __future__ import annotations

import csv
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from autograder import grade
from autograder.gradebook import classbook, manual
from autograder.intake import lmsnames
from autograder.intake import submissions as intake
from autograder.intake.late import LatePolicy
from labkit.env import LabkitError

log = logging.getLogger("autograder")


@dataclass
class MergeReport:
    """What a merge produced."""

    out: Path  # the merged output folder
    results: list  # StudentResult of every merged student, by student id
    slices: list[dict]  # per input folder: path, shard, students
    missing: list[str] = field(default_factory=list)  # expected students no slice graded
    rejected: list[str] = field(default_factory=list)  # one line per done-marker not taken


def _key_of(folder: Path) -> bytes:
    key = folder / ".grader-key"
    try:
        data = key.read_bytes()
    except OSError as e:
        raise LabkitError(f"{folder} has no grader key ({key.name}): is it a grading output folder?") from e
    if len(data) != 32:
        raise LabkitError(f"{key} is damaged")
    return data


def _read_slice(folder: Path) -> tuple[classbook.ClassInfo, dict, dict[str, grade.StudentResult], list[str]]:
    try:
        info, manifest = classbook.read_info(folder)
    except FileNotFoundError as e:
        raise LabkitError(f"{folder} has no {classbook.MANIFEST}: that grading job did not finish; run it again "
                          "(it resumes where it stopped), then merge") from e
    key = _key_of(folder)
    results, rejected = {}, []
    for sid in manifest["students"]:
        res = grade.load_result(folder / "students" / sid / "result.json", key, sid)
        if res is None:
            rejected.append(f"{sid} in {folder}: done-marker missing, not the grader's own, or another "
                            "student's (regrade that slice)")
        else:
            results[sid] = res
    return info, manifest, results, rejected


def expected_students(submissions: str | Path | None = None, roster: str | Path | None = None, *,
                      assignment: str, lms_regex: str = intake.LMS_REGEX, scratch: Path | None = None) -> set[str]:
    """Student ids the class should have: from the submissions folder (as intake sees it) and/or a roster CSV
    (the class list grading reads: a student_id column or a Canvas gradebook export; else the first column)."""
    ids: set[str] = set()
    # the class list reads the names as grading did: an id with `_` in it is matched whole, never cut
    listed = lmsnames.load_roster(roster) if roster is not None and _has_id_column(roster) else None
    if submissions is not None:
        found = intake.collect(submissions, assignment, scratch=scratch or Path(".merge-intake"), lms_regex=lms_regex,
                               roster=listed)
        ids |= {s.student_id for s in found.submissions}
    if listed is not None:  # a Canvas export's first column is the students' names, and a 'Points Possible' row
        ids |= set(listed.ids)
    elif roster is not None:
        with Path(roster).open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
        if not rows:
            raise LabkitError(f"roster {roster} is empty")
        col = rows[0].index("student_id") if "student_id" in rows[0] else 0
        ids |= {intake.safe_id(r[col]) for r in rows[1:] if len(r) > col and r[col].strip()}
    return ids


def _has_id_column(roster: str | Path) -> bool:
    """Whether the roster CSV is one lmsnames reads (a student_id column, or Canvas's Student and ID): a bare
    first-column list still names who is missing, but cannot tell intake how to read the names."""
    try:
        with Path(roster).open(newline="", encoding="utf-8-sig") as f:
            head = {c.strip() for c in next(csv.reader(f), [])}
    except OSError as e:
        raise LabkitError(f"cannot read the roster {roster}: {e}") from None
    return "student_id" in head or {"Student", "ID"} <= head


def _copy_student(src: Path, out: Path, sid: str, assignment: str) -> None:
    for rel in (f"students/{sid}", f"feedback/{sid}", f"autograded/{sid}"):
        if (src / rel).is_dir():
            shutil.copytree(src / rel, out / rel, dirs_exist_ok=True)


def merge(folders: list[str | Path], out: str | Path, *, submissions: str | Path | None = None,
          roster: str | Path | None = None, policy: LatePolicy | None = None, lms_regex: str = intake.LMS_REGEX,
          progress: bool = True, manual_scores: str | Path | None = None) -> MergeReport:
    """Merge slice output folders into `out`; LabkitError before writing anything if they do not fit together."""
    from autograder.base.progress import bar, stage

    out = Path(out).resolve()
    folders = [Path(f).resolve() for f in folders]
    if not folders:
        raise LabkitError("merge needs at least one slice output folder")
    if out in folders:
        raise LabkitError(f"the merged folder {out} must not be one of the slices")
    stage(f"reading {len(folders)} slice folder(s)", progress)
    slices = [(f, *_read_slice(f)) for f in folders]
    info = slices[0][1]
    for f, inf, _, _, _ in slices[1:]:
        if (inf.assignment, inf.source_digest) != (info.assignment, info.source_digest):
            raise LabkitError(f"{f} graded {inf.assignment} from another source than {folders[0]} "
                              f"({info.assignment}): regrade the slices from the same course")
    specs = [m.get("shard") for _, _, m, _, _ in slices]
    if len(set(specs)) != len(specs):
        raise LabkitError(f"two folders hold the same slice ({', '.join(map(str, specs))}): pass each slice once")
    owner: dict[str, Path] = {}
    overlaps = []
    for f, _, _, res, _ in slices:
        for sid in res:
            if sid in owner:
                overlaps.append(f"{sid} (in {owner[sid]} and {f})")
            owner.setdefault(sid, f)
    if overlaps:
        raise LabkitError(f"refusing to merge: {len(overlaps)} student(s) graded in two slices: "
                          + "; ".join(overlaps[:10]) + ". Were the slices run with different N? Regrade with one N")
    scores = manual.collect(out, info.assignment, info.cells, manual_scores)  # before the gradebook is rebuilt
    out.mkdir(parents=True, exist_ok=True)
    key = grade.result_key(out)
    results, rejected, hardware, junk = [], [], [], []
    pbar = bar(total=len(owner), desc=f"merging {info.assignment}", unit="student", disable=not progress)
    for f, _, manifest, res, rej in slices:
        rejected += rej
        hardware += [h for h in manifest.get("hardware", []) if h not in hardware]
        junk += [j for j in manifest.get("junk", []) if j not in junk]
        for sid, r in res.items():
            _copy_student(f, out, sid, info.assignment)
            (out / "students" / sid / "result.json").write_bytes(grade.sealed_result(r, key))
            results.append(r)
            pbar.set_postfix_str(f"{sid}: {r.score:g}/{r.max_score:g}")
            pbar.update(1)
    pbar.close()
    results.sort(key=lambda r: r.student_id)
    missing = []
    if submissions is not None or roster is not None:
        stage("checking the class list for students no slice graded", progress)
        expected = expected_students(submissions, roster, assignment=info.assignment, lms_regex=lms_regex,
                                     scratch=out / ".intake")
        shutil.rmtree(out / ".intake", ignore_errors=True)
        missing = sorted(expected - set(owner))
    junk += [f"{sid}: not graded by any slice (missing)" for sid in missing] + rejected

    def write(rel: str, data: bytes) -> str:
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return ""

    stage("writing the merged gradebook, grades.csv and summary", progress)
    results = manual.apply(results, scores)
    lines = ["", f"merged {len(folders)} slice(s): " + ", ".join(f"{m.get('shard') or 'whole class'} "
                                                                  f"({len(r)} students)" for _, _, m, r, _ in slices)]
    if missing:
        lines.append(f"MISSING ({len(missing)}; no slice graded them, run their slice again): {', '.join(missing)}")
    if rejected:
        lines += ["rejected done-markers:"] + [f"  {x}" for x in rejected]
    classbook.finish(out, info, results, hardware=hardware, junk=junk, write=write, policy=policy,
                     submissions=submissions, lms_regex=lms_regex, trailer=lines)
    return MergeReport(out, results, [{"folder": str(f), "shard": m.get("shard"), "students": sorted(r)}
                                      for f, _, m, r, _ in slices], missing, rejected)

"""The class's book: the one place that writes a run's or a merge's class outputs, once, after the grading.

`finish` runs at the end of every grading run and every merge. From the students' results it makes one final row
each (extra credit from the bonus tier the checks measured, the late policy's assessment, the total, written
answers pending, verdicts to look at again), then writes, each once: `gradebook.db` (the generated gradebook, every
student's per-cell scores and the bonus as nbgrader extra credit), `grades.csv` (report.write_csv),
`summary.txt` (autograder.gradebook.summary) and `summary.json`, the late and written-answer boxes on each
student's feedback pages, `final.json` (what the LMS exports read) and `class.json` (what a merge needs: the
assignment's cells, checks and source digest, the slice, the students).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from autograder.checks import gpu_policy, review
from autograder.gradebook import manual, summary
from autograder.intake import late
from labkit.bench import write_json

MANIFEST = "class.json"
FINAL = "final.json"
MASTER_GRADEBOOK = "master_gradebook.db"  # the generated gradebook before any student: merges start from it


@dataclass
class ClassInfo:
    """An assignment as the class outputs need it (a merge rebuilds this from class.json, without nbgrader)."""

    assignment: str  # nbgrader assignment id
    max_score: float  # points available (extra credit not included)
    cells: list[dict]  # notebook, cell, max_score of every grade cell
    notebooks: list[str]  # notebook ids
    calls: list[dict]  # notebook, cell, check of every harness call in a test cell
    source_digest: str  # changes when the assignment or course config changes
    gradebook: bytes = b""  # the generated gradebook (finish merges the students into it)


def info_from_course(course) -> ClassInfo:
    calls = [{"notebook": c.notebook, "cell": c.cell, "check": c.check} for c in course.calls]
    return ClassInfo(course.assignment, course.max_score, course.cells, course.notebooks, calls,
                     course.source_digest, course.gradebook)


def read_info(folder: Path) -> tuple[ClassInfo, dict]:
    """ClassInfo and the whole manifest of a grading output folder (FileNotFoundError if it has none)."""
    m = json.loads((folder / MANIFEST).read_text())
    info = ClassInfo(**{k: m[k] for k in ("assignment", "max_score", "cells", "notebooks", "calls",
                                           "source_digest")})
    info.gradebook = (folder / MASTER_GRADEBOOK).read_bytes()
    return info, m


def cell_of_check(info: ClassInfo) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for c in info.calls:
        out.setdefault(c["check"], (c["notebook"], c["cell"]))
    return out


def final_rows(info: ClassInfo, results: list, policy: late.LatePolicy | None,
               times: dict[str, late.Stamp]) -> list[dict]:
    """One row per student: score, extra credit (and where it goes), late assessment, total."""
    cell_of = cell_of_check(info)
    rows = []
    for r in results:
        bonus = gpu_policy.extra_credit(r, cell_of) if r.status == "graded" else []
        ec = round(sum(b["points"] for b in bonus), 4)
        row = {"student_id": r.student_id, "status": r.status, "score": r.score, "max_score": r.max_score,
               "extra_credit": ec, "extra_credit_from": bonus, "not_gradable_here": gpu_policy.not_gradable(r),
               "submitted_at": "", "time_source": "", "days_late": "", "late_penalty": "", "late_note": "",
               "review": review.flags(r)}
        if policy is not None:
            row.update(late.assess(policy, r.student_id, times.get(r.student_id), r.max_score))
        row["total"] = round(max(0.0, r.score + ec - float(row["late_penalty"] or 0.0)), 4)
        # written answers: the total counts the instructor's grades; it is provisional while any is missing
        pending = manual.pending_points(r) if r.status == "graded" else 0.0
        row.update(manual_points=manual.manual_points(r), pending_manual_points=pending, provisional=pending > 0,
                   manual_scores={c["cell"]: c["score"] for c in r.cells if c.get("source") == manual.SOURCE})
        rows.append(row)
    return rows


def _write_late_feedback(out: Path, assignment: str, rows: list[dict], policy: late.LatePolicy | None) -> None:
    """Put each student's late assessment, and the written answers a person graded since, on their feedback pages
    (or take them off when no policy is in force and no manual score exists).

    The pages were written while grading, before the class's policy was applied; a later run or merge with
    another policy (an extension added, say) rewrites the box, so the page always shows the policy of the last
    run. The grader's resume check reads pages without it (report.without_late_box)."""
    from autograder.gradebook import (
        report,  # nbgrader loads with report; a merge without feedback pages never needs it
    )

    for row in rows:
        folder = out / "feedback" / row["student_id"] / assignment
        pages = sorted(folder.glob("*.html")) if folder.is_dir() else []
        late_b = None
        if policy is not None and pages:
            late_b = report.late_box(row, grace_s=policy.grace_s, extended=row["student_id"] in policy.extensions)
        box = report.after_grading_box(late_b, report.manual_box(row) if pages else None)
        for p in pages:
            if p.is_symlink():
                continue
            old = p.read_bytes()
            new = report.with_late_box(old, box)
            if new != old:
                tmp = p.with_name(f".{p.name}.tmp")
                tmp.write_bytes(new)
                os.replace(tmp, p)


def finish(out: Path, info: ClassInfo, results: list, *, hardware: list[dict], junk: list[str], write=None,
           shard: str | None = None, policy: late.LatePolicy | None = None, submissions: str | Path | None = None,
           lms_regex: str | None = None, trailer: list[str] = ()) -> list[dict]:
    """Write the class outputs under `out`, each once: gradebook.db, grades.csv, summary.txt and summary.json,
    the late and written-answer boxes on the feedback pages, final.json and class.json; returns the final rows.

    `write(relative_path, bytes)` is the grader's writer for the pages of students who could not be graded (None:
    leave those pages as they are); `trailer` is the caller's last lines of the summary (a merge's slices).
    """
    times = {}
    if policy is not None and submissions is not None:
        kw = {"lms_regex": lms_regex} if lms_regex else {}
        times = late.submission_times(submissions, tz=policy.timezone, times_csv=policy.times_csv,
                                      roster=policy.roster, assignment=info.assignment, **kw)
    rows = final_rows(info, results, policy, times)
    from autograder.gradebook import report  # nbgrader loads with report

    if write is not None:
        report.not_graded_pages(info, results, write)
    report.write_csv(out / "grades.csv", info, results, rows)
    summary.write(out, summary.text(info, results, rows, junk=junk, hardware=hardware, policy=policy, shard=shard,
                                    trailer=trailer))
    write_json(out / "summary.json", {
        "assignment": info.assignment, "max_score": info.max_score, "hardware": hardware, "junk": junk,
        "students": {r.student_id: {"status": r.status, "score": r.score, "cause": r.cause} for r in results},
        "causes": dict(Counter(r.cause for r in results if r.cause)),
        "final": {r["student_id"]: {k: r[k] for k in ("total", "extra_credit", "days_late", "late_penalty",
                                                       "pending_manual_points", "provisional")} for r in rows},
        "not_gradable_here": {r["student_id"]: r["not_gradable_here"] for r in rows if r["not_gradable_here"]},
        "review": {r["student_id"]: r["review"] for r in rows if r["review"]},
        "late_policy": policy.describe() if policy else None, "shard": shard})
    report.merge_gradebook(info.gradebook, out / "gradebook.db", info.assignment, results, rows)
    _write_late_feedback(out, info.assignment, rows, policy)
    write_json(out / FINAL, {"assignment": info.assignment, "max_score": info.max_score,
                             "late_policy": policy.describe() if policy else None, "students": rows})
    (out / MASTER_GRADEBOOK).write_bytes(info.gradebook)
    write_json(out / MANIFEST, {**{k: v for k, v in asdict(info).items() if k != "gradebook"}, "shard": shard,
                                "students": [r.student_id for r in results], "hardware": hardware, "junk": junk})
    return rows

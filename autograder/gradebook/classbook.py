"""The class's final book, written after the per-student grading: extra credit, late policy, totals, manifest.

`finish` runs at the end of every grading run and every merge. It writes the bonus tier the checks measured
(`extra_credit`) into the nbgrader gradebook as extra credit, applies the late policy to the total, adds the
columns extra_credit, submitted_at, time_source, days_late, late_penalty, total, not_gradable_here and review to
grades.csv and the late assessment to each student's feedback pages, lists late, bonus and not-gradable
students and the verdicts to look at again (autograder.checks.review) in the summary, and keeps `final.json` (what
the LMS exports read) and `class.json` (what a merge needs: the assignment's cells, checks and source digest,
the slice, the students) beside them.
"""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from autograder.base import shown
from autograder.checks import gpu_policy, review
from autograder.gradebook import manual
from autograder.intake import late
from labkit.bench import write_json

MANIFEST = "class.json"
FINAL = "final.json"
MASTER_GRADEBOOK = "master_gradebook.db"  # the generated gradebook before any student: merges start from it
EXTRA_COLUMNS = ["extra_credit", "submitted_at", "time_source", "days_late", "late_penalty", "total",
                 "not_gradable_here", "review", "manual_points", "pending_manual_points", "provisional"]


@dataclass
class ClassInfo:
    """An assignment as the class outputs need it (a merge rebuilds this from class.json, without nbgrader)."""

    assignment: str  # nbgrader assignment id
    max_score: float  # points available (extra credit not included)
    cells: list[dict]  # notebook, cell, max_score of every grade cell
    notebooks: list[str]  # notebook ids
    calls: list[dict]  # notebook, cell, check of every harness call in a test cell
    source_digest: str  # changes when the assignment or course config changes
    gradebook: bytes = b""  # the generated gradebook (report.write_outputs merges the students into it)


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


def _write_gradebook_extra_credit(db: Path, assignment: str, rows: list[dict]) -> None:
    from nbgrader.api import Gradebook

    todo = [(row["student_id"], b) for row in rows for b in row["extra_credit_from"] if b["cell"]]
    if not todo or not db.exists():
        return
    with warnings.catch_warnings(), Gradebook(f"sqlite:///{db}") as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy's autoflush chatter from inside nbgrader's API
        for sid, b in todo:
            g = gb.find_grade(b["cell"], b["notebook"], assignment, sid)
            g.extra_credit = (g.extra_credit or 0.0) + b["points"]
        gb.db.commit()


def _extend_csv(path: Path, rows: list[dict]) -> None:
    """Add the EXTRA_COLUMNS to grades.csv (written by report.write_csv), keeping its rows and columns."""
    if not path.exists():
        return
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols, old = list(reader.fieldnames or []), list(reader)
    by = {r["student_id"]: r for r in rows}
    cols = [c for c in cols if c not in EXTRA_COLUMNS] + EXTRA_COLUMNS
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for o in old:
        r = by.get(o["student_id"], {})
        o.update({"extra_credit": f"{r.get('extra_credit', 0):g}", "submitted_at": r.get("submitted_at", ""),
                  "time_source": r.get("time_source", ""), "days_late": r.get("days_late", ""),
                  "late_penalty": f"{r['late_penalty']:g}" if r.get("late_penalty") != "" and r else "",
                  "total": f"{r.get('total', 0):g}", "not_gradable_here": " ".join(r.get("not_gradable_here", [])),
                  "review": " | ".join(f"{f['check']}: {f['kind']}" for f in r.get("review", [])),
                  "manual_points": f"{r.get('manual_points', 0):g}",
                  "pending_manual_points": f"{r.get('pending_manual_points', 0):g}",
                  "provisional": "yes" if r.get("provisional") else "no"})
        w.writerow(shown.csv_row(o))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buf.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


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


def summary_lines(rows: list[dict], policy: late.LatePolicy | None, shard: str | None) -> list[str]:
    """The summary's extra sections: slice, extra credit, late work, students not gradable on this hardware."""
    lines = []
    if shard:
        lines += ["", f"slice {shard} of the class (merge the slices with `python -m autograder merge`)"]
    bonus = [r for r in rows if r["extra_credit"]]
    if bonus:
        lines += ["", "extra credit (bonus tier; in gradebook.db as nbgrader extra credit and in grades.csv):"]
        lines += [f"  {r['student_id']}: +{r['extra_credit']:g} ({', '.join(b['check'] for b in r['extra_credit_from'])})"
                  for r in bonus]
    if policy is not None:
        lines += ["", f"late policy: {policy.describe()}"]
        lines += [f"  {r['student_id']}: {r['late_note']} -> total {r['total']:g}" for r in rows if r["days_late"]]
        unknown = [r["student_id"] for r in rows if not r["submitted_at"]]
        if unknown:
            lines.append(f"  no submission time (not checked for lateness), {len(unknown)} hand-in(s): "
                         f"{', '.join(unknown)}")
        if not any(r["days_late"] for r in rows):
            lines.append("  nobody late")
    ungradable = [r for r in rows if r["not_gradable_here"]]
    if ungradable:
        lines += ["", f"NOT GRADABLE ON THIS HARDWARE ({len(ungradable)} students; those checks scored 0, regrade "
                      "where they can be graded with --only ... --force: a GPU machine for a GPU check, a quiet one "
                      "for a timing too noisy here):"]
        lines += [f"  {r['student_id']}: {', '.join(r['not_gradable_here'])}" for r in ungradable]
    return lines + review.summary_lines(rows) + manual.summary_lines(rows)


def finish(out: Path, info: ClassInfo, results: list, *, hardware: list[dict], junk: list[str],
           shard: str | None = None, policy: late.LatePolicy | None = None, submissions: str | Path | None = None,
           lms_regex: str | None = None) -> list[dict]:
    """Write extra credit, late policy and totals into the class outputs under `out`; returns the final rows."""
    times = {}
    if policy is not None and submissions is not None:
        kw = {"lms_regex": lms_regex} if lms_regex else {}
        times = late.submission_times(submissions, tz=policy.timezone, times_csv=policy.times_csv,
                                      roster=policy.roster, assignment=info.assignment, **kw)
    rows = final_rows(info, results, policy, times)
    _write_gradebook_extra_credit(out / "gradebook.db", info.assignment, rows)
    _extend_csv(out / "grades.csv", rows)
    _write_late_feedback(out, info.assignment, rows, policy)
    extra = summary_lines(rows, policy, shard)
    if extra:
        with (out / "summary.txt").open("a", encoding="utf-8") as f:
            f.write("\n".join(shown.line(x) for x in extra) + "\n")
    summary = out / "summary.json"
    if summary.exists():
        d = json.loads(summary.read_text())
        d.update(final={r["student_id"]: {k: r[k] for k in ("total", "extra_credit", "days_late", "late_penalty",
                                                             "pending_manual_points", "provisional")}
                        for r in rows},
                 not_gradable_here={r["student_id"]: r["not_gradable_here"] for r in rows if r["not_gradable_here"]},
                 review={r["student_id"]: r["review"] for r in rows if r["review"]},
                 late_policy=policy.describe() if policy else None, shard=shard)
        write_json(summary, d)
    write_json(out / FINAL, {"assignment": info.assignment, "max_score": info.max_score,
                             "late_policy": policy.describe() if policy else None, "students": rows})
    (out / MASTER_GRADEBOOK).write_bytes(info.gradebook)
    write_json(out / MANIFEST, {**{k: v for k, v in asdict(info).items() if k != "gradebook"}, "shard": shard,
                                "students": [r.student_id for r in results], "hardware": hardware, "junk": junk})
    return rows

"""summary.txt, the class's end-of-run page for the instructor: the one module that writes it.

It is written once per run or merge, after the class's final rows exist (autograder.gradebook.classbook.finish):
the table of students, failures by cause, score statistics and skipped input, then the sections an instructor
acts on (the slice, extra credit, late work, checks not gradable on this hardware, speed verdicts to look at again,
written answers to grade) and whatever the caller adds (a merge's slices). A run that stops before grading appends
its one line (`note_stopped`). Every line is escaped whole: ids, causes, messages, flags and skipped names are the
students' (autograder.base.shown).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import statistics
from collections import Counter
from pathlib import Path

from autograder.base import shown
from autograder.checks import review

NAME = "summary.txt"


def table_lines(info, results: list, junk: list[str], hardware: list[dict]) -> list[str]:
    """The end-of-run table: one line per student, then failures by cause, score statistics and skipped input."""
    lines = [f"assignment {info.assignment}: {len(results)} students, max {info.max_score:g} points",
             "hardware: " + "; ".join(f"{h['card']} ({h['class']})" for h in hardware), ""]
    w = max([len(shown.line(r.student_id)) for r in results] + [7])
    lines.append(f"{'student':<{w}}  {'score':>11}  {'status':<11} cause / message")
    for r in results:
        extra = r.cause or ""
        if r.status != "graded" or r.cause:
            extra = f"{r.cause}: {r.message}"
        if r.flags:
            extra += ("; " if extra else "") + "FLAGGED: " + r.flags[0]
        lines.append(f"{shown.line(r.student_id):<{w}}  {r.score:>5g} / {r.max_score:<3g}  {r.status:<11} {extra}")
    causes = Counter(r.cause for r in results if r.cause)
    lines += ["", "failures by cause:" if causes else "failures by cause: none"]
    lines += [f"  {c:<24} {n}" for c, n in causes.most_common()]
    graded = [r.score for r in results if r.status == "graded"]
    if graded:
        lines += ["", f"graded: {len(graded)}; mean {statistics.mean(graded):.2f}, median "
                      f"{statistics.median(graded):g}, full marks {sum(1 for s in graded if s >= info.max_score)}"]
    per = [r.wall_s for r in results if r.wall_s]
    if per:
        lines.append(f"grading time per student: median {statistics.median(per):.1f} s, max {max(per):.1f} s")
    flagged = [r.student_id for r in results if r.flags]
    if flagged:
        lines.append("flagged for a look: " + ", ".join(flagged))
    if junk:
        lines += ["", "skipped input:"] + [f"  {j}" for j in junk]
    return lines


def final_sections(rows: list[dict], policy, shard: str | None) -> list[str]:
    """The sections read off the final rows (classbook.final_rows): slice, extra credit, late work, students not
    gradable on this hardware, speed verdicts to look at again, written answers to grade."""
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
    return lines + review_sections(rows) + manual_sections(rows)


def review_sections(rows: list[dict]) -> list[str]:
    """The sections for the final rows' `review` findings (autograder.checks.review.flags)."""
    lines = []
    for kind, head in ((review.MEASURE_AGAIN, "MEASURE AGAIN (the GPU throttled or its clocks moved while the rounds "
                                              "were timed; not a failure for the student: regrade with --only ... "
                                              "--force)"),
                       (review.NEAR_BOUNDARY, "NEAR A TIER BOUNDARY: regrade recommended (the ratio is within its "
                                              "measured spread of a boundary; not a failure for the student)"),
                       (review.REMEASURED, "RE-MEASURED BEFORE SCORING (the first ratio was within its spread of a "
                                           "tier boundary: measured once more and scored on the pooled rounds; "
                                           "nothing to do)"),
                       (review.OWN_SPREAD, "SCORED DESPITE ITS OWN SPREAD (its rounds disagreed by more than the "
                                           "ratio while the baseline's held steady: the hand-in's own jitter, scored "
                                           "as measured; look at what its code does between rounds)")):
        hits = [(r["student_id"], f) for r in rows for f in r.get("review", []) if f["kind"] == kind]
        if hits:
            lines += ["", f"{head}:"] + [f"  {sid}: {f['check']}: {f['why']}" for sid, f in hits]
    return lines


def manual_sections(rows: list[dict]) -> list[str]:
    """The section on written answers still to grade (none: no lines)."""
    todo = [r for r in rows if r.get("pending_manual_points")]
    if not todo:
        return []
    return ["", f"NEEDS MANUAL GRADING ({len(todo)} students; their totals are provisional): grade the written "
                "answers in formgrader on this folder's gradebook.db or pass --manual-scores scores.csv, then "
                "run again"] + [f"  {r['student_id']}: {r['pending_manual_points']:g} points pending" for r in todo]


def text(info, results: list, rows: list[dict], *, junk: list[str], hardware: list[dict], policy=None,
         shard: str | None = None, trailer: list[str] = ()) -> str:
    """The whole summary, every line escaped."""
    lines = table_lines(info, results, junk, hardware) + final_sections(rows, policy, shard) + list(trailer)
    return "\n".join(shown.line(x) for x in lines) + "\n"


def write(out: Path, page: str) -> None:
    """Replace `out`/summary.txt with `page` (atomic: a reader sees the old page or the new one)."""
    p = out / NAME
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(p)


def note_stopped(out: Path, error: BaseException) -> None:
    """Append the line saying the run stopped before grading, and why (best effort: the run is already failing)."""
    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    with contextlib.suppress(OSError), (out / NAME).open("a", encoding="utf-8") as f:
        f.write(f"{stamp} run stopped before grading: {shown.line(error)}\n")

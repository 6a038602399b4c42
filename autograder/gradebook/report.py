"""What the grader writes for people, piece by piece: gradebook reads and merges, grades.csv, feedback pages.

Grades are read from each student's scratch gradebook, checked against the master (a notebook's code could
have rewritten its own gradebook while it ran), and merged into one fresh `gradebook.db` at the end of every
run, so the merge is idempotent and the instructor can keep using nbgrader's own tools on it.
"""

from __future__ import annotations

import csv
import html
import io
import os
import re
import warnings
from pathlib import Path

from nbgrader.api import Gradebook

from autograder.base import shown
from autograder.gradebook import manual


class TamperedError(Exception):
    """A student's gradebook no longer describes the assignment that was generated."""


def _url(db: Path) -> str:
    return f"sqlite:///{db}"


def gradebook_cells(db: Path, assignment: str) -> tuple[list[dict], list[str]]:
    """Every grade cell (notebook, cell, max_score) of the assignment, and its notebook ids, in notebook order."""
    with Gradebook(_url(db)) as gb:
        a = gb.find_assignment(assignment)
        notebooks = [nb.name for nb in a.notebooks]
        cells = [{"notebook": nb.name, "cell": gc.name, "max_score": float(gc.max_score)}
                 for nb in a.notebooks for gc in nb.grade_cells]
    return cells, notebooks


def structure(db: Path, assignment: str) -> dict:
    """Grade cells (name, points, type), source cells (name, checksum, locked) and task cells (name, points) per
    notebook."""
    with Gradebook(_url(db)) as gb:
        a = gb.find_assignment(assignment)
        return {nb.name: (sorted((gc.name, float(gc.max_score), gc.cell_type) for gc in nb.grade_cells),
                          sorted((sc.name, sc.checksum, sc.locked) for sc in nb.source_cells),
                          sorted((tc.name, float(tc.max_score)) for tc in nb.task_cells))
                for nb in a.notebooks}


SCHEMA_STEPS = 10_000_000  # SQLite VM steps one read of a crafted file may take: it cannot keep the grader busy
SPARE_ROWS = 64  # rows a scratch gradebook may hold beyond three times the master's: grading one hand-in adds
# a student, a submission, a row per notebook and a grade and a comment per cell, well under twice the master's


def _read_only(db: Path | bytes):
    """A SQLite connection to a file (read-only) or to bytes, that aborts any statement past SCHEMA_STEPS."""
    import sqlite3

    con = sqlite3.connect(":memory:") if isinstance(db, bytes) else sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    if isinstance(db, bytes):
        con.deserialize(db)
    con.set_progress_handler(lambda: 1, SCHEMA_STEPS)  # past it: abort, an error
    return con


def schema(db: Path | bytes) -> list[tuple]:
    """The tables, indexes, views and triggers of a SQLite file (or its bytes), read without running any of them."""
    con = _read_only(db)
    try:
        return sorted(con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall(),
                      key=lambda r: tuple(str(x) for x in r))
    finally:
        con.close()


def well_formed(db: Path | bytes) -> str | None:
    """None if the SQLite file's pages form proper trees (`PRAGMA quick_check`), else its first complaint.

    A table can be rewritten so that every entry of each level points at the same page below: a few pages that
    SQLite walks as 584**6 rows, inside single instructions (a count, nbgrader's scans) where no step budget
    reaches, so the grader's process never came back. quick_check visits each page once and names the page
    referenced twice."""
    con = _read_only(db)
    try:
        rows = con.execute("PRAGMA quick_check(1)").fetchall()
    finally:
        con.close()
    return None if rows == [("ok",)] else str(rows[0][0] if rows else "no answer").splitlines()[-1][:200]


def table_rows(db: Path | bytes, most: int | None = None) -> int:
    """Rows in all the tables of a SQLite file (or its bytes), within SCHEMA_STEPS; each table counted up to
    `most` + 1 rows at most, row by row, so that the step budget applies."""
    con = _read_only(db)
    limit = -1 if most is None else most + 1
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return sum(con.execute(f'SELECT count(*) FROM (SELECT 1 FROM "{t.replace(chr(34), chr(34) * 2)}" LIMIT ?)',
                               (limit,)).fetchone()[0] for t in tables)
    finally:
        con.close()


def check_integrity(student_db: Path, expected: dict, assignment: str, master: bytes | None = None) -> None:
    """Raise TamperedError if the student's gradebook changed the assignment's cells, points or checksums, or
    (given the `master` gradebook's bytes) its schema: a view, a trigger or another table, which the grader's own
    reads and writes would run in its process (a view that never ends, say); or holds far more rows than grading
    one hand-in writes: nbgrader's reads look some of them up without an index, so 200,000 crafted rows in a
    23 MiB file held the grader's process for 8 minutes and 950 MB before the cells were compared; or its pages no
    longer form trees (`well_formed`). Nothing reads it through nbgrader before these pass."""
    bad = well_formed(student_db)
    if bad:
        raise TamperedError(f"the scratch gradebook's file is malformed ({bad})")
    if master is not None:
        if schema(student_db) != schema(master):
            raise TamperedError("the scratch gradebook's tables, views or triggers differ from the assignment's")
        most = 3 * table_rows(master) + SPARE_ROWS
        rows = table_rows(student_db, most)
        if rows > most:
            raise TamperedError(f"the scratch gradebook holds more than {most:,} rows, more than grading one "
                                "hand-in writes")
    if structure(student_db, assignment) != expected:
        raise TamperedError("grade cells, points or checksums in the scratch gradebook differ from the assignment")


def course_cells(rows: list[dict], cells: list[dict]) -> tuple[list[dict], list[str]]:
    """The assignment's grade cells (`cells`, from the master gradebook), each scored from `rows` (`read_grades`
    of the scratch gradebook, which the student's code could write): never more than the master's points, the
    lowest where a cell has several rows. Rows for cells the assignment does not have are dropped, with a flag."""
    got: dict[tuple, list[dict]] = {}
    for r in rows:
        got.setdefault((r["notebook"], r["cell"]), []).append(r)
    out = []
    for c in cells:
        mine = got.get((c["notebook"], c["cell"]), [])
        score = min((r["score"] for r in mine), default=0.0)
        # Only a written answer may wait for a person; the flag on any other cell came from the submission's code
        out.append({**c, "score": max(0.0, min(score, c["max_score"])), "source": "nbgrader",
                    "needs_manual": bool(c.get("manual")) and any(r["needs_manual"] for r in mine)})
    known = {(c["notebook"], c["cell"]) for c in cells}
    extra = sorted({f"{n}/{k}" for (n, k), rs in got.items() if (n, k) not in known or len(rs) > 1})
    return out, [f"the scratch gradebook held grade rows the assignment does not have ({', '.join(extra)}): "
                 "written by the submission's code? ignored"] if extra else []


def read_grades(db: Path, assignment: str, student: str) -> list[dict]:
    """Per grade cell: notebook, cell, score (auto score, 0 when none), max_score, needs_manual."""
    rows = []
    with Gradebook(_url(db)) as gb:
        sub = gb.find_submission(assignment, student)
        for nb in sub.notebooks:
            for g in nb.grades:
                score = g.manual_score if g.manual_score is not None else g.auto_score
                rows.append({"notebook": nb.name, "cell": g.name, "score": float(score or 0.0),
                             "max_score": float(g.max_score), "needs_manual": bool(g.needs_manual_grade),
                             "source": "nbgrader"})
    return rows


def write_scores(db: Path, assignment: str, student: str, cells: list[dict]) -> None:
    """Store the grader's final per-cell scores as auto scores (so nbgrader's feedback shows them), with no extra
    credit and no comment but nbgrader's own: the feedback page shows both, and the submission's code could have
    written them (extra credit reaches the class gradebook from the trusted checks, in classbook)."""
    with Gradebook(_url(db)) as gb:
        for nb in gb.find_submission(assignment, student).notebooks:
            for cm in nb.comments:
                cm.manual_comment = None
                cm.auto_comment = cm.auto_comment if cm.auto_comment == NO_RESPONSE else None
        for c in cells:
            g = gb.find_grade(c["cell"], c["notebook"], assignment, student)
            g.extra_credit = None
            g.auto_score = c["score"]
            # nbgrader never writes a manual score while autograding: one here came from the submission's code,
            # and nbgrader's feedback page would show it in place of the grader's score
            g.manual_score = None
            if c.get("source", "").startswith("trusted"):
                g.needs_manual_grade = False
            _manual_grade(g, c, graded=True)
        gb.db.commit()


NO_RESPONSE = "No response."  # the one comment nbgrader's autograde writes (a written answer left blank)


def _manual_grade(g, c: dict, graded: bool) -> None:
    """A written answer in a gradebook: pending (no score, needs manual grading, as formgrader lists it) or the
    instructor's score as nbgrader's manual score; nothing a submission wrote survives."""
    if not c.get("manual"):
        return
    g.manual_score = c["score"] if c.get("source") == manual.SOURCE else None
    g.auto_score = None if c.get("needs_manual") or c.get("source") == manual.SOURCE else c["score"]
    g.needs_manual_grade = bool(c.get("needs_manual")) and graded


def merge_gradebook(master: bytes, dest: Path, assignment: str, results: list, rows: list[dict] = ()) -> None:
    """Build `dest` from the generated gradebook plus every student's per-cell scores and the bonus tier their
    checks measured (the final rows' `extra_credit_from`, as nbgrader extra credit on the check's cell), atomically.
    No generated gradebook (an empty `master`, as a ClassInfo built by hand has) writes none."""
    if not master:
        return
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.write_bytes(master)
    with warnings.catch_warnings(), Gradebook(_url(tmp)) as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy's autoflush chatter from inside nbgrader's API
        for r in results:
            gb.update_or_create_student(r.student_id)
            gb.update_or_create_submission(assignment, r.student_id)
            for c in r.cells:
                g = gb.find_grade(c["cell"], c["notebook"], assignment, r.student_id)
                g.auto_score = c["score"]
                g.needs_manual_grade = bool(c.get("needs_manual")) and r.status == "graded"
                _manual_grade(g, c, graded=r.status == "graded")
        for row in rows:
            for b in row["extra_credit_from"]:
                if b["cell"]:
                    g = gb.find_grade(b["cell"], b["notebook"], assignment, row["student_id"])
                    g.extra_credit = (g.extra_credit or 0.0) + b["points"]
        gb.db.commit()
    os.replace(tmp, dest)


# ------------------------------------------------------------------------------------------------ feedback


def _fmt(x, spec=",.0f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else ("-" if x is None else str(x))


# the grader's own bookkeeping: in result.json and the summary for the instructor, not in the student's table
_NOT_SHOWN = ("score", "max_score", "gradable", "hardware", "device", "secret", "sandbox", "baseline_interference",
              "baseline_after_student_slowdown", "warmup_excess_s")


def _measure_list(m: dict) -> str:
    items = [f"{k}: {v}" for k, v in m.items() if k not in _NOT_SHOWN and not isinstance(v, (dict, list))]
    return "; ".join(items)[:400]


def summary_box(res) -> str:
    """An HTML block with the final score, every re-run check with its measurements, and what the grader noticed."""
    e = shown.html
    rows = []
    for s in res.checks:
        verdict = {True: "passed", False: "failed", None: "not gradable here"}[s.get("passed")]
        if s.get("passed") and s.get("fraction", 1) < 1:
            verdict = f"partly ({s['fraction']:.0%})"
        ratio = f"{s['ratio']:.2f}x" if isinstance(s.get("ratio"), (int, float)) else "-"
        rows.append("<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in (
            s.get("check"), verdict, _fmt(s.get("baseline_img_s")), _fmt(s.get("student_img_s")), ratio,
            s.get("message", ""), _measure_list(s.get("measurements") or {}))) + "</tr>")
    table = ("<table border='1' cellpadding='4' style='border-collapse:collapse'><tr><th>check</th>"
             "<th>verdict</th><th>baseline per s</th><th>yours per s</th><th>ratio</th><th>message</th>"
             "<th>measured</th></tr>" + "".join(rows) + "</table>") if rows else ""
    cells = "".join(f"<li>{e(c['notebook'])} / {e(c['cell'])}: "
                    + (e(manual.cell_note(c)) or f"{c['score']:g} of {c['max_score']:g}")
                    + (" (checked again by the grader outside your notebook)" if c.get("source") == "trusted"
                       else "") + "</li>" for c in res.cells)
    notes = "".join(f"<li>{e(n)}</li>" for n in res.notes)
    cause = f"<p><b>Note:</b> {e(res.message)}</p>" if res.status != "graded" or res.cause else ""
    cause += _pending_note(res)
    return ("<div id='labkit-grade-summary' style='border:2px solid #555;padding:10px;margin:10px;"
            "font-family:sans-serif'>"
            f"<h2>{e(res.assignment)}: {res.score:g} / {res.max_score:g} points</h2>{cause}"
            f"<p>Graded on {e(res.hardware.get('card', '?'))} ({e(res.hardware.get('class', '?'))}).</p>"
            f"{table}<ul>{cells}</ul>" + (f"<p>Also noticed:</p><ul>{notes}</ul>" if notes else "") + "</div>")


def _pending_note(res) -> str:
    pending = manual.pending_points(res) if res.status == "graded" else 0
    note = (f"<p><b>Provisional:</b> {pending:g} points of written answers need manual grading; the total above "
            "does not count them yet.</p>") if pending else ""
    here = [s["check"] for s in res.checks if s.get("passed") is None] if res.status == "graded" else []
    if here:  # e.g. lab 4's speed on a CPU-only grader: zero here is "not graded yet", not points lost
        note += (f"<p><b>Not graded yet:</b> {shown.html(', '.join(here))} could not be graded on this machine "
                 f"({shown.html(res.hardware.get('class', '?'))}); the total above counts them as 0 until they are "
                 "graded where they can be (the table says why).</p>")
    return note


def feedback_path(res, notebook: str) -> str:
    """Where a notebook's feedback page goes, relative to the output folder (nbgrader's own layout)."""
    return f"feedback/{res.student_id}/{res.assignment}/{notebook}.html"


def feedback_page(res, nbgrader_html: str | None) -> bytes:
    """nbgrader's feedback page with the summary box on top (or the box alone when there is no page)."""
    box = summary_box(res)
    if nbgrader_html is None:
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(res.assignment)}</title>"
                f"</head><body>{box}</body></html>")
    else:
        nbgrader_html = _pending_cell_scores(nbgrader_html, res)
        m = re.search(r"<body[^>]*>", nbgrader_html)
        page = nbgrader_html[:m.end()] + box + nbgrader_html[m.end():] if m else box + nbgrader_html
    return page.encode("utf-8")


def _pending_cell_scores(page: str, res) -> str:
    """nbgrader's page with each written answer still waiting for a person labelled so, where nbgrader prints its
    autograded 0 ("Score: 0.0 / 2.0", read as 2 points lost): in the table of contents and in the cell's own
    heading, each found by the cell's anchor that nbgrader writes (the first such, in nbgrader's own markup)."""
    for c in res.cells if res.status == "graded" else []:
        if not (c.get("manual") and c.get("needs_manual")):
            continue
        cell, label = re.escape(str(c["cell"])), "pending (a person grades it)"
        page = re.sub(rf'(<a href="#{cell}">[^<]*</a> \(Score: )[\d.]+( / [\d.]+\))', rf"\g<1>{label}\g<2>", page,
                      count=1)
        page = re.sub(rf'(<a name="{cell}"></a><div class="panel-heading">.{{0,400}}?Score: )[\d.]+( / [\d.]+)',
                      rf"\g<1>{label}\g<2>", page, count=1, flags=re.S)
    return page


# ------------------------------------------------------------------------------------------------ late work

# The late box sits right after the summary box (which feedback_page puts right after <body>): found by position,
# never by searching, so a marker a student typed into their own notebook (rendered further down) is never taken
# for it. Everything inside it is escaped, so its end marker cannot occur inside it.
_LATE_START, _LATE_END = "<!--labkit-late-->", "<!--/labkit-late-->"


def late_box(row: dict, *, grace_s: float = 0.0, extended: bool = False) -> str:
    """HTML for a student's late-work assessment (a classbook.final_rows row): submitted at, due date, days
    late after grace and extension, the penalty in points, and the total before and after it."""
    e = shown.html
    before = float(row.get("score") or 0.0) + float(row.get("extra_credit") or 0.0)
    penalty = float(row.get("late_penalty") or 0.0)
    due = e(str(row.get("due") or "?")) + (" (your extension)" if extended else "")
    grace = f" plus a grace period of {grace_s / 60:g} min" if grace_s else ""
    got = e(str(row.get("submitted_at") or "unknown"))
    if row.get("time_source"):
        got += f" (from the {e(str(row['time_source']))})"
    items = [f"<li>submitted at: {got}</li>", f"<li>due: {due}{grace}</li>",
             f"<li>days late (after grace and extension): {int(row.get('days_late') or 0)}</li>",
             f"<li>late penalty applied: -{penalty:g} points</li>",
             f"<li>total before the penalty: {before:g}; after: {float(row.get('total', before)):g} points</li>"]
    if row.get("late_note"):
        items.append(f"<li>{e(str(row['late_note']))}</li>")
    return (f"{_LATE_START}<div id='labkit-late' style='border:2px solid #a50;padding:10px;margin:10px;"
            f"font-family:sans-serif'><h3>Late work</h3><ul>{''.join(items)}</ul></div>{_LATE_END}")


def manual_box(row: dict) -> str | None:
    """HTML for the written answers a person graded after the page was written (a classbook.final_rows row), or
    None when none was: the page's summary box and nbgrader's cell scores are from autograding, this supersedes."""
    scores = row.get("manual_scores") or {}
    if not scores:
        return None
    e = shown.html
    items = "".join(f"<li>{e(str(cell))}: {float(score):g} points</li>" for cell, score in scores.items())
    left = float(row.get("pending_manual_points") or 0)
    state = f"{left:g} points of written answers still wait for a person" if left else "no longer provisional"
    return (f"{_LATE_START}<div id='labkit-manual' style='border:2px solid #275;padding:10px;margin:10px;"
            f"font-family:sans-serif'><h3>Written answers, graded by a person</h3><ul>{items}</ul><p>Your total is "
            f"now {float(row.get('total') or 0):g} of {float(row.get('max_score') or 0):g} points ({state}). The box "
            "above was written when your hand-in was autograded, and the notebook below shows each cell's score "
            f"from then: these lines replace them.</p></div>{_LATE_END}")


def after_grading_box(*boxes: str | None) -> str | None:
    """The late box and the manual box (each as late_box/manual_box return it) in the one slot after the summary
    box that the page's digest leaves out; None when neither applies."""
    parts = [b.removeprefix(_LATE_START).removesuffix(_LATE_END) for b in boxes if b]
    return _LATE_START + "".join(parts) + _LATE_END if parts else None


def _late_slot(page: str) -> tuple[int, int]:
    """(start, end) of the late box's place in a feedback page; start == end when the page has none yet."""
    m = re.search(r"<body[^>]*>", page)
    at = m.end() if m else 0
    if page.startswith("<div id='labkit-grade-summary'", at):
        at = page.index("</div>", at) + len("</div>")  # the summary box holds no other div (all text escaped)
    if page.startswith(_LATE_START, at):
        end = page.find(_LATE_END, at)
        if end >= 0:
            return at, end + len(_LATE_END)
    return at, at


def with_late_box(page: bytes, box: str | None) -> bytes:
    """A feedback page with its late box replaced by `box` (or removed when None); idempotent."""
    text = page.decode("utf-8", errors="replace")
    start, end = _late_slot(text)
    if start == end and not box:
        return page  # byte for byte: what the grader wrote is what its digest covers
    return (text[:start] + (box or "") + text[end:]).encode("utf-8")


def without_late_box(page: bytes) -> bytes:
    """The page as the grader first wrote it (the late box is added, and rewritten, after grading)."""
    return with_late_box(page, None)


# ------------------------------------------------------------------------------------------------ class outputs


def _first_speed(r) -> dict:
    return next((s for s in r.checks if s.get("ratio") is not None), r.checks[0] if r.checks else {})


# the columns read off the final rows (classbook.final_rows): bonus, late policy, total, review, written answers
FINAL_COLUMNS = ["extra_credit", "submitted_at", "time_source", "days_late", "late_penalty", "total",
                 "not_gradable_here", "review", "manual_points", "pending_manual_points", "provisional"]


def _final_cells(r: dict) -> dict:
    return {"extra_credit": f"{r.get('extra_credit', 0):g}", "submitted_at": r.get("submitted_at", ""),
            "time_source": r.get("time_source", ""), "days_late": r.get("days_late", ""),
            "late_penalty": f"{r['late_penalty']:g}" if r.get("late_penalty") != "" and r else "",
            "total": f"{r.get('total', 0):g}", "not_gradable_here": " ".join(r.get("not_gradable_here", [])),
            "review": " | ".join(f"{f['check']}: {f['kind']}" for f in r.get("review", [])),
            "manual_points": f"{r.get('manual_points', 0):g}",
            "pending_manual_points": f"{r.get('pending_manual_points', 0):g}",
            "provisional": "yes" if r.get("provisional") else "no"}


def write_csv(path: Path, info, results: list, rows: list[dict]) -> None:
    """grades.csv: a row per student, its cells, checks and measurements, then the final rows' columns (atomic)."""
    cell_names = [c["cell"] for c in info.cells]
    cols = ["student_id", "status", "score", "max_score", "percent", "cause", "message", *cell_names,
            "checks_passed", "ratio", "baseline_img_s", "student_img_s", "card", "hardware", "wall_s",
            "peak_memory_mib", "flags", "notes", "finished_at"]
    cols = [c for c in cols if c not in FINAL_COLUMNS] + FINAL_COLUMNS
    final = {r["student_id"]: r for r in rows}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in results:
        s = _first_speed(r)
        row = {"student_id": r.student_id, "status": r.status, "score": f"{r.score:g}", "max_score": f"{r.max_score:g}",
               "percent": f"{100 * r.score / r.max_score:.1f}" if r.max_score else "", "cause": r.cause or "",
               "message": r.message,
               "checks_passed": f"{sum(1 for c in r.checks if c.get('passed'))}/{len(r.checks)}" if r.checks else "",
               "ratio": s.get("ratio", ""), "baseline_img_s": s.get("baseline_img_s", ""),
               "student_img_s": s.get("student_img_s", ""), "card": r.hardware.get("card", ""),
               "hardware": r.hardware.get("class", ""), "wall_s": f"{r.wall_s:.1f}",
               "peak_memory_mib": f"{r.peak_rss_bytes / 2**20:.0f}", "flags": " | ".join(r.flags),
               "notes": " | ".join(r.notes), "finished_at": r.finished_at}
        for c in r.cells:
            row[c["cell"]] = "pending" if c.get("manual") and c.get("needs_manual") else f"{c['score']:g}"
        row.update(_final_cells(final.get(r.student_id, {})))
        w.writerow(shown.csv_row(row))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buf.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


def not_graded_pages(info, results: list, write) -> None:
    """A feedback page for every student who could not be graded, saying why; `write(relative_path, bytes)` is the
    grader's writer for per-student files (it keeps them guarded)."""
    for r in results:
        if r.status != "graded":
            for nb in info.notebooks:
                write(feedback_path(r, nb), feedback_page(r, None))

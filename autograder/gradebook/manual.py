"""Written answers: an assignment's manually graded cells, their pending points and the instructor's scores.

A markdown cell that is both an nbgrader grade cell and a solution cell is a written answer, graded by a person
against the rubric in the instructor's notebook. The grader never takes such a cell's score from a student's
scratch gradebook or notebook (the student's code ran next to both and could write one): which cells are
written answers comes from the generated assignment, and their points stay *pending* (the total provisional)
until an instructor grades them, in nbgrader's formgrader on the output folder's `gradebook.db` or with a CSV
(`student_id,cell,score`) passed as `--manual-scores`. Every later run or merge reads both back (the CSV wins)
and keeps them in the rebuilt gradebook, so the total counts them from then on.
"""

from __future__ import annotations

import copy
import csv
import logging
import re
import warnings
from pathlib import Path

from autograder.sandbox.limits import MAX_JSON_VALUES, json_values
from labkit.errors import LabkitError

SOURCE = "manual"  # a cell's "source" once an instructor's score is in


def _gradebook(db: Path):
    from nbgrader.api import Gradebook

    return Gradebook(f"sqlite:///{db}")


def manual_ids(db: Path, assignment: str) -> set[tuple[str, str]]:
    """(notebook, cell) of every manually graded cell of the generated assignment: grade cells that are also
    solution cells (written answers, or code graded by hand) and graded markdown cells."""
    with _gradebook(db) as gb:
        a = gb.find_assignment(assignment)
        out = set()
        for nb in a.notebooks:
            solutions = {sc.name for sc in nb.solution_cells}
            out |= {(nb.name, gc.name) for gc in nb.grade_cells if gc.name in solutions or gc.cell_type == "markdown"}
    return out


def mark(cells: list[dict], ids: set[tuple[str, str]]) -> list[dict]:
    """The course's cells with `manual: True` on the manually graded ones (in place; returns them)."""
    for c in cells:
        if (c["notebook"], c["cell"]) in ids:
            c["manual"] = True
    return cells


def _answered(graded_nb: Path, cell: str, original: str | None) -> bool:
    """False when the student left the answer as released (nbgrader's own rule: the checksum is unchanged)."""
    from nbformat.reader import reads
    from nbgrader.utils import compute_checksum

    try:
        data = graded_nb.read_bytes()
        if json_values(data) > MAX_JSON_VALUES:  # the student's bytes: take_graded refused them already
            return True
        nb = reads(data)  # nbformat's reader without its validation, which a rewritten notebook makes huge
        found = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == cell]
        return bool(found) and compute_checksum(found[0]) != original
    except Exception:  # an unreadable cell: a person looks at it rather than a silent zero
        return True


def seal(cells: list[dict], course_cells: list[dict], graded: dict[str, Path], structure: dict) -> list[str]:
    """Reset every manually graded cell to pending (in place), whatever the scratch gradebook says; returns
    flags for the instructor when it claimed points for one (only a submission's code writes those).

    `graded`: notebook id -> the autograded notebook; `structure`: report.structure of the master gradebook
    (its source-cell checksums tell an untouched answer, which scores 0 and needs no grading)."""
    ids = {(c["notebook"], c["cell"]) for c in course_cells if c.get("manual")}
    flags = []
    for c in cells:
        if (c["notebook"], c["cell"]) not in ids:
            continue
        if c.get("score"):
            flags.append(f"{c['cell']}: the scratch gradebook claimed {c['score']:g} points for a written answer "
                         "nobody graded yet (written by the submission's code?); ignored")
        original = {name: ck for name, ck, _ in structure.get(c["notebook"], ([], []))[1]}.get(c["cell"])
        path = graded.get(c["notebook"])
        answered = path is not None and _answered(path, c["cell"], original)
        c.update(score=0.0, manual=True, needs_manual=answered, source="pending" if answered else "unanswered")
    return flags


def pending_points(res) -> float:
    """Points of `res`'s written answers that still need an instructor's grade."""
    return round(sum(c["max_score"] for c in res.cells if c.get("manual") and c.get("needs_manual")), 4)


def manual_points(res) -> float:
    """Points an instructor gave `res`'s written answers."""
    return round(sum(c["score"] for c in res.cells if c.get("manual") and c.get("source") == SOURCE), 4)


def cell_note(c: dict) -> str:
    """How a cell's score reads in feedback and summaries ('' for an ordinary cell)."""
    if not c.get("manual"):
        return ""
    if c.get("needs_manual"):
        return f"needs manual grading (a written answer worth {c['max_score']:g} points)"
    if c.get("source") == SOURCE:
        return f"{c['score']:g} of {c['max_score']:g}, graded by an instructor"
    return f"0 of {c['max_score']:g} (left unanswered)"


def settle_page(page: str, res, row: dict) -> str:
    """A feedback page written while answers were pending, brought up to date with the instructor's scores
    (`row`: the student's final row): their cells read as graded, and the provisional note goes once none is
    pending. Only the grader's summary box is rewritten (found by position, right after <body>, as
    report.feedback_page puts it): the student's own notebook below may quote either line, and stays as written."""
    m = re.search(r"<body[^>]*>", page)
    start = m.end() if m else 0
    if not page.startswith("<div id='labkit-grade-summary'", start):
        return page
    end = page.index("</div>", start) + len("</div>")  # the box holds no other div: all its text is escaped
    box = page[start:end]
    given = row.get("manual_scores") or {}
    for c in res.cells:
        if c.get("manual") and c["cell"] in given:
            box = box.replace(f"{c['cell']}: {cell_note(dict(c, needs_manual=True))}",
                              f"{c['cell']}: {cell_note(dict(c, needs_manual=False, source=SOURCE, score=given[c['cell']]))}")
    if not row.get("provisional"):
        box = re.sub(r"<p><b>Provisional:</b>.*?</p>", "", box, flags=re.S)
    return page[:start] + box + page[end:]


# ------------------------------------------------------------------------------------------------ scores in


def read_csv(path: str | Path) -> dict[tuple[str, str], float]:
    """{(student_id, cell): points} from a CSV with columns student_id, cell, score; LabkitError on bad input."""
    p = Path(path)
    try:
        with p.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            cols = set(reader.fieldnames or [])
            rows = list(reader)
    except OSError as e:
        raise LabkitError(f"cannot read the manual scores {p}: {e.strerror or e}") from e
    if not {"student_id", "cell", "score"} <= cols:
        raise LabkitError(f"{p} needs the columns student_id, cell, score (has {', '.join(sorted(cols)) or 'none'})")
    out, line_of = {}, {}
    for i, r in enumerate(rows, 2):
        sid, cell, score = ((r.get(k) or "").strip() for k in ("student_id", "cell", "score"))
        if not sid or not cell:
            raise LabkitError(f"{p} line {i}: student_id and cell must not be empty")
        if score == "":
            continue  # not graded yet
        if (sid, cell) in line_of:  # which of two grades counts must not depend on their order in the file
            raise LabkitError(f"{p} line {i}: {sid}/{cell} is scored twice (line {line_of[(sid, cell)]} too); "
                              "keep one row per answer")
        line_of[(sid, cell)] = i
        try:
            out[(sid, cell)] = float(score)
        except ValueError:
            raise LabkitError(f"{p} line {i}: score {score!r} is not a number") from None
    return out


def check_csv(scores: dict[tuple[str, str], float], cells: list[dict], path: str | Path) -> None:
    """LabkitError unless every CSV score names a written answer and lies in 0..its points."""
    points = {c["cell"]: c["max_score"] for c in cells if c.get("manual")}
    for (sid, cell), v in scores.items():
        if cell not in points:
            raise LabkitError(f"{path}: {cell!r} ({sid}) is not a manually graded cell of this assignment "
                              f"(those are: {', '.join(sorted(points)) or 'none'})")
        if not 0 <= v <= points[cell]:
            raise LabkitError(f"{path}: {sid}/{cell} scored {v:g}, outside 0..{points[cell]:g}")


def read_gradebook(db: Path, assignment: str, cells: list[dict]) -> dict[tuple[str, str], float]:
    """{(student_id, cell): points} an instructor gave written answers in `db` (formgrader's manual scores)."""
    ids = {(c["notebook"], c["cell"]) for c in cells if c.get("manual")}
    if not ids or not db.is_file():
        return {}
    out = {}
    with warnings.catch_warnings(), _gradebook(db) as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy's autoflush chatter from inside nbgrader's API
        try:
            subs = gb.find_assignment(assignment).submissions
        except Exception:  # a gradebook of another assignment, or an empty one: nothing graded there
            return {}
        for sub in subs:
            for nb in sub.notebooks:
                for g in nb.grades:
                    if (nb.name, g.name) in ids and g.manual_score is not None:
                        out[(sub.student.id, g.name)] = float(g.manual_score)
    return out


def collect(out: Path, assignment: str, cells: list[dict], csv_path: str | Path | None) -> dict:
    """The instructor's scores: the output folder's gradebook (formgrader), then the CSV over it."""
    scores = read_gradebook(out / "gradebook.db", assignment, cells)
    if csv_path:
        extra = read_csv(csv_path)
        check_csv(extra, cells, csv_path)
        scores.update(extra)
    return scores


def apply(results: list, scores: dict[tuple[str, str], float], known: set[str] | None = None) -> list:
    """Copies of `results` with the instructor's scores in their written answers and totals (the done-markers
    themselves stay as graded: a score given by a person is not the grader's measurement). A score is held to
    0..its cell's points; scores for ids no result has are named in a warning (a typo changes nothing else).
    `known`: every id of the class where `results` are one slice of it, so that the warning names only ids no
    slice has (the typos), not the other slices' students, whose scores their own slice and the merge apply."""
    stray = sorted({sid for sid, _ in scores} - {r.student_id for r in results} - (known or set()))
    if stray:
        logging.getLogger("autograder").warning(
            "manual scores for %d id(s) no student of this %s has (a typo?): %s",
            len(stray), "class" if known else "run", ", ".join(stray[:20]))
    out = []
    for r in results:
        mine = {cell: v for (sid, cell), v in scores.items() if sid == r.student_id}
        if r.status != "graded" or not any(c.get("manual") for c in r.cells):
            out.append(r)
            continue
        r = copy.copy(r)
        r.cells = [dict(c) for c in r.cells]
        for c in r.cells:
            if c.get("manual") and c["cell"] in mine:
                c.update(score=min(max(mine[c["cell"]], 0.0), c["max_score"]), needs_manual=False, source=SOURCE)
        r.score = round(sum(c["score"] for c in r.cells), 4)
        pending = pending_points(r)
        r.message = f"{r.score:g} / {r.max_score:g} points" + (
            f" (provisional: {pending:g} points of written answers need manual grading)" if pending else "")
        out.append(r)
    return out

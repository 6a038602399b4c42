"""Strings a student controls reach people escaped, in every output: terminal, summary.txt, grade_log.txt,
grades.csv, the Canvas and Gradescope exports and the HTML feedback (autograder.base.shown).

The attack: an LMS-named hand-in whose student part holds ANSI escapes and newlines (a clear-screen, forged
"nothing flagged" and "14 of 14 graded" lines, then hidden text), a bidi override, and code whose error message
carries the same, beside a formula for the spreadsheet. A toy class with it and an honest classmate is graded for
real and exported; then every output file is read back and must hold no control character a student wrote, and
no CSV cell may start a formula. The honest student's grades and names read exactly as before.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import grade, rehearsal
from autograder.base import shown
from autograder.gradebook import report, summary
from autograder.intake import submissions as intake
from autograder.lms import exports as lms

AID = rehearsal.TOY_ID
# ESC (clear screen, home, hide), newlines that forge lines, a carriage return, a bidi override and isolate,
# a line separator, a backspace and a C1 CSI: none may reach a person raw
EVIL = ("\x1b[2J\x1b[H\nnothing flagged\n14 of 14 graded\r\u202eHIDDEN\u2066\u2028\x08\x9b31m\x1b[8m")
RAW = set("\x1b\n\r\u202e\u2066\u2028\x08\x9b")
FORMULA = "=HYPERLINK(\"http://evil.example\",\"click\")"


# ------------------------------------------------------------------------------------------------ the function


@pytest.mark.parametrize("s", [EVIL, "a\tb", "x\u200fy\u202dz", "\x00\x7f", "ok \U000e0041 tag"])
def test_line_escapes_every_control_and_keeps_it_visible(s):
    out = shown.line(s)
    assert out.isprintable(), ascii(out)
    assert shown.block(s).replace("\n", "").isprintable()
    assert "\\x1b" in shown.line(EVIL) and "\\u202e" in shown.line(EVIL) and "\\n" in shown.line(EVIL)


@pytest.mark.parametrize("honest", ["jane_doe", "Zoë Müller-Łukasz", "lab1.ipynb", "3.2x faster; 12 of 14",
                                    "C:\\Users\\amy\\lab.ipynb", "李雷", ""])
def test_honest_text_is_unchanged(honest):
    assert shown.line(honest) == honest and shown.name(honest) == honest and shown.csv_cell(honest) == honest
    assert shown.html(honest) == __import__("html").escape(honest)


@pytest.mark.parametrize("cell", ["=1+1", "+SUM(A1)", "-2+3", "@cmd", "\t=1", "\r=1", "  =1", FORMULA])
def test_a_csv_cell_never_starts_a_formula(cell):
    got = shown.csv_cell(cell)
    assert got.startswith("'") and got.isprintable(), got


@pytest.mark.parametrize("number", ["-2", "+1.5", "-0.25", "3"])
def test_numbers_stay_numbers_in_csv(number):
    assert shown.csv_cell(number) == number and shown.csv_cell(-2.0) == -2.0 and shown.csv_cell(None) is None


def test_intake_shown_is_the_one_function():
    assert intake.shown is shown.name and intake.shown("a\nb") == repr("a\nb")


def test_the_log_formatter_escapes_messages_and_tracebacks():
    h_out = io.StringIO()
    h = logging.StreamHandler(h_out)
    h.setFormatter(shown.LogFormatter("%(levelname)s %(message)s"))
    lg = logging.getLogger("labkit-test-escaping")
    lg.addHandler(h)
    lg.propagate = False
    try:
        lg.warning("%s: graded", EVIL)
        try:
            raise ValueError(EVIL)
        except ValueError:
            lg.exception("student %s", "amy")
    finally:
        lg.removeHandler(h)
    text = h_out.getvalue()
    assert not RAW - {"\n"} & set(text), ascii(text)
    assert text.splitlines()[0].startswith("WARNING \\x1b[2J") and len(text.splitlines()[0]) > 40
    assert not any(ln.startswith(("nothing flagged", "14 of 14")) for ln in text.splitlines())


# ------------------------------------------------------------------------------------------------ every output


def _raw_in(text: str) -> set[str]:
    return RAW & set(text)


def _csv_cells(path: Path) -> list[str]:
    return [c for row in csv.reader(path.open(newline="", encoding="utf-8")) for c in row]


def _hand_in(body: str) -> str:
    nb = rehearsal.toy_notebook()
    nb.cells[1].source = "%%writefile pipeline.py\n" + body
    return nbformat.writes(nb)


@pytest.fixture(scope="module")
def hostile_class(tmp_path_factory):
    """A toy class graded for real from LMS-named zips: 'mallory' (student part of the name: EVIL; her code fails
    with EVIL and a formula as its message) and honest 'jane_doe'; then exported to Canvas, Gradescope and
    feedback bundles."""
    base = tmp_path_factory.mktemp("escaping")
    rehearsal.build_toy_course(base / "course")
    subs = base / "subs"
    subs.mkdir()
    bad = f"raise ValueError({FORMULA + EVIL!r})\n"
    for name, body in ((f"mallory_{EVIL}.zip", bad), (f"jane_doe_{AID}_handin.zip", None)):
        with zipfile.ZipFile(subs / name, "w") as z:
            z.writestr(f"{AID}{EVIL}.ipynb" if body else f"{AID}.ipynb",
                       _hand_in(body) if body else nbformat.writes(rehearsal.toy_notebook()))
    (subs / f"notes{EVIL}.txt").write_text("not a hand-in")  # skipped input, named in the summary
    roster = base / "roster.csv"
    roster.write_text("student_id\nmallory\njane_doe\n")
    cfg = grade.GradeConfig(course=str(base / "course"), out=str(base / "out"), work=str(base / "work"),
                            cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=1,
                            harness_module="autograder.rehearsal", progress=False, roster=str(roster))
    rep = grade.grade_class(AID, subs, cfg)
    for to in ("canvas", "gradescope", "feedback"):
        lms.export(base / "out", to, base / "lms" / to, submissions=subs)
    return {"rep": rep, "base": base, "out": base / "out"}


def test_the_attack_reaches_the_outputs_and_is_shown_escaped(hostile_class):
    by = {r.student_id: r for r in hostile_class["rep"].results}
    assert set(by) == {"mallory", "jane_doe"}, by
    base, out = hostile_class["base"], hostile_class["out"]
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    reached = {f.name for f in [out / "summary.txt", out / "grade_log.txt", *(out / "feedback").rglob("*.html"),
                                *(base / "lms").rglob("*.json"), *(base / "lms").rglob("*.html")]
               if "nothing flagged" in f.read_text(encoding="utf-8")}
    # the student's words got in (a file name, the error her code raised): it is the outputs' job to escape them
    assert {"summary.txt", "grade_log.txt"} <= reached and any(n.endswith(".html") for n in reached), reached
    assert not _raw_in(summary.replace("\n", "")), ascii(summary)
    lines = summary.splitlines()
    assert not any(ln.lstrip().startswith(("nothing flagged", "14 of 14 graded")) for ln in lines), summary


def test_no_output_file_holds_a_raw_control_character(hostile_class):
    base, out = hostile_class["base"], hostile_class["out"]
    files = [out / "summary.txt", out / "grade_log.txt", out / "grades.csv",
             base / "lms" / "canvas" / "canvas_grades.csv",
             *sorted((out / "feedback").rglob("*.html")), *sorted((base / "lms" / "feedback").rglob("*.html"))]
    assert len(files) >= 6 and all(f.exists() for f in files), files
    for f in files:
        text = f.read_text(encoding="utf-8")
        got = _raw_in(text.replace("\n", "").replace("\r\n", ""))
        assert not got, (f, ascii(sorted(got)))
    for f in sorted((base / "lms" / "gradescope").rglob("results.json")):
        d = json.loads(f.read_text())
        texts = [d["output"], *(t["output"] for t in d["tests"])]
        assert not any(_raw_in(t.replace("\n", "")) for t in texts), (f, texts)
        assert not any(ln.startswith(("nothing flagged", "14 of 14")) for t in texts for ln in t.splitlines())
    log = (out / "grade_log.txt").read_text(encoding="utf-8")
    assert not any(ln.startswith(("nothing flagged", "14 of 14")) for ln in log.splitlines())


def test_no_csv_cell_starts_a_formula(hostile_class):
    base, out = hostile_class["base"], hostile_class["out"]
    for f in (out / "grades.csv", base / "lms" / "canvas" / "canvas_grades.csv"):
        for c in _csv_cells(f):
            assert not c.lstrip(" ").startswith(shown.FORMULA_PREFIXES) or shown._number(c), (f, c)
            assert "\n" not in c and "\r" not in c, (f, c)


def test_the_honest_classmate_is_graded_and_reads_as_before(hostile_class):
    by = {r.student_id: r for r in hostile_class["rep"].results}
    jane = by["jane_doe"]
    assert jane.status == "graded" and jane.score == jane.max_score, (jane.message, jane.cells)
    rows = {r["student_id"]: r for r in csv.DictReader((hostile_class["out"] / "grades.csv").open())}
    assert rows["jane_doe"]["score"] == f"{jane.max_score:g}" and rows["jane_doe"]["status"] == "graded"
    assert "jane_doe" in (hostile_class["out"] / "summary.txt").read_text()


def test_results_a_student_could_word_are_escaped_in_every_writer(tmp_path):
    """Every writer fed the attack directly: message, notes, flags, a check's message and measurement."""
    res = grade.StudentResult(student_id="amy", assignment=AID, status="not graded", score=0.0, max_score=5.0,
                              cause="nbgrader error", message=FORMULA + EVIL, notes=[EVIL, "@" + EVIL],
                              flags=["-" + EVIL], checks=[{"check": "toy.speed", "passed": False, "message": EVIL,
                                                           "measurements": {"said": EVIL}}],
                              cells=[], hardware={"class": "cpu", "card": "cpu"})
    text = summary.text(type("C", (), {"assignment": AID, "max_score": 5.0})(), [res], [], junk=[EVIL],
                        hardware=[{"card": "cpu", "class": "cpu"}])
    assert not _raw_in(text.replace("\n", "")) and len(text.splitlines()) < 16, text
    page = report.feedback_page(res, None).decode()
    assert not _raw_in(page) and "\\u202e" in page
    path = tmp_path / "grades.csv"
    report.write_csv(path, type("C", (), {"cells": []})(), [res], [])
    cells = _csv_cells(path)
    assert all(not c.startswith(shown.FORMULA_PREFIXES) for c in cells) and not _raw_in("".join(cells)), cells
    gs = lms.gradescope_results(res, {"late_note": EVIL, "late_penalty": 1.0}, [])
    texts = [gs["output"], *(t["output"] for t in gs["tests"])]
    assert not any(_raw_in(t.replace("\n", "")) for t in texts), texts
    assert not any(ln.startswith(("nothing flagged", "14 of 14")) for t in texts for ln in t.splitlines()), texts


def test_the_copy_as_handed_in_keeps_text_outputs_and_drops_markup_that_runs(tmp_path):
    """The marker opens students/<id>/as_handed_in/: a hand-in's HTML, JavaScript and SVG outputs and its
    markdown never reach it as markup, only its text outputs and its source as written."""
    from autograder.gradebook import feedback

    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("print('mine')")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="mine: 52.0 ms\n"),
                    nbformat.v4.new_output("display_data", data={"text/html": "<script>steal()</script>",
                                                                 "application/javascript": "steal()",
                                                                 "image/svg+xml": "<svg onload='steal()'/>"})]
    nb.cells = [nbformat.v4.new_markdown_cell("<img src=x onerror='steal()'>"), code]
    handed = tmp_path / "submitted" / "eve" / AID
    handed.mkdir(parents=True)
    (handed / f"{AID}.ipynb").write_text(nbformat.writes(nb))
    log = feedback.show(tmp_path, AID, "eve", pages=False)
    copy = (tmp_path / "formgrader" / feedback.HANDED_IN / f"{AID}.ipynb").read_text()
    assert "mine: 52.0 ms" in copy and "<script>" not in copy and "steal()</script>" not in copy, log
    mimes = {k for c in json.loads(copy)["cells"] for o in c.get("outputs", []) for k in o.get("data", {})}
    assert not mimes & {"text/html", "application/javascript", "image/svg+xml"}, mimes
    md = next(c for c in json.loads(copy)["cells"] if "onerror" in "".join(c["source"]))
    assert "".join(md["source"]).startswith("```") or md["cell_type"] == "code"  # shown as written, not as markup

"""What the grader shows of a graded notebook: the formgrader copy holds nothing that runs, and the rendering child
is stopped past its budget and started again (autograder/gradebook/feedback.py). The whole path, with a hand-in whose page
takes minutes to render, is in tests/test_hostile_scratch.py."""

from __future__ import annotations

import json

import nbformat
import pytest
from conftest import active_markup
from nbformat import v4

from autograder.gradebook import feedback

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def _hostile() -> nbformat.NotebookNode:
    answer = v4.new_markdown_cell("My answer <script>alert(1)</script> <img src=x onerror=alert(2)> "
                                  "[see](javascript:alert(3)) [r]\n\n[r]: javascript:alert(4)\n\n"
                                  r"$\href{javascript:alert(5)}{x}$")
    answer.metadata["nbgrader"] = {"grade": True, "solution": True, "locked": False, "points": 2,
                                   "grade_id": "lab1_written", "schema_version": 3, "comment": "<b onload=alert(6)>"}
    code = v4.new_code_cell("show()", execution_count=3)
    code.outputs = [
        v4.new_output("display_data", data={"text/plain": "<Figure>", "text/html": "<script>alert(7)</script>",
                                            "image/svg+xml": "<svg onload=alert(8)/>", "image/png": PNG,
                                            "application/javascript": "alert(9)"},
                      metadata={"image/png": {"width": '1" onerror="alert(10)'}}),
        v4.new_output("display_data", data={"image/jpeg": '"><img src=x onerror=alert(11)>'}),
        v4.new_output("stream", name='stdout"><script>alert(12)</script>', text="loss 0.5\n"),
        v4.new_output("execute_result", data={"text/latex": r"$\href{javascript:alert(13)}{y}$"}, execution_count=3),
    ]
    code.metadata["nbgrader"] = {"grade": False, "solution": True, "locked": False, "grade_id": "answer_code",
                                 "schema_version": 3}
    raw = v4.new_raw_cell("<script>alert(14)</script>")
    return v4.new_notebook(cells=[answer, code, raw], metadata={"title": "lab 1", "custom": "<script>alert(15)"})


def _formgrader_page(nb) -> str:
    from nbconvert import HTMLExporter
    from nbgrader.server_extensions.formgrader import handlers
    from traitlets.config import Config

    c = Config()  # what formgrader's extension configures (build_extra_config), with its own template
    c.HTMLExporter.template_name = "formgrade"
    c.HTMLExporter.extra_template_basedirs = [handlers.template_path]
    html, _ = HTMLExporter(config=c).from_notebook_node(
        nb, resources={"base_url": "", "index": 0, "total": 1, "notebook_id": "lab1", "mathjax_url": ""})
    return html[html.index("<body"):]


def test_the_formgrader_copy_shows_the_answers_as_written_and_runs_nothing():
    hostile = _hostile()
    assert len(active_markup(_formgrader_page(hostile))) >= 2  # what formgrader makes of the notebook as it is

    plain = nbformat.reads(feedback.plain_notebook(nbformat.writes(hostile).encode()), as_version=4)
    nbformat.validate(plain)
    page = _formgrader_page(plain)
    assert active_markup(page) == []
    assert "loss 0.5" in page and PNG in page
    answer, code, was_raw = plain.cells
    # Written answers are graded by a person from this copy: their text exactly as the student wrote it.
    assert answer.source == "```\n" + hostile.cells[0].source + "\n```" and "My answer &lt;script&gt;" in page
    assert answer.metadata.nbgrader == {"grade": True, "solution": True, "locked": False, "points": 2,
                                        "grade_id": "lab1_written", "schema_version": 3}
    assert code.metadata.nbgrader["grade_id"] == "answer_code" and code.execution_count == 3
    assert was_raw.cell_type == "markdown" and hostile.cells[2].source in was_raw.source
    shown = code.outputs[0]
    assert set(shown.data) == {"text/plain", "image/png"} and not shown.metadata
    assert "not shown by the grader: application/javascript, image/svg+xml, text/html" in shown.data["text/plain"]
    assert "image/jpeg" not in code.outputs[1].data and code.outputs[2].name == "stdout"
    assert set(code.outputs[3].data) == {"text/plain"}  # LaTeX, typeset by MathJax, is left out
    assert plain.metadata == {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                              "language_info": {"name": "python"}}


def test_a_notebook_shaped_to_cost_the_grader_is_refused_quickly():
    code_fence = v4.new_markdown_cell("```` four ````\n```python\nx = 1\n```")
    odd = {"cell_type": "code", "source": ["print(", 42, ")"], "outputs": [{"output_type": "stream", "text": [1]}]}
    nb = json.loads(nbformat.writes(v4.new_notebook(cells=[code_fence])))
    nb["cells"].append(odd)
    plain = json.loads(feedback.plain_notebook(json.dumps(nb).encode()))
    assert plain["cells"][0]["source"] == "`````\n" + code_fence.source + "\n`````"  # no fence inside closes it
    assert plain["cells"][1]["source"] == "print()" and plain["cells"][1]["outputs"][0]["text"] == ""
    nb["cells"][0]["source"] = "x \ud800 y"  # a lone surrogate: the page showing it could not be encoded
    nb["cells"][0]["metadata"] = {"nbgrader": {"points": float("nan"), "grade": True}}
    plain = json.loads(feedback.plain_notebook(json.dumps(nb).encode()))
    assert plain["cells"][0]["source"] == "```\nx ? y\n```"
    assert plain["cells"][0]["metadata"] == {"nbgrader": {"grade": True}}
    for bad in ({"nbformat": 99, "cells": []}, {"nbformat": 4, "cells": [{}] * (feedback.MAX_CELLS + 1)}, [1]):
        with pytest.raises(ValueError):
            feedback.plain_notebook(json.dumps(bad).encode())


def test_a_feedback_page_gets_no_output_metadata_attachments_or_active_math():
    nb = _hostile()
    nb.cells[0].attachments = {"a.png": {"image/png": '"><script>alert(16)</script>'}}
    nb.cells[0].source += " &#92;href{javascript:alert(17)}{x}"  # the page decodes the entity before MathJax
    nb.cells[1].metadata["tags"] = ["x navbar-fixed-top alert-success"]  # tags become the cell's CSS classes
    nb.cells[1].outputs[0].data["text/html"] = r"$\mmlToken{mi}[href='javascript:alert(18)']{x}$"
    safe = json.loads(feedback._page_safe(nbformat.writes(nb)))
    answer, code, raw = safe["cells"]
    assert r"\backslash href{javascript:alert(5)}" in answer["source"] and "attachments" not in answer
    assert r"\backslash href{javascript:alert(17)}" in answer["source"]
    assert code["outputs"][3]["data"]["text/latex"].startswith(r"$\backslash href")
    assert code["outputs"][0]["data"]["text/html"].startswith(r"$\backslash mmlToken")
    assert all(not o.get("metadata") for o in code["outputs"])  # an image's width went into its tag
    assert code["metadata"] == {"nbgrader": nb.cells[1].metadata.nbgrader} and raw["metadata"] == {}
    assert feedback.inert_tex(r"\hrefs \frac{a}{b}") == r"\hrefs \frac{a}{b}"  # other macros untouched
    with pytest.raises(ValueError):
        feedback._page_safe(json.dumps({"nbformat": 99, "cells": [{}]}))


def test_the_renderer_stops_a_page_past_its_time_and_serves_the_next(tmp_path):
    r = feedback.Renderer()
    try:
        pages, log, stopped = r.render(tmp_path, "lab", "amy", timeout_s=0.001)  # still importing nbgrader
        assert pages == {} and stopped == "rendering the feedback took longer than 0.001 s and was stopped"
        stopped = r.render(tmp_path, "lab", "amy", pages=False, timeout_s=0.001)[2]  # --no-feedback: copies only
        assert stopped == "rebuilding the notebooks kept for formgrader took longer than 0.001 s and was stopped"
        pages, log, stopped = r.render(tmp_path, "lab", "amy", timeout_s=120)  # a fresh child answers
        assert pages == {} and stopped is None and "nbgrader_config.py" in log  # its answer: no course here
    finally:
        r.stop()


def test_a_renderer_that_dies_is_reported_and_replaced(tmp_path):
    r = feedback.Renderer(memory_bytes=32 * 2**20)  # too little to import nbgrader: it exits
    try:
        assert r.render(tmp_path, "lab", "amy", timeout_s=120)[2] == "the feedback renderer died (out of memory?)"
        r.memory_bytes = feedback.RENDER_MEMORY_BYTES
        assert r.render(tmp_path, "lab", "amy", timeout_s=120)[2] is None
    finally:
        r.stop()


def test_bidi_controls_in_a_students_notebook_are_shown_as_escapes_on_the_page_and_in_formgrader():
    """A right-to-left override in a written answer, a code cell or an output would reorder what the instructor
    reads ("1 of 4" read as "4 of 1"; code shown other than it runs): each is shown as its escape."""
    import json

    from autograder.gradebook import feedback

    rlo = "\u202e"
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": f"score {rlo}4 of 1"},
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": f"x = 1  # {rlo}", "outputs": [
            {"output_type": "stream", "name": "stdout", "text": f"ok{rlo}"},
            {"output_type": "execute_result", "execution_count": 1, "metadata": {},
             "data": {"text/plain": f"{rlo}1"}}]}]}
    for text in (feedback._page_safe(json.dumps(nb)), feedback.plain_notebook(json.dumps(nb).encode()).decode()):
        shown = json.loads(text)
        flat = json.dumps(shown, ensure_ascii=False)
        assert rlo not in flat and "\\\\u202e" in flat, flat


def test_the_feedback_box_names_checks_not_graded_on_this_machine():
    """Lab 4's speed on a CPU-only grader scores 0 there: the box says it is not graded yet, not lost."""
    from autograder.grade import StudentResult
    from autograder.gradebook import report

    res = StudentResult("ana", "lab4_speedrun", "graded", score=8, max_score=16, hardware={"class": "cpu"},
                        checks=[{"check": "lab4.correctness", "passed": True, "fraction": 1.0, "message": "ok",
                                 "measurements": {"cosine": 1.0, "secret": "open-kit default (public)",
                                                  "sandbox": "bwrap", "baseline_interference": True}},
                                {"check": "lab4.speed", "passed": None, "fraction": 0.0,
                                 "message": "not gradable on this hardware (cpu): needs a CUDA GPU"}])
    box = report.summary_box(res)
    assert "Not graded yet:</b> lab4.speed could not be graded on this machine (cpu)" in box
    assert "lab4.correctness could not" not in box
    assert "cosine: 1.0" in box and "open-kit" not in box and "bwrap" not in box and "interference" not in box


def test_written_answers_graded_later_reach_the_page_in_the_slot_its_digest_leaves_out():
    """A manual-scores pass keeps the page the grader wrote: the person's scores and the new total go into the
    slot after the summary box (beside the late box), and the page without that slot is byte for byte the old."""
    from autograder.gradebook import report

    page = (b"<html><body><div id='labkit-grade-summary'><h2>lab: 12 / 14 points</h2></div>"
            b"<p>Written response (Score: 0.0 / 2.0)</p></body></html>")
    row = {"manual_scores": {"lab3_written_<b>": 1.5}, "pending_manual_points": 0, "total": 13.5, "max_score": 14}
    late = report.late_box({"score": 13.5, "extra_credit": 0, "late_penalty": 0, "submitted_at": "2025-03-01",
                            "due": "2025-03-02", "days_late": 0, "total": 13.5})
    new = report.with_late_box(page, report.after_grading_box(late, report.manual_box(row)))
    text = new.decode()
    assert "graded by a person" in text and "now 13.5 of 14 points (no longer provisional)" in text
    assert "lab3_written_&lt;b&gt;: 1.5 points" in text and "Late work" in text
    assert text.index("labkit-grade-summary") < text.index("Late work") < text.index("graded by a person")
    assert report.without_late_box(new) == page
    assert report.manual_box({"manual_scores": {}}) is None and report.after_grading_box(None, None) is None


def test_a_written_answer_waiting_for_a_person_is_not_shown_as_zero_in_nbgraders_page():
    """nbgrader prints its autograded 0 for a written answer ("Score: 0.0 / 2.0"), read as 2 points lost while a
    person has yet to grade it: the page labels it pending, in the table of contents and the cell's heading, and
    leaves graded cells, other cells and the student's own text as they were."""
    from types import SimpleNamespace

    from autograder.gradebook import report

    page = ('<html><body><h4>lab (Score: 10.0 / 16.0)</h4><ol><li><a href="#lab5_written">Written response</a> '
            '(Score: 0.0 / 2.0)</li><li><a href="#test_a">Test cell</a> (Score: 0.0 / 3.0)</li></ol>'
            '<p>my notes: Score: 0.0 / 2.0</p>'
            '<a name="comment-lab5_written"></a><a name="lab5_written"></a><div class="panel-heading"><span '
            'class="nbgrader-label">Student\'s answer</span><span class="pull-right">\n      Score: 0.0 / 2.0 '
            '<a href="#top">(Top)</a></span></div></body></html>')
    cells = [{"notebook": "lab", "cell": "lab5_written", "manual": True, "needs_manual": True, "score": 0,
              "max_score": 2}, {"notebook": "lab", "cell": "test_a", "score": 0, "max_score": 3}]
    res = SimpleNamespace(status="graded", cells=cells)
    out = report._pending_cell_scores(page, res)
    assert out.count("Score: pending (a person grades it) / 2.0") == 2
    assert "(Score: 0.0 / 3.0)" in out and "<p>my notes: Score: 0.0 / 2.0</p>" in out
    cells[0]["needs_manual"] = False  # graded by a person: nbgrader's page already carries the score
    assert report._pending_cell_scores(page, res) == page

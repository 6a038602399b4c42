"""Written answers: manually graded cells stay pending (the total provisional) until an instructor grades them.

A toy class with a written answer (autograder.rehearsal, `written=True`) is graded once: the reference (answered),
the untouched release (unanswered), and two students who grade their own answer (full manual scores written into
the gradebook from a cell; the answer cell turned into a passing test). Then the instructor's scores arrive, by
CSV and by formgrader (nbgrader's manual score in the output's gradebook.db), and the totals count them.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from autograder import grade, merge, rehearsal, suite
from autograder.gradebook import manual
from autograder.lms import exports as lms
from autograder.release.build import generate_release
from labkit.errors import LabkitError

REPO_ROOT = Path(__file__).resolve().parents[1]
AID = rehearsal.TOY_ID
WID = rehearsal.WRITTEN_ID
NAMES = ("reference", "release", "self_graded_gradebook", "self_graded_metadata", "script_in_answer")
LABS = ["lab1_loss_scaling", "lab2_data_pipeline", "lab3_profile_fix", "lab4_speedrun"]


def _cfg(base: Path, out: Path, **kw) -> grade.GradeConfig:
    return grade.GradeConfig(course=str(base / "course"), out=str(out), work=str(base / f"work-{out.name}"),
                             cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=2,
                             harness_module="autograder.rehearsal", progress=False, **kw)


@pytest.fixture(scope="module")
def written_class(tmp_path_factory):
    base = tmp_path_factory.mktemp("written")
    course = rehearsal.build_toy_course(base / "course", written=True)
    release = generate_release(course, AID, base / "release")
    builder = suite.SuiteBuilder(course / "source" / AID / f"{AID}.ipynb", release, AID, rehearsal.BODIES)
    variants = [v for v in builder.variants() if v.name in NAMES]
    assert sorted(v.name for v in variants) == sorted(NAMES)
    suite.write_submissions(variants, base / "subs")
    rep = grade.grade_class(AID, base / "subs", _cfg(base, base / "out"))
    return {"base": base, "builder": builder, "variants": variants, "report": rep,
            "by": {r.student_id: r for r in rep.results}}


def _cell(res, cell=WID) -> dict:
    return next(c for c in res.cells if c["cell"] == cell)


def _csv(path: Path) -> dict[str, dict]:
    return {r["student_id"]: r for r in csv.DictReader(path.open())}


def test_a_written_answer_is_pending_and_the_total_provisional(written_class, tmp_path):
    by, out = written_class["by"], written_class["base"] / "out"
    ref, blank = by["reference"], by["release"]
    assert _cell(ref)["needs_manual"] and _cell(ref)["score"] == 0 and ref.score == 5.0
    assert "provisional: 2 points of written answers need manual grading" in ref.message
    assert manual.pending_points(ref) == rehearsal.WRITTEN_POINTS and not ref.flags
    # left as released: 0 points, nothing for a person to grade (nbgrader's own rule)
    assert not _cell(blank)["needs_manual"] and manual.pending_points(blank) == 0

    rows = _csv(out / "grades.csv")
    assert rows["reference"][WID] == "pending" and rows["reference"]["pending_manual_points"] == "2"
    assert rows["reference"]["provisional"] == "yes" and rows["reference"]["total"] == "5"
    assert rows["release"]["provisional"] == "no" and rows["release"][WID] == "0"
    assert "NEEDS MANUAL GRADING" in (out / "summary.txt").read_text()
    page = (out / "feedback" / "reference" / AID / f"{AID}.html").read_text()
    assert "needs manual grading" in page and "Provisional:" in page
    final = {r["student_id"]: r for r in json.loads((out / "final.json").read_text())["students"]}
    assert final["reference"]["provisional"] and final["reference"]["pending_manual_points"] == 2

    from nbgrader.api import Gradebook  # formgrader's view: the answer waits for a person

    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gb:
        g = gb.find_grade(WID, AID, AID, "reference")
        assert g.needs_manual_grade and g.auto_score is None and g.manual_score is None

    lines = lms.export(out, "canvas", tmp_path / "canvas")
    assert any("PROVISIONAL" in ln and "reference" in ln for ln in lines)
    lms.export(out, "gradescope", tmp_path / "gs")
    gs = json.loads((tmp_path / "gs" / "reference" / "results.json").read_text())
    assert "provisional total" in gs["output"] and gs["extra_data"]["provisional"]
    assert "needs manual grading" in next(t for t in gs["tests"] if t["name"] == WID)["output"]
    lms.export(out, "feedback", tmp_path / "fb")
    assert "provisional total" in next((tmp_path / "fb" / "reference").glob("*feedback.html")).read_text()


@pytest.mark.parametrize("name", ["self_graded_gradebook", "self_graded_metadata"])
def test_a_student_cannot_grade_their_own_written_answer(written_class, name):
    v = next(x for x in written_class["variants"] if x.name == name)
    r = written_class["by"][name]
    assert suite.check(v, r, r.cells, written_class["builder"].speed_cells) == []
    assert _cell(r)["score"] == 0 and _cell(r)["needs_manual"] and r.score == 5.0
    row = _csv(written_class["base"] / "out" / "grades.csv")[name]
    assert row["provisional"] == "yes" and row["total"] == "5"
    if name == "self_graded_gradebook":
        assert any("claimed" in f and WID in f for f in r.flags), r.flags
        # nor does nbgrader's own page under the summary show the scores it wrote
        page = (written_class["base"] / "out" / "feedback" / name / AID / f"{AID}.html").read_text()
        assert "100.0 /" not in page and "5.0 / 7.0" in page


def test_instructor_scores_from_csv_and_formgrader_count_in_the_total(written_class, tmp_path):
    from nbgrader.api import Gradebook

    base = written_class["base"]
    out = tmp_path / "out"
    shutil.copytree(base / "out", out)  # the class as graded; the fixture's folder stays pending
    # formgrader writes nbgrader's manual score into the output's gradebook: the next run reads it back
    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gb:
        gb.find_grade(WID, AID, AID, "self_graded_metadata").manual_score = 0.5
        gb.find_grade(WID, AID, AID, "reference").manual_score = 0.25  # the CSV below wins over it
        gb.db.commit()
    scores = tmp_path / "scores.csv"
    scores.write_text(f"student_id,cell,score\nreference,{WID},1.5\nself_graded_gradebook,{WID},\n")
    rep = grade.grade_class(AID, base / "subs", _cfg(base, out, manual_scores=str(scores)))
    assert rep.graded_now == 0  # nobody regraded: a person's score is not a measurement
    rows = _csv(out / "grades.csv")
    assert rows["reference"]["total"] == "6.5" and rows["reference"]["provisional"] == "no"
    assert rows["reference"]["manual_points"] == "1.5" and rows["reference"][WID] == "1.5"
    assert rows["self_graded_metadata"]["total"] == "5.5" and rows["self_graded_metadata"]["provisional"] == "no"
    assert rows["self_graded_gradebook"]["provisional"] == "yes"  # an empty score: not graded yet
    assert "self_graded_gradebook" in (out / "summary.txt").read_text().split("NEEDS MANUAL GRADING")[1]
    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gb:  # kept there for the next run, as formgrader's
        assert gb.find_grade(WID, AID, AID, "reference").manual_score == 1.5
        assert not gb.find_grade(WID, AID, AID, "reference").needs_manual_grade
    # a merge reads the same scores (here: the fixture's pending class, merged with the CSV)
    merged = merge.merge([base / "out"], tmp_path / "merged", manual_scores=str(scores), progress=False)
    assert {r.student_id: r.score for r in merged.results}["reference"] == 6.5
    assert _csv(tmp_path / "merged" / "grades.csv")["self_graded_metadata"]["provisional"] == "yes"
    lms.export(out, "gradescope", tmp_path / "gs")
    gs = json.loads((tmp_path / "gs" / "reference" / "results.json").read_text())
    assert gs["score"] == 6.5 and next(t for t in gs["tests"] if t["name"] == WID)["score"] == 1.5
    lms.export(out, "feedback", tmp_path / "fb")
    page = next((tmp_path / "fb" / "reference").glob("*feedback.html")).read_text()
    assert "written answers, graded by an instructor: 1.5" in page and "total 6.5 points" in page
    assert f"{WID}: 1.5 of 2, graded by an instructor" in page and "Provisional" not in page


def test_a_bad_manual_scores_csv_is_one_clear_line(tmp_path):
    cells = [{"notebook": AID, "cell": WID, "max_score": 2.0, "manual": True},
             {"notebook": AID, "cell": "test_speed", "max_score": 3.0}]
    p = tmp_path / "s.csv"
    for text, msg in [("student_id,score\nalice,1\n", "needs the columns"),
                      (f"student_id,cell,score\nalice,{WID},two\n", "not a number"),
                      ("student_id,cell,score\nalice,test_speed,3\n", "not a manually graded cell"),
                      (f"student_id,cell,score\nalice,{WID},2.5\n", "outside 0..2")]:
        p.write_text(text)
        with pytest.raises(LabkitError, match=msg):
            manual.check_csv(manual.read_csv(p), cells, p)
    with pytest.raises(LabkitError, match="cannot read"):
        manual.read_csv(tmp_path / "missing.csv")


def _released(nb):
    """What `nbgrader generate_assignment` leaves of a notebook's solution regions (the course's stubs)."""
    from nbgrader.preprocessors import ClearMarkScheme, ClearSolutions
    from traitlets.config import Config

    cfg = Config()
    cfg.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
    cfg.ClearSolutions.text_stub = "YOUR ANSWER HERE"
    nb, res = ClearSolutions(config=cfg).preprocess(nb, {})
    return ClearMarkScheme(config=cfg).preprocess(nb, res)[0]


@pytest.mark.parametrize("lab", LABS)
def test_each_lab_has_a_rubric_graded_written_answer_the_release_leaves_out(lab):
    nb = nbformat.read(REPO_ROOT / "assignments" / "source" / lab / f"{lab}.ipynb", as_version=4)
    written = [c for c in nb.cells if c.cell_type == "markdown" and c.metadata.get("nbgrader", {}).get("grade")
               and c.metadata["nbgrader"].get("solution")]
    assert written, f"{lab}: no written answer"
    for c in written:
        assert c.metadata["nbgrader"]["points"] > 0 and not c.metadata["nbgrader"]["locked"]
        region = re.search(r"### BEGIN SOLUTION\n(.*)### END SOLUTION", c.source, flags=re.S)
        assert region and "**Model answer" in region.group(1) and "**Rubric" in region.group(1), c.source
    release = nbformat.writes(_released(nb))
    assert "Rubric" not in release and "Model answer" not in release
    assert release.count("YOUR ANSWER HERE") >= len(written)


def test_script_in_a_written_answer_or_an_output_never_runs_in_the_feedback_page(written_class):
    """Instructors open students' feedback pages to grade written answers: the student's markup is shown, its
    script is not kept (no <script>, no event handler, no javascript: link), and the answer is still pending."""
    r = written_class["by"]["script_in_answer"]
    assert r.score == 5.0 and _cell(r)["needs_manual"]
    page = (written_class["base"] / "out" / "feedback" / "script_in_answer" / AID / f"{AID}.html").read_text()
    assert "Because the loader was the bottleneck." in page and "my answer" in page
    body = page.split("<body", 1)[1]  # the code cell's source shows the markup as escaped text: harmless
    assert not re.search(r"<script[^>]*>[^<]*labkit-pwned", body)  # no script tag, no JavaScript output
    assert not re.search(r"<[a-z]+[^>]*\bon[a-z]+\s*=", body, re.I)  # no event handler on any tag
    assert not re.search(r"<a[^>]*href\s*=\s*[\"']?\s*javascript:", body, re.I)


def test_lab2s_question_asks_for_runs_that_measure_each_change_alone():
    """Two changes (packed storage, batched augmentation) need runs that differ in one of them at a time: the cell
    below the question times the baseline with and without augmentation and the student's loader both ways."""
    nb = nbformat.read(REPO_ROOT / "assignments" / "source" / "lab2_data_pipeline" / "lab2_data_pipeline.ipynb",
                       as_version=4)
    i = next(k for k, c in enumerate(nb.cells)
             if c.metadata.get("nbgrader", {}).get("grade_id") == "lab2_written_speed_question")
    question, measure, answer = nb.cells[i:i + 3]
    assert measure.cell_type == "code" and not measure.metadata.get("nbgrader")
    assert answer.metadata["nbgrader"]["grade_id"] == "lab2_written_speed"
    src = measure.source
    assert "PILFileDataset(paths, labels.tolist(), augment=False)" in src
    assert "augment=False)" in src.split("PILFileDataset", 1)[1] and "augment=True)" in src
    assert "bench.torch_threads(1)" in src
    # The old question compared augment=False and augment=True against an augmenting baseline: no longer asked.
    assert "with `augment=False` and with `augment=True` against the baseline" not in question.source
    assert "Change 1 alone" in question.source and "Change 2 alone" in question.source

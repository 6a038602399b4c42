"""A hand-in carries what it was made from, and an old release is graded on the cells it has.

Lab 3's handed-out slow_train.py carries a variant tag only the course secret makes; the hand-in cell puts the
tag, the release's version and the student's slow_train.py into the zip; the grader checks the tag against the
id it read, and a classmate's, the common or another course's variant is a clear verdict for a person. A hand-in
from an earlier release gets the cells it lacks from the course's notebook, not from nbgrader's insertion, and a
failed nbgrader run is reported by its real exception. File-level: no student code runs here.
"""

from __future__ import annotations

import json
import zipfile
from types import SimpleNamespace

import nbformat

from autograder import course, grade, rehearsal
from autograder.base import course_secret
from autograder.checks import lab3_variants
from autograder.intake import submissions as intake
from labkit import handin

COURSE = course_secret.Secret(b"a course secret for these tests", course_secret.COURSE_LABEL)
OTHER = course_secret.Secret(b"another course's secret, same kit", course_secret.COURSE_LABEL)
LAB3 = SimpleNamespace(calls=[SimpleNamespace(check="lab3.bottlenecks")])


def test_each_handout_carries_a_tag_only_the_secret_makes():
    alice = lab3_variants.handout("alice", COURSE)
    tag = lab3_variants.read_tag(alice)
    assert tag == lab3_variants.variant_tag("alice", COURSE) and len(tag) == 32
    assert alice.split("\n", 1)[1] == lab3_variants.render(lab3_variants.spec_for("alice", COURSE))
    assert lab3_variants.tag_verdict(tag, "alice", COURSE) is None
    assert lab3_variants.tag_verdict(tag, "bob", COURSE, ["alice", "bob"]) == ("another student's variant",
                                                                               "alice's variant")
    common = lab3_variants.read_tag(lab3_variants.handout(None, COURSE))
    assert lab3_variants.tag_verdict(common, "bob", COURSE)[1] == "the common variant"
    elsewhere = lab3_variants.read_tag(lab3_variants.handout("bob", OTHER))
    assert "never handed out" in lab3_variants.tag_verdict(elsewhere, "bob", COURSE, ["alice", "bob"])[0]
    assert lab3_variants.variant_tag("alice_b", COURSE) != lab3_variants.variant_tag("alice", COURSE)


def _lab3_folder(tmp_path, student: str | None, secret=COURSE):
    folder = tmp_path / "lab"
    folder.mkdir(exist_ok=True)
    (folder / "slow_train.py").write_text(lab3_variants.handout(student, secret))
    (folder / "student_fix.py").write_text("def bottlenecks():\n    return {}\n")
    nb = {"cells": [{"cell_type": "code", "source": "%%writefile student_fix.py\nx = 1\n", "metadata": {},
                     "outputs": [], "execution_count": None}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    return folder, nb


def test_the_hand_in_cell_puts_the_tag_release_and_slow_train_in_the_zip(tmp_path, monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    folder, nb = _lab3_folder(tmp_path, "sim_student1")
    out = handin.save("lab3_profile_fix", folder, notebook=nb)
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = json.loads(z.read(handin.RECORD))
        slow = z.read("slow_train.py").decode()
    assert {"lab3_profile_fix.ipynb", "student_fix.py", "slow_train.py", handin.RECORD} <= names
    assert record == {"lab": "lab3_profile_fix", "release": handin._release_version(),
                      "variant_tag": lab3_variants.variant_tag("sim_student1", COURSE)}
    assert lab3_variants.read_tag(slow) == record["variant_tag"]


def _sub(sid: str, files: dict) -> intake.Submission:
    return intake.Submission(sid, notebook="lab.ipynb", files={"lab.ipynb": b"{}", **files})


def test_the_grader_checks_the_tag_against_the_id_it_read():
    ids = ["sim", "sim_student1", "bob"]
    own = _sub("sim_student1", {"slow_train.py": lab3_variants.handout("sim_student1", COURSE).encode()})
    mixed = _sub("sim", {"slow_train.py": lab3_variants.handout("sim_student1", COURSE).encode()})
    common = _sub("bob", {"slow_train.py": lab3_variants.handout(None, COURSE).encode()})
    foreign = _sub("bob", {"slow_train.py": lab3_variants.handout("bob", OTHER).encode()})
    in_record = _sub("sim", {"handin.json": json.dumps({"variant_tag": lab3_variants.variant_tag("bob", COURSE)})
                             .encode()})
    untagged = _sub("bob", {"slow_train.py": lab3_variants.render(lab3_variants.spec_for("bob", COURSE)).encode()})
    subs = [own, mixed, common, foreign, in_record, untagged]
    grade.check_variants(subs, LAB3, COURSE, ids)
    assert own.problem is None and any("variant tag checked" in n for n in own.notes)
    for sub, whose in ((mixed, "sim_student1's variant"), (common, "the common variant"),
                       (foreign, "no variant of this course"), (in_record, "bob's variant")):
        assert sub.cause == "variant mismatch" and "waits for a person" in sub.problem, sub
        assert whose in sub.flags[0] and "sim_student1" not in sub.problem.replace(sub.student_id, "")
    assert untagged.problem is None and any("no lab 3 variant tag" in n for n in untagged.notes)
    kit = course_secret.Secret(course_secret.OPEN_KIT_KEY, course_secret.OPEN_KIT_LABEL)
    open_kit = _sub("bob", {"slow_train.py": lab3_variants.render(lab3_variants.spec_for("bob", kit)).encode()})
    grade.check_variants([open_kit], LAB3, kit, ids)  # the open kit's one untagged slow_train.py: nothing to note
    assert open_kit.problem is None and not open_kit.notes
    other_lab = _sub("sim", {"slow_train.py": lab3_variants.handout("bob", COURSE).encode()})
    grade.check_variants([other_lab], SimpleNamespace(calls=[SimpleNamespace(check="lab1.x")]), COURSE, ids)
    assert other_lab.problem is None and not other_lab.notes


def _ids(nb: bytes) -> list[str]:
    return [c["metadata"]["nbgrader"]["grade_id"] for c in json.loads(nb)["cells"] if "nbgrader" in c["metadata"]]


def test_missing_cells_come_from_the_course_notebook_even_adjacent_ones():
    now = rehearsal.toy_notebook(written=True)
    old = rehearsal.toy_notebook(written=False)
    old.cells = [c for c in old.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "test_speed"]
    old.cells[1].source = "%%writefile pipeline.py\nmine = 1\n"
    data, missing = course.fill_missing_cells(nbformat.writes(old).encode(), nbformat.writes(now).encode())
    assert missing == ["test_speed", rehearsal.WRITTEN_ID]  # adjacent: nbgrader's insertion raised KeyError here
    assert _ids(data) == _ids(nbformat.writes(now).encode())
    filled = nbformat.reads(data.decode(), as_version=4)
    nbformat.validate(filled)
    assert filled.cells[1].source.endswith("mine = 1\n")  # the student's own cells stay as they are
    same, none = course.fill_missing_cells(nbformat.writes(now).encode(), nbformat.writes(now).encode())
    assert none == [] and same == nbformat.writes(now).encode()
    assert course.fill_missing_cells(b"not json", nbformat.writes(now).encode()) == (b"not json", [])


def test_a_failed_nbgrader_run_is_reported_by_its_real_exception():
    out = ("[AutogradeApp | INFO] Overwriting cells\n[AutogradeApp | ERROR] There was an error processing "
           "assignment: /x/submitted/amy/lab\n[AutogradeApp | ERROR] Traceback (most recent call last):\n"
           '  File "/v/nbgrader/converters/base.py", line 398, in convert_notebooks\n    self.convert_single()\n'
           '  File "/v/nbgrader/preprocessors/overwritecells.py", line 129, in add_missing_grade_cells\n'
           "    idx = source_cell_ids.index(grade_cell_id)\nKeyError: 'written_answer'\n\n"
           "[AutogradeApp | ERROR] There was an error processing assignment 'lab' for student 'amy'\n"
           "[AutogradeApp | ERROR] Please see the the above traceback for details on the specific errors on the "
           "above failures.\nnbgrader.converters.base.NbGraderException: Please see the the above traceback for "
           "details on the specific errors on the above failures.\n")
    why = grade.nbgrader_failure(out)
    assert why.startswith("KeyError: 'written_answer'") and "add_missing_grade_cells" in why, why
    assert "above traceback" not in why
    assert grade.nbgrader_failure("") == "no output (see autograde.log)"


def test_lab_1_from_before_its_written_answer_gets_the_question_and_the_answer_back(tmp_path):
    """The issue's case: lab 1's written answer and the locked question before it, both missing."""
    from autograder.release.build import generate_release

    src = course.REPO_ROOT / "assignments"
    released = generate_release(src, "lab1_loss_scaling", tmp_path / "rel").read_bytes()
    old = json.loads(released)
    gone = ("lab1_written_scale_question", "lab1_written_scale")
    old["cells"] = [c for c in old["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") not in gone]
    data, missing = course.fill_missing_cells(json.dumps(old).encode(), released)
    assert missing == list(gone)
    assert _ids(data) == _ids(released)
    assert [c["id"] for c in json.loads(data)["cells"]] == list(dict.fromkeys(c["id"] for c in json.loads(data)["cells"]))


def test_gradescope_says_when_a_lab_3_hand_in_is_not_the_common_variant(tmp_path, monkeypatch):
    from autograder.lms import exports as lms

    monkeypatch.setenv(course_secret.ENV, COURSE.key.decode())
    sub = tmp_path / "submission"
    sub.mkdir()
    assert lms._gradescope_variant(sub) == ""
    (sub / "slow_train.py").write_text(lab3_variants.handout(None, COURSE))
    assert lms._gradescope_variant(sub) == ""
    (sub / "slow_train.py").write_text(lab3_variants.handout("alice", COURSE))
    assert "VARIANT MISMATCH" in lms._gradescope_variant(sub)


def test_a_change_anywhere_in_the_graders_code_regrades():
    """Results are kept while the grader's code is the same: its digest covers labkit's subpackages too (the fast
    start moved into labkit/faststart, where a change regraded nobody)."""
    from pathlib import Path

    root = Path(grade.__file__).resolve().parents[1]
    files = {p.relative_to(root).as_posix() for p in grade.grader_files(root)}
    assert {"labkit/faststart/tiered.py", "labkit/train.py", "autograder/student/runner.py",
            "autograder/grade.py"} <= files

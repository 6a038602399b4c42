"""Whose hand-in is it: each LMS's download names read by its own pattern, matched to the class list.

Honest students with ids holding '_', '-' and digits (jane_doe, sim_student1, bo-7, n07) get their own id from
every LMS's naming; names that fit no listed id, or several, or (without a class list) an id that may hold a
separator, are named with their candidates and never cut to a classmate's id. File-level: no student code runs.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder.intake import lmsnames
from autograder.intake import submissions as intake
from labkit.env import LabkitError

AID = "lab3_profile_fix"


def _nb(code: str = "x = 1") -> bytes:
    return nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])).encode()


def _zip(path: Path, who: str) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{AID}.ipynb", _nb(f"who = {who!r}"))


def _roster(tmp_path: Path, text: str = "student_id,name\nsim,Sim Po\nsim_student1,Sim Student\njane_doe,Jane Doe\n"
            "bo-7,Bo Seven\nn07,Nia Oh\n") -> Path:
    p = tmp_path / "roster.csv"
    p.write_text(text)
    return p


def _collect(subs: Path, tmp_path: Path, roster=None):
    got = intake.collect(subs, AID, scratch=tmp_path / "scratch", roster=roster)
    return {s.student_id: s for s in got.submissions}, got


def test_the_longest_listed_id_wins_underscores_and_all(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    _zip(subs / f"sim_student1_{AID}_handin.zip", "sim_student1")  # the student: read as "sim" before
    _zip(subs / f"sim_{AID}_handin.zip", "sim")
    _zip(subs / f"bo-7_{AID}_handin.zip", "bo-7")
    (subs / f"n07_{AID}.ipynb").write_bytes(_nb("who = 'n07'"))
    by, got = _collect(subs, tmp_path, _roster(tmp_path))
    assert set(by) == {"sim_student1", "sim", "bo-7", "n07"} and not got.unmatched, (by, got.junk)
    for sid, sub in by.items():
        assert f"who = {sid!r}".encode() in sub.files[sub.notebook]


def test_each_lms_naming_is_read_by_its_own_pattern(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    roster = _roster(tmp_path, "Student,ID,SIS User ID,SIS Login ID,Section\n    Points Possible,,,,\n"
                     "\"Doe, Jane\",101,9001,jane_doe,A\n\"Student, Sim\",102,9002,sim_student1,A\n"
                     "\"Seven, Bo\",103,9003,bo-7,A\n\"Po, Sim\",104,9004,sim,A\n\"Oh, Nia\",105,9005,n07,A\n")
    _zip(subs / f"doejane_101_5551_{AID}_handin.zip", "jane_doe")  # Canvas: the user id is the roster's ID
    _zip(subs / f"Sim Student_77_assignsubmission_file_{AID}_handin.zip", "sim_student1")  # Moodle: full name
    _zip(subs / f"Lab 3_bo-7_attempt_2025-03-04-23-15-02_{AID}_handin.zip", "bo-7")  # Blackboard: the username
    _zip(subs / f"1234-5678 - Nia Oh - Mar 4, 2025 1115 PM - {AID}_handin.zip", "n07")  # D2L: the full name
    gs = subs / "submission_424242"  # Gradescope's export: a folder per submission, named in its metadata
    gs.mkdir()
    (gs / f"{AID}.ipynb").write_bytes(_nb("who = 'sim'"))
    (subs / lmsnames.GRADESCOPE_META).write_text(
        "submission_424242:\n  :submitters:\n  - :name: Sim Po\n    :sid: sim\n    :email: sim@uni.edu\n"
        "  :created_at: 2025-03-04 23:15:02.000000000 +00:00\n")
    by, got = _collect(subs, tmp_path, roster)
    assert set(by) == {"jane_doe", "sim_student1", "bo-7", "n07", "sim"} and not got.unmatched, got.junk
    for sid, sub in by.items():
        assert f"who = {sid!r}".encode() in sub.files[sub.notebook], sid


@pytest.mark.parametrize("name, lms, sid", [
    ("janedoe_LATE_101_5551_lab_1_2_x.ipynb", "canvas", "jane_doe"),
    ("Jane Doe_77_assignsubmission_file_lab.ipynb", "moodle", "jane_doe"),
    ("lab3_profile_fix_jane_doe_attempt_2025-03-04-23-15-02_lab.ipynb", "blackboard", "jane_doe"),
    ("1-2 - Jane Doe - Mar 4, 2025 1115 PM - lab.ipynb", "d2l", "jane_doe"),
    ("jane_doe_lab3_profile_fix.ipynb", "plain", "jane_doe"),
    ("bo-7_lab3_profile_fix.ipynb", "plain", "bo-7"),
])
def test_ids_with_separators_and_digits_from_every_naming(tmp_path, name, lms, sid):
    roster = lmsnames.read_roster(_roster(tmp_path))
    got = lmsnames.read_name(name, AID, roster)
    assert (got.lms, got.student_id, got.problem) == (lms, sid, None)


def test_without_a_class_list_an_id_with_a_separator_is_ambiguous_never_cut(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    _zip(subs / f"sim_student1_{AID}_handin.zip", "sim_student1")
    _zip(subs / f"Lab 3_jane_doe_attempt_2025-03-04-23-15-02_{AID}_handin.zip", "jane_doe")
    _zip(subs / f"amy_{AID}_handin.zip", "amy")  # one cut only: amy
    by, got = _collect(subs, tmp_path)
    assert set(by) == {"amy"}, by
    text = "\n".join(got.unmatched)
    assert "'sim'" in text and "'sim_student1'" in text and "'doe'" in text and "'jane_doe'" in text
    assert text.count("--roster") == 2 and all(u.startswith("'") for u in got.unmatched)


def test_a_name_matching_no_listed_id_is_named_with_the_file(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    _zip(subs / f"zed_{AID}_handin.zip", "zed")
    _zip(subs / f"jane_doe_{AID}_handin.zip", "jane_doe")
    by, got = _collect(subs, tmp_path, _roster(tmp_path))
    assert set(by) == {"jane_doe"}
    assert got.unmatched == [f"'zed_{AID}_handin.zip': its name matches no id of the class list"]
    assert any(j.startswith("NOT GRADED: 'zed_") for j in got.junk)
    # two listed people of one folded name: several candidates, named
    two = lmsnames.read_roster(_roster(tmp_path, "student_id,name\njdoe1,Jane Doe\njdoe2,Jane Doe\n"))
    r = lmsnames.read_name("Jane Doe_7_assignsubmission_file_lab.ipynb", AID, two)
    assert r.student_id is None and "jdoe1, jdoe2" in r.problem


def test_a_folder_alice_dash_is_never_alices(tmp_path):
    """Issue 48: a folder `alice-` mapped to alice's id, so neither was graded."""
    subs = tmp_path / "subs"
    for who in ("alice", "alice-"):
        (subs / who).mkdir(parents=True)
        (subs / who / f"{AID}.ipynb").write_bytes(_nb(f"who = {who!r}"))
    by, got = _collect(subs, tmp_path)
    assert by["alice"].problem is None and b"'alice'" in by["alice"].files[f"{AID}.ipynb"]
    other = next(s for sid, s in by.items() if sid != "alice")
    assert other.problem is None and other.origin == "alice-" and other.student_id.startswith("alice_x")
    # with the class list, `alice-` is no listed id: named, not graded; alice is graded
    by, got = _collect(subs, tmp_path, _roster(tmp_path, "student_id\nalice\n"))
    assert set(by) == {"alice"} and by["alice"].problem is None
    assert got.unmatched == ["'alice-': its folder name matches no id of the class list"]


def test_a_class_list_that_cannot_be_used_stops_before_any_work(tmp_path):
    for text, why in [("name\nx\n", "no student_id column"), ("student_id\n\n", "names no student"),
                      ("student_id\na\na\n", "more than once"), ("student_id\nalice-\n", "ids must be")]:
        with pytest.raises(LabkitError, match=why):
            lmsnames.read_roster(_roster(tmp_path, text))
    with pytest.raises(LabkitError, match="cannot read the roster"):
        lmsnames.read_roster(tmp_path / "missing.csv")


def test_a_bundle_says_where_each_ungraded_check_can_be_graded():
    """A GPU check on a CPU grader waits for a GPU; a timing the busy machine made too noisy waits for a quiet
    machine, not a GPU (the bundle said "to be regraded on a GPU" for both). Student-controlled text stays escaped."""
    from types import SimpleNamespace

    from autograder.lms import exports as lms

    res = SimpleNamespace(score=6, max_score=14, cells=[], assignment="lab4_speedrun")
    box = lms._bundle_box(res, {"total": 6, "not_gradable_here": ["lab4.speed", "lab3.speed"],
                                "late_note": "<b>forged</b>"})
    assert "lab4.speed (to be regraded on a GPU)" in box and "lab3.speed (to be timed again on a quiet machine)" in box
    assert "<b>forged</b>" not in box

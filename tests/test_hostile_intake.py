"""The class-level machinery against hostile hand-ins: intake of zips and folders, the late policy's submission
times, done-markers moved between students before a merge or export, and similarity under trivial renames.

Each test builds the hand-in a student could really produce (an LMS-named file or zip, as intake and the late
policy read them) and shows what the grader makes of it. All of them are file-level and run in well under a
second: no student code runs here.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import re
import stat
import struct
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import grade, merge
from autograder.gradebook import classbook, similarity, summary
from autograder.intake import late
from autograder.intake import submissions as intake

sys.path.insert(0, str(Path(__file__).parent / "data"))
import similarity_class  # noqa: E402

AID = "lab"
REPO_ROOT = Path(__file__).resolve().parents[1]
UTC = dt.UTC
DUE = dt.datetime(2025, 3, 4, 23, 59, tzinfo=UTC)


def _nb(code: str = "x = 1") -> bytes:
    return nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])).encode()


def _zip(path: Path, entries: list[tuple[str | zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            z.writestr(name, data)
    return path


def _collect(subs: Path, tmp_path: Path) -> tuple[dict[str, intake.Submission], list[str]]:
    got = intake.collect(subs, AID, scratch=tmp_path / "scratch")
    return {s.student_id: s for s in got.submissions}, got.junk


# ------------------------------------------------------------------------------------------------ intake


@pytest.mark.parametrize("evil", ["../../outside.ipynb", "/tmp/labkit-abs-outside.ipynb", "lab/../../outside.py"])
def test_a_zip_entry_leaving_its_folder_fails_that_student_only(tmp_path, evil):
    subs = tmp_path / "subs"
    subs.mkdir()
    _zip(subs / "mal_handin.zip", [(f"{AID}.ipynb", _nb()), (evil, b"pwned")])
    (subs / f"amy_{AID}.ipynb").write_bytes(_nb())
    by, _ = _collect(subs, tmp_path)
    assert by["mal"].problem and "points outside the archive" in by["mal"].problem and not by["mal"].files
    assert by["amy"].notebook and not by["amy"].problem
    assert not list(tmp_path.rglob("outside*")) and not Path("/tmp/labkit-abs-outside.ipynb").exists()


def test_two_zip_entries_for_one_file_are_refused_not_silently_one_of_them(tmp_path):
    # The instructor's unzip shows one copy, the grader would have graded the other.
    subs = tmp_path / "subs"
    subs.mkdir()
    with pytest.warns(UserWarning, match="Duplicate name"):
        _zip(subs / "mal_handin.zip", [(f"{AID}.ipynb", _nb("print('for the instructor')")),
                                       (f"{AID}.ipynb", _nb("print('for the grader')"))])
    _zip(subs / "sam_handin.zip", [(f"{AID}.ipynb", _nb()), (f"sub/../{AID}.ipynb", _nb("y = 2"))])
    by, _ = _collect(subs, tmp_path)
    for sid in ("mal", "sam"):
        assert by[sid].cause == "bad archive" and "two entries unpack to 'lab.ipynb'" in by[sid].problem, by[sid]


def test_symlinks_in_a_hand_in_are_never_followed(tmp_path):
    # An instructor who unpacked the class with `unzip` gets the student's symlinks on disk; Python's zipfile
    # writes a zipped symlink as a small file holding its target's name.
    secret = tmp_path / "instructor"
    secret.mkdir()
    (secret / "key.txt").write_text("SECRET")
    subs = tmp_path / "subs"
    (subs / "mal").mkdir(parents=True)
    (subs / "mal" / f"{AID}.ipynb").write_bytes(_nb())
    os.symlink(secret / "key.txt", subs / "mal" / "key.txt")
    os.symlink(secret, subs / "mal" / "stolen")
    link = zipfile.ZipInfo("answers.txt")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    _zip(subs / "sym_handin.zip", [(f"{AID}.ipynb", _nb()), (link, str(secret / "key.txt").encode())])
    by, _ = _collect(subs, tmp_path)
    assert sorted(by["mal"].files) == [f"{AID}.ipynb"]
    assert by["sym"].files["answers.txt"] == str(secret / "key.txt").encode()
    assert not (tmp_path / "scratch" / "_unzipped" / "sym" / "sym_handin" / "answers.txt").is_symlink()
    assert all(b"SECRET" not in d for s in by.values() for d in s.files.values())


def test_too_many_or_too_deeply_nested_entries_are_one_clear_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(intake, "MAX_ARCHIVE_FILES", 50)
    subs = tmp_path / "subs"
    subs.mkdir()
    _zip(subs / "many_handin.zip", [(f"{AID}.ipynb", _nb())] + [(f"f{i}.txt", b"") for i in range(60)])
    _zip(subs / "deep_handin.zip", [(f"{AID}.ipynb", _nb()), ("d/" * 2100 + "x.txt", b"x")])
    # a bomb whose headers claim 100 bytes: unpacking stops at the claimed size and the CRC gives it away
    bomb = bytearray(_zip(tmp_path / "bomb.zip", [(f"{AID}.ipynb", b"\0" * 2**23)]).read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(bomb))) as z:
        assert z.infolist()[0].compress_type == zipfile.ZIP_DEFLATED
    struct.pack_into("<I", bomb, 22, 100)  # the local header's uncompressed size
    struct.pack_into("<I", bomb, bomb.find(b"PK\x01\x02") + 24, 100)  # the central directory's
    (subs / "boom_handin.zip").write_bytes(bytes(bomb))
    by, _ = _collect(subs, tmp_path)
    assert by["many"].cause == "bad archive" and "61 files (limit 50)" in by["many"].problem
    assert by["deep"].cause == "bad archive" and "not a readable zip archive" in by["deep"].problem
    assert by["boom"].cause == "bad archive" and "Bad CRC-32" in by["boom"].problem
    assert sum(f.stat().st_size for f in (tmp_path / "scratch").rglob("*") if f.is_file()) < 2**20


def test_a_file_name_cannot_forge_a_line_of_the_summary(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    forged = "x\namy                10 of 10  graded     .ipynb"  # no "/": that would make folders
    _zip(subs / "mal_handin.zip", [("a.ipynb", _nb()), (forged, _nb())])
    _zip(subs / "nat_handin.zip", [(f"{AID}/{AID}.ipynb", _nb()), ("notes\nbob  10 of 10  graded", b"")])
    by, _ = _collect(subs, tmp_path)
    assert "\n" not in by["mal"].problem and "'x\\namy" in by["mal"].problem, by["mal"].problem
    assert all("\n" not in n for n in by["nat"].notes) and any("'notes\\nbob" in n for n in by["nat"].notes)


def test_look_alike_names_do_not_become_another_student_or_the_lab(tmp_path):
    subs = tmp_path / "subs"
    for who in ("amy", "\u0430my"):  # Cyrillic a: a folder that looks like amy's
        (subs / who).mkdir(parents=True)
        (subs / who / f"{AID}.ipynb").write_bytes(_nb(f"who = {who!r}"))
    # a notebook whose name only looks like the lab's, beside the real one: the real one is graded
    (subs / "bea").mkdir()
    (subs / "bea" / f"{AID}.ipynb").write_bytes(_nb("real = 1"))
    (subs / "bea" / "l\u0430b.ipynb").write_bytes(_nb("decoy = 1"))
    by, _ = _collect(subs, tmp_path)
    assert b"'amy'" in by["amy"].files[f"{AID}.ipynb"]
    other = next(s for sid, s in by.items() if sid not in ("amy", "bea"))
    assert other.student_id != "amy" and any("graded as student id" in n for n in other.notes)
    assert by["bea"].notebook == f"{AID}.ipynb" and b"real = 1" in by["bea"].files[f"{AID}.ipynb"]


# ------------------------------------------------------------------------------------------------ late work


def test_a_time_in_the_students_own_file_name_does_not_date_the_hand_in(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    # Canvas names carry no time: the stamp is the student's own file name, after the LMS's prefix
    (subs / "mal_LATE_12345_678_lab 2025-03-01T10-00-00.ipynb").write_bytes(b"{}")
    (subs / "kim_12345_679_lab_20250301T100000.ipynb").write_bytes(b"{}")
    (subs / "Moe Ng_4242_assignsubmission_file_lab 2025-03-01T10-00-00.ipynb").write_bytes(b"{}")  # Moodle
    # D2L writes its stamp after the student's name; a Blackboard-looking stamp later in the name is the student's
    (subs / "11-1 - Di Lo - Mar 9, 2025 1115 PM - lab_attempt_2025-03-01-00-00-00.ipynb").write_bytes(b"{}")
    (subs / "lab_bb_attempt_2025-03-09-01-30-00_lab 2025-03-01T00-00-00.ipynb").write_bytes(b"{}")
    # A student's name, which some LMSs let them edit, comes before the LMS's stamp: Moodle's and D2L's
    assert late.time_from_name("Jo 2025-03-01T10-00-00 Li_77_assignsubmission_file_lab.ipynb") is None
    (subs / "12-2 - Jo 2025-03-01T10-00-00 Li - Mar 9, 2025 1115 PM - lab.ipynb").write_bytes(b"{}")
    got = late.submission_times(subs, assignment=AID)
    assert got["Jo_2025-03-01T10-00-00_Li"].at == dt.datetime(2025, 3, 9, 23, 15, tzinfo=UTC)
    assert got["mal"].at is None and got["mal"].lms_late and got["kim"].at is None and got["Moe_Ng"].at is None
    assert got["Di_Lo"].at == dt.datetime(2025, 3, 9, 23, 15, tzinfo=UTC)
    assert got["bb"].at == dt.datetime(2025, 3, 9, 1, 30, tzinfo=UTC)
    pol = late.LatePolicy(DUE)
    assert "LMS marked this hand-in late" in late.assess(pol, "mal", got["mal"], 10)["late_note"]
    assert late.assess(pol, "Di_Lo", got["Di_Lo"], 10)["days_late"] == 5


def test_dates_the_student_wrote_never_beat_or_hide_the_lmss_own_stamp(tmp_path):
    """The second round's late attacks: a D2L-looking date in the student's part of a Blackboard name (it beat
    the attempt stamp: two days late graded on time), a second one in a D2L name (it made the time unknown),
    and `_assignsubmission_file_` in the student's part (it turned every date off)."""
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "Lab 1_jane_doe_attempt_2025-03-06-23-00-00_lab Mar 1, 2025 1000 AM.ipynb").write_bytes(b"{}")
    (subs / "12-3 - Sam Li - Mar 6, 2025 1100 PM - lab Mar 1, 2025 1000 AM Mar 2, 2025 0900 AM.ipynb").write_bytes(
        b"{}")
    (subs / "Lab 1_bo-7_attempt_2025-03-06-23-00-00_x_1_assignsubmission_file_y.ipynb").write_bytes(b"{}")
    roster = tmp_path / "roster.csv"
    roster.write_text("student_id,name\njane_doe,Jane Doe\nsam_li,Sam Li\nbo-7,Bo\n")
    got = late.submission_times(subs, roster=str(roster), assignment=AID)
    two_days = dt.datetime(2025, 3, 6, 23, 0, tzinfo=UTC)
    assert got["jane_doe"].at == two_days and got["sam_li"].at == two_days and got["bo-7"].at == two_days, got
    pol = late.LatePolicy(DUE)
    assert all(late.assess(pol, s, got[s], 10)["days_late"] == 2 for s in ("jane_doe", "sam_li", "bo-7"))
    # The stamp of an instructor's own pattern (its timestamp group) is not beaten by a D2L date after it either
    iso = r"^(?P<student_id>[a-z_]+?)_(?P<timestamp>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})_(?P<file>.+)$"
    assert late.time_from_name("jane_doe_2025-03-06T23:00:00_lab Mar 1, 2025 1000 AM.ipynb", lms_regex=iso) == two_days
    # A plain name carries no LMS stamp, whatever date the student put in it: "not checked", with the reason
    assert late.time_from_name("amy_2025-03-01T10-00-00_lab.ipynb") is None
    assert late.time_from_name("amy_20250301T100000_lab.ipynb") is None
    (subs / "amy_lab 20250301T100000.ipynb").write_bytes(b"{}")
    row = late.assess(pol, "amy", late.submission_times(subs, assignment=AID)["amy"], 10)
    assert row["submitted_at"] == "" and "not checked" in row["late_note"] and "plain" in row["late_note"], row


def test_a_backdated_zip_clears_no_hand_in_of_lateness(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    old = (2025, 3, 1, 8, 0, 0)
    _zip(subs / "mal_LATE_12345_678_handin.zip", [(zipfile.ZipInfo(f"{AID}.ipynb", date_time=old), _nb())])
    _zip(subs / "zed_handin.zip", [(zipfile.ZipInfo(f"{AID}.ipynb", date_time=old), _nb())])  # no LATE mark
    got = late.submission_times(subs)
    pol = late.LatePolicy(DUE)
    row = late.assess(pol, "mal", got["mal"], 10)
    assert row["submitted_at"] == "" and row["late_penalty"] == 0, row  # not "on time": unknown, and said so
    assert "LMS marked this hand-in late" in row["late_note"] and "--submitted-csv" in row["late_note"]
    info = classbook.ClassInfo(AID, 10.0, [], [AID], [], "d")
    res = grade.StudentResult("mal", AID, "graded", 10.0, 10.0)
    rows = classbook.final_rows(info, [res], pol, got)
    assert "no submission time (not checked for lateness), 1 hand-in(s): mal" in \
        "\n".join(summary.final_sections(rows, pol, None))
    # Without a LATE mark too: the student's machine dated its zip, so on time by it is unknown, and said so.
    zed = late.assess(pol, "zed", got["zed"], 10)
    assert zed["submitted_at"] == "" and "not checked for lateness" in zed["late_note"]
    rows = classbook.final_rows(info, [res, grade.StudentResult("zed", AID, "graded", 10.0, 10.0)], pol, got)
    assert "not checked for lateness), 2 hand-in(s): mal, zed" in "\n".join(summary.final_sections(rows, pol, None))


# ------------------------------------------------------------------------------------------------ merge


def _slice(folder: Path, results: dict[str, grade.StudentResult]) -> bytes:
    key = grade.result_key(folder)
    for sid, r in results.items():
        (folder / "students" / sid).mkdir(parents=True, exist_ok=True)
        (folder / "students" / sid / "result.json").write_bytes(grade.sealed_result(r, key))
    (folder / classbook.MANIFEST).write_text(json.dumps(
        {"assignment": AID, "max_score": 10.0, "cells": [], "notebooks": [AID], "calls": [], "source_digest": "d",
         "students": sorted(results), "shard": "0/1"}))
    (folder / classbook.MASTER_GRADEBOOK).write_bytes(b"")
    return key


def test_a_sealed_marker_moved_to_another_student_is_not_credited_to_them(tmp_path):
    s = tmp_path / "s0"
    amy, bob = (grade.StudentResult(sid, AID, "graded", pts, 10.0) for sid, pts in (("amy", 10.0), ("bob", 1.0)))
    key = _slice(s, {"amy": amy, "bob": bob})
    # both markers are the grader's own, sealed under this folder's key: only their places are swapped
    a, b = (s / "students" / sid / "result.json" for sid in ("amy", "bob"))
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    assert grade.load_result(b, key) is not None and grade.load_result(b, key, "bob") is None
    _, _, results, rejected = merge._read_slice(s)
    assert results == {} and len(rejected) == 2 and "another student's" in rejected[0]


# ------------------------------------------------------------------------------------------------ similarity


def _renamed_self(src: str) -> str:
    return re.sub(r"\bself\b", "me", src)


def test_renaming_self_does_not_hide_a_copy():
    files = dict(similarity_class.SOLUTIONS, zed=_renamed_self(similarity_class.COPY))
    pairs, _ = similarity.compare(files, similarity_class.STARTER)
    assert [(p.a, p.b) for p in pairs if p.flagged] == [("ana", "zed")] and pairs[0].similarity > 0.9
    assert max(p.similarity for p in pairs if not p.flagged) < 0.3

    def toks(src):
        return [t for t, _ in similarity.tokens(src)]

    method = "class A:\n    def f(self, x):\n        return self.w * x.sum()\n"
    assert toks(method) == toks(_renamed_self(method).replace("x", "y"))
    assert toks("def f(me):\n    return me.sum()\n") != toks("def f(me):\n    return me.mean()\n")  # not a method


# ------------------------------------------------------------------------------------------------ Gradescope


def test_a_gradescope_upload_cannot_point_the_grader_at_the_course_solution(tmp_path):
    from autograder.checks import harness
    from autograder.lms import exports as lms

    aid = harness.ASSIGNMENTS["lab1"]
    want = harness.STUDENT_FILES["lab1"]
    solution = tmp_path / "autograder" / "source" / f"{aid}.ipynb"  # what the course ships to the container
    solution.parent.mkdir(parents=True)
    solution.write_bytes(_nb(f"%%writefile {want}\nSOLUTION = 'the instructor'\n"))
    sub = tmp_path / "submission"
    sub.mkdir()
    os.symlink(solution, sub / f"{aid}.ipynb")
    os.symlink(solution.parent, sub / "linked")
    for t in ("t1", "t2"):
        (tmp_path / t).mkdir()
    assert lms._gradescope_student_file(sub, "lab1", aid, tmp_path / "t1") is None
    (sub / want).write_text("MINE = 1\n")  # the student's own file is still graded
    got = lms._gradescope_student_file(sub, "lab1", aid, tmp_path / "t2")
    assert got is not None and got.read_text() == "MINE = 1\n"


def test_gradescope_refuses_to_grade_where_bubblewrap_cannot_start(tmp_path):
    """In a container without user namespaces, `--sandbox auto` fell back to no sandbox: a blank hand-in read the
    course secret and the trusted checks, double-forked a daemon out of the grader's reach and rewrote results.json
    to full marks after the grader wrote it. Now the run stops before any student code runs, and writes no
    results; `--sandbox none`, said by name, still trusts the submission, without the secret in its environment."""
    import subprocess

    from autograder.checks import harness

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the "
                                "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    canary = tmp_path / "student_ran.txt"
    sub = tmp_path / "submission"
    sub.mkdir()
    (sub / harness.STUDENT_FILES["lab1"]).write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(canary)!r}).write_text(os.environ.get('LABKIT_COURSE_SECRET', 'no secret'))\n")
    results = tmp_path / "results" / "results.json"
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
           "LABKIT_COURSE_SECRET": "a-course-secret-of-some-length", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "autograder", "gradescope", "lab1", "--submission", str(sub), "--results", str(results)]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "cannot sandbox the submission here" in r.stderr + r.stdout, r.stderr[-2000:]
    assert "--sandbox none" in r.stderr + r.stdout and "No permissions" in r.stderr + r.stdout
    assert not canary.exists() and not results.exists()
    r = subprocess.run(cmd + ["--sandbox", "none"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert canary.read_text() == "no secret"  # trusted by name: it ran, but the secret stayed with the grader
    said = json.loads(results.read_text())
    assert "UNSANDBOXED (--sandbox none" in said["output"] and said["score"] == 0


def _with_idle_statements(src: str, idle: str) -> str:
    """`src` with the statement `idle` after every simple statement inside a function."""
    import ast

    after: dict[int, int] = {}
    for f in (n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)):
        for st in ast.walk(f):
            if isinstance(st, ast.stmt) and not hasattr(st, "body") and st is not f:
                after[st.end_lineno] = st.col_offset
    lines = src.splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        out.append(line)
        if n in after:
            out.append(" " * after[n] + idle)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("idle", ["pass", "...", "0", "None", "'padding'"])
def test_statements_that_do_nothing_do_not_hide_a_copy(idle):
    padded = _with_idle_statements(similarity_class.COPY, idle)
    assert padded.count(f"\n        {idle}\n") > 10
    pairs, _ = similarity.compare(dict(similarity_class.SOLUTIONS, zed=padded), similarity_class.STARTER)
    assert [(p.a, p.b) for p in pairs if p.flagged] == [("ana", "zed")] and pairs[0].similarity > 0.9
    assert max(p.similarity for p in pairs if not p.flagged) < 0.3


def test_a_line_nested_past_the_parser_neither_crashes_the_report_nor_hides_the_copy():
    """A copy whose %%writefile cell also holds `_ = ------...1` (100,000 minus signs; the next cell rewrites the
    module clean, so grading never sees it) made ast.parse raise MemoryError in the similarity tool, which stopped
    with no report for the whole class, and the copy was never flagged."""
    from autograder import labkit_answers

    poisoned = similarity_class.COPY + "_ = " + "-" * 100_000 + "1\n"
    pairs, _ = similarity.compare(dict(similarity_class.SOLUTIONS, zed=poisoned), similarity_class.STARTER)
    assert [(p.a, p.b) for p in pairs if p.flagged] == [("ana", "zed")]
    assert labkit_answers.banned_uses(poisoned, "lab1") == []  # unparsable: nothing found, and no crash


def test_a_notebook_nested_past_the_parsers_depth_is_one_clear_problem(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / f"deep_{AID}.ipynb").write_bytes(b'{"nbformat": 4, "cells": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    by, _ = _collect(subs, tmp_path)
    assert by["deep"].cause == "invalid notebook" and "RecursionError" in by["deep"].problem, by["deep"].problem


def test_a_notebook_of_millions_of_tiny_values_is_refused_before_it_is_parsed(tmp_path):
    """Intake parses and validates each hand-in in the grader's process. 48 MiB of `{},` (16 million cells) stayed
    under the 50 MiB limit and cost gigabytes there (every cell an object, and a validation error each); so did
    200,000 empty cells, validated one by one."""
    import time
    import tracemalloc

    from autograder.gradebook.feedback import MAX_CELLS

    subs = tmp_path / "subs"
    subs.mkdir()
    head = b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": ['
    (subs / f"vast_{AID}.ipynb").write_bytes(head + b"{}," * (16 * 2**20) + b"{}]}")
    (subs / f"wide_{AID}.ipynb").write_bytes(head + b"{}," * 200_000 + b"{}]}")
    (subs / f"amy_{AID}.ipynb").write_bytes(_nb())
    tracemalloc.start()
    t0 = time.perf_counter()
    by, _ = _collect(subs, tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert by["vast"].cause == "invalid notebook" and "more than 2,000,000 JSON values" in by["vast"].problem
    assert by["wide"].cause == "invalid notebook" and f"(limit {MAX_CELLS:,})" in by["wide"].problem
    assert by["amy"].problem is None
    # the files are read whole (48 MiB, then a decoded copy) but never parsed into millions of objects
    assert peak < 300 * 2**20 and time.perf_counter() - t0 < 30, (peak, time.perf_counter() - t0)


def test_tags_that_take_validation_minutes_are_refused_in_milliseconds_and_missing_ids_still_pass(tmp_path):
    """12,000 tags of mixed types (92 KB): jsonschema's distinct-items check compared every pair when nbformat
    worded the failure, and held intake 107 s in the grader's process. fastjsonschema alone decides now. A notebook
    saved without cell ids is still read, its ids made as nbformat.reads makes them."""
    import time

    nb = json.loads(_nb())
    nb["cells"][0]["metadata"]["tags"] = [i if i % 2 == 0 else f"a{i}" for i in range(12_000)]
    t0 = time.perf_counter()
    problem = intake.check_notebook(json.dumps(nb).encode(), "lab.ipynb")
    assert time.perf_counter() - t0 < 2 and problem.startswith("lab.ipynb is not a valid notebook: data.cells[0]")
    nb["cells"][0]["metadata"]["tags"] = ["fine"]
    del nb["cells"][0]["id"]
    assert intake.check_notebook(json.dumps(nb).encode(), "lab.ipynb") is None
    nb["nbformat"] = 3
    assert "only nbformat 4 notebooks are read" in intake.check_notebook(json.dumps(nb).encode(), "lab.ipynb")


def test_a_class_of_large_hand_ins_is_spooled_to_disk_not_held_in_memory(tmp_path, monkeypatch):
    """Intake held every hand-in in memory until the class was graded, up to MAX_HANDIN_BYTES each: a class whose
    hand-ins carry the dataset beside the notebook would hold the grader at gigabytes. Now each file is copied
    into the scratch folder with its sha256, and memory holds a chunk at a time. The digest covers every name and
    byte, each preceded by its length."""
    import hashlib
    import tracemalloc

    from autograder.base import spool

    monkeypatch.setattr(intake, "MAX_HANDIN_BYTES", 12 * 2**20)
    subs = tmp_path / "subs"
    blobs = {}
    for i, sid in enumerate(["amy", "bea", "cal", "dan", "eve"]):
        (subs / sid).mkdir(parents=True)
        (subs / sid / f"{AID}.ipynb").write_bytes(_nb(f"x = {i}"))
        blobs[sid] = bytes([i]) * (8 * 2**20)
        (subs / sid / "data.bin").write_bytes(blobs[sid])
    (subs / "big").mkdir()
    (subs / "big" / f"{AID}.ipynb").write_bytes(_nb())
    (subs / "big" / "data.bin").write_bytes(b"\0" * (12 * 2**20))  # the notebook and this pass the cap together
    tracemalloc.start()
    by, _ = _collect(subs, tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # 40 MiB handed in, less than one hand-in held at once
    assert by["big"].cause == "hand-in too large" and not by["big"].files
    assert sorted(p.name for p in (tmp_path / "scratch" / "spool").iterdir()) == ["1", "2", "3", "4", "5", "6"]
    assert not any(by["big"].files.folder.iterdir())  # nothing of it kept
    amy = by["amy"]
    assert isinstance(amy.files, spool.Spool) and amy.files["data.bin"] == blobs["amy"]
    want = hashlib.sha256()
    for name in sorted(amy.files):
        data = amy.files[name]
        want.update(len(name).to_bytes(8, "big") + name.encode() + len(data).to_bytes(8, "big") + data)
    assert amy.digest == want.hexdigest()


def test_two_different_hand_ins_never_share_a_digest(tmp_path):
    """Names and bytes joined by NUL bytes gave one digest to a file holding "x\\0k1\\0y" and to that file split
    in two: a changed hand-in kept its earlier grade ("already graded") and the hidden cases drawn for it."""
    subs = tmp_path / "subs"
    for sid, files in {"one": {"k": b"x\0k1\0y"}, "two": {"k": b"x", "k1": b"y"}}.items():
        (subs / sid).mkdir(parents=True)
        (subs / sid / f"{AID}.ipynb").write_bytes(_nb())
        for name, data in files.items():
            (subs / sid / name).write_bytes(data)
    by, _ = _collect(subs, tmp_path)
    assert by["one"].digest and by["one"].digest != by["two"].digest


def test_a_spooled_file_changed_after_intake_is_refused_where_it_is_read(tmp_path):
    """The sandboxes never see the spool, but if anything rewrites a copy there, grading must not go on with it
    (nor with a digest computed from it): the change is refused by name, for that student."""
    from autograder import course as courses
    from autograder.base import spool

    subs = tmp_path / "subs"
    (subs / "amy").mkdir(parents=True)
    (subs / "amy" / f"{AID}.ipynb").write_bytes(_nb())
    (subs / "amy" / "helper.py").write_text("ANSWER = 1\n")
    by, _ = _collect(subs, tmp_path)
    files = by["amy"].files
    stored = next(p for p in files.folder.iterdir() if p.read_bytes() == b"ANSWER = 1\n")
    stored.write_text("ANSWER = 2\n")
    with pytest.raises(spool.HandinChanged, match="'helper.py' changed after intake read it"):
        files["helper.py"]
    with pytest.raises(spool.HandinChanged, match="'helper.py' changed"):
        by["amy"].compute_digest()
    with pytest.raises(spool.HandinChanged):  # the scratch course is laid out from these files
        courses._write_files(tmp_path / "course", files)
    stored.unlink()
    with pytest.raises(spool.HandinChanged, match="could not be read"):
        files["helper.py"]


def test_a_full_disk_under_the_spool_stops_the_run_instead_of_dropping_a_file(tmp_path):
    """A file the grader cannot copy (its own disk is full) must not be noted as the student's unreadable file and
    then graded without it: the run stops with one line, before any grading."""
    import subprocess
    import textwrap

    subs = tmp_path / "subs"
    (subs / "amy").mkdir(parents=True)
    (subs / "amy" / f"{AID}.ipynb").write_bytes(_nb())
    (subs / "amy" / "data.bin").write_bytes(b"\1" * (3 * 2**20))
    code = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from autograder.intake import submissions as intake
        from labkit.env import LabkitError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))
        try:
            intake.collect({str(subs)!r}, {AID!r}, scratch=Path({str(tmp_path / "scratch")!r}))
        except LabkitError as e:
            print("STOPPED:", e)
        else:
            print("GRADED ON")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert "STOPPED: cannot copy the hand-ins into" in out.stdout and "File too large" in out.stdout, out

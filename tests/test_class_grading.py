"""Grading a real class: slices and merge, late work, LMS exports, similarity, GPU verdicts, progress.

One small toy class (autograder.rehearsal) is graded twice, once in three slices (one of them killed mid-run and
resumed) and once whole, and the merge of the slices must give exactly the whole run's grades. Everything else
is built from StudentResult objects or plain files, without grading.
"""

from __future__ import annotations

import copy
import csv
import datetime as dt
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import commands, grade, merge, rehearsal
from autograder.__main__ import build_parser
from autograder.__main__ import main as cli_main
from autograder.base import progress
from autograder.checks import gpu_policy
from autograder.gradebook import classbook, similarity, summary
from autograder.intake import late, shard
from autograder.lms import exports as lms
from labkit.env import REPO_ROOT, LabkitError

sys.path.insert(0, str(Path(__file__).parent / "data"))
import similarity_class  # noqa: E402

AID = rehearsal.TOY_ID
PY = sys.executable
UTC = dt.UTC


# ------------------------------------------------------------------------------------------------ slices


def test_slices_are_stable_and_partition_the_class():
    ids = [f"student{i:03d}" for i in range(200)]
    before = {s: shard.slice_of(s, 4) for s in ids}
    assert set(before.values()) == {0, 1, 2, 3}
    more = ids + [f"late_joiner{i}" for i in range(50)]
    assert all(shard.slice_of(s, 4) == before[s] for s in ids)  # adding students moves nobody
    subs = [type("S", (), {"student_id": s})() for s in more]
    parts = [shard.select(subs, f"{k}/4") for k in range(4)]
    assert sorted(s.student_id for p in parts for s in p) == sorted(more)
    assert shard.slice_of("alice", 3) == shard.slice_of("alice", 3) and shard.parse(" 2 / 3 ") == (2, 3)
    for bad in ("3/3", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(LabkitError):
            shard.parse(bad)


def _id_in(slice_k: int, prefix: str, n: int = 3) -> str:
    return next(f"{prefix}{i}" for i in range(1000) if shard.slice_of(f"{prefix}{i}", n) == slice_k)


def _hand_in(body: str | None) -> bytes:
    """The toy notebook as a student hands it in: the %%writefile cell holding `body`."""
    nb = rehearsal.toy_notebook()
    if body is not None:
        nb.cells[1].source = "%%writefile pipeline.py\n" + body
    return nbformat.writes(nb).encode()


def _cfg(base: Path, out: str, **kw) -> grade.GradeConfig:
    return grade.GradeConfig(course=str(base / "course"), out=str(base / out), work=str(base / f"work-{out}"),
                             cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=1,
                             harness_module="autograder.rehearsal", progress=False, **kw)


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """A 5-student toy class graded in three slices (slice 0 killed after its first result, then resumed),
    graded again whole, and the slices merged."""
    base = tmp_path_factory.mktemp("sliced")
    rehearsal.build_toy_course(base / "course")
    # Slice 0: a hand-in without a notebook (done at once) then the reference (killed while it is graded).
    who = {"empty": _id_in(0, "a_empty"), "ref": _id_in(0, "b_ref"), "wrong": _id_in(1, "c_wrong"),
           "bad": _id_in(2, "d_bad"), "nothing": _id_in(2, "e_nothing")}
    subs = base / "subs"
    for key, files in {"empty": {"README.txt": b"sorry"}, "ref": {f"{AID}.ipynb": _hand_in(None)},
                       "wrong": {f"{AID}.ipynb": _hand_in(rehearsal.BODIES["wrong_fast"])},
                       "bad": {f"{AID}.ipynb": b'{"cells": [ oops'}, "nothing": {"notes.md": b"-"}}.items():
        (subs / who[key]).mkdir(parents=True)
        for name, data in files.items():
            (subs / who[key] / name).write_bytes(data)
    cmd = [PY, "-m", "autograder", "grade", AID, "--submissions", str(subs), "--course", str(base / "course"),
           "--out", str(base / "s0"), "--work", str(base / "work-s0"), "--shard", "0/3", "--preset", "quick",
           "--harness", "autograder.rehearsal", "--jobs", "1", "--memory-gb", "2.5", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if list((base / "s0" / "students").glob("*/result.json")):
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {m.parent.name: json.loads(m.read_text())["finished_at"]
              for m in (base / "s0" / "students").glob("*/result.json")}
    reps = [grade.grade_class(AID, subs, _cfg(base, f"s{k}", shard=f"{k}/3")) for k in range(3)]
    whole = grade.grade_class(AID, subs, _cfg(base, "whole"))
    merged = merge.merge([base / f"s{k}" for k in range(3)], base / "merged", submissions=subs, progress=False)
    return {"base": base, "who": who, "before": before, "slices": reps, "whole": whole, "merged": merged}


def _csv(path: Path) -> dict[str, dict]:
    return {r["student_id"]: r for r in csv.DictReader(path.open())}


def test_three_slices_merged_give_the_grades_of_one_unsharded_run(sliced):
    base, who = sliced["base"], sliced["who"]
    assert [sorted(r.student_id for r in rep.results) for rep in sliced["slices"]] == \
        [sorted([who["empty"], who["ref"]]), [who["wrong"]], sorted([who["bad"], who["nothing"]])]
    assert sliced["merged"].missing == [] and sliced["merged"].rejected == []
    whole, merged = _csv(base / "whole" / "grades.csv"), _csv(base / "merged" / "grades.csv")
    assert list(merged) == list(whole) == sorted(who.values())
    same = ["status", "score", "max_score", "cause", "test_correct", "test_speed", "checks_passed", "total",
            "extra_credit"]
    assert {s: {c: r[c] for c in same} for s, r in merged.items()} == \
        {s: {c: r[c] for c in same} for s, r in whole.items()}
    assert float(merged[who["ref"]]["score"]) == 5 and float(merged[who["wrong"]]["score"]) == 0

    from nbgrader.api import Gradebook

    def book(folder):
        with Gradebook(f"sqlite:///{base / folder / 'gradebook.db'}") as gb:
            return {s.student.id: s.score for s in gb.assignment_submissions(AID)}

    assert book("merged") == book("whole") and len(book("merged")) == 5
    key = grade.result_key(base / "merged")
    for sid in who.values():  # re-sealed under the merged folder's key, feedback carried over
        assert grade.load_result(base / "merged" / "students" / sid / "result.json", key) is not None
        assert (base / "merged" / "feedback" / sid / AID / f"{AID}.html").exists()
    summary = (base / "merged" / "summary.txt").read_text()
    assert "merged 3 slice(s)" in summary and "MISSING" not in summary


def test_a_killed_slice_resumes_without_regrading_what_it_finished(sliced):
    who, before, s0 = sliced["who"], sliced["before"], sliced["slices"][0]
    assert before and who["ref"] not in before  # killed while the reference was being graded
    by = {r.student_id: r for r in s0.results}
    assert all(by[sid].finished_at == t for sid, t in before.items())
    assert s0.graded_now == 2 - len(before)
    assert "slice 0/3" in (sliced["base"] / "s0" / "summary.txt").read_text()


def test_merge_refuses_overlaps_and_names_missing_students(sliced, tmp_path):
    base, who = sliced["base"], sliced["who"]
    with pytest.raises(LabkitError, match="graded in two slices"):
        merge.merge([base / "whole", base / "s1"], tmp_path / "m1", progress=False)
    rep = merge.merge([base / "s0", base / "s1"], tmp_path / "m2", submissions=base / "subs", progress=False)
    assert rep.missing == sorted([who["bad"], who["nothing"]])
    assert "MISSING (2" in (tmp_path / "m2" / "summary.txt").read_text()
    roster = tmp_path / "roster.csv"
    roster.write_text("student_id,name\n" + "".join(f"{s},x\n" for s in who.values()) + "zoe_never,z\n")
    rep = merge.merge([base / f"s{k}" for k in range(3)], tmp_path / "m3", roster=roster, progress=False)
    assert rep.missing == ["zoe_never"]
    unfinished = tmp_path / "unfinished"
    shutil.copytree(base / "s1", unfinished)
    (unfinished / classbook.MANIFEST).unlink()
    with pytest.raises(LabkitError, match="did not finish"):
        merge.merge([base / "s0", unfinished], tmp_path / "m4", progress=False)
    code = cli_main(["merge", str(tmp_path / "m5"), *(str(base / f"s{k}") for k in range(3)), "--no-progress",
                     "--submissions", str(base / "subs")])
    assert code == 0 and _csv(tmp_path / "m5" / "grades.csv") .keys() == set(who.values())


# ------------------------------------------------------------------------------------------------ GPU verdicts


CPU = [{"index": None, "card": "CPU (x86_64, 2 cores)", "capability": None, "class": "cpu"}]


def _result(sid, score=3.0, checks=(), status="graded", cells=None, **kw) -> grade.StudentResult:
    cells = cells or [{"notebook": "lab", "cell": "test_a", "score": min(score, 2.0), "max_score": 2.0},
                      {"notebook": "lab", "cell": "test_speed", "score": max(score - 2.0, 0.0), "max_score": 4.0}]
    return grade.StudentResult(sid, "lab", status, score, 6.0, cells=cells, checks=list(checks),
                               hardware={"class": "cpu", "card": "CPU"}, wall_s=12.0, **kw)


def _check(name, passed=True, **measurements):
    return {"check": name, "passed": passed, "fraction": 1.0 if passed else 0.0, "message": f"{name} said so",
            "cause": None, "measurements": measurements}


def test_a_gpu_lab_is_refused_on_a_cpu_machine_unless_allowed(tmp_path, monkeypatch):
    import ast

    # The table follows lab 4's tiers (read from its source: the trusted module imports torch and the harness).
    tree = ast.parse((REPO_ROOT / "autograder" / "checks" / "lab4_checks.py").read_text())
    tiers = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "SPEED_TIERS" for t in n.targets))
    assert set(gpu_policy.NEEDS_GPU["lab4.speed"]) == {k.value for k in tiers.keys}
    with pytest.raises(LabkitError, match="allow-ungradable"):
        gpu_policy.refuse_ungradable("lab4_speedrun", ["lab4.correctness", "lab4.speed"], CPU, allow=False)
    assert gpu_policy.refuse_ungradable("lab4_speedrun", ["lab4.speed"], CPU, allow=True) == ["lab4.speed"]
    gpu = [{"index": 0, "card": "NVIDIA H100", "capability": "9.0", "class": "tensor_core_gpu"}]
    assert gpu_policy.refuse_ungradable("lab4_speedrun", ["lab4.speed"], gpu, allow=False) == []
    # Up front in grade_class: nobody is graded (the toy's speed check stands in for a GPU check here).
    monkeypatch.setitem(gpu_policy.NEEDS_GPU, rehearsal.CHECK, ("gpu",))
    course = rehearsal.build_toy_course(tmp_path / "course")
    (tmp_path / "subs" / "alice").mkdir(parents=True)
    (tmp_path / "subs" / "alice" / f"{AID}.ipynb").write_bytes(_hand_in(None))
    cfg = grade.GradeConfig(course=str(course), out=str(tmp_path / "out"), harness_module="autograder.rehearsal",
                            progress=False, trusted_submissions=True)
    with pytest.raises(LabkitError, match="cannot be fully graded on this machine"):
        grade.grade_class(AID, tmp_path / "subs", cfg)
    assert not (tmp_path / "out" / "students").exists()


def test_not_gradable_students_are_listed_and_the_bonus_tier_is_extra_credit():
    info = classbook.ClassInfo("lab", 6.0, [], ["lab"], [{"notebook": "lab", "cell": "test_speed",
                                                         "check": "lab4.speed"}], "d")
    res = [_result("ann", 6.0, [_check("lab4.speed", speedup=4.3, extra_credit=1)]),
           _result("bob", 2.0, [_check("lab4.speed", passed=None)]),
           _result("cat", 6.0, [_check("lab4.speed", speedup=3.2, extra_credit=0)])]
    rows = {r["student_id"]: r for r in classbook.final_rows(info, res, None, {})}
    assert rows["ann"]["extra_credit"] == 1 and rows["ann"]["total"] == 7
    assert rows["ann"]["extra_credit_from"] == [{"check": "lab4.speed", "notebook": "lab", "cell": "test_speed",
                                                 "points": 1.0}]
    assert rows["bob"]["not_gradable_here"] == ["lab4.speed"] and rows["cat"]["extra_credit"] == 0
    text = "\n".join(summary.final_sections(list(rows.values()), None, None))
    assert "NOT GRADABLE ON THIS HARDWARE (1 students" in text and "bob: lab4.speed" in text
    assert "ann: +1 (lab4.speed)" in text


def test_extra_credit_is_written_into_the_gradebook_and_grades_csv(sliced, tmp_path):
    out = tmp_path / "book"
    shutil.copytree(sliced["base"] / "whole", out)
    info, _ = classbook.read_info(out)
    ref = sliced["who"]["ref"]
    results = copy.deepcopy(sliced["whole"].results)  # the fixture's own stay as graded
    for r in results:
        if r.student_id == ref:
            r.checks = [dict(c, measurements={**c["measurements"], "extra_credit": 1}) if c["check"] == rehearsal.CHECK
                        else c for c in r.checks]
    classbook.finish(out, info, results, hardware=CPU, junk=[], write=lambda rel, data: "")
    row = _csv(out / "grades.csv")[ref]
    assert row["extra_credit"] == "1" and row["total"] == "6" and row["score"] == "5"
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gb:
        g = gb.find_grade("test_speed", AID, AID, ref)
        assert g.extra_credit == 1 and gb.find_submission(AID, ref).score == 6


# ------------------------------------------------------------------------------------------------ late work


def test_submission_times_from_names_zip_dates_and_csv(tmp_path):
    s = tmp_path / "subs"
    s.mkdir()
    (s / "bb_attempt_2025-03-05-01-30-00_lab.ipynb").write_text("{}")  # Blackboard stamp
    (s / "1-2 - d2l - Mar 4, 2025 1115 PM - lab.ipynb").write_text("{}")  # D2L stamp
    (s / "canv_LATE_12345_678_lab.ipynb").write_text("{}")  # Canvas: only a LATE marker
    with zipfile.ZipFile(s / "zed_lab.zip", "w") as z:
        z.writestr(zipfile.ZipInfo("lab.ipynb", date_time=(2025, 3, 6, 8, 0, 0)), "{}")
        z.writestr(zipfile.ZipInfo("helper.py", date_time=(2025, 3, 1, 8, 0, 0)), "x = 1")
    (tmp_path / "times.csv").write_text("student_id,submitted_at\nd2l,2025-03-04T20:00:00+00:00\n")
    got = late.submission_times(s, times_csv=str(tmp_path / "times.csv"))
    assert got["bb"].at == dt.datetime(2025, 3, 5, 1, 30, tzinfo=UTC) and got["bb"].source == "file name"
    assert got["zed"].at == dt.datetime(2025, 3, 6, 8, 0, tzinfo=UTC) and got["zed"].source == late.STUDENT_ZIP
    assert got["d2l"].source == "csv" and got["d2l"].at.hour == 20  # the CSV beats the name
    assert got["canv"].at is None and got["canv"].lms_late
    assert late.time_from_name("1-2 - x - Mar 4, 2025 1115 PM - y", "UTC") == dt.datetime(2025, 3, 4, 23, 15, tzinfo=UTC)
    assert late.time_from_name("alice_20250304T231502_lab.ipynb") is None  # plain names: the student's own text
    got = late.time_from_name("alice_2025-03-04T23:15:02_lab.ipynb", lms_regex=r"^(?P<student_id>[a-z]+)_(?P<timestamp>"
                              r"[0-9T:-]+)_(?P<file>.+)$")  # the instructor's pattern says where a stamp is
    assert got == dt.datetime(2025, 3, 4, 23, 15, 2, tzinfo=UTC)
    # A class zip: a student's folder is dated by its newest entry.
    with zipfile.ZipFile(tmp_path / "class.zip", "w") as z:
        z.writestr(zipfile.ZipInfo("subs/amy/lab.ipynb", date_time=(2025, 3, 4, 22, 0, 0)), "{}")
    assert late.submission_times(tmp_path / "class.zip")["amy"].at.hour == 22


def test_late_policy_grace_per_day_cap_and_extensions(tmp_path):
    due = dt.datetime(2025, 3, 4, 23, 59, tzinfo=UTC)
    ext = tmp_path / "ext.csv"
    ext.write_text("student_id,days\ncat,2\n")
    pol = late.LatePolicy(due, grace_s=15 * 60, per_day_pct=10, cap_pct=30,
                          extensions=late.read_extensions(ext, due))
    at = lambda **k: late.Stamp(due + dt.timedelta(**k), "csv")  # noqa: E731
    assert late.assess(pol, "ann", at(minutes=10), 20)["late_penalty"] == 0  # inside the grace period
    r = late.assess(pol, "bob", at(hours=30), 20)
    assert r["days_late"] == 2 and r["late_penalty"] == 4.0 and "2 day(s) late" in r["late_note"]
    assert late.assess(pol, "dan", at(days=9), 20)["late_penalty"] == 6.0  # capped at 30%
    assert late.assess(pol, "cat", at(hours=30), 20)["late_penalty"] == 0  # two days' extension
    assert "not checked" in late.assess(pol, "eve", None, 20)["late_note"]
    # The student's own zip is dated by their machine: late by it counts, on time by it is not believed.
    own = lambda **k: late.Stamp(due + dt.timedelta(**k), late.STUDENT_ZIP)  # noqa: E731
    assert late.assess(pol, "bob", own(hours=30), 20)["late_penalty"] == 4.0
    backdated = late.assess(pol, "mal", own(days=-3), 20)
    assert backdated["submitted_at"] == "" and "not checked for lateness" in backdated["late_note"]
    info = classbook.ClassInfo("lab", 6.0, [], ["lab"], [], "d")
    times = {"bob": at(hours=30), "ann": at(minutes=10)}
    rows = {r["student_id"]: r for r in classbook.final_rows(info, [_result("bob", 1.0), _result("ann")], pol, times)}
    assert rows["bob"]["total"] == 0.0 and rows["ann"]["total"] == 3.0  # never below 0
    text = "\n".join(summary.final_sections(list(rows.values()), pol, None))
    assert "late policy: due 2025-03-04T23:59:00+00:00, grace 15 min" in text and "bob: submitted 2 day(s)" in text
    args = build_parser().parse_args(["grade", AID, "--submissions", "x", "--due", "2025-03-04T23:59",
                                      "--timezone", "Europe/Berlin", "--late-per-day", "5", "--extensions", str(ext)])
    p = commands.late_policy(args)
    assert p.due.utcoffset() == dt.timedelta(hours=1) and p.per_day_pct == 5 and "cat" in p.extensions
    for bad in (["--due", "tomorrow"], ["--due", "2025-03-04", "--late-cap", "150"], ["--extensions", str(ext)]):
        with pytest.raises(LabkitError):
            commands.late_policy(build_parser().parse_args(["grade", AID, "--submissions", "x", *bad]))


def test_the_feedback_page_shows_the_late_assessment_and_a_resume_still_trusts_it(tmp_path):
    from autograder.gradebook import report

    due = dt.datetime(2025, 3, 4, 23, 59, tzinfo=UTC)
    (tmp_path / "ext.csv").write_text("student_id,days\nleeann,2\n")
    (tmp_path / "times.csv").write_text("student_id,submitted_at\nsmithjo,2025-03-06T05:59:00+00:00\n"
                                        "leeann,2025-03-06T05:59:00+00:00\n")
    out = tmp_path / "out"
    results = [_result("smithjo", 6.0, [_check("lab4.speed", speedup=4.2, extra_credit=1)]), _result("leeann", 2.0)]
    # A student's own notebook is rendered into their page: a late box typed into it must stay theirs, untouched.
    fake = "<!--labkit-late--><div id='labkit-late'>on time, no penalty</div><!--/labkit-late-->"
    nbg = {"smithjo": f"<html><head></head><body><p>notebook</p>{fake}</body></html>", "leeann": None}
    digests = {}
    for r in results:
        data = report.feedback_page(r, nbg[r.student_id])
        digests[report.feedback_path(r, "lab")] = grade._sha(data)
        (out / report.feedback_path(r, "lab")).parent.mkdir(parents=True)
        (out / report.feedback_path(r, "lab")).write_bytes(data)
    info = classbook.ClassInfo("lab", 6.0, [], ["lab"], [{"notebook": "lab", "cell": "test_speed",
                                                         "check": "lab4.speed"}], "d")

    def finish(per_day):
        pol = late.LatePolicy(due, grace_s=15 * 60, per_day_pct=per_day, cap_pct=30, times_csv=str(tmp_path / "times.csv"),
                              extensions=late.read_extensions(tmp_path / "ext.csv", due))
        classbook.finish(out, info, results, hardware=CPU, junk=[], policy=pol, submissions=tmp_path)
        return {sid: (out / "feedback" / sid / "lab" / "lab.html").read_text() for sid in ("smithjo", "leeann")}

    pages = finish(10)
    smith, lee = pages["smithjo"], pages["leeann"]
    assert "submitted at: 2025-03-06T05:59:00+00:00 (from the csv)" in smith and "grace period of 15 min" in smith
    assert "days late (after grace and extension): 2" in smith and "late penalty applied: -1.2 points" in smith
    assert "total before the penalty: 7; after: 5.8 points" in smith  # 6 + 1 extra credit, -20% of 6
    assert smith.index("labkit-grade-summary") < smith.index("Late work") < smith.index("<p>notebook</p>")
    assert "2025-03-06T23:59:00+00:00 (your extension)" in lee and "late penalty applied: -0 points" in lee
    assert "total before the penalty: 2; after: 2 points" in lee
    smith = finish(5)["smithjo"]  # another policy on a later run or merge: the box is replaced, not added
    assert smith.count("Late work") == 1 and "-0.6 points" in smith and fake in smith
    outputs = grade.Outputs(out)
    assert all(outputs.adopt(rel, dg) for rel, dg in digests.items())  # a resume keeps these students
    page = out / "feedback" / "smithjo" / "lab" / "lab.html"
    page.write_text(smith.replace("<p>notebook</p>", "<p>changed</p>"))
    assert not outputs.adopt("feedback/smithjo/lab/lab.html", digests["feedback/smithjo/lab/lab.html"])
    page.write_text(smith)
    classbook.finish(out, info, results, hardware=CPU, junk=[])  # no policy any more: the box goes
    assert grade._sha(page.read_bytes()) == digests["feedback/smithjo/lab/lab.html"]


# ------------------------------------------------------------------------------------------------ exports


def _graded_folder(tmp_path: Path, policy=None, times=None, extra=()) -> Path:
    """An output folder as a grading run leaves it, from StudentResults made here (no grading)."""
    out = tmp_path / "out"
    key = grade.result_key(out)
    results = [_result("smithjo", 6.0, [_check("lab4.speed", speedup=4.2, extra_credit=1)]),
               _result("leeann", 2.0, [_check("lab4.speed", passed=False, speedup=1.1)]),
               _result("nobody", 0.0, status="not graded", cause="no notebook", message="no notebook handed in"),
               *extra]
    for r in results:
        (out / "students" / r.student_id).mkdir(parents=True)
        (out / "students" / r.student_id / "result.json").write_bytes(grade.sealed_result(r, key))
    (out / "feedback" / "smithjo" / "lab").mkdir(parents=True)
    (out / "feedback" / "smithjo" / "lab" / "lab.html").write_text("<html><body><p>nbgrader page</p></body></html>")
    info = classbook.ClassInfo("lab", 6.0, [], ["lab"], [{"notebook": "lab", "cell": "test_speed",
                                                         "check": "lab4.speed"}], "d")
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "smithjo_LATE_4242_77_lab.ipynb").write_text("{}")
    classbook.finish(out, info, results, hardware=CPU, junk=[], policy=policy, submissions=subs)
    return out


def test_canvas_export_names_the_students_whose_gpu_checks_a_cpu_could_not_grade(tmp_path):
    """Graded with --allow-ungradable on a CPU, the speed check's 0 is not the student's: the export says whose."""
    cpu_only = _check("lab4.speed", passed=None)  # no verdict and no cause: not gradable here
    out = _graded_folder(tmp_path, extra=[_result("cpu_kid", 2.0, [cpu_only]),
                                          _result("odd\x1b[2Jone", 2.0, [cpu_only])])  # an id is shown escaped
    lines = lms.export(out, "canvas", tmp_path / "canvas", title="Lab 4 (1234)", submissions=tmp_path / "subs")
    said = [ln for ln in lines if ln.startswith("NOT GRADABLE ON THIS HARDWARE")]
    assert len(said) == 1 and said[0].endswith(": cpu_kid, 'odd\\x1b[2Jone'") and "--force" in said[0], lines
    assert "\x1b" not in said[0], ascii(said[0])
    assert not any(ln.startswith("NOT GRADABLE") for ln in lms.export(_graded_folder(tmp_path / "all"), "canvas",
                                                                      tmp_path / "canvas2", title="Lab 4 (1234)"))


def test_canvas_export_has_the_documented_columns(tmp_path):
    out = _graded_folder(tmp_path)
    lines = lms.export(out, "canvas", tmp_path / "canvas", title="Lab 4 (1234)", submissions=tmp_path / "subs")
    rows = list(csv.reader((tmp_path / "canvas" / "canvas_grades.csv").open()))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Lab 4 (1234)"]
    assert rows[1][0].strip() == "Points Possible" and rows[1][5] == "6"
    by = {r[3]: r for r in rows[2:]}
    assert by["smithjo"][1] == "4242" and by["smithjo"][5] == "7"  # Canvas id from the download name; + bonus
    assert by["leeann"][5] == "2" and by["nobody"][5] == "0"
    assert any("leeann" in line for line in lines)  # no Canvas id known for her: named
    roster = tmp_path / "roster.csv"
    roster.write_text("Student,ID,SIS User ID,SIS Login ID,Section,Lab 4 (1234)\n"
                      "    Points Possible,,,,,6\n"
                      '"Smith, Jo",4242,S001,jsmith,A,\n"Lee, Ann",4343,S002,leeann,B,\n"Doe, Jane",4444,S003,jdoe,A,\n')
    text, unmatched = lms.canvas_csv(*lms.load_class(out)[:2], title="Lab 4", points=6,
                                     roster=lms.read_roster(roster), names=lms.lms_names(tmp_path / "subs"))
    got = {r["SIS User ID"]: r for r in csv.DictReader(io.StringIO(text)) if r["SIS User ID"]}
    assert got["S001"]["Lab 4"] == "7" and got["S002"]["Section"] == "B" and unmatched == ["nobody"]


def test_gradescope_results_follow_the_autograder_spec(tmp_path):
    due = dt.datetime(2025, 3, 4, tzinfo=UTC)
    out = _graded_folder(tmp_path, late.LatePolicy(due, times_csv=None), None)
    lms.export(out, "gradescope", tmp_path / "gs")
    for sid in ("smithjo", "leeann", "nobody"):
        d = json.loads((tmp_path / "gs" / sid / "results.json").read_text())
        assert {"score", "output", "tests"} <= set(d) and isinstance(d["score"], float)
        assert "execution_time" not in d  # the run's time includes the hidden checks', stretched by their inputs
        for t in d["tests"]:
            assert {"name", "score", "max_score", "output"} <= set(t)
            assert t.get("visibility", "visible") in ("hidden", "after_due_date", "after_published", "visible")
    d = json.loads((tmp_path / "gs" / "smithjo" / "results.json").read_text())
    assert d["score"] == 7 and [t["name"] for t in d["tests"]] == ["test_a", "test_speed", "extra credit (bonus tier)"]
    assert "lab4.speed said so" in d["tests"][1]["output"] and "speedup: 4.2" in d["tests"][1]["output"]


def test_run_autograder_entry_point_for_labs_1_to_3(tmp_path):
    sub = tmp_path / "submission"
    sub.mkdir()
    src = REPO_ROOT / "assignments" / "source" / "lab1_loss_scaling" / "lab1_loss_scaling.ipynb"
    shutil.copy(src, sub / "lab1_loss_scaling.ipynb")
    seen = {}

    def fake(names, student, **kw):  # the harness's verdicts, without running the checks
        seen.update(names=names, file=Path(student).name, **kw)
        return [{"check": n, "ok": i != 1, "score": 1.0 if i != 1 else 0.0, "max_score": 1.0, "message": f"{n} ok",
                 "measurements": {"steps": 3}} for i, n in enumerate(names)]

    r = lms.run_gradescope("lab1", sub, tmp_path / "results" / "results.json", run_checks=fake)
    assert seen["file"] == "student_scaler.py" and seen["device"] == "cpu"
    d = json.loads((tmp_path / "results" / "results.json").read_text())
    assert d == r and {"score", "output", "tests"} <= set(d)
    cells = json.loads(src.read_text())["cells"]
    points = sum(c["metadata"]["nbgrader"].get("points", 0) for c in cells if c["metadata"].get("nbgrader", {}).get("grade"))
    assert sum(t["max_score"] for t in d["tests"]) == points and 0 < d["score"] < points
    assert all({"name", "score", "max_score", "output"} <= set(t) for t in d["tests"])
    with pytest.raises(LabkitError, match="no GPU"):
        lms.run_gradescope("lab4", sub, tmp_path / "r.json", run_checks=fake)
    script = (REPO_ROOT / "autograder" / "deploy" / "gradescope" / "run_autograder").read_text()
    assert "-m autograder gradescope" in script and os.access(REPO_ROOT / "autograder" / "deploy" / "gradescope" /
                                                            "run_autograder", os.X_OK)
    build_parser().parse_args(["gradescope", "lab2", "--submission", "/autograder/submission"])


def test_feedback_bundles_carry_the_total_late_note_and_measurements(tmp_path):
    due = dt.datetime(2025, 3, 4, tzinfo=UTC)
    times = tmp_path / "times.csv"
    times.write_text("student_id,submitted_at\nsmithjo,2025-03-04T10:00:00+00:00\n")
    out = _graded_folder(tmp_path, late.LatePolicy(due, per_day_pct=10, times_csv=str(times)))
    z = lms.feedback_bundles(out, tmp_path / "fb", submissions=tmp_path / "subs")
    names = zipfile.ZipFile(z).namelist()
    assert "smithjo_LATE_4242_77_feedback.html" in names and "leeann_lab_measurements.json" in names
    page = (tmp_path / "fb" / "smithjo" / "smithjo_LATE_4242_77_feedback.html").read_text()
    assert "total 6.4 points" in page and "1 day(s) late" in page and "nbgrader page" in page
    m = json.loads((tmp_path / "fb" / "smithjo" / "smithjo_LATE_4242_77_measurements.json").read_text())
    assert m["checks"][0]["measurements"]["speedup"] == 4.2 and m["late"]["days_late"] == 1
    assert "-0.6 points" in (out / "summary.txt").read_text()


# ------------------------------------------------------------------------------------------------ similarity


def test_a_renamed_and_reformatted_copy_is_flagged_and_independent_work_is_not():
    files = dict(similarity_class.SOLUTIONS, zed=similarity_class.COPY)
    pairs, stats = similarity.compare(files, similarity_class.STARTER)
    flagged = [(p.a, p.b) for p in pairs if p.flagged]
    assert flagged == [("ana", "zed")] and pairs[0].similarity > 0.9
    assert max(p.similarity for p in pairs if not p.flagged) < 0.3 and stats["compared"] == 7
    def toks(src):
        return [t for t, _ in similarity.tokens(src)]

    assert toks("x = foo(a, b,)\n") == toks("renamed   =  bar(c,\n  d)  # hi\n")
    assert toks("torch.isfinite(g)") != toks("torch.isnan(g)")  # library calls kept


def test_similarity_command_reads_notebooks_and_writes_text_and_json(tmp_path, capsys):
    course = rehearsal.build_toy_course(tmp_path / "course")
    subs = tmp_path / "subs"
    for sid, body in [*similarity_class.SOLUTIONS.items(), ("zed", similarity_class.COPY)]:
        (subs / sid).mkdir(parents=True)
        (subs / sid / f"{AID}.ipynb").write_bytes(_hand_in(body))
    (subs / "nada").mkdir()
    (subs / "nada" / "README.md").write_text("no code")
    starter = tmp_path / "starter.py"
    starter.write_text(similarity_class.STARTER)
    code = cli_main(["similarity", AID, "--submissions", str(subs), "--course", str(course), "--starter",
                     str(starter), "--out", str(tmp_path / "rep"), "--no-progress"])
    assert code == 0
    text = (tmp_path / "rep" / "similarity.txt").read_text()
    assert "FLAGGED: 1 pair(s)" in text and "== ana and zed" in text and "nada: no student module" in text
    d = json.loads((tmp_path / "rep" / "similarity.json").read_text())
    assert [(p["a"], p["b"]) for p in d["pairs"] if p["flagged"]] == [("ana", "zed")]
    assert "closest pairs" in capsys.readouterr().out
    assert "raise NotImplementedError" not in (similarity.starter_code(course, AID) or "")


# ------------------------------------------------------------------------------------------------ progress


def test_progress_prints_a_line_per_step_off_a_terminal(capsys):
    b = progress.bar(total=2, desc="grading toy", unit="student")
    assert isinstance(b, progress.LineBar)  # pytest's stderr is not a terminal
    b.set_postfix_str("alice: 5/5")
    b.update(1)
    b.update(1)
    b.close()
    progress.stage("writing outputs")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("grading toy: 1/2 student (alice: 5/5)") and err[1].startswith("grading toy: 2/2")
    assert err[2].endswith("writing outputs")
    assert "a  bb\n-  --\n1  2\n" == progress.table([[1, 2]], ["a", "bb"])


def test_deploy_files_run_the_documented_commands():
    d = REPO_ROOT / "autograder" / "deploy"
    sb, k8s = (d / "slurm_grade.sbatch").read_text(), (d / "k8s_grade.yaml").read_text()
    assert "#SBATCH --array" in sb and "#SBATCH --gres=gpu:1" in sb and '--shard "$K/$N"' in sb
    assert "-m autograder merge" in (d / "slurm_merge.sbatch").read_text()
    assert "--dependency=" in (d / "slurm_submit.sh").read_text()
    assert "completionMode: Indexed" in k8s and "nvidia.com/gpu: 1" in k8s and "JOB_COMPLETION_INDEX/$SHARDS" in k8s
    assert "-m autograder merge" in k8s
    readme = (REPO_ROOT / "assignments" / "README.md").read_text()
    for needle in ("slurm_submit.sh", "k8s_grade.yaml", "--shard", "python -m autograder merge",
                   "export grading", "similarity", "--roster roster.csv", "variant tag"):
        assert needle in readme, needle
    build_parser().parse_args(["grade", AID, "--submissions", "s", "--shard", "3/8", "--allow-ungradable"])
    assert build_parser().parse_args(["grade", AID, "--submissions", "s", "--roster", "r.csv"]).roster == "r.csv"
    build_parser().parse_args(["merge", "out", "a", "b", "--submissions", "s", "--due", "2025-01-01"])


# ------------------------------------------------------------------------------------------------ honest students


def _with_question(course: Path) -> None:
    """The toy's written answer after a locked question cell, as lab 1's: nbgrader's insertion of the missing
    answer looked for that question among the graded cells and raised KeyError."""
    path = course / "source" / AID / f"{AID}.ipynb"
    nb = nbformat.read(path, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == rehearsal.WRITTEN_ID)
    q = nbformat.v4.new_markdown_cell("**Question (read-only).** Why is the dot product faster?")
    q.metadata["nbgrader"] = {"grade": False, "solution": False, "locked": True, "grade_id": "written_question",
                              "schema_version": 3}
    q.id = "toy-question"
    nb.cells.insert(at, q)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def lms_class(tmp_path_factory):
    """A toy class (with a written answer) graded from LMS-named zips against a class list: jane_doe (an id with
    '_', beside a classmate jane) handed in from this release, old_timer2 through Canvas from a release before
    the speed test and the written answer were added (two adjacent cells: nbgrader's insertion raised KeyError)."""
    base = tmp_path_factory.mktemp("lms")
    _with_question(rehearsal.build_toy_course(base / "course", written=True))
    subs = base / "subs"
    subs.mkdir()

    def zipped(name: str, nb, release: str) -> None:
        with zipfile.ZipFile(subs / name, "w") as z:
            z.writestr(f"{AID}.ipynb", nbformat.writes(nb))
            z.writestr("handin.json", json.dumps({"lab": AID, "release": release, "variant_tag": ""}))

    now = nbformat.read(base / "course" / "source" / AID / f"{AID}.ipynb", as_version=4)
    first = next(c for c in now.cells if c.cell_type == "code")  # what jane saw: her written answer cites it
    first.outputs = [nbformat.v4.new_output("stream", name="stdout", text="on my laptop: 52.0 ms a batch\n")]
    zipped(f"jane_doe_{AID}_handin.zip", now, "0.1.0")
    old = rehearsal.toy_notebook(written=False)
    old.cells = [c for c in old.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "test_speed"]
    zipped(f"oldtimer_101_5551_{AID}_handin.zip", old, "0.0.9")
    roster = base / "roster.csv"
    roster.write_text("student_id,canvas_id\njane,\njane_doe,\nold_timer2,101\n")
    with pytest.raises(LabkitError) as stop:  # without the class list: jane_doe's id may be jane, so no grading
        grade.grade_class(AID, subs, _cfg(base, "no-roster"))
    rep = grade.grade_class(AID, subs, _cfg(base, "out", roster=str(roster)))
    return {"rep": rep, "stop": str(stop.value), "base": base}


def test_honest_hand_ins_from_an_id_with_underscores_and_an_old_release_get_full_marks(lms_class):
    by = {r.student_id: r for r in lms_class["rep"].results}
    assert set(by) == {"jane_doe", "old_timer2"}, by
    for r in by.values():
        auto = [c for c in r.cells if not c.get("manual")]
        assert r.status == "graded" and r.cause is None, (r.student_id, r.message, r.cause)
        assert [c["score"] for c in auto] == [c["max_score"] for c in auto] and sum(c["score"] for c in auto) == 5, \
            (r.student_id, r.cells)
    old = " ".join(by["old_timer2"].notes)
    assert "release 0.0.9" in old and f"test_speed, written_question, {rehearsal.WRITTEN_ID}" in old, old
    assert not any("lacks" in n for n in by["jane_doe"].notes)


def test_without_the_class_list_the_run_stops_naming_the_file_and_its_candidates(lms_class):
    stop = lms_class["stop"]
    assert f"jane_doe_{AID}_handin.zip" in stop and "'jane'" in stop and "'jane_doe'" in stop and "--roster" in stop
    assert not (lms_class["base"] / "no-roster" / "students").exists()  # nobody was graded


def test_similarity_and_merge_read_the_names_against_the_class_list_as_grading_did(lms_class, tmp_path):
    """The report a person reads beside the grades, and merge's list of who is missing, name jane_doe whole."""
    from autograder import merge
    from autograder.gradebook import similarity

    base = lms_class["base"]
    files, notes = similarity.class_files(base / "subs", AID, tmp_path / "s", roster=base / "roster.csv")
    assert set(files) <= {"jane_doe", "old_timer2"} and "jane_doe" in files, (files.keys(), notes)
    got = merge.expected_students(base / "subs", base / "roster.csv", assignment=AID, scratch=tmp_path / "m")
    assert got == {"jane", "jane_doe", "old_timer2"}


def test_the_marker_gets_each_notebook_as_handed_in_with_the_students_own_outputs(lms_class):
    """Written answers cite the student's own run; autograde re-executes the notebook, so its copy shows the
    grader's outputs. The plain copy as handed in sits beside the result (students/<id>/as_handed_in/)."""
    out = lms_class["base"] / "out"
    mine = out / "students" / "jane_doe" / "as_handed_in" / f"{AID}.ipynb"
    assert "on my laptop: 52.0 ms a batch" in mine.read_text()
    assert "on my laptop" not in (out / "autograded" / "jane_doe" / AID / f"{AID}.ipynb").read_text()
    nb = json.loads(mine.read_text())  # plain: text outputs only, markdown shown as written
    assert all(o["output_type"] in ("stream", "execute_result", "error", "display_data")
               for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"])

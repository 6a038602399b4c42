"""The instructor's batch grader: sandbox, intake, trusted re-runs, and a whole adversarial class on CPU.

The class is graded once (module fixture) the way an instructor would meet it: the CLI starts, is killed
mid-run, and the run is resumed; every fixture submission is then checked against the score it deserves.
The fixtures are generated from the toy assignment's source and release notebooks (autograder.rehearsal).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import psutil
import pytest

from autograder import course as courses
from autograder import grade, rehearsal, suite
from autograder.checks import harness, trusted
from autograder.intake import submissions as intake
from autograder.release.build import generate_release
from autograder.sandbox import jail
from autograder.sandbox import limits as sandbox
from labkit.env import REPO_ROOT, LabkitError

PY = sys.executable
AID = rehearsal.TOY_ID
# Variants graded in the batch. "renamed" is covered by the intake test, "patch_in_file" by the toy harness test.
SKIP_IN_BATCH = {"renamed", "patch_in_file"}
IN_BATCH = ["reference", "release", "wrong_fast", "tests_edited", "slow_correct", "tests_deleted", "patch_kernel",
            "cache", "infinite_loop", "deaf_loop", "kernel_crash", "memory_hog", "output_flood", "stderr_noise", "snoop",
            "vandal", "malformed", "no_notebook",
            # the hostile class: forge, reach the grader's files, kill, outlive, flood, steal, slow the baseline
            "forge_verdict", "reach_files", "kill_all", "daemon", "fork_flood", "import_reference", "spinner",
            "in_kernel", "cache_share_a", "cache_share_b",
            # fill the grader's disk: one endless file, deleted files held open, and from the checks' process
            "disk_fill", "disk_hidden", "disk_checks"]
CANARY = "instructor-only: the hidden answers are 42"
DISK_GB = 0.25  # under what the disk attacks write (1 GiB, 512 MiB), far over what an honest hand-in leaves


# ------------------------------------------------------------------------------------------------ sandbox


def _alive_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_sandbox_timeout_kills_the_whole_group(tmp_path):
    marker = f"sleep-marker-{os.getpid()}-a"
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)',"
            f" '{marker}']); time.sleep(60)")
    out = sandbox.run_limited([PY, "-c", code], cwd=tmp_path, limits=sandbox.Limits(wall_s=2.0))
    assert out.timed_out and out.cause() == "timeout" and out.returncode != 0
    assert out.wall_s < 20
    assert not _alive_with(marker)


def test_sandbox_memory_budget_and_address_space(tmp_path):
    hog = "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))\n"
    out = sandbox.run_limited([PY, "-c", hog], cwd=tmp_path,
                              limits=sandbox.Limits(wall_s=60, memory_bytes=400 * 2**20))
    assert out.out_of_memory and out.cause() == "memory" and out.peak_rss_bytes > 400 * 2**20
    out = sandbox.run_limited([PY, "-c", hog], cwd=tmp_path,
                              limits=sandbox.Limits(wall_s=60, memory_bytes=600 * 2**20, address_space=True))
    assert not out.out_of_memory and out.returncode == 1 and "MemoryError" in out.output


def test_sandbox_keeps_head_and_tail_of_a_flood(tmp_path):
    code = "import sys\nprint('FIRST')\nfor i in range(400000):\n    print('x' * 60)\nprint('LAST')\n"
    out = sandbox.run_limited([PY, "-c", code], cwd=tmp_path, limits=sandbox.Limits(wall_s=60, keep_output_bytes=4096))
    assert out.ok and out.output_bytes > 20 * 2**20
    assert out.output.startswith("FIRST") and out.output.rstrip().endswith("LAST") and len(out.output) < 10_000


# Threads by the thousand in one process: one process to a limit on processes, a process ID each to the machine.
_THREAD_FLOOD = ("import threading, time\nthreading.stack_size(1 << 16)\n"
                 "for _ in range(1000):\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                 "time.sleep(60)\n")


def test_sandbox_stops_a_thread_flood(tmp_path):
    out = sandbox.run_limited([PY, "-c", _THREAD_FLOOD], cwd=tmp_path,
                              limits=sandbox.Limits(wall_s=30, max_threads=200, poll_s=0.05))
    assert out.too_many_processes and out.cause() == "processes" and out.wall_s < 20


def test_a_hand_in_starting_threads_by_the_thousand_is_stopped(tmp_path):
    from autograder.sandbox import jail, remote

    if jail.probe():
        pytest.skip(jail.probe())
    (tmp_path / "s.py").write_text(_THREAD_FLOOD.replace("time.sleep(60)\n", "") + "def total(x):\n    return 0\n")
    r = remote.Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]),
                      student_file=tmp_path / "s.py", max_threads=200)
    try:
        with pytest.raises(remote.RemoteFailed) as e:
            r.call("toy.totals", {"arrays": [[1, 2]]}, timeout_s=30)
            time.sleep(2)  # the import finished before the watchdog's next look: the next call finds it stopped
            r.call("toy.totals", {"arrays": [[1, 2]]}, timeout_s=30)
        assert e.value.cause == "processes"
    finally:
        r.close()


def test_sandbox_kills_a_daemon_that_left_the_session(tmp_path):
    marker = f"daemon-marker-{os.getpid()}"
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'])\n"
            "    os._exit(0)\ntime.sleep(1)\n")
    out = sandbox.run_limited([PY, "-c", code], cwd=tmp_path, limits=sandbox.Limits(wall_s=30))
    assert out.ok and out.leftovers_killed >= 1
    assert not _alive_with(marker)


def test_a_students_compile_cache_reaches_their_runner_only(tmp_path):
    from autograder.checks import harness
    from autograder.sandbox import jail

    if jail.probe():
        pytest.skip(jail.probe())
    cache, box = tmp_path / "cache", tmp_path / "box"
    cache.mkdir()
    box.mkdir()
    code = ("import os; d = os.environ['TORCHINDUCTOR_CACHE_DIR']; os.makedirs(d, exist_ok=True); "
            "open(os.path.join(d, 'entry'), 'w').write('x'); print(d)")
    j = harness._jail_for(box, "cpu", "bwrap", cache=cache, baseline=False)
    out = subprocess.run(j.command([PY, "-c", code]), env=j.host_env({}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == jail.cache_env(jail.CACHE_VIEW)["TORCHINDUCTOR_CACHE_DIR"]
    assert (cache / "inductor" / "entry").read_text() == "x"  # the notebook's compile is there for the runner
    # The baseline never loads anything of the student's: not sandboxed (trusted code), and no cache of theirs.
    base = harness._jail_for(box, "cpu", "bwrap", cache=None, baseline=True)
    assert base.trusted and base.cache is None and "TORCHINDUCTOR_CACHE_DIR" not in base.host_env({})
    ctx = harness.Context(device="cpu", hardware="cpu", small=True, work_dir=tmp_path, student_file=box / "s.py",
                          sandbox="bwrap", cache=cache)
    assert ctx._jail(box, True).cache is None and ctx._jail(box, False).cache == cache


def test_killing_a_sandbox_does_not_wait_for_its_zombies(tmp_path):
    from autograder.sandbox import jail
    from autograder.sandbox.remote import Remote

    if jail.probe():
        pytest.skip(jail.probe())
    r = Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]))
    r.wait_ready()
    t0 = time.monotonic()
    r.close()
    assert time.monotonic() - t0 < 1.0  # it waited for the machine's init to reap them: 1-2 s per runner
    assert r.proc.poll() is not None


def test_freezing_a_hand_in_waits_until_its_work_inside_the_kernel_has_stopped(tmp_path):
    """While one side is timed the other is frozen. SIGSTOP alone left a helper inside a long system call using
    a core and memory bandwidth beside the baseline's timing; freeze() returns only once every thread of the
    hand-in has stopped, and nothing of it runs until thaw()."""
    from autograder.sandbox import jail
    from autograder.sandbox.remote import _STOPPED, Remote, _tasks

    if jail.probe():
        pytest.skip(jail.probe())
    if not hasattr(mmap, "MAP_POPULATE"):
        pytest.skip("no MAP_POPULATE on this platform")
    # the hostile class's helper (mmap calls that fault in 256 MiB each), and the toy's answer
    (tmp_path / "s.py").write_text(suite._IN_KERNEL + "\ndef total(x):\n    return int((x * x).sum())\n")
    r = Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]), student_file=tmp_path / "s.py")
    try:
        assert r.call("toy.totals", {"arrays": [[1, 2]]})[0] == {"totals": [5]}  # imports it: the helper starts

        def cpu(procs):
            return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())

        for _ in range(5):
            time.sleep(0.2)  # the helper is back at its mmap calls
            r.freeze()
            procs = r.members()
            states = [st for st, _ in _tasks(procs).values()]
            assert len(procs) >= 3 and set(states) <= _STOPPED  # bwrap, the runner and the helper: all threads
            before = cpu(procs)
            time.sleep(0.3)
            assert cpu(procs) == before
            r.thaw()
    finally:
        r.close()


def test_a_hand_in_that_cannot_be_frozen_is_stopped_with_that_cause(tmp_path, monkeypatch):
    """A thread that never stops (here: one reported running throughout) must not be timed beside: the runner is
    stopped and the check fails with the cause 'freeze', instead of the baseline being timed next to it."""
    from autograder.sandbox import jail, remote

    if jail.probe():
        pytest.skip(jail.probe())
    r = remote.Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]))
    try:
        r.wait_ready()
        monkeypatch.setattr(remote, "FREEZE_WAIT_S", 0.2)
        monkeypatch.setattr(remote, "_tasks", lambda procs: {(1, "1"): ("R", 0.0)})
        with pytest.raises(remote.RemoteFailed, match="kept running") as e:
            r.freeze()
        assert e.value.cause == "freeze" and r.cause == "freeze"
        r.proc.wait(timeout=10)  # killed, with everything it started
    finally:
        r.close()


# An honest hand-in: a thread runs a tool now and then. A freeze can stop the vfork child before its exec, and
# the thread then waits in the kernel (state D) for as long as the child is stopped, using no CPU.
_SUBPROCESS_THREAD = """import subprocess, threading

def _poll():
    while True:
        subprocess.run(["true"])

threading.Thread(target=_poll, daemon=True).start()

def total(x):
    return int((x * x).sum())
"""


def _toy_remote(tmp_path, code: str):
    from autograder.sandbox import jail
    from autograder.sandbox.remote import Remote

    if jail.probe():
        pytest.skip(jail.probe())
    (tmp_path / "s.py").write_text(code)
    r = Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]), student_file=tmp_path / "s.py")
    assert r.call("toy.totals", {"arrays": [[1, 2]]})[0] == {"totals": [5]}  # imports it: its threads start
    return r


def test_a_hand_in_that_wakes_while_frozen_fails_the_check(tmp_path):
    """Stopped when the timing starts is not stopped throughout: a process can have the kernel wake it (a POSIX
    timer that sends it SIGCONT once it has stopped, pushed back all the while it runs). Here the test sends the
    SIGCONT; check_frozen() finds the CPU the hand-in's spinners used after the freeze."""
    from autograder.sandbox import remote

    r = _toy_remote(tmp_path, suite._SPINNER + "\ndef total(x):\n    return int((x * x).sum())\n")
    try:
        r.freeze()
        for p in r.members():
            p.send_signal(signal.SIGCONT)
        time.sleep(0.3)  # the other side's timed call
        with pytest.raises(remote.RemoteFailed, match="ran while it was stopped") as e:
            r.check_frozen()
        assert e.value.cause == "freeze" and r.cause == "freeze"
    finally:
        r.close()


def test_a_thread_that_came_or_went_while_frozen_fails_the_check(tmp_path, monkeypatch):
    """A stopped thread can neither start another nor end, and one that woke, spent CPU and ended would take its
    CPU time out of the count: a thread set that changed is itself the sign that the side ran."""
    from autograder.sandbox import remote

    r = _toy_remote(tmp_path, "def total(x):\n    return int((x * x).sum())\n")
    try:
        r.freeze()
        frozen = dict(r._frozen_tasks)
        gone = dict(list(frozen.items())[:-1])  # the last thread ended; its CPU time went with it
        monkeypatch.setattr(remote, "_tasks", lambda procs: gone)
        with pytest.raises(remote.RemoteFailed, match="ran while it was stopped"):
            r.check_frozen()
    finally:
        r.close()


def test_an_honest_thread_running_tools_survives_many_freezes(tmp_path):
    """A thread waiting in the kernel for a stopped vfork child uses no CPU: it counts as still, and an honest
    hand-in is never failed for it."""
    r = _toy_remote(tmp_path, _SUBPROCESS_THREAD)
    try:
        for _ in range(300):
            r.freeze()
            time.sleep(0.005)
            r.check_frozen()
            r.thaw()
            time.sleep(0.005)
        assert r.cause is None
    finally:
        r.close()


# ------------------------------------------------------------------------------------------------ intake


def _nb_bytes(src: str = "print(1)") -> bytes:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
    return nbformat.writes(nb).encode()


def test_intake_understands_folders_lms_files_and_zips(tmp_path):
    s = tmp_path / "subs"
    (s / "alice").mkdir(parents=True)
    (s / "alice" / "lab.ipynb").write_bytes(_nb_bytes())
    (s / "alice" / "helper.py").write_text("x = 1\n")
    (s / "bob" / "lab").mkdir(parents=True)  # nbgrader's submitted/<student>/<assignment>/ layout
    (s / "bob" / "lab" / "lab.ipynb").write_bytes(_nb_bytes())
    (s / "carol").mkdir()
    (s / "carol" / "Copy of lab (1).ipynb").write_bytes(_nb_bytes())  # the only notebook, under another name
    (s / "dave").mkdir()
    (s / "dave" / "a.ipynb").write_bytes(_nb_bytes())
    (s / "dave" / "b.ipynb").write_bytes(_nb_bytes())
    (s / "erin").mkdir()
    (s / "erin" / "lab.ipynb").write_text('{"cells": [')
    (s / "frank").mkdir()
    (s / "frank" / "README.md").write_text("sorry")
    (s / "gus_12345_678_lab.ipynb").write_bytes(_nb_bytes())  # LMS download, flat
    with zipfile.ZipFile(s / "hana_lab.zip", "w") as z:
        z.writestr("lab.ipynb", _nb_bytes())
    with zipfile.ZipFile(s / "ivan_evil.zip", "w") as z:
        z.writestr("../../escape.txt", "x")
    (s / "notes.txt").write_text("junk")
    (s / "weird name!").mkdir()
    (s / "weird name!" / "lab.ipynb").write_bytes(_nb_bytes())
    for shadow in ("n07_kim", "-n07_kim"):  # a second folder that once mapped to a classmate's id
        (s / shadow).mkdir()
        (s / shadow / "lab.ipynb").write_bytes(_nb_bytes())
    with zipfile.ZipFile(s / "lu_kim_lab.zip", "w") as z:  # an id that may hold '_': lu_kim or lu?
        z.writestr("lab.ipynb", _nb_bytes())

    got = intake.collect(s, "lab", scratch=tmp_path / "scratch")
    by = {x.student_id: x for x in got.submissions}
    shadow = next(x for x in by if x.startswith("n07_kim_x"))  # '-n07_kim' is not n07_kim: both are graded
    weird = next(x for x in by if x.startswith("weird_name_x"))
    assert set(by) == {"alice", "bob", "carol", "dave", "erin", "frank", "gus", "hana", "ivan", weird,
                       "n07_kim", shadow}
    assert by["n07_kim"].problem is None and by[shadow].problem is None and by[shadow].origin == "-n07_kim"
    assert any("'lu'" in u and "'lu_kim'" in u and "--roster" in u for u in got.unmatched)
    assert by["alice"].problem is None and set(by["alice"].files) == {"lab.ipynb", "helper.py"}
    assert by["bob"].problem is None and by["bob"].notebook == "lab.ipynb"
    assert by["carol"].problem is None and any("only notebook" in n for n in by["carol"].notes)
    assert by["dave"].cause == "no notebook" and "several notebooks" in by["dave"].problem
    assert by["erin"].cause == "invalid notebook" and "JSON" in by["erin"].problem
    assert by["frank"].cause == "no notebook"
    assert by["gus"].problem is None and by["hana"].problem is None
    assert by["ivan"].cause == "bad archive" and "outside" in by["ivan"].problem
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "scratch" / "escape.txt").exists()
    assert any("notes.txt" in j for j in got.junk)
    assert any("graded as student id" in n for n in by[weird].notes)
    assert by["alice"].digest and by["alice"].digest != by["bob"].digest


def test_intake_takes_one_archive_and_refuses_bad_input(tmp_path):
    arch = tmp_path / "download.zip"
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("submissions/amy/lab.ipynb", _nb_bytes())
        z.writestr("submissions/ben/lab.ipynb", _nb_bytes())
    got = intake.collect(arch, "lab", scratch=tmp_path / "s")
    assert [x.student_id for x in got.submissions] == ["amy", "ben"]
    with pytest.raises(LabkitError, match="does not exist"):
        intake.collect(tmp_path / "nope", "lab", scratch=tmp_path / "s")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(LabkitError, match="not a .zip"):
        intake.collect(tmp_path / "f.txt", "lab", scratch=tmp_path / "s")
    with pytest.raises(LabkitError, match="student_id"):
        intake.collect(tmp_path, "lab", scratch=tmp_path / "s", lms_regex="(?P<who>.+)")


# ------------------------------------------------------------------------------------------------ trusted checks


def test_find_calls_in_the_course_and_the_toy(tmp_path):
    course = rehearsal.build_toy_course(tmp_path / "c")
    calls = trusted.find_calls(course / "source" / AID / f"{AID}.ipynb")
    assert [(c.cell, c.check, c.student_file, c.kind) for c in calls] == [
        ("test_correct", "toy.correct", "pipeline.py", "run_check"),
        ("test_correct", "toy.hidden", "pipeline.py", "run_check"),
        ("test_speed", rehearsal.CHECK, "pipeline.py", "run_check")]
    lab1 = REPO_ROOT / "assignments" / "source" / "lab1_loss_scaling" / "lab1_loss_scaling.ipynb"
    if lab1.exists():
        calls = trusted.find_calls(lab1)
        assert calls and all(c.kind == "grade" and c.student_file.endswith(".py") for c in calls)
        assert any(c.check.startswith("lab1.") for c in calls)


def test_verdicts_rescore_cells_and_flag_cells_scored_in_the_notebook():
    g = trusted.HarnessCall("nb", "c1", "lab2.loader_speed", "f.py", "grade")
    v = trusted.interpret(g, {"check": "lab2.loader_speed", "ok": True, "score": 2.0, "max_score": 4.0,
                              "gradable": True, "message": "2.1x",
                              "measurements": {"speedup": 2.1, "baseline_samples_per_s": 100,
                                               "packed_samples_per_s": 210}})
    assert v.passed is True and v.fraction == 0.5
    assert trusted.headline(v.numbers) == {"ratio": 2.1, "baseline_img_s": 100, "student_img_s": 210}
    ng = trusted.interpret(g, {"ok": False, "gradable": False, "score": 0, "max_score": 4, "message": "needs CUDA"})
    assert ng.passed is None and ng.fraction == 0
    r = trusted.HarnessCall("nb", "c2", "toy.speed", "f.py", "run_check")
    assert trusted.interpret(r, {"passed": True}).fraction == 1.0
    assert trusted.interpret(r, {"passed": False}).fraction == 0.0
    cells = [{"notebook": "nb", "cell": "c1", "score": 4.0, "max_score": 4.0},
             {"notebook": "nb", "cell": "c2", "score": 3.0, "max_score": 3.0},
             {"notebook": "nb", "cell": "c3", "score": 1.0, "max_score": 1.0}]
    flags = trusted.cell_scores([g, r], {"lab2.loader_speed": v, "toy.speed": trusted.interpret(r, {"passed": False})},
                                cells)
    assert [c["score"] for c in cells] == [2.0, 0.0, 1.0]
    assert [c.get("kernel_score") for c in cells] == [4.0, 3.0, None]
    assert len(flags) == 1 and flags[0].startswith("c3: scored inside the notebook")


def test_toy_harness_rejects_replaced_clocks_and_wrong_answers(tmp_path):
    for body, ok, why in [(rehearsal.REFERENCE, True, "enough"), (rehearsal.BODIES["timer_patch"], False, "need"),
                          (rehearsal.BODIES["wrong_fast"], False, "wrong")]:
        f = tmp_path / "pipeline.py"
        f.write_text(body)
        v = rehearsal.run_check(rehearsal.CHECK, str(f))
        assert v["passed"] is ok and why in v["message"], v


# ------------------------------------------------------------------------------------------------ bad input


def test_cli_bad_input_is_one_clear_line(tmp_path, capsys):
    from autograder.__main__ import main

    course = rehearsal.build_toy_course(tmp_path / "c")
    out = tmp_path / "out"
    rc = main(["grade", AID, "--submissions", str(tmp_path / "missing"), "--course", str(course), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert "does not exist" in (out / "grade_log.txt").read_text()
    assert "does not exist" in (out / "summary.txt").read_text()
    (tmp_path / "subs").mkdir()
    rc = main(["grade", "lab9_nope", "--submissions", str(tmp_path / "subs"), "--course", str(course),
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown assignment 'lab9_nope'" in err and AID in err
    rc = main(["grade", AID, "--submissions", str(tmp_path / "subs"), "--course", str(tmp_path), "--out", str(out)])
    assert rc == 2 and "not an nbgrader course" in capsys.readouterr().err
    (tmp_path / "subs" / "notes.txt").write_text("no hand-ins here")
    rc = main(["grade", AID, "--submissions", str(tmp_path / "subs"), "--course", str(course), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "no student hand-ins found" in err and "notes.txt" in err, err
    assert not (out / "grades.csv").exists() and not (out / "feedback").exists()


def test_grading_refuses_to_start_without_a_sandbox_unless_submissions_are_trusted(tmp_path, monkeypatch):
    from autograder.sandbox import jail

    course = rehearsal.build_toy_course(tmp_path / "c")
    (tmp_path / "subs" / "amy").mkdir(parents=True)
    monkeypatch.setattr(jail, "probe", lambda: "bubblewrap (bwrap) is not installed")
    cfg = grade.GradeConfig(course=str(course), out=str(tmp_path / "out"), progress=False)
    with pytest.raises(LabkitError, match="cannot sandbox the students' code: bubblewrap .* --trusted-submissions"):
        grade.grade_class(AID, tmp_path / "subs", cfg)
    assert not (tmp_path / "out" / "students").exists()  # refused before anything was graded
    monkeypatch.setattr(jail, "probe", lambda: None)
    with pytest.raises(LabkitError, match="re-run outside them unless the submissions are trusted"):
        grade.grade_class(AID, tmp_path / "subs", grade.GradeConfig(course=str(course), out=str(tmp_path / "o2"),
                                                                    trusted_recheck=False, progress=False))


def test_harness_cli_refuses_what_is_not_a_module_and_notebooks_that_are_not(tmp_path):
    f = tmp_path / "answers.json"
    f.write_text("{}")
    p = subprocess.run([PY, "-m", "autograder.harness", "lab1", str(f)], capture_output=True, text=True,
                       cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 2 and "not a .py file" in p.stderr and "Error" not in p.stderr, p.stderr
    assert "JSON without the notebook fields" in intake.check_notebook(b"{}", "lab.ipynb")


# ------------------------------------------------------------------------------------------------ the class


def _cli(cls: Path, work: Path, *extra: str) -> list[str]:
    return [PY, "-m", "autograder", "grade", AID, "--submissions", str(cls / "subs"), "--course", str(cls / "course"),
            "--out", str(cls / "out"), "--work", str(work), "--preset", "quick", "--cell-timeout", "20",
            "--timeout", "120", "--memory-gb", "2.5", "--disk-gb", str(DISK_GB), "--jobs", "2", "--harness", "autograder.rehearsal",
            "--no-progress", *extra]


def _config(cls: Path, work: Path) -> grade.GradeConfig:
    return grade.GradeConfig(course=str(cls / "course"), out=str(cls / "out"), work=str(work), cell_timeout_s=20,
                             wall_timeout_s=120, memory_gb=2.5, disk_gb=DISK_GB, harness_timeout_s=300, jobs=2,
                             harness_module="autograder.rehearsal", progress=False)


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """Build the class, start grading with the CLI, kill it mid-run, resume; returns what each stage saw."""
    base = tmp_path_factory.mktemp("klass")
    cls, work = base / "class", base / "work"  # the scratch folder lies outside what the vandal can reach
    course = rehearsal.build_toy_course(cls / "course")
    release = generate_release(course, AID, base / "release")
    canary = base / "instructor" / "secret.txt"
    canary.parent.mkdir()
    canary.write_text(CANARY)
    grader_files = {p: p.read_bytes() for p in sorted((REPO_ROOT / "autograder").rglob("*.py"))}
    builder = suite.SuiteBuilder(course / "source" / AID / f"{AID}.ipynb", release, AID, rehearsal.BODIES)
    variants = [v for v in builder.variants(vandal_root=cls, canary=canary) if v.name not in SKIP_IN_BATCH]
    assert sorted(v.name for v in variants) == sorted(IN_BATCH)
    suite.write_submissions(variants, cls / "subs")
    (cls / "subs" / "notes.txt").write_text("not a submission")

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(_cli(cls, work), cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    markers = []
    while time.monotonic() < deadline and proc.poll() is None:
        markers = sorted((cls / "out" / "students").glob("*/result.json"))
        if len(markers) >= 3:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {m.parent.name: json.loads(m.read_text())["finished_at"] for m in
              (cls / "out" / "students").glob("*/result.json")}
    cfg = _config(cls, work)
    rep = grade.grade_class(AID, cls / "subs", cfg)
    return {"cls": cls, "work": work, "builder": builder, "variants": variants, "before": before, "report": rep,
            "course": course, "cfg": cfg, "killed_pid": proc.pid, "canary": canary, "grader_files": grader_files,
            "hand_ins": {p: p.read_bytes() for p in sorted((cls / "subs").rglob("*")) if p.is_file()}}


def test_validate_source_passes_and_release_fails(graded_class, tmp_path):
    env = courses.py_env()
    course = rehearsal.build_toy_course(tmp_path / "c")  # a fresh copy: the vandal wrote over the class's
    for nb, ok in [(course / "source" / AID / f"{AID}.ipynb", True), (tmp_path / f"{AID}.ipynb", False)]:
        if not ok:
            nb.write_text(json.dumps(graded_class["builder"].release))
        out = subprocess.run([PY, "-m", "nbgrader", "validate", str(nb)], capture_output=True, text=True,
                             env=env, cwd=nb.parent, timeout=300)
        assert ("Success! Your notebook passes all the tests." in out.stdout) is ok, out.stdout[-2000:]


@pytest.mark.parametrize("name", IN_BATCH)
def test_each_submission_gets_what_it_deserves(graded_class, name):
    v = next(x for x in graded_class["variants"] if x.name == name)
    r = next(x for x in graded_class["report"].results if x.student_id == name)
    assert suite.check(v, r, r.cells, graded_class["builder"].speed_cells) == []


def test_a_hand_in_filling_the_disk_is_stopped_and_told_why(graded_class):
    by = {r.student_id: r for r in graded_class["report"].results}
    cap = f"left more than {DISK_GB * 1024:g} MiB of files"
    for name in ("disk_fill", "disk_hidden"):  # the notebook's run: not graded
        assert by[name].cause == "disk" and cap in by[name].message, by[name].message
    failed = [c for c in by["disk_checks"].checks if not c["passed"]]  # the checks' process: those checks fail
    hidden = [c for c in failed if harness.CHECKS[c["check"]].hidden]  # and a hidden one says no more than that
    assert hidden and all(c["message"] == harness.WITHHELD for c in hidden), hidden
    assert len(failed) > len(hidden) and all(cap in c["message"] for c in failed if c not in hidden), failed
    left = [p for p in (graded_class["work"]).rglob("*.bin")]
    assert all(p.stat().st_size <= DISK_GB * 2**30 + 1 for p in left)  # no file past the cap, wherever it was


def test_the_run_survived_a_kill_and_resumed_without_regrading(graded_class):
    before, rep = graded_class["before"], graded_class["report"]
    assert 1 <= len(before) < len(graded_class["variants"])
    by = {r.student_id: r for r in rep.results}
    for sid, finished in before.items():
        assert by[sid].finished_at == finished  # graded once, before the kill
    assert rep.graded_now == len(graded_class["variants"]) - len(before)
    assert len(rep.results) == len(graded_class["variants"])
    out = graded_class["cls"] / "out"
    assert not list(out.glob("students/*/running.json"))
    assert not list(Path("/tmp").glob(f"lk-sock-{graded_class['killed_pid']}-*"))  # its kernels' socket folders
    for p in psutil.process_iter(["pid"]):  # nothing still working in the scratch folder
        try:
            assert not Path(p.cwd()).is_relative_to(graded_class["work"]), p.cmdline()
        except (psutil.Error, OSError):
            pass


def test_outputs_grades_csv_gradebook_feedback_summary(graded_class):
    rep, out = graded_class["report"], graded_class["cls"] / "out"
    import csv

    rows = {r["student_id"]: r for r in csv.DictReader((out / "grades.csv").open())}
    assert set(rows) == {r.student_id for r in rep.results}
    for r in rep.results:
        assert float(rows[r.student_id]["score"]) == r.score
        assert float(rows[r.student_id]["test_speed"]) == next(c["score"] for c in r.cells if c["cell"] == "test_speed")
    ref = rows["reference"]
    assert float(ref["ratio"]) > rehearsal.REQUIRED_RATIO and float(ref["student_img_s"]) > float(ref["baseline_img_s"])
    assert ref["card"].startswith("CPU") and ref["hardware"] == "cpu" and float(ref["wall_s"]) > 0

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gb:
        merged = {s.student.id: s.score for s in gb.assignment_submissions(AID)}
    assert merged == {r.student_id: r.score for r in rep.results}

    for r in rep.results:
        page = (out / "feedback" / r.student_id / AID / f"{AID}.html").read_text()
        assert "labkit-grade-summary" in page and f"{r.score:g} / {r.max_score:g} points" in page
        assert "default_rng(7)" not in page  # a line of the hidden test
    assert "baseline per s" in (out / "feedback" / "reference" / AID / f"{AID}.html").read_text()
    summary = (out / "summary.txt").read_text()
    assert "failures by cause:" in summary and "kernel died" in summary and "notes.txt" in summary
    assert "notes.txt" in (out / "grade_log.txt").read_text()
    snooped = nbformat.read(out / "autograded" / "snoop" / AID / f"{AID}.ipynb", as_version=4)
    said = "".join(o.get("text", "") for c in snooped.cells if c.cell_type == "code" for o in c.outputs)
    # In the sandbox the notebook sees its own graded copy and gradebook (whose hidden test cells name the hidden
    # checks, never their inputs), but no source notebook: no solution to steal.
    assert "snooping found" in said
    assert not [ln for ln in said.splitlines() if "FOUND" in ln and "/source/" in ln]
    # the spooled hand-ins are outside every sandbox's view (the cell's own source is in `said`, hence the start)
    assert not [ln for ln in said.splitlines() if ln.startswith("CLASSMATE HAND-IN FOUND in ")]


def test_the_hostile_class_reached_nothing_outside_its_sandbox(graded_class):
    """Students read, rewrote, signalled and outlived what they could: none of it reached the grader's code, the
    instructor's files, the other hand-ins or the outputs, and every verdict came from the trusted side."""
    rep, out = graded_class["report"], graded_class["cls"] / "out"
    assert graded_class["canary"].read_text() == CANARY
    assert {p: p.read_bytes() for p in graded_class["grader_files"]} == graded_class["grader_files"]
    assert {p: p.read_bytes() for p in graded_class["hand_ins"]} == graded_class["hand_ins"]
    assert all(r.sandbox == "bwrap" for r in rep.results if r.status == "graded")
    reach = nbformat.read(out / "autograded" / "reach_files" / AID / f"{AID}.ipynb", as_version=4)
    said = "".join(o.get("text", "") for c in reach.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # All it could read was its own sandbox (its /proc/1 is bubblewrap's, started with an empty environment).
    read = [ln for ln in said.splitlines() if ln.startswith("READ ")]
    assert all(ln.startswith("READ /proc/1/environ b'PATH=/usr/bin:/bin") for ln in read), read
    assert "rewrote 0" in said and CANARY not in said and "LABKIT_GRADER_TOKEN" not in said, said[-2000:]
    page = (out / "feedback" / "reach_files" / AID / f"{AID}.html").read_text()
    assert CANARY not in page and "REQUIRED_RATIO" not in page
    key = grade.result_key(out)
    for r in rep.results:  # every done-marker is the grader's own: its MAC verifies
        assert grade.load_result(out / "students" / r.student_id / "result.json", key) is not None
    assert "daemon was here" not in (out / "grades.csv").read_text()


def test_vandal_changed_nothing_that_counts(graded_class):
    rep = graded_class["report"]
    # The vandal's code ran in the sandbox, which shows it nothing of the class folder: nothing to undo.
    vandal = next(r for r in rep.results if r.student_id == "vandal")
    assert vandal.score == vandal.max_score
    assert (graded_class["cls"] / "subs" / "reference" / f"{AID}.ipynb").read_text() != "vandalised"
    assert not rep.restored
    for r in rep.results:
        marker = json.loads((graded_class["cls"] / "out" / "students" / r.student_id / "result.json").read_text())
        assert marker["score"] == r.score


def test_rerun_is_idempotent_and_regrades_only_a_changed_hand_in(graded_class):
    cls, variants = graded_class["cls"], graded_class["variants"]
    # Put back what the vandal destroyed, as an instructor would from their download.
    rehearsal.build_toy_course(cls / "course")
    suite.write_submissions(variants, cls / "subs")
    csv_before = (cls / "out" / "grades.csv").read_text()
    again = grade.grade_class(AID, cls / "subs", graded_class["cfg"])
    assert again.graded_now == 0 and (cls / "out" / "grades.csv").read_text() == csv_before
    # A done-marker rewritten by anyone but the grader (the digests recomputed, the MAC guessed) is regraded.
    marker = cls / "out" / "students" / "wrong_fast" / "result.json"
    forged = json.loads(marker.read_text())
    forged.update(score=forged["max_score"], message="forged")
    marker.write_text(json.dumps(forged))
    forged_run = grade.grade_class(AID, cls / "subs", graded_class["cfg"])
    assert forged_run.graded_now == 1
    assert {r.student_id: r.score for r in forged_run.results} == {r.student_id: r.score for r in again.results}
    csv_before = (cls / "out" / "grades.csv").read_text()
    ref_nb = next(v for v in variants if v.name == "reference").files[f"{AID}.ipynb"]
    (cls / "subs" / "release" / f"{AID}.ipynb").write_bytes(ref_nb)
    third = grade.grade_class(AID, cls / "subs", graded_class["cfg"])
    assert third.graded_now == 1
    by = {r.student_id: r for r in third.results}
    assert by["release"].score == by["release"].max_score
    assert by["slow_correct"].finished_at == {r.student_id: r for r in again.results}["slow_correct"].finished_at


# ------------------------------------------------------------------------------------------------ benchmarks


def test_reliability_benchmark_runs_on_cpu_without_jupyter(tmp_results):
    # The GPU machine has no Jupyter stack: block it, then run the script as its command line would.
    code = ("import runpy, sys\n"
            "for m in ('nbformat', 'nbgrader', 'nbclient', 'nbconvert', 'jupyter_client', 'IPython'):\n"
            "    sys.modules[m] = None\n"
            f"sys.argv = ['grade_reliability.py', '--quick', '--check', {rehearsal.CHECK!r}, '--runs', '2', "
            f"'--out', {str(tmp_results)!r}]\n"
            "runpy.run_path('benchmarks/grade_reliability.py', run_name='__main__')\n")
    out = subprocess.run([PY, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads((tmp_results / "grade_reliability.json").read_text())
    assert d["check"] == rehearsal.CHECK and d["summary"]["runs"] == 2 and len(d["runs"]) == 2
    assert d["summary"]["false_failures"] == 0 and d["summary"]["ratio_min"] > rehearsal.REQUIRED_RATIO
    assert d["env"]["device_name"] and d["env"]["command"]


def test_class_benchmark_survives_its_own_kill(tmp_results):
    out = subprocess.run([PY, "benchmarks/grade_class.py", "--quick", "--students", "2", "--kill-after", "1",
                          "--out", str(tmp_results)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    d = json.loads((tmp_results / "grade_class_cpu.json").read_text())
    assert out.returncode == 0 and d["nothing_lost"], (out.stdout[-3000:], d.get("lost"))
    assert d["students"] == 2 and d["done_before_kill"] >= 1 and d["killed"]
    assert d["per_submission_s"]["n"] == 2 and d["per_submission_s"]["median"] > 0


# ------------------------------------------------------------------------------------------------ the real speed lab

LAB2 = "lab2_data_pipeline"
_LAB2_YIELD = "            yield (x.float() / 255 - MEAN) / STD, self.labels[idx]"


@pytest.fixture(scope="module")
def graded_lab2(tmp_path_factory):
    """A few hand-ins of the course's CPU-gradable speed lab, graded with the real harness."""
    src = REPO_ROOT / "assignments" / "source" / LAB2 / f"{LAB2}.ipynb"
    if not src.exists():
        pytest.skip(f"{LAB2} is not in assignments/source")
    base = tmp_path_factory.mktemp("lab2")
    release = generate_release(REPO_ROOT / "assignments", LAB2, base / "release")
    builder = suite.SuiteBuilder(src, release, LAB2)
    body = builder.reference[builder.target[0]].split("\n", 1)[1]
    if _LAB2_YIELD not in body:
        pytest.skip("the lab 2 reference changed shape: update the slow variant")
    # Correct but slow: every batch waits 400 ms, as if read from a slow disk. At 50 ms it was slow only beside a
    # fast baseline: on 2 busy cores the naive loader ran 429 samples/s and the waiting one 4.85x that (a tier).
    # At 400 ms it stays under 2x (the lowest tier) down to a baseline of 160 samples/s.
    builder.bodies["slow_correct"] = body.replace(_LAB2_YIELD, "            __import__('time').sleep(0.4)\n"
                                                  + _LAB2_YIELD)
    variants = [v for v in builder.variants() if v.name in ("reference", "release", "patch_kernel")]
    suite.write_submissions(variants, base / "subs")
    cfg = grade.GradeConfig(course=str(REPO_ROOT / "assignments"), out=str(base / "out"), work=str(base / "work"),
                            cell_timeout_s=300, wall_timeout_s=600, memory_gb=4, jobs=2, progress=False)
    return builder, variants, grade.grade_class(LAB2, base / "subs", cfg)


def test_lab2_submissions_get_what_they_deserve_with_the_real_harness(graded_lab2):
    builder, variants, rep = graded_lab2
    assert builder.speed_cells and all(c.kind == "grade" for c in builder.calls)
    by = {r.student_id: r for r in rep.results}
    problems = [p for v in variants for p in suite.check(v, by.get(v.name), by[v.name].cells, builder.speed_cells)]
    assert problems == []
    speed = next(c for c in by["reference"].checks if c["check"] == "lab2.loader_speed")
    assert speed["ratio"] > 1 and speed["student_img_s"] > speed["baseline_img_s"]
    # every auto-graded cell's score is the trusted run's; the written answer waits for its grader
    assert all(c["source"] == "trusted" for c in by["patch_kernel"].cells if not c.get("manual"))
    assert [c for c in by["reference"].cells if c.get("manual")] and by["reference"].cells


def test_kernels_use_private_sockets_so_a_taken_port_cannot_kill_them(tmp_path):
    """Two students graded side by side once raced for a localhost port and one kernel died before running a
    line ("Address already in use"). Kernels now talk over Unix sockets in a private folder: even a course
    config that pins the kernel to a port someone else holds grades normally, and the folder is removed."""
    import socket

    if os.name != "posix":
        pytest.skip("Unix sockets: POSIX only (elsewhere kernels keep TCP)")
    course = rehearsal.build_toy_course(tmp_path / "course")
    release = generate_release(course, AID, tmp_path / "release")
    builder = suite.SuiteBuilder(course / "source" / AID / f"{AID}.ipynb", release, AID, rehearsal.BODIES)
    suite.write_submissions([v for v in builder.variants() if v.name == "reference"], tmp_path / "subs")
    before = set(Path("/tmp").glob("lk-sock-*"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (course / "nbgrader_config.py").open("a") as f:
            # the port another kernel won (jupyter_client's port cache would otherwise pick a free one):
            # over TCP this kernel dies before its first line, exactly as in the race
            f.write(f"c.KernelManager.cache_ports = False\nc.KernelManager.shell_port = {port}\n")
        cfg = grade.GradeConfig(course=str(course), out=str(tmp_path / "out"), work=str(tmp_path / "work"),
                                cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=1,
                                harness_module="autograder.rehearsal", progress=False)
        rep = grade.grade_class(AID, tmp_path / "subs", cfg)
    (r,) = rep.results
    assert r.status == "graded" and r.cause is None, (r.cause, r.message)
    assert next(c for c in r.cells if c["cell"] == "test_correct")["score"] == 2.0
    assert set(Path("/tmp").glob("lk-sock-*")) <= before  # the socket folder went with the run
    died = sandbox.Outcome(1, 5.0, output="RuntimeError: Kernel died before replying to kernel_info")
    assert grade._kernel_cause(died) == "kernel did not start"  # not blamed on code that never ran


def test_reading_back_what_a_sandbox_left_follows_no_link_and_takes_only_small_regular_files(tmp_path):
    """sandbox.read_left: the grader's only way to read a file from a folder student code could write."""
    import os

    from autograder.sandbox.limits import LeftFileError, TooLarge, left_folder, read_left

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "mine.py").write_text("x = 1\n")
    (tmp_path / "elsewhere.py").write_text("someone else's\n")
    os.symlink(tmp_path / "elsewhere.py", tmp_path / "a" / "b" / "link.py")
    os.symlink(tmp_path / "a", tmp_path / "via")
    os.mkfifo(tmp_path / "a" / "b" / "pipe.py")
    (tmp_path / "a" / "big.py").write_bytes(b"#" * 100)
    assert read_left(tmp_path, "a/b/mine.py") == b"x = 1\n"
    assert left_folder(tmp_path, "a/b") == tmp_path / "a" / "b"
    for rel in ("a/b/link.py", "via/b/mine.py", "a/b/pipe.py", "a/b", "../elsewhere.py", "/etc/passwd"):
        with pytest.raises(LeftFileError):
            read_left(tmp_path, rel)
    with pytest.raises(TooLarge, match="larger than 10 bytes"):  # a LeftFileError the grader may read past
        read_left(tmp_path, "a/big.py", limit=10)
    with pytest.raises(FileNotFoundError):
        read_left(tmp_path, "a/b/none.py")


def test_nbgrader_starts_without_the_iri_checker_and_still_validates_notebooks(tmp_path):
    """autograder.base.nbstart: the grader's nbgrader processes leave out rfc3987_syntax (1.3 s of grammar building each),
    and nbformat's validation, which does not use it, still rejects a broken notebook."""
    from autograder.base.nbstart import nbgrader_command

    out = subprocess.run(nbgrader_command("--version"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    code = ("import sys; from autograder.base.nbstart import skip_iri_checker; skip_iri_checker(); import nbformat\n"
            "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('x = 1')]); nbformat.validate(nb)\n"
            "nb.cells[0]['cell_type'] = 'nonsense'\n"
            "try:\n    nbformat.validate(nb)\nexcept nbformat.ValidationError:\n    print('rejected')\n"
            "print('rfc3987_syntax' in sys.modules and sys.modules['rfc3987_syntax'] is not None)\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.stdout.split() == ["rejected", "False"], (out.stdout, out.stderr[-2000:])


def test_a_graded_notebook_rewritten_into_millions_of_values_is_refused_unread_in_little_memory(tmp_path):
    """A helper outliving the kernel can rewrite the graded notebook after nbgrader wrote it (as the hostile class's
    xena does). 60 MiB of `[],` (20 million values) would take json.loads over 1.3 GiB in the grader's process, and nbformat's
    validation, which read it twice more, far more: now the grader counts its values first and refuses it unread,
    and its other readers (the cell notes, the written-answer seal) never validate it."""
    import time
    import tracemalloc

    from autograder import course as courses
    from autograder.gradebook import manual
    from autograder.sandbox.limits import MAX_JSON_VALUES, LeftFileError, load_left_json

    huge = b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [' + b"[]," * (20 * 2**20) + b"[]]}"
    deep = b'{"cells": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    graded = tmp_path / "lab.ipynb"
    graded.write_bytes(huge)
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(LeftFileError, match=f"more than {MAX_JSON_VALUES:,} JSON values"):
        courses._check_grade_ids(huge, Path("autograded/s/lab/lab.ipynb"))
    with pytest.raises(LeftFileError, match="nested deeper"):
        courses._check_grade_ids(deep, Path("lab.ipynb"))
    assert grade._notebook_notes([graded], 60) == []
    assert manual._answered(graded, "answer", "released checksum")  # unreadable: a person looks at it
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 200 * 2**20 and time.perf_counter() - t0 < 20, (peak, time.perf_counter() - t0)
    # take_graded leaves such a notebook out of the grader's copy, and one over MAX_LEFT_BYTES too (an honest print
    # of 70 MB used to fail as "tampered files", 0 points); grade.py then scores without it, and says so
    from types import SimpleNamespace

    course = SimpleNamespace(assignment="lab", notebooks=["lab", "big"], calls=[], config_text="c = get_config()\n")
    root = tmp_path / "scratch"
    (root / "autograded" / "s" / "lab").mkdir(parents=True)
    (root / "gradebook.db").write_bytes(b"")
    (root / "autograded" / "s" / "lab" / "lab.ipynb").write_bytes(huge)
    (root / "autograded" / "s" / "lab" / "big.ipynb").write_bytes(b'{"cells": []}' + b" " * (64 * 2**20))
    taken = courses.take_graded(root, tmp_path / "taken", course, "s", cell_timeout_s=60, hide_hidden_tests=True)
    assert taken.is_dir() and not list(taken.glob("*.ipynb"))
    ok = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "error", "ename": "CellTimeoutError"}]}]}
    graded.write_text(json.dumps(ok))
    assert grade._notebook_notes([graded], 60) == ["cell 0 hit the per-cell time limit (60 s) and was interrupted"]
    assert load_left_json(b"[1, 2]", "x") == [1, 2]
    with pytest.raises(LeftFileError, match="not JSON"):
        load_left_json(b"{", "x")


def test_the_cells_scored_are_the_assignments_whatever_the_scratch_gradebook_holds():
    """report.course_cells: the master's cells and points; a row the assignment lacks, a second row for a cell and
    a score above the cell's points change nothing but a flag."""
    from autograder.gradebook import report

    master = [{"notebook": "lab", "cell": "test_a", "max_score": 2.0},
              {"notebook": "lab", "cell": "answer", "max_score": 2.0, "manual": True}]
    row = lambda cell, score, top=2.0: {"notebook": "lab", "cell": cell, "score": score, "max_score": top,  # noqa: E731
                                        "needs_manual": False, "source": "nbgrader"}
    cells, flags = report.course_cells([row("test_a", 9.0, 9.0), row("test_a", 1.0, 3.0), row("phantom", 5.0, 5.0)],
                                       master)
    assert [(c["cell"], c["score"], c["max_score"]) for c in cells] == [("test_a", 1.0, 2.0), ("answer", 0.0, 2.0)]
    assert cells[1]["manual"] and len(flags) == 1 and "lab/phantom" in flags[0] and "lab/test_a" in flags[0]
    assert report.course_cells([row("test_a", 2.0)], master)[1] == []
    flagged = [{**row("test_a", 2.0), "needs_manual": True}, {**row("answer", 0.0), "needs_manual": True}]
    cells = report.course_cells(flagged, master)[0]  # only a written answer may wait for a person
    assert [c["needs_manual"] for c in cells] == [False, True]


@pytest.mark.filterwarnings("ignore:Object of type:Warning")  # nbgrader's own add_submission, under SQLAlchemy 2
def test_scores_written_back_leave_no_extra_credit_or_comment_the_submission_wrote(tmp_path):
    """report.write_scores on a scratch gradebook whose rows the notebook's code rewrote (a helper outliving the
    kernel can, after nbgrader's last save): the feedback page printed its extra credit and an 'instructor' comment."""
    from nbgrader.api import Gradebook

    from autograder.gradebook import report

    generate_release(rehearsal.build_toy_course(tmp_path / "course"), AID, tmp_path / "made")
    db = tmp_path / "made" / "gradebook.db"
    with Gradebook(f"sqlite:///{db}") as gb:
        gb.add_student("eve")
        sub = gb.add_submission(AID, "eve")
        cells = [{"notebook": AID, "cell": g.name, "score": 0.0} for nb in sub.notebooks for g in nb.grades]
        for nb in sub.notebooks:
            for g in nb.grades:
                g.extra_credit = 50.0
            for cm in nb.comments:
                cm.manual_comment, cm.auto_comment = "**Instructor:** +50 agreed", "full marks"
        gb.db.commit()
    report.write_scores(db, AID, "eve", cells)
    with Gradebook(f"sqlite:///{db}") as gb:
        nbs = gb.find_submission(AID, "eve").notebooks
        assert cells and all(g.extra_credit is None for nb in nbs for g in nb.grades)
        assert any(nb.comments for nb in nbs)
        assert all(cm.manual_comment is None and cm.auto_comment is None for nb in nbs for cm in nb.comments)


@pytest.mark.skipif(jail.probe() is not None, reason="needs the bubblewrap sandbox")
def test_the_sandboxs_memory_backed_folders_are_capped():
    """/tmp and /dev/shm are tmpfs (memory the resident-memory watchdog does not see): capped where bwrap can."""
    import subprocess
    import sys

    if not jail._can_size(jail.find_bwrap()):
        pytest.skip("this bubblewrap has no --size")
    code = "import os; print(*(os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in ('/tmp', '/dev/shm')))"
    j = jail.Jail(writable=[])
    r = subprocess.run(j.command([sys.executable, "-c", code]), capture_output=True, text=True, timeout=60,
                       env=j.host_env({}))
    assert r.returncode == 0, r.stderr[-500:]
    assert all(int(b) <= jail.TMPFS_BYTES for b in r.stdout.split())

"""Caps and machine faults: cgroup v2 where the machine delegates it (memory with tmpfs and page cache, tasks), a
clean fallback where it does not, and a failure the machine caused (the grader's disk full, its memory) recorded
as the grader's fault and graded again on resume, never stored as the student's result.

The cgroup tests build a cgroup v2 tree of plain files (what the kernel shows under /sys/fs/cgroup): the grader's
moves, the caps it writes and the events it reads back are the same there; the kernel's enforcement is not
tested here (this CI machine has cgroup v1).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import nbformat
import pytest

from autograder import grade, rehearsal
from autograder.base import faults
from autograder.sandbox import cgroups
from autograder.sandbox import limits as sandbox

AID = rehearsal.TOY_ID


def _tree(tmp_path: Path, controllers="cpuset cpu io memory pids", writable=True) -> tuple[Path, Path, str]:
    root = tmp_path / "cgroup"
    base = root / "grader.service"
    base.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    (base / "cgroup.subtree_control").write_text("")
    me = tmp_path / "self-cgroup"
    me.write_text("0::/grader.service\n")
    if not writable:
        os.chmod(base / "cgroup.procs", 0o444)
        os.chmod(base, 0o555)
    return root, base, str(me)


# ------------------------------------------------------------------------------------------------ cgroups


def test_a_delegated_cgroup_is_found_and_the_grader_moves_to_a_leaf(tmp_path):
    root, base, me = _tree(tmp_path)
    got, why = cgroups.find(root, me)
    assert got == base and why == ""
    assert (base / cgroups.LEAF / "cgroup.procs").read_text() == str(os.getpid())
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids +io"


@pytest.mark.parametrize("case", ["v1", "no memory", "read-only"])
def test_without_delegation_find_says_why_and_nothing_is_written(tmp_path, case):
    if case == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes through file modes")
    if case == "v1":
        root, me = tmp_path / "cgroup", str(tmp_path / "none")
        root.mkdir()
    else:
        root, base, me = _tree(tmp_path, "cpu pids" if case == "no memory" else "memory pids",
                               writable=case != "read-only")
    got, why = cgroups.find(root, me)
    assert got is None and why, why
    assert {"v1": "no cgroup v2", "no memory": "no memory", "read-only": "not delegated"}[case] in why


def test_a_sandbox_cgroup_gets_the_caps_and_reads_the_kernels_count(tmp_path):
    root, base, me = _tree(tmp_path)
    cgroups.find(root, me)
    (tmp_path / "probe").mkdir()
    box = cgroups.Box.create(base, 2 * 2**30, 512)
    assert (box.path / "memory.max").read_text() == str(2 * 2**30) and (box.path / "pids.max").read_text() == "512"
    assert box.cause() is None
    (box.path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    assert box.cause() == "memory"
    (box.path / "memory.events").write_text("oom_kill 0\n")
    (box.path / "pids.events").write_text("max 3\n")
    assert box.cause() == "processes"
    box.close()
    assert not box.path.exists()


def test_the_sandboxs_first_process_joins_its_cgroup_and_a_kernel_oom_is_its_cause(tmp_path, monkeypatch):
    root, base, me = _tree(tmp_path)
    monkeypatch.setattr(cgroups, "_FOUND", {"base": base, "why": ""})
    made = []
    real = cgroups.Box.create

    def create(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(cgroups.Box, "create", create)
    monkeypatch.setattr(cgroups.Box, "close", lambda self: None)  # keep it to look at
    out = sandbox.run_limited([sys.executable, "-c", "import os; print(os.getpid())"], cwd=tmp_path,
                              limits=sandbox.Limits(wall_s=60, memory_bytes=2**30, max_processes=64),
                              jail=_FakeJail(tmp_path))
    assert out.ok, out.output
    box = made[0]
    assert (box.path / "cgroup.procs").read_text() == out.output.strip()  # joined before exec: the same pid
    assert (box.path / "memory.max").read_text() == str(2**30) and (box.path / "pids.max").read_text() == "64"
    monkeypatch.setattr(cgroups.Box, "cause", lambda self: "memory")  # as if the kernel's OOM killer had acted
    out = sandbox.run_limited([sys.executable, "-c", "pass"], cwd=tmp_path, limits=sandbox.Limits(wall_s=60),
                              jail=_FakeJail(tmp_path))
    assert out.out_of_memory and not out.ok


class _FakeJail:
    """A trusted jail (no bubblewrap) with no disk watch: only the cgroup path is under test."""

    env: dict = {}

    def __init__(self, folder):
        self.env = {}

    def command(self, cmd):
        return list(cmd)

    def host_env(self, env):
        return dict(env)

    def disk_watch(self):
        return None


def test_without_delegation_sandboxes_run_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "_FOUND", {"base": None, "why": "no cgroup v2"})
    assert cgroups.box_for(2**30, 64) is None and cgroups.then_join(None, print) is print
    out = sandbox.run_limited([sys.executable, "-c", "print('ok')"], cwd=tmp_path, limits=sandbox.Limits(wall_s=60),
                              jail=_FakeJail(tmp_path))
    assert out.ok and out.output.strip() == "ok"


# ------------------------------------------------------------------------------------------------ machine faults


def _res(cause, message, status="not graded"):
    return grade.StudentResult("amy", AID, status, 0.0, 5.0, cause, message)


@pytest.mark.parametrize("cause,message", [
    ("nbgrader error", "nbgrader autograde failed: OSError: [Errno 28] No space left on device (in write, x.py line 3)"),
    ("grader error", "OSError: [Errno 122] Disk quota exceeded"),
    ("grader error", "MemoryError: "),
])
def test_a_machine_failure_is_the_graders_fault_and_is_retried(cause, message):
    r = faults.classify(_res(cause, message))
    assert r.cause == faults.GRADER_FAULT and r.status == "not graded" and "graded again" in r.message, r.message
    assert not faults.kept(r)


@pytest.mark.parametrize("cause,message", [
    ("disk", "the notebook wrote more than 2 GiB and was stopped"),
    ("memory", "the notebook used more than 2.5 GiB and was stopped (MemoryError)"),
    ("nbgrader error", "nbgrader autograde failed: ValueError: bad cell"),
    ("kernel died", "the kernel died (No space left on device)"),
])
def test_a_students_own_cap_or_failure_stays_theirs(cause, message):
    r = faults.classify(_res(cause, message))
    assert r.cause == cause and r.message == message and faults.kept(r)


def _cfg(base: Path) -> grade.GradeConfig:
    return grade.GradeConfig(course=str(base / "course"), out=str(base / "out"), work=str(base / "work"),
                             cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=1,
                             harness_module="autograder.rehearsal", progress=False)


def test_a_full_grader_disk_is_not_stored_as_the_students_result_and_resume_regrades_only_them(tmp_path,
                                                                                              monkeypatch):
    rehearsal.build_toy_course(tmp_path / "course")
    subs = tmp_path / "subs"
    for sid in ("alice", "bob"):
        (subs / sid).mkdir(parents=True)
        (subs / sid / f"{AID}.ipynb").write_text(nbformat.writes(rehearsal.toy_notebook()))
    real = grade.grade_student

    def full_disk_for_alice(sub, *a, **k):
        if sub.student_id == "alice":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "work"))
        return real(sub, *a, **k)

    monkeypatch.setattr(grade, "grade_student", full_disk_for_alice)
    first = {r.student_id: r for r in grade.grade_class(AID, subs, _cfg(tmp_path)).results}
    assert first["alice"].cause == faults.GRADER_FAULT and "disk was full" in first["alice"].message
    assert first["bob"].status == "graded" and first["bob"].score == first["bob"].max_score  # beside it: untouched
    assert "grader fault" in (tmp_path / "out" / "summary.txt").read_text()
    monkeypatch.setattr(grade, "grade_student", real)
    rep = grade.grade_class(AID, subs, _cfg(tmp_path))
    again = {r.student_id: r for r in rep.results}
    assert rep.graded_now == 1  # alice only: bob's result is kept
    assert again["alice"].status == "graded" and again["alice"].score == again["alice"].max_score, again["alice"]
    assert again["bob"].finished_at == first["bob"].finished_at

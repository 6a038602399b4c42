"""Speed checks pin the student's runner and the baseline's to one CPU set and one thread count, from the trusted
side (autograder.sandbox.pinning), and notice a hand-in that widens its own CPU set while it is timed. Lab 3's timed data
is made on the trusted side and sent with each timed request: nothing the timing depends on is prepared in the
student's process before the clock starts.
"""

from __future__ import annotations

import inspect
import os

import psutil
import pytest

from autograder.checks import lab3_checks
from autograder.sandbox import jail, pinning, remote

TOY = "def total(x):\n    return int((x * x).sum())\n"
WIDEN = ("import os\n_all = set(range(os.cpu_count() or 1))\n"
         "def total(x):\n    os.sched_setaffinity(0, _all)\n    return int((x * x).sum())\n")


def _runner_env(r: remote.Remote) -> dict:
    """The environment of the runner's python process (read from the kernel, not from anything it says)."""
    found = [p for p in r.members() if "python" in os.path.basename(p.cmdline()[0])
             and "autograder.student.runner" in p.cmdline()]  # not bubblewrap's own process, whose args name it
    assert found, [p.cmdline() for p in r.members()]
    return found[-1].environ()


def test_cpu_lists_parse_and_bad_ones_are_refused(monkeypatch):
    assert pinning.parse_cpus("0-2,5, 7-7") == (0, 1, 2, 5, 7)
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(ValueError):
            pinning.parse_cpus(bad)
    monkeypatch.setenv(pinning.CPUS_ENV, "4096")
    with pytest.raises(ValueError, match="may not use"):
        pinning.for_device("cuda")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_both_sides_get_the_same_cpu_set_and_thread_count(tmp_path):
    if jail.probe():
        pytest.skip(jail.probe())
    (tmp_path / "s").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "s" / "s.py").write_text(TOY)
    student = remote.Remote(work_dir=tmp_path / "s", device="cpu", jail=jail.Jail(writable=[tmp_path / "s"]),
                            student_file=tmp_path / "s" / "s.py")
    base = remote.Remote(work_dir=tmp_path / "b", device="cpu", jail=jail.Jail(writable=[tmp_path / "b"],
                                                                                 trusted=True))
    try:
        assert student.call("toy.totals", {"arrays": [[1, 2]]})[0] == {"totals": [5]}
        base.wait_ready()
        assert student.pin == base.pin and len(student.pin.cpus) == 1 and student.pin.threads == 1
        for r in (student, base):
            procs = r.members()
            assert len(procs) >= 1 and {tuple(sorted(p.cpu_affinity())) for p in procs} == {student.pin.cpus}
            env = _runner_env(r)
            assert all(env.get(k) == "1" for k in pinning.THREAD_VARS), {k: env.get(k) for k in pinning.THREAD_VARS}
            r.check_pinned()  # nothing moved
    finally:
        student.close()
        base.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to widen onto")
def test_a_hand_in_that_widens_its_cpu_set_is_caught_while_timed(tmp_path):
    if jail.probe():
        pytest.skip(jail.probe())
    (tmp_path / "s").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "s" / "s.py").write_text(WIDEN)
    student = remote.Remote(work_dir=tmp_path / "s", device="cpu", jail=jail.Jail(writable=[tmp_path / "s"]),
                            student_file=tmp_path / "s" / "s.py")
    base = remote.Remote(work_dir=tmp_path / "b", device="cpu", jail=jail.Jail(writable=[tmp_path / "b"],
                                                                                 trusted=True))
    try:
        req = ("toy.totals", {"arrays": [[1, 2, 3]]})
        with pytest.raises(remote.StudentFailed, match="changed its CPU affinity"):
            remote.interleaved(base, lambda r: ("toy.baseline", {"pool_seed": 1, "pool_n": 64, "n": 8,
                                                                  "offsets": [0]}), student, lambda r: req, rounds=2)
    finally:
        student.close()
        base.close()


def test_pin_drift_names_the_process_and_skips_ended_ones():
    me = psutil.Process()
    own = tuple(sorted(me.cpu_affinity()))
    assert pinning.Pin(own, 1).drift([me]) is None and pinning.Pin((), 1).drift([me]) is None
    if len(own) > 1:
        assert f"process {me.pid}" in pinning.Pin(own[:1], 1).drift([me])


def test_lab3_timed_data_is_made_on_the_trusted_side():
    """No untimed call into the student's process feeds the timing: its data travels inside each timed request."""
    src = inspect.getsource(lab3_checks.check_speedup)
    assert 'ctx.call("lab3.prepare"' not in src and '"images": made[r][0]' in src
    from autograder.student import lab3

    n = 8
    images, labels = lab3.data({"n": n, "data_seed": 3})
    got = lab3._sent_data({"n": n, "images": images, "labels": labels})
    assert got[0] is images
    with pytest.raises(Exception, match="malformed"):
        lab3._sent_data({"n": n, "images": images.float(), "labels": labels})
    with pytest.raises(Exception, match="malformed"):
        lab3._sent_data({"n": n + 1, "images": images, "labels": labels})

"""One CPU set and one thread count for both sides of a speed check: the student's runner and the baseline's.

A ratio of two timings compares code only if the two processes ran on the same CPUs with the same number of
intra-op threads. Both runners (autograder.sandbox.remote.Remote) are started by the trusted side with the same `Pin`:
its CPU set is applied with sched_setaffinity in the runner's first process before exec (inherited by bubblewrap,
the runner and everything they start), its thread count goes into OMP_NUM_THREADS, MKL_NUM_THREADS,
OPENBLAS_NUM_THREADS and LABKIT_TORCH_THREADS, which the runner applies with torch.set_num_threads before the
student's code is loaded. A process may widen its own affinity again (no privilege is needed for that), so the
trusted side reads every runner process's affinity from the kernel after each timed request (`Pin.drift`): a
student's process found on other CPUs fails the measurement with that cause; the baseline's is the grader's
fault. Extra threads a student's code starts itself share the pinned CPUs: on a CPU machine the set is as many
CPUs as the thread count (`for_device`), so they cannot buy CPU time the baseline does not have.

`LABKIT_GRADE_CPUS` ("0-3,8") names the CPUs to use, for an instructor who keeps some for the grader or who grades
several students at once (give each run its own CPUs); by default the grader's own affinity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CPUS_ENV = "LABKIT_GRADE_CPUS"  # the CPUs speed checks run on (a Linux CPU list); default: the grader's own
THREADS_ENV = "LABKIT_TORCH_THREADS"  # the runner's torch.set_num_threads, set by the trusted side
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", THREADS_ENV)
GPU_MAX_THREADS = 8  # intra-op threads on a GPU machine: a GPU step's CPU work is launches, not math


def parse_cpus(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,8,10-11") as sorted CPU numbers; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return tuple(sorted(cpus))


def _available() -> tuple[int, ...]:
    if not hasattr(os, "sched_getaffinity"):
        return ()
    own = tuple(sorted(os.sched_getaffinity(0)))
    asked = os.environ.get(CPUS_ENV, "").strip()
    if not asked:
        return own
    try:
        cpus = parse_cpus(asked)
    except ValueError as e:
        raise ValueError(f"{CPUS_ENV}: {e}") from None
    if not set(cpus) <= set(own):
        raise ValueError(f"{CPUS_ENV}={asked!r} names CPUs this process may not use (it may use {list(own)})")
    return cpus


@dataclass(frozen=True)
class Pin:
    """The CPUs (empty: the platform cannot pin) and intra-op thread count of one speed check's runners."""

    cpus: tuple[int, ...]
    threads: int

    def env(self) -> dict[str, str]:
        """The thread-count variables both runners get."""
        return {k: str(self.threads) for k in THREAD_VARS}

    def apply(self) -> None:
        """Pin the calling process (a preexec_fn, in the child before exec): async-signal-light, no imports."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def drift(self, procs) -> str | None:
        """None if every process (psutil.Process) still runs on exactly `cpus`, else which one does not and where;
        processes that ended meanwhile are skipped."""
        if not self.cpus:
            return None
        want = set(self.cpus)
        for p in procs:
            try:
                got = set(p.cpu_affinity())
            except Exception:  # psutil.NoSuchProcess, AccessDenied: gone or not ours to read
                continue
            if got != want:
                return f"process {p.pid} runs on CPUs {sorted(got)}, not the pinned {sorted(want)}"
        return None


_CLAIMED: dict[str, object] = {}  # this process's claimed CPU: {"cpu": n, "fd": lock descriptor}


def _claim(cpus: tuple[int, ...]) -> int:
    """One CPU of `cpus` for this process's checks, the same on every call: the first whose lock file no other
    grading process holds (students graded at once each get their own), else the lowest. The lock is an flock
    on a file in the temp folder, released when this process ends."""
    import fcntl
    import tempfile

    if _CLAIMED.get("cpu") in cpus:
        return int(_CLAIMED["cpu"])
    for c in cpus:
        fd = os.open(os.path.join(tempfile.gettempdir(), f"labkit-speed-cpu-{c}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _CLAIMED.update(cpu=c, fd=fd)
        return c
    return cpus[0]


def for_device(device_type: str) -> Pin:
    """The Pin both runners of a check on `device_type` ("cpu", "cuda") get. On a CPU: one thread on one CPU of
    the set (`_claim`), as the runners always timed with one thread, so a student's extra threads share that CPU.
    On a GPU: the whole set, with as many threads as CPUs up to GPU_MAX_THREADS."""
    cpus = _available()
    if device_type == "cpu":
        return Pin((_claim(cpus),) if cpus else (), 1)
    return Pin(cpus, max(1, min(len(cpus) or GPU_MAX_THREADS, GPU_MAX_THREADS)))


def preexec(pin: Pin, then=None):
    """A preexec_fn that pins the child, then runs `then` (the sandbox's limits, autograder.sandbox.disk_cap.child_limits)."""

    def fn():
        pin.apply()
        if then is not None:
            then()
    return fn

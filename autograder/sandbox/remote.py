"""The trusted side's handle on a runner process: start it (sandboxed), call probes, freeze it, time it, end it.

A `Remote` is one `autograder.student.runner` process behind one socket. The student's runner lives in the
sandbox (autograder.sandbox.jail); the baseline's runner holds no student code at all. Every request is timed here,
in the grader's process, with the grader's clock: nothing the student's process does can move it. While one
side is being timed the other is frozen (SIGSTOP on every process it has, a wait until every thread of them has
stopped, and a check afterwards that none of them ran meanwhile), so a submission cannot slow the baseline by
spinning threads or children in the background.
Memory, process count, disk (autograder.sandbox.disk_cap) and wall clock are watched from outside; past a limit the whole
sandbox is killed and the call fails with the cause.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from autograder.base.course_secret import ENV as SECRET_ENV
from autograder.sandbox import cgroups, pinning
from autograder.sandbox.disk_cap import child_limits
from autograder.sandbox.jail import GRADER_ROOT, Jail
from autograder.sandbox.limits import _Capture, _kill, _rss, too_many
from autograder.student import channel

# A thread stops on SIGSTOP only when it next leaves the kernel: one inside a long system call (an mmap of a GiB
# with MAP_POPULATE, say) goes on using a core and memory bandwidth after the signal. freeze() waits for every
# thread to stop; one still running after this long means the side cannot be frozen, and its runner is stopped.
FREEZE_WAIT_S = 5.0
_STOPPED = frozenset("TtZXx")  # /proc/<pid>/task/<tid>/stat states: stopped, traced, zombie, dead
# A stopped process can be woken by a signal the kernel sends it (a POSIX timer's SIGCONT), so stopped at the start
# of a timing is not stopped throughout: CPU a frozen side used by the end of it, past this, fails the check.
FROZEN_SLACK_S = 0.002


class RemoteFailed(Exception):
    """The runner process died, hung, broke a limit or spoke out of protocol; `cause` says which."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class StudentFailed(Exception):
    """The student's code failed inside a probe: the message is the student's one-line error."""


class Remote:
    """One runner process. `student_file` None makes a baseline runner (no student code ever loaded)."""

    def __init__(self, *, work_dir: Path, device: str, jail: Jail, student_file: Path | None = None,
                 memory_bytes: int | None = None, max_processes: int = 256, max_threads: int = 4096,
                 startup_s: float = 120.0):
        self.work_dir, self.device, self.jail = Path(work_dir), device, jail
        self.student_file, self.memory_bytes, self.max_processes = student_file, memory_bytes, max_processes
        self.max_threads = max_threads
        self.cause: str | None = None
        self.peak_rss_bytes = 0
        self._ids = 0
        self._frozen = False
        self._frozen_tasks: dict = {}
        self.disk = jail.disk_watch()
        # the same CPU set and thread count for the student's runner and the baseline's, set from here
        self.pin = pinning.for_device(device.split(":")[0])
        jail.env.update(self.pin.env())
        # a cgroup of its own where the machine delegates cgroup v2: memory (tmpfs included) and tasks capped by
        # the kernel; else None and the watchdog alone
        self.cg = None if jail.trusted else cgroups.box_for(memory_bytes, max_processes)
        parent, child = socket.socketpair()
        cmd = [sys.executable, "-m", "autograder.student.runner", "--fd", str(child.fileno()), "--device", device]
        if student_file is not None:
            cmd += ["--student", str(student_file)]
        # a sandboxed runner gets a short list (Jail.command); an unsandboxed (trusted) one the grader's, less the
        # course secret. That keeps the secret out of what it prints by accident, not from it: running as the
        # grader, it can read its parent's environment. Trusting submissions trusts them with the secret.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JPY_")) and k != SECRET_ENV}
        env.update(PYTHONPATH=str(GRADER_ROOT) if jail.trusted else jail.python_path(), PYTHONUNBUFFERED="1",
                   PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore", MPLBACKEND="Agg",
                   **self.pin.env())
        self.proc = subprocess.Popen(jail.command(cmd), cwd=str(work_dir), env=jail.host_env(env),
                                     pass_fds=[child.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=cgroups.then_join(self.cg, pinning.preexec(
                                         self.pin, child_limits(self.disk.limit_bytes))))
        child.close()
        self.sock = parent
        self.output = _Capture(self.proc.stdout, 32 * 1024)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()
        self._ready_by = time.monotonic() + startup_s
        self._ready = False

    def wait_ready(self) -> None:
        """Wait for the runner's hello (it imports torch meanwhile, while this process gets on with its own)."""
        if self._ready:
            return
        hello = self._recv(self._ready_by, "starting")
        if not isinstance(hello, dict) or not hello.get("ready"):
            self._fail("protocol")
            raise RemoteFailed("the grading process did not start", "protocol")
        self._ready = True

    # ------------------------------------------------------------------------------------------ processes
    def members(self) -> list[psutil.Process]:
        """Every process of this runner (the sandbox's own processes included), however they detached."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _watchdog(self) -> None:
        while self.proc.poll() is None and self.cause is None:
            procs = self.members()
            rss = _rss(procs)
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            if self.memory_bytes and rss > self.memory_bytes:
                self._fail("memory")
            elif too_many(procs, self.max_processes, self.max_threads):
                self._fail("processes")
            elif self.cg is not None and self.cg.cause():
                self._fail(self.cg.cause())
            elif not self._frozen and self.disk.over([p.pid for p in procs]):
                # Not while frozen: a stopped side writes nothing, and walking its folders then would spend the
                # grader's CPU beside the other side's timing (a hand-in could plant files to make it costly).
                self._fail("disk")
            time.sleep(0.1)

    def check_pinned(self) -> None:
        """Raise if a process of this runner left the CPU set both sides were pinned to (autograder.sandbox.pinning): a
        timing of the student's then compares more CPUs with fewer; the baseline's is the grader's fault."""
        why = self.pin.drift(self.members())
        if why is None:
            return
        if self.student_file is not None:
            raise StudentFailed(f"the submission's code changed its CPU affinity while it was timed ({why}): "
                                "its speed is not comparable with the baseline's")
        raise RemoteFailed(f"the baseline's process left its CPU set ({why})", "grader")

    def _fail(self, cause: str) -> None:
        self.cause = self.cause or cause
        self.kill()

    def freeze(self) -> None:
        """Stop every process of this runner until thaw(), children found while stopping too, and return once
        every thread of them is still: stopped, or waiting in the kernel without using the CPU (a thread whose
        vfork child was stopped before its exec). FREEZE_WAIT_S at most: past it the runner is stopped,
        RemoteFailed. `check_frozen()` then tells whether it stayed so."""
        seen: set[int] = set()
        deadline = time.monotonic() + FREEZE_WAIT_S
        self._frozen = True
        last: dict = {}
        while True:
            procs = self.members()
            for p in procs:
                if p.pid not in seen:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGSTOP)
                    seen.add(p.pid)
            now = _tasks(procs)
            still = all(st in _STOPPED or (st == "D" and last.get(k, ("", -1.0))[1] == cpu)
                        for k, (st, cpu) in now.items())
            if still and all(p.pid in seen for p in self.members()):
                self._frozen_tasks = now
                return
            if time.monotonic() > deadline:
                self._fail("freeze")
                raise RemoteFailed(f"the submission's process {_WORDS['freeze']}", "freeze")
            last = now
            time.sleep(0.001)

    def check_frozen(self) -> None:
        """Raise RemoteFailed (cause "freeze", the runner stopped) if this side ran since freeze() returned: a
        thread or process that came or went (a stopped one can do neither, and one that ran and ended would take
        its CPU time with it), or CPU time past FROZEN_SLACK_S."""
        now = _tasks(self.members())
        then = self._frozen_tasks
        ran = sum(cpu - then[k][1] for k, (_, cpu) in now.items() if k in then)
        if set(now) != set(then) or ran > FROZEN_SLACK_S:
            self._fail("freeze")
            raise RemoteFailed(f"the submission's process {_WORDS['ran']}", "freeze")

    def thaw(self) -> None:
        for p in self.members():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
        self._frozen = False

    def kill(self) -> None:
        procs = self.members()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        _kill(procs)
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self) -> None:
        """End the runner and everything it started; safe to call twice."""
        if self.proc.poll() is None and self.cause is None:
            with contextlib.suppress(Exception):
                self.sock.settimeout(2)
                channel.send(self.sock, {"op": "bye"})
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.cg is not None:
            self.cause = self.cause or self.cg.cause()
            self.cg.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------ requests
    def _recv(self, deadline: float, what: str):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail("timeout")
                raise RemoteFailed(f"{what} took too long and was stopped", "timeout")
            self.sock.settimeout(min(left, 1.0))
            try:
                return channel.recv(self.sock)
            except TimeoutError:
                if self.proc.poll() is not None or self.cause:
                    break
                continue
            except (channel.ChannelError, OSError) as e:
                if self.cause is None and self.proc.poll() is None:
                    self._fail("protocol")
                    raise RemoteFailed(f"the grading process broke the protocol: {e}", "protocol") from None
                break
        if self.cause is None and self.disk.over([], now=True):  # ended by SIGXFSZ, or before the watch looked
            self.cause = "disk"
        cause = self.cause or "died"
        words = {**_WORDS, "died": f"exited (status {self.proc.poll()}) while {what}",
                 **({"disk": f"{self.disk.why} and was stopped"} if self.disk.why else {})}
        raise RemoteFailed(f"the submission's process {words.get(cause, cause)}", cause)

    def call(self, probe: str, params: dict | None = None, *, timeout_s: float = 120.0) -> tuple[object, float]:
        """Run probe `probe` with `params`; returns (result, wall seconds measured here).

        Raises StudentFailed when the student's code failed (its message), RemoteFailed when the process broke.
        """
        if self.cause:
            why = self.disk.why if self.cause == "disk" else self.cause  # the student reads what broke the cap
            raise RemoteFailed(f"the submission's process was already stopped ({why})", self.cause)
        self.wait_ready()
        self._ids += 1
        rid = self._ids
        t0 = time.perf_counter()
        try:
            self.sock.settimeout(timeout_s)
            channel.send(self.sock, {"id": rid, "op": "call", "probe": probe, "params": params or {}})
        except (OSError, channel.ChannelError):
            raise RemoteFailed("the submission's process stopped listening", self.cause or "died") from None
        reply = self._recv(time.monotonic() + timeout_s, f"running {probe}")
        dt = time.perf_counter() - t0
        if not isinstance(reply, dict) or reply.get("id") != rid or not isinstance(reply.get("ok"), bool):
            self._fail("protocol")
            raise RemoteFailed("the grading process answered out of protocol", "protocol")
        if not reply["ok"]:
            raise StudentFailed(str(reply.get("error") or "failed")[:2000])
        return reply.get("result"), dt

    def tail(self) -> str:
        """The last lines the runner printed (the student's prints and tracebacks), for logs."""
        return self.output.text()[-2000:]


_WORDS = {"memory": "used more memory than allowed and was stopped",
          "disk": "wrote more to its folders than allowed and was stopped",
          "processes": "started more processes or threads than allowed and was stopped",
          "freeze": f"kept running more than {FREEZE_WAIT_S:g} s after it was told to stop while the other side "
                    f"was timed, and was stopped",
          "ran": "ran while it was stopped for the other side's timing, and was stopped"}
_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_PSUTIL_STOPPED = {psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
                   psutil.STATUS_DEAD: "X", psutil.STATUS_DISK_SLEEP: "D"}


def _tasks(procs: list[psutil.Process]) -> dict[tuple[int, str], tuple[str, float]]:
    """{(pid, thread id): (state letter, CPU seconds)} of every thread of `procs`: Linux reads each thread's
    /proc entry (CPU time in nanoseconds from schedstat where the kernel keeps it, else clock ticks); where there
    is no /proc, a process stands for its threads. Threads and processes that end meanwhile are left out."""
    out = {}
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except FileNotFoundError:  # no /proc here, or the process is gone
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[(p.pid, "")] = (_PSUTIL_STOPPED.get(p.status(), "R"), t.user + t.system)
            continue
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{p.pid}/task/{tid}"
            try:
                with open(f"{base}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # that thread ended
            # "tid (comm) S ...": comm may hold spaces and parentheses, the fields follow its last ")"
            fields = stat[stat.rfind(b")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"{base}/schedstat", "rb") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            out[(p.pid, tid)] = (fields[0].decode(), cpu)
    return out


def interleaved(a: Remote, req_a, b: Remote, req_b, *, rounds: int, warmup: int = 1, timeout_s: float = 300.0,
                check_a=None, check_b=None, warm: list | None = None) -> tuple[list[float], list[float]]:
    """Time `req_a` on `a` and `req_b` on `b` alternately (ABBA order), the idle side frozen; seconds each.

    `req_*` are callables round -> (probe, params), so every round can carry fresh inputs; `check_*(result,
    params)` verify each reply (raise to reject it). Warm-up rounds are run and checked but not returned; their
    seconds (both sides) go into `warm` when given.
    """
    ta, tb = [], []
    a.wait_ready()
    b.wait_ready()
    for r in range(warmup + rounds):
        order = [(a, req_a, check_a, ta), (b, req_b, check_b, tb)]
        if r % 2:
            order.reverse()
        for remote, req, check, out in order:
            other = b if remote is a else a
            probe, params = req(r)
            other.freeze()
            try:
                result, dt = remote.call(probe, params, timeout_s=timeout_s)
                other.check_frozen()
                remote.check_pinned()
            finally:
                other.thaw()
            if check is not None:
                check(result, params)
            if r >= warmup:
                out.append(dt)
            elif warm is not None:
                warm.append(dt)
    return ta, tb

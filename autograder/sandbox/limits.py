"""Run one untrusted command with a wall-clock and memory budget, and leave nothing of it behind.

The command gets its own session (process group), so a timeout kills the whole tree: nbgrader, the Jupyter
kernel it started, and anything the student's code spawned. Memory is bounded two ways: RLIMIT_AS per process
(only where no CUDA is in use: CUDA reserves far more virtual address space than it touches) and a watchdog
that sums the resident memory of every process in the session and kills the tree when it passes the budget.
Every process carries a random token in its environment, so a daemon that escaped the session (double fork,
setsid) is still found and killed when the command ends. Output is kept as a bounded head and tail, so a
submission that floods stdout cannot fill the disk or the grader's memory; what it writes to its folders is held
to the jail's disk caps (autograder.sandbox.disk_cap).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import secrets
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from autograder.sandbox import cgroups
from autograder.sandbox.disk_cap import child_limits

TOKEN_VAR = "LABKIT_GRADER_TOKEN"


@dataclass
class Limits:
    """What one untrusted command may use."""

    wall_s: float = 1800.0  # whole-command wall clock, seconds; the process group is killed past it
    memory_bytes: int | None = 16 * 2**30  # resident memory of all its processes together, bytes (None: no cap)
    address_space: bool = False  # also cap each process's virtual memory at memory_bytes (RLIMIT_AS; CPU only)
    poll_s: float = 0.25  # how often the watchdog looks, seconds
    keep_output_bytes: int = 64 * 1024  # how much of the start and of the end of the output is kept, bytes each
    max_processes: int | None = 512  # processes alive at once (a fork bomb is killed at the next look)
    max_threads: int | None = 4096  # threads of all its processes at once: each takes one of the machine's process IDs


@dataclass
class Outcome:
    """How a limited command ended."""

    returncode: int | None  # exit status (negative: killed by that signal); None if it never started
    wall_s: float  # seconds from start to the last process gone
    timed_out: bool = False  # killed for passing Limits.wall_s
    out_of_memory: bool = False  # killed for passing Limits.memory_bytes
    too_many_processes: bool = False  # killed for passing Limits.max_processes or Limits.max_threads
    out_of_disk: str | None = None  # what broke the jail's disk caps (autograder.sandbox.disk_cap), if it was killed for it
    peak_rss_bytes: int = 0  # largest total resident memory the watchdog saw, bytes
    output: str = ""  # stdout and stderr interleaved, head and tail only
    output_bytes: int = 0  # how many bytes the command wrote in all
    leftovers_killed: int = 0  # processes still alive after the command ended (daemons), killed
    error: str | None = None  # why the command could not be started

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not (self.timed_out or self.out_of_memory or self.too_many_processes
                                             or self.out_of_disk)

    def cause(self) -> str | None:
        """A short cause for a failed command, for logs and summaries; None when it succeeded."""
        if self.error:
            return "could not start"
        if self.timed_out:
            return "timeout"
        if self.out_of_memory:
            return "memory"
        if self.too_many_processes:
            return "processes"
        if self.out_of_disk:
            return "disk"
        if self.returncode != 0:
            return f"exit {self.returncode}"
        return None


class _Capture:
    """Reads a pipe to its end, keeping the first and last `keep` bytes."""

    def __init__(self, stream, keep: int):
        self.stream, self.keep = stream, keep
        self.head, self.tail, self.total = bytearray(), bytearray(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else self.stream.read(65536)
            if not chunk:
                break
            self.total += len(chunk)
            room = self.keep - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                if len(self.tail) > self.keep:
                    del self.tail[: len(self.tail) - self.keep]

    def text(self) -> str:
        self.thread.join(timeout=5)
        head = self.head.decode("utf-8", "replace")
        if self.total <= len(self.head) + len(self.tail):
            return head + self.tail.decode("utf-8", "replace")
        skipped = self.total - len(self.head) - len(self.tail)
        return head + f"\n[... {skipped} bytes of output left out ...]\n" + self.tail.decode("utf-8", "replace")


def _preexec(limits: Limits, jailed=None):
    """Runs in the child before exec: no core dumps, optional RLIMIT_AS, a jail's `child_limits`, die with the
    grader."""
    def fn():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if jailed is not None:
            jailed()
        if limits.address_space and limits.memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        with contextlib.suppress(Exception):  # Linux only; elsewhere the stale-run sweep covers it
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    return fn


def _session_members(sid: int, token: str | None, root: psutil.Process | None) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    if root is not None:
        with contextlib.suppress(psutil.Error):
            procs[root.pid] = root
            for c in root.children(recursive=True):
                procs[c.pid] = c
    for p in psutil.process_iter(["pid"]):
        if p.pid in procs or p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                procs[p.pid] = p
                continue
            if token is not None and p.environ().get(TOKEN_VAR) == token:
                procs[p.pid] = p
    return list(procs.values())


def kill_token(token: str) -> int:
    """Kill every process whose environment carries `token` (a stale run's leftovers); returns how many."""
    victims = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if p.environ().get(TOKEN_VAR) == token:
                victims.append(p)
    return _kill(victims)


def _kill(procs: list[psutil.Process]) -> int:
    n = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
            n += 1
    _wait_gone(procs, timeout_s=5.0)
    return n


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    """Wait until each process has exited; a zombie counts as gone (it runs nothing).

    psutil.wait_procs waits for a zombie until its parent reaps it; a sandbox's processes are reaped by the
    machine's init once their namespace dies, which can take a second or more, on every run.
    """
    deadline = time.monotonic() + timeout_s
    left = list(procs)
    while left and time.monotonic() < deadline:
        still = []
        for p in left:
            with contextlib.suppress(psutil.Error):  # reaps our own children; others raise TimeoutExpired
                p.wait(timeout=0)
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.Error:
                pass
        left = still
        if left:
            time.sleep(0.01)


def _threads(procs: list[psutil.Process]) -> int:
    """Threads of `procs` together: a process ID of the machine's each, so thousands of them in one process can
    run the machine out of IDs for everyone, where a limit on processes alone never notices."""
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.num_threads()
    return total


def too_many(procs: list[psutil.Process], max_processes: int | None, max_threads: int | None) -> bool:
    """Whether `procs` pass either cap (None: no cap)."""
    return bool(max_processes and len(procs) > max_processes or max_threads and _threads(procs) > max_threads)


def _rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run_limited(cmd: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
                limits: Limits | None = None, token: str | None = None, jail=None) -> Outcome:
    """Run `cmd` in its own session under `limits`; always returns, never leaves a process behind.

    `token` marks every process of this run (a fresh random one if None); pass a token you recorded if you
    want to be able to kill the run's leftovers after a crash of the caller (see kill_token). With `jail` (an
    autograder.sandbox.jail.Jail) the command runs in that sandbox, whose PID namespace takes every process with it, and
    under the jail's disk caps (autograder.sandbox.disk_cap).
    """
    limits = limits or Limits()
    token = token or secrets.token_hex(16)
    env = dict(os.environ if env is None else env)
    env[TOKEN_VAR] = token
    if jail is not None:
        jail.env.setdefault(TOKEN_VAR, token)
        try:
            cmd = jail.command(cmd)
        except RuntimeError as e:
            return Outcome(None, 0.0, error=str(e))
        env = jail.host_env(env)
    disk = jail.disk_watch() if jail is not None else None
    # where cgroup v2 is delegated, the kernel caps the sandbox's memory (tmpfs and page cache included) and tasks
    cg = cgroups.box_for(limits.memory_bytes, limits.max_processes) if jail is not None else None
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=cgroups.then_join(cg, _preexec(
                                    limits, child_limits(disk.limit_bytes) if disk else None)))
    except OSError as e:
        if cg is not None:
            cg.close()
        return Outcome(None, 0.0, error=f"{type(e).__name__}: {e}")
    cap = _Capture(proc.stdout, limits.keep_output_bytes)
    out = Outcome(None, 0.0)
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:  # already gone
        root = None
    try:
        while proc.poll() is None:
            members = _session_members(proc.pid, None, root)
            rss = _rss(members)
            out.peak_rss_bytes = max(out.peak_rss_bytes, rss)
            if limits.memory_bytes and rss > limits.memory_bytes:
                out.out_of_memory = True
                _kill(members)
                break
            if too_many(members, limits.max_processes, limits.max_threads):
                out.too_many_processes = True
                _kill(members)
                break
            if disk is not None and disk.over([p.pid for p in members]):
                _kill(members)
                break
            if time.monotonic() - t0 > limits.wall_s:
                out.timed_out = True
                _kill(members)
                break
            time.sleep(limits.poll_s)
    finally:
        # Whatever happened (including KeyboardInterrupt in the caller), take the whole session down.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out.leftovers_killed = _kill(_session_members(proc.pid, token, None))
        try:
            out.returncode = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            out.returncode = None
        if disk is not None and disk.over([], now=True):  # a last look: what it left, however it ended
            out.out_of_disk = disk.why
        if cg is not None:  # the kernel's own count of the caps it enforced
            hit = cg.cause()
            out.out_of_memory = out.out_of_memory or hit == "memory"
            out.too_many_processes = out.too_many_processes or hit == "processes"
            cg.close()
        if out.timed_out or out.out_of_memory or out.too_many_processes or out.out_of_disk:
            out.returncode = -signal.SIGKILL  # psutil may have reaped it first and left 0 behind
        out.wall_s = time.monotonic() - t0
        out.output = cap.text()
        out.output_bytes = cap.total
        with contextlib.suppress(Exception):
            proc.stdout.close()
    return out


def write_log(path: Path, header: str, outcome: Outcome) -> None:
    """Save a command's kept output with a one-line header saying how it ended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = outcome.cause() or "ok"
    path.write_text(f"# {header}\n# ended: {state}, {outcome.wall_s:.1f} s, peak {outcome.peak_rss_bytes / 2**20:.0f} MiB, "
                    f"{outcome.output_bytes} bytes of output, {outcome.leftovers_killed} leftover processes killed\n"
                    + outcome.output, errors="replace")



# ------------------------------------------------------------------------------- reading what a command left

MAX_LEFT_BYTES = 64 * 2**20  # the largest file the grader reads back from a sandbox's folder, bytes


class LeftFileError(ValueError):
    """A path in a folder an untrusted command could write that is not what the grader reads there: a link, a
    special file, a file too large. The command could have pointed it at a classmate's file or the grader's."""


def left_folder(root: Path, rel: str | os.PathLike) -> Path:
    """`root/rel`, a folder, with no link among the components of `rel` (checked with lstat, one by one); raises
    LeftFileError, or FileNotFoundError where a component is missing.

    Call it only once nothing of the command runs any more (run_limited has returned): then nothing can swap a
    component between this check and the read that follows it."""
    path, rel = Path(root), Path(rel)
    if rel.is_absolute() or ".." in rel.parts:
        raise LeftFileError(f"{rel}: not a path inside {root}")
    for name in rel.parts:
        path = path / name
        if not os.path.isdir(path) or os.path.islink(path):
            if not os.path.lexists(path):
                raise FileNotFoundError(str(path))
            raise LeftFileError(f"{rel}: {name} is not a folder (a link, or a file)")
    return path


class TooLarge(LeftFileError):
    """A file left past what the grader reads (bytes, or JSON values): an honest notebook's output can get there."""


def read_left(root: Path, rel: str | os.PathLike, limit: int = MAX_LEFT_BYTES) -> bytes:
    """The bytes of `root/rel`, a regular file of at most `limit` bytes reached through no link (`left_folder`
    for its folders, O_NOFOLLOW for the file itself); raises LeftFileError, or FileNotFoundError where there is
    none. Read into memory: what the grader then trusts is this copy, not the path."""
    rel = Path(rel)
    folder = left_folder(root, rel.parent) if rel.parent != Path(".") else Path(root)
    # O_NONBLOCK: opening a FIFO left there returns at once instead of waiting for a writer that never comes
    try:
        fd = os.open(folder / rel.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: the file is a link
        raise LeftFileError(f"{rel}: a link or not a readable file ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LeftFileError(f"{rel}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(f"{rel}: larger than {limit:,} bytes")
    return data


MAX_JSON_VALUES = 2_000_000  # values in a JSON file the grader parses from a student: a few hundred MiB at most


class TooManyValues(TooLarge):
    """A JSON file past MAX_JSON_VALUES: refused unread."""


def json_values(data: bytes) -> int:
    """A bound on what parsing a JSON text builds, counted without parsing it: its commas and opening brackets.
    Every array element and object member but the first follows a comma, the first a bracket, so a text holds at
    most about twice this many values and keys (commas and brackets inside strings only overcount). 64 MiB of `[],`
    took json.loads 1.4 GiB and 16 s on a 2-core machine; counting takes milliseconds."""
    return data.count(b",") + data.count(b"[") + data.count(b"{")


def load_left_json(data: bytes, what: str, max_values: int = MAX_JSON_VALUES):
    """json.loads of bytes a student's code may have written, in bounded memory: LeftFileError, before parsing,
    past `max_values` (`json_values`); also when it is not JSON or nests deeper than the parser goes."""
    if json_values(data) > max_values:
        raise TooManyValues(f"{what}: more than {max_values:,} JSON values (commas and brackets): refused unread")
    try:
        return json.loads(data)
    except RecursionError:
        raise LeftFileError(f"{what}: nested deeper than a JSON reader goes") from None
    except ValueError:
        raise LeftFileError(f"{what}: not JSON") from None

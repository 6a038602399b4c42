"""cgroup v2 caps for a sandbox, where the machine delegates a cgroup subtree to the grader; nothing elsewhere.

The watchdogs (autograder.sandbox.limits, autograder.sandbox.remote) add up the resident memory of a sandbox's processes and
count them. Memory that belongs to no process escapes them: files in a tmpfs, the page cache. A cgroup's
memory.max counts all of it (tmpfs pages are charged to the cgroup that wrote them), and the kernel enforces it
at the moment of allocation, not at the watchdog's next look; pids.max refuses a fork past the cap. So where
cgroup v2 is mounted and the grader's own cgroup is writable (systemd's Delegate=yes, a container given its
cgroup namespace read-write), each sandbox gets a cgroup of its own with memory.max (swap 0, the OOM killer
taking the whole group) and pids.max, its first process moved into it before exec, and the kernel's own count
of hits (memory.events, pids.events) read back as the sandbox's cause. The io controller, where offered, is
enabled but given no limits: io bandwidth is not capped (disk space is, by autograder.sandbox.disk_cap).

To give sandboxes cgroups beside it, the grader moves its own process into a leaf (`labkit-grader`) of its
cgroup and enables the controllers for the children, as cgroup v2's no-internal-process rule requires. Where any
of this is missing (cgroup v1, a read-only /sys/fs/cgroup, another process sharing the grader's cgroup) `find`
says why and the watchdogs alone apply: assignments/README.md's threat model lists what is then not capped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
NEEDED = ("memory", "pids")
LEAF = "labkit-grader"  # the grader's own process moves here so that its cgroup may have controlled children
_FOUND: dict = {}


def _own(proc_cgroup: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def find(root: Path = ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[Path | None, str]:
    """(the cgroup folder sandboxes get their cgroups in, "") where cgroup v2 is delegated to this process;
    else (None, why not). Moves this process into a leaf of its cgroup the first time it succeeds."""
    root = Path(root)
    if not (root / "cgroup.controllers").is_file():
        return None, f"no cgroup v2 at {root} (cgroup v1 or none)"
    own = _own(proc_cgroup)
    if own is None:
        return None, "this process is in no cgroup v2 group"
    base = root / own.lstrip("/")
    if base.name == LEAF:  # moved there by an earlier call of this process
        base = base.parent
    offered = (root / "cgroup.controllers").read_text().split()
    missing = [c for c in NEEDED if c not in offered]
    if missing:
        return None, f"cgroup v2 offers no {', '.join(missing)} controller"
    if not os.access(base, os.W_OK) or not os.access(base / "cgroup.procs", os.W_OK):
        return None, f"the grader's cgroup {base} is not delegated to it (not writable)"
    return _enable(base, [c for c in (*NEEDED, "io") if c in offered])


def _enable(base: Path, controllers: list[str]) -> tuple[Path | None, str]:
    enabled = set((base / "cgroup.subtree_control").read_text().split()) if \
        (base / "cgroup.subtree_control").exists() else set()
    if set(NEEDED) <= enabled:
        return base, ""
    leaf = base / LEAF
    try:
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in controllers))
    except OSError as e:
        with contextlib.suppress(OSError):
            (base / "cgroup.procs").write_text(str(os.getpid()))  # back where it was
        why = "other processes share the grader's cgroup" if e.errno == errno.EBUSY else e.strerror
        return None, f"cannot enable {', '.join(controllers)} for {base}'s children: {why}"
    return base, ""


def delegated() -> tuple[Path | None, str]:
    """`find()`, once per process (it may move this process; later calls reuse the answer)."""
    if "base" not in _FOUND:
        try:
            _FOUND["base"], _FOUND["why"] = find()
        except OSError as e:
            _FOUND["base"], _FOUND["why"] = None, f"cgroup v2 unreadable: {e.strerror}"
    return _FOUND["base"], _FOUND["why"]


@dataclass
class Box:
    """One sandbox's cgroup: memory.max and pids.max, joined by its first process before exec."""

    path: Path

    @classmethod
    def create(cls, base: Path, memory_bytes: int | None, max_processes: int | None) -> Box:
        """A fresh cgroup under `base` with these caps (bytes of memory, tmpfs and page cache included; tasks)."""
        path = Path(base) / f"labkit-sb-{secrets.token_hex(6)}"
        path.mkdir()
        box = cls(path)
        if memory_bytes:
            box._set("memory.max", str(int(memory_bytes)))
            box._set("memory.swap.max", "0", optional=True)  # swapped pages would leave memory.max's count
            box._set("memory.oom.group", "1", optional=True)  # an OOM takes the whole sandbox, never half of it
        if max_processes:
            box._set("pids.max", str(int(max_processes)))
        return box

    def _set(self, name: str, value: str, optional: bool = False) -> None:
        f = self.path / name
        if optional and not f.exists():
            return
        f.write_text(value)

    def join(self) -> None:
        """Move the calling process into this cgroup (a preexec_fn step: runs in the child before exec)."""
        fd = os.open(str(self.path / "cgroup.procs"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def _events(self, name: str) -> dict[str, int]:
        out = {}
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                k, v = line.split()
                out[k] = int(v)
        return out

    def cause(self) -> str | None:
        """"memory" or "processes" when the kernel enforced that cap in this cgroup, else None."""
        mem = self._events("memory.events")
        if mem.get("oom_kill", 0) or mem.get("oom_group_kill", 0):
            return "memory"
        if self._events("pids.events").get("max", 0):
            return "processes"
        return None

    def close(self) -> None:
        """Kill what is left in it and remove it (a cgroup with processes cannot be removed)."""
        with contextlib.suppress(OSError):
            self._set("cgroup.kill", "1", optional=True)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # still busy, or (a test's plain folder) holding files
                if not (self.path / "cgroup.controllers").exists() and any(self.path.iterdir()):
                    import shutil

                    shutil.rmtree(self.path, ignore_errors=True)
                    return
                time.sleep(0.02)


def box_for(memory_bytes: int | None, max_processes: int | None) -> Box | None:
    """A cgroup for one sandbox where cgroup v2 is delegated, else None (the watchdogs alone then)."""
    base, _ = delegated()
    if base is None:
        return None
    try:
        return Box.create(base, memory_bytes, max_processes)
    except OSError:
        return None


def then_join(box: Box | None, fn):
    """A preexec_fn that joins `box` (when there is one) and then runs `fn`."""
    if box is None:
        return fn

    def both():
        box.join()
        if fn is not None:
            fn()
    return both

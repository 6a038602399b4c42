"""What a student's processes may leave on the grader's disk, and the watch that holds them to it.

A sandbox writes only to its own folders (the scratch course, the compile cache: `autograder.jail.Jail`), but
those are folders of the grader's disk: one hand-in writing without end would fill it, and every classmate
graded after it would fail for want of space. Two bounds, both per sandbox:

- RLIMIT_FSIZE on every process (`file_size_limit`): no single file grows past the cap, whatever folder it is
  in (the private /tmp included) and however fast it is written. A write past it gets SIGXFSZ, which ends the
  process.
- a watch from outside (`DiskWatch`, beside the memory watchdog): the space its folders' files take, counted by
  allocated blocks (a sparse file costs what it holds) and each inode once (hard links), plus the files its
  processes hold open after deleting them; and the number of files and folders. Past either cap the sandbox is
  killed, and a last look once it has ended says whether what it left is over.
"""

from __future__ import annotations

import contextlib
import os
import resource
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

DISK_BYTES = 8 * 2**30  # default: the files one sandbox's processes may keep in its folders together, bytes
MAX_FILES = 100_000  # default: files and folders there together (each takes one of the filesystem's inodes)


def file_size_limit(limit_bytes: int | None) -> None:
    """Cap the size of any file this process (and its children) writes at `limit_bytes` + 1 bytes: one byte over,
    so a file that reaches the limit is also over it for the watch. Call in the child before exec."""
    if limit_bytes:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes + 1, limit_bytes + 1))


@dataclass
class Use:
    """One look at a sandbox's folders."""

    bytes: int = 0  # allocated bytes of the files found, each inode once, plus deleted files held open
    files: int = 0  # files and folders found (the count stops once past the cap)
    unreadable: str | None = None  # a folder the grader could not list, even after giving itself the right to


def folder_use(folders: list[Path], max_files: int | None = None) -> Use:
    """Bytes and entries under `folders`, links not followed; stops counting past `max_files`.

    A folder the student's code made unlistable (chmod 000) is opened up again (the grader owns what the
    sandbox wrote); one that stays shut is reported in `unreadable`, since it could hide anything."""
    use, seen = Use(), set()
    stack = [Path(f) for f in folders]
    while stack:
        d = stack.pop()
        try:
            entries = _list(d)
        except PermissionError as e:
            use.unreadable = f"{d} ({e.strerror})"
            return use
        except OSError:  # gone, or swapped for a file or a link since it was listed: what it holds is elsewhere
            continue
        for path, st in entries:
            use.files += 1
            if max_files and use.files > max_files:
                return use
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                use.bytes += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
    return use


def _list(d: Path) -> list[tuple[Path, os.stat_result]]:
    # Through a descriptor opened without following links: the sandbox may still be running and could swap a
    # folder for a link between a check and a use.
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(d, flags)
    except PermissionError:
        shut = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.chmod(f"/proc/self/fd/{shut}", stat.S_IRWXU)
        finally:
            os.close(shut)
        fd = os.open(d, flags)
    try:
        out = []
        for n in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                out.append((d / n, os.stat(n, dir_fd=fd, follow_symlinks=False)))
        return out
    finally:
        os.close(fd)


def deleted_open_bytes(pids: list[int], devices: set[int]) -> int:
    """Allocated bytes of regular files on `devices` that the processes `pids` hold open after deleting them:
    space no folder listing shows. Processes that end meanwhile, or whose descriptors this user cannot read, are
    skipped (RLIMIT_FSIZE still bounds each such file)."""
    total, seen = 0, set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if not os.readlink(f"/proc/{pid}/fd/{fd}").endswith(" (deleted)"):
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode) and st.st_dev in devices and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


@dataclass
class DiskWatch:
    """The disk caps of one sandbox, checked at most every `every_s` seconds by whoever watches its processes."""

    folders: list[Path]  # every folder the sandbox may write (bound writable inside it)
    limit_bytes: int | None = DISK_BYTES  # space its files may take together, bytes (None: no cap)
    max_files: int | None = MAX_FILES  # files and folders it may keep (None: no cap)
    every_s: float = 1.0  # seconds between looks: a look walks every folder
    peak_bytes: int = 0  # the most it was seen to hold, bytes
    why: str | None = None  # what broke a cap, once one was broken
    _next: float = field(default=0.0, repr=False)

    def over(self, pids: list[int], *, now: bool = False) -> bool:
        """Whether the sandbox broke a cap (sets `why`); looks only when `every_s` has passed, or `now`."""
        if self.why is not None:
            return True
        t = time.monotonic()
        if not now and t < self._next:
            return False
        self._next = t + self.every_s
        use = folder_use(self.folders, self.max_files)
        if use.unreadable is None:
            devices = {os.stat(f).st_dev for f in self.folders if os.path.isdir(f)}
            use.bytes += deleted_open_bytes(pids, devices)
        self.peak_bytes = max(self.peak_bytes, use.bytes)
        if use.unreadable is not None:
            self.why = f"made a folder the grader cannot read: {use.unreadable}"
        elif self.max_files and use.files > self.max_files:
            self.why = f"left more than {self.max_files:,} files and folders"
        elif self.limit_bytes and use.bytes > self.limit_bytes:
            self.why = f"left more than {_size(self.limit_bytes)} of files"
        return self.why is not None


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"

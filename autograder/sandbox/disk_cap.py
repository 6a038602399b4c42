"""What a student's processes may leave on the grader's disk, and the watch that holds them to it.

A sandbox writes only to its own folders (the scratch course, the compile cache: `autograder.sandbox.jail.Jail`), but
those are folders of the grader's disk: one hand-in writing without end would fill it, and every classmate
graded after it would fail for want of space. Two bounds, both per sandbox:

- limits set before the sandbox starts (`child_limits`): no single file grows past the cap (RLIMIT_FSIZE),
  whatever folder it is in and however fast it is written, and fallocate(2), which allocates past that limit,
  is refused (seccomp).
- a watch from outside (`DiskWatch`, beside the memory watchdog): the space its folders' files take, counted by
  allocated blocks (a sparse file costs what it holds) and each inode once (hard links), plus the files its
  processes hold open or mapped after deleting them; and the number of files and folders. Past either cap the sandbox is
  killed, and a last look once it has ended says whether what it left is over.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

DISK_BYTES = 8 * 2**30  # default: the files one sandbox's processes may keep in its folders together, bytes
MAX_FILES = 100_000  # default: files and folders there together (each takes one of the filesystem's inodes)
MAX_DEPTH = 64  # folders nested deeper than this are not counted but refused: the walk holds one descriptor per level
MAX_OPEN = 65_536  # descriptors of all its processes together that a look reads; more are refused
OPEN_FILES = 8192  # RLIMIT_NOFILE in the sandbox (at most): keeps a look at its descriptors short


def child_limits(limit_bytes: int | None):
    """What a sandbox's first process runs before exec (a preexec_fn), inherited by everything it starts:

    - RLIMIT_FSIZE at `limit_bytes` + 1: one byte over, so a file that reaches the cap is also over it for the watch;
    - RLIMIT_NOFILE at most OPEN_FILES, which keeps the watch's look at the descriptors short;
    - a seccomp filter that refuses (ENOSYS) the REFUSED calls: fallocate(2) with FALLOC_FL_KEEP_SIZE allocates
      blocks without growing the file, past RLIMIT_FSIZE, gigabytes in a millisecond (glibc's posix_fallocate then
      falls back to writing, which the limit stops); io_uring does the same through its own queue, and memfd
      memory sits in no folder and no RSS.
    The filter is built here, in the parent: the child only makes system calls. Where it cannot be installed
    (another architecture, a setuid bubblewrap that no_new_privs would break) the other two still hold."""
    prog = _seccomp_program()
    libc = ctypes.CDLL(None, use_errno=True) if prog is not None else None

    def fn():
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes + 1, limit_bytes + 1))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hard = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
        if prog is not None:
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: required to install a filter unprivileged
            libc.prctl(22, 2, ctypes.byref(prog[0]), 0, 0)  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    return fn


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


# The system calls a sandbox is refused, each a way to take disk or memory that neither RLIMIT_FSIZE nor a watch
# counts: fallocate (blocks without growing the file, with FALLOC_FL_KEEP_SIZE); io_uring, whose own fallocate and
# writes bypass this filter; memfd_create and memfd_secret (memory held by a descriptor, in no folder and, while not
# mapped, in no process's RSS); open_by_handle_at (opens a file by handle, past the mount namespace's view).
# fallocate is refused with EOPNOTSUPP (glibc's posix_fallocate then falls back to writing, which RLIMIT_FSIZE
# stops), the others with ENOSYS, "not in this kernel", which libraries already handle by falling back.
REFUSED = ("fallocate", "io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_create", "memfd_secret",
           "open_by_handle_at")
# (audit arch, mask applied to the number first, {name: number}) for each ABI a process of this machine can call
# the kernel through: x86_64 with its x32 numbers (bit 30) and i386 (int 0x80); arm64 and 32-bit arm.
_IO_URING = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
_SYSCALLS = {
    "x86_64": [(0xC000003E, 0xBFFFFFFF, {"fallocate": 285, "memfd_create": 319, "memfd_secret": 447,
                                         "open_by_handle_at": 304, **_IO_URING}),
               (0x40000003, None, {"fallocate": 324, "memfd_create": 356, "memfd_secret": 447,
                                   "open_by_handle_at": 342, **_IO_URING})],
    "aarch64": [(0xC00000B7, None, {"fallocate": 47, "memfd_create": 279, "memfd_secret": 447,
                                    "open_by_handle_at": 265, **_IO_URING}),
                (0x40000028, None, {"fallocate": 352, "memfd_create": 385, "open_by_handle_at": 371, **_IO_URING})]}


def _seccomp_program():
    """(sock_fprog, its instructions) refusing the REFUSED calls, or None where this machine has no entry or
    bubblewrap is setuid."""
    import platform

    abis = _SYSCALLS.get(platform.machine())
    bwrap = shutil.which("bwrap")
    if not abis or (bwrap and os.stat(bwrap).st_mode & stat.S_ISUID):
        return None
    ld, jeq, and_, ret = 0x20, 0x15, 0x54, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_ALU|AND|K, BPF_RET|K
    err, allow = 0x00050000, 0x7FFF0000  # SECCOMP_RET_ERRNO (| errno), SECCOMP_RET_ALLOW
    code: list[tuple[int, int, int, int]] = []
    for arch, mask, numbers in abis:
        nrs = [(numbers[n], n == "fallocate") for n in REFUSED if n in numbers]
        # each number: equal -> jump to its refusal after the block's allow; else fall through to the next test
        tests = [(jeq, len(nrs) - i + (0 if eop else 1), 0, nr) for i, (nr, eop) in enumerate(nrs)]
        block = [(ld, 0, 0, 0), *([(and_, 0, 0, mask)] if mask else []), *tests, (ret, 0, 0, allow),
                 (ret, 0, 0, err | errno.EOPNOTSUPP), (ret, 0, 0, err | errno.ENOSYS)]
        code += [(ld, 0, 0, 4), (jeq, 0, len(block), arch), *block]  # seccomp_data: nr at 0, arch at 4
    code.append((ret, 0, 0, allow))
    insns = (_Filter * len(code))(*[_Filter(*c) for c in code])
    return _Program(len(code), ctypes.cast(insns, ctypes.POINTER(_Filter))), insns


@dataclass
class Use:
    """One look at a sandbox's folders and processes."""

    bytes: int = 0  # allocated bytes of the files found, each inode once, plus deleted files held open or mapped
    files: int = 0  # files and folders found (the count stops once past the cap)
    refused: str | None = None  # why the look could not count everything (then the sandbox is stopped)


def folder_use(folders: list[Path], max_files: int | None = None, max_depth: int = MAX_DEPTH) -> Use:
    """Bytes and entries under `folders`, links not followed; stops counting past `max_files`.

    Every folder is opened relative to its parent's descriptor, never by path, so neither a path past PATH_MAX nor
    a folder swapped for a link while the sandbox runs can hide files or lead the walk outside. A folder the
    student's code made unlistable (chmod 000) is opened up again (the grader owns what the sandbox wrote).
    Whatever cannot be counted (nesting past `max_depth`, a folder that stays shut or changed kind under the
    walk) is reported in `refused`: it could hide anything."""
    use, seen = Use(), set()
    for root in folders:
        try:
            fd = _open_dir(None, str(root))
        except FileNotFoundError:
            continue
        except OSError as e:
            use.refused = f"{root}: {e.strerror}"
            return use
        try:
            if not _walk(fd, str(root), 1, use, seen, max_files, max_depth):
                return use
        finally:
            os.close(fd)
    return use


def _walk(fd: int, shown: str, depth: int, use: Use, seen: set, max_files: int | None, max_depth: int) -> bool:
    """Count the entries of the open folder `fd` and below; False once the look must stop (`use` says why)."""
    for name in os.listdir(fd):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:  # removed since the listing
            continue
        use.files += 1
        if max_files and use.files > max_files:
            return False
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            use.bytes += st.st_blocks * 512
        if not stat.S_ISDIR(st.st_mode):
            continue
        if depth >= max_depth:
            use.refused = f"folders nested deeper than {max_depth} under {shown}"
            return False
        try:
            child = _open_dir(fd, name)
        except FileNotFoundError:
            continue
        except OSError as e:  # shut for good, or swapped for a link or a file since its stat
            use.refused = f"{shown}/{name}: {e.strerror}"
            return False
        try:
            if not _walk(child, f"{shown}/{name}", depth + 1, use, seen, max_files, max_depth):
                return False
        finally:
            os.close(child)
    return True


def _open_dir(parent: int | None, name: str) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return os.open(name, flags, dir_fd=parent)
    except PermissionError:
        # O_PATH needs no read right; O_DIRECTORY | O_NOFOLLOW refuses a link, so the chmod lands on this folder
        shut = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{shut}", stat.S_IRWXU)
        finally:
            os.close(shut)
        return os.open(name, flags, dir_fd=parent)


def held_deleted(pids: list[int], devices: set[int], max_open: int = MAX_OPEN) -> tuple[int, str | None]:
    """(allocated bytes, refusal) of regular files on `devices` that the processes `pids` deleted but still hold,
    open or mapped: space no folder listing shows. Past `max_open` descriptors in all, the look stops and says
    so, since reading each one costs the grader time. Processes that end meanwhile, or whose /proc entries this
    user cannot read, are skipped (RLIMIT_FSIZE still bounds each such file). Not seen: a descriptor in flight
    in a socket message, held by no process (the README's threat model says so)."""
    links, n = [], 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            n += len(fds)
            if n > max_open:
                return 0, f"holds more than {max_open:,} open files"
            links += [f"/proc/{pid}/fd/{fd}" for fd in fds]
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            links += [f"/proc/{pid}/map_files/{line.split(maxsplit=1)[0]}" for line in maps
                      if line.rstrip().endswith(" (deleted)")]
    total, seen = 0, set()
    for link in links:
        with contextlib.suppress(OSError):
            if "/fd/" in link and not os.readlink(link).endswith(" (deleted)"):
                continue
            st = os.stat(link)
            if stat.S_ISREG(st.st_mode) and st.st_dev in devices and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total, None


def remove_tree(path: Path) -> None:
    """Remove a sandbox's folder once nothing of it runs, whatever modes its code left: a folder made read-only
    keeps its files from an ordinary user's rmtree, and each such student would leave up to a cap behind. Every
    folder is given back its owner's rights first; os.fwalk opens each through its parent's descriptor, so paths
    past PATH_MAX are reached. No link is ever followed: fwalk lists a link to a folder among the folders, and a
    chmod by name would change the folder it names, outside the sandbox (`_own_folder`)."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
        return
    with contextlib.suppress(OSError, RecursionError):  # a tree too deep to open up: rmtree takes what it can
        _own_folder(str(path), None)
        for _, dirs, _, fd in os.fwalk(path):
            for name in dirs:
                _own_folder(name, fd)
    shutil.rmtree(path, ignore_errors=True)  # rmtree's descriptor-based walk unlinks links, never follows them


def _own_folder(name: str, dir_fd: int | None) -> None:
    """Give the folder `name` (under `dir_fd`) its owner's rights, if it is a real folder and not a link.

    Opened with O_NOFOLLOW and changed through its own descriptor, so a link (or one swapped in after the look)
    is never followed. A folder its owner cannot open (mode 000) is looked at without following and changed by
    name: nothing of the sandbox runs now to swap a link in between the two."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.EACCES:
            return  # ELOOP or ENOTDIR: a link or no folder; leave it to rmtree, which unlinks it
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode):
                os.chmod(name, stat.S_IRWXU, dir_fd=dir_fd)
        return
    try:
        os.fchmod(fd, stat.S_IRWXU)
    finally:
        os.close(fd)


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
        if use.refused is None:
            devices = {os.stat(f).st_dev for f in self.folders if os.path.isdir(f)}
            held, use.refused = held_deleted(pids, devices)
            use.bytes += held
        self.peak_bytes = max(self.peak_bytes, use.bytes)
        if use.refused is not None:
            self.why = f"left what the grader cannot count ({use.refused})"
        elif self.max_files and use.files > self.max_files:
            self.why = f"left more than {self.max_files:,} files and folders"
        elif self.limit_bytes and use.bytes > self.limit_bytes:
            self.why = f"left more than {_size(self.limit_bytes)} of files"
        return self.why is not None


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"

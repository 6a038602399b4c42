"""The disk caps of a sandbox (autograder.sandbox.disk_cap): what a hand-in may leave on the grader's disk.

The hostile class (tests/test_autograder.py: disk_fill, disk_hidden, disk_checks) grades the same attacks end to
end; these look at the watch itself, on a CPU, in seconds.
"""

import os
import stat
import sys
import time

import pytest

from autograder.sandbox import disk_cap, jail
from autograder.sandbox import limits as sandbox
from autograder.sandbox.remote import Remote, RemoteFailed

PY = sys.executable
MiB = 2**20
needs_bwrap = pytest.mark.skipif(jail.probe() is not None, reason="needs the bubblewrap sandbox")


def test_a_folder_costs_its_allocated_blocks_once_per_file_and_no_link_is_followed(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * MiB)
    os.link(tmp_path / "a.bin", tmp_path / "b.bin")  # the same blocks twice
    with open(tmp_path / "sparse.bin", "wb") as f:  # 8 GiB long, one block held
        f.seek(8 * 2**30)
        f.write(b"1")
    os.symlink("/usr", tmp_path / "usr")  # followed, it would count the system
    shut = tmp_path / "shut"
    shut.mkdir()
    (shut / "c.bin").write_bytes(b"y" * MiB)
    shut.chmod(0)  # unlistable, as the hand-in left it: the grader opens it again
    use = disk_cap.folder_use([tmp_path])
    assert use.refused is None and use.files == 6
    assert 2 * MiB <= use.bytes < 2 * MiB + 64 * 1024
    assert disk_cap.folder_use([tmp_path], max_files=2).files == 3  # stops counting once past the cap


def _deep(root, levels: int, name: str = "d" * 250) -> int:
    """Folders `levels` deep under `root`, made relative to each other (their full path passes PATH_MAX); returns a
    descriptor of the deepest."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd


def test_files_past_path_max_are_counted_and_nesting_past_the_depth_cap_is_refused(tmp_path):
    fd = _deep(tmp_path, 20)  # 20 x 251 bytes: a path of over 5,000
    with open(os.open("big.bin", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as f:
        f.write(b"x" * 4 * MiB)
    os.close(fd)
    use = disk_cap.folder_use([tmp_path])
    assert use.refused is None and use.files == 21 and use.bytes >= 4 * MiB
    os.close(_deep(tmp_path / ("d" * 250), disk_cap.MAX_DEPTH, "e"))
    assert "nested deeper than 64" in disk_cap.folder_use([tmp_path]).refused
    disk_cap.remove_tree(tmp_path)  # what the grader does afterwards: nothing of it is left
    assert not tmp_path.exists()


def test_a_link_swapped_in_for_a_folder_is_never_opened_or_changed(tmp_path):
    outside = tmp_path / "grader"
    outside.mkdir(mode=0o300)  # a grader's folder, as the sealed one is
    (tmp_path / "box").mkdir()
    os.symlink(outside, tmp_path / "box" / "sub")
    with pytest.raises(OSError):
        disk_cap._open_dir(None, str(tmp_path / "box" / "sub"))
    assert stat.S_IMODE(outside.stat().st_mode) == 0o300
    assert disk_cap.folder_use([tmp_path / "box"]).files == 1  # the link, counted, not followed


def test_the_watch_looks_at_most_every_few_seconds_and_remembers_what_broke_a_cap(tmp_path):
    watch = disk_cap.DiskWatch([tmp_path], limit_bytes=MiB, max_files=10, every_s=60)
    assert not watch.over([])
    (tmp_path / "big.bin").write_bytes(b"x" * 2 * MiB)
    assert not watch.over([])  # not time to look yet
    assert watch.over([], now=True) and watch.why == "left more than 1 MiB of files"
    (tmp_path / "big.bin").unlink()
    assert watch.over([]) and watch.peak_bytes >= 2 * MiB  # a cap once broken stays broken
    many = disk_cap.DiskWatch([tmp_path], limit_bytes=None, max_files=10)
    for i in range(11):
        (tmp_path / f"f{i}").touch()
    assert many.over([], now=True) and many.why == "left more than 10 files and folders"


def _run(tmp_path, code: str, **caps) -> sandbox.Outcome:
    box = jail.Jail(writable=[tmp_path], **caps)
    return sandbox.run_limited([PY, "-c", code], cwd=tmp_path, jail=box,
                               limits=sandbox.Limits(wall_s=60, memory_bytes=None, poll_s=0.05))


_ENDLESS = ("chunk = b'0' * (1 << 20)\nwith open('fill.bin', 'wb') as f:\n    for _ in range(4096):\n"
            "        f.write(chunk)\n")


@needs_bwrap
def test_a_sandbox_writing_one_endless_file_is_stopped_at_the_cap(tmp_path):
    t0 = time.monotonic()
    out = _run(tmp_path, _ENDLESS, disk_bytes=16 * MiB)
    assert out.cause() == "disk" and not out.ok and time.monotonic() - t0 < 30
    assert out.out_of_disk == "left more than 16 MiB of files"
    assert (tmp_path / "fill.bin").stat().st_size == 16 * MiB + 1  # RLIMIT_FSIZE: one byte over, then EFBIG
    assert "File too large" in out.output


@needs_bwrap
def test_deleted_files_held_open_and_floods_of_small_files_are_counted(tmp_path):
    hidden = ("import os, time\nheld = []\nfor i in range(4):\n    f = open(f'h{i}', 'wb')\n    os.unlink(f'h{i}')\n"
              "    f.write(b'0' * (8 << 20))\n    f.flush()\n    held.append(f)\ntime.sleep(60)\n")
    (tmp_path / "a").mkdir()
    t0 = time.monotonic()
    out = _run(tmp_path / "a", hidden, disk_bytes=16 * MiB)
    assert out.cause() == "disk" and time.monotonic() - t0 < 30  # 32 MiB that no listing shows
    assert not list((tmp_path / "a").iterdir())
    (tmp_path / "b").mkdir()
    out = _run(tmp_path / "b", "import time\nfor i in range(5000):\n    open(f'f{i}', 'w').close()\ntime.sleep(60)\n",
               max_files=1000)
    assert out.cause() == "disk" and out.out_of_disk == "left more than 1,000 files and folders"


@needs_bwrap
def test_an_honest_run_under_the_caps_is_untouched(tmp_path):
    out = _run(tmp_path, "open('out.bin', 'wb').write(b'0' * (4 << 20))\nprint('done')\n", disk_bytes=16 * MiB)
    assert out.ok and out.out_of_disk is None and "done" in out.output


@needs_bwrap
def test_a_checks_process_that_fills_its_folder_is_stopped_with_that_cause(tmp_path):
    quiet = "try:\n" + "".join(f"    {line}\n" for line in _ENDLESS.splitlines()) + "except OSError:\n    pass\n"
    (tmp_path / "s.py").write_text(quiet + "def total(x):\n    return int((x * x).sum())\n")
    r = Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path], disk_bytes=16 * MiB),
               student_file=tmp_path / "s.py")
    try:
        with pytest.raises(RemoteFailed) as e:
            r.call("toy.totals", {"arrays": [[1, 2]]}, timeout_s=30)
            time.sleep(2)  # the import erred at the limit and the file stays: the watch's next look stops it
            r.call("toy.totals", {"arrays": [[1, 2]]}, timeout_s=30)
        assert e.value.cause == "disk" and "left more than 16 MiB of files" in str(e.value)
    finally:
        r.close()


def test_a_cap_that_is_not_positive_is_refused_before_any_work(tmp_path):
    from autograder import grade
    from labkit.env import LabkitError

    (tmp_path / "subs").mkdir()
    cfg = grade.GradeConfig(out=str(tmp_path / "out"), disk_gb=0, progress=False)
    with pytest.raises(LabkitError, match="--disk-gb must be positive"):
        grade.grade_class("lab", tmp_path / "subs", cfg)


@needs_bwrap
def test_the_watch_does_not_walk_a_frozen_sides_folders(tmp_path):
    """While one side is timed the other is frozen, and a frozen side writes nothing: walking its folders then would
    only spend the grader's CPU beside the timing, and a hand-in could plant files to make that walk long."""
    r = Remote(work_dir=tmp_path, device="cpu", jail=jail.Jail(writable=[tmp_path]))
    looks = []

    class Counting(disk_cap.DiskWatch):
        def over(self, pids, *, now=False):
            looks.append(time.monotonic())
            return False

    r.disk = Counting([tmp_path])
    try:
        r.wait_ready()
        r.freeze()
        t0 = time.monotonic()
        time.sleep(0.6)
        frozen = [t for t in looks if t >= t0]
        r.thaw()
        time.sleep(0.6)
        assert frozen == [] and looks[-1] > t0 + 0.6
    finally:
        r.close()


@needs_bwrap
def test_fallocate_is_refused_and_posix_fallocate_stops_at_the_cap(tmp_path):
    code = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = os.open('a.bin', os.O_RDWR | os.O_CREAT)\n"
            "r = libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1 << 30))\n"  # FALLOC_FL_KEEP_SIZE
            "print('fallocate', r, ctypes.get_errno() == errno.EOPNOTSUPP)\n"
            "try:\n    os.posix_fallocate(fd, 0, 1 << 30)\nexcept OSError as e:\n"
            "    print('posix_fallocate', errno.errorcode[e.errno])\n"
            "import resource\nprint('nofile', resource.getrlimit(resource.RLIMIT_NOFILE)[1])\n")
    out = _run(tmp_path, code, disk_bytes=16 * MiB)
    assert "fallocate -1 True" in out.output and "posix_fallocate EFBIG" in out.output, out.output
    assert int(out.output.split("nofile")[1].split()[0]) <= disk_cap.OPEN_FILES
    assert os.stat(tmp_path / "a.bin").st_blocks * 512 <= 16 * MiB + 8192  # nothing past the cap was allocated


@needs_bwrap
def test_io_uring_memfd_and_open_by_handle_are_refused(tmp_path):
    """The attack took 20 GiB in 0.05 s through io_uring's fallocate (which the fallocate rule never sees); memfd
    holds memory in no folder and no RSS. Each is refused before it starts, with ENOSYS."""
    code = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "p = (ctypes.c_char * 120)()\n"
            "for name, nr, args in (('io_uring_setup', 425, (8, p)), ('io_uring_enter', 426, (0, 1, 0, 0, None)),\n"
            "                       ('io_uring_register', 427, (0, 0, None, 0)), ('memfd_secret', 447, (0,)),\n"
            "                       ('open_by_handle_at', 304, (-100, p, 0))):\n"
            "    r = libc.syscall(nr, *args)\n"
            "    print(name, r, errno.errorcode.get(ctypes.get_errno()))\n"
            "try:\n    os.memfd_create('x')\nexcept OSError as e:\n    print('memfd_create', errno.errorcode[e.errno])\n"
            "print('write ok', os.write(os.open('w.bin', os.O_WRONLY | os.O_CREAT), b'x' * 4096))\n")
    out = _run(tmp_path, code, disk_bytes=16 * MiB)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_secret", "open_by_handle_at"):
        assert f"{name} -1 ENOSYS" in out.output, out.output
    assert "memfd_create ENOSYS" in out.output and "write ok 4096" in out.output, out.output


@needs_bwrap
def test_the_sandbox_root_is_read_only_and_its_tmpfs_are_capped(tmp_path):
    """bubblewrap's root was a writable tmpfs of no size: 4 GiB held there under a 2.5 GiB memory cap, graded."""
    code = ("import errno, os\n"
            f"for d in ('/', {jail.VIEW!r}, {jail.VIEW + '/autograder'!r}, '/usr'):\n"
            "    try:\n        open(os.path.join(d, 'fill.bin'), 'wb').write(b'x')\n        print(d, 'written')\n"
            "    except OSError as e:\n        print(d, errno.errorcode[e.errno])\n"
            "s = os.statvfs('/tmp')\nprint('tmp bytes', s.f_blocks * s.f_frsize)\n"
            "open('/tmp/ok.bin', 'wb').write(b'x')\nprint('tmp ok')\n")
    out = _run(tmp_path, code, disk_bytes=16 * MiB)
    for d in ("/", jail.VIEW, jail.VIEW + "/autograder", "/usr"):  # folders made on the root tmpfs among them
        assert f"{d} EROFS" in out.output, out.output
    assert "tmp ok" in out.output
    if jail._can_size(jail.find_bwrap()):
        assert int(out.output.split("tmp bytes")[1].split()[0]) <= jail.TMPFS_BYTES


@needs_bwrap
def test_a_deleted_file_held_only_by_a_mapping_is_counted(tmp_path):
    code = ("import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mmap.restype = ctypes.c_void_p\nfd = os.open('m.bin', os.O_RDWR | os.O_CREAT)\n"
            "os.write(fd, b'0' * (24 << 20))\nos.unlink('m.bin')\n"
            "p = libc.mmap(None, ctypes.c_size_t(24 << 20), 1, 1, fd, ctypes.c_long(0))\n"  # PROT_READ, MAP_SHARED
            "os.close(fd)\nprint('mapped', p != ctypes.c_void_p(-1).value, flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    out = _run(tmp_path, code, disk_bytes=16 * MiB)
    assert "mapped True" in out.output and out.cause() == "disk" and time.monotonic() - t0 < 30


def test_a_look_at_too_many_descriptors_stops_and_says_so():
    held, why = disk_cap.held_deleted([os.getpid()], set(), max_open=2)
    assert held == 0 and why == "holds more than 2 open files"


def test_the_clean_up_never_changes_a_folder_a_link_names(tmp_path):
    """A student's links to folders outside the scratch: the clean-up unlinks them and leaves the folders as
    they were (the attack made an outside 755 folder and a 555 one 700, and root could so reach any folder)."""
    outside = tmp_path / "outside"
    open_dir, read_only = outside / "open", outside / "read_only"
    for d, mode in ((open_dir, 0o755), (read_only, 0o555)):
        d.mkdir(parents=True)
        (d / "keep.txt").write_text("mine") if mode == 0o755 else None
        d.chmod(mode)
    scratch = tmp_path / "scratch"
    (scratch / "deep" / "locked").mkdir(parents=True)
    os.symlink(open_dir, scratch / "to_open")
    os.symlink(read_only, scratch / "deep" / "to_read_only")
    os.symlink(outside, scratch / "deep" / "locked" / "to_outside")
    (scratch / "deep" / "locked").chmod(0o000)
    (scratch / "deep").chmod(0o500)
    disk_cap.remove_tree(scratch)
    assert not scratch.exists()
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o755 and (open_dir / "keep.txt").read_text() == "mine"
    assert stat.S_IMODE(read_only.stat().st_mode) == 0o555
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755 & ~os.umask(os.umask(0))


def test_the_clean_up_of_a_link_removes_the_link_only(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    (target / "f").write_text("x")
    os.symlink(target, tmp_path / "scratch")
    disk_cap.remove_tree(tmp_path / "scratch")
    assert not (tmp_path / "scratch").exists() and (target / "f").read_text() == "x"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755

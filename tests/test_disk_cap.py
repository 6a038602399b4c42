"""The disk caps of a sandbox (autograder.disk_cap): what a hand-in may leave on the grader's disk.

The hostile class (tests/test_autograder.py: disk_fill, disk_hidden, disk_checks) grades the same attacks end to
end; these look at the watch itself, on a CPU, in seconds.
"""

import os
import sys
import time

import pytest

from autograder import disk_cap, jail, sandbox
from autograder.remote import Remote, RemoteFailed

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
    assert use.unreadable is None and use.files == 6
    assert 2 * MiB <= use.bytes < 2 * MiB + 64 * 1024
    assert disk_cap.folder_use([tmp_path], max_files=2).files == 3  # stops counting once past the cap


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

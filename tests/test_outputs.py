"""Output paths checked before any work, files written whole with an ordinary mode, earlier runs kept; progress lines."""

import datetime as dt
import json
import os
import stat

import pytest

from labkit import outputs
from labkit.errors import LabkitError
from labkit.progress import Stages, fmt_duration


def test_check_writable_leaves_no_trace_and_names_the_problem(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    assert outputs.check_writable(deep, "dir") == deep
    assert outputs.check_writable(deep / "r.json", "file") == deep / "r.json"
    assert list(tmp_path.iterdir()) == []  # the folders it made to try are gone again
    (tmp_path / "f").write_text("x")
    with pytest.raises(LabkitError, match=r"--out .*/f/sub: cannot write there \(Not a directory\)"):
        outputs.check_writable(tmp_path / "f" / "sub", "dir", "--out")
    with pytest.raises(LabkitError, match="exists and is not a folder"):
        outputs.check_writable(tmp_path / "f", "dir")
    with pytest.raises(LabkitError, match="is a folder, not a file name"):
        outputs.check_writable(tmp_path, "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_check_writable_catches_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(LabkitError, match="cannot write there"):
        outputs.check_writable(ro / "out", "dir")


def test_fresh_path_keeps_earlier_runs(tmp_path):
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    d = tmp_path / "runs" / "ladder"
    assert outputs.fresh_path(d, "dir", now) == d  # nothing there yet
    d.mkdir(parents=True)
    assert outputs.fresh_path(d, "dir", now) == d  # an empty folder holds no run
    (d / "ladder.json").write_text("{}")
    assert outputs.fresh_path(d, "dir", now) == d.with_name("ladder-20260102-030405")
    d.with_name("ladder-20260102-030405").mkdir()
    assert outputs.fresh_path(d, "dir", now) == d.with_name("ladder-20260102-030405-2")  # same second
    f = tmp_path / "r.json"
    f.write_text("{}")
    assert outputs.fresh_path(f, "file", now) == tmp_path / "r-20260102-030405.json"


def test_prepare_output_says_where_this_run_goes(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("{}")
    said = []
    p = outputs.prepare_output(f, "file", log=said.append, what="--json")
    assert p != f and p.parent == tmp_path and said == [f"--json {f} holds an earlier run: this one goes to {p} "
                                                        "(--overwrite replaces it instead)"]
    assert outputs.prepare_output(f, "file", overwrite=True, log=said.append) == f and len(said) == 1


def test_results_and_charts_get_the_same_ordinary_mode(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    old = os.umask(0o022)
    try:
        j = outputs.write_json(tmp_path / "r.json", {"a": 1, "p": tmp_path})
        fig = plt.figure()
        png = outputs.save_figure(fig, tmp_path / "c.png")
        plt.close(fig)
        t = outputs.write_text(tmp_path / "t.md", "x")
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (j, png, t)}
    assert modes == {0o644}
    assert json.loads(j.read_text())["p"] == str(tmp_path) and png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "r.json", "t.md"]  # no temporary files


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path):
    p = outputs.write_json(tmp_path / "r.json", {"run": 1})
    with pytest.raises(TypeError):
        outputs.write_json(p, {"run": 2, "bad": object()})
    assert json.loads(p.read_text()) == {"run": 1} and [x.name for x in tmp_path.iterdir()] == ["r.json"]


def test_progress_lines_say_time_spent_and_left():
    t = [0.0]
    lines = []
    stages = Stages(2, "ladder", log=lines.append, mode="lines", every_s=10, clock=lambda: t[0])
    with stages.stage("baseline", 4) as bar:
        for _ in range(4):
            t[0] += 6
            bar.update()
    with stages.stage("no_sync", 2) as bar:
        t[0] += 30
        bar.update(2)
    assert lines[0] == "  [1/2] baseline: 4 steps, started at 0 s"
    assert lines[1] == "    baseline: 2/4 steps, 12 s, about 12 s left"
    assert lines[2] == "  [1/2] baseline: done in 24 s; ladder 24 s so far, about 24 s left"
    assert lines[-1] == "  [2/2] no_sync: done in 30 s; ladder 54 s so far"
    assert fmt_duration(600) == "10.0 min" and fmt_duration(7200) == "2.0 h"
    quiet = []
    with Stages(1, log=quiet.append, mode="off").stage("x", 3) as bar:
        bar.update()
    assert quiet == []

"""Noise is part of the ladder's result: repeated, interleaved runs; median and spread; "within noise" steps."""

import json

from labkit import report
from labkit import train as T

TINY = T.TrainConfig(width=8, n_train=512, n_test=128, epochs=1, batch_size=64, augment=False, workers=0)


def _rec(name, ips, runs=None):
    rec = {"name": name, "img_per_s": ips, "img_per_s_all": ips, "first_step_s": 0.1, "peak_mem_bytes": None,
           "mfu": None, "final_loss": 1.0, "accuracy": 0.5, "losses": [2.0, 1.5, 1.0], "config": {"batch_size": 64}}
    if runs:
        rec.update(repeats=len(runs), img_per_s_min=min(runs), img_per_s_max=max(runs), img_per_s=sorted(runs)[1])
    return rec


def test_rounds_rotate_the_rung_order():
    names = ["a", "b", "c"]
    assert [T.ladder_order(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                            ["a", "b", "c"]]


def test_merged_record_is_the_median_with_its_spread_and_every_run():
    runs = [{**_rec("x", v), "round": i, "position": i} for i, v in enumerate((100.0, 130.0, 90.0))]
    m = T.merge_runs(runs)
    assert m["img_per_s"] == 100.0 and (m["img_per_s_min"], m["img_per_s_max"]) == (90.0, 130.0)
    assert m["repeats"] == 3 and [r["img_per_s"] for r in m["runs"]] == [100.0, 130.0, 90.0]
    assert [r["round"] for r in m["runs"]] == [0, 1, 2] and "round" not in m


def test_a_step_inside_the_spread_is_labelled_within_noise():
    recs = [_rec("base", 0, [95, 100, 105]), _rec("same", 0, [98, 103, 110]), _rec("faster", 0, [190, 200, 210])]
    rows = report.ladder_rows(recs)
    assert [r["within_noise"] for r in rows] == [None, True, False]
    table = report.ladder_table(recs)
    assert "| spread |" in table and "| 95–105 |" in table
    assert "1.03x (within noise)" in table and "1.94x |" in table and "1.94x (within" not in table


def test_single_runs_keep_the_one_number_table():
    # the README's recorded ladder (one run per rung) must render exactly as before
    recs = [_rec("base", 100.0), _rec("next", 150.0)]
    table = report.ladder_table(recs)
    assert "spread" not in table and "within noise" not in table
    assert table.splitlines()[3] == "| next | 150 | 150 | 1.50x | 1.50x | - | - | 0.10 | 1.000 | 50.0% |"


def test_the_ladder_records_every_run_in_interleaved_rounds(tmp_path, monkeypatch):
    calls = []

    def fake_train(cfg, *a, progress=None, **k):
        calls.append(cfg.name)
        return {**_rec(cfg.name, 100.0 + len(calls)), "config": {"batch_size": cfg.batch_size}}

    monkeypatch.setattr(T, "train", fake_train)
    lines = []
    T.run_ladder("cpu", quick=True, names=["baseline", "no_sync", "resident_data"], out=tmp_path / "l",
                 base=TINY, show_progress=False, log=lines.append, repeats=3)
    assert calls == ["baseline", "no_sync", "resident_data", "no_sync", "resident_data", "baseline",
                     "resident_data", "baseline", "no_sync"]
    saved = json.loads((tmp_path / "l" / "ladder.json").read_text())
    assert saved["repeats"] == 3 and saved["complete"] and "rotated" in saved["order"]
    base = saved["rungs"][0]
    assert [r["img_per_s"] for r in base["runs"]] == [101.0, 106.0, 108.0] and base["img_per_s"] == 106.0
    assert [r["position"] for r in base["runs"]] == [0, 2, 1]
    md = (tmp_path / "l" / "ladder.md").read_text()
    assert "Each rung ran 3 times" in md and "| spread |" in md and "- spread: " in md
    assert (tmp_path / "l" / "ladder.png").stat().st_size > 1000


def test_quick_mode_runs_twice_on_half_the_images_and_says_so(monkeypatch):
    seen = []
    monkeypatch.setattr(T, "train", lambda cfg, *a, **k: seen.append(cfg.n_train) or _rec(cfg.name, 100.0))
    monkeypatch.setattr(T.D, "load", lambda *a, **k: T.D.synthetic_cifar(256, 64, seed=0, cache=False))
    lines = []
    res = T.run_ladder("cpu", quick=True, names=["baseline"], show_progress=False, log=lines.append)
    assert res["repeats"] == T.QUICK_REPEATS == 2 and seen == [T.quick_base().n_train // 2] * 2
    assert any("quick mode runs each rung 2 times (not 3)" in line for line in lines)

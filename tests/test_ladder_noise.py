"""Noise is part of the ladder's result: repeated, interleaved runs; median and spread; "within noise" steps."""

import json
import time

from labkit import bench, report
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
    T.run_ladder("cpu", quick=True, names=["baseline", "loader", "resident_data"], out=tmp_path / "l",
                 base=TINY, show_progress=False, log=lines.append, repeats=3)
    assert calls == ["baseline", "loader", "resident_data", "loader", "resident_data", "baseline",
                     "resident_data", "baseline", "loader"]
    saved = json.loads((tmp_path / "l" / "ladder.json").read_text())
    assert saved["repeats"] == 3 and saved["complete"] and "rotated" in saved["order"]
    base = saved["rungs"][0]
    assert [r["img_per_s"] for r in base["runs"]] == [101.0, 106.0, 108.0] and base["img_per_s"] == 106.0
    assert [r["position"] for r in base["runs"]] == [0, 2, 1]
    md = (tmp_path / "l" / "ladder.md").read_text()
    assert "Each rung ran 3 times" in md and "| spread |" in md and "- spread: " in md
    assert (tmp_path / "l" / "ladder.png").stat().st_size > 1000


def test_quick_mode_runs_once_on_all_its_images_and_says_so(monkeypatch):
    # split over two runs (2,048 images, 64 steps each) the rungs stopped on training's first plateau, at chance
    seen = []
    monkeypatch.setattr(T, "train", lambda cfg, *a, **k: seen.append(cfg.n_train) or _rec(cfg.name, 100.0))
    monkeypatch.setattr(T.D, "load", lambda *a, **k: T.D.synthetic_cifar(256, 64, seed=0, cache=False))
    lines = []
    res = T.run_ladder("cpu", quick=True, names=["baseline"], show_progress=False, log=lines.append)
    assert res["repeats"] == T.QUICK_REPEATS == 1 and seen == [T.quick_base().n_train]
    assert T.quick_base().n_train // T.quick_base().batch_size * T.quick_base().epochs >= 192
    assert any("quick mode runs each rung 1 time (not 3)" in line for line in lines)


def test_a_quick_cpu_ladder_skips_no_sync_with_the_reason():
    plan = T.ladder_plan(T.torch.device("cpu"), quick=True)
    assert "no_sync" not in [c.name for c in plan.rungs]
    assert "asynchronous" in dict(plan.skipped)["no_sync"]
    assert "no_sync" in [c.name for c in T.ladder_plan(T.torch.device("cpu"), quick=False).rungs]


def test_the_table_says_when_other_programs_shared_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "train", lambda cfg, *a, **k: {**_rec(cfg.name, 100.0), "steps": 8,
                                                          "config": {"batch_size": 64, "n_test": 512, "epochs": 2}})
    loads = iter([0.9, 0.9, 0.01, 0.01])  # other programs' cores: a loaded run, then an idle one

    def fake_stop(self):
        rec = {"cores": 2, "other_cores": next(loads), "loadavg_before": [3.0, 3.0, 3.0],
               "loadavg_after": [3.5, 3.0, 3.0]}
        return {**rec, **bench.verdict(rec)}

    monkeypatch.setattr(bench.MachineLoad, "stop", fake_stop)
    loaded = T.run_ladder("cpu", quick=True, names=["baseline"], base=TINY, out=tmp_path / "a",
                          show_progress=False, log=lambda *_: None)
    assert loaded["timings_trustworthy"] is False and loaded["rungs"][0]["runs"][0]["machine_load"]
    md = (tmp_path / "a" / "ladder.md").read_text()
    table_end = md.index("| baseline |")
    assert "**Timings not trustworthy**: other programs used 0.90 of the 2 CPU cores" in md[table_end:]
    assert "load average 3.0 before, 3.5 after" in md
    assert json.loads((tmp_path / "a" / "ladder.json").read_text())["machine_load"]["trustworthy"] is False
    idle = T.run_ladder("cpu", quick=True, names=["baseline"], base=TINY, out=tmp_path / "b",
                        show_progress=False, log=lambda *_: None)
    assert idle["timings_trustworthy"] is True
    assert "not trustworthy" not in (tmp_path / "b" / "ladder.md").read_text()


def test_the_machine_load_meter_counts_other_programs_apart_from_this_one():
    m = bench.MachineLoad()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:  # busy here: counted as this process's, not as others'
        pass
    rec = m.stop()
    assert 0 < rec["own_cores"] <= rec["cores"] + 0.1 and rec["wall_s"] >= 0.3
    if rec["other_cores"] is not None:
        assert rec["other_cores"] >= 0 and rec["trustworthy"] == (rec["other_cores"] <= 0.1 * rec["cores"])


def test_a_rung_below_the_baseline_band_says_why():
    def rung(name, acc, steps, batch):
        return {**_rec(name, 100.0), "accuracy": acc, "steps": steps,
                "config": {"batch_size": batch, "n_test": 512, "epochs": 2}}

    band, notes = T.accuracy_band([rung("baseline", 0.77, 128, 64), rung("resident_data", 0.76, 128, 64),
                                   rung("batch_fused", 0.64, 32, 256), rung("channels_last", 0.10, 128, 64)])
    assert band["low"] < 0.76 < band["high"] and abs(band["tolerance"] - 2 * (0.77 * 0.23 / 512) ** 0.5) < 1e-9
    assert len(notes) == 2 and notes[0].startswith("batch_fused ended at 64.0%")
    assert "takes 32 optimizer steps in 2 epochs against the baseline's 128" in notes[0]
    assert notes[1].startswith("channels_last") and "the same steps as the baseline" in notes[1]

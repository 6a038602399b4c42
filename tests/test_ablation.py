"""Week 6's capstone additions: leave-one-out ablation presets, time to a target accuracy, MFU against the
datasheet peak; runners tested with a fake engine (the engine itself is tested in test_train)."""

import json

import pytest
import torch

from labkit import presets as P
from labkit import report
from labkit import train as T
from labkit.env import LabkitError

CPU = torch.device("cpu")
TINY = T.TrainConfig(width=8, n_train=256, n_test=64, epochs=2, batch_size=64, augment=False, workers=0)


def test_leaving_one_change_out_of_the_top_rung():
    top = P.preset("muon")
    no_bf16 = P.without("bf16", "muon")
    assert no_bf16.precision == "default" and no_bf16.batch_size == top.batch_size and no_bf16.optimizer == "muon"
    assert P.without("cuda_graphs").compile == "default"  # the compile rung's mode remains
    assert P.without("muon").batch_size == 512 and P.without("muon").optimizer == "sgd-fused"
    configs, skipped = P.ablation()
    assert configs[0] == top and all(c.name.startswith("without_") for c in configs[1:])
    # batch_fused's and compile's fields are all set again by later rungs: leaving them out changes nothing
    assert {n for n, _ in skipped} == {"without_batch_fused", "without_compile"}
    assert "cuda_graphs sets the same fields" in dict(skipped)["without_compile"]
    for bad in (("baseline", "muon"), ("muon", "bf16"), ("warp", "muon")):
        with pytest.raises(LabkitError):
            P.without(*bad)


def test_ablation_plan_fits_the_device_and_says_what_it_skips():
    plan = T.plan_ablation(CPU, True, base=TINY)
    names = [c.name for c in plan.rungs]
    assert names[:2] == ["baseline", "batch_fused"] and "without_resident_data" in names
    assert "without_bf16" in dict(plan.skipped)  # a CPU trains bf16 rungs in fp32: no effect to measure
    assert all(c.batch_size <= 256 for c in plan.rungs)
    with pytest.raises(LabkitError, match="CUDA graphs need a CUDA GPU"):
        T.plan_ablation(CPU, True, top="cuda_graphs", base=TINY)
    with pytest.raises(LabkitError, match="--drop 'muon'"):
        T.plan_ablation(CPU, True, top="channels_last", drop=["muon"], base=TINY)


def _run(name, ips, curve, first=0.5, batch=64):
    return {"name": name, "img_per_s": ips, "first_step_s": first, "config": {"batch_size": batch},
            "accuracy_curve": [{"epoch": i + 1, "train_s": t, "accuracy": a} for i, (t, a) in enumerate(curve)]}


def test_time_to_target_with_and_without_compilation():
    run = _run("x", 640.0, [(3.0, 0.4), (5.0, 0.7), (7.0, 0.8)], first=2.1)
    assert report.time_to_target(run, 0.7) == (5.0, pytest.approx(5.0 - (2.1 - 0.1)))
    assert report.time_to_target(run, 0.9) is None and report.time_to_target({"img_per_s": 1}, 0.5) is None
    recs = [{**_run("baseline", 100.0, [(10.0, 0.5), (20.0, 0.6)]), "img_per_s_all": 90, "final_loss": 1.0,
             "accuracy": 0.6, "mfu": None, "mfu_datasheet": None},
            {**_run("fast", 400.0, [(3.0, 0.62), (6.0, 0.7)]), "img_per_s_all": 300, "final_loss": 0.9,
             "accuracy": 0.7, "mfu": 0.4, "mfu_datasheet": 0.3}]
    table = report.ladder_table(recs, target=0.6)
    assert "| MFU | share of measured peak |" in table and "| to target s |" in table and "| 3.0 / 2.7 |" in table
    assert "| 20.0 / 20.0 |" in table and "30.0%" in table
    plain = report.ladder_table([{k: v for k, v in r.items() if k not in ("accuracy_curve", "mfu_datasheet")}
                                 for r in recs])
    assert "to target" not in plain and "| MFU |" not in plain  # no datasheet peak: no MFU column
    abl = report.ablation_table(recs, 0.6)
    assert "| fast | 400 | - | 1.00x | 70.0% | 3.0 / 2.7 | 30.0% | 40.0% |" in abl


def _fake_train(calls):
    def train(cfg, device=None, dataset=None, peak_tflops=None, progress=None, on_step=None):
        calls.append(cfg)
        fast = 1 + cfg.channels_last + (cfg.loader == "resident")
        curve = [{"epoch": 1, "steps": 2, "train_s": 4.0 / fast, "accuracy": 0.3 * fast},
                 {"epoch": 2, "steps": 4, "train_s": 8.0 / fast, "accuracy": 0.2 + 0.1 * fast}]
        return {"name": cfg.name, "img_per_s": 100.0 * fast, "img_per_s_all": 90.0, "first_step_s": 0.1,
                "peak_mem_bytes": None, "mfu": None, "achieved_tflops": 1e-3, "final_loss": 1.0,
                "accuracy": curve[-1]["accuracy"], "losses": [2.0, 1.0], "accuracy_curve": curve,
                "config": __import__("dataclasses").asdict(cfg)}
    return train


def test_ablation_run_writes_its_own_files_with_the_target(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(T, "train", _fake_train(calls))
    T.run_ladder("cpu", quick=True, base=TINY, out=tmp_path, repeats=1, ablation=True, top="channels_last",
                 drop=["resident_data", "channels_last"], show_progress=False, log=lambda *a: None)
    assert [c.name for c in calls] == ["baseline", "channels_last", "without_resident_data", "without_channels_last"]
    assert all(c.eval_every_epoch for c in calls)
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert saved["kind"] == "ablation" and saved["target_accuracy"] == pytest.approx(0.3)
    md = (tmp_path / "ablation.md").read_text()
    assert "| without_channels_last |" in md and "Target accuracy (the lowest of the baseline's runs): 30.00%." in md
    assert (tmp_path / "ablation.png").exists() and not (tmp_path / "ladder.json").exists()


def test_ablation_from_a_ladder_trains_only_what_the_ladder_did_not(monkeypatch):
    calls = []
    monkeypatch.setattr(T, "train", _fake_train(calls))
    lad = T.run_ladder("cpu", quick=True, base=TINY, names=["baseline", "resident_data", "channels_last"],
                       repeats=1, show_progress=False, log=lambda *a: None)
    calls.clear()
    abl = T.ablation_from(lad, "cpu", drop=["resident_data", "channels_last"], log=lambda *a: None)
    assert [c.name for c in calls] == ["without_resident_data"]
    assert [r["name"] for r in abl["rungs"]] == ["baseline", "channels_last", "without_resident_data",
                                                 "without_channels_last"]
    assert abl["reused"] == ["without_channels_last = resident_data"] and abl["target_accuracy"] == pytest.approx(0.3)


def test_cli_ablation_flags_fail_clearly(capsys):
    from labkit.cli import main

    assert main(["ladder", "--drop", "bf16"]) != 0
    assert "go with --ablation" in capsys.readouterr().err
    assert main(["ladder", "--ablation", "--top", "muon"]) != 0
    assert "cannot ablate from 'muon'" in capsys.readouterr().err


def test_an_accuracy_curve_costs_no_training_time_and_ends_at_the_final_accuracy():
    from labkit import data as D

    ds = D.synthetic_cifar(128, 64, seed=0, cache=False)
    small = T.with_changes(TINY, n_train=128)
    r = T.train(T.with_changes(small, eval_every_epoch=True), "cpu", dataset=ds)
    curve = r["accuracy_curve"]
    assert [c["epoch"] for c in curve] == [1, 2] and curve[-1]["accuracy"] == r["accuracy"]
    assert curve[-1]["train_s"] == pytest.approx(sum(r["epoch_s"]))  # evaluation time left out
    assert T.train(small, "cpu", dataset=ds)["accuracy_curve"] is None

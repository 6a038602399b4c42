import json
import math
import subprocess
import sys

import numpy as np
import pytest

from labkit import data as D
from labkit import train as T
from labkit.env import LabkitError

TINY = T.TrainConfig(width=8, n_train=512, n_test=128, epochs=1, batch_size=64, augment=False, workers=0)


@pytest.fixture(scope="module")
def ds():
    return D.synthetic_cifar(4096, 512, seed=0, cache=False)


def _run(cfg, ds, **kw):
    return T.train(T.with_changes(cfg, **kw), "cpu", dataset=ds)


def test_quick_training_beats_chance_by_a_wide_margin(ds):
    cfg = T.with_changes(T.quick_base(), loader="resident", channels_last=True)
    r = T.train(cfg, "cpu", dataset=ds)
    assert r["accuracy"] > 0.3  # chance is 0.10
    assert r["losses"][-1] < r["losses"][0]
    assert r["img_per_s"] > 0 and r["steps"] == 192 and r["flops_per_image"] > 0


def test_every_cpu_rung_trains_with_finite_falling_loss(ds):
    plan = T.plan_ladder(__import__("torch").device("cpu"), quick=True,
                         base=T.with_changes(TINY, epochs=2, lr=0.05))
    assert {n for n, _ in plan.skipped} >= {"bf16", "cuda_graphs", "muon"}
    for cfg in plan.rungs:
        cfg = T.with_changes(cfg, batch_size=min(cfg.batch_size, 64), workers=min(cfg.workers, 1))
        r = T.train(cfg, "cpu", dataset=ds)
        assert all(math.isfinite(v) for v in r["losses"]), cfg.name
        k = max(2, len(r["losses"]) // 4)
        assert np.mean(r["losses"][-k:]) < np.mean(r["losses"][:k]), cfg.name


def test_loading_paths_and_optimizers_track_the_reference_losses(ds):
    # Same data order, no augmentation: every path must compute the same function, step for step.
    K = 6
    tiny = T.with_changes(TINY, lr=0.02)  # gentle steps: rounding differences stay rounding-sized
    ref = _run(tiny, ds, loader="resident", max_steps=K)["losses"]
    assert len(ref) == K
    for changes, tol in [
        (dict(loader="pil"), 1e-4),            # PNG decode + torchvision transforms: lossless, same numbers
        (dict(loader="tensor"), 1e-5),
        (dict(loader="pil", workers=2, pin_memory=True, persistent_workers=True, prefetch_factor=2), 1e-4),
        (dict(loader="resident", optimizer="sgd-foreach"), 1e-4),
        (dict(loader="resident", optimizer="sgd-fused"), 1e-4),
        (dict(loader="resident", channels_last=True), 2e-3),  # different conv algorithms: rounding differs
        (dict(loader="resident", sync_every_step=False), 1e-6),
        (dict(loader="resident", checkpointing=True), 1e-4),
        (dict(loader="resident", precision="fp32"), 1e-4),
    ]:
        got = _run(tiny, ds, max_steps=K, **changes)["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
        assert rel < tol, (changes, rel)
    # bf16 autocast: same trajectory within bf16's ~3 significant digits.
    got = _run(tiny, ds, loader="resident", max_steps=K, precision="bf16")["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) < 3e-2


def test_large_batch_recipe_switches_do_what_they_say(ds):
    import torch

    from labkit.models import resnet18

    torch.manual_seed(0)
    plain = resnet18(width=8)
    torch.manual_seed(0)
    zero = resnet18(width=8, zero_init_residual=True)
    for (name, a), (_, b) in zip(plain.named_parameters(), zero.named_parameters(), strict=True):
        if name.endswith("bn2.weight"):  # each block starts as its shortcut: last BatchNorm scale 0
            assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a) > 0, name
        else:  # and nothing else changed: the same random stream
            assert torch.equal(a, b), name
    opt = T._make_optimizer(T.with_changes(TINY, bn_weight_decay=False), plain, lr=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == TINY.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(plain.parameters()))
    assert len(T._make_optimizer(TINY, plain, lr=0.1).param_groups) == 1
    # Linear lr scaling at batch 256 doubles the peak lr (sqrt scaling: x1.41): the first warm-up step shows it.
    base = T.with_changes(TINY, batch_size=256, warmup_frac=0.5, max_steps=2, lr=0.01)
    lin, sq = (_run(base, ds, lr_scaling=k)["losses"] for k in ("linear", "sqrt"))
    assert lin[0] == sq[0] and lin[1] != sq[1]
    r = _run(TINY, ds, zero_init_residual=True, bn_weight_decay=False, lr_scaling="linear", epochs=2)
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0]
    with pytest.raises(LabkitError, match="lr_scaling"):
        T.check_config(T.with_changes(TINY, lr_scaling="cubic"), torch.device("cpu"))


def test_adamw_option_is_fused_adamw_with_the_same_parameter_groups(ds):
    import torch

    from labkit.models import resnet18

    model = resnet18(width=8)
    opt = T._make_optimizer(T.with_changes(TINY, optimizer="adamw-fused", bn_weight_decay=False, momentum=0.8,
                                           weight_decay=0.05), model, lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
    assert opt.defaults["betas"] == (0.8, 0.99) and [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    r = _run(TINY, ds, optimizer="adamw-fused", lr=2e-3, weight_decay=0.05, epochs=2)
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0]
    for bad, msg in ((dict(momentum=1.0), "beta1"), (dict(weight_decay=-0.1), "weight_decay")):
        with pytest.raises(LabkitError, match=msg):  # not torch's ValueError from inside AdamW
            T.check_config(T.with_changes(TINY, optimizer="adamw-fused", **bad), torch.device("cpu"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="the CUDA kernel needs a GPU"))])
def test_fused_sgd_survives_steps_that_grad_scaler_skips(device):
    """fp16 gradients overflow at GradScaler's starting scale, so the first step is often skipped. Fused SGD
    would then read momentum buffers it never wrote (torch makes them with empty_like); the engine's fused SGD
    must take the same steps as the per-parameter loop, a skipped later step included."""
    import torch

    params = {}
    for name in ("sgd", "sgd-fused"):
        w = torch.nn.Linear(4, 1, bias=False).to(device)
        torch.nn.init.ones_(w.weight)
        opt = T._make_optimizer(T.with_changes(TINY, optimizer=name, weight_decay=0.0), w, lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        inf = float("inf")
        for g in ([inf, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, inf, 1, 1], [1, 2, 1, 1]):  # two overflows
            scaler.scale(w(torch.tensor([g], dtype=torch.float32, device=device)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        params[name] = w.weight.detach().clone()
    assert torch.isfinite(params["sgd-fused"]).all()
    # the same steps up to rounding: the CUDA kernel fuses multiply-adds, so its last bits differ from the loop's
    assert torch.allclose(params["sgd-fused"], params["sgd"], rtol=1e-5, atol=1e-6), params


def test_compile_settings_patch_inductor_only_where_they_leave_its_defaults():
    import torch._inductor.config as inductor_config

    plain = T.with_changes(TINY, compile="default")
    with T._switches(plain):
        assert inductor_config.triton.autotune_pointwise is True and inductor_config.combo_kernels is False
    fast = T.with_changes(plain, compile_autotune=False, compile_combo=True)
    with T._switches(fast):  # the patch covers the loop, where torch.compile compiles lazily
        assert inductor_config.triton.autotune_pointwise is False and inductor_config.combo_kernels is True
    assert inductor_config.triton.autotune_pointwise is True and inductor_config.combo_kernels is False
    for change in (dict(compile_combo=True), dict(matmul_edges=True)):
        with pytest.raises(LabkitError, match="set compile too"):
            T.check_config(T.with_changes(TINY, **change), __import__("torch").device("cpu"))


def test_the_graph_key_names_what_changes_the_compiled_graph_and_nothing_else():
    top = T.preset("muon")
    same = T.with_changes(top, epochs=11, lr=0.01, seed=3, n_train=1000, cudnn_benchmark=False, evaluate=False)
    assert T.graph_key(same) == T.graph_key(top) and T.graph_key(top)["batch_size"] == 4096
    for change in (dict(batch_size=2048), dict(precision="fp16"), dict(channels_last=False), dict(width=32),
                   dict(compile="default"), dict(compile_autotune=False), dict(matmul_edges=True)):
        assert T.graph_key(T.with_changes(top, **change)) != T.graph_key(top), change


def test_cudnn_limit_covers_the_loop_and_rejects_negatives():
    import torch

    before = torch.backends.cudnn.benchmark_limit
    with T._switches(T.with_changes(TINY, cudnn_benchmark=True, cudnn_limit=3)):
        assert torch.backends.cudnn.benchmark_limit == 3
    assert torch.backends.cudnn.benchmark_limit == before
    with pytest.raises(LabkitError, match="cudnn_limit must be >= 0"):
        T.check_config(T.with_changes(TINY, cudnn_limit=-1), torch.device("cpu"))


def test_evaluation_leaves_cudnn_autotuning_off_and_restores_it(ds):
    """The test batch differs from the training batch: autotuning would time every convolution again."""
    import torch

    seen = []
    model = T.resnet18(num_classes=10, width=8)
    model.register_forward_pre_hook(lambda m, a: seen.append(torch.backends.cudnn.benchmark))
    cfg = T.with_changes(TINY, cudnn_benchmark=True)
    with T._switches(cfg):
        T.evaluate(model, ds.subset(64, 128), cfg, torch.device("cpu"), batch_size=64)
        assert torch.backends.cudnn.benchmark is True
    assert seen == [False, False]


def test_bad_configs_fail_clearly():
    import torch

    cpu = torch.device("cpu")
    with pytest.raises(LabkitError, match="unknown preset"):
        T.preset("turbo")
    with pytest.raises(LabkitError, match="CUDA graphs"):
        T.check_config(T.with_changes(TINY, compile="reduce-overhead"), cpu)
    with pytest.raises(LabkitError, match="CUDA graphs"):
        T.check_config(T.with_changes(TINY, compile="max-autotune"), cpu)
    with pytest.raises(LabkitError, match="compile_tuning"):
        T.check_config(T.with_changes(TINY, compile_tuning=True), cpu)
    with pytest.raises(LabkitError, match="fp16"):
        T.check_config(T.with_changes(TINY, precision="fp16"), cpu)
    with pytest.raises(LabkitError, match="precision must be"):
        T.check_config(T.with_changes(TINY, precision="fp8"), cpu)
    with pytest.raises(LabkitError, match="multiple of accumulation"):
        T.check_config(T.with_changes(TINY, accumulation=3), cpu)
    with pytest.raises(LabkitError, match="unknown TrainConfig field"):
        T.with_changes(TINY, turbo=True)
    with pytest.raises(LabkitError, match="unknown rung"):
        T.plan_ladder(cpu, True, ["baseline", "warp"])


def test_missing_dataset_path_fails_clearly(ds, tmp_path):
    with pytest.raises(LabkitError, match="does not exist"):
        _run(TINY, ds, loader="pil", data_dir=str(tmp_path / "missing"), max_steps=1)


def test_cli_bad_input_one_line_and_nothing_written(tmp_path):
    out = tmp_path / "out"
    for args, needle in [
        (["ladder", "--rungs", "baseline,warp", "--out", str(out)], "unknown rung"),
        (["ladder", "--device", "cuda", "--out", str(out)], "no CUDA GPU"),
        (["train", "--preset", "nope"], "unknown preset"),
        (["train", "--quick", "--set", "batch_size=lots"], "whole number"),
        (["train", "--quick", "--set", "precision=fp16"], "fp16"),
    ]:
        if "cuda" in args and __import__("torch").cuda.is_available():
            continue
        r = subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def _fake_train(calls, stop_at, exc):
    """A stand-in for T.train: a real-looking record at once, and `exc` raised on call number `stop_at`."""
    def train(cfg, *a, progress=None, **k):
        calls.append(cfg.name)
        if len(calls) == stop_at:
            raise exc
        for _ in range(3):
            progress.update(1)
        return {"name": cfg.name, "img_per_s": 100.0 * len(calls), "img_per_s_all": 90.0, "first_step_s": 0.1,
                "peak_mem_bytes": None, "mfu": None, "final_loss": 1.0, "accuracy": 0.5, "losses": [2.0, 1.0]}
    return train


def test_ladder_writes_its_files_after_every_rung_and_says_what_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "train", _fake_train([], 0, None))  # the engine is tested above; this is the runner
    base = T.with_changes(TINY, epochs=1)
    out = tmp_path / "ladder"
    lines = []
    res = T.run_ladder("cpu", quick=True, names=["loader", "resident_data", "bf16"], out=out, base=base,
                       show_progress=False, log=lines.append)
    assert [r["name"] for r in res["rungs"]] == ["loader", "resident_data"]
    saved = json.loads((out / "ladder.json").read_text())
    assert saved["env"]["torch"] and len(saved["rungs"]) == 2 and saved["complete"] and saved["stopped"] is None
    assert saved["mode"].startswith("quick") and saved["skipped"][0]["rung"] == "bf16"
    assert "img/s (steady)" in saved["columns"] and "vs previous" in saved["columns"]
    md = (out / "ladder.md").read_text()
    assert "| rung |" in md and "Mode: quick" in md and "- skipped bf16: " in md
    assert "- img/s (steady): " in md and "- vs previous: " in md and "The whole run took " in md
    assert (out / "ladder.png").stat().st_size > 1000
    assert any(line.startswith("ladder finished in ") for line in lines)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), LabkitError("boom")], ids=["ctrl-c", "crash"])
def test_an_interrupt_or_a_crash_keeps_the_finished_rungs(tmp_path, monkeypatch, exc):
    calls = []
    monkeypatch.setattr(T, "train", _fake_train(calls, 2, exc))
    out = tmp_path / "ladder"
    lines = []
    with pytest.raises(type(exc)):
        T.run_ladder("cpu", quick=True, names=["baseline", "loader", "resident_data"], out=out,
                     base=T.with_changes(TINY, epochs=1), show_progress=False, log=lines.append)
    assert calls == ["baseline", "loader"]
    saved = json.loads((out / "ladder.json").read_text())
    assert [r["name"] for r in saved["rungs"]] == ["baseline"] and saved["complete"] is False
    assert saved["stopped"] == ("interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else "LabkitError: boom")
    md = (out / "ladder.md").read_text()
    assert "| baseline |" in md and "not run: loader, resident_data" in md
    assert (out / "ladder.png").stat().st_size > 1000
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind
    assert any("the 1 rung(s) with a finished run are saved in" in line for line in lines)


def test_ladder_progress_is_a_line_per_rung_off_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "train", _fake_train([], 0, None))
    monkeypatch.setattr("labkit.progress._bars_work", lambda: False)  # output piped, as under make demo > log
    lines = []
    T.run_ladder("cpu", quick=True, names=["baseline", "loader"], base=T.with_changes(TINY, epochs=1), log=lines.append,
                 repeats=1)
    starts = [x for x in lines if "steps, started at" in x]
    ends = [x for x in lines if ": done in " in x]
    assert len(starts) == 2 and starts[0].strip().startswith("[1/2] baseline")
    assert len(ends) == 2 and "about" in ends[0] and "left" in ends[0] and "left" not in ends[1]


def test_unwritable_ladder_output_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "train", lambda *a, **k: pytest.fail("trained before checking the output"))
    (tmp_path / "f").write_text("")
    with pytest.raises(LabkitError, match="cannot write there"):
        T.run_ladder("cpu", quick=True, names=["baseline"], out=tmp_path / "f" / "ladder", base=TINY)


def test_ddp_graph_split_switch_covers_the_loop_and_is_restored():
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.optimize_ddp
    with T._switches(TINY):  # one compiled graph under DDP unless asked
        assert dynamo_config.optimize_ddp is False
    with T._switches(T.with_changes(TINY, ddp_split_graphs=True)):
        assert dynamo_config.optimize_ddp is True
    assert dynamo_config.optimize_ddp == before


def test_compile_tuning_switch_covers_the_loop_and_is_restored():
    import torch._inductor.config as inductor_config

    before = inductor_config.coordinate_descent_tuning
    with T._switches(T.with_changes(TINY, compile="default", compile_tuning=True)):
        assert inductor_config.coordinate_descent_tuning is True
    assert inductor_config.coordinate_descent_tuning == before
    with T._switches(TINY):
        assert inductor_config.coordinate_descent_tuning == before


def test_steps_and_accuracy_points_from_top_rung_results():
    import matplotlib

    matplotlib.use("Agg")
    from labkit import report

    res = {"epochs": 5, "variants": {
        "rung": {"changes": {}, "accuracy": 0.92, "img_per_s": 72e3},
        "big adamw": {"changes": {"batch_size": 2048, "optimizer": "adamw-fused"}, "accuracy": 0.5,
                      "accuracy_median": 0.886, "img_per_s_median": 85e3},
        "rung 10 epochs": {"changes": {"epochs": 10}, "accuracy": 0.979},
        "collapsed": {"changes": {"batch_size": 2048, "lr": 0.1}, "accuracy_median": 0.1},
        "failed": {"changes": {"batch_size": 1024}, "error": "LabkitError: NaN"}}}
    pts = {p["label"]: p for p in report.steps_and_accuracy([res])}
    assert pts["rung"]["steps"] == (50_000 // 512) * 5 and pts["rung"]["batch"] == 512
    assert pts["big adamw"]["steps"] == 24 * 5 and pts["big adamw"]["accuracy"] == 0.886  # the median, not seed 0
    assert pts["big adamw"]["optimizer"] == "adamw-fused" and pts["big adamw"]["img_per_s"] == 85e3
    assert pts["rung 10 epochs"]["steps"] == 97 * 10
    assert [k for k, p in pts.items() if p["diverged"]] == ["collapsed", "failed"]
    ax = report.accuracy_vs_steps_chart(list(pts.values()))
    assert sum(len(c.get_offsets()) for c in ax.collections) == 3 and "2 diverged runs not shown" in ax.get_title()


def test_train_runs_a_rung_as_the_ladder_runs_it_on_this_device_and_says_what_changed(tmp_path, capsys,
                                                                                      monkeypatch):
    """`labkit train --preset` on a CPU (or a GPU without bf16 tensor cores) trains the rung as the ladder and the
    compile-cache artifact do, saying so; an explicit --set still wins."""
    from labkit.cli import main

    ran = []
    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: ran.append(cfg) or {"img_per_s": 1.0, "final_loss": 2.0,
                                                                                "accuracy": None})
    # a CPU cannot replay CUDA graphs: without --set compile=none the command stops before loading anything
    assert main(["train", "--quick", "--device", "cpu", "--preset", "muon", "--no-compile-cache"]) == 2
    assert "CUDA graphs (compile=reduce-overhead) need a CUDA GPU" in capsys.readouterr().err
    assert ran == []
    assert main(["train", "--quick", "--device", "cpu", "--preset", "muon", "--no-compile-cache",
                 "--set", "compile=none"]) == 0
    assert ran[-1].precision == "default" and ran[-1].batch_size == T.QUICK_CPU_BATCH  # as the quick CPU ladder runs it
    out = capsys.readouterr().out
    assert "muon: bf16 -> default, as the ladder runs it here: a CPU trains bf16 rungs in its default precision" in out
    assert f"muon: batch 4096 -> {T.QUICK_CPU_BATCH}, as the ladder runs it here: 2 cores run a larger batch" in out
    assert main(["train", "--quick", "--device", "cpu", "--preset", "muon", "--no-compile-cache",
                 "--set", "precision=bf16", "batch_size=512", "compile=none"]) == 0
    assert ran[-1].precision == "bf16" and ran[-1].batch_size == 512
    capsys.readouterr()
    assert main(["train", "--quick", "--device", "cpu", "--preset", "resident_data", "--no-compile-cache"]) == 0
    assert "->" not in capsys.readouterr().out  # an fp32 rung: nothing to fit
    from t4_fake import fake_t4

    with fake_t4(cuda_device=True):  # the free Colab GPU: bf16 only emulated, which check_config refuses
        assert main(["train", "--device", "cuda", "--preset", "muon", "--no-compile-cache"]) == 0
    assert ran[-1].precision == "fp16" and ran[-1].batch_size == 4096
    assert "muon: bf16 -> fp16, as the ladder runs it here: this GPU has no bf16 tensor cores" in capsys.readouterr().out


def test_the_quick_cpu_ladder_keeps_the_batch_rung_at_quick_batch_and_says_why():
    """At batch 256 the quick CPU batch rung had 48 steps against the baseline's 192 and ended below the
    baseline's accuracy band, for no speed (a CPU has nothing to fill): the quick CPU ladder keeps it at quick
    mode's batch, and its notes say so; a full-size ladder keeps the rung's batch."""
    import torch

    cpu = torch.device("cpu")
    plan = T.plan_ladder(cpu, quick=True)
    fused = next(c for c in plan.rungs if c.name == "batch_fused")
    assert fused.batch_size == T.quick_base().batch_size == T.QUICK_CPU_BATCH and fused.optimizer == "sgd-fused"
    assert T.QUICK_CPU_BATCH_NOTE in plan.notes
    assert T.QUICK_CPU_BATCH_NOTE not in T.plan_ladder(cpu, quick=True, names=["baseline", "loader"]).notes
    assert next(c for c in T.plan_ladder(cpu, quick=False).rungs if c.name == "batch_fused").batch_size == 512


def test_a_train_record_says_where_the_wall_time_went(tmp_path):
    """Besides its epochs, a run spends time before the command, loading, setting up and evaluating: the record
    splits it, so a cold start's wait can be read off the record and not only its first step."""
    from pathlib import Path

    from labkit.cli import main

    out = tmp_path / "train.json"
    assert main(["train", "--quick", "--device", "cpu", "--preset", "bf16", "--no-compile-cache", "--json", str(out),
                 "--set", "width=4", "n_train=256", "n_test=64", "max_steps=2", "workers=0"]) == 0
    stages = json.loads(out.read_text())["stages_s"]
    assert set(stages) == {"process_before_command", "device_and_config", "compile_cache_load", "setup", "loop",
                           "final_evaluation"}
    assert all(v is None or v >= 0 for v in stages.values())
    if Path("/proc/self/stat").exists():  # Linux: the interpreter and imports ran before the command
        assert stages["process_before_command"] > 0
    age = T.process_age_s()
    assert age is None or age > stages["process_before_command"]


def test_rungs_that_share_convolution_shapes_with_and_without_cudnn_autotuning_are_named():
    """In one process PyTorch reuses the first cuDNN pick for a shape whatever cudnn.benchmark says, so a ladder or
    an ablation on a GPU says which of its rungs cannot show what autotuning is worth."""
    ladder = [T.preset(n) for n in T.RUNG_NAMES]
    assert T.cudnn_shared_shapes(ladder) == [["batch_fused", "cudnn_benchmark", "compile", "cuda_graphs"]]
    top = T.preset("muon")
    assert T.cudnn_shared_shapes([top, T.with_changes(top, name="without_cudnn_benchmark", cudnn_benchmark=False)]) \
        == [["muon", "without_cudnn_benchmark"]]
    assert T.cudnn_shared_shapes([top, T.with_changes(top, name="half", batch_size=2048, cudnn_benchmark=False)]) == []


def test_ddp_settings_reach_the_wrapper(monkeypatch, tmp_path):
    """The DDP fields of TrainConfig are what DistributedDataParallel gets (one gloo process stands for a run)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(T, "world", lambda: (0, 2))  # wrap as a multi-process run would
        cfg = T.with_changes(TINY, ddp_broadcast_buffers=False, ddp_bucket_mb=7)
        model, net, _ = T._build_model(cfg, 10, __import__("torch").device("cpu"))
        assert net is not model and net.module is model
        assert net.broadcast_buffers is False and net.static_graph and net.gradient_as_bucket_view
        assert net.bucket_bytes_cap == 7 * 1024 * 1024
    finally:
        dist.destroy_process_group()


def test_a_batch_larger_than_the_images_is_refused_before_work_and_quick_gpu_rungs_fit(monkeypatch):
    """`labkit ladder --quick` on a GPU trained 10 rungs, then stopped at the top one: its batch of 4096 was more
    than quick mode's 2048 images (found on an H200). Quick mode now fits each rung's batch to its images, as it
    keeps CPU batches at quick mode's, and a config that asks for more is refused before anything loads."""
    import torch

    cpu = torch.device("cpu")
    with pytest.raises(LabkitError, match="batch_size 512 is larger than the 256 training images"):
        T.check_config(T.with_changes(T.preset("batch_fused"), n_train=256), cpu)
    T.check_config(T.with_changes(T.preset("batch_fused"), n_train=512), cpu)
    monkeypatch.setattr(T, "native_bf16", lambda device: True)  # the GPU's side of fit_rung, without a GPU
    base = T.with_changes(T.ladder_plan(cpu, True).base, n_train=2048)  # fewer images than the top batch
    top = T.fit_rung(T.preset("muon", base), torch.device("cuda"), quick=True)
    assert top.batch_size == base.n_train < T.preset("muon").batch_size and top.precision == "bf16"
    assert T.fit_rung(T.preset("muon"), torch.device("cuda"), quick=False).batch_size == 4096  # full size untouched

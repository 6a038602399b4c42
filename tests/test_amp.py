"""labkit.amp: hand-made loss scalers against torch.amp.GradScaler, clipping, accumulation, checkpointing, memory."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit import amp, loss_scaling
from labkit.env import REPO_ROOT, LabkitError
from labkit.models import resnet18


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """These models are tiny: one thread is faster, and immune to stalls when other processes share the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ----------------------------------------------------------------------------------- scalers vs GradScaler


@pytest.fixture(scope="module")
def traces():
    return amp.compare_scalers("cpu")


@pytest.mark.parametrize("name", list(amp.crafted_sequences()))
def test_dynamic_scaler_matches_gradscaler(traces, name):
    ref, mine = traces[name]["GradScaler"], traces[name]["DynamicLossScaler"]
    assert mine.scales == ref.scales
    assert mine.skipped == ref.skipped
    assert mine.params == ref.params  # the unscaled gradients, hence the updates, are bit-identical


def test_crafted_sequences_exercise_every_rule(traces):
    """Guard against sequences too gentle to tell a wrong scaler from a right one."""
    ref = {n: t["GradScaler"] for n, t in traces.items()}
    assert ref["inf_and_nan"].skipped == [False, True, False, True, True, False, False]
    assert ref["growth"].scales == [16, 16, 16, 32, 32, 32, 64, 64, 64, 128]
    ob = ref["overflow_backoff"]
    assert ob.skipped[:2] == [True, True] and min(ob.scales) < ob.scales[0] and not all(ob.skipped)
    odd = ref["odd_factors"].scales  # growth 1.7 / backoff 0.3 give values that need float32 rounding
    assert any(s != float(int(s)) for s in odd)
    ceil = ref["float32_ceiling"].scales
    assert ceil[0] == 2.0**126 and ceil[1] == 2.0**127 and ceil[-1] == 2.0**127  # growth beyond fp32 max refused
    # a scaler with one changed rule would differ somewhere
    wrong = amp.drive_scaler(amp.DynamicLossScaler(2.0**16, growth_interval=5), amp.crafted_sequences()
                             ["overflow_backoff"]["grads"])
    assert wrong.scales != ob.scales


def test_static_scaler_never_moves_and_skips_like_gradscaler(traces):
    for name, t in traces.items():
        assert len(set(t["StaticLossScaler"].scales)) == 1, name
    # where inf/NaN come from the gradient itself, not from the scale, skips agree with GradScaler
    t = traces["inf_and_nan"]
    assert t["StaticLossScaler"].skipped == t["GradScaler"].skipped
    # where the scale causes the overflow, a static scale keeps overflowing: every big step is skipped
    assert traces["overflow_backoff"]["StaticLossScaler"].skipped == [True] * 8 + [False] * 6


def _two_copies(precision="fp16", **kw):
    model = amp.build_mlp("tiny")
    a = amp.AmpTrainer(copy.deepcopy(model), precision, device="cpu", **kw)
    b = amp.AmpTrainer(copy.deepcopy(model), precision, device="cpu", **kw)
    return a, b


def test_dynamic_scaler_matches_gradscaler_in_autocast_training():
    """Real fp16 autocast training where the first scales overflow: same scales, skips and weights."""
    a, b = _two_copies("fp16")
    kw = dict(init_scale=2.0**40, growth_interval=3)
    a.scaler, b.scaler = torch.amp.GradScaler("cpu", **kw), amp.DynamicLossScaler(**kw)
    sa, sb = [], []
    for i in range(10):
        x, y = amp.teacher_batch(i, 32)
        sa.append(a.scaler.get_scale())
        sb.append(b.scaler.get_scale())
        la, lb = a.step(x, y), b.step(x, y)
        assert torch.equal(la, lb)
    assert sa == sb
    assert sa[1] < sa[0]  # it did back off, so skipping was exercised
    assert b.scaler.skipped_steps > 0
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_scaler_usage_errors_mirror_gradscaler():
    p = torch.nn.Parameter(torch.ones(3))
    for make in (lambda: torch.amp.GradScaler("cpu"), amp.DynamicLossScaler, amp.StaticLossScaler):
        s, opt = make(), torch.optim.SGD([p], lr=0.1)
        s.scale(p.sum()).backward()
        s.unscale_(opt)
        with pytest.raises(RuntimeError):
            s.unscale_(opt)
        s.step(opt)
        with pytest.raises(RuntimeError):
            s.step(opt)
        s.update()
        p.grad = None
    # labkit's errors are also LabkitErrors (one-line messages in the CLI)
    s = amp.DynamicLossScaler()
    with pytest.raises(LabkitError, match="call step"):
        s.update()
    with pytest.raises(LabkitError, match="no gradients"):
        s.step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_scaler_refuses_fp16_grads_and_bad_settings():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    p.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(LabkitError, match="master weights"):
        amp.DynamicLossScaler().step(torch.optim.SGD([p], lr=0.1))
    for kw in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"backoff_factor": 0.0}, {"growth_interval": 0},
               {"init_scale": float("inf")}, {"init_scale": -1.0}):
        with pytest.raises(LabkitError):
            amp.DynamicLossScaler(**kw)


def test_overflow_streak_down_to_zero_scale_stops_where_gradscaler_corrupts_weights():
    """Gradients that are inf at every scale back the scale off until its float32 reciprocal overflows.

    GradScaler carries on: at 2**-128 (and at 0, two steps later) its unscale factor is inf, so the first
    finite gradients are turned into inf/NaN and applied. labkit matches it up to the last usable scale, then
    stops with a LabkitError instead of a bare ZeroDivisionError or NaN weights.
    """
    inf, one = [1.0, float("inf"), 0.0], [1e-3, -2e-4, 5e-6]
    ref = amp.drive_scaler(torch.amp.GradScaler("cpu"), [inf] * 170 + [one] * 2)
    usable = [s for s in ref.scales if s >= 2.0**-127]
    assert usable == [2.0 ** (16 - i) for i in range(144)] and 0.0 in ref.scales
    assert all(math.isnan(v) for v in ref.params[-1])  # GradScaler ends with NaN weights, steps not skipped
    mine = amp.DynamicLossScaler()
    amp.drive_scaler(mine, [inf] * 143)
    assert [s for s, _ in mine.history] + [mine.get_scale()] == usable
    with pytest.raises(LabkitError, match=r"underflow: 144 overflow steps in a row .* from 65536 to 2\.9"):
        amp.drive_scaler(mine, [inf])
    assert mine.get_scale() == 2.0**-127  # left at the last usable scale


def test_tiny_init_scale_like_gradscaler_or_a_clear_error():
    one = [1e-3, -2e-4, 5e-6]
    # tiny but usable: the same scales, skips and weights as GradScaler
    for init in (1e-38, 2.0**-127):
        ref = amp.drive_scaler(torch.amp.GradScaler("cpu", init_scale=init, growth_interval=2), [one] * 5)
        mine = amp.drive_scaler(amp.DynamicLossScaler(init, growth_interval=2), [one] * 5)
        assert (mine.scales, mine.skipped, mine.params) == (ref.scales, ref.skipped, ref.params)
    # too small to unscale by in float32 (or 0 there): GradScaler writes inf/NaN into the weights
    for init in (2.9e-39, 1e-45, 1e-46):
        ref = amp.drive_scaler(torch.amp.GradScaler("cpu", init_scale=init), [[1.0, 1.0, 0.0]])
        assert not all(map(math.isfinite, ref.params[-1])) and ref.skipped == [False]
        for make in (amp.DynamicLossScaler, amp.StaticLossScaler):
            with pytest.raises(LabkitError, match="unusable"):
                make(init)
    with pytest.raises(LabkitError, match="unusable"):
        amp.DynamicLossScaler().update(1e-46)
    with pytest.raises(LabkitError, match="unusable"):
        amp.DynamicLossScaler().load_state_dict({"scale": 0.0})


def test_state_dict_moves_between_labkit_and_gradscaler():
    seq = amp.crafted_sequences()["overflow_backoff"]
    mine = amp.DynamicLossScaler(2.0**16, growth_interval=4)
    amp.drive_scaler(mine, seq["grads"][:10])
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(mine.state_dict())
    back = amp.DynamicLossScaler()
    back.load_state_dict(ref.state_dict())
    rest = seq["grads"][10:]
    t_mine, t_ref, t_back = (amp.drive_scaler(s, rest) for s in (mine, ref, back))
    assert t_mine.scales == t_ref.scales == t_back.scales
    assert back.growth_interval == 4


def test_update_with_new_scale_like_gradscaler():
    for s in (amp.DynamicLossScaler(), torch.amp.GradScaler("cpu")):
        s.scale(torch.ones(()))
        s.update(1000.3)
        assert s.get_scale() == loss_scaling._fp32(1000.3)
        s.update(torch.tensor(64.0))
        assert s.get_scale() == 64.0
    with pytest.raises(LabkitError):
        amp.DynamicLossScaler().update(torch.ones(2))


def test_disabled_scaler_is_a_pass_through():
    s = amp.DynamicLossScaler(enabled=False)
    loss = torch.tensor(2.0)
    assert s.scale(loss) is loss and s.get_scale() == 1.0
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), float("inf"))
    s.step(torch.optim.SGD([p], lr=1.0))  # no inf check when disabled: the step happens
    assert torch.isinf(p).all()


def test_scale_accepts_lists_and_rejects_junk():
    s = amp.StaticLossScaler(8.0)
    a, b = s.scale([torch.tensor(1.0), torch.tensor(2.0)])
    assert (a.item(), b.item()) == (8.0, 16.0)
    with pytest.raises(LabkitError):
        s.scale("loss")


# ------------------------------------------------------------------------------------------------ clipping


def test_clipping_under_scaling_equals_fp32_clipping():
    x, y = amp.teacher_batch(0, 32)
    ref = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu")
    F.cross_entropy(ref.model(x), y).backward()
    norm_ref = amp.clip_grad_norm_(ref.optimizer, 0.1)

    scaled = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu")
    scaler = amp.DynamicLossScaler(2.0**12)
    scaler.scale(F.cross_entropy(scaled.model(x), y)).backward()
    norm = amp.clip_grad_norm_(scaled.optimizer, 0.1, scaler)
    assert norm.item() == pytest.approx(norm_ref.item(), rel=1e-5)
    assert norm_ref.item() > 0.1  # clipping actually happened
    for a, b in zip(ref.model.parameters(), scaled.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)

    wrong = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu")  # clip first, unscale later: wrong
    s2 = amp.DynamicLossScaler(2.0**12)
    s2.scale(F.cross_entropy(wrong.model(x), y)).backward()
    amp.clip_grad_norm_(wrong.optimizer, 0.1)
    s2.unscale_(wrong.optimizer)
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.model.parameters(), wrong.model.parameters(),
                                                                     strict=True))
    assert diff > 1e-4


def test_clipping_inside_the_trainer_matches_fp32():
    a = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu", max_grad_norm=0.05)
    b = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu", max_grad_norm=0.05)
    b.scaler = amp.DynamicLossScaler(2.0**10)
    for i in range(3):
        a.step(*amp.teacher_batch(i, 32))
        b.step(*amp.teacher_batch(i, 32))
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("k,batch", [(4, 32), (3, 31), (32, 32)])
def test_accumulation_matches_one_large_batch(k, batch):
    model = amp.build_mlp("tiny")
    big = amp.AmpTrainer(copy.deepcopy(model), "fp32", device="cpu")
    acc = amp.AmpTrainer(copy.deepcopy(model), "fp32", device="cpu", micro_batches=k)
    x, y = amp.teacher_batch(0, batch)
    lb, la = big.forward_backward(x, y), acc.forward_backward(x, y)
    assert la.item() == pytest.approx(lb.item(), rel=1e-5)
    for pb, pa in zip(big.model.parameters(), acc.model.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6)
    big.step(x, y)
    acc.step(x, y)
    # Adam's first step moves each weight by lr * g / (|g| + eps): a gradient at rounding level (the two sums
    # differ in order) can move its weight by a sizable part of lr (2.8e-5 of lr = 1e-3 seen on one CPU), so
    # the weights agree to a tenth of a step, the gradients above to rounding.
    for pb, pa in zip(big.model.parameters(), acc.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=0.1 * 1e-3)


def test_accumulation_with_loss_scaling_and_bad_split():
    model = amp.build_mlp("tiny")
    big = amp.AmpTrainer(copy.deepcopy(model), "fp32", device="cpu")
    acc = amp.AmpTrainer(copy.deepcopy(model), "fp32", device="cpu", micro_batches=4)
    acc.scaler = amp.DynamicLossScaler(2.0**8)
    x, y = amp.teacher_batch(1, 32)
    big.step(x, y)
    acc.step(x, y)
    # Adam's first step moves each weight by lr * g / (|g| + eps): a gradient at rounding level (the two sums
    # differ in order) can move its weight by a sizable part of lr (2.8e-5 of lr = 1e-3 seen on one CPU), so
    # the weights agree to a tenth of a step, the gradients above to rounding.
    for pb, pa in zip(big.model.parameters(), acc.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=0.1 * 1e-3)
    with pytest.raises(LabkitError, match="micro_batches"):
        amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu", micro_batches=64).step(x, y)
    with pytest.raises(LabkitError):
        amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu", micro_batches=0)


# ------------------------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("make,x", [
    (lambda: amp.build_mlp("tiny"), amp.teacher_batch(0, 16)[0]),
    (lambda: resnet18(width=4), torch.randn(4, 3, 32, 32)),
])
def test_checkpointed_and_plain_models_give_equal_gradients(make, x):
    torch.manual_seed(0)
    plain = make()
    ckpt = copy.deepcopy(plain)
    n = amp.checkpoint_blocks(ckpt)
    assert n >= 3
    y = torch.randint(0, 10, (x.shape[0],))
    lp = F.cross_entropy(plain(x), y)
    lc = F.cross_entropy(ckpt(x), y)
    lp.backward()
    lc.backward()
    assert torch.equal(lp, lc)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    # and it saves activation memory
    assert amp.activation_bytes(ckpt, x) < 0.6 * amp.activation_bytes(plain, x)


def test_checkpoint_blocks_errors():
    with pytest.raises(LabkitError, match="no blocks"):
        amp.checkpoint_blocks(torch.nn.Linear(3, 3))
    m = amp.build_mlp("tiny")
    amp.checkpoint_blocks(m)
    with pytest.raises(LabkitError, match="already wrapped"):
        amp.checkpoint_blocks(m)


# -------------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp16_master", "half"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_bytes_per_param_predicted_equals_measured(precision, optimizer):
    tr = amp.AmpTrainer(amp.build_mlp("tiny"), precision, device="cpu", optimizer=optimizer, lr=1e-3)
    tr.step(*amp.teacher_batch(0, 16))
    measured = amp.measured_bytes_per_param(tr.model, tr.optimizer, tr.master)
    predicted = amp.predicted_bytes_per_param(precision, "adam" if optimizer == "adam" else "sgd_momentum")
    for part in ("params", "grads", "optimizer_state", "master_weights", "total"):
        # Adam's per-tensor step counters add a few bytes per tensor, nothing per parameter
        assert measured[part] == pytest.approx(predicted[part], abs=0.01), part


def test_adam_costs_16_bytes_per_param_in_fp32_and_in_amp():
    for p in ("fp32", "fp16", "bf16", "fp16_master"):
        assert amp.predicted_bytes_per_param(p)["total"] == 16
    assert amp.predicted_bytes_per_param("half")["total"] == 8
    with pytest.raises(LabkitError):
        amp.predicted_bytes_per_param("fp64")
    with pytest.raises(LabkitError):
        amp.predicted_bytes_per_param("fp32", "lion")


def test_activation_bytes_scale_with_batch_and_halve_under_autocast():
    model = amp.build_mlp("tiny")
    x = amp.teacher_batch(0, 512)[0]
    b32, b32_2x = amp.activation_bytes(model, x[:256].clone()), amp.activation_bytes(model, x)
    assert b32_2x == 2 * b32  # fp32: only activations are saved, exactly proportional to the batch
    bf = amp.activation_bytes(model, x, "bf16")
    # half-size activations, plus bf16 weight copies, fp32 norm statistics and an extra cast copy per block
    assert 0.45 * b32_2x < bf < 0.65 * b32_2x
    with amp.SavedTensorMeter(model) as m:
        model(x)
    assert m.bytes == b32_2x and m.tensors > 0


def test_cuda_peak_bytes_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(LabkitError, match="CUDA"):
        amp.cuda_peak_bytes(lambda: None, "cpu")


def test_underflow_fraction():
    g = torch.tensor([1e-9, 1e-3, 1e5, 0.0])
    r = amp.underflow_fraction([g])
    assert r["elements"] == 3 and r["underflow"] == pytest.approx(1 / 3) and r["overflow"] == pytest.approx(1 / 3)
    r = amp.underflow_fraction([g], scale=2.0**14)
    assert r["underflow"] == 0.0 and r["overflow"] == pytest.approx(1 / 3)
    assert amp.underflow_fraction([g], dtype=torch.bfloat16)["underflow"] == 0.0
    with pytest.raises(LabkitError):
        amp.underflow_fraction([torch.zeros(3)])


# ---------------------------------------------------------------------------------------------------- race


def test_precision_race_half_diverges_autocast_converges():
    res = amp.precision_race(("fp32", "half", "fp16_master", "fp16", "bf16"), steps=25, batch=64, progress=False)
    assert res.first_nonfinite("half") is not None
    for p in ("fp32", "fp16_master", "fp16", "bf16"):
        assert res.first_nonfinite(p) is None
        assert res.final(p) < 0.75 * res.losses[p][0], p
        assert res.final(p) == pytest.approx(res.final("fp32"), rel=0.02)
    assert "half" in res.table()


def test_small_loss_needs_scaling_in_fp16_not_in_bf16():
    res = amp.precision_race(("fp32", "fp16_noscale", "fp16", "bf16"), steps=25, batch=64, loss_weight=1e-5,
                             progress=False)
    assert res.zero_grad_fraction["fp16_noscale"] > 0.5
    assert res.zero_grad_fraction["fp16"] < 0.01
    assert res.final("fp16_noscale") > res.final("fp32") + 0.2
    assert res.final("fp16") == pytest.approx(res.final("fp32"), rel=0.02)
    assert res.final("bf16") == pytest.approx(res.final("fp32"), rel=0.02)
    assert all(s >= 1 for s in res.scales["fp16"])


def test_unknown_presets_are_clear_errors():
    with pytest.raises(LabkitError, match="precision"):
        amp.get_precision("fp12")
    with pytest.raises(LabkitError, match="MLP preset"):
        amp.build_mlp("huge")
    with pytest.raises(LabkitError, match="scaler kind"):
        amp.make_scaler("apex", "cpu")


# ----------------------------------------------------------------------------------- fp8 rows, CLI, bench


def test_recorded_dtype_rows_reads_matmul_layouts():
    result = {"env": {"kind": "fp8", "tflops": 1.0},
              "grid": [{"kind": "bf16", "m": 8192, "n": 8192, "k": 8192, "tflops": 700.0},
                       {"kind": "fp8", "m": 8192, "n": 8192, "k": 8192, "tflops": 1300.0},
                       {"kind": "fp8", "m": 8191, "n": 8191, "k": 8191, "tflops": None}],
              "other": [{"dtype": "fp16", "shape": [4096] * 3, "tflops": 600}]}
    rows = amp.recorded_dtype_rows(result)
    assert [(r["dtype"], r["tflops"]) for r in rows] == [("bf16", 700.0), ("fp8", 1300.0), ("fp16", 600.0)]
    assert rows[0]["shape"] == "8192x8192x8192"


def test_cli_amp_scalers_and_memory(capsys, tmp_path):
    from labkit.cli import main

    out = tmp_path / "amp.json"
    assert main(["amp", "--what", "scalers,memory", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "matches GradScaler on every sequence" in text and "fp16_master" in text
    rec = json.loads(out.read_text())
    assert rec["bytes_per_param"]["fp16"]["measured"]["total"] == pytest.approx(16, abs=0.01)
    assert main(["amp", "--what", "speed"]) == 2


def test_benchmark_quick_runs_on_cpu(tmp_results):
    r = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "week3_amp.py"), "--quick", "--device", "cpu",
                        "--rounds", "2", "--out", str(tmp_results)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_results / "week3_amp.json").read_text())
    assert res["name"] == "week3_amp" and res["env"]["device_type"] == "cpu"
    speeds = {(s["model"], s["batch"], s["precision"]) for s in res["speed"]}
    assert ("resnet18", 4, "bf16") in speeds and ("mlp", 64, "fp16") in speeds
    assert all(s["speedup_vs_fp32"] > 0 for s in res["speed"])
    ck = {c["model"]: c for c in res["checkpointing"]}
    assert ck["mlp"]["checkpointed_activation_bytes"] < ck["mlp"]["plain_activation_bytes"]
    assert all(r["identical"] for r in res["scalers"].values())
    assert res["race"]["1"]["first_nonfinite"]["half"] is not None
    assert math.isfinite(res["race"]["1"]["losses"]["bf16"][-1])
    assert "samples/s" in amp.benchmark_summary(res)


def test_benchmark_full_size_refuses_cpu(tmp_results):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the full run is allowed")
    r = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "week3_amp.py"), "--out", str(tmp_results)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--quick" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_results / "week3_amp.json").exists()


def test_recorded_memory_shows_what_amp_saves_and_why_old_peaks_rose():
    """week3_memory.json: measured alone, a ResNet-18 step's 16-bit peak and activations sit well below fp32's;
    measured in sequence in one process (the old benchmark), the absolute peak climbs with what earlier
    configurations left resident. week3_amp.json, measured the new way, shows the saving."""
    import json
    from pathlib import Path

    res = Path(__file__).resolve().parents[1] / "benchmarks/results/notebooks"
    mem = json.loads((res / "week3_memory.json").read_text())
    alone = {(r["precision"], r["cudnn_benchmark"]): r for r in mem["isolated"]}
    for bench_mode in (True, False):
        fp32, bf16 = alone[("fp32", bench_mode)], alone[("bf16", bench_mode)]
        assert bf16["peak"] < 0.6 * fp32["peak"] and bf16["activations"] < 0.6 * fp32["activations"]
    seq = mem["in_sequence"]
    assert [r["precision"] for r in seq] == ["fp32", "tf32", "fp16", "bf16"]
    assert all(a["resident_before"] < b["resident_before"] for a, b in zip(seq, seq[1:], strict=False))
    assert seq[-1]["absolute_peak"] > seq[0]["absolute_peak"] > alone[("fp32", True)]["peak"]
    rows = amp.recorded_memory_split(json.loads((res / "week3_amp.json").read_text()))
    rn = {r["precision"]: r for r in rows if r["model"] == "resnet18" and r["batch"] == 128}
    assert rn["bf16"]["peak"] < 0.6 * rn["fp32"]["peak"]
    assert rn["bf16"]["activations"] < 0.6 * rn["fp32"]["activations"]


def test_memory_breakdown_needs_cuda_and_says_so():
    tr = amp.AmpTrainer(amp.build_mlp("tiny"), "fp32", device="cpu")
    with pytest.raises(LabkitError, match="needs a CUDA device"):
        amp.memory_breakdown(tr, *amp.teacher_batch(0, 8))

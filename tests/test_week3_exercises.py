"""Week 3's exercise checks catch the usual wrong answers with a message that says what to fix; the snapshot reader
and the snapshot benchmark behave on a machine without a GPU."""

import gzip
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labkit import amp, memory_snapshot
from labkit import exercises as ex
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- 3.4 scaler

class Scaler:
    """A plain dynamic scaler; the wrong ones below change one thing."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s, self.g, self.b, self.n = float(init_scale), growth_factor, backoff_factor, growth_interval
        self.streak, self.bad = 0, None

    def scale(self, loss):
        return loss * self.s

    def grads(self, opt):
        return [p.grad for grp in opt.param_groups for p in grp["params"] if p.grad is not None]

    def unscale_(self, opt):
        self.bad = any(not bool(torch.isfinite(g).all()) for g in self.grads(opt))
        for g in self.grads(opt):
            g.div_(self.s)

    def step(self, opt):
        if self.bad is None:
            self.unscale_(opt)
        if not self.bad:
            opt.step()

    def update(self):
        if self.bad:
            self.s, self.streak = self.s * self.b, 0
        else:
            self.streak += 1
            if self.streak == self.n:
                self.s, self.streak = self.s * self.g, 0
        self.bad = None

    def get_scale(self):
        return self.s


class NeverGrows(Scaler):
    def update(self):
        if self.bad:
            self.s *= self.b
        self.bad = None


class NeverSkips(Scaler):
    def step(self, opt):
        if self.bad is None:
            self.unscale_(opt)
        opt.step()


class UnscalesTwice(Scaler):
    def step(self, opt):
        self.unscale_(opt)
        if not self.bad:
            opt.step()


def test_a_right_scaler_passes_and_wrong_ones_say_what_differs():
    assert "GradScaler" in ex.check("3.4", Scaler, quiet=True)
    with pytest.raises(ex.Wrong, match="scale at step"):
        ex.check("3.4", NeverGrows, quiet=True)
    with pytest.raises(ex.Wrong, match="skip exactly when"):
        ex.check("3.4", NeverSkips, quiet=True)
    with pytest.raises(ex.Wrong, match="must not unscale a second time"):
        ex.check("3.4", UnscalesTwice, quiet=True)
    with pytest.raises(ex.Wrong, match="pass the class itself"):
        ex.check("3.4", Scaler(), quiet=True)


# --------------------------------------------------------------------------------------------------- 3.5 loop

def loop(clip_first=False, autocast=True, update=True):
    def train_steps(model, batches, optimizer, scaler, device_type="cpu", dtype=torch.float16, max_grad_norm=1.0):
        out = []
        for x, y in batches:
            optimizer.zero_grad()
            with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if clip_first:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                scaler.unscale_(optimizer)
            else:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            if update:
                scaler.update()
            out.append(loss.item())
        return out
    return train_steps


def test_the_loop_check_names_the_missing_piece():
    assert "bit for bit" in ex.check("3.5", loop(), quiet=True)
    with pytest.raises(ex.Wrong, match="outside autocast"):
        ex.check("3.5", loop(autocast=False), quiet=True)
    with pytest.raises(ex.Wrong, match="unscale_ the gradients before clipping"):
        ex.check("3.5", loop(clip_first=True), quiet=True)
    with pytest.raises(ex.Wrong, match=r"called after step\(\)"):  # GradScaler says it itself
        ex.check("3.5", loop(update=False), quiet=True)


@pytest.mark.parametrize("exercise", ["3.5", "3.14", "3.16"])
def test_cpu_checks_never_ask_for_the_default_device(monkeypatch, exercise):
    """On an H200 machine these checks built their models on the default device (the GPU) beside CPU inputs:
    3.5's right loop trained in fp32 (CPU autocast does nothing on the GPU) and missed AmpTrainer's fp16 loss;
    3.14 and 3.16 stopped with "Expected all tensors to be on the same device". Here the default device is made
    unusable: a check that runs on the CPU must say so."""
    from labkit import amp, attention

    real = amp.pick_device

    def no_default(device=None):
        assert device is not None, f"exercise {exercise}'s check asked for the default device"
        return real(device)

    monkeypatch.setattr(amp, "pick_device", no_default)
    monkeypatch.setattr(attention, "pick_device", no_default)
    fn = loop() if exercise == "3.5" else ex.get(exercise).reference()
    ex.check(exercise, fn, quiet=True)


# -------------------------------------------------------------------------------------------- 3.10 snapshots

def reader(free_action="free_completed", count_segments=False, smallest=False):
    def read_snapshot(snapshot, k=5):
        now = best = 0
        ev = snapshot["device_traces"][0]
        for e in ev:
            if e["action"] == "alloc" or (count_segments and e["action"] == "segment_alloc"):
                now += e["size"]
            elif e["action"] == free_action:
                now -= e["size"]
            best = max(best, now)
        allocs = sorted((e for e in ev if e["action"] == "alloc"), key=lambda e: e["size"], reverse=not smallest)
        return {"peak_bytes": best, "largest": [(e["size"], e["frames"]) for e in allocs[:k]]}
    return read_snapshot


def test_the_reader_check_knows_free_requested_from_free_completed():
    assert "labkit's reader" in ex.check("3.10", reader(), quiet=True)
    with pytest.raises(ex.Wrong, match="until 'free_completed'"):
        ex.check("3.10", reader("free_requested"), quiet=True)
    with pytest.raises(ex.Wrong, match="segment_alloc"):
        ex.check("3.10", reader(count_segments=True), quiet=True)
    with pytest.raises(ex.Wrong, match="largest first"):
        ex.check("3.10", reader(smallest=True), quiet=True)


def test_snapshot_reading_load_baseline_and_refusals(tmp_path):
    snap = memory_snapshot.synthetic_snapshot()
    p = memory_snapshot.peak(snap)
    assert p["peak_bytes"] == 45 * 2**20 and p["peak_event"] == 9 and p["baseline_bytes"] == 0
    assert [r["size"] // 2**20 for r in memory_snapshot.largest_allocations(snap, 3)] == [16, 16, 12]
    assert memory_snapshot.user_frame(snap["device_traces"][0][3]["frames"]) == "train.py:21 in forward"
    alive = memory_snapshot.alive_at_peak(snap)
    assert sum(r["size"] for r in alive) == p["peak_bytes"]
    # recording that started late: a free the trace never saw allocated, and a live block it never touched
    late = memory_snapshot.synthetic_snapshot()
    late["device_traces"][0].insert(0, {"action": "free_completed", "addr": 0x5000_0000, "size": 2**20, "frames": []})
    late["segments"][0]["blocks"].append({"address": 0x6000_0000, "size": 3 * 2**20, "state": "active_allocated"})
    assert memory_snapshot.baseline_bytes(late) == 4 * 2**20
    assert memory_snapshot.peak(late)["peak_bytes"] == p["peak_bytes"] + 3 * 2**20
    for name, data in (("s.pickle", pickle.dumps(snap)), ("s.pickle.gz", gzip.compress(pickle.dumps(snap)))):
        (tmp_path / name).write_bytes(data)
        assert memory_snapshot.load(tmp_path / name) == snap
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Path("/")}))
    with pytest.raises(LabkitError, match="plain"):
        memory_snapshot.load(tmp_path / "evil.pickle")
    with pytest.raises(LabkitError, match="segments"):
        memory_snapshot.peak({"device_traces": []})
    with pytest.raises(LabkitError, match="device 1"):
        memory_snapshot.peak(snap, device=1)
    with pytest.raises(LabkitError, match="no snapshot file"):
        memory_snapshot.load(tmp_path / "missing.pickle")


# ---------------------------------------------------------------------------------------- 3.10 accumulation

def accumulate(weight="share", zero=True, slices=True):
    def fn(model, x, y, micro_batches):
        if zero:
            model.zero_grad(set_to_none=True)
        if not slices:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        total = 0.0
        for xa, ya in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches), strict=True):
            w = xa.shape[0] / x.shape[0] if weight == "share" else 1 / micro_batches
            part = F.cross_entropy(model(xa), ya) * w
            part.backward()
            total += part.item()
        return total
    return fn


def test_the_accumulation_check_catches_weights_zeroing_and_whole_batches():
    assert "full batch" in ex.check("3.11", accumulate(), quiet=True)
    with pytest.raises(ex.Wrong, match="share of the batch"):
        ex.check("3.11", accumulate(weight="1/k"), quiet=True)
    with pytest.raises(ex.Wrong, match="zero them first"):
        ex.check("3.11", accumulate(zero=False), quiet=True)
    with pytest.raises(ex.Wrong, match="slices"):
        ex.check("3.11", accumulate(slices=False), quiet=True)


# ------------------------------------------------------------------------------------ the benchmark script

def _script():
    spec = importlib.util.spec_from_file_location("week3_snapshot", ROOT / "benchmarks" / "week3_snapshot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_snapshot_benchmark_refuses_without_cuda_and_trims_frames(monkeypatch, tmp_path):
    mod = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        mod.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path), "--batch", "0"])
    snap = memory_snapshot.synthetic_snapshot()
    trimmed = mod._trim(snap, 1)
    assert all(len(e["frames"]) == 1 for e in trimmed["device_traces"][0])
    assert memory_snapshot.peak(trimmed)["peak_bytes"] == 45 * 2**20
    from torch.cuda import _memory_viz

    assert "MemoryViz" in _memory_viz.trace_plot(trimmed)  # the page the GPU run writes, made on a CPU


def test_the_recorded_memory_split_shows_no_negative_memory():
    from labkit.bench import load_result

    rows = amp.recorded_memory_split(load_result("week3_amp"))
    assert rows and all(r["step_adds"] >= 0 and r["peak"] == r["state"] + r["step_adds"] for r in rows)


# ------------------------------------------------------------------------------------- 3.7 bytes per parameter

def counter(skip_step=False, per_param=True):
    def fn(model, optimizer):
        n = sum(q.numel() for q in model.parameters()) if per_param else 1

        def held(ts):
            return sum(t.untyped_storage().nbytes() for t in ts if isinstance(t, torch.Tensor))

        state = [v for s in optimizer.state.values() for k, v in s.items() if not (skip_step and k == "step")]
        return {"params": held(model.parameters()) / n, "grads": held(p.grad for p in model.parameters()) / n,
                "optimizer_state": held(state) / n}
    return fn


def test_the_bytes_check_wants_every_state_tensor_per_parameter():
    assert "16.00" in ex.check("3.7", counter(), quiet=True)
    with pytest.raises(ex.Wrong, match="step counter"):
        ex.check("3.7", counter(skip_step=True), quiet=True)
    with pytest.raises(ex.Wrong, match="divide by the number of model parameters"):
        ex.check("3.7", counter(per_param=False), quiet=True)


# ------------------------------------------------------------------------------------- 3.12-3.16 an attention step

def _attn(q, k, v, causal=False, *, scale=None, dim=-1, mask="triu", after=False):
    """Naive attention with one thing changeable, for the wrong answers below."""
    scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5 if scale is None else scale)
    n = q.shape[-2]
    if causal and mask:
        drop = (torch.ones(n, n, dtype=torch.bool).triu(1) if mask == "triu" else
                torch.ones(n, n, dtype=torch.bool).triu(0) if mask == "diagonal" else
                torch.ones(n, n, dtype=torch.bool).tril(-1))
        if not after:
            scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim)
    if causal and after:
        probs = probs.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), 0.0)
    return probs @ v


def test_naive_attention_passes_and_each_slip_is_named():
    assert "plain and causal" in ex.check("3.12", _attn, quiet=True)
    cases = [(lambda q, k, v, causal=False: _attn(q, k, v, causal, scale=1.0), "divide the scores by sqrt"),
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, scale=q.shape[-1]), "not by head_dim itself"),
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, dim=-2), "last dimension"),
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, mask=None), "causal=True changed nothing"),
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, mask="tril"), "you masked the past"),
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, after=True), "-inf before the softmax"),
             # the diagonal masked too: query 0 sees no key, its row is NaN; not a zeroing after the softmax
             (lambda q, k, v, causal=False: _attn(q, k, v, causal, mask="diagonal"), "its own key included"),
             (lambda q, k, v, causal=False: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
              "called scaled_dot_product_attention"),
             (lambda q, k, v, causal=False: _attn(q.detach(), k.detach(), v.detach(), causal), "no gradient")]
    for fn, message in cases:
        with pytest.raises(ex.Wrong, match=message):
            ex.check("3.12", fn, quiet=True)


def test_the_score_bytes_check_wants_l_squared_the_dtype_and_every_head():
    assert "saves for backward" in ex.check("3.13", ex.reference("3.13"), quiet=True)
    size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    for fn, message in ((lambda b, h, n, dt: b * h * n * size(dt), "seq_len \\* seq_len"),
                        (lambda b, h, n, dt: b * h * n * n * 4, "bytes per element"),
                        (lambda b, h, n, dt: b * n * n * size(dt), "every head")):
        with pytest.raises(ex.Wrong, match=message):
            ex.check("3.13", fn, quiet=True)



def test_the_score_bytes_check_writes_both_numbers_alike():
    with pytest.raises(ex.Wrong) as err:  # both counts with thousands separators, so they read side by side
        ex.check("3.13", lambda b, h, n, dt: b * h * n * n * 4, quiet=True)
    assert "is 32,000,000 bytes, you found 64,000,000" in str(err.value), err.value


def test_the_layer_count_check_names_the_missing_term():
    ref = ex.reference("3.14")
    assert "within 1%" in ex.check("3.14", ref, quiet=True)

    def no_probs(b, n, d, h, mlp_ratio=4, elem_bytes=4):
        return ref(b, n, d, h, mlp_ratio, elem_bytes) - elem_bytes * b * h * n * n

    def probs_twice(b, n, d, h, mlp_ratio=4, elem_bytes=4):
        return ref(b, n, d, h, mlp_ratio, elem_bytes) + elem_bytes * b * h * n * n

    def no_mlp(b, n, d, h, mlp_ratio=4, elem_bytes=4):
        return ref(b, n, d, h, mlp_ratio, elem_bytes) - elem_bytes * 2 * mlp_ratio * d * b * n

    for fn, message in ((no_probs, "count the attention probabilities"), (probs_twice, "saved once"),
                        (no_mlp, "GELU saves its input"), (lambda *a, **k: 1.0, "tolerance 1%")):
        with pytest.raises(ex.Wrong, match=message):
            ex.check("3.14", fn, quiet=True)
    # the measurement is fp32, so a count that ignores elem_bytes is caught at elem_bytes=2
    with pytest.raises(ex.Wrong, match="multiply the count of saved elements by elem_bytes"):
        ex.check("3.14", lambda b, n, d, h, mlp_ratio=4, elem_bytes=4: ref(b, n, d, h, mlp_ratio, 4), quiet=True)
    # LayerNorm's statistics are within the stated tolerance: leaving them out still passes
    ex.check("3.14", lambda b, n, d, h, mlp_ratio=4, elem_bytes=4: ref(b, n, d, h, mlp_ratio, elem_bytes) - 16 * b * n,
             quiet=True)


def test_the_bf16_attention_check_reads_each_ops_dtype():
    assert "softmax in float32" in ex.check("3.15", ex.reference("3.15"), quiet=True)

    def autocast_only(q, k, v, causal=False):  # softmax left to autocast: bf16 on a CPU
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _attn(q, k, v, causal)

    def fp32_out(q, k, v, causal=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return _attn_tail(scores, v)

    def fused(q, k, v, causal=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def plain_only(q, k, v, causal=False):  # causal ignored
        return ex.reference("3.15")(q, k, v)

    for fn, message in ((_attn, "the matmuls ran in"), (autocast_only, "came out in bfloat16"),
                        (plain_only, "the plain case passed: with causal=True mask"),
                        (fp32_out, "the matmuls ran in"), (fused, "hides its softmax")):
        with pytest.raises(ex.Wrong, match=message):
            ex.check("3.15", fn, quiet=True)


def _attn_tail(scores, v):
    return scores.float().softmax(-1) @ v


def test_the_profile_check_wants_a_schedule_and_the_profiler_back():
    from torch.profiler import profile, schedule

    assert "top op by self CPU time" in ex.check("3.16", ex.reference("3.16"), quiet=True)

    def no_schedule(step_fn, active=2):
        with profile() as prof:
            for _ in range(4):
                step_fn()
                prof.step()
        return prof

    def returns_nothing(step_fn, active=2):
        for _ in range(4):
            step_fn()

    def once(step_fn, active=2):
        with profile() as prof:
            step_fn()
        return prof

    def no_step(step_fn, active=2):  # a schedule that never advances: torch refuses key_averages
        with profile(schedule=schedule(wait=1, warmup=1, active=active)) as prof:
            for _ in range(2 + active):
                step_fn()
        return prof

    def the_table(step_fn, active=2):
        return ex.reference("3.16")(step_fn, active).key_averages()

    for fn, message in ((no_schedule, "inside a profile with a schedule"), (returns_nothing, "profiler object itself"),
                        (once, "step_fn ran 1 times"), (no_step, "call prof.step\\(\\) after every step_fn"),
                        (the_table, "profiler object itself.*not EventList")):
        with pytest.raises(ex.Wrong, match=message):
            ex.check("3.16", fn, quiet=True)


def test_attention_meters_see_the_quadratic_term_and_refuse_bad_input():
    from labkit import attention as A

    rows = A.attention_sweep({"naive": A.naive_attention, "sdpa": A.sdpa}, [64, 128], repeats=1)
    by = {(r["name"], r["seq_len"]): r for r in rows}
    score = lambda n: 4 * 4 * n * n  # noqa: E731  (batch 1, 4 heads, fp32)
    for n in (64, 128):
        assert by["naive", n]["saved_bytes"] - 3 * 4 * 4 * n * 32 == score(n)
        assert by["naive", n]["peak_bytes"] >= score(n) > by["sdpa", n]["peak_bytes"]
    assert A.top_ops(ex.reference("3.16")(lambda: A.naive_attention(*A.random_qkv())))[0]["share"] == 1.0
    with pytest.raises(LabkitError, match="multiple of heads"):
        A.build_blocks(A.TinyConfig(d_model=130, heads=4))
    with pytest.raises(LabkitError, match="positive"):
        A.random_qkv(seq_len=0)
    with pytest.raises(LabkitError, match="at least one"):
        A.attention_sweep({}, [64])


def test_week3_points_at_lab1_where_the_release_and_the_repository_keep_it():
    """The release has no assignments/ folder: its labs sit in labs/<lab>/ (autograder.release.build.LABS)."""
    import json
    import re

    from autograder.release.build import LABS

    nb = json.loads((ROOT / "notebooks" / "03_mixed_precision.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "(`assignments/`)" not in text and "in `assignments/`" not in text
    named = set(re.findall(r"`labs/(\w+)`", text))
    assert named == {"lab1_loss_scaling"} and named <= set(LABS), named
    for lab in re.findall(r"`assignments/source/(\w+)`", text):
        assert (ROOT / "assignments" / "source" / lab).is_dir(), lab


def test_the_gpu_profile_prose_fits_the_record_copy_tops_naive_and_is_small_under_sdpa():
    """Section 12's reading of the GPU profile: the naive step's first row is aten::copy_ (autocast's casts of
    the L x L matrices), SDPA's copy_ row a small share of its top row; the record is attention_h200.json."""
    import json

    from labkit.bench import load_result

    nb = json.loads((ROOT / "notebooks" / "03_mixed_precision.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "first row is `aten::copy_`" in text and "a small share" in text
    profiles = {p["attention"]: p["top_ops"] for p in load_result("attention_h200")["profiles"]}
    assert profiles["naive"][0]["op"] == "aten::copy_"
    assert any("copy_kernel" in r["op"] for r in profiles["naive"][1:4])
    sdpa_copy = [r["share"] for r in profiles["SDPA"] if r["op"] == "aten::copy_"]
    assert sdpa_copy and sdpa_copy[0] < 0.5 and profiles["SDPA"][0]["op"] != "aten::copy_"


def test_the_crossover_length_in_the_prose_is_the_tiny_presets():
    """Section 12 types the L where the probabilities equal the rest of a block's activations (512): it is
    (8 + 2 * mlp_ratio) * d_model / heads of attention.TINY_PRESETS["tiny"], which it names."""
    import json

    from labkit import attention

    cfg = attention.TINY_PRESETS["tiny"]
    nb = json.loads((ROOT / "notebooks" / "03_mixed_precision.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    at = (8 + 2 * cfg.mlp_ratio) * cfg.d_model // cfg.heads
    assert f"{at}\nfor the tiny preset (d_model {cfg.d_model}, {cfg.heads} heads)" in text
    ref = ex.reference("3.14")
    probs = 4 * 2 * cfg.heads * at * at
    rest = ref(2, at, cfg.d_model, cfg.heads, cfg.mlp_ratio) - probs
    assert abs(probs / rest - 1) < 0.01  # equal, short of LayerNorm's statistics

"""Week 3's exercises (mixed precision): the checks behind the notebook's self-check cells, and labkit's versions.

* 3.4 a dynamic loss scaler, class-shaped like `torch.amp.GradScaler`: checked against GradScaler's scale schedule,
  skipped steps and weights on `labkit.loss_scaling.crafted_sequences`;
* 3.5 the AMP training loop (autocast forward, scaled backward, unscale_ before clipping, step, update): checked
  against `labkit.amp.AmpTrainer` on the week's tiny MLP, bit for bit, in fp16 autocast on the CPU;
* 3.7 bytes per parameter counted from the live tensors of the model and the optimizer: checked against
  `labkit.amp.measured_bytes_per_param` in fp32, under bf16 autocast, in pure fp16 and with SGD + momentum;
* 3.10 a reader of a CUDA memory snapshot (peak bytes in use, largest allocations with their stacks): checked against
  `labkit.memory_snapshot` on hand-made snapshots, and on the recorded GPU snapshots when they are present;
* 3.11 gradient accumulation equal to the big batch: checked against the full batch's gradient;
* 3.12 naive attention (plain and causal): checked against `F.scaled_dot_product_attention`, outputs and gradients;
* 3.13 the score matrix's bytes: checked by formula and against the softmax output naive attention saves;
* 3.14 the bytes one transformer layer saves for backward: checked within 1% against `amp.SavedTensorMeter` on
  `labkit.attention.build_blocks`;
* 3.15 attention under bf16 autocast with the softmax in float32: every op's dtypes read below autocast;
* 3.16 profiling a training step with torch.profiler and a schedule: checked on the profile it returns.

Everything runs on a CPU in a few seconds. The exercises 3.1-3.3, 3.6, 3.8, 3.9 and 3.17 of the notebook are predictions
or readings, checked in the notebook itself.
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import amp, attention, memory_snapshot
from labkit import exercises as ex
from labkit.errors import LabkitError
from labkit.loss_scaling import crafted_sequences, drive_scaler

# ---------------------------------------------------------------------------------- 3.4 a dynamic loss scaler

CORE_SEQUENCES = ("finite", "inf_and_nan", "growth", "overflow_backoff")  # powers of two: exact in any float
EXTRA_SEQUENCES = ("odd_factors", "float32_ceiling")  # need GradScaler's float32 scale to match to the bit


def _scaler_kwargs(seq: dict) -> dict:
    return {k: seq[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval") if k in seq}


def _unscale_then_step(scaler, grads, lr: float = 0.1) -> list[tuple[list[float], list[float]]]:
    """(gradient right after unscale_, weights after step) per step, with unscale_ called by hand before step."""
    p = torch.nn.Parameter(torch.ones(len(grads[0])))
    opt = torch.optim.SGD([p], lr=lr)
    out = []
    for g in grads:
        opt.zero_grad(set_to_none=True)
        p.grad = (torch.tensor(g) * scaler.scale(torch.ones(()))).to(torch.float16).float()
        scaler.unscale_(opt)
        seen = p.grad.tolist()
        scaler.step(opt)  # must not divide a second time
        scaler.update()
        out.append((seen, p.detach().tolist()))
    return out


def _same_floats(a, b, rtol: float = 1e-6) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            if not _same_floats(x, y, rtol):
                return False
        elif not (x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= rtol * max(abs(x), abs(y))):
            return False
    return True


def _check_sequence(cls, name: str, seq: dict) -> str | None:
    """None when `cls` behaves as GradScaler on `seq`, else what differed first."""
    kw = _scaler_kwargs(seq)
    ref = drive_scaler(torch.amp.GradScaler("cpu", **kw), seq["grads"], "cpu")
    mine = drive_scaler(cls(**kw), seq["grads"], "cpu")
    for i, (a, b) in enumerate(zip(ref.scales, mine.scales, strict=True)):
        if a != b:
            return (f"on the '{name}' sequence the scale at step {i} is {b:g}, GradScaler's is {a:g} (scales so far: "
                    f"{', '.join(f'{s:g}' for s in ref.scales[: i + 1])})")
    for i, (a, b) in enumerate(zip(ref.skipped, mine.skipped, strict=True)):
        if a != b:
            grads = seq["grads"][i]
            return (f"on the '{name}' sequence step {i} was {'skipped' if b else 'taken'}, GradScaler "
                    f"{'skipped' if a else 'took'} it (true gradient {grads} times scale {ref.scales[i]:g}, "
                    "rounded to fp16): skip exactly when some gradient is inf or NaN after scaling")
    if not _same_floats(ref.params, mine.params):
        i = next(j for j, (a, b) in enumerate(zip(ref.params, mine.params, strict=True)) if not _same_floats(a, b))
        return (f"on the '{name}' sequence the weights after step {i} are {mine.params[i]}, GradScaler's are "
                f"{ref.params[i]}: step() must divide the gradients by the scale (once) before optimizer.step()")
    return None


@ex.exercise("3.4", "a dynamic loss scaler", reference=lambda: amp.DynamicLossScaler)
def check_scaler(cls) -> str:
    """`cls(init_scale=, growth_factor=, backoff_factor=, growth_interval=)` must act as torch.amp.GradScaler."""
    assert isinstance(cls, type), (f"pass the class itself (e.g. `MyScaler`), not {type(cls).__name__}: the check "
                                   "builds one per gradient sequence with GradScaler's keyword arguments")
    for meth in ("scale", "unscale_", "step", "update", "get_scale"):
        assert callable(getattr(cls, meth, None)), f"your class has no method {meth}()"
    s = cls(init_scale=8.0)
    assert s.get_scale() == 8.0, f"get_scale() right after init_scale=8.0 returns {s.get_scale()!r}, want 8.0"
    out = s.scale(torch.tensor(0.5))
    assert isinstance(out, torch.Tensor) and float(out) == 4.0, f"scale(tensor(0.5)) at scale 8 gives {out!r}, want 4"
    seqs = crafted_sequences()
    for name in CORE_SEQUENCES:
        problem = _check_sequence(cls, name, seqs[name])
        assert problem is None, problem
    seq = seqs["inf_and_nan"]
    ref = _unscale_then_step(torch.amp.GradScaler("cpu", **_scaler_kwargs(seq)), seq["grads"])
    mine = _unscale_then_step(cls(**_scaler_kwargs(seq)), seq["grads"])
    for i, ((g_ref, w_ref), (g, w)) in enumerate(zip(ref, mine, strict=True)):
        assert _same_floats(g_ref, g), (f"after unscale_() at step {i} the gradient is {g}, GradScaler's is {g_ref}: "
                                        "unscale_ divides the gradients by the scale in place")
        assert _same_floats(w_ref, w), (f"with unscale_() called before step(), the weights after step {i} are {w}, "
                                        f"GradScaler's {w_ref}: step() must not unscale a second time")
    extra = [n for n in EXTRA_SEQUENCES if _check_sequence(cls, n, seqs[n]) is not None]
    tail = ("also on odd factors and at the float32 ceiling" if not extra else
            f"differs on {', '.join(extra)} (GradScaler keeps its scale in float32 and refuses growth to inf: "
            "optional, try it)")
    return (f"same scales, skipped steps and weights as torch.amp.GradScaler on {len(CORE_SEQUENCES)} sequences "
            f"and with unscale_ before step; {tail}")


# ------------------------------------------------------------------------------------ 3.5 the AMP training loop

LOOP_STEPS, LOOP_BATCH, LOOP_INIT_SCALE, LOOP_GROWTH, LOOP_CLIP = 12, 32, 2.0**20, 3, 0.5


def _loop_setup():
    """The week's tiny MLP with Adam, a GradScaler whose first scale overflows fp16 (so steps get skipped and the
    scale both backs off and grows within a dozen steps), and the batches, all on the CPU: the check runs the loop
    with device_type="cpu" beside AmpTrainer on the CPU. (On a GPU machine the default device put the model on the
    GPU, where CPU autocast does nothing: the loop trained in fp32 and its first loss missed AmpTrainer's fp16 one.)"""
    model = amp.build_mlp("tiny", device="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOOP_INIT_SCALE, growth_interval=LOOP_GROWTH)
    batches = [amp.teacher_batch(i, LOOP_BATCH, device="cpu") for i in range(LOOP_STEPS)]
    return model, opt, scaler, batches


def _trainer_run():
    """labkit's AmpTrainer on the same model, data and scaler settings: losses, weights, scales."""
    tr = amp.AmpTrainer(amp.build_mlp("tiny", device="cpu"), "fp16", device="cpu", max_grad_norm=LOOP_CLIP)
    tr.scaler = torch.amp.GradScaler("cpu", init_scale=LOOP_INIT_SCALE, growth_interval=LOOP_GROWTH)
    losses, scales = [], []
    for x, y in _loop_setup()[3]:
        losses.append(float(tr.step(x, y)))
        scales.append(tr.scaler.get_scale())
    return losses, [p.detach().clone() for p in tr.model.parameters()], scales


def _reference_train_steps(model, batches, optimizer, scaler, device_type="cpu", dtype=torch.float16,
                           max_grad_norm=1.0):
    """labkit's loop, built on AmpTrainer's pieces: amp.autocast_context and amp.clip_grad_norm_."""
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    result = []
    for xb, yb in batches:
        model.zero_grad(set_to_none=True)
        with amp.autocast_context(precision, torch.device(device_type)):
            logits = model(xb)
        batch_loss = F.cross_entropy(logits.float(), yb)
        scaler.scale(batch_loss).backward()
        amp.clip_grad_norm_(optimizer, max_grad_norm, scaler)  # unscales first
        scaler.step(optimizer)
        scaler.update()
        result.append(float(batch_loss.detach()))
    return result


@ex.exercise("3.5", "the autocast + GradScaler training loop", reference=lambda: _reference_train_steps)
def check_train_steps(fn) -> str:
    """fn(model, batches, optimizer, scaler, device_type=, dtype=, max_grad_norm=) -> list of float losses."""
    model, opt, scaler, batches = _loop_setup()
    outside = []
    model.register_forward_hook(lambda m, i, o: outside.append(not torch.is_autocast_enabled("cpu")))
    from labkit.bench import torch_threads

    with torch_threads(1):  # one thread on both sides: a many-core CPU otherwise sums in another order
        losses = fn(model, batches, opt, scaler, device_type="cpu", dtype=torch.float16, max_grad_norm=LOOP_CLIP)
    assert outside, "the model was never called: run model(x) for each batch"
    assert not any(outside), "model(x) ran outside autocast: put the forward pass in `with torch.autocast(...)`"
    assert isinstance(losses, list | tuple) and len(losses) == len(batches), (
        f"return one loss per batch ({len(batches)} floats), got {type(losses).__name__} of "
        f"{len(losses) if hasattr(losses, '__len__') else '?'}")
    losses = [float(v) for v in losses]
    with torch_threads(1):
        ref_losses, ref_weights, ref_scales = _trainer_run()
    assert _same_floats(ref_losses[:1], losses[:1], 1e-5), (
        f"the first loss is {losses[0]:.6f}, AmpTrainer's {ref_losses[0]:.6f}: return the unscaled cross-entropy of "
        "each batch, computed from the autocast forward pass")
    assert scaler.get_scale() == ref_scales[-1], (
        f"the scaler ends at scale {scaler.get_scale():g}, AmpTrainer's at {ref_scales[-1]:g} (start {LOOP_INIT_SCALE:g}"
        f", which overflows fp16 at first): call scaler.step(optimizer) and then scaler.update() once per batch")
    weights = list(model.parameters())
    if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ref_weights, weights, strict=True)):
        hint = ("unscale_ the gradients before clipping them (clipping the scaled ones clips far too hard), and step "
                "through the scaler so that overflow steps are skipped")
        raise AssertionError(f"the weights after {len(batches)} steps differ from AmpTrainer's: {hint}")
    assert _same_floats(ref_losses, losses, 1e-5), "the losses differ from AmpTrainer's after the first step"
    exact = all(torch.equal(a, b) for a, b in zip(ref_weights, weights, strict=True)) and ref_losses == losses
    skipped = sum(1 for a, b in zip([LOOP_INIT_SCALE, *ref_scales[:-1]], ref_scales, strict=True) if b < a)
    return (f"{len(batches)} steps of fp16 autocast on the CPU match AmpTrainer {'bit for bit' if exact else 'to 1e-5'} "
            f"({skipped} overflow steps skipped, scale 2^{math.log2(LOOP_INIT_SCALE):.0f} -> 2^{math.log2(ref_scales[-1]):.0f}); on a GPU the same "
            "loop runs with device_type='cuda'")


# --------------------------------------------------------------------------------- 3.7 bytes per parameter

BYTES_CASES = (("fp32", "adam"), ("bf16", "adam"), ("half", "adam"), ("bf16", "sgd"))


def _reference_bytes(model, optimizer):
    """labkit's count: amp.measured_bytes_per_param (each storage once), without master weights."""
    got = amp.measured_bytes_per_param(model, optimizer)
    return {k: got[k] for k in ("params", "grads", "optimizer_state")}


@ex.exercise("3.7", "bytes per parameter, counted from the live tensors", reference=lambda: _reference_bytes)
def check_bytes(fn) -> str:
    """fn(model, optimizer) -> {"params", "grads", "optimizer_state"}: bytes per model parameter."""
    lines = []
    for precision, opt in BYTES_CASES:
        tr = amp.AmpTrainer(amp.build_mlp("tiny"), precision, device="cpu", optimizer=opt, lr=0.01)
        tr.step(*amp.teacher_batch(0, 16))
        want = _reference_bytes(tr.model, tr.optimizer)
        got = fn(tr.model, tr.optimizer)
        assert isinstance(got, dict) and set(want) <= set(got), (
            f"return a dict with {sorted(want)}, got {type(got).__name__}"
            f"{' with keys ' + str(sorted(got)) if isinstance(got, dict) else ''}")
        for k, v in want.items():
            g = float(got[k])
            if abs(g - v) > 1e-6 * max(1.0, v):
                hint = {"params": "add up p.untyped_storage().nbytes() over model.parameters()",
                        "grads": "the same over each p.grad that is not None",
                        "optimizer_state": "every tensor in optimizer.state[p].values() (Adam keeps exp_avg, "
                                           "exp_avg_sq and a step counter)"}[k]
                raise AssertionError(f"{precision} with {opt}: {k} is {v:.4f} bytes per parameter, you found "
                                     f"{g:.4f}; divide by the number of model parameters and {hint}")
        lines.append(f"{precision}/{opt} {sum(want.values()):.2f}")
    return "bytes per parameter as labkit counts them: " + ", ".join(lines)


# --------------------------------------------------------------------------------- 3.10 reading a memory snapshot

def _random_snapshot(seed: int, n: int = 400) -> dict:
    """A snapshot of `n` random events that starts empty: allocs, frees (some delayed), segment events."""
    rng = random.Random(seed)
    live, pending, trace, addr = {}, [], [], 0x7000_0000
    for i in range(n):
        r = rng.random()
        fr = [{"filename": "model.py", "line": 10 + i % 37, "name": f"layer{i % 5}"}]
        if r < 0.45 or not live:
            size = 512 * rng.randint(1, 4096)
            addr += 2**24
            live[addr] = size
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": fr})
        elif r < 0.85:
            a = rng.choice(sorted(live))
            size = live.pop(a)
            trace.append({"action": "free_requested", "addr": a, "size": size, "stream": 0, "frames": fr})
            if rng.random() < 0.3:
                pending.append((a, size))  # in use on another stream: completes later
            else:
                trace.append({"action": "free_completed", "addr": a, "size": size, "stream": 0, "frames": fr})
        elif pending:
            a, size = pending.pop(0)
            trace.append({"action": "free_completed", "addr": a, "size": size, "stream": 0, "frames": fr})
        else:
            trace.append({"action": rng.choice(["segment_alloc", "segment_free"]), "addr": addr + 1,
                          "size": 2**21 * rng.randint(1, 8), "stream": 0, "frames": fr})
    blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated", "frames": []}
              for a, s in live.items()]
    blocks += [{"address": a, "size": s, "requested_size": s, "state": "active_awaiting_free", "frames": []}
               for a, s in pending]
    return {"segments": [{"device": 0, "address": 0x7000_0000, "total_size": 2**40, "blocks": blocks}],
            "device_traces": [trace]}


def _reference_reader(snapshot, k=5):
    """labkit's reader: memory_snapshot.peak and memory_snapshot.largest_allocations."""
    top = memory_snapshot.largest_allocations(snapshot, k)
    return {"peak_bytes": memory_snapshot.peak(snapshot)["peak_bytes"], "largest": [(r["size"], r["frames"]) for r in top]}


def _compare_reader(fn, snap: dict, what: str, k: int = 3) -> None:
    got = fn(copy.deepcopy(snap), k)
    assert isinstance(got, dict) and {"peak_bytes", "largest"} <= set(got), (
        f"return a dict with 'peak_bytes' and 'largest', got {type(got).__name__}"
        f"{' with keys ' + str(sorted(got)) if isinstance(got, dict) else ''}")
    want = _reference_reader(snap, k)
    peak = memory_snapshot.peak(snap)
    if int(got["peak_bytes"]) != want["peak_bytes"]:
        early = _peak_with(snap, "free_requested")
        hint = ("memory is in use until 'free_completed', not 'free_requested' (a free can wait for another stream)"
                if int(got["peak_bytes"]) == early else
                "count 'alloc' up and 'free_completed' down; 'segment_alloc'/'segment_free' are the allocator's "
                "cudaMalloc/cudaFree, not tensors")
        raise AssertionError(f"on {what} the peak is {want['peak_bytes']:,} bytes (reached at event "
                             f"{peak['peak_event']}), you found {int(got['peak_bytes']):,}: {hint}")
    sizes = [int(s) for s, _ in got["largest"]]
    assert sizes == [s for s, _ in want["largest"]], (
        f"on {what} the {k} largest allocations are {[s for s, _ in want['largest']]} bytes, you found {sizes}: "
        "look at the 'alloc' events only, largest first")
    allocs = [(e["size"], e.get("frames", [])) for e in snap["device_traces"][0] if e["action"] == "alloc"]
    for size, frames in got["largest"]:
        assert (int(size), frames) in allocs, (f"on {what} no alloc of {size} bytes has the frames you gave: return "
                                               "each event's own 'frames' list")


def _peak_with(snap: dict, free_action: str) -> int:
    now = best = 0
    for e in snap["device_traces"][0]:
        now += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == free_action else 0
        best = max(best, now)
    return best


@ex.exercise("3.10", "reading a memory snapshot", reference=lambda: _reference_reader)
def check_reader(fn) -> str:
    """fn(snapshot, k) -> {"peak_bytes": int, "largest": [(size, frames), ...]} for device 0."""
    _compare_reader(fn, memory_snapshot.synthetic_snapshot(), "the hand-made snapshot (memory_snapshot."
                    "synthetic_snapshot())")
    for seed in (1, 2, 3):
        _compare_reader(fn, _random_snapshot(seed), f"a random snapshot (seed {seed})", k=5)
    recorded = memory_snapshot.recorded_snapshots()
    for name, path in recorded.items():
        _compare_reader(fn, memory_snapshot.load(path), f"the recorded {name} snapshot", k=5)
    where = (f"and on the recorded GPU snapshots ({', '.join(recorded)})" if recorded else
             "(the recorded GPU snapshots are not here yet: checked on CPU-made ones only)")
    return f"same peak and largest allocations as labkit's reader on 4 hand-made snapshots {where}"


# ------------------------------------------------------------------------------ 3.11 gradient accumulation

def _reference_accumulate(model, x, y, micro_batches):
    """labkit's version: AmpTrainer(..., micro_batches=k).forward_backward, after zeroing the gradients."""
    model.zero_grad(set_to_none=True)
    tr = amp.AmpTrainer(model, "fp32", device=x.device, micro_batches=micro_batches)
    return tr.forward_backward(x, y)


@ex.exercise("3.11", "gradient accumulation equal to the big batch", reference=lambda: _reference_accumulate)
def check_accumulate(fn) -> str:
    """fn(model, x, y, micro_batches) leaves the full batch's mean-loss gradient in model's .grad; returns the loss."""
    x, y = amp.teacher_batch(0, 30, amp.MLP_PRESETS["tiny"])
    full = amp.build_mlp("tiny")
    loss_full = F.cross_entropy(full(x), y)
    loss_full.backward()
    loss_full = float(loss_full.detach())
    want = torch.cat([p.grad.flatten() for p in full.parameters()])
    for k in (1, 4, 7):  # 30 = 8+8+7+7 and 5+5+4+4+4+4+4: uneven slices, so the weights matter
        model, seen = amp.build_mlp("tiny"), []
        model.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].shape[0]))
        for _ in range(2):  # twice: the second call must start from zero, not add to the first
            seen.clear()
            loss = fn(model, x, y, k)
        assert len(seen) == k and max(seen) <= math.ceil(30 / k), (
            f"with micro_batches={k} the model saw batches of {seen}: run it on {k} slices of the batch "
            "(torch.tensor_split), never on the whole batch")
        got = torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                         for p in model.parameters()])
        rel = ((got - want).norm() / want.norm()).item()
        if rel > 1e-5:
            doubled = ((got - 2 * want).norm() / want.norm()).item() < 1e-5
            hint = ("the gradients doubled on the second call: zero them first (model.zero_grad())" if doubled else
                    "weight each slice's mean loss by its share of the batch (len(slice) / len(batch)), not by 1/k")
            raise AssertionError(f"with micro_batches={k} the gradient is {rel:.1e} (relative) away from the "
                                 f"full batch's: {hint}")
        loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        assert abs(loss - loss_full) < 1e-5, (
            f"with micro_batches={k} you return loss {loss:.6f}, the batch's mean loss is {loss_full:.6f}")
    return "the accumulated gradients equal the full batch's (relative difference below 1e-5) for 1, 4 and 7 slices"


# ------------------------------------------------------------------------------ 3.12-3.16 an attention step

ATTN_ATOL, ATTN_RTOL = 1e-5, 1e-4  # fp32 naive vs fp32 SDPA: same arithmetic, different order of summation
BF16_ATOL = 3e-2  # bf16 attention vs fp32: bf16 keeps 8 significant bits (eps 2^-7 = 0.0078), outputs are O(1)
LAYER_RTOL = 0.01  # 3.14: within 1% of the measured bytes, so LayerNorm's per-token statistics may be left out
ATTN_CASES = ((2, 3, 17, 8), (1, 4, 64, 16))  # (batch, heads, seq_len, head_dim): odd length, then a round one


class _OpRecorder(TorchDispatchMode):
    """Every aten op that ran below autocast: (name, input dtypes, output dtype)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, ins, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


def _ran_sdpa(rec: _OpRecorder) -> bool:
    return any("scaled_dot_product" in name for name, _, _ in rec.ops)


def _attention_hint(fn, q, k, v, causal: bool, got) -> str:
    """Why `got` differs from SDPA's output: the usual slips, tried one by one."""
    close = lambda want: torch.allclose(got, want, atol=1e-4, rtol=1e-3)  # noqa: E731
    if close(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)):
        return "divide the scores by sqrt(head_dim) (q.shape[-1]) before the softmax"
    if close(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0 / q.shape[-1])):
        return "divide by the square root of head_dim, not by head_dim itself"
    if causal:
        if torch.isnan(got).any():
            return ("a row of your output is NaN: some query had every key masked, so its softmax saw only -inf. "
                    "Query i may attend to keys 0..i, its own key included: mask only the keys after it, "
                    "torch.ones(L, L, dtype=torch.bool).triu(1) (triu(0) masks the diagonal too)")
        if close(F.scaled_dot_product_attention(q, k, v)):
            return "causal=True changed nothing: mask every key after its query before the softmax"
        past = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(-1)
        if close(F.scaled_dot_product_attention(q, k, v, attn_mask=~past)):
            return ("you masked the past: query i may look at keys 0..i, so mask where the key index is larger "
                    "(torch.ones(L, L, dtype=torch.bool).triu(1))")
        return ("set the masked scores to -inf before the softmax (masked_fill): zeroing them after the softmax "
                "leaves rows that no longer sum to 1")
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if close(scores.softmax(-2) @ v):
        return "take the softmax over the keys, the last dimension (dim=-1)"
    return "compute softmax(q @ k.transpose(-2, -1) / sqrt(head_dim), dim=-1) @ v"


@ex.exercise("3.12", "naive attention", reference=lambda: attention.naive_attention)
def check_naive_attention(fn) -> str:
    """fn(q, k, v, causal=False) -> softmax(q k^T / sqrt(d)) v, as F.scaled_dot_product_attention."""
    worst = 0.0
    for i, shape in enumerate(ATTN_CASES):
        q, k, v = attention.random_qkv(*shape, seed=i, requires_grad=True)
        for causal in (False, True):
            with _OpRecorder() as rec:
                got = fn(q, k, v, causal=causal)
            assert not _ran_sdpa(rec), ("your function called scaled_dot_product_attention: write it from a matmul, "
                                        "a softmax and another matmul, so that you see the score matrix")
            want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
                f"for q, k, v of shape {tuple(shape)} return a tensor of that shape, got "
                f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
            err = (got - want).abs().max().item()
            if not torch.allclose(got, want, atol=ATTN_ATOL, rtol=ATTN_RTOL):
                with torch.no_grad():
                    hint = _attention_hint(fn, q, k, v, causal, got)
                raise AssertionError(f"with causal={causal} on shape {tuple(shape)} your output is up to {err:.1e} "
                                     f"away from scaled_dot_product_attention's (tolerance atol {ATTN_ATOL:g}, rtol "
                                     f"{ATTN_RTOL:g}): {hint}")
            worst = max(worst, err)
            assert got.requires_grad, ("the output carries no gradient: build it from differentiable torch ops on q, "
                                       "k and v (no .detach(), no torch.no_grad())")
            g = torch.randn_like(want)
            mine = [torch.zeros_like(t) if d is None else d
                    for t, d in zip((q, k, v), torch.autograd.grad(got, (q, k, v), g, allow_unused=True), strict=True)]
            ref = torch.autograd.grad(want, (q, k, v), g)
            assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(mine, ref, strict=True)), (
                f"with causal={causal} the output is right but its gradients differ from SDPA's: build it from "
                "differentiable torch ops (no .detach(), no in-place writes to the scores after the softmax)")
    return (f"matches F.scaled_dot_product_attention, plain and causal, within atol {ATTN_ATOL:g} / rtol "
            f"{ATTN_RTOL:g} (largest difference {worst:.1e}), gradients too")


def _reference_score_bytes(batch, heads, seq_len, dtype=torch.float32):
    """Bytes of one (batch, heads, seq_len, seq_len) score matrix in `dtype`."""
    return batch * heads * seq_len * seq_len * torch.empty((), dtype=dtype).element_size()


SCORE_CASES = ((1, 3, 128, torch.float32), (2, 8, 1000, torch.bfloat16), (3, 1, 7, torch.float16),
               (1, 1, 1, torch.float64))


@ex.exercise("3.13", "the score matrix's bytes", reference=lambda: _reference_score_bytes)
def check_score_bytes(fn) -> str:
    """fn(batch, heads, seq_len, dtype) -> bytes of the (batch, heads, L, L) score matrix; checked by formula
    and against the bytes naive attention saves for backward (minus q, k and v)."""
    for b, h, n, dt in SCORE_CASES:
        want, got = _reference_score_bytes(b, h, n, dt), fn(b, h, n, dt)
        size = torch.empty((), dtype=dt).element_size()
        elements = b * h * n * n
        hint = ("one score per (query, key) pair: seq_len * seq_len per head" if got == b * h * n * size else
                f"{dt} takes {size} bytes per element (torch.empty((), dtype=dtype).element_size())"
                if got in (elements, 4 * elements) else "every batch element and every head has its own L x L matrix")
        assert got == want, (f"batch {b}, heads {h}, seq_len {n}, {dt}: the score matrix is {want:,} bytes, you "
                             f"found {f'{got:,}' if isinstance(got, int) else repr(got)}: {hint}")
    lines = []
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = attention.random_qkv(2, 4, 96, 16, dtype=dt, requires_grad=True)
        saved = attention.saved_bytes(lambda q=q, k=k, v=v: attention.naive_attention(q, k, v))
        scores = saved - 3 * q.untyped_storage().nbytes()
        assert scores == fn(2, 4, 96, dt), (f"in {dt} naive attention saved {scores:,} bytes beyond q, k and v (its "
                                            f"softmax output), your formula says {fn(2, 4, 96, dt):,}")
        lines.append(f"{dt}: {scores:,}")
    return ("exact on 4 shapes and dtypes, and equal to the softmax output naive attention saves for backward "
            f"(batch 2, 4 heads, L 96: {', '.join(lines)} bytes)")


def _reference_layer_bytes(batch, seq_len, d_model, heads, mlp_ratio=4, elem_bytes=4):
    """Bytes one labkit.attention.Block with naive attention saves for backward: every (batch, seq_len,
    d_model) tensor it saves, the MLP's two wide ones, the attention probabilities, LayerNorm's statistics."""
    tokens = batch * seq_len
    per_token = (1 + 1 + 3 + 1 + 1 + 1) * d_model + 2 * mlp_ratio * d_model  # ln1 in, qkv in, q k v, proj in,
    # ln2 in, fc1 in; gelu in and fc2 in, each mlp_ratio * d_model wide
    probs = batch * heads * seq_len * seq_len  # softmax's output, saved once for softmax and for probs @ v
    stats = 2 * 2 * tokens * 4  # mean and 1/std per token for each of two LayerNorms, always float32
    return elem_bytes * (tokens * per_token + probs) + stats


LAYER_CASES = ((attention.TinyConfig(128, 4, 2), 2, 64), (attention.TinyConfig(256, 8, 3), 1, 160),
               (attention.TinyConfig(64, 2, 2, mlp_ratio=2), 4, 32))  # (config, batch, seq_len)


def _measured_layer_bytes(cfg, batch, seq_len) -> float:
    model = attention.build_blocks(cfg, device="cpu")  # beside x: on a GPU machine the default device is the GPU
    x = torch.randn(batch, seq_len, cfg.d_model)
    return attention.saved_bytes(lambda: model(x), model) / cfg.layers


@ex.exercise("3.14", "activation memory of a transformer layer", reference=lambda: _reference_layer_bytes)
def check_layer_bytes(fn) -> str:
    """fn(batch, seq_len, d_model, heads, mlp_ratio=4, elem_bytes=4) -> bytes one block (naive attention) saves
    for backward in fp32; within 1% of amp.SavedTensorMeter's measurement of labkit.attention.build_blocks."""
    lines = []
    for cfg, b, n in LAYER_CASES:
        measured = _measured_layer_bytes(cfg, b, n)
        got = float(fn(b, n, cfg.d_model, cfg.heads, mlp_ratio=cfg.mlp_ratio, elem_bytes=4))
        off = got / measured - 1
        if abs(off) > LAYER_RTOL:
            probs = 4 * b * cfg.heads * n * n
            mlp = 4 * 2 * cfg.mlp_ratio * cfg.d_model * b * n
            hint = ("the attention probabilities (batch * heads * L * L) are saved once: softmax and the matmul "
                    "after it keep the same tensor" if abs(got - probs - measured) < LAYER_RTOL * measured else
                    "count the attention probabilities, batch * heads * L * L elements" if
                    abs(got + probs - measured) < LAYER_RTOL * measured else
                    "GELU saves its input and fc2 its input: 2 * mlp_ratio * d_model per token" if
                    abs(got + mlp - measured) < 2 * LAYER_RTOL * measured else
                    "per token: the inputs of ln1, qkv, proj, ln2 and fc1 (d_model each), q, k and v (3 * d_model), "
                    "the inputs of GELU and fc2 (mlp_ratio * d_model each); plus batch * heads * L * L")
            raise AssertionError(f"d_model {cfg.d_model}, {cfg.heads} heads, batch {b}, L {n}: one layer saves "
                                 f"{measured:,.0f} bytes, you counted {got:,.0f} ({off:+.1%}; tolerance "
                                 f"{LAYER_RTOL:.0%}): {hint}")
        lines.append(f"{off:+.2%}")
    # the measurement is fp32 only: hold elem_bytes=2 (bf16 activations) to the count, LayerNorm's float32
    # statistics being within the tolerance
    cfg, b, n = LAYER_CASES[0]
    want2 = _reference_layer_bytes(b, n, cfg.d_model, cfg.heads, cfg.mlp_ratio, elem_bytes=2)
    got2 = float(fn(b, n, cfg.d_model, cfg.heads, mlp_ratio=cfg.mlp_ratio, elem_bytes=2))
    if abs(got2 / want2 - 1) > LAYER_RTOL:
        raise AssertionError(f"d_model {cfg.d_model}, {cfg.heads} heads, batch {b}, L {n} at elem_bytes=2 (bf16 "
                             f"activations): one layer saves about {want2:,.0f} bytes, you counted {got2:,.0f}: "
                             "multiply the count of saved elements by elem_bytes")
    return (f"within {LAYER_RTOL:.0%} of the saved bytes measured per layer on {len(LAYER_CASES)} configurations "
            f"({', '.join(lines)})")


MATMULS = ("mm", "bmm", "baddbmm", "addmm", "matmul")


def _reference_attention_bf16(q, k, v, causal=False):
    """Naive attention under bf16 autocast, the softmax cast up to float32 (autocast does that on CUDA only)."""
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = scores.float().softmax(dim=-1).to(torch.bfloat16)
        return probs @ v


@ex.exercise("3.15", "bf16 attention with the softmax in float32", reference=lambda: _reference_attention_bf16)
def check_attention_bf16(fn) -> str:
    """fn(q, k, v, causal=False) on fp32 inputs: matmuls in bf16 under autocast, every softmax out in float32,
    the output in bf16 and within atol 3e-2 of fp32 attention; dtypes read op by op below autocast."""
    worst = 0.0
    for causal in (False, True):
        q, k, v = attention.random_qkv(2, 4, 48, 16, seed=3)
        with _OpRecorder() as rec:
            got = fn(q, k, v, causal=causal)
        assert not _ran_sdpa(rec), ("scaled_dot_product_attention hides its softmax: write the attention out (scores, "
                                    "softmax, @ v) so that you choose the softmax's dtype")
        mm = [ins for name, ins, _ in rec.ops if name in MATMULS]
        soft = [(ins, out) for name, ins, out in rec.ops if name in ("_softmax", "softmax")]
        assert len(mm) >= 2 and all(torch.bfloat16 in ins for ins in mm), (
            f"the matmuls ran in {sorted({str(d) for ins in mm for d in ins})}: run q @ k^T and probs @ v under "
            "torch.autocast(q.device.type, dtype=torch.bfloat16), which casts their inputs to bf16")
        assert soft, "no softmax ran: compute scores.softmax(dim=-1) yourself"
        assert all(out == torch.float32 for _, out in soft), (
            "the softmax came out in bfloat16: on a CPU autocast's lists leave softmax in the dtype that arrives "
            "(on CUDA they would cast it up): cast the scores up yourself, scores.float().softmax(dim=-1)")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, (
            f"the output is {getattr(got, 'dtype', type(got).__name__)}: the last matmul (probs @ v) should run under "
            "autocast too, so the output is bf16 like every other matmul's")
        want = attention.naive_attention(q, k, v, causal=causal)
        err = (got.float() - want).abs().max().item()
        hint = ("the plain case passed: with causal=True mask the keys after each query before the softmax, as "
                "in 3.12" if causal else "the arithmetic is not the attention's: scores / sqrt(head_dim), softmax "
                "over the keys, @ v")
        assert err <= BF16_ATOL, (f"with causal={causal} the output is up to {err:.3f} away from fp32 attention "
                                  f"(tolerance {BF16_ATOL:g}): {hint}")
        worst = max(worst, err)
    return (f"matmuls in bf16, the softmax in float32, output bf16 within {worst:.1e} of fp32 attention (tolerance "
            f"{BF16_ATOL:g}), plain and causal")


def _reference_profile_step(step_fn, active=2):
    """torch.profiler around `step_fn` with a schedule (skip 1 step, warm up 1, record `active`)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=active)) as prof:
        for _ in range(2 + active):
            step_fn()
            prof.step()
    return prof


@ex.exercise("3.16", "profiling one training step", reference=lambda: _reference_profile_step)
def check_profile_step(fn) -> str:
    """fn(step_fn, active=2) -> a finished torch.profiler.profile whose schedule recorded `active` steps."""
    from labkit import profiling

    profiling.quiet_cpu_profiler()
    model = attention.build_blocks(attention.TinyConfig(64, 2, 1), device="cpu")  # on the CPU, beside x
    x = torch.randn(1, 32, 64)
    calls = []

    def step():
        calls.append(1)
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    with profiling._quiet_profiler():
        prof = fn(step, active=2)
    assert len(calls) >= 3, (f"step_fn ran {len(calls)} times: run it in a loop, wait + warmup + active times, "
                             "with prof.step() after each call")
    assert isinstance(prof, torch.profiler.profile), (
        f"return the profiler object itself (the `prof` of `with torch.profiler.profile(...) as prof`), not "
        f"{type(prof).__name__}")
    try:
        read = profiling.read_key_averages(prof)
    except LabkitError as e:
        raise AssertionError(str(e)) from None
    except (RuntimeError, AssertionError) as e:  # torch's words for a schedule that never reached its active steps
        raise AssertionError(f"the profiler recorded nothing ({e}): under a schedule it moves from wait to warmup "
                             "to active only at prof.step(), so call prof.step() after every step_fn()") from None
    assert read["steps"] == 2, (f"the profile recorded {read['steps']} steps, asked for 2: use "
                                "torch.profiler.schedule(wait=1, warmup=1, active=active) and call prof.step() "
                                "after every step")
    return f"2 steps recorded; the top op by self CPU time in this check's tiny step: {read['top_op']}"

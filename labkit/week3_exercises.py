"""Week 3's exercises (mixed precision): the checks behind the notebook's self-check cells, and labkit's versions.

* 3.4 a dynamic loss scaler, class-shaped like `torch.amp.GradScaler`: checked against GradScaler's scale schedule,
  skipped steps and weights on `labkit.loss_scaling.crafted_sequences`;
* 3.5 the AMP training loop (autocast forward, scaled backward, unscale_ before clipping, step, update): checked
  against `labkit.amp.AmpTrainer` on the week's tiny MLP, bit for bit, in fp16 autocast on the CPU;
* 3.7 bytes per parameter counted from the live tensors of the model and the optimizer: checked against
  `labkit.amp.measured_bytes_per_param` in fp32, under bf16 autocast, in pure fp16 and with SGD + momentum;
* 3.10 a reader of a CUDA memory snapshot (peak bytes in use, largest allocations with their stacks): checked against
  `labkit.memory_snapshot` on hand-made snapshots, and on the recorded GPU snapshots when they are present;
* 3.11 gradient accumulation equal to the big batch: checked against the full batch's gradient.

Everything runs on a CPU in a few seconds. The exercises 3.1-3.3, 3.6, 3.8 and 3.9 of the notebook are predictions,
checked in the notebook itself.
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn.functional as F

from labkit import amp, memory_snapshot
from labkit import exercises as ex
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
    scale both backs off and grows within a dozen steps), and the batches."""
    model = amp.build_mlp("tiny")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOOP_INIT_SCALE, growth_interval=LOOP_GROWTH)
    batches = [amp.teacher_batch(i, LOOP_BATCH) for i in range(LOOP_STEPS)]
    return model, opt, scaler, batches


def _trainer_run():
    """labkit's AmpTrainer on the same model, data and scaler settings: losses, weights, scales."""
    tr = amp.AmpTrainer(amp.build_mlp("tiny"), "fp16", device="cpu", max_grad_norm=LOOP_CLIP)
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
    losses = fn(model, batches, opt, scaler, device_type="cpu", dtype=torch.float16, max_grad_norm=LOOP_CLIP)
    assert outside, "the model was never called: run model(x) for each batch"
    assert not any(outside), "model(x) ran outside autocast: put the forward pass in `with torch.autocast(...)`"
    assert isinstance(losses, list | tuple) and len(losses) == len(batches), (
        f"return one loss per batch ({len(batches)} floats), got {type(losses).__name__} of "
        f"{len(losses) if hasattr(losses, '__len__') else '?'}")
    losses = [float(v) for v in losses]
    ref_losses, ref_weights, ref_scales = _trainer_run()
    assert _same_floats(ref_losses[:1], losses[:1], 1e-6), (
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

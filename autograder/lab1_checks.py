"""Lab 1, loss scaling by hand: the trusted reference scalers, the fp16 problem, and the checks.

The problem is a small regression whose targets are in tiny units (about 1e-3), so under fp16 autocast most
weight gradients underflow to zero without loss scaling (training stalls) and match fp32 with it.
The student's file defines StaticScaler, DynamicScaler and fp16_train_step (see the notebook for the API).
"""

from __future__ import annotations

import collections
import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from autograder.harness import CheckFailed, call_student, gemm_dtypes, host_sync_sites, require, student_attr

LOSS_UNIT = 1e6  # losses are reported in (1e-3 units)^2, so they read as ~1 instead of ~1e-6


class RefStaticScaler:
    """Trusted reference: a fixed loss scale; skips the optimizer step when a gradient is inf or NaN."""

    def __init__(self, scale: float = 2.0**10):
        self._scale = float(scale)
        self._found_inf = None
        self._unscaled = False

    def scale(self, loss):
        return loss * self._scale

    def unscale_(self, optimizer):
        if self._unscaled:
            raise RuntimeError("unscale_() already called since the last update()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = torch.zeros((), dtype=torch.bool, device=grads[0].device if grads else "cpu")
        inv = 1.0 / self._scale
        for gr in grads:
            found = found | ~torch.isfinite(gr).all()
            gr.mul_(inv)
        self._found_inf, self._unscaled = found, True

    def step(self, optimizer) -> bool:
        if not self._unscaled:
            self.unscale_(optimizer)
        if bool(self._found_inf):
            return False
        optimizer.step()
        return True

    def update(self):
        self._unscaled = False

    def get_scale(self) -> float:
        return self._scale


class RefDynamicScaler(RefStaticScaler):
    """Trusted reference with GradScaler's schedule: backoff on overflow, growth after N clean steps."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._tracker = 0

    def update(self):
        if self._found_inf is not None and bool(self._found_inf):
            self._scale *= self.backoff_factor
            self._tracker = 0
        else:
            self._tracker += 1
            if self._tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._tracker = 0
        self._found_inf = None
        self._unscaled = False


class Net(nn.Module):
    """Two-layer MLP whose output is in small units: the fp16 gradients underflow without loss scaling."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.f(x) * 1e-3


def problem(device, seed: int = 0, n: int = 1024, d: int = 32):
    """Inputs (n, d) and tiny targets (n, 1) on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return x.to(device), (torch.tanh(x @ w / 4) * 1e-3).to(device)


def ref_fp16_train_step(model, optimizer, scaler, x, y):
    """The reference step: fp16 autocast forward, fp32 loss, scaled backward, scaler step and update."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        out = model(x)
    loss = F.mse_loss(out.float(), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _train(step_fn, scaler, device, steps: int, seed: int = 0, batch: int = 64):
    """Train Net with `step_fn` and `scaler`; returns losses (in LOSS_UNIT), optimizer steps and samples seen."""
    torch.manual_seed(seed)
    x, y = problem(device, seed)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts = {"opt_steps": 0, "samples": 0}
    opt.register_step_post_hook(lambda *a: counts.__setitem__("opt_steps", counts["opt_steps"] + 1))
    model.register_forward_pre_hook(lambda m, a: counts.__setitem__("samples", counts["samples"] + a[0].shape[0]))
    losses = []
    for s in range(steps):
        i = torch.arange(s * batch, (s + 1) * batch, device=device) % x.shape[0]
        loss = step_fn(model, opt, scaler, x[i], y[i])
        require(isinstance(loss, torch.Tensor) and loss.numel() == 1,
                f"fp16_train_step must return the loss as a one-element tensor, got {type(loss).__name__}")
        losses.append(loss.detach().float().reshape(()))
    return [v * LOSS_UNIT for v in torch.stack(losses).tolist()], counts, model, opt, x, y


def _param(device, n=8):
    p = nn.Parameter(torch.zeros(n, device=device))
    return p, torch.optim.SGD([p], lr=0.1)


def _scaled_step(scaler, p, opt, c, explicit_unscale=False):
    """One step of loss (p*c).sum(): the gradient is c (times the scale); returns what step() returned."""
    opt.zero_grad(set_to_none=True)
    call_student("scaler.scale(loss).backward()", lambda: scaler.scale((p * c).sum()).backward())
    if explicit_unscale:
        call_student("scaler.unscale_(optimizer)", scaler.unscale_, opt)
    stepped = call_student("scaler.step(optimizer)", scaler.step, opt)
    call_student("scaler.update()", scaler.update)
    return stepped


def check_static_scaler(mod, ctx) -> dict:
    dev = ctx.device
    cls = student_attr(mod, "StaticScaler")
    sc = call_student("StaticScaler(scale=1024.0)", cls, scale=1024.0)
    loss = torch.tensor(0.375, device=dev)
    scaled = call_student("StaticScaler.scale", sc.scale, loss)
    require(torch.is_tensor(scaled) and math.isclose(float(scaled), 384.0),
            f"scale(loss) should be loss * 1024 = 384.0, got {scaled}")
    p, opt = _param(dev)
    c = torch.linspace(-1, 1, 8, device=dev)
    opt.zero_grad()
    call_student("scaler.scale(loss).backward()", lambda: sc.scale((p * c).sum()).backward())
    call_student("scaler.unscale_(optimizer)", sc.unscale_, opt)
    require(torch.allclose(p.grad, c), "after unscale_ the gradients should equal the unscaled ones "
            f"(max error {float((p.grad - c).abs().max()):.3g}): divide each .grad by the scale, in place")
    stepped = call_student("scaler.step(optimizer)", sc.step, opt)
    call_student("scaler.update()", sc.update)
    require(stepped is True or stepped == True, f"step() should return True after a finite step, got {stepped!r}")  # noqa: E712
    require(torch.allclose(p.detach(), -0.1 * c), "after one finite step the parameter should move by -lr * grad "
            "(did step() unscale twice, or not at all?)")
    bad = c.clone()
    bad[3] = float("inf")
    before = p.detach().clone()
    stepped = _scaled_step(sc, p, opt, bad)
    require(not stepped, f"step() must skip (return False) when a gradient is inf, got {stepped!r}")
    require(torch.equal(p.detach(), before), "the parameters changed on a step with an inf gradient")
    require(call_student("get_scale()", sc.get_scale) == 1024.0, "a static scaler's scale must never change")
    stepped = _scaled_step(sc, p, opt, c)
    require(bool(stepped) and torch.allclose(p.detach(), before - 0.1 * c),
            "after a skipped step the next finite step must go through normally")
    return {"message": "static scaler: scale, unscale_, skip on inf all match the reference"}


def _trajectory(scaler, dev, steps, bad_steps, nan=False, explicit_unscale=False):
    p, opt = _param(dev)
    c = torch.linspace(-1, 1, 8, device=dev)
    out = []
    for s in range(steps):
        cc = c.clone()
        if s in bad_steps:
            cc[1] = float("nan") if nan else float("inf")
        stepped = _scaled_step(scaler, p, opt, cc, explicit_unscale)
        out.append((bool(stepped), float(call_student("get_scale()", scaler.get_scale))))
    return out, p.detach()


def check_dynamic_scaler(mod, ctx) -> dict:
    cls = student_attr(mod, "DynamicScaler")
    d = call_student("DynamicScaler()", cls)
    require(call_student("get_scale()", d.get_scale) == 2.0**16, "DynamicScaler() should start at 2**16 like GradScaler")
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    bad = {2, 3, 9}
    want, p_ref = _trajectory(RefDynamicScaler(**kw), ctx.device, 12, bad)
    got, p_got = _trajectory(call_student("DynamicScaler(...)", cls, **kw), ctx.device, 12, bad)
    for s, (w, g) in enumerate(zip(want, got, strict=True)):
        require(w == g, f"step {s}: expected (stepped, scale after update) = {w}, got {g}; overflow steps are {sorted(bad)}",
                expected=want, got=got)
    require(torch.allclose(p_ref, p_got), "the parameters after 12 steps differ from the reference")
    return {"message": "dynamic scaler: backoff and growth schedule match GradScaler's", "measurements": {
        "scale_trajectory": [s for _, s in got]}}


def check_scaler_edge_cases(mod, ctx) -> dict:
    cls = student_attr(mod, "DynamicScaler")
    kw = dict(init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    for label, bad, nan, explicit in [("NaN gradients", {1, 4}, True, False),
                                      ("unscale_ called before step", {2}, False, True),
                                      ("growth counter reset after an overflow", {1, 2, 5}, False, False)]:
        want, p_ref = _trajectory(RefDynamicScaler(**kw), ctx.device, 8, bad, nan, explicit)
        got, p_got = _trajectory(call_student("DynamicScaler(...)", cls, **kw), ctx.device, 8, bad, nan, explicit)
        require(want == got, f"{label}: expected (stepped, scale) per step {want}, got {got}")
        require(torch.allclose(p_ref, p_got), f"{label}: the parameters differ from the reference")
    return {"message": "edge cases: NaN, explicit unscale_, custom factors and counter reset all correct"}


def check_fp16_training(mod, ctx) -> dict:
    step = student_attr(mod, "fp16_train_step")
    cls = student_attr(mod, "DynamicScaler")
    steps, k = 150, 20
    ref_losses, ref_counts, *_ = _train(ref_fp16_train_step, RefDynamicScaler(init_scale=2.0**16), ctx.device, steps)
    scaler = call_student("DynamicScaler(init_scale=2**16)", cls, init_scale=2.0**16)
    losses, counts, model, opt, x, y = _train(lambda *a: call_student("fp16_train_step", step, *a), scaler,
                                              ctx.device, steps)
    m = {"first_losses": [round(v, 5) for v in losses[:5]], "reference_first_losses": [round(v, 5) for v in ref_losses[:5]],
         "final_loss": sum(losses[-10:]) / 10, "reference_final_loss": sum(ref_losses[-10:]) / 10,
         "optimizer_steps": counts["opt_steps"], "samples": counts["samples"]}
    require(all(math.isfinite(v) for v in losses), "a loss is not finite: the unscaled loss must be returned", **m)
    for s in range(k):
        require(math.isclose(losses[s], ref_losses[s], rel_tol=2e-2, abs_tol=1e-3),
                f"step {s}: loss {losses[s]:.5f} differs from the reference {ref_losses[s]:.5f} "
                "(fp16 autocast forward, fp32 MSE, scaled backward, scaler.step, scaler.update)", **m)
    require(counts["samples"] == steps * 64, f"the model saw {counts['samples']} samples in {steps} steps, "
            f"expected {steps * 64} (one forward per step)", **m)
    require(abs(counts["opt_steps"] - ref_counts["opt_steps"]) <= 3,
            f"{counts['opt_steps']} optimizer steps taken, the reference took {ref_counts['opt_steps']} "
            "(skip only overflowing steps; step exactly once otherwise)", **m)
    require(m["final_loss"] <= 0.1 * losses[0] and m["final_loss"] <= 3 * m["reference_final_loss"] + 1e-3,
            f"training did not converge: final loss {m['final_loss']:.4f}, reference {m['reference_final_loss']:.4f}",
            **m)
    i = torch.arange(64, device=ctx.device)
    dtypes = gemm_dtypes(lambda: call_student("fp16_train_step", step, model, opt, scaler, x[i], y[i]))
    m["gemm_dtypes"] = dtypes
    require(dtypes.get("float16", 0) > 0 and sum(v for kk, v in dtypes.items() if kk != "float16") == 0,
            f"the matrix multiplies should all run in float16 (tensor-core eligible), saw {dtypes}: "
            "run the forward pass under torch.autocast(device_type, dtype=torch.float16)", **m)
    return {"message": f"fp16 training converged (final loss {m['final_loss']:.4f} vs reference "
                       f"{m['reference_final_loss']:.4f}); every matmul in float16", "measurements": m}


def _gate(mod, ctx, steps: int = 10) -> None:
    """Correctness before the sync count: a step that does nothing never syncs."""
    step, cls = student_attr(mod, "fp16_train_step"), student_attr(mod, "DynamicScaler")
    ref, *_ = _train(ref_fp16_train_step, RefDynamicScaler(), ctx.device, steps)
    got, counts, *_ = _train(lambda *a: call_student("fp16_train_step", step, *a),
                             call_student("DynamicScaler()", cls), ctx.device, steps)
    for s in range(steps):
        require(math.isclose(got[s], ref[s], rel_tol=2e-2, abs_tol=1e-3),
                f"step {s}: loss {got[s]:.5f} differs from the reference {ref[s]:.5f}; fix lab1.fp16_training first")
    require(counts["opt_steps"] > 0, "fp16_train_step never called optimizer.step(); fix lab1.fp16_training first")


def check_host_syncs(mod, ctx) -> dict:
    """At most one host sync in a typical step: the skip decision. Counted per step after a warm-up.

    The median over steps is the criterion, so a one-off (lazy state on a first optimizer step, an allocator
    event) does not cost points while a sync in every step does; the sites of the syncs are reported.
    """
    _gate(mod, ctx)
    step = student_attr(mod, "fp16_train_step")
    cls = student_attr(mod, "DynamicScaler")
    torch.manual_seed(0)
    x, y = problem(ctx.device)
    model = Net().to(ctx.device)
    # SGD: Adam's own bookkeeping calls .item() on CPU step counters, which is not the student's doing.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = call_student("DynamicScaler()", cls)
    xb, yb = x[:64].contiguous(), y[:64].contiguous()
    for _ in range(5):  # warm-up: the first overflows back the scale off, momentum buffers appear
        call_student("fp16_train_step", step, model, opt, scaler, xb, yb)
    per_step = [host_sync_sites(lambda: call_student("fp16_train_step", step, model, opt, scaler, xb, yb),
                                ctx.device) for _ in range(8)]
    counts = [len(s) for s in per_step]
    typical = statistics.median(counts)
    sites = collections.Counter(site for s in per_step for site in s)
    m = {"host_syncs_per_step": typical, "host_syncs_by_step": counts,
         "sync_sites": {k: v for k, v in sites.most_common(6)}}
    where = ", ".join(f"{k} ({v}x in {len(counts)} steps)" for k, v in sites.most_common(3))
    if typical > 1:
        raise CheckFailed(f"{typical:g} host syncs in a typical step (at most 1: deciding whether to skip the step)"
                          f"; they happen at {where}. Keep found_inf a tensor; avoid .item()/bool() per parameter "
                          "and returning float(loss)", **m)
    return {"message": f"{typical:g} host sync(s) in a typical step (per step: {counts})", "measurements": m}

"""Lab 1, loss scaling by hand: the trusted reference scalers and the checks.

The student's file defines StaticScaler, DynamicScaler and fp16_train_step (see the notebook for the API).
Every scenario lives in `autograder.student.lab1` and runs twice: in the sandbox with the student's code (a
probe) and here with the reference; the verdict compares the two. Nothing the student's process says is
taken as a verdict.
"""

from __future__ import annotations

import collections
import math
import statistics

import torch

from autograder.checks.harness import CheckFailed, hidden_draws, require
from autograder.student import lab1 as scen
from autograder.student.lab1 import LOSS_UNIT, Net, problem  # noqa: F401  (the notebook's plots import them)


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


ref_fp16_train_step = scen.torch_amp_step  # the reference step (public: PyTorch's documented recipe)


def _t(x, what: str) -> torch.Tensor:
    """A tensor the student's process sent, or a failed check saying what was malformed."""
    require(isinstance(x, torch.Tensor), f"the submission's process sent no tensor for {what}")
    return x.float()


def check_static_scaler(ctx) -> dict:
    params = {"scale": 1024.0, "loss": 0.375, "lr": 0.1, "grad": torch.linspace(-1, 1, 8), "bad_index": 3}
    want = scen.static_scenario(RefStaticScaler, ctx.device, params)
    got = ctx.call("lab1.static", params)
    c = params["grad"]
    require(math.isclose(float(got["scaled"]), 384.0), f"scale(loss) should be loss * 1024 = 384.0, got {got['scaled']}")
    require(torch.allclose(_t(got["grad"], "grad"), c), "after unscale_ the gradients should equal the unscaled ones "
            f"(max error {float((_t(got['grad'], 'grad') - c).abs().max()):.3g}): divide each .grad by the scale, in place")
    require(got["first"] is True, f"step() should return True after a finite step, got {got['first']!r}")
    require(torch.allclose(_t(got["after_first"], "parameters"), want["after_first"].cpu()),
            "after one finite step the parameter should move by -lr * grad (did step() unscale twice, or not at all?)")
    require(got["bad"] is False, f"step() must skip (return False) when a gradient is inf, got {got['bad']!r}")
    require(torch.equal(_t(got["after_bad"], "parameters"), _t(got["after_first"], "parameters")),
            "the parameters changed on a step with an inf gradient")
    require(got["scale"] == 1024.0, "a static scaler's scale must never change")
    require(got["last"] is True and torch.allclose(_t(got["after_last"], "parameters"), want["after_last"].cpu()),
            "after a skipped step the next finite step must go through normally")
    return {"message": "static scaler: scale, unscale_, skip on inf all match the reference"}


def _compare_trajectories(ctx, kw: dict, steps: int, bad: set, label: str, **opts) -> list:
    params = {"kw": kw, "steps": steps, "bad": sorted(bad), **opts}
    want = scen.trajectory(RefDynamicScaler, ctx.device, params)
    got = ctx.call("lab1.trajectory", params)
    w, g = want["steps"], got["steps"]
    require(isinstance(g, list) and len(g) == steps, f"{label}: expected {steps} steps of (stepped, scale)")
    for s, (a, b) in enumerate(zip(w, g, strict=True)):
        require(list(a) == list(b), f"{label}: step {s}: expected (stepped, scale after update) = {tuple(a)}, got "
                f"{tuple(b) if isinstance(b, list) else b}; overflow steps are {sorted(bad)}", expected=w, got=g)
    require(torch.allclose(want["param"].cpu(), _t(got["param"], "parameters")),
            f"{label}: the parameters after {steps} steps differ from the reference")
    return g


def check_dynamic_scaler(ctx) -> dict:
    got = ctx.call("lab1.default_scale", {})
    require(got["scale"] == 2.0**16, "DynamicScaler() should start at 2**16 like GradScaler")
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    g = _compare_trajectories(ctx, kw, 12, {2, 3, 9}, "backoff and growth")
    return {"message": "dynamic scaler: backoff and growth schedule match GradScaler's", "measurements": {
        "scale_trajectory": [s for _, s in g]}}


def hidden_edge_cases(student: str | None = None,
                      handin: str | None = None) -> tuple[dict, list[tuple[str, set, bool, bool]]]:
    """The hidden test's scaler settings and overflow steps, from the course secret and the student or the hand-in
    (autograder.checks.harness.hidden_draws): (kwargs, cases), each case (label, overflow steps of 8, NaN instead of inf,
    unscale_ before step). Never the defaults, so a scaler that ignores its arguments fails."""
    from autograder.base import course_secret

    r = course_secret.rng("lab1.hidden/edge_cases", student, handin=handin)
    kw = dict(init_scale=2.0 ** int(r.integers(6, 11)), growth_factor=float(r.choice([3.0, 4.0, 8.0])),
              backoff_factor=float(r.choice([0.125, 0.25])), growth_interval=int(r.integers(2, 4)))
    a = int(r.integers(0, 3))  # two overflows in a row, then one more after a clean streak has begun
    return kw, [("NaN gradients", {int(v) for v in r.choice(8, size=2, replace=False)}, True, False),
                ("unscale_ called before step", {int(r.integers(0, 8))}, False, True),
                ("growth counter reset after an overflow", {a, a + 1, int(r.integers(a + 3, 8))}, False, False)]


def check_scaler_edge_cases(ctx) -> dict:
    for draw in hidden_draws(ctx):
        kw, cases = hidden_edge_cases(**draw)
        for label, bad, nan, explicit in cases:
            _compare_trajectories(ctx, kw, 8, bad, label, nan=nan, explicit_unscale=explicit)
    return {"message": "edge cases: NaN, explicit unscale_, custom factors and counter reset all correct"}


def check_fp16_training(ctx) -> dict:
    steps, k = 150, 20
    ref, ref_counts, _ = scen.train(ref_fp16_train_step, RefDynamicScaler(init_scale=2.0**16), ctx.device, steps)
    ref_losses = ref.tolist()
    got = ctx.call("lab1.fp16_training", {"steps": steps, "init_scale": 2.0**16, "dtypes": True}, timeout_s=120)
    losses = _t(got["losses"], "losses").reshape(-1).tolist()
    require(len(losses) == steps, f"expected {steps} losses, got {len(losses)}")
    counts = {"opt_steps": int(got["opt_steps"]), "samples": int(got["samples"])}
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
            f"training did not converge: final loss {m['final_loss']:.4f}, reference {m['reference_final_loss']:.4f} "
            "(in 1e-6 units, as the notebook plots it)",
            **m)
    dtypes = {str(k): int(v) for k, v in dict(got.get("gemm_dtypes") or {}).items()}
    m["gemm_dtypes"] = dtypes
    require(dtypes.get("float16", 0) > 0 and sum(v for kk, v in dtypes.items() if kk != "float16") == 0,
            f"the matrix multiplies should all run in float16 (tensor-core eligible), saw {dtypes}: "
            "run the forward pass under torch.autocast(device_type, dtype=torch.float16)", **m)
    return {"message": f"fp16 training converged (final loss {m['final_loss']:.4f} vs reference "
                       f"{m['reference_final_loss']:.4f}, in 1e-6 units as the notebook plots it); every matmul in float16", "measurements": m}


def _gate(ctx, steps: int = 10) -> None:
    """Correctness before the sync count: a step that does nothing never syncs."""
    ref, *_ = scen.train(ref_fp16_train_step, RefDynamicScaler(), ctx.device, steps)
    got = ctx.call("lab1.fp16_training", {"steps": steps, "init_scale": 2.0**16})
    losses = _t(got["losses"], "losses").reshape(-1).tolist()
    require(len(losses) == steps, f"expected {steps} losses, got {len(losses)}")
    for s in range(steps):
        require(math.isclose(losses[s], float(ref[s]), rel_tol=2e-2, abs_tol=1e-3),
                f"step {s}: loss {losses[s]:.5f} differs from the reference {float(ref[s]):.5f}; fix lab1.fp16_training "
                "first")
    require(int(got["opt_steps"]) > 0, "fp16_train_step never called optimizer.step(); fix lab1.fp16_training first")


def check_host_syncs(ctx) -> dict:
    """At most one host sync in a typical step: the skip decision. Counted per step after a warm-up.

    The median over steps is the criterion, so a one-off (lazy state on a first optimizer step, an allocator
    event) does not cost points while a sync in every step does; the sites of the syncs are reported. The count
    is taken inside the student's process (nothing outside can see a host sync): see the threat model.
    """
    _gate(ctx)
    got = ctx.call("lab1.host_syncs", {"steps": 8})
    per_step = [[str(s) for s in step] for step in got["sites"]]
    require(len(per_step) == 8, "expected the sync sites of 8 steps")
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

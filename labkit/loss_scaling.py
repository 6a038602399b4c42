"""Loss scaling by hand: static and dynamic scalers that behave like `torch.amp.GradScaler`, written to be read.

    scaler = DynamicLossScaler()              # or StaticLossScaler(2.0**12)
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()         # gradients are now `scale` times too large (and did not underflow)
        scaler.unscale_(optimizer)            # optional: only needed to look at or clip the true gradients
        clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)                # unscales if needed; skips the step if any gradient is inf/NaN
        scaler.update()                       # dynamic: back off after inf/NaN, grow after a clean streak

Same scale history, same skipped steps, same unscaled gradients as GradScaler: `compare_scalers` drives both
on crafted gradient sequences (`crafted_sequences`) that exercise every rule. `Fp32MasterWeights` keeps fp32
copies of an fp16 model's weights. `labkit.amp` builds the week's training step on these (and re-exports them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from labkit.env import LabkitError, pick_device

# ------------------------------------------------------------------------------------------- loss scalers


class ScalerUsageError(LabkitError, RuntimeError):
    """A scaler method was called out of order (GradScaler raises RuntimeError in the same situations)."""


def _fp32(x: float) -> float:
    """Round a Python float to the nearest float32, as GradScaler keeps its scale in a float32 tensor."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def _usable(scale: float) -> bool:
    """Whether a float32 scale > 0 has a finite float32 reciprocal (true down to about 2.94e-39).

    Below that GradScaler's unscale factor is inf, and it checks the gradients for inf/NaN before multiplying
    by it: finite gradients become inf (zero ones NaN) and the step is taken, so the weights are overwritten with inf/NaN. At scale 0
    (reached by backing off past the smallest float32) that happens on every later step, for good.
    """
    return scale > 0 and math.isfinite(_fp32(1.0 / scale))


def _check_scale(scale: float, what: str) -> None:
    if not _usable(scale):
        raise LabkitError(f"{what} {scale:g} is unusable: in float32 (where the scale is kept, as in GradScaler) "
                          f"it or its reciprocal is 0/inf; use a scale >= {_SMALLEST_SCALE:.3g}")


_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"
# The smallest power of two whose float32 reciprocal is finite; any scale below ~2.94e-39 is unusable.
_SMALLEST_SCALE = 2.0**-127


class StaticLossScaler:
    """Loss scaling with a fixed scale: multiply the loss, divide the gradients, skip steps with inf/NaN grads.

    Mirrors `torch.amp.GradScaler`'s methods: `scale(loss)`, `unscale_(optimizer)`, `step(optimizer)`,
    `update()`, `get_scale()`, `state_dict()` / `load_state_dict()`. `history` lists one
    `(scale used, step skipped)` pair per `update()`, and `skipped_steps` counts the skipped ones.
    """

    # A static scale never grows or backs off; the dynamic scaler overrides these.
    growth_factor: float = 1.0
    backoff_factor: float = 1.0
    growth_interval: int = 0

    def __init__(self, scale: float = 2.0**16, enabled: bool = True):
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise LabkitError(f"loss scale must be a finite number > 0, got {scale!r}")
        self._enabled = enabled
        self._init_scale = float(scale)
        self._scale = _fp32(scale)
        _check_scale(self._scale, "loss scale")
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}
        self.history: list[tuple[float, bool]] = []
        self.skipped_steps = 0

    # -- the four calls of a training step

    def scale(self, outputs):
        """Multiply a loss (or a list/tuple of losses) by the current scale; unchanged when disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise LabkitError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide `optimizer`'s gradients by the scale in place and note whether any of them is inf or NaN.

        Call it at most once per step, after all backward passes, when you need the true gradients (clipping).
        """
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the last update()")
        if state["stage"] == _STEPPED:
            raise ScalerUsageError("unscale_() is being called after step(); call update() first")
        # The reciprocal in float64, rounded to float32, is exactly the factor GradScaler multiplies by.
        inv_scale = _fp32(1.0 / self._scale)
        found = None
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if g.is_sparse:
                        raise LabkitError("sparse gradients are not supported by the labkit scalers; "
                                          "use torch.amp.GradScaler")
                    if g.dtype == torch.float16:
                        raise LabkitError("refusing to unscale fp16 gradients: keep fp32 parameters (autocast) or "
                                          "fp32 master weights (Fp32MasterWeights) so the update is not rounded")
                    # Check before dividing: inf stays inf, but a huge finite value must still count as finite.
                    bad = (~torch.isfinite(g)).any()
                    found = bad if found is None else found | bad.to(found.device)
                    g.mul_(inv_scale)
        if found is None:
            raise ScalerUsageError("no gradients found: call scaler.scale(loss).backward() before unscale_/step")
        state["found_inf"], state["stage"] = found, _UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless `unscale_` already ran) and call `optimizer.step()` only if all gradients are finite.

        Returns what `optimizer.step` returns, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise LabkitError("optimizer closures are not supported with loss scaling")
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise ScalerUsageError("step() has already been called since the last update()")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        # One host sync per step: the decision to skip is made on the CPU (GradScaler does the same).
        state["skipped"] = bool(state["found_inf"].item())
        state["stage"] = _STEPPED
        return None if state["skipped"] else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: record it, then set the next scale (`new_scale` if given, else the rule)."""
        if not self._enabled:
            return
        checked = [s for s in self._per_optimizer.values() if s["stage"] != _READY]
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise LabkitError("new_scale must be a float or a one-element tensor without requires_grad")
                new_scale = float(new_scale.item())
            _check_scale(_fp32(float(new_scale)), "new_scale")
            self._scale = _fp32(float(new_scale))
        else:
            if not checked:
                raise ScalerUsageError("no inf checks were recorded before update(): call step() first")
            # Any optimizer's inf/NaN counts for all: the step(s) of this iteration were (or must be) skipped.
            found_inf = any(bool(s["found_inf"].item()) for s in checked)
            self.history.append((self._scale, found_inf))
            self.skipped_steps += int(found_inf)
            self._scale, self._growth_tracker = self._next_scale(found_inf)
        self._per_optimizer = {}

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    # -- the rule: the only thing the dynamic scaler changes

    def _next_scale(self, found_inf: bool) -> tuple[float, int]:
        """(next scale, next growth tracker) after an iteration; a static scale never moves."""
        return self._scale, 0

    # -- bookkeeping

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY})

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last finished iteration skipped its optimizer step (None before the first update)."""
        return self.history[-1][1] if self.history else None

    def state_dict(self) -> dict:
        """The same keys as GradScaler.state_dict(), so checkpoints can move between the two."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        if not state:
            raise LabkitError("the scaler state dict is empty (it was saved from a disabled scaler)")
        _check_scale(_fp32(float(state["scale"])), "the state dict's scale")
        self._scale = _fp32(float(state["scale"]))
        self._growth_tracker = int(state.get("_growth_tracker", 0))
        if isinstance(self, DynamicLossScaler):
            self.growth_factor = float(state.get("growth_factor", self.growth_factor))
            self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
            self.growth_interval = int(state.get("growth_interval", self.growth_interval))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self._scale:g}, skipped_steps={self.skipped_steps})"


class DynamicLossScaler(StaticLossScaler):
    """Loss scaling that adapts: after an inf/NaN step the scale is multiplied by `backoff_factor`; after
    `growth_interval` clean steps in a row it is multiplied by `growth_factor` (unless that overflows float32).

    Defaults and behaviour are those of `torch.amp.GradScaler`, with one exception: where overflow after
    overflow backs the scale off below ~2.94e-39 (GradScaler goes on down to 0 and then writes inf/NaN into
    the weights), `update()` raises a LabkitError that says so.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not growth_factor > 1.0:
            raise LabkitError(f"growth_factor must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise LabkitError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise LabkitError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        super().__init__(init_scale, enabled)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval

    def _next_scale(self, found_inf: bool) -> tuple[float, int]:
        if found_inf:
            backed_off = _fp32(self._scale * self.backoff_factor)
            if not _usable(backed_off):
                self._raise_underflow(backed_off)
            return backed_off, 0
        streak = self._growth_tracker + 1
        if streak == self.growth_interval:
            grown = _fp32(self._scale * self.growth_factor)
            return (grown if math.isfinite(grown) else self._scale), 0
        return self._scale, streak

    def _raise_underflow(self, backed_off: float) -> None:
        """Stop where GradScaler would go on to write inf/NaN into the weights (see `_usable`)."""
        streak = 0
        for _, skipped in reversed(self.history):
            if not skipped:
                break
            streak += 1
        first = self.history[-streak][0]
        raise LabkitError(
            f"loss scale underflow: {streak} overflow steps in a row backed the scale off from {first:g} to "
            f"{backed_off:g}, too small to unscale by in float32; gradients that are inf/NaN at every scale come "
            "from the model or the loss itself (NaN inputs, log/div of 0, a diverged learning rate), not from "
            "fp16 range. torch.amp.GradScaler would carry on and write inf/NaN into the weights")


def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float, scaler=None) -> torch.Tensor:
    """Clip the gradients of `optimizer`'s parameters to total L2 norm `max_norm`, correctly under scaling.

    With a scaler the gradients are unscaled first: clipping scaled gradients would compare `scale * norm` with
    `max_norm`, i.e. clip far too hard (or, written as `max_norm * scale`, let fp16 overflow slip through).
    Returns the total norm of the true gradients (inf/NaN on an overflow step, which `step` then skips).
    """
    if max_norm <= 0:
        raise LabkitError(f"max_norm must be > 0, got {max_norm}")
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class Fp32MasterWeights:
    """The pre-autocast recipe: an fp16 model for forward/backward, fp32 copies that the optimizer updates.

    Build the optimizer on `master_params`; per step: backward into the fp16 model, `grads_to_master()`,
    scaler.step / update, `master_to_model()`. The fp32 gradients live only during the step.
    """

    def __init__(self, model: nn.Module):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]

    def grads_to_master(self) -> None:
        for mp, p in zip(self.master_params, self.model_params, strict=True):
            mp.grad = None if p.grad is None else p.grad.float()

    def master_to_model(self) -> None:
        with torch.no_grad():
            for mp, p in zip(self.master_params, self.model_params, strict=True):
                p.copy_(mp)
                mp.grad = None




# ------------------------------------------------------------------------------- scalers on crafted grads


def crafted_sequences() -> dict[str, dict]:
    """Named gradient sequences (true gradients per step, plus the scaler settings) that exercise every rule.

    Each step's gradient is multiplied by the scale and rounded to fp16, as an fp16 backward would hand it over,
    so a too-large scale overflows to inf exactly as in real training.
    """
    one, big = [1e-3, -2e-4, 5e-6], [3.0, -1.0, 0.5]
    inf, nan = [1.0, float("inf"), 0.0], [float("nan"), 1.0, 0.0]
    return {
        "finite": {"grads": [one] * 6, "init_scale": 2.0**10, "growth_interval": 100},
        "inf_and_nan": {"grads": [one, inf, one, nan, nan, one, one], "init_scale": 2.0**10, "growth_interval": 100},
        "growth": {"grads": [one] * 10, "init_scale": 2.0**4, "growth_interval": 3},
        "overflow_backoff": {"grads": [big] * 8 + [one] * 6, "init_scale": 2.0**16, "growth_interval": 4},
        "odd_factors": {"grads": [big, big, one, one, one, inf, one, one, one, one], "init_scale": 3000.0,
                        "growth_interval": 2, "growth_factor": 1.7, "backoff_factor": 0.3},
        "float32_ceiling": {"grads": [[0.0, 0.0, 0.0]] * 4, "init_scale": 2.0**126, "growth_interval": 1},
    }


@dataclass
class ScalerTrace:
    """What a scaler did on a gradient sequence."""

    scales: list[float]  # scale in force at each step (before update)
    skipped: list[bool]  # whether the optimizer step was skipped
    params: list[list[float]]  # parameter values after each step


def drive_scaler(scaler, grads: Sequence[Sequence[float]], device=None) -> ScalerTrace:
    """Run `scaler` (labkit or torch.amp.GradScaler) through `grads` with one fp32 parameter and SGD(lr=0.1)."""
    dev = pick_device(device)
    p = nn.Parameter(torch.ones(len(grads[0]), device=dev))
    opt = torch.optim.SGD([p], lr=0.1)
    stepped = []
    opt.register_step_post_hook(lambda *_: stepped.append(True))
    trace = ScalerTrace([], [], [])
    for g in grads:
        opt.zero_grad(set_to_none=True)
        factor = scaler.scale(torch.ones((), device=dev))
        p.grad = (torch.tensor(g, device=dev) * factor).to(torch.float16).float()
        trace.scales.append(scaler.get_scale())
        before = len(stepped)
        scaler.step(opt)
        scaler.update()
        trace.skipped.append(len(stepped) == before)
        trace.params.append(p.detach().cpu().tolist())
    return trace


def compare_scalers(device=None, sequences: dict | None = None) -> dict[str, dict[str, ScalerTrace]]:
    """Run GradScaler, DynamicLossScaler and StaticLossScaler through each crafted sequence."""
    dev = pick_device(device)
    out = {}
    for name, seq in (sequences or crafted_sequences()).items():
        kw = {k: seq[k] for k in ("init_scale", "growth_interval", "growth_factor", "backoff_factor") if k in seq}
        out[name] = {
            "GradScaler": drive_scaler(torch.amp.GradScaler(dev.type, **kw), seq["grads"], dev),
            "DynamicLossScaler": drive_scaler(DynamicLossScaler(**kw), seq["grads"], dev),
            "StaticLossScaler": drive_scaler(StaticLossScaler(kw["init_scale"]), seq["grads"], dev),
        }
    return out

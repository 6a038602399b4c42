"""Scaling tensors into fp8: per-tensor amax scaling, delayed scaling from an amax history, and MX-style block
scaling (32-element blocks sharing a power-of-two scale), compared for error on real gradients.

fp8 has so little range (e4m3: 2^-9 to 448; e5m2: 2^-16 to 57344) that a tensor is multiplied by a scale before
the cast and divided by it afterwards. The methods differ in where the scale comes from:

  per-tensor  scale = max / amax(x) / 2^margin, from the tensor itself (needs a pass over x before the cast);
  delayed     the same formula with the largest amax of the last `history_len` steps (Transformer Engine's
              default recipe): no extra pass, but a tensor whose amax jumps past its history saturates;
  MX block    every 32 consecutive values share a power-of-two scale (an E8M0 exponent), so one large value
              only costs precision to its own block. OCP Microscaling v1.0 sets the exponent to
              floor(log2 amax_block) - emax, which lets a block's largest values pass the format's max and
              saturate; rounding the exponent up instead keeps every block in range (`mx_exponents`).

Values are rounded with `labkit.floats.round_to` (checked bit for bit against torch's fp8 casts), saturating at
the format's max as the fp8 cast kernels of these recipes do. Everything returned is dequantized float32.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from labkit.env import LabkitError
from labkit.floats import FloatFormat, get_format, round_to

MX_BLOCK = 32
MX_EXPONENTS = ("floor", "up")
METHODS = ("no scaling", "per-tensor amax", "delayed (amax history)", "MX block, exponent floor",
           "MX block, exponent up")


def _tensor(x) -> torch.Tensor:
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        raise LabkitError(f"fp8 scaling takes float tensors, got {x.dtype}")
    return x.detach().float()


def scale_for(amax: float, fmt="fp8_e4m3", margin: int = 0) -> float:
    """The multiplier that maps `amax` to the format's max / 2^margin (1.0 for an all-zero or non-finite amax,
    as Transformer Engine keeps the previous scale then)."""
    f = get_format(fmt)
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return f.max / amax / 2.0**margin


def _cast(x: torch.Tensor, f: FloatFormat, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * scale rounded to f saturating, divided by scale again, as float32; the mask of the values that
    saturated: past the point where round to nearest leaves the max). `scale`: a float or a tensor that
    broadcasts against x."""
    y = x.double() * scale
    # Half a gap above max is the tie; it rounds to even, which is past max only where max's mantissa is odd.
    tie = f.max + 2.0 ** (f.emax - f.mantissa_bits - 1)
    past = y.abs() >= tie if f.has_inf else y.abs() > tie
    return (round_to(y, f, overflow="saturate").double() / scale).float(), past


def quantize(x, fmt="fp8_e4m3", scale: float = 1.0) -> torch.Tensor:
    """round(x * scale) in `fmt`, saturating at its max, divided by `scale` again: what the tensor becomes."""
    if not scale > 0 or not math.isfinite(scale):
        raise LabkitError(f"scale must be a positive finite number, got {scale!r}")
    return _cast(_tensor(x), get_format(fmt), scale)[0]


def _per_tensor(x: torch.Tensor, f: FloatFormat, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _cast(x, f, scale_for(float(x.abs().max()) if x.numel() else 0.0, f, margin))


def per_tensor(x, fmt="fp8_e4m3", margin: int = 0) -> torch.Tensor:
    """Dequantized x after a per-tensor amax-scaled cast to `fmt` (the scale from x's own amax)."""
    return _per_tensor(_tensor(x), get_format(fmt), margin)[0]


def mx_exponents(x, fmt="fp8_e4m3", block: int = MX_BLOCK, exponent: str = "floor") -> torch.Tensor:
    """The shared power-of-two exponent of each block of `block` consecutive values of flattened x (padded with
    zeros), clamped to E8M0's -127..127 (0 for an all-zero block).

    exponent="floor" (OCP MX v1.0): floor(log2 amax_block) - emax of `fmt`; the block's largest value then
    lands in [2^emax, 2^(emax + 1)), past the format's max for e4m3 and e5m2 whenever its mantissa is large,
    and saturates. exponent="up": ceil(log2(amax_block / max)), the smallest scale that fits the whole block.
    """
    f = get_format(fmt)
    if block < 1:
        raise LabkitError(f"block must be at least 1, got {block}")
    if exponent not in MX_EXPONENTS:
        raise LabkitError(f"exponent={exponent!r}: use one of {', '.join(MX_EXPONENTS)}")
    flat = _tensor(x).flatten()
    pad = (-flat.numel()) % block
    amax = torch.cat([flat, flat.new_zeros(pad)]).abs().reshape(-1, block).amax(dim=1).double()
    if exponent == "floor":
        _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
        shared = e.long() - 1 - f.emax
    else:
        m, e = torch.frexp(amax / f.max)  # ceil(log2 y) is e, or e - 1 when y is exactly 2^(e - 1)
        shared = e.long() - (m == 0.5).long()
    return torch.where(amax > 0, shared.clamp(-127, 127), torch.zeros_like(shared))


def _mx_block(x: torch.Tensor, f: FloatFormat, block: int, exponent: str) -> tuple[torch.Tensor, torch.Tensor]:
    exps = mx_exponents(x, f, block, exponent)
    flat = x.flatten()
    pad = (-flat.numel()) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, block)
    scale = torch.ldexp(torch.ones(len(exps), 1, dtype=torch.float64), -exps[:, None].double())  # exact 2^-e
    q, past = _cast(blocks, f, scale)
    return q.flatten()[: flat.numel()].reshape(x.shape), past.flatten()[: flat.numel()].reshape(x.shape)


def mx_block(x, fmt="fp8_e4m3", block: int = MX_BLOCK, exponent: str = "floor") -> torch.Tensor:
    """Dequantized x after MX-style block scaling: each block of `block` consecutive values (of the flattened
    tensor, i.e. along rows) is divided by its shared 2^exponent (see `mx_exponents`), rounded to `fmt`
    saturating, and multiplied back."""
    return _mx_block(_tensor(x), get_format(fmt), block, exponent)[0]


@dataclass
class DelayedScaler:
    """Delayed scaling: each named tensor is cast with a scale from the amaxes of its previous casts, and its
    own amax then joins the history. A name seen for the first time is scaled by its own amax."""

    fmt: str = "fp8_e5m2"  # element format (Transformer Engine's hybrid recipe: e5m2 for gradients)
    history_len: int = 16  # amaxes remembered per tensor (Transformer Engine's default is 1024)
    margin: int = 0  # extra headroom: scales are divided by 2^margin
    history: dict[str, deque] = field(default_factory=dict)  # name -> recent amaxes, oldest first

    def __post_init__(self):
        get_format(self.fmt)
        if self.history_len < 1 or self.margin < 0:
            raise LabkitError(f"history_len must be >= 1 and margin >= 0, got {self.history_len}, {self.margin}")

    def scale(self, name: str) -> float | None:
        """The scale the next cast of `name` will use, None before its first cast."""
        h = self.history.get(name)
        return scale_for(max(h), self.fmt, self.margin) if h else None

    def _quantize(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = float(x.abs().max()) if x.numel() else 0.0
        s = self.scale(name)
        out = _cast(x, get_format(self.fmt), scale_for(amax, self.fmt, self.margin) if s is None else s)
        self.history.setdefault(name, deque(maxlen=self.history_len)).append(amax)
        return out

    def quantize(self, name: str, x) -> torch.Tensor:
        """Cast x with the scale from `name`'s history (its own amax if none yet), then record x's amax."""
        return self._quantize(name, _tensor(x))[0]


def error_stats(x, q, past_max=None) -> dict:
    """How far q (a dequantized copy) is from x: summed squared error and squares (for pooled relative errors),
    the share of nonzero values flushed to zero, and the share that were past the format's max once scaled
    (`past_max`, a mask from the cast; saturated to the max, so clipped)."""
    x, q = _tensor(x).double().flatten(), _tensor(q).double().flatten()
    nz = x != 0
    n = max(int(nz.sum()), 1)
    sat = 0.0 if past_max is None else float((torch.as_tensor(past_max).flatten() & nz).sum()) / n
    return {"sq_error": float(((x - q) ** 2).sum()), "sq_norm": float((x**2).sum()), "values": x.numel(),
            "nonzero": int(nz.sum()), "to_zero": float(((q == 0) & nz).sum()) / n, "saturated": sat}


def _pool(name: str, fmt: FloatFormat, stats: list[dict], per_tensor_err: list[float]) -> dict:
    total = sum(s["nonzero"] for s in stats)
    weigh = lambda key: sum(s[key] * s["nonzero"] for s in stats) / max(total, 1)  # noqa: E731  shares of nonzeros
    sq_norm = sum(s["sq_norm"] for s in stats)
    return {"method": name, "format": fmt.name,
            "relative_error": math.sqrt(sum(s["sq_error"] for s in stats) / sq_norm) if sq_norm else 0.0,
            "median_tensor_error": float(torch.tensor(per_tensor_err).median()) if per_tensor_err else 0.0,
            "to_zero": weigh("to_zero"), "saturated": weigh("saturated"), "tensors": len(stats)}


def compare_scaling(steps: Sequence[dict], fmt="fp8_e5m2", *, block: int = MX_BLOCK, history_len: int = 16,
                    margin: int = 0, evaluate_from: int = 1) -> list[dict]:
    """Each method's error on a sequence of training steps, each a {name: tensor} dict (e.g. the
    "activation_grads" of `labkit.floats.gradient_tensors`). Delayed scaling sees every step in order; errors
    are pooled over steps `evaluate_from` onwards (step 0 only fills the amax history).

    One row per method: relative_error (sqrt of summed squared error over summed squares, all values pooled),
    median_tensor_error (the median of each tensor's own relative error: small tensors count as much as big
    ones), to_zero and saturated (shares of the nonzero values), tensors (how many were compared).
    """
    f = get_format(fmt)
    if not steps or not 0 <= evaluate_from < len(steps):
        raise LabkitError(f"need steps to evaluate: got {len(steps)} steps, evaluate_from={evaluate_from}")
    delayed = DelayedScaler(f.name, history_len, margin)
    stats: dict[str, list[dict]] = {m: [] for m in METHODS}
    errs: dict[str, list[float]] = {m: [] for m in METHODS}
    for i, step in enumerate(steps):
        for name, x in step.items():
            x = _tensor(x)
            q = {"delayed (amax history)": delayed._quantize(name, x)}
            if i < evaluate_from:
                continue
            q |= {"no scaling": _cast(x, f, 1.0), "per-tensor amax": _per_tensor(x, f, margin),
                  "MX block, exponent floor": _mx_block(x, f, block, "floor"),
                  "MX block, exponent up": _mx_block(x, f, block, "up")}
            for m in METHODS:
                s = error_stats(x, *q[m])
                stats[m].append(s)
                errs[m].append(math.sqrt(s["sq_error"] / s["sq_norm"]) if s["sq_norm"] else 0.0)
    return [_pool(m.replace("MX block", f"MX block of {block}"), f, stats[m], errs[m]) for m in METHODS]


def plot_scaling(rows: Sequence[dict], ax=None, title: str = "fp8 scaling on real gradients"):
    """Grouped bars of `compare_scaling` rows: each method's pooled relative error (log scale), one colour per
    format, the share of values flushed to zero written above each bar."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    width = 0.8 / max(len(formats), 1)
    for j, (fmt, c) in enumerate(zip(formats, colours, strict=False)):
        got = {r["method"]: r for r in rows if r["format"] == fmt}
        xs = [i + j * width for i, m in enumerate(methods) if m in got]
        ys = [got[m]["relative_error"] for m in methods if m in got]
        bars = ax.bar(xs, ys, width, color=c, label=fmt)
        for b, m in zip(bars, [m for m in methods if m in got], strict=True):
            ax.annotate(f"{got[m]['to_zero']:.1%} to 0", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks([i + width * (len(formats) - 1) / 2 for i in range(len(methods))],
                  [m.replace(", ", ",\n") for m in methods], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("relative error (all values pooled)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax

"""Accumulating in a narrow format: running sums that stall (swamping), updates lost to rounding, and the fixes
(a wider accumulator, blocked and pairwise sums, stochastic rounding).

Everything is simulated exactly with `labkit.floats`: each addition is formed in float64 and rounded once to the
accumulator's format, so the results are the same on any machine. An addend is used as given (a float32 update
added to a bf16 weight stays float32 until the sum is rounded); round the addends first for a sum of values that
are themselves stored in the narrow format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from labkit.env import LabkitError
from labkit.floats import get_format, round_stochastic, round_to

ROUNDINGS = ("nearest", "stochastic")


def _rounder(fmt, rounding: str, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    f = get_format(fmt)
    if rounding == "nearest":
        return lambda v: round_to(v, f).double()
    if rounding == "stochastic":
        g = torch.Generator().manual_seed(seed)
        return lambda v: round_stochastic(v, f, generator=g).double()
    raise LabkitError(f"rounding={rounding!r}: use one of {', '.join(ROUNDINGS)}")


def _values(values) -> torch.Tensor:
    """values as a float64 CPU tensor with at least one element along the last dimension."""
    v = torch.as_tensor(values)
    if not v.is_floating_point() or v.dim() == 0 or v.shape[-1] == 0:
        raise LabkitError(f"expected a non-empty float tensor of values (last dimension summed), got "
                          f"{v.dtype} of shape {tuple(v.shape)}")
    return v.detach().cpu().double()


def running_sum(values, fmt="bf16", *, rounding: str = "nearest", seed: int = 0) -> torch.Tensor:
    """Partial sums s_i = round(s_(i-1) + v_i) along the last dimension, with the accumulator s held in `fmt`.

    Each row of a 2-D input is an independent sum (stochastic rounding draws differ per row). Returns float64
    partial sums, the same shape as `values`; the last column is the total. One Python step per element, so
    keep the last dimension to a few thousand (about 0.1 ms per step).
    """
    v = _values(values)
    rnd = _rounder(fmt, rounding, seed)
    out = torch.empty_like(v)
    acc = torch.zeros(v.shape[:-1], dtype=torch.float64)
    for i in range(v.shape[-1]):
        acc = rnd(acc + v[..., i])
        out[..., i] = acc
    return out


def repeated_add(start: float, increment: float, steps: int, fmt="bf16", *, rounding: str = "nearest",
                 trials: int = 1, seed: int = 0) -> torch.Tensor:
    """Add `increment` to `start` `steps` times, the running value held in `fmt` (a weight receiving the same
    small update every step). Returns float64 trajectories, shape (trials, steps + 1); column 0 is `start` as
    `fmt` stores it. Trials differ only under stochastic rounding."""
    if steps < 1 or trials < 1:
        raise LabkitError(f"steps and trials must be at least 1, got steps={steps}, trials={trials}")
    v = torch.full((trials, steps + 1), float(increment), dtype=torch.float64)
    v[:, 0] = float(start)
    return running_sum(v, fmt, rounding=rounding, seed=seed)


def pairwise_sum(values, fmt="bf16") -> float:
    """Sum of a 1-D tensor as a tree: neighbours added in pairs, level by level, every partial sum rounded to
    `fmt` (how a parallel reduction adds). The error grows with log2(n) instead of n."""
    v = _values(values).flatten()
    f = get_format(fmt)
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, v.new_zeros(1)])
        v = round_to(v[0::2] + v[1::2], f).double()
    return float(round_to(v, f)[0])


def blocked_sum(values, fmt="bf16", block: int = 64) -> float:
    """Two-level sum of a 1-D tensor, both levels in `fmt`: a running sum inside each block of `block`
    consecutive values, then a running sum of the block totals (the idea behind split-K and per-thread
    partial sums). Each partial sum stays small compared with its addends, so less is swamped."""
    v = _values(values).flatten()
    if block < 1:
        raise LabkitError(f"block must be at least 1, got {block}")
    pad = (-v.numel()) % block
    blocks = torch.cat([v, v.new_zeros(pad)]).reshape(-1, block)
    totals = running_sum(blocks, fmt)[:, -1]
    return float(running_sum(totals, fmt)[-1])


def summation_errors(values, fmt="bf16", *, block: int = 64, seed: int = 0) -> list[dict]:
    """One row per way of summing the 1-D tensor `values`: the sum and its relative error against the exact
    (float64) sum. Ways: a running sum in `fmt` rounded to nearest and stochastically, a pairwise tree in `fmt`,
    blocks of `block` in `fmt`, a running sum in fp32, and torch.sum of the values as a tensor of `fmt`'s torch
    dtype (which accumulates in fp32 inside and rounds once)."""
    v = _values(values).flatten()
    f = get_format(fmt)
    exact = float(v.sum())
    sums = {f"{f.name} running sum, round to nearest": float(running_sum(v, f)[-1]),
            f"{f.name} running sum, stochastic rounding": float(running_sum(v, f, rounding="stochastic",
                                                                             seed=seed)[-1]),
            f"{f.name} pairwise (tree) sum": pairwise_sum(v, f),
            f"{f.name} blocks of {block}, then the block sums": blocked_sum(v, f, block),
            "fp32 running sum": float(running_sum(v, "fp32")[-1])}
    if f.dtype() is not None:
        sums[f"torch.sum of a {f.torch_dtype} tensor"] = float(v.to(f.dtype()).sum().double())
    return [{"method": k, "sum": s, "relative_error": abs(s - exact) / abs(exact) if exact else abs(s)}
            for k, s in sums.items()]


def _flat(x) -> torch.Tensor:
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, Iterable) and not isinstance(x, torch.Tensor):
        parts = [torch.as_tensor(t).detach().flatten() for t in x]
        if not parts:
            raise LabkitError("no tensors given")
        x = torch.cat(parts)
    return torch.as_tensor(x).detach().cpu().double().flatten()


def update_survival(weights, updates, fmt="bf16", *, rounding: str = "nearest", seed: int = 0) -> dict:
    """What one optimizer step does to weights stored in `fmt`: w_new = round(w + u), with w first rounded to
    `fmt` (that is where it lives) and u the update as computed (float32).

    `weights` and `updates` are tensors, lists of tensors or {name: tensor} dicts of matching shapes. Returns
    {"format", "rounding", "updates": nonzero updates, "lost": share of them that left the weight unchanged,
    "applied": sum((w_new - w) * sign(u)) / sum(|u|), the share of the intended movement that happened (1.0:
    all of it, on average)}.
    """
    w, u = _flat(weights), _flat(updates)
    if w.shape != u.shape:
        raise LabkitError(f"weights and updates differ in size: {w.numel()} against {u.numel()} values")
    rnd = _rounder(fmt, rounding, seed)
    w = round_to(w, fmt).double()
    moved = rnd(w + u) - w
    nz = u != 0
    n = int(nz.sum())
    lost = float(((moved == 0) & nz).sum()) / max(n, 1)
    applied = float((moved * u.sign()).sum() / u.abs().sum()) if n else 1.0
    return {"format": get_format(fmt).name, "rounding": rounding, "updates": n, "lost": lost, "applied": applied}


def plot_repeated_add(trajectories: dict[str, torch.Tensor], start: float, increment: float, ax=None):
    """Running value against step for each labelled (trials, steps + 1) trajectory, beside the exact line
    start + step * increment; several trials are drawn as their mean with a 5-95% band."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    colours = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]
    steps = next(iter(trajectories.values())).shape[-1] - 1
    x = torch.arange(steps + 1).numpy()
    ax.plot(x, (start + increment * torch.arange(steps + 1, dtype=torch.float64)).numpy(), color="black",
            linestyle="--", linewidth=1.5, label="exact", zorder=5)  # on top: the lines it hides are labelled
    for (label, t), c in zip(trajectories.items(), colours, strict=False):
        t = t.reshape(-1, steps + 1)
        ax.plot(x, t.mean(0).numpy(), color=c, linewidth=1.5,
                label=label if t.shape[0] == 1 else f"{label} (mean of {t.shape[0]}, 5-95% band)")
        if t.shape[0] > 1:
            lo, hi = torch.quantile(t, torch.tensor([0.05, 0.95], dtype=torch.float64), dim=0)
            ax.fill_between(x, lo.numpy(), hi.numpy(), color=c, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("running value")
    ax.set_title(f"Adding {increment:g} to {start:g} again and again")
    ax.legend(fontsize=8)
    return ax

"""Attention's memory and time, measured: a tiny transformer block to count activations in, and the meters.

The student writes the attention itself (week 3, exercises 3.12-3.16); this module holds what measures it:

* `TinyConfig` + `TINY_PRESETS` and `build_blocks(cfg, attn)`: a pre-LayerNorm transformer block stack
  (LayerNorm, one qkv projection, attention, output projection, LayerNorm, a GELU MLP of 4 * d_model), with
  the attention function pluggable, so that the student's naive attention and PyTorch's fused
  `scaled_dot_product_attention` run inside the same layers;
* `peak_bytes(fn, device)`: the most memory `fn()` held at once above what was held before it, in bytes
  (the CUDA caching allocator's peak on a GPU; on a CPU, the allocator's running total as torch.profiler's
  memory events report it);
* `saved_bytes(fn)`: bytes autograd keeps for backward while `fn()` runs (`amp.SavedTensorMeter`);
* `attention_sweep(fns, seq_lens, ...)`: median time, peak bytes and saved bytes of each attention function
  at each sequence length; `plot_sweep(rows)` draws them on log axes;
* `random_qkv(...)`: seeded query, key and value tensors of shape (batch, heads, seq_len, head_dim);
* `naive_attention`: labkit's own naive version (the reference the week's checks use).

Everything runs on a CPU in a second or two at the quick sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.env import LabkitError, pick_device


@dataclass(frozen=True)
class TinyConfig:
    d_model: int = 128  # width of the residual stream
    heads: int = 4      # attention heads; head_dim = d_model / heads
    layers: int = 2     # transformer blocks in the stack
    mlp_ratio: int = 4  # the MLP's hidden width is mlp_ratio * d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def check(self) -> None:
        if self.d_model < 1 or self.heads < 1 or self.layers < 1 or self.mlp_ratio < 1:
            raise LabkitError(f"TinyConfig needs positive sizes, got {self}")
        if self.d_model % self.heads:
            raise LabkitError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")


TINY_PRESETS = {
    "tiny": TinyConfig(d_model=128, heads=4, layers=2),   # the notebook's quick size
    "small": TinyConfig(d_model=256, heads=4, layers=4),  # full size
}


def naive_attention(q, k, v, causal: bool = False):
    """softmax(q @ k^T / sqrt(head_dim)) @ v over the last two dims; causal masks keys after each query."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


def sdpa(q, k, v, causal: bool = False):
    """PyTorch's fused attention, with the same signature as the student's."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, cfg: TinyConfig, attn: Callable):
        super().__init__()
        self.cfg, self.attn = cfg, attn
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, n, d = x.shape
        heads = self.cfg.heads
        # (b, n, 3d) -> three (b, heads, n, head_dim); contiguous, so each is one tensor of its own (the
        # matmuls then save these, not copies made inside them)
        q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2).contiguous()
                   for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        o = self.attn(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(o)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def build_blocks(cfg: TinyConfig | str = "tiny", attn: Callable | None = None, *, seed: int = 0,
                 device=None) -> nn.Sequential:
    """`cfg.layers` transformer blocks calling `attn(q, k, v)` (default: labkit's naive attention), seeded."""
    cfg = TINY_PRESETS[cfg] if isinstance(cfg, str) else cfg
    cfg.check()
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(cfg, attn or naive_attention) for _ in range(cfg.layers))).to(pick_device(device))


def random_qkv(batch: int = 1, heads: int = 4, seq_len: int = 128, head_dim: int = 32, *, dtype=torch.float32,
               device=None, requires_grad: bool = False, seed: int = 0):
    """Seeded (q, k, v), each of shape (batch, heads, seq_len, head_dim)."""
    if min(batch, heads, seq_len, head_dim) < 1:
        raise LabkitError(f"random_qkv needs positive sizes, got {(batch, heads, seq_len, head_dim)}")
    g = torch.Generator().manual_seed(seed)
    dev = pick_device(device)
    return tuple(torch.randn(batch, heads, seq_len, head_dim, generator=g).to(dev, dtype).requires_grad_(requires_grad)
                 for _ in range(3))


# ------------------------------------------------------------------------------------------------ meters

def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's running total during fn(), from torch.profiler's memory events (bytes)."""
    from torch.profiler import ProfilerActivity, profile

    from labkit.profiling import _quiet_profiler, quiet_cpu_profiler

    quiet_cpu_profiler()
    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out  # what fn returns is freed here, inside the profile, like every temporary
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()  # positive for an allocation, negative for a free
        peak = max(peak, now)
    return peak


def peak_bytes(fn: Callable[[], object], device=None) -> int:
    """The most memory `fn()` held at once above what was held before it, in bytes.

    On CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) minus what was allocated before.
    On a CPU: the CPU allocator's running total, as torch.profiler records every allocation and free
    (`profile_memory=True`); this counts buffers a kernel allocates inside itself too."""
    dev = pick_device(device)
    if dev.type == "cuda":
        from labkit.amp import cuda_peak_bytes

        return cuda_peak_bytes(fn, dev)["peak_above_resident_bytes"]
    if dev.type != "cpu":
        raise LabkitError(f"peak_bytes measures CUDA or CPU memory, not {dev.type}")
    return _cpu_peak_bytes(fn)


def saved_bytes(fn: Callable[[], object], model: nn.Module | None = None) -> int:
    """Bytes autograd keeps for the backward pass while `fn()` runs (each storage once, `model`'s parameters
    excluded): `amp.SavedTensorMeter` around the call."""
    from labkit.amp import SavedTensorMeter

    with SavedTensorMeter(model) as m:
        out = fn()
    del out
    return m.bytes


def attention_sweep(fns: dict[str, Callable], seq_lens: Sequence[int], *, batch: int = 1, heads: int = 4,
                    head_dim: int = 32, causal: bool = False, device=None, repeats: int = 5) -> list[dict]:
    """Each attention function at each sequence length: rows of name, seq_len, median_s (forward pass, inputs
    that require grad, as in training), peak_bytes (forward) and saved_bytes (kept for backward)."""
    from labkit.bench import time_fn

    if not fns or not seq_lens or min(seq_lens) < 1:
        raise LabkitError("attention_sweep needs at least one function and positive sequence lengths")
    dev = pick_device(device)
    rows = []
    for n in seq_lens:
        q, k, v = random_qkv(batch, heads, n, head_dim, device=dev, requires_grad=True)
        for name, fn in fns.items():
            call = lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal=causal)  # noqa: E731
            t = time_fn(call, device=dev, warmup=1, repeats=repeats)
            rows.append({"name": name, "seq_len": n, "median_s": t.median, "peak_bytes": peak_bytes(call, dev),
                         "saved_bytes": saved_bytes(call)})
    return rows


def top_ops(prof, k: int = 5, by: str = "cpu") -> list[dict]:
    """The `k` rows with the most self time in a finished torch.profiler profile: rows of op, self_ms (summed
    over the recorded steps) and share (of the top row's self time, 1.0 for the top one).

    by="cpu" ranks by self CPU time, by="device" by self device time (on a GPU: the kernels); every row but the
    ProfilerStep ranges, so the ranking is the key-averages table's sorted by the same column."""
    if by not in ("cpu", "device"):
        raise LabkitError(f"top_ops ranks by 'cpu' or 'device' self time, not {by!r}")
    attr = "self_cpu_time_total" if by == "cpu" else "self_device_time_total"
    pairs = [(r.key, getattr(r, attr, 0.0)) for r in prof.key_averages() if not r.key.startswith("ProfilerStep")]
    rows = sorted(((key, us) for key, us in pairs if us > 0), key=lambda kv: -kv[1])
    if not rows:
        raise LabkitError(f"the profile recorded no operators with self {by} time: profile a step that runs torch ops")
    top = rows[0][1] or 1.0
    return [{"op": key, "self_ms": us / 1e3, "share": us / top} for key, us in rows[:k]]


def plot_sweep(rows: list[dict], expected: Callable[[int], float] | None = None, axes=None):
    """Time and peak memory against sequence length, log-log, one colour per function; `expected(seq_len)`
    (bytes) is drawn dashed on the memory panel when given."""
    import matplotlib.pyplot as plt

    from labkit.report import series_colors

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(dict.fromkeys(r["name"] for r in rows))
    lens = sorted({r["seq_len"] for r in rows})
    for name, color in zip(names, series_colors(len(names) + 1), strict=False):
        mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["seq_len"])
        xs = [r["seq_len"] for r in mine]
        axes[0].plot(xs, [1e3 * r["median_s"] for r in mine], "o-", color=color, label=name)
        axes[1].plot(xs, [r["peak_bytes"] / 2**20 for r in mine], "o-", color=color, label=f"{name}: peak")
    if expected is not None:
        axes[1].plot(lens, [expected(n) / 2**20 for n in lens], "--", color=series_colors(len(names) + 1)[-1],
                     label="one score matrix (expected)")
    axes[0].set_ylabel("forward time (ms, median)")
    axes[1].set_ylabel("peak memory above start (MiB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.legend()
    return axes

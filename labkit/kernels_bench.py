"""Timing a hand-written kernel fairly, and placing it on the roofline.

A kernel is timed beside the PyTorch code that computes the same thing, run eagerly and compiled by
`torch.compile` (inductor, which writes Triton kernels of its own): all in one process, in interleaved rounds
whose order rotates, so that clock changes and other load hit every contender alike; each is reported as the
median seconds per call with its interquartile range. Bytes moved over the median time give the achieved
bandwidth; FLOPs over bytes give the arithmetic intensity, and with them a point under week 2's roofline
(`labkit.matmul.roofline`), whose roof comes from the same card's measured copy bandwidth and a peak.

The kernels themselves live elsewhere (week 7's notebook and `labkit.week7_exercises`): this module only times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from labkit import bench
from labkit.env import LabkitError
from labkit.matmul import roofline


@contextlib.contextmanager
def count_launches():
    """Count Triton kernel launches (compiled or interpreted) inside the block: yields a one-item list."""
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    count, saved = [0], {cls: cls.run for cls in classes}

    def counted(orig):
        def run(self, *args, **kwargs):
            count[0] += 1
            return orig(self, *args, **kwargs)

        return run

    for cls, orig in saved.items():
        cls.run = counted(orig)
    try:
        yield count
    finally:
        for cls, orig in saved.items():
            cls.run = orig


def inner_for(fn: Callable[[], object], device: torch.device | str, target_s: float = 1e-3,
              most: int = 200) -> int:
    """Calls per timed sample so that one sample lasts about `target_s`: a single launch of a small kernel is
    shorter than CUDA events resolve well."""
    one = bench.time_fn(fn, device=device, warmup=1, repeats=3).median
    return max(1, min(most, int(target_s / max(one, 1e-7))))


def side_by_side(fns: dict[str, Callable[[], object]], *, device: torch.device | str, rounds: int = 15,
                 warmup: int = 3, inner: int | None = None, target_s: float = 1e-3) -> dict[str, bench.Timing]:
    """Time every callable in interleaved rounds: seconds per call, one sample per round for each.

    Each round runs all of them once (`inner` calls each, default: enough for about `target_s`), starting one
    further along the list every round, so no contender always runs first or right after the same other."""
    if not fns:
        raise LabkitError("side_by_side needs at least one callable")
    if rounds < 1 or warmup < 0 or (inner is not None and inner < 1):
        raise LabkitError("side_by_side needs rounds >= 1, warmup >= 0 and inner >= 1")
    dev = torch.device(device)
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    calls = {n: inner or inner_for(fns[n], dev, target_s) for n in names}
    bench.synchronize(dev)
    clock = bench._Clock(dev)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            clock.start()
            for _ in range(calls[name]):
                fns[name]()
            samples[name].append(clock.stop() / calls[name])
    return {n: bench.Timing(samples[n]) for n in names}


def eager_and_inductor(fn: Callable, *args, dynamic: bool = False) -> dict[str, Callable[[], object]]:
    """{"eager": fn(*args), "inductor": torch.compile(fn)(*args)} as zero-argument callables.

    The compiled one is compiled on its first call: run it once (side_by_side's warm-up does) before timing."""
    compiled = torch.compile(fn, dynamic=dynamic)
    return {"eager": lambda: fn(*args), "inductor": lambda: compiled(*args)}


def achieved(nbytes: float, seconds: float, flop: float | None = None) -> dict:
    """What a kernel reached: GB/s from bytes moved over seconds per call; with its FLOPs, FLOP/byte and TFLOP/s."""
    if nbytes <= 0 or seconds <= 0:
        raise LabkitError(f"achieved needs positive bytes and seconds, got {nbytes} and {seconds}")
    out = {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}
    if flop is not None:
        out |= {"flop": flop, "intensity": flop / nbytes, "tflops": flop / seconds / 1e12}
    return out


def summarize(timings: dict[str, bench.Timing], nbytes: float, flop: float | None = None) -> dict[str, dict]:
    """Per contender: its timing summary (median and IQR in seconds) with achieved() at the median."""
    return {n: t.summary() | achieved(nbytes, t.median, flop) for n, t in timings.items()}


def floor_seconds(nbytes: float, bandwidth: float) -> float:
    """The least time a memory-bound kernel can take: its bytes over the bandwidth (bytes/s), in seconds."""
    if bandwidth <= 0:
        raise LabkitError(f"bandwidth must be positive (bytes/s), got {bandwidth}")
    return nbytes / bandwidth


def week2_roof(record: dict | None = None) -> dict:
    """Week 2's recorded roofline (`week2_matmul.json`): peak TFLOP/s, copy bandwidth in bytes/s, the card."""
    rec = record if record is not None else bench.load_result("week2_matmul")
    roof = rec.get("roofline") or {}
    try:
        return {"peak_tflops": float(roof["peak_tflops"]), "bandwidth": float(roof["bandwidth"]["bytes_per_s"]),
                "device_name": rec.get("env", {}).get("device_name", "?"), "note": bench.recorded_note(rec)}
    except (KeyError, TypeError) as e:
        raise LabkitError(f"the week-2 record has no roofline ({e!r} missing)") from None


def kernels_roof(record: dict | None = None) -> dict:
    """The roof of the card week 7's kernels were timed on (`triton_kernels_h200.json`): the copy bandwidth measured
    in that run (bytes/s), the card's datasheet fp32 TFLOP/s, the card, the record's note.

    The floors drawn from it belong with the recorded times: week 2's roof is another card's."""
    rec = record if record is not None else bench.load_result("triton_kernels_h200")
    try:
        return {"peak_tflops": float(rec["datasheet_tflops"]["fp32"]),
                "bandwidth": float(rec["copy_bandwidth"]["bytes_per_s"]),
                "device_name": rec.get("env", {}).get("device_name", "?"), "note": bench.recorded_note(rec)}
    except (KeyError, TypeError) as e:
        raise LabkitError(f"the kernels' record has no roof ({e!r} missing)") from None


def recorded_points(record: dict, dtype: str = "float32") -> list[dict]:
    """Every timed contender of the record's kernels in `dtype`, as plot_points' points (label, intensity, TFLOP/s)."""
    return [{"label": f"{k['kernel']}: {who} (recorded)", "intensity": c["intensity"], "tflops": c["tflops"]}
            for k in record.get("kernels", []) if k.get("dtype") == dtype
            for who, c in k.get("contenders", {}).items()]


def ceiling(intensity: float, peak_tflops: float, bandwidth: float) -> float:
    """TFLOP/s the roof allows at `intensity` (FLOP/byte): min(peak, bandwidth x intensity)."""
    return roofline(intensity, peak_tflops * 1e12, bandwidth) / 1e12


def plot_points(points: Sequence[dict], peak_tflops: float, bandwidth: float, ax=None,
                title: str = "Kernels on the roofline"):
    """Points {"label", "intensity", "tflops"} (tflops None: only the intensity is known, drawn as a line) under
    min(peak, bandwidth x intensity); bandwidth in bytes/s."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    ridge = peak_tflops * 1e12 / bandwidth
    xs = [p["intensity"] for p in points] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [ceiling(x, peak_tflops, bandwidth) for x in grid], "k-", linewidth=1.5,
            label=f"roof: {peak_tflops:.4g} TFLOP/s, {bandwidth / 1e9:.4g} GB/s")
    for p in points:
        if p.get("tflops") is None:
            ax.axvline(p["intensity"], linestyle="--", linewidth=1, color="tab:blue")
            ax.annotate(p["label"], (p["intensity"], ceiling(p["intensity"], peak_tflops, bandwidth)),
                        fontsize=7, rotation=90, xytext=(3, 4), textcoords="offset points")
        else:
            ax.scatter([p["intensity"]], [p["tflops"]], zorder=3)
            ax.annotate(p["label"], (p["intensity"], p["tflops"]), fontsize=7, xytext=(3, -9),
                        textcoords="offset points")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax

"""Copy-compute overlap: host-to-device copies on a side CUDA stream from pinned buffers, hidden behind compute.

`copy_compute_overlap` feeds the same batches through the same compute three ways and times each with CUDA
events: (a) `serial`: a pageable host tensor copied synchronously, then computed on; (b) `pinned`: pinned
host memory and `non_blocking=True`, but on the compute stream, so copy and compute still take turns; (c)
`overlap`: pinned memory copied on a side stream into one of two device buffers while the default stream
computes on the previous batch, events ordering the two. With copy time C and compute time K per batch, (a) and
(b) cost about C + K, (c) about max(C, K). On a CPU there is no copy engine and no second stream: the function
runs a tiny version of the same loops (so CI exercises the code) and its note says the overlap needs CUDA.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from labkit.env import LabkitError, pick_device

MODES = ("serial", "pinned", "overlap")


@dataclass(frozen=True)
class OverlapConfig:
    batch_mib: float = 64.0  # size of one float32 host batch, MiB (CPU runs cap it at 0.25 MiB)
    batches: int = 8  # batches fed through per timed pass (at least 2, so there is a next batch to prefetch)
    width: int = 2048  # columns of a batch and side of the square weight the compute multiplies by
    matmuls: int | None = None  # matmuls per batch; None balances compute time against one batch's copy time
    repeats: int = 5  # timed passes per mode (after one warm-up); the median is reported


def _check(cfg: OverlapConfig) -> None:
    if cfg.batches < 2:
        raise LabkitError(f"batches must be at least 2 (one to compute while the next copies), got {cfg.batches}")
    if not cfg.batch_mib > 0 or cfg.width < 1 or cfg.repeats < 1:
        raise LabkitError(f"batch_mib, width and repeats must be positive, got {cfg.batch_mib}, {cfg.width}, "
                          f"{cfg.repeats}")
    if cfg.matmuls is not None and cfg.matmuls < 1:
        raise LabkitError(f"matmuls must be at least 1 (or None to balance), got {cfg.matmuls}")


class _Timer:
    """Elapsed seconds of a block: CUDA events on the current stream on a GPU, perf_counter on a CPU."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def _compute(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    for _ in range(k):
        x = torch.tanh(x @ w)  # tanh keeps values bounded however many matmuls run
    return x.sum()


def _serial(host, w, k, dev):
    total = torch.zeros((), device=dev)
    for h in host:
        total += _compute(h.to(dev), w, k)  # pageable: the copy blocks the host until it is done
    return total


def _pinned_same_stream(host, w, k, dev):
    total = torch.zeros((), device=dev)
    for h in host:
        total += _compute(h.to(dev, non_blocking=True), w, k)  # asynchronous, but queued behind the compute
    return total


def _overlapped(host, w, k, dev, bufs):
    if dev.type != "cuda":  # no side stream on a CPU: the same loop, in order
        return _pinned_same_stream(host, w, k, dev)
    main, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    copied = [torch.cuda.Event() for _ in bufs]  # buffer i holds its batch
    free = [torch.cuda.Event() for _ in bufs]  # compute has finished reading buffer i
    total = torch.zeros((), device=dev)
    for e in free:
        e.record(main)

    def prefetch(i):
        j = i % len(bufs)
        with torch.cuda.stream(side):
            side.wait_event(free[j])  # never overwrite a buffer the compute is still reading
            bufs[j].copy_(host[i], non_blocking=True)
            copied[j].record(side)

    prefetch(0)
    for i in range(len(host)):
        if i + 1 < len(host):
            prefetch(i + 1)  # the next copy starts now, while batch i computes
        j = i % len(bufs)
        main.wait_event(copied[j])
        total += _compute(bufs[j], w, k)
        free[j].record(main)
    return total


def _balance(host, w, dev) -> int:
    """Matmuls per batch that make compute take about as long as copying one batch (pinned, same stream)."""
    x = host[0].to(dev)
    _compute(x, w, 1)
    with _Timer(dev) as c:
        host[0].to(dev, non_blocking=True)
    with _Timer(dev) as m:
        _compute(x, w, 1)
    return max(1, round(c.seconds / max(m.seconds, 1e-9)))


def copy_compute_overlap(device=None, cfg: OverlapConfig = OverlapConfig()) -> dict:
    """Time the three ways of feeding batches (`MODES`) through the same compute; per-batch times in seconds.

    Returns {"device", "cuda", "config", "matmuls", "batch_bytes", "copy_s" and "compute_s" (one batch each,
    alone), "serial_s", "pinned_s", "overlap_s" (per batch, median of `repeats` passes), "speedup" (serial /
    overlap), "ideal_speedup" ((copy + compute) / max(copy, compute)), "same_result" (all three computed the same
    sums), "note"}. On a CPU it runs a tiny version (0.25 MiB batches, width at most 128) and says so in "note".
    """
    _check(cfg)
    dev = pick_device(device or "cpu")
    cuda = dev.type == "cuda"
    mib = cfg.batch_mib if cuda else min(cfg.batch_mib, 0.25)
    width = cfg.width if cuda else min(cfg.width, 128)
    rows = max(1, int(mib * 2**20) // (4 * width))
    g = torch.Generator().manual_seed(0)
    pageable = [torch.randn(rows, width, generator=g) for _ in range(cfg.batches)]
    pinned = [h.pin_memory() for h in pageable] if cuda else pageable
    w = (torch.randn(width, width, generator=g) / width**0.5).to(dev)
    bufs = [torch.empty(rows, width, device=dev) for _ in range(2)]
    k = cfg.matmuls or _balance(pinned, w, dev)
    runs = {"serial": lambda: _serial(pageable, w, k, dev),
            "pinned": lambda: _pinned_same_stream(pinned, w, k, dev),
            "overlap": lambda: _overlapped(pinned, w, k, dev, bufs)}
    times, sums = {m: [] for m in MODES}, {}
    for rep in range(cfg.repeats + 1):  # the first pass warms up (allocator, kernels, pinned pages)
        for mode in MODES:  # interleaved, so drift hits every mode alike
            with _Timer(dev) as t:
                sums[mode] = float(runs[mode]())
            if rep:
                times[mode].append(t.seconds / cfg.batches)
    with _Timer(dev) as c:
        pinned[0].to(dev, non_blocking=True)
    bufs[0].copy_(pinned[0])
    with _Timer(dev) as m:
        _compute(bufs[0], w, k)
    per = {mode: statistics.median(v) for mode, v in times.items()}
    same = all(abs(s - sums["serial"]) <= 1e-4 * max(1.0, abs(sums["serial"])) for s in sums.values())
    note = ("measured on CUDA: copies on a side stream from pinned buffers, events between the streams" if cuda else
            "CPU: a tiny version of the same loops; there is no copy engine or side stream here, so the three "
            "modes cost about the same. The overlap needs CUDA (see the recorded run).")
    return {"device": str(dev), "cuda": cuda, "config": asdict(cfg), "matmuls": k, "batch_bytes": rows * width * 4,
            "copy_s": c.seconds, "compute_s": m.seconds, **{f"{mode}_s": per[mode] for mode in MODES},
            "speedup": per["serial"] / per["overlap"],
            "ideal_speedup": (c.seconds + m.seconds) / max(c.seconds, m.seconds, 1e-12),
            "same_result": same, "note": note}


def overlap_summary(r: dict) -> str:
    """A few lines: per-batch copy and compute alone, the three modes, and the speedup against the ideal."""
    ms = lambda s: f"{1e3 * s:.3f} ms"  # noqa: E731
    lines = [f"{r['device']}: batches of {r['batch_bytes'] / 2**20:.2f} MiB, {r['matmuls']} matmul(s) each",
             f"  alone, per batch: copy {ms(r['copy_s'])}, compute {ms(r['compute_s'])}"]
    for mode, what in (("serial", "pageable copy, then compute"), ("pinned", "pinned copy, same stream"),
                       ("overlap", "pinned copy on a side stream")):
        lines.append(f"  {mode:<8} {ms(r[f'{mode}_s']):>12} per batch   ({what})")
    if r["cuda"]:
        lines.append(f"  serial / overlap: {r['speedup']:.2f}x   (ideal for these two times: "
                     f"{r['ideal_speedup']:.2f}x)   same results: {r['same_result']}")
    else:  # nothing overlaps on a CPU: a ratio here would only show the noise of a shared machine
        lines.append(f"  same results: {r['same_result']}\n  {r['note']}")
    return "\n".join(lines)

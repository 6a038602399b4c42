"""Holistic Trace Analysis (HTA, the PyTorch trace-analysis library) read beside labkit's own trace parsing.

An optional extra (pip install 'labkit[hta]'): nothing in labkit needs it, and every function here says so
with a clear LabkitError (or None from `version`) where it is missing.

- `version()`: HTA's version, or None where it is not importable.
- `hta_summary(trace_file)`: what HTA measures on one trace: its temporal breakdown (GPU idle / compute /
  non-compute shares of its kernel span), its idle-time breakdown (GPU idle time split into host wait, kernel
  wait and other) and its kernel-launch statistics (launch delay, launch-call time, kernel length).
- `idle_split(trace_file)`: the one quantity HTA measures that labkit's own parsing does not: whether each GPU
  idle gap opened because the host launched the next kernel late (host wait: its launch call began after the
  previous kernel ended) or with the next kernel already queued (kernel wait: under 30 us between kernels;
  other: longer, e.g. a wait on an event). labkit charges every gap to what the host was doing; HTA's per-kernel
  launch correlation says whether the host was late at all. `labkit.diagnosis.diagnose(..., hta=True)` adds it
  as evidence.
- `compare(ours, theirs)`: the per-quantity cross-check that benchmarks/trace_corpus.py --hta records.

HTA reads a trace file, so a trace dict is written to a temporary file first. Its time unit is the trace's:
microseconds. It drops the last profiler step by default; here it is kept (include_last_profiler_step=True) so
that both tools read the same steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
from pathlib import Path

from labkit.errors import LabkitError

KERNEL_WAIT_US = 30       # HTA's default: gaps between queued kernels under this are launch latency
LAUNCH_BOUND_DELAY_US = 50.0  # median launch-to-start delay below which kernels start as soon as launched
IDLE_AGREE = 0.10         # GPU idle shares within this count as agreeing
EXACT_AGREE = 0.01        # ... and for HTA's reading without its rounding, which parses the same times
KERNEL_AGREE = 0.25       # mean kernel lengths within this fraction (or 0.5 us) count as agreeing
COMPUTE_IDLE = 0.30       # below this GPU idle share a trace reads as GPU-bound to either tool
NS_ROUNDING_ENV = "HTA_DISABLE_NS_ROUNDING"
HOST_CAUSES = ("data", "sync", "overhead")  # labkit causes that HTA sees only as "host wait"


def version() -> str | None:
    """HTA's installed version (a string), or None where `hta` is not importable."""
    try:
        import hta  # noqa: F401
    except ImportError:
        return None
    from importlib import metadata

    try:
        return metadata.version("HolisticTraceAnalysis")
    except metadata.PackageNotFoundError:
        return "unknown"


def _require() -> str:
    v = version()
    if v is None:
        raise LabkitError("Holistic Trace Analysis is not installed: pip install 'labkit[hta]' (it is optional; "
                          "labkit.diagnosis works without it)")
    return v


@contextlib.contextmanager
def _trace_file(source):
    """A path HTA can read: the file itself, or a trace dict written to a temporary file."""
    if isinstance(source, dict):  # written here, not by labkit.diagnosis, which imports this module
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            path.write_text(json.dumps(source, separators=(",", ":")))
            yield path.resolve()
        return
    if not isinstance(source, (str, os.PathLike)):
        raise LabkitError(f"HTA reads a trace file or a trace dict, not {type(source).__name__}")
    p = Path(source)
    if not p.is_file():
        raise LabkitError(f"no trace file at {p}")
    yield p.resolve()


def _analysis(path: Path, exact: bool = False):
    """HTA's TraceAnalysis of one trace as rank 0, last profiler step kept, its progress messages silenced.
    `exact` turns off HTA's rounding of fractional-microsecond times (its HTA_DISABLE_NS_ROUNDING switch)."""
    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)
    old = os.environ.get(NS_ROUNDING_ENV)
    os.environ[NS_ROUNDING_ENV] = "1" if exact else "0"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return TraceAnalysis(trace_files={0: str(path)}, trace_dir=str(path.parent),
                                 include_last_profiler_step=True)
    finally:
        if old is None:
            os.environ.pop(NS_ROUNDING_ENV, None)
        else:
            os.environ[NS_ROUNDING_ENV] = old


def _temporal(ta) -> dict:
    """HTA's temporal breakdown as shares of its kernel span (first kernel start to last kernel end, us). HTA
    0.5.0 asserts on some traces (its merged compute time exceeds its merged kernel time by a few us, from
    rounding ns timestamps to us); there the idle share comes from the same HTA helper its breakdown uses."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis

    try:
        row = ta.get_temporal_breakdown(visualize=False).iloc[0]
        span = max(float(row["kernel_time(us)"]), 1e-9)
        return {"span_us": span, "idle_share": float(row["idle_time(us)"]) / span,
                "compute_share": float(row["compute_time(us)"]) / span,
                "non_compute_share": float(row["non_compute_time(us)"]) / span}
    except AssertionError as e:
        df = ta.t.get_trace(0)
        idle, span = BreakdownAnalysis._get_idle_time_for_kernels(df[df["stream"].ne(-1)].copy())
        return {"span_us": float(span), "idle_share": float(idle) / max(float(span), 1e-9),
                "compute_share": None, "non_compute_share": None,
                "error": f"get_temporal_breakdown raised AssertionError {e}".strip()}


def _idle_breakdown(ta) -> dict:
    """HTA's GPU idle time (us) per category, summed over streams, and each category's share of it."""
    df, _ = ta.get_idle_time_breakdown(visualize=False, consecutive_kernel_delay=KERNEL_WAIT_US)
    by_cat = df.groupby("idle_category")["idle_time"].sum()
    total = float(by_cat.sum())
    us = {c: float(by_cat.get(c, 0.0)) for c in ("host_wait", "kernel_wait", "other")}
    return {"idle_us": total, "split": {c: (v / total if total else 0.0) for c, v in us.items()},
            "streams": int(df["stream"].nunique())}


def _launch_stats(ta) -> dict:
    """HTA's launch statistics: per launched kernel, the launch call's time, the kernel's time and the delay
    from the end of the launch call to the kernel's start (us), as medians, with the share of kernels shorter
    than their own launch call (a kernel that cannot pay for its launch)."""
    df = ta.get_cuda_kernel_launch_stats(visualize=False)[0]
    if df.empty:
        return {"kernels": 0}
    trace, sym = ta.t.get_trace(0), ta.t.symbol_table.get_sym_table()
    kernels = trace[trace["cat"].isin([i for i, name in enumerate(sym) if name == "kernel"])]
    return {"kernels": int(len(df)), "mean_kernel_us": float(kernels["dur"].mean()),
            "median_launch_delay_us": float(df["launch_delay"].median()),
            "median_launch_call_us": float(df["cpu_duration"].median()),
            "median_kernel_us": float(df["gpu_duration"].median()),
            "shorter_than_launch_share": float((df["gpu_duration"] < df["cpu_duration"]).mean())}


def hta_summary(source, exact: bool = False) -> dict:
    """HTA's reading of one trace (file or dict): {"version", "temporal": {span_us, idle_share, compute_share,
    non_compute_share}, "idle": {idle_us, split: {host_wait, kernel_wait, other} (shares of GPU idle time),
    streams}, "launch": {kernels, mean_kernel_us, median_launch_delay_us, median_launch_call_us,
    median_kernel_us, shorter_than_launch_share}}. By default HTA rounds each event's start up and its end down
    to whole microseconds (against overlaps in ns-resolution traces), which shortens every kernel by about
    1 us; `exact=True` reads the trace's own times. Raises LabkitError where HTA is not installed."""
    v = _require()
    with _trace_file(source) as path:
        ta = _analysis(path, exact)
        with contextlib.redirect_stdout(io.StringIO()):
            return {"version": v, "temporal": _temporal(ta), "idle": _idle_breakdown(ta),
                    "launch": _launch_stats(ta)}


def idle_split(source) -> dict | None:
    """HTA's split of the GPU's idle time into host wait / kernel wait / other (shares of idle time, adding up
    to 1) and HTA's median launch delay (us); None where HTA is not installed or the trace has no GPU kernels."""
    if version() is None:
        return None
    s = hta_summary(source, exact=True)  # rounding to whole us would turn microsecond kernels into gaps
    if not s["launch"].get("kernels"):
        return None
    return {"version": s["version"], **s["idle"]["split"],
            "median_launch_delay_us": s["launch"]["median_launch_delay_us"]}


def _hta_reading(theirs: dict) -> str:
    """What HTA's numbers alone say the step is bound by: "compute" (GPU busy), "host" (the GPU waited for the
    host to launch: data, sync and launch/Python all look alike to HTA), or "kernel wait" / "other"."""
    if theirs["temporal"]["idle_share"] < COMPUTE_IDLE:
        return "compute"
    split = theirs["idle"]["split"]
    return max(split, key=split.get).replace("host_wait", "host").replace("kernel_wait", "kernel wait")


def compare(ours: dict, theirs: dict, exact: dict | None = None) -> list[dict]:
    """Cross-check labkit's evidence (`Diagnosis.evidence`) against `hta_summary` (and, given, its `exact=True`
    reading), quantity by quantity: each {"quantity", "ours", "theirs", "agree", "why"} ("why" only where they
    disagree; shares are fractions)."""
    idle_o, idle_t = ours["gpu_idle_share"], theirs["temporal"]["idle_share"]
    shares = ours["cause_shares"]
    top = max(shares, key=shares.get)
    rows = [{"quantity": "GPU idle share", "ours": round(idle_o, 4), "theirs": round(idle_t, 4),
             "agree": abs(idle_o - idle_t) <= IDLE_AGREE}]
    if not rows[0]["agree"]:
        rows[0]["why"] = _WINDOWS
    if exact is not None:
        rows.append({"quantity": "GPU idle share, HTA without its us rounding", "ours": round(idle_o, 4),
                     "theirs": round(exact["temporal"]["idle_share"], 4),
                     "agree": abs(idle_o - exact["temporal"]["idle_share"]) <= EXACT_AGREE})
        if not rows[-1]["agree"]:
            rows[-1]["why"] = _WINDOWS
    reading = _hta_reading(theirs)
    ours_side = "compute" if top == "compute" else "host"
    rows.append({"quantity": "bound by", "ours": top, "theirs": reading, "agree": ours_side == reading})
    if not rows[-1]["agree"]:
        rows[-1]["why"] = _why_bound(top, reading, theirs)
    host_idle = sum(ours["idle_by_cause"][c] for c in HOST_CAUSES) / max(idle_o, 1e-9)
    hw = theirs["idle"]["split"]["host_wait"]
    if idle_o >= COMPUTE_IDLE:  # on a busy GPU the idle split is a few bubbles either way
        rows.append({"quantity": "share of GPU idle time the host caused", "ours": round(host_idle, 4),
                     "theirs": round(hw, 4), "agree": abs(host_idle - hw) <= IDLE_AGREE})
        if not rows[-1]["agree"]:
            rows[-1]["why"] = ("labkit charges every idle gap to what the host was doing; HTA counts a gap as host "
                               "wait only where the next kernel's launch call began after the previous kernel "
                               "ended, and the rest as kernel wait (queued, under 30 us apart) or other")
    mean_o, mean_t = ours["mean_kernel_us"], theirs["launch"].get("mean_kernel_us")
    if mean_t is not None:
        rows.append({"quantity": "mean kernel length, us", "ours": round(mean_o, 2), "theirs": round(mean_t, 2),
                     "agree": abs(mean_o - mean_t) <= max(0.5, KERNEL_AGREE * mean_o)})
        if not rows[-1]["agree"]:
            rows[-1]["why"] = ("HTA rounds each event's start up and its end down to whole microseconds (its guard "
                               "against overlapping ns-resolution events), so every kernel loses about 1 us and some "
                               "come out at 0 or -1 us; labkit reads each kernel's own duration, and HTA without that "
                               "rounding (HTA_DISABLE_NS_ROUNDING=1) reads the same mean as labkit")
    delay = theirs["launch"].get("median_launch_delay_us")
    if delay is not None:
        launch_bound = delay <= LAUNCH_BOUND_DELAY_US
        rows.append({"quantity": "kernels start as soon as launched (host-limited)", "ours": top in HOST_CAUSES,
                     "theirs": launch_bound, "agree": launch_bound == (top in HOST_CAUSES),
                     "theirs_median_launch_delay_us": delay})
        if not rows[-1]["agree"]:
            rows[-1]["why"] = ("HTA's median launch delay counts every kernel of the step alike; where the host "
                               "waits (data, sync) between bursts that each run ahead of the GPU, most kernels "
                               "queue behind others and the median delay is long although the step is host-bound")
    return rows


_WINDOWS = ("the windows differ: ours runs from the first recorded GPU work to the end of the last step or its last "
            "kernel, whichever is later (a step that ends waiting for its next batch keeps that wait), HTA's from "
            "the first kernel's start to the last kernel's end")


def _why_bound(top: str, reading: str, theirs: dict) -> str:
    if reading == "compute":
        return (f"HTA finds the GPU idle only {theirs['temporal']['idle_share']:.0%} of its kernel span, which "
                f"ends at the last kernel; labkit ranks {top} first over its own window")
    if top == "compute":
        return (f"HTA finds the GPU idle {theirs['temporal']['idle_share']:.0%} of its kernel span, mostly "
                f"{reading}; labkit ranks GPU busy time first")
    return f"HTA reads the idle time as {reading}, which labkit has no cause for; labkit ranks {top} first"

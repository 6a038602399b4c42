"""Name what a training step's time goes to, from any torch.profiler trace, with the evidence behind it.

- `diagnose(trace or profile)` -> `Diagnosis`: the causes of the step time ranked with their shares
  ("data" loading, "sync" (host synchronization), "overhead" (CPU/launch: Python and kernel launches), "compute"
  (the GPU's own work; "compute bound" on a CPU)), each with its evidence and the fix that targets it. `kind` is
  the top cause; `dominant` says whether it stands alone (at least DOMINANCE times the next); `verdict` is one
  line: "synchronization bound", or "mixed: sync 55%, launch/Python 30%".
- `trace_stats(trace)`: the per-step numbers it decides from; `breakdown` / `plot_breakdown` for a chart.
- `load_trace` / `save_trace`: Chrome/Perfetto traces, gzipped, with clear errors for bad files.
`labkit.profiling` records the traces (and re-exports these names).

It reads signals that every PyTorch trace has; labkit's phase labels (data / forward / backward / optimizer)
sharpen the picture but are never required:
- data: DataLoader's own annotation, `enumerate(DataLoader)#<iterator>.__next__`, on the stepping thread: the
  loop waiting for its next batch (the loading itself with num_workers=0, the wait on the worker queue
  otherwise); labkit's `data` label counts the same way.
- sync: host calls that block until the GPU catches up (cudaStreamSynchronize, cudaDeviceSynchronize,
  cudaEventSynchronize, blocking cudaMemcpy), the host reads behind them (`aten::item` /
  `aten::_local_scalar_dense`: .item(), float(t), `if t:`; on a GPU only reads of device values, those with a
  copy or sync inside) and device-to-host copies.
- launch/Python: kernel count, launch-call time and mean kernel length, and host time in no torch operator
  (neither on the stepping thread nor, during backward, on autograd's thread).
- compute: the share of the step the GPU runs kernels or copies, and how much kernel time is on tensor cores;
  where `labkit.profiling` read the card's clock and power through the active steps (the trace's
  labkit.gpu_power, `labkit.gpu_power`), whether it ran at its power limit.

How the shares are made. On a GPU the step's wall time is split along the GPU timeline: busy time is compute;
each idle gap is charged to what the host was doing meanwhile: waiting for data (the overlap with data
waits), coming back from a sync (the host was inside a sync call when the GPU ran dry, so nothing was queued),
or else launching and running Python. The four shares add up to 1. The sync share is meant as the honest
counterfactual "what would taking the reads out buy": at least the host's time inside the reads (`read_share`),
at most every gap between them. A gap that opens while the host sits in a sync had nothing queued behind it
because of the sync; a gap that opens while the host is launching would open without the sync too, when the
host is slower than the GPU everywhere (then the run is launch bound, syncs or not, and ranks so). A wait of
DATA_IDLE_LIMIT or more on a background loader (worker processes, or labkit's `data` label where the trace does
not say the loading runs in the step's thread) ranks first whatever the others: that loader is the slowest stage of a pipeline, so speeding up anything else only lengthens the wait. With num_workers=0 the
loading is serial work like the rest and ranks by its share. On a CPU there is no queue: the step splits into
data, time in operators of SMALL_OP_US or more (compute) and the rest (Python, dispatch, tiny operators;
a best effort: microsecond timings on a busy machine are noisy).
Holistic Trace Analysis splits GPU idle time by its own rules (host wait, kernel wait, other) and knows no
data or sync cause; `diagnose(..., hta=True)` adds its split as evidence where it is installed (labkit[hta],
`labkit.hta`), and `benchmarks/trace_corpus.py --hta` cross-checks the two over the corpus.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import tempfile
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.env import LabkitError

PHASES = ("data", "forward", "backward", "optimizer", "metrics")
COMPUTE_PHASES = ("forward", "backward", "optimizer")
KINDS = {
    "data": "data-loading bound",
    "overhead": "CPU/launch bound",
    "sync": "synchronization bound",
    "compute": "GPU compute bound",
}
CAUSES = {"data": "data", "sync": "sync", "overhead": "launch/Python", "compute": "compute"}  # short names
DATALOADER_PREFIX = "enumerate(DataLoader)#"  # torch.utils.data's own profiler annotation of __next__
# Host calls that block until the device catches up. cudaMemcpy (not ...Async) waits for the stream.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::item")  # .item(), int(t), float(t), bool(t), if t: ...
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"  # backward's operators, on autograd's device thread
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
GPU_IDLE_LIMIT = 0.30      # GPU idle share below which "faster loading will not help" notes apply
DATA_IDLE_LIMIT = 0.15     # GPU idle share waiting on a background loader that ranks the loader first
SMALL_OP_US = 20.0
SYNC_TOLERANCE_US = 20.0   # host and device clocks in a trace agree to within a few microseconds
DOMINANCE = 2.0            # the top cause is the single verdict when its share is at least this times the next
NOTE_SHARE = 0.10          # other causes at this share of the step or more are listed as next in line
POWER_CAP_SHARE = 0.5      # readings with the driver's power-cap reason set, above which the card is power-bound

FIXES = {
    "data": "Feed the step faster than it eats: a DataLoader worker per core, pin_memory=True with non_blocking "
            "copies, persistent_workers and prefetch; better, packed uint8 arrays with batched augmentation on "
            "the GPU instead of per-sample Python transforms (week 4).",
    "overhead": "Give each kernel more work and launch fewer: a larger batch, a fused or foreach optimizer "
                "(fused=True), torch.compile to fuse elementwise operators, CUDA graphs (mode='reduce-overhead') "
                "to launch the whole step at once; no Python loops over tensors inside the step.",
    "sync": "Take host reads out of the step: keep losses and metrics on the device (accumulate detached "
            "tensors), read them every N steps or at the end; no .item(), .cpu(), print(tensor) or `if tensor:` "
            "in the loop. torch.cuda.set_sync_debug_mode('warn') points at every remaining sync.",
    "compute_cuda_cores": "The GPU is the limit and its matmuls run on CUDA cores: bf16 autocast (or TF32 for "
                          "fp32), channels_last, dimensions that are multiples of 8; then fuse elementwise work "
                          "with torch.compile. Compare MFU with the measured peak to know the headroom.",
    "compute_tensor_cores": "The GPU is the limit and already runs on tensor cores: fuse elementwise kernels "
                            "(torch.compile), cut memory traffic (channels_last, fused optimizer), or do less work; "
                            "compare MFU with the measured peak to know the headroom.",
    "compute_cpu": "The arithmetic itself is the limit on this CPU: on a GPU it would move to tensor cores "
                   "(bf16 autocast); on the CPU only fewer FLOPs (a smaller model or batch) or more cores help.",
}
# added to the compute fix when the card ran at its power limit (benchmarks/results/ladder/step_power_h200.json)
POWER_FIX = (" The card ran at its power limit, so its clock sank to keep within the watts: a change that only "
             "shortens kernels at full clock gains less or nothing; spending fewer joules per image still pays "
             "(fewer bytes moved, fewer or cheaper multiplications).")


def save_trace(trace: dict, path: str | os.PathLike) -> Path:
    """Write a Chrome trace as gzipped JSON (what Perfetto and chrome://tracing open); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def load_trace(path: str | os.PathLike) -> dict:
    """Read a torch.profiler Chrome trace (.json or .json.gz), with a clear LabkitError for a bad file."""
    p = Path(path)
    if not p.exists():
        raise LabkitError(f"no trace file at {p}: record one with labkit profile --out DIR (or profile_steps)")
    if p.is_dir():
        found = sorted(p.glob("*.json.gz")) + sorted(p.glob("*.json"))
        if len(found) != 1:
            raise LabkitError(f"{p} is a folder with {len(found)} trace files: name one of them")
        p = found[0]
    try:
        with open(p, "rb") as f:
            magic = f.read(2)
        opener = gzip.open if magic == b"\x1f\x8b" else open
        with opener(p, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise LabkitError(f"trace {p} is truncated or not valid gzip ({type(e).__name__}): record it again") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LabkitError(f"trace {p} is not complete JSON ({e}): the file was cut short or is not a trace; "
                          f"record it again") from e
    _check_trace(trace, str(p))
    return trace


def _check_trace(trace, where: str) -> None:
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise LabkitError(f"{where} is JSON but not a torch.profiler Chrome trace (no 'traceEvents' list)")
    cats = {e.get("cat") for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"}
    if not cats & {"cpu_op", "user_annotation", "kernel"}:
        raise LabkitError(f"{where} has no profiler events (no operators, annotations or kernels): "
                          f"was it recorded with torch.profiler?")




# ---------------------------------------------------------------------------------------------- intervals


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _overlap(merged: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi] covered by `merged` (sorted, disjoint)."""
    i = max(0, bisect.bisect_right(merged, (lo, float("inf"))) - 1)
    total = 0.0
    while i < len(merged) and merged[i][0] < hi:
        a, b = merged[i]
        total += max(0.0, min(b, hi) - max(a, lo))
        i += 1
    return total


def _overlap_all(merged, lo: float, hi: float) -> float:
    return _overlap(merged, lo, hi) if merged else 0.0


def _spans(events) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def _gaps(merged, lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of [lo, hi] that `merged` (sorted, disjoint) leaves uncovered."""
    out, t = [], lo
    for a, b in merged:
        if a > t:
            out.append((t, min(a, hi)))
        t = max(t, b)
        if t >= hi:
            break
    if t < hi:
        out.append((t, hi))
    return [(a, b) for a, b in out if b > a]


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """(event, self time in us) for CPU operators: duration minus that of the operators nested in it, per thread."""
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, time of its children]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                top = stack.pop()
                out.append((top[0], top[0]["dur"] - top[1]))
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        out += [(ev, ev["dur"] - kids) for ev, kids in reversed(stack)]
    return out


# ------------------------------------------------------------------------------------------- trace stats


@dataclass
class _Window:
    """Where in a trace the step time is measured, and the events every later stage needs."""

    events: list[dict]     # every timed event (ph "X")
    steps: list[dict]      # ProfilerStep markers of the stepping thread (empty without a schedule)
    main: tuple | None     # (pid, tid) of the stepping thread; None without step markers (any thread counts)
    w0: float              # start of the time shares, us (on a GPU: the first recorded GPU activity)
    w1: float              # end of the time shares, us
    h0: float              # host events are counted from here: every recorded step
    a: float               # the unit the shares are taken over: the whole window on a GPU, the median step on a CPU
    b: float
    gpu: list[dict]        # kernels, copies and memsets
    kernels: list[dict]

    @property
    def n_steps(self) -> int:
        return max(1, len(self.steps))

    @property
    def on_gpu(self) -> bool:
        return bool(self.kernels)

    @property
    def span(self) -> float:
        return max(self.w1 - self.w0, 1e-9)

    def on_main(self, e: dict) -> bool:
        return self.main is None or (e.get("pid"), e.get("tid")) == self.main

    def in_window(self, e: dict) -> bool:
        return e["ts"] < self.w1 and e["ts"] + e["dur"] > self.h0

    def share(self, merged) -> float:
        """Share of the unit [a, b] covered by `merged` intervals."""
        return _overlap_all(merged, self.a, self.b) / max(self.b - self.a, 1e-9)


def _timed_events(trace: dict) -> list[dict]:
    X = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
         and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    if not X:
        raise LabkitError("the trace has no timed events (ph 'X' with numeric ts and dur): is it a torch.profiler trace?")
    return X


def _find_window(X: list[dict], notes: list[str]) -> _Window:
    """The steps and the time window: ProfilerStep markers of one thread, stretched to the last GPU work they
    launched; on a GPU the shares start at the first recorded GPU activity."""
    steps = sorted((e for e in X if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    host = [e for e in X if e.get("cat") in HOST_CATS] or X
    if steps:
        main = (steps[0].get("pid"), steps[0].get("tid"))
        steps = [s for s in steps if (s.get("pid"), s.get("tid")) == main]
        w0, w1 = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    else:
        notes.append("no ProfilerStep markers (no schedule): the whole trace counts as one step")
        main = None
        w0, w1 = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    gpu = [e for e in X if e.get("cat") in GPU_CATS]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    h0 = w0
    if kernels:
        late = [e for e in gpu if e["ts"] + e["dur"] > w0]
        w1 = max(w1, max(e["ts"] + e["dur"] for e in late))
        # Kernels launched before the profiler started are not in the trace, yet a host that runs ahead leaves
        # the GPU busy with them for a while: time shares start at the first recorded GPU activity.
        g0 = min(e["ts"] for e in late)
        if g0 - w0 > 0.2 * (w1 - w0):
            notes.append(f"the first recorded GPU work starts {(g0 - w0) / 1e3:.1f} ms into the first step (the host "
                         f"ran ahead, or waited before launching); time shares start there")
        w0 = max(w0, g0)
    # On a CPU the shares come from the step of median length: one step stretched by a preempted thread does
    # not decide, and the shares still add up. On a GPU, work launched in one step runs in the next, so there
    # the whole window is the unit.
    a, b = w0, w1
    if steps and not kernels:
        mid = sorted(steps, key=lambda e: e["dur"])[(len(steps) - 1) // 2]
        a, b = mid["ts"], mid["ts"] + mid["dur"]
    return _Window(X, steps, main, w0, w1, h0, a, b, gpu, kernels)


def _data_waits(win: _Window, notes: list[str], in_thread: bool = False) -> tuple[list[tuple[float, float]], dict]:
    """When the stepping thread waited for its next batch (DataLoader's annotation, labkit's `data` label),
    and what kind of loader that was: its wait is the loading itself with num_workers=0, a queue otherwise.
    `in_thread`: the trace says (labkit.data_loading, which profile_steps writes for a scenario Workload) that
    the `data` label wraps loading done in the step's own thread, like num_workers=0."""
    label = [e for e in win.events if e.get("name") == "data" and e.get("cat") in ("user_annotation", "cpu_op")
             and win.on_main(e)]
    loader = [e for e in win.events if str(e.get("name", "")).startswith(DATALOADER_PREFIX) and win.on_main(e)]
    names = {str(e["name"]) for e in loader}
    kind = None
    if names:
        kind = ("worker processes" if any("MultiProcessing" in n for n in names)
                else "num_workers=0" if any("SingleProcess" in n for n in names) else "unknown")
    if not label and not loader:
        notes.append("no 'data' label and no DataLoader annotation in the trace: time waiting for data cannot be "
                     "separated")
    info = {"label": bool(label), "dataloader": kind,
            # A queue filled by other processes (or labkit's label, unless the trace says the loading runs in
            # the step's thread) is a pipeline stage.
            "background": kind == "worker processes" or (bool(label) and kind is None and not in_thread)}
    if in_thread and label and kind is None:
        info["dataloader"] = "in the step's thread"
    return _union(_clip(_spans(label + loader), win.w0, win.w1)), info


def _phase_shares(win: _Window, data_iv) -> tuple[dict, dict]:
    """labkit's phase labels as intervals on the stepping thread ("data" also from DataLoader), and their shares."""
    phase_iv = {"data": data_iv}
    for ph in PHASES[1:]:
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in win.events if e.get("name") == ph
              and e.get("cat") in ("user_annotation", "cpu_op") and win.on_main(e)]
        phase_iv[ph] = _union(_clip(iv, win.w0, win.w1))
    shares = {ph: win.share(iv) for ph, iv in phase_iv.items()}
    labelled = _union([x for iv in phase_iv.values() for x in iv])
    shares["other"] = max(0.0, 1 - win.share(labelled))
    return phase_iv, shares


def _host_signals(win: _Window) -> dict:
    """Operators, runtime calls, syncs, launches, host reads and device-to-host copies in the window."""
    ops = [e for e in win.events if e.get("cat") == "cpu_op" and win.in_window(e)]
    runtime = [e for e in win.events if e.get("cat") in ("cuda_runtime", "cuda_driver") and win.in_window(e)]
    main_ops = [e for e in ops if win.on_main(e)]
    reads = ([e for e in main_ops if e.get("name") == HOST_READ_OPS[0]]
             or [e for e in main_ops if e.get("name") == HOST_READ_OPS[1]])
    if win.on_gpu:
        # Reading a CPU scalar (a non-fused optimizer's step count, a counter kept in a tensor) costs nothing;
        # reading a device value copies it back and waits for the stream, inside the read's own call.
        waits = _union(_spans(e for e in runtime if win.on_main(e) and (e.get("name") in SYNC_CALLS
                                                                          or e.get("name") == "cudaMemcpyAsync")))
        reads = [e for e in reads if _overlap_all(waits, e["ts"], e["ts"] + e["dur"]) > 0]
    # backward() runs on autograd's own thread while the stepping thread waits in it: that thread is in torch too.
    autograd = {(e.get("pid"), e.get("tid")) for e in ops if str(e.get("name", "")).startswith(AUTOGRAD_PREFIX)
                and (win.main is None or e.get("pid") == win.main[0])}
    return {
        "ops": ops,
        # Syncs and reads that stall training are the stepping thread's (a pin-memory thread has its own).
        "syncs": [e for e in runtime if e.get("name") in SYNC_CALLS and win.on_main(e)],
        "launches": [e for e in runtime if "Launch" in str(e.get("name", ""))],
        "reads": reads,
        "dtoh": [e for e in win.gpu if e.get("cat") == "gpu_memcpy" and "dtoh" in str(e.get("name", "")).lower()
                 and win.in_window(e)],
        # Where the step is inside torch (an operator or a runtime call of the stepping thread, or of autograd's
        # thread during backward): elsewhere the stepping thread runs Python.
        "in_torch": _union(_spans(e for e in ops + runtime
                                  if win.on_main(e) or (e.get("pid"), e.get("tid")) in autograd)),
    }


def _subtract(intervals, minus) -> list[tuple[float, float]]:
    out = []
    for a, b in intervals:
        out += _gaps(_clip(minus, a, b), a, b)
    return out


def _operator_split(win: _Window, ops, phase_iv) -> tuple[list, float]:
    """Self times of the operators, and the share of compute time NOT spent in operators that last
    SMALL_OP_US or more (Python, dispatch, tiny operators). Compute time: labkit's forward/backward/optimizer
    labels where present, else the step minus its data waits."""
    comp = _union([x for ph in COMPUTE_PHASES for x in phase_iv[ph]])
    if not comp:
        comp = _subtract([(win.w0, win.w1)], phase_iv["data"])
    rows = _self_times(ops)
    c = _clip(comp, win.a, win.b)
    heavy = sum(s for e, s in rows if s >= SMALL_OP_US and win.a <= e["ts"] < win.b
                and _overlap(c, e["ts"], e["ts"] + e["dur"]) > 0)
    return rows, max(0.0, 1 - heavy / max(_length(c), 1e-9))


def _idle_causes(gaps, data_iv, sync_iv, in_torch) -> tuple[dict, float]:
    """Charge each GPU idle gap (us) to what the host did: waited for data, came back from a sync (it was inside
    one when the GPU ran dry, so nothing was queued), or launched and ran Python. Also returns the idle time
    charged to launch/Python during which the host was in no torch operator at all."""
    cause = {"data": 0.0, "sync": 0.0, "overhead": 0.0}
    python = 0.0
    for x0, x1 in gaps:
        d = _overlap_all(data_iv, x0, x1)
        cause["data"] += d
        rest = (x1 - x0) - d
        if _overlap_all(sync_iv, x0 - SYNC_TOLERANCE_US, x0 + SYNC_TOLERANCE_US) > 0:
            cause["sync"] += rest
        else:
            cause["overhead"] += rest
            python += max(0.0, rest - _overlap_all(in_torch, x0, x1))
    return cause, python


def _kernel_stats(win: _Window, sig: dict) -> dict:
    from labkit.matmul import is_tensor_core_kernel

    n = win.n_steps
    k_in = [e for e in win.kernels if win.in_window(e)]
    k_time = sum(e["dur"] for e in k_in)
    tc_of = {name: is_tensor_core_kernel(name)[0] for name in {str(e.get("name", "")) for e in k_in}}
    tc_time = sum(e["dur"] for e in k_in if tc_of[str(e.get("name", ""))] is True)
    mm_time = sum(e["dur"] for e in k_in if tc_of[str(e.get("name", ""))] is not None)
    return {"kernels_per_step": len(k_in) / n, "launches_per_step": len(sig["launches"]) / n,
            "kernel_ms_per_step": k_time / n / 1e3,
            "launch_ms_per_step": sum(e["dur"] for e in sig["launches"]) / n / 1e3,
            "mean_kernel_us": k_time / max(1, len(k_in)),
            "tensor_core_share": tc_time / k_time if k_time else 0.0,
            "matmul_share": mm_time / k_time if k_time else 0.0,
            "top": _top([(str(e.get("name", "")), e["dur"]) for e in k_in], n, k_time, tc=True)}


def _comm_stats(win: _Window) -> dict:
    """Collective kernels (NCCL) run on their own stream; the part of them with no other kernel beside it is
    communication that backward did not hide: the scaling loss of data parallelism."""
    k_in = [e for e in win.kernels if win.in_window(e)]
    comm = [e for e in k_in if "nccl" in str(e.get("name", "")).lower()]
    if not comm:
        return {}
    c_iv = _union(_clip(_spans(comm), win.w0, win.w1))
    other = _union(_clip(_spans(e for e in k_in if "nccl" not in str(e.get("name", "")).lower()), win.w0, win.w1))
    hidden = sum(_overlap_all(other, x0, x1) for x0, x1 in c_iv)
    return {"comm_ms_per_step": _length(c_iv) / win.n_steps / 1e3,
            "comm_exposed_ms_per_step": (_length(c_iv) - hidden) / win.n_steps / 1e3}


def _gpu_stats(win: _Window, sig: dict, data_iv) -> dict:
    busy = _union(_clip(_spans(win.gpu), win.w0, win.w1))
    k_iv = _union(_clip(_spans(win.kernels), win.w0, win.w1))
    cause, python = _idle_causes(_gaps(busy, win.w0, win.w1), data_iv, _union(_spans(sig["syncs"])),
                                 sig["in_torch"])
    st = {"gpu_busy_share": _length(busy) / win.span, "kernel_busy_share": _length(k_iv) / win.span,
          "idle_by_cause": {k: v / win.span for k, v in cause.items()},
          "idle_python_share": python / win.span}
    st["gpu_idle_share"] = 1 - st["gpu_busy_share"]
    return {**st, **_kernel_stats(win, sig), **_comm_stats(win)}


def _cause_shares(st: dict) -> dict[str, float]:
    """Shares of the step per cause, adding up to 1: on a GPU along its timeline, on a CPU data waits, time
    in operators of SMALL_OP_US or more (compute) and the rest (overhead). A CPU has no sync cause."""
    if st["device"] == "cuda":
        return {"compute": st["gpu_busy_share"], **st["idle_by_cause"]}
    d, small = st["data_share"], st["small_op_share"]
    return {"data": d, "overhead": (1 - d) * small, "compute": (1 - d) * (1 - small)}


def trace_stats(trace: dict | str | os.PathLike) -> dict:
    """Per-step numbers from a torch.profiler trace: cause shares, phase shares, GPU busy/idle and its causes,
    syncs, host reads, launches, kernels, tensor-core share, top kernels or operators. Times in ms, shares in
    [0, 1] of the step's wall time. Any torch.profiler trace will do; labkit's labels are optional."""
    if not isinstance(trace, dict):
        trace = load_trace(trace)
    _check_trace(trace, "the trace")
    notes: list[str] = []
    win = _find_window(_timed_events(trace), notes)
    lab = trace.get("labkit") if isinstance(trace.get("labkit"), dict) else {}
    data_iv, data_info = _data_waits(win, notes, in_thread=lab.get("data_loading") == "in-thread")
    phase_iv, phase_share = _phase_shares(win, data_iv)
    sig = _host_signals(win)
    rows, small = _operator_split(win, sig["ops"], phase_iv)
    n = win.n_steps
    st = {
        "device": "cuda" if win.on_gpu else "cpu",
        "steps": len(win.steps) or 1,
        "step_ms": win.span / n / 1e3,
        "phase_share": phase_share,
        "data_share": phase_share["data"],
        "data_wait": data_info,
        "host_reads_per_step": len(sig["reads"]) / n,
        # What taking the reads out of the step buys at the least (more where they drain a queue that would
        # otherwise stay ahead of the GPU): the host's time inside them.
        "read_share": win.share(_union(_spans(sig["reads"]))),
        "syncs_per_step": len(sig["syncs"]) / n,
        "sync_wait_share": _length(_clip(_union(_spans(sig["syncs"])), win.w0, win.w1)) / win.span,
        "dtoh_copies_per_step": len(sig["dtoh"]) / n,
        "python_share": 1 - win.share(_union(sig["in_torch"] + data_iv)),
        "ops_per_step": len(sig["ops"]) / n,
        "small_op_share": small,
        "notes": notes,
    }
    if win.on_gpu:
        st.update(_gpu_stats(win, sig, data_iv))
        # the card's clock and power over the active steps, where labkit.profiling read them (labkit.gpu_power)
        st["gpu_power"] = lab.get("gpu_power")
    else:
        st.update(gpu_busy_share=None, gpu_idle_share=None, idle_by_cause=None, tensor_core_share=None)
        selfs = [(str(e.get("name", "")), s) for e, s in rows if str(e.get("name", "")).startswith("aten::")]
        st["top"] = _top(selfs, n, sum(s for _, s in selfs), tc=False)
    st["cause_shares"] = _cause_shares(st)
    return st


def _top(items: list[tuple[str, float]], n_steps: int, total: float, tc: bool, k: int = 6) -> list[dict]:
    from labkit.matmul import is_tensor_core_kernel

    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, t in items:
        agg[name][0] += t
        agg[name][1] += 1
    rows = []
    for name, (t, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:k]:
        row = {"name": name if len(name) <= 100 else name[:97] + "...", "ms_per_step": t / n_steps / 1e3,
               "calls_per_step": n / n_steps, "share": t / total if total else 0.0}
        if tc:
            row["tensor_core"] = is_tensor_core_kernel(name)[0]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- diagnose


@dataclass
class Diagnosis:
    """What a profiled run's step time goes to, the evidence for it, and the fixes.

    kind: the top cause, "data" | "overhead" | "sync" | "compute" (see KINDS for titles); causes: every cause
    ranked, each {"cause", "name", "title", "share" (of the step's wall time), "evidence", "fix"}; dominant:
    whether the top cause is at least DOMINANCE times the next (else the run is "mixed"); evidence: the numbers
    of `trace_stats` (shares are fractions of the step's wall time; ms per step); reasons: sentences citing the
    numbers that decided; notes: secondary findings; fix: the top cause's fix.
    """

    kind: str
    title: str
    device: str
    reasons: list[str]
    fix: str
    evidence: dict
    notes: list[str] = field(default_factory=list)
    causes: list[dict] = field(default_factory=list)
    dominant: bool = True

    @property
    def verdict(self) -> str:
        """One line: the title where one cause dominates, else the leading causes with their shares."""
        if self.dominant or len(self.causes) < 2:
            return self.title
        shown = [c for c in self.causes if c["share"] >= NOTE_SHARE] or self.causes[:1]
        shown = shown if len(shown) >= 2 else self.causes[:2]
        return "mixed: " + ", ".join(f"{c['name']} {_pct(c['share'])}" for c in shown)

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    def __str__(self) -> str:
        ev = self.evidence
        head = self.verdict if self.dominant else f"{self.verdict} (top: {self.title})"
        lines = [f"{head} ({self.device}: {ev['steps']} steps of {ev['step_ms']:.2f} ms)"]
        if self.causes:
            lines.append("  causes, share of step time: "
                         + ", ".join(f"{c['name']} {_pct(c['share'])}" for c in self.causes))
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  note: {n}" for n in self.notes]
        if ev.get("top"):
            lines.append("  top " + ("kernels" if self.device == "cuda" else "operators (self time)") + ":")
            for r in ev["top"][:5]:
                tc = {True: " [tensor cores]", False: " [CUDA cores]"}.get(r.get("tensor_core"), "")
                lines.append(f"    {100 * r['share']:5.1f}%  {r['ms_per_step']:8.3f} ms/step  {r['name']}{tc}")
        lines.append(f"  fix: {self.fix}")
        if not self.dominant and len(self.causes) > 1:
            second = self.causes[1]
            lines.append(f"  then ({second['name']}, {_pct(second['share'])}): {second['fix']}")
        return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(source, hta: bool = False) -> Diagnosis:
    """Rank what a profiled run's step time goes to: data loading, synchronization, CPU/launch overhead or
    (GPU) compute, each with its share of the step, its evidence and its fix.

    `source`: a `Profile` from `profile_steps`, a trace file (.json / .json.gz from torch.profiler, labkit's or
    anyone's), a parsed trace dict, or a torch.profiler.profile object. Raises LabkitError for a missing,
    truncated or non-profiler trace. The result's `kind` is the top cause ("data", "overhead", "sync",
    "compute"), `causes` the ranking, `verdict` one line; `evidence` holds the numbers.
    `hta=True` adds Holistic Trace Analysis's split of the GPU's idle time (evidence "hta", see `_add_hta`)
    where HTA is installed, a note where it is not; the ranking is the same either way.
    """
    if isinstance(getattr(source, "trace", None), dict):  # a labkit.profiling.Profile
        trace = source.trace
    elif isinstance(source, dict):
        trace = source
    elif isinstance(source, (str, os.PathLike)):
        trace = load_trace(source)
    elif hasattr(source, "export_chrome_trace"):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "trace.json")
            source.export_chrome_trace(p)
            trace = load_trace(p)
    else:
        raise LabkitError(f"diagnose needs a Profile, a trace file or a trace dict, not {type(source).__name__}")
    st = trace_stats(trace)
    d = _decide_gpu(st) if st["device"] == "cuda" else _decide_cpu(st)
    return _add_hta(d, trace) if hta else d


def _add_hta(d: Diagnosis, trace: dict) -> Diagnosis:
    """HTA's per-kernel reading of the GPU's idle time beside ours (optional: labkit[hta]). Ours charges each gap
    to what the host was doing; HTA says whether the host was late at all (host wait: the next kernel's launch
    began after the previous kernel ended) or the next kernel was already queued (kernel wait). Where the GPU
    idles with work queued, the launch/Python share is gaps between kernels that a faster host would not close."""
    from labkit import hta

    if d.device != "cuda":
        return d
    split = hta.idle_split(trace)
    if split is None:
        d.notes.append("hta=True: Holistic Trace Analysis is not installed (pip install 'labkit[hta]'); "
                       "diagnosed without it")
        return d
    d.evidence["hta"] = split
    text = (f"Holistic Trace Analysis {split['version']}: of the GPU's idle time {_pct(split['host_wait'])} host "
            f"wait (the next kernel launched after the last one ended), {_pct(split['kernel_wait'])} kernel wait "
            f"(queued, under {hta.KERNEL_WAIT_US} us apart), {_pct(split['other'])} other; median launch delay "
            f"{split['median_launch_delay_us']:.0f} us")
    d.notes.append(text)
    overhead = next((c for c in d.causes if c["cause"] == "overhead"), None)
    if overhead is not None and overhead["share"] >= NOTE_SHARE and split["host_wait"] < 0.5:
        d.notes.append(f"most of the launch/Python share ({_pct(overhead['share'])}) is gaps between kernels that "
                       f"were already queued: fewer, larger kernels (torch.compile, CUDA graphs) close them, a "
                       f"faster host does not")
    return d


def _rank(shares: dict[str, float], first: str | None = None) -> list[str]:
    """Causes by share, largest first (ties in KINDS order); `first` goes to the front whatever its share."""
    order = sorted(shares, key=lambda k: (-shares[k], list(KINDS).index(k)))
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    return order


def _is_dominant(order: list[str], shares: dict[str, float]) -> bool:
    rest = [shares[k] for k in order[1:]]
    return not rest or shares[order[0]] >= DOMINANCE * max(rest)


def _data_source(st: dict) -> str:
    dw = st["data_wait"]
    if dw["dataloader"] == "num_workers=0":
        return "DataLoader with num_workers=0: the loading itself runs in the step's thread"
    if dw["dataloader"] == "worker processes":
        return "DataLoader workers: the step waits on their queue"
    if dw["dataloader"] == "in the step's thread":
        return "labkit's 'data' label, over loading done in the step's own thread"
    return "labkit's 'data' label" if dw["label"] else "DataLoader"


def _gpu_evidence(st: dict) -> dict[str, str]:
    c = st["idle_by_cause"]
    return {
        "data": (f"the loop waited for its next batch {_pct(st['data_share'])} of the step ({_data_source(st)}), "
                 f"{_pct(c['data'])} of it with the GPU idle"),
        "sync": (f"{st['syncs_per_step']:.0f} host syncs, {st['dtoh_copies_per_step']:.0f} device-to-host copies "
                 f"and {st['host_reads_per_step']:.0f} .item()-style reads of device values per step (the host "
                 f"spent {_pct(st['read_share'])} of the step in them); the host waited in syncs "
                 f"{_pct(st['sync_wait_share'])} of the step and the GPU sat idle after them {_pct(c['sync'])}"),
        "overhead": (f"{st['kernels_per_step']:.0f} kernels per step averaging {st['mean_kernel_us']:.1f} us; launch "
                     f"calls {st['launch_ms_per_step']:.2f} ms vs kernel time {st['kernel_ms_per_step']:.2f} ms per "
                     f"step; the GPU idled {_pct(c['overhead'])} of the step while the host launched or ran Python "
                     f"({_pct(st['idle_python_share'])} with the host in no torch operator at all)"),
        "compute": (f"GPU busy {_pct(st['gpu_busy_share'])} of the step; tensor cores ran "
                    f"{_pct(st['tensor_core_share'])} of kernel time, matmul kernels {_pct(st['matmul_share'])}"),
    }


def _power_limited(st: dict) -> str:
    """The readings in a few words where the power-cap reason was set in most of them, else ''."""
    from labkit.gpu_power import describe
    p = st.get("gpu_power")
    numbers = ("samples", "sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w")
    if not (isinstance(p, dict) and all(isinstance(p.get(k), int | float) for k in numbers)
            and isinstance(p.get("reasons"), dict)):
        return ""  # none read, or not labkit's readings (a trace from elsewhere): no claim either way
    cap = p["reasons"].get("power cap", 0.0)
    return describe(p) if isinstance(cap, int | float) and cap >= POWER_CAP_SHARE else ""


def _causes(order, shares, evidence, fixes, titles=KINDS) -> list[dict]:
    return [{"cause": k, "name": CAUSES[k], "title": titles[k], "share": shares[k], "evidence": evidence[k],
             "fix": fixes[k]} for k in order]


def _next_in_line(causes: list[dict]) -> list[str]:
    return [f"next in line after the fix: {c['title']} ({_pct(c['share'])} of the step): {c['evidence']}"
            for c in causes[1:] if c["share"] >= NOTE_SHARE]


def _decide_gpu(st: dict) -> Diagnosis:
    shares, idle, c = st["cause_shares"], st["gpu_idle_share"], st["idle_by_cause"]
    notes = list(st["notes"])
    if st.get("comm_ms_per_step") is not None:
        notes.append(f"all-reduce (NCCL) kernels: {st['comm_ms_per_step']:.2f} ms per step, "
                     f"{st['comm_exposed_ms_per_step']:.2f} ms of it with no compute kernel beside it")
    # A steady wait on a background loader means it is the slowest stage: faster launches or fewer syncs would
    # only wait longer for the next batch. Serial loading (num_workers=0) ranks by its share like the rest.
    promote = st["data_wait"]["background"] and c["data"] >= DATA_IDLE_LIMIT
    order = _rank(shares, "data" if promote else None)
    fixes = {**FIXES, "compute": FIXES["compute_tensor_cores" if st["tensor_core_share"] >= 0.5
                                      else "compute_cuda_cores"]}
    evidence = _gpu_evidence(st)
    power = _power_limited(st)
    if power:
        evidence["compute"] += f"; the card ran at its power limit ({power})"
        fixes["compute"] += POWER_FIX
    causes = _causes(order, shares, evidence, fixes)
    kind = order[0]
    reasons = [f"GPU busy {_pct(st['gpu_busy_share'])} of the step, idle {_pct(idle)}: {_pct(c['data'])} while the "
               f"host waited for data, {_pct(c['sync'])} right after host syncs, {_pct(c['overhead'])} while the "
               f"host launched kernels or ran Python", evidence[kind]]
    if promote:
        reasons.append(f"a background loader that the step waits on ({_pct(DATA_IDLE_LIMIT)} of the step or more "
                       f"with the GPU idle) is the slowest stage: speeding up anything else only lengthens the wait")
    notes += _next_in_line(causes)
    if kind == "compute" and st["data_share"] >= 0.2 and idle < GPU_IDLE_LIMIT:
        notes.append(f"the host spends {_pct(st['data_share'])} of the step waiting for data while the GPU is "
                     f"busy: it is waiting behind queued GPU work (a blocking copy), so faster loading will not help")
    mentioned = {kind} | {x["cause"] for x in causes[1:] if x["share"] >= NOTE_SHARE}
    if "sync" not in mentioned and st["syncs_per_step"] >= 1:
        notes.append(evidence["sync"])
    if "overhead" not in mentioned:
        notes.append(evidence["overhead"])
    if power and kind != "compute":
        notes.append(f"the card ran at its power limit ({power}): once the GPU is the limit, its clock is set by "
                     f"the energy its kernels spend")
    return Diagnosis(kind, KINDS[kind], "cuda", reasons, fixes[kind], st, notes, causes,
                     _is_dominant(order, shares))


def _decide_cpu(st: dict) -> Diagnosis:
    shares = st["cause_shares"]
    notes = list(st["notes"])
    ps = st["phase_share"]
    order = _rank(shares)
    kind = order[0]
    small = (f"{st['ops_per_step']:.0f} operators per step; {_pct(st['small_op_share'])} of the time outside data "
             f"waits is spent outside operators of {SMALL_OP_US:.0f} us or more (Python, dispatch, tiny operators)")
    evidence = {"data": f"the loop waited for its next batch {_pct(st['data_share'])} of the step ({_data_source(st)})",
                "overhead": small,
                "compute": (f"{_pct(1 - st['small_op_share'])} of the time outside data waits is spent in operators "
                            f"of {SMALL_OP_US:.0f} us or more, doing real arithmetic")}
    fixes = {**FIXES, "compute": FIXES["compute_cpu"]}
    titles = {**KINDS, "compute": "compute bound"}
    causes = _causes(order, shares, evidence, fixes, titles)
    reasons = []
    if any(ps[p] for p in COMPUTE_PHASES):
        reasons.append(f"step time: data {_pct(ps['data'])}, forward {_pct(ps['forward'])}, backward "
                       f"{_pct(ps['backward'])}, optimizer {_pct(ps['optimizer'])}, other "
                       f"{_pct(ps['other'] + ps['metrics'])}")
    reasons.append(evidence[kind])
    notes += _next_in_line(causes)
    if st["host_reads_per_step"] >= 1:
        notes.append(f"{st['host_reads_per_step']:.0f} host reads per step (.item() and the like): free on a CPU, "
                     f"but on a GPU each one makes the host wait for the device")
    return Diagnosis(kind, titles[kind], "cpu", reasons, fixes[kind], st, notes, causes, _is_dominant(order, shares))


def breakdown(d) -> dict[str, float]:
    """Where a step's time went, as shares that sum to 1: on a GPU the busy share and the idle share by cause,
    on a CPU the phases (or, without labkit's labels, data / operators / the rest). `d`: a Diagnosis or its evidence dict (e.g. from a recorded result)."""
    ev = d.evidence if isinstance(d, Diagnosis) else d
    if ev.get("gpu_busy_share") is not None:
        c = ev["idle_by_cause"]
        return {"GPU busy": ev["gpu_busy_share"], "idle: data": c["data"], "idle: after sync": c["sync"],
                "idle: launch/Python": c["overhead"]}
    ps = ev["phase_share"]
    if not any(ps[p] for p in COMPUTE_PHASES) and ev.get("cause_shares"):  # no labkit labels: the causes
        c = ev["cause_shares"]
        return {"data": c["data"], "operators >= 20 us": c["compute"], "Python/small ops": c["overhead"]}
    parts = {p: ps[p] for p in ("data", "forward", "backward", "optimizer")}
    parts["other"] = max(0.0, 1 - sum(parts.values()))
    return parts


def plot_breakdown(named: dict, ax=None, title: str = "where the step's time goes"):
    """Stacked horizontal bars of `breakdown` for each named Diagnosis (or evidence dict); returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(named) + 1.4))
    names = list(named)
    parts = [breakdown(named[n]) for n in names]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    left = [0.0] * len(names)
    for k in keys:
        vals = [100 * p.get(k, 0.0) for p in parts]
        ax.barh(names, vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for i, n in enumerate(names):
        d = named[n]
        kind = d.kind if isinstance(d, Diagnosis) else None
        if kind:
            ax.text(101, i, d.title, va="center", fontsize=8)
    ax.set_xlim(0, 100 if not any(isinstance(d, Diagnosis) for d in named.values()) else 135)
    ax.invert_yaxis()
    ax.set_xlabel("% of step time")
    ax.set_title(title)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=len(keys), fontsize=8, frameon=False)
    return ax

"""Name a training step's bottleneck from a torch.profiler trace, with the evidence behind it.

- `diagnose(trace or profile)` -> `Diagnosis`: kind "data" (data-loading bound), "overhead" (CPU/launch bound),
  "sync" (synchronization bound) or "compute" (GPU compute bound; "compute bound" on a CPU), with the numbers
  it used (`evidence`), the sentences that explain them (`reasons`) and the fix the course teaches (`fix`).
- `trace_stats(trace)`: the per-step numbers it decides from; `breakdown` / `plot_breakdown` for a chart.
- `load_trace` / `save_trace`: Chrome/Perfetto traces, gzipped, with clear errors for bad files.
`labkit.profiling` records the traces (and re-exports these names).

How the diagnosis decides. On a GPU: if the GPU runs kernels (or copies) less than 70% of the step, the idle
time is split by what the host was doing: waiting in "data", coming back from a host sync
(cudaStreamSynchronize & co.; `.item()` / `.cpu()` cause them), or anything else (Python and kernel launches).
Idle while waiting for data (15% of the step or more) names the loader, the slowest stage; otherwise the larger
of the other two shares decides. If the GPU is busy 70% or more, the GPU itself is the limit. On a CPU there is
no queue to starve: the step is data-loading bound when "data" takes half of it, CPU/launch (framework
overhead) bound when most of the compute phases is spent outside operators that last 20 us or more (a best
effort: microsecond timings on a busy machine are noisy), compute bound otherwise.
Holistic Trace Analysis was weighed for this: it analyses GPU kernels only (nothing to say on a CPU trace)
and knows nothing of our phase labels, so this small parser does the job and is tested on committed traces.
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
# Host calls that block until the device catches up. cudaMemcpy (not ...Async) waits for the stream.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::item")  # .item(), int(t), float(t), bool(t), if t: ...
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GPU_IDLE_LIMIT = 0.30      # GPU idle share above which the host is the bottleneck
DATA_IDLE_LIMIT = 0.15     # GPU idle share while the host waits in "data" that names the loader the slowest stage
CPU_DATA_LIMIT = 0.50      # CPU: share of the step in "data" that makes it data-loading bound
CPU_OVERHEAD_LIMIT = 0.60  # CPU: share of compute phases not in the self time of operators >= SMALL_OP_US
SMALL_OP_US = 20.0
SYNC_TOLERANCE_US = 20.0   # host and device clocks in a trace agree to within a few microseconds

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


# ------------------------------------------------------------------------------------------- trace stats


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


def trace_stats(trace: dict | str | os.PathLike) -> dict:
    """Per-step numbers from a torch.profiler trace: phase shares, GPU busy/idle and its causes, syncs,
    host reads, launches, kernels, tensor-core share, top kernels or operators. Times in ms, shares in [0, 1]."""
    if not isinstance(trace, dict):
        trace = load_trace(trace)
    _check_trace(trace, "the trace")
    from labkit.matmul import is_tensor_core_kernel

    X = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
         and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    if not X:
        raise LabkitError("the trace has no timed events (ph 'X' with numeric ts and dur): is it a torch.profiler trace?")
    notes: list[str] = []
    steps = sorted((e for e in X if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    host = [e for e in X if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")] or X
    if steps:
        main = (steps[0].get("pid"), steps[0].get("tid"))
        steps = [s for s in steps if (s.get("pid"), s.get("tid")) == main]
        w0, w1 = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    else:
        notes.append("no ProfilerStep markers (no schedule): the whole trace counts as one step")
        main = None
        w0, w1 = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    n_steps = max(1, len(steps))
    gpu = [e for e in X if e.get("cat") in GPU_CATS]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    on_gpu = bool(kernels)
    h0 = w0  # host side: counts per step cover every recorded step
    if on_gpu:
        late = [e for e in gpu if e["ts"] + e["dur"] > w0]
        w1 = max(w1, max(e["ts"] + e["dur"] for e in late))
        # Kernels launched before the profiler started are not in the trace, yet a host that runs ahead leaves
        # the GPU busy with them for a while: time shares start at the first recorded GPU activity.
        g0 = min(e["ts"] for e in late)
        if g0 - w0 > 0.2 * (w1 - w0):
            notes.append(f"the first recorded GPU work starts {(g0 - w0) / 1e3:.1f} ms into the first step (the host "
                         f"ran ahead, or waited before launching); time shares start there")
        w0 = max(w0, g0)
    span = max(w1 - w0, 1e-9)

    def in_window(e):
        return e["ts"] < w1 and e["ts"] + e["dur"] > h0

    # Phases: record_function ranges on the stepping thread (or any thread without step markers).
    phase_iv = {}
    for ph in PHASES:
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in X if e.get("name") == ph and e.get("cat") in ("user_annotation", "cpu_op")
              and (main is None or (e.get("pid"), e.get("tid")) == main)]
        phase_iv[ph] = _union(_clip(iv, w0, w1))
    # On a CPU the shares come from the step of median length: one step stretched by a preempted thread does
    # not decide, and the shares still add up. On a GPU, work launched in one step runs in the next, so there
    # the whole window is the unit.
    if on_gpu or not steps:
        a, b = w0, w1
    else:
        mid = sorted(steps, key=lambda e: e["dur"])[(len(steps) - 1) // 2]
        a, b = mid["ts"], mid["ts"] + mid["dur"]

    def share(iv_of):
        return _overlap_all(iv_of, a, b) / max(b - a, 1e-9)

    phase_share = {ph: share(iv) for ph, iv in phase_iv.items()}
    labelled = _union([x for iv in phase_iv.values() for x in iv])
    phase_share["other"] = max(0.0, 1 - share(labelled))
    if not phase_iv["data"]:
        notes.append("no 'data' label in the trace: time waiting for data cannot be separated")

    ops = [e for e in X if e.get("cat") == "cpu_op" and in_window(e)]
    runtime = [e for e in X if e.get("cat") in ("cuda_runtime", "cuda_driver") and in_window(e)]
    # Syncs and reads that stall training are the stepping thread's (a pin-memory thread has its own).
    syncs = [e for e in runtime if e.get("name") in SYNC_CALLS and (main is None or (e.get("pid"), e.get("tid")) == main)]
    launches = [e for e in runtime if "Launch" in str(e.get("name", ""))]
    main_ops = [e for e in ops if main is None or (e.get("pid"), e.get("tid")) == main]
    reads = ([e for e in main_ops if e.get("name") == HOST_READ_OPS[0]]
             or [e for e in main_ops if e.get("name") == HOST_READ_OPS[1]])
    dtoh = [e for e in gpu if e.get("cat") == "gpu_memcpy" and "dtoh" in str(e.get("name", "")).lower()
            and in_window(e)]

    st = {
        "device": "cuda" if on_gpu else "cpu",
        "steps": len(steps) or 1,
        "step_ms": span / n_steps / 1e3,
        "phase_share": phase_share,
        "data_share": phase_share["data"],
        "host_reads_per_step": len(reads) / n_steps,
        "syncs_per_step": len(syncs) / n_steps,
        "sync_wait_share": _length(_clip(_union([(e["ts"], e["ts"] + e["dur"]) for e in syncs]), w0, w1)) / span,
        "dtoh_copies_per_step": len(dtoh) / n_steps,
        "notes": notes,
    }

    # Compute phases on the host: how much of them is spent in operators big enough to be real work.
    comp = _union([x for ph in COMPUTE_PHASES for x in phase_iv[ph]]) or [(w0, w1)]
    rows = _self_times(ops)
    c = _clip(comp, a, b)
    heavy = sum(s for e, s in rows if s >= SMALL_OP_US and a <= e["ts"] < b and _overlap(c, e["ts"], e["ts"] + e["dur"]) > 0)
    st["ops_per_step"] = len(ops) / n_steps
    st["small_op_share"] = max(0.0, 1 - heavy / max(_length(c), 1e-9))

    if on_gpu:
        busy = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in gpu], w0, w1))
        k_iv = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in kernels], w0, w1))
        st["gpu_busy_share"] = _length(busy) / span
        st["gpu_idle_share"] = 1 - st["gpu_busy_share"]
        st["kernel_busy_share"] = _length(k_iv) / span
        gaps, t = [], w0
        for x0, x1 in busy:
            if x0 > t:
                gaps.append((t, x0))
            t = max(t, x1)
        if t < w1:
            gaps.append((t, w1))
        data_iv = phase_iv["data"]
        sync_ends = sorted(e["ts"] + e["dur"] for e in syncs)
        cause = {"data": 0.0, "sync": 0.0, "overhead": 0.0}
        for x0, x1 in gaps:
            d = _overlap(data_iv, x0, x1)
            cause["data"] += d
            k = bisect.bisect_left(sync_ends, x0 - SYNC_TOLERANCE_US)
            after_sync = k < len(sync_ends) and sync_ends[k] <= x1
            cause["sync" if after_sync else "overhead"] += (x1 - x0) - d
        st["idle_by_cause"] = {k: v / span for k, v in cause.items()}
        k_in = [e for e in kernels if in_window(e)]
        k_time = sum(e["dur"] for e in k_in)
        tc_of = {n: is_tensor_core_kernel(n)[0] for n in {str(e.get("name", "")) for e in k_in}}
        tc_time = sum(e["dur"] for e in k_in if tc_of[str(e.get("name", ""))] is True)
        mm_time = sum(e["dur"] for e in k_in if tc_of[str(e.get("name", ""))] is not None)
        st.update(kernels_per_step=len(k_in) / n_steps, launches_per_step=len(launches) / n_steps,
                  kernel_ms_per_step=k_time / n_steps / 1e3,
                  launch_ms_per_step=sum(e["dur"] for e in launches) / n_steps / 1e3,
                  mean_kernel_us=k_time / max(1, len(k_in)),
                  tensor_core_share=tc_time / k_time if k_time else 0.0,
                  matmul_share=mm_time / k_time if k_time else 0.0)
        st["top"] = _top([(str(e.get("name", "")), e["dur"]) for e in k_in], n_steps, k_time, tc=True)
        # Collective kernels (NCCL) run on their own stream; the part of them with no other kernel running
        # beside it is communication that backward did not hide: the scaling loss of data parallelism.
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in k_in if "nccl" in str(e.get("name", "")).lower()]
        if comm:
            c_iv = _union(_clip(comm, w0, w1))
            other = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in k_in
                                  if "nccl" not in str(e.get("name", "")).lower()], w0, w1))
            hidden = sum(_overlap(other, x0, x1) for x0, x1 in c_iv)
            st["comm_ms_per_step"] = _length(c_iv) / n_steps / 1e3
            st["comm_exposed_ms_per_step"] = (_length(c_iv) - hidden) / n_steps / 1e3
    else:
        st.update(gpu_busy_share=None, gpu_idle_share=None, idle_by_cause=None, tensor_core_share=None)
        selfs = [(str(e.get("name", "")), s) for e, s in rows if str(e.get("name", "")).startswith("aten::")]
        st["top"] = _top(selfs, n_steps, sum(s for _, s in selfs), tc=False)
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
    """The bottleneck of a profiled run, the evidence for it, and the fix.

    kind: "data" | "overhead" | "sync" | "compute" (see KINDS for titles); evidence: the numbers of
    `trace_stats` (shares are fractions of the step's wall time; ms per step); reasons: sentences citing the
    numbers that decided; notes: secondary findings; fix: what the course teaches for this bottleneck.
    """

    kind: str
    title: str
    device: str
    reasons: list[str]
    fix: str
    evidence: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        ev = self.evidence
        lines = [f"{self.title} ({self.device}: {ev['steps']} steps of {ev['step_ms']:.2f} ms)"]
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  note: {n}" for n in self.notes]
        if ev.get("top"):
            lines.append("  top " + ("kernels" if self.device == "cuda" else "operators (self time)") + ":")
            for r in ev["top"][:5]:
                tc = {True: " [tensor cores]", False: " [CUDA cores]"}.get(r.get("tensor_core"), "")
                lines.append(f"    {100 * r['share']:5.1f}%  {r['ms_per_step']:8.3f} ms/step  {r['name']}{tc}")
        lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(source) -> Diagnosis:
    """Name the bottleneck of a profiled run: data-loading, CPU/launch, synchronization or GPU compute bound.

    `source`: a `Profile` from `profile_steps`, a trace file (.json / .json.gz from torch.profiler), a parsed
    trace dict, or a torch.profiler.profile object. Raises LabkitError for a missing, truncated or non-profiler
    trace. The result's `kind` is one of "data", "overhead", "sync", "compute"; `evidence` holds the numbers.
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
    return _decide_gpu(st) if st["device"] == "cuda" else _decide_cpu(st)


def _decide_gpu(st: dict) -> Diagnosis:
    idle, causes = st["gpu_idle_share"], st["idle_by_cause"]
    reasons, notes = [], list(st["notes"])
    if st.get("comm_ms_per_step") is not None:
        notes.append(f"all-reduce (NCCL) kernels: {st['comm_ms_per_step']:.2f} ms per step, "
                     f"{st['comm_exposed_ms_per_step']:.2f} ms of it with no compute kernel beside it")
    tc = st["tensor_core_share"]
    busy_line = (f"GPU busy {_pct(st['gpu_busy_share'])} of the step, idle {_pct(idle)}: "
                 f"{_pct(causes['data'])} while the host waited in 'data', {_pct(causes['sync'])} right after host "
                 f"syncs, {_pct(causes['overhead'])} while the host ran Python and launched kernels")
    launch_line = (f"{st['kernels_per_step']:.0f} kernels per step averaging {st['mean_kernel_us']:.1f} us; "
                   f"launch calls {st['launch_ms_per_step']:.2f} ms vs kernel time {st['kernel_ms_per_step']:.2f} ms "
                   f"per step")
    sync_line = (f"{st['syncs_per_step']:.0f} host syncs, {st['dtoh_copies_per_step']:.0f} device-to-host copies and "
                 f"{st['host_reads_per_step']:.0f} .item()-style reads per step; the host waited in syncs "
                 f"{_pct(st['sync_wait_share'])} of the step")
    if idle < GPU_IDLE_LIMIT:
        kind = "compute"
        reasons += [busy_line + f" (below the {_pct(GPU_IDLE_LIMIT)} that would blame the host)",
                    f"tensor cores ran {_pct(tc)} of kernel time; matmul kernels {_pct(st['matmul_share'])}"]
        fix = FIXES["compute_tensor_cores" if tc >= 0.5 else "compute_cuda_cores"]
        if st["data_share"] >= 0.2:
            notes.append(f"the host spends {_pct(st['data_share'])} of the step in 'data' while the GPU is busy: "
                         f"it is waiting behind queued GPU work (a blocking copy), so faster loading will not help")
    else:
        # A steady wait for data means the loader is the slowest stage: faster launches or fewer syncs would only
        # wait longer for the next batch. Otherwise the larger of the other two causes decides.
        kind = "data" if causes["data"] >= DATA_IDLE_LIMIT else max(("sync", "overhead"), key=causes.get)
        reasons.append(busy_line)
        if kind == "data":
            reasons.append(f"the host spent {_pct(st['data_share'])} of the step inside 'data' (the next batch), "
                           f"{_pct(causes['data'])} with the GPU idle; {_pct(DATA_IDLE_LIMIT)} or more means the "
                           f"loader is the slowest stage")
        elif kind == "sync":
            reasons.append(sync_line)
        else:
            reasons.append(launch_line)
        fix = FIXES[kind]
        for other, share in sorted(causes.items(), key=lambda kv: -kv[1]):
            if other != kind and share >= 0.1:
                notes.append(f"next in line after the fix: {KINDS[other]} ({_pct(share)} of the step idle that way)")
    if kind != "sync" and st["syncs_per_step"] >= 1:
        notes.append(sync_line)
    if kind != "overhead":
        notes.append(launch_line)
    return Diagnosis(kind, KINDS[kind], "cuda", reasons, fix, st, notes)


def _decide_cpu(st: dict) -> Diagnosis:
    reasons, notes = [], list(st["notes"])
    ps = st["phase_share"]
    comp = sum(ps[p] for p in COMPUTE_PHASES)
    split = (f"step time: data {_pct(ps['data'])}, forward {_pct(ps['forward'])}, backward {_pct(ps['backward'])}, "
             f"optimizer {_pct(ps['optimizer'])}, other {_pct(ps['other'] + ps['metrics'])}")
    small = (f"{st['ops_per_step']:.0f} operators per step; {_pct(st['small_op_share'])} of forward/backward/optimizer "
             f"time is spent outside operators of {SMALL_OP_US:.0f} us or more (Python, dispatch, tiny ops)")
    if st["data_share"] >= CPU_DATA_LIMIT:
        kind = "data"
        reasons += [split, f"the step waits for data {_pct(st['data_share'])} of the time "
                           f"(at least {_pct(CPU_DATA_LIMIT)} makes it data-loading bound)"]
        fix = FIXES["data"]
    elif st["small_op_share"] >= CPU_OVERHEAD_LIMIT:
        kind = "overhead"
        reasons += [split, small + f" (at least {_pct(CPU_OVERHEAD_LIMIT)} makes it overhead bound)"]
        fix = FIXES["overhead"]
    else:
        kind = "compute"
        reasons += [split, f"forward/backward/optimizer take {_pct(comp)} of the step, mostly in operators that do "
                           f"real work ({_pct(1 - st['small_op_share'])} of that time)"]
        fix = FIXES["compute_cpu"]
    if kind != "data" and st["data_share"] >= 0.2:
        notes.append(f"data loading still takes {_pct(st['data_share'])} of the step")
    if st["host_reads_per_step"] >= 1:
        notes.append(f"{st['host_reads_per_step']:.0f} host reads per step (.item() and the like): free on a CPU, "
                     f"but on a GPU each one makes the host wait for the device")
    title = "compute bound" if kind == "compute" else KINDS[kind]
    return Diagnosis(kind, title, "cpu", reasons, fix, st, notes)


def breakdown(d) -> dict[str, float]:
    """Where a step's time went, as shares that sum to 1: on a GPU the busy share and the idle share by cause,
    on a CPU the phases. `d`: a Diagnosis or its evidence dict (e.g. from a recorded result)."""
    ev = d.evidence if isinstance(d, Diagnosis) else d
    if ev.get("gpu_busy_share") is not None:
        c = ev["idle_by_cause"]
        return {"GPU busy": ev["gpu_busy_share"], "idle: data": c["data"], "idle: after sync": c["sync"],
                "idle: launch/Python": c["overhead"]}
    ps = ev["phase_share"]
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

"""Profile a few training steps and name the bottleneck, with the evidence behind it.

- `profile_steps(target)`: torch.profiler with a wait/warmup/active schedule around a training loop (a ladder
  rung's `TrainConfig`, a scenario `Workload`, or any step function), phases labelled data / forward /
  backward / optimizer; returns a `Profile` (the Chrome/Perfetto trace, gzipped on disk, and the key-averages
  table). Traces stay small by default: 3 active steps, no shapes, no stacks, no memory events.
- `diagnose(trace or profile)` -> `Diagnosis` (from `labkit.diagnosis`, re-exported here): kind "data",
  "overhead", "sync" or "compute", with its evidence, reasons and the fix the course teaches.
- The Python profilers as plain functions (they also run in a script, no IPython magics): `cprofile`,
  `line_profile`, `memory_usage`, `memory_lines` (both after `release_freed_memory`), `py_spy_top` (optional
  tool), `cuda_memory_snapshot`, `nvidia_smi`.
- Reading what profilers print: `read_key_averages(prof)` (the top operator by self time and a phase's share of
  the step, from torch.profiler's key-averages table), `read_nsys_stats(kernels, nvtx)` (the dominant kernel and
  the data range's share of the step, from `nsys stats` cuda_gpu_kern_sum and nvtx_sum output).
- For Nsight Systems: `nvtx_range(name)` (a no-op without CUDA), `nsys_command(argv)`, the command to run, and
  `find_nsys()`.
- `quiet_cpu_profiler()`: on a machine without a CUDA GPU, keeps kineto from printing its CUDA probe
  (`ERROR: ... gpuGetDeviceCount failed with code 35`) and start/stop lines under every CPU profile.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from labkit import gpu_power as GP
from labkit.diagnosis import (  # noqa: F401  (re-exported: profile, then diagnose, from one module)
    FIXES,
    KINDS,
    PHASES,
    Diagnosis,
    breakdown,
    diagnose,
    load_trace,
    plot_breakdown,
    save_trace,
    trace_stats,
)
from labkit.env import LabkitError, pick_device

# --------------------------------------------------------------------------------------------- profiling

KINETO_QUIET_LEVEL = "6"  # kineto's logger prints levels at or above KINETO_LOG_LEVEL; its highest (USDT) is 5


def quiet_cpu_profiler() -> bool:
    """Silence kineto's log lines for the rest of this process when it has no CUDA GPU; True if it did.

    Whatever activities a torch.profiler is asked for, kineto asks the CUDA runtime for its devices when it
    writes a trace's device properties, and on a machine with a CUDA build of torch but no driver that prints
    `ERROR: ... DeviceProperties.cpp ... gpuGetDeviceCount failed with code 35` (cudaErrorInsufficientDriver),
    beside `USDT: ... profiler_start/stop` lines, straight to the process's stderr. Asking only for
    ProfilerActivity.CPU does not stop it; kineto's KINETO_LOG_LEVEL does, read once, when the process first
    profiles: call this before the first profile (labkit's `profile_steps` calls it). A GPU machine keeps its
    messages, and a KINETO_LOG_LEVEL set by the user is left as it is.
    """
    if torch.cuda.is_available() or "KINETO_LOG_LEVEL" in os.environ:
        return False
    os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    return True



@dataclass
class ProfileSchedule:
    wait: int = 1      # steps run before the profiler starts (first-step costs: allocation, autotune, compile)
    warmup: int = 1    # steps traced and thrown away (the profiler's own start-up cost)
    active: int = 3    # steps recorded and analysed

    @property
    def total(self) -> int:
        return self.wait + self.warmup + self.active

    def check(self) -> None:
        if self.wait < 0 or self.warmup < 0 or self.active < 1:
            raise LabkitError(f"profile schedule needs wait >= 0, warmup >= 0 and active >= 1, got {self}")


def suggest_schedule(target, device=None, active: int = 3) -> ProfileSchedule:
    """A schedule that skips what is not steady state for this target.

    A DataLoader starts with full prefetch queues (2 batches per worker by default), so on a GPU the wait lasts
    until they drain, or a data-bound run looks fine; compiled steps need a few calls to compile and record CUDA
    graphs.
    """
    from labkit.train import TrainConfig

    dev = pick_device(device)
    wait = 1
    if isinstance(target, TrainConfig):
        if target.compile:
            wait = 4
        if target.loader == "pil" and dev.type == "cuda":
            workers = min(16, os.cpu_count() or 1) if target.workers < 0 else target.workers
            # The queue drains at (consumption - production) per step, which is slow when the two are close.
            wait = max(wait, min(40, 2 + 6 * workers * (target.prefetch_factor or 2)))
    return ProfileSchedule(wait=wait, warmup=1, active=active)


@dataclass
class Profile:
    """What `profile_steps` recorded: the Chrome/Perfetto trace (parsed), its file, and the key-averages table."""

    name: str
    device: str                 # "cpu" or "cuda"
    trace: dict                 # the Chrome trace JSON of the active steps
    table: str                  # torch.profiler key averages, sorted by self device time (GPU) or self CPU time
    schedule: ProfileSchedule
    trace_path: Path | None = None

    def diagnose(self) -> Diagnosis:
        return diagnose(self.trace)


@contextlib.contextmanager
def _quiet_profiler():
    """Hide the profiler's start/stop chatter (C++ lines on fd 2, a once-per-cycle warning)."""
    from labkit.matmul import _native_stderr_filtered

    with warnings.catch_warnings(), _native_stderr_filtered():
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
        warnings.filterwarnings("ignore", message=".*CUPTI.*")
        yield


def _key_table(prof, device: torch.device, row_limit: int) -> str:
    ka = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for key in keys:
        try:
            return ka.table(sort_by=key, row_limit=row_limit)
        except (KeyError, AttributeError, RuntimeError, ValueError):
            continue
    return ka.table(row_limit=row_limit)


def _train_config_for_profile(cfg, total: int):
    """The rung's config trimmed to `total` steps, all in one epoch (a new epoch restarts the workers)."""
    from labkit.train import with_changes

    n_train = max(cfg.n_train or 0, total * cfg.batch_size)
    return with_changes(cfg, n_train=n_train, epochs=1, max_steps=total, evaluate=False)


def profile_steps(target, device=None, *, schedule: ProfileSchedule | None = None, out: str | os.PathLike | None = None,
                  name: str | None = None, record_shapes: bool = False, with_stack: bool = False,
                  profile_memory: bool = False, dataset=None, row_limit: int = 15, progress: bool = False) -> Profile:
    """Run a few training steps under torch.profiler with a wait/warmup/active schedule.

    `target`: a `labkit.train.TrainConfig` (runs `train()`, trimmed to the schedule's steps), a
    `labkit.scenarios.Workload` (its `step()`), or a callable doing one training step. Label the phases of your
    own step with `torch.profiler.record_function("data" | "forward" | "backward" | "optimizer")` so
    `diagnose` can split the step time. With `out` (a folder), writes `<name>.pt.trace.json.gz` (open it in
    Perfetto, https://ui.perfetto.dev, or chrome://tracing) and `<name>.keyavg.txt`.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import schedule as make_schedule
    from tqdm.auto import tqdm

    from labkit.train import TrainConfig, train

    dev = pick_device(device)
    sched = schedule or suggest_schedule(target, dev)
    sched.check()
    quiet_cpu_profiler()
    step = None
    if isinstance(target, TrainConfig):
        label = name or target.name
    else:
        step = target.step if hasattr(target, "step") else target
        if not callable(step):
            raise LabkitError(f"profile_steps needs a TrainConfig, a Workload or a step function, "
                              f"not {type(target).__name__}")
        label = name or getattr(getattr(target, "cfg", None), "name", None) or getattr(target, "__name__", "steps")
    captured: dict = {}

    def ready(prof):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "trace.json")
            prof.export_chrome_trace(p)
            captured["trace"] = json.loads(Path(p).read_text())
        captured["table"] = _key_table(prof, dev, row_limit)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    bar = tqdm(total=sched.total, desc=f"profiling {label}", leave=False, disable=None if progress else True)
    meter = GP.Meter.open(dev)  # the clock and power over the active steps: is the card at its power limit?
    done = [0]
    with contextlib.ExitStack() as readings, _quiet_profiler(), \
            profile(activities=acts, record_shapes=record_shapes, with_stack=with_stack,
                    profile_memory=profile_memory, on_trace_ready=ready,
                    schedule=make_schedule(wait=sched.wait, warmup=sched.warmup, active=sched.active, repeat=1)) as prof:
        def read_from_here():  # the readings run from the first active step to the end of the run
            if meter is not None:
                readings.enter_context(meter.reading())

        def on_step(_done=None):
            bar.update(1)
            prof.step()
            done[0] += 1
            if done[0] == sched.wait + sched.warmup:
                read_from_here()

        try:
            if sched.wait + sched.warmup == 0:
                read_from_here()
            if step is None:
                train(_train_config_for_profile(target, sched.total), dev, dataset=dataset, on_step=on_step,
                      read_power=False)  # this meter reads them, from the first active step
            else:
                for _ in range(sched.total):
                    step()
                    on_step()
        finally:
            bar.close()
    if "trace" not in captured:
        raise LabkitError(f"{label}: the profiler recorded nothing; the run ended before the {sched.total} steps "
                          f"that wait={sched.wait} + warmup={sched.warmup} + active={sched.active} need")
    trace = captured["trace"]
    trace["traceName"] = label  # export wrote it to a temporary file whose path means nothing later
    trace["labkit"] = {"name": label, "device": dev.type, "schedule": asdict(sched),
                       "gpu_power": meter.report() if meter is not None and meter.samples else None}
    # A Workload loads its batches in the step's own thread (no worker queue): diagnose ranks that wait by its
    # share, as it does DataLoader's num_workers=0, instead of as a background loader's.
    loading = getattr(target, "data_loading", None)
    if loading is not None:
        trace["labkit"]["data_loading"] = loading
    result = Profile(label, dev.type, trace, captured["table"], sched)
    if out is not None:
        result.trace_path = save_trace(trace, Path(out) / f"{_safe(label)}.pt.trace.json.gz")
        (Path(out) / f"{_safe(label)}.keyavg.txt").write_text(result.table)
    return result


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "trace"


# ----------------------------------------------------------------------------- reading key averages


STEP_KEY = "ProfilerStep*"  # key_averages groups the schedule's ProfilerStep#N ranges under this one key


def read_key_averages(prof, phase: str = "data", by: str = "cpu") -> dict:
    """What torch.profiler's key-averages table says about a profiled loop: its top operator and a phase's share.

    `prof`: a finished `torch.profiler.profile` whose loop called `prof.step()` (so the steps are the
    `ProfilerStep*` row) and labelled its phases with `record_function`. `by`: "cpu" ranks the `aten::`
    operators by self CPU time (time in the operator itself, not in the operators it calls); "cuda" ranks every
    row by self device time (on a GPU: the kernels). Returns top_op, top_op_ms (summed over the recorded steps),
    steps (ProfilerStep ranges recorded), step_ms (CPU time of one step), phase_ms (the phase's CPU time per
    step) and phase_share: the phase's total CPU time over the steps' total, 0 when the phase never ran.
    With a schedule that repeats, the table holds the last cycle only.
    """
    if by not in ("cpu", "cuda"):
        raise LabkitError(f"read_key_averages ranks by 'cpu' or 'cuda' self time, not {by!r}")
    if not hasattr(prof, "key_averages"):
        raise LabkitError(f"read_key_averages needs a finished torch.profiler.profile, not {type(prof).__name__}")
    rows = list(prof.key_averages())
    steps = [r for r in rows if r.key == STEP_KEY]
    if not steps:
        raise LabkitError("the profile has no ProfilerStep* row: call prof.step() at the end of every loop "
                          "iteration, inside a profile with a schedule")
    step = steps[0]
    if by == "cpu":
        ranked = [(r.key, r.self_cpu_time_total) for r in rows if r.key.startswith("aten::")]
    else:
        ranked = [(r.key, getattr(r, "self_device_time_total", 0.0)) for r in rows if r.key != STEP_KEY]
    if not ranked:
        raise LabkitError(f"the profile recorded no operators to rank by self {by} time")
    top, top_us = max(ranked, key=lambda kv: kv[1])
    phase_us = sum(r.cpu_time_total for r in rows if r.key == phase)
    n = max(1, step.count)
    return {"top_op": top, "top_op_ms": top_us / 1e3, "steps": step.count, "step_ms": step.cpu_time_total / n / 1e3,
            "phase": phase, "phase_ms": phase_us / n / 1e3,
            "phase_share": phase_us / step.cpu_time_total if step.cpu_time_total else 0.0}


# ------------------------------------------------------------------------------------- Python profilers


@dataclass
class PyProfile:
    """A Python profiler's report: the text it prints, its rows as dicts, and the profiled call's return value."""

    text: str
    rows: list[dict]
    result: object = None

    def __str__(self) -> str:
        return self.text


def cprofile(fn, *args, sort: str = "cumulative", limit: int = 12, **kwargs) -> PyProfile:
    """Run `fn(*args, **kwargs)` under cProfile; rows: function, calls, tottime_s (own), cumtime_s (with callees)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    result = pr.runcall(fn, *args, **kwargs)
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf).strip_dirs().sort_stats(sort)
    stats.print_stats(limit)
    key = {"cumulative": 3, "tottime": 2, "calls": 1, "ncalls": 1}.get(sort, 3)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{func} ({file}:{line})", "calls": nc, "tottime_s": tt, "cumtime_s": ct,
                     "_k": (None, nc, tt, ct)[key]})
    rows.sort(key=lambda r: -r.pop("_k"))
    return PyProfile(buf.getvalue(), rows[:limit], result)


def line_profile(fn, *args, functions=None, **kwargs) -> PyProfile:
    """Time every line of `functions` (default: `fn`) while `fn(*args, **kwargs)` runs, with line_profiler.

    Rows: function, line, hits, time_s, share (of the profiled functions' total), code. On a GPU the time of
    asynchronous kernels is charged to the line that waits for them (an .item(), a print), not to the line that
    launched them.
    """
    import linecache

    from line_profiler import LineProfiler

    lp = LineProfiler(*(functions or [fn]))
    result = lp.runcall(fn, *args, **kwargs)
    buf = io.StringIO()
    lp.print_stats(stream=buf, output_unit=1e-3, stripzeros=True)
    st = lp.get_stats()
    rows = []
    for (file, _first, func), timings in st.timings.items():
        for line, hits, t in timings:
            rows.append({"function": func, "line": line, "hits": hits, "time_s": t * st.unit,
                         "code": linecache.getline(file, line).strip()})
    total = sum(r["time_s"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["time_s"] / total
    rows.sort(key=lambda r: -r["time_s"])
    return PyProfile(buf.getvalue(), rows, result)


def release_freed_memory() -> bool:
    """Hand memory that Python and the C heap have freed, but still hold, back to the operating system.

    Resident-memory profilers measure pages the process holds, so an allocation that reuses a freed hole in the
    heap (common after a few training runs) shows no increment at all. Trimming first makes a line that allocates
    show its size. Returns True where it could trim (Linux with glibc); elsewhere it only collects garbage.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def memory_usage(fn, *args, interval: float = 0.01, **kwargs) -> dict:
    """Resident memory of this process sampled every `interval` s while `fn` runs (memory_profiler).

    Returns start_mib, peak_mib, samples_mib (MiB) and result. Host memory only: tensors on a GPU do not show.
    Freed memory is handed back first (`release_freed_memory`), so the peak reflects what `fn` allocates.
    """
    from memory_profiler import memory_usage as mu

    release_freed_memory()
    samples, result = mu((fn, args, kwargs), interval=interval, retval=True, include_children=False)
    return {"start_mib": samples[0], "peak_mib": max(samples), "samples_mib": list(samples),
            "interval_s": interval, "result": result}


def memory_lines(fn, *args, functions=None, **kwargs) -> PyProfile:
    """Memory after each line of `functions` (default `fn`) and its increment, with memory_profiler (slow: small
    inputs only). Rows: line, mem_mib, increment_mib, code. The functions must live in a .py file (memory_profiler
    reads their source): a function defined in a notebook cell is skipped with an error line. Freed memory is
    handed back first (`release_freed_memory`), so a line that allocates shows its increment."""
    import linecache

    import memory_profiler as mp

    release_freed_memory()
    prof = mp.LineProfiler(backend="psutil")
    for f in functions or [fn]:
        prof.add_function(getattr(f, "__func__", f))
    prof.enable_by_count()
    try:
        result = fn(*args, **kwargs)
    finally:
        prof.disable_by_count()
    buf = io.StringIO()
    mp.show_results(prof, stream=buf, precision=1)
    rows = []
    for filename, lines in prof.code_map.items():
        for line, entry in lines:
            code = linecache.getline(filename, line).strip()
            if entry and not code.startswith(("def ", "async def ")):  # the def line holds memory at entry
                rows.append({"line": line, "mem_mib": entry[1], "increment_mib": entry[0], "code": code})
    return PyProfile(buf.getvalue(), rows, result)


PTRACE_NOTE = ("py-spy reads another process's memory, which Linux guards with ptrace permissions: a program it "
               "starts itself (py-spy record -- python ...) works as a normal user; attaching to a running process "
               "(--pid) needs root or kernel.yama.ptrace_scope=0; in Docker add --cap-add SYS_PTRACE; on macOS use "
               "sudo.")


def py_spy_path() -> str | None:
    """The py-spy executable (an optional tool: pip install 'labkit[profiling]'), or None."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def py_spy_top(argv: list[str], *, rate: int = 200, top: int = 10, timeout: float = 300,
               native: bool = False, within: str | None = None) -> dict | None:
    """Sample a Python program with py-spy (`py-spy record -- argv`) and list where it spent its time.

    `within`: keep only samples taken inside a function of that name (e.g. "step"), so start-up and imports
    do not crowd the list. Returns {"samples", "self": [(function, share)], "inclusive": [(function, share)]},
    or None (with a printed reason) when py-spy is absent or may not trace. py-spy sees Python frames (with
    `native`, C frames too), not what a GPU runs.
    """
    exe = py_spy_path()
    if exe is None:
        print("py-spy is not installed (an optional tool: pip install py-spy): skipped")
        return None
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "raw.txt")
        cmd = [exe, "record", "--format", "raw", "-o", raw, "--rate", str(rate)] + (["--native"] if native else [])
        try:
            proc = subprocess.run(cmd + ["--", *argv], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"py-spy: the program ran longer than {timeout:.0f} s: skipped")
            return None
        if proc.returncode != 0 or not os.path.exists(raw):
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"py-spy could not sample ({err}). {PTRACE_NOTE}")
            return None
        text = Path(raw).read_text()
    own: dict[str, int] = defaultdict(int)
    incl: dict[str, int] = defaultdict(int)
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # one row per function, not per line
        if within is not None and not any(f.split(" (")[0].split(".")[-1] == within for f in frames):
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        print("py-spy took no samples" + (f" inside {within}()" if within else "") + " (too short a run?): skipped")
        return None

    def best(d):
        return [(f, n / total) for f, n in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "self": best(own), "inclusive": best(incl)}


def cuda_memory_snapshot(fn, path: str | os.PathLike, *, max_entries: int = 100_000) -> Path | None:
    """Record every CUDA allocation while `fn()` runs and dump a snapshot for https://pytorch.org/memory_viz.

    CUDA only: on a machine without a CUDA GPU it prints why and returns None.
    """
    if not torch.cuda.is_available():
        print("CUDA memory snapshots record the CUDA caching allocator: this machine has no CUDA GPU, skipped")
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"wrote {path}: drag it onto https://pytorch.org/memory_viz")
    return path


def nvidia_smi(fields=("utilization.gpu", "memory.used", "memory.total", "power.draw")) -> list[dict] | None:
    """One nvidia-smi reading per GPU (utilization.gpu is the share of time any kernel ran, not how busy the
    SMs were); None with a printed reason where nvidia-smi is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        print("nvidia-smi is not here (no NVIDIA driver): skipped")
        return None
    out = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        print(f"nvidia-smi failed: {out.stderr.strip()[:200]}")
        return None
    return [dict(zip(fields, (v.strip() for v in line.split(",")), strict=False))
            for line in out.stdout.strip().splitlines()]


# ----------------------------------------------------------------------------------------- NVTX and nsys


@contextlib.contextmanager
def nvtx_range(name: str):
    """Mark a range (a training phase, a step) for Nsight Systems: `torch.cuda.nvtx.range_push/pop` on a CUDA
    machine, a no-op elsewhere, so the same code runs on a CPU. nsys shows the ranges on the NVTX row above the
    host thread; torch.profiler does not (use `torch.profiler.record_function` for its traces). The other way
    round, nsys shows `record_function` labels only where PyTorch emits NVTX for them: inside
    `torch.autograd.profiler.emit_nvtx()`, or under `nsys profile --pytorch=autograd-nvtx`."""
    if not isinstance(name, str) or not name:
        raise LabkitError(f"nvtx_range needs a non-empty name, got {name!r}")
    on = torch.cuda.is_available()
    if on:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if on:
            torch.cuda.nvtx.range_pop()


def nsys_command(argv: list[str], out: str = "runs/week5/nsys_report", *, python_sampling: bool = True) -> str:
    """The `nsys profile` command line that records `argv` (a program and its arguments) with CUDA, NVTX and OS
    runtime traces into `out`.nsys-rep; open that in the Nsight Systems GUI, or `nsys stats` it in a terminal.
    Returns the command as a string (run it in a shell on the GPU machine)."""
    import shlex

    if not argv or not all(isinstance(a, str) for a in argv):
        raise LabkitError(f"nsys_command needs the program to run as a list of strings, got {argv!r}")
    opts = ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--cuda-memory-usage=false", f"--output={out}",
            "--force-overwrite=true"]
    if python_sampling:
        opts.append("--python-sampling=true")  # Python stacks beside the kernels (nsys 2023.3 and later)
    return shlex.join(opts + list(argv))


NSYS_PLACES = ("/usr/local/cuda/bin/nsys", "/opt/nvidia/nsight-systems/*/bin/nsys",
               "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys", "/usr/local/cuda/nsight-systems-*/bin/nsys")


def find_nsys() -> str | None:
    """The nsys executable: on PATH, else where CUDA toolkits and Nsight installers put it; None if absent."""
    import glob

    found = shutil.which("nsys")
    if found:
        return found
    for pattern in NSYS_PLACES:
        hits = sorted(p for p in glob.glob(pattern) if os.access(p, os.X_OK))
        if hits:
            return hits[-1]  # the newest version, where the folder names carry one
    return None


_NUMBER = re.compile(r"^-?[\d,]+(?:\.\d+)?$")


def parse_nsys_stats(text: str) -> list[dict]:
    """The rows of one `nsys stats` summary report (cuda_gpu_kern_sum, nvtx_sum, ...), as dicts.

    Reads both the default column layout (a header row, a row of dashes, numbers with thousands separators)
    and `--format csv`; lines before the header (nsys's "Generating SQLite file ..." and "Processing ..."
    lines) are skipped. Keys are the report's own column names; numbers become floats; the last column (Name,
    Range) stays a string, spaces kept. Raises LabkitError when no header with "Time" and "Total Time" is found.
    """
    import csv

    if not isinstance(text, str):
        raise LabkitError(f"parse_nsys_stats needs the report's text, not {type(text).__name__}")
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if "Total Time" in ln and "Time" in ln.replace("Total Time", "")), None)
    if at is None:
        raise LabkitError("no nsys stats table here: expected a header row with 'Time (%)' and 'Total Time (ns)' "
                          "(nsys stats --report cuda_gpu_kern_sum or nvtx_sum)")
    head = lines[at]
    rows = []
    if head.lstrip().startswith('"') or head.count(",") >= 3:  # --format csv
        reader = csv.reader(ln for ln in lines[at:] if ln.strip())
        cols = [c.strip() for c in next(reader)]
        for vals in reader:
            if len(vals) == len(cols):
                rows.append(dict(zip(cols, vals, strict=True)))
    else:
        cols = re.split(r"\s{2,}", head.strip())
        for ln in lines[at + 1:]:
            if not ln.strip() or set(ln.strip()) <= {"-", " "}:
                continue
            parts = ln.strip().split(None, len(cols) - 1)
            if len(parts) == len(cols) and all(_NUMBER.match(v) for v in parts[:2]):  # Time (%), Total Time
                rows.append(dict(zip(cols, parts, strict=True)))
    out = []
    for r in rows:
        out.append({k: float(v.replace(",", "")) if k != cols[-1] and _NUMBER.match(v.strip()) else v.strip()
                    for k, v in r.items()})
    return out


def _column(rows: list[dict], *starts: str) -> str:
    for k in rows[0]:
        if any(k.replace(" ", "").startswith(s.replace(" ", "")) for s in starts):
            return k
    raise LabkitError(f"the nsys table has no column starting with {' or '.join(map(repr, starts))}: "
                      f"its columns are {list(rows[0])}")


def read_nsys_stats(kernels: str, nvtx: str, *, data: str = "data", step: str = "step") -> dict:
    """The dominant kernel and the data range's share of the step, from `nsys stats` output.

    `kernels`: the text of a cuda_gpu_kern_sum report; `nvtx`: an nvtx_sum report of a loop whose steps are
    NVTX ranges named `step` with a `data` range inside each (a name nsys prints with a leading ':' domain
    separator counts too). Returns top_kernel, top_kernel_share (of all kernel time; the report's Time (%)
    over 100), top_kernel_instances, kernel_ms (all kernels), steps (instances of the step range), step_ms and
    data_ms (mean per instance) and data_share: the data range's total time over the step range's.
    """
    krows, nrows = parse_nsys_stats(kernels), parse_nsys_stats(nvtx)
    if not krows:
        raise LabkitError("the kernel summary has no rows: did the profiled run launch any kernel?")
    if not nrows:
        raise LabkitError("the NVTX summary has no rows: were the NVTX ranges pushed (torch.cuda.nvtx.range)?")
    kt, kn, kname = _column(krows, "Total Time"), _column(krows, "Instances"), list(krows[0])[-1]
    top = max(krows, key=lambda r: r[kt])
    total_ns = sum(r[kt] for r in krows)
    nt, nn, rname = _column(nrows, "Total Time"), _column(nrows, "Instances"), list(nrows[0])[-1]
    ranges = {str(r[rname]).lstrip(":"): r for r in nrows}
    for want in (step, data):
        if want not in ranges:
            raise LabkitError(f"no NVTX range named {want!r} in the summary (it has {sorted(ranges)}): name the "
                              f"step's ranges {step!r} and {data!r}")
    s, d = ranges[step], ranges[data]
    return {"top_kernel": top[kname], "top_kernel_share": top[kt] / total_ns if total_ns else 0.0,
            "top_kernel_instances": int(top[kn]), "kernel_ms": total_ns / 1e6, "steps": int(s[nn]),
            "step_ms": s[nt] / max(1, s[nn]) / 1e6, "data_ms": d[nt] / max(1, d[nn]) / 1e6,
            "data_share": d[nt] / s[nt] if s[nt] else 0.0}


# -------------------------------------------------------------------------------------------------- CLI


def add_cli(sub) -> None:
    p = sub.add_parser("profile", help="profile a few training steps, write the trace, print the diagnosed bottleneck")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", help="ladder rung to profile (labkit ladder --list); the default is baseline")
    what.add_argument("--scenario", help="planted-bottleneck scenario: data, overhead, sync or compute")
    what.add_argument("--trace", metavar="PATH", help="diagnose an existing torch.profiler trace (.json or .json.gz)")
    p.add_argument("--fixed", action="store_true", help="with --scenario: profile the fixed version")
    p.add_argument("--out", default="runs/profile", help="folder for the trace, key-averages table and diagnosis")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--quick", action="store_true", help="small sizes (the default without a GPU)")
    p.add_argument("--full", action="store_true", help="full sizes even on a CPU (slow)")
    p.add_argument("--wait", type=int, help="steps before recording (default: chosen per target)")
    p.add_argument("--warmup", type=int, default=1, help="steps traced and discarded (default 1)")
    p.add_argument("--active", type=int, default=3, help="steps recorded and analysed (default 3)")
    p.add_argument("--list", action="store_true", help="list the scenarios and rungs, then exit")
    p.set_defaults(func=_cli_profile)


def _cli_profile(args) -> int:
    from labkit import scenarios as S
    from labkit import train as T
    from labkit.bench import write_json
    from labkit.env import quick_mode

    if args.list:
        for s in S.SCENARIOS.values():
            print(f"scenario {s.name:<9} planted: {s.planted}\n{'':18} fix: {s.fix}")
        print("rungs: " + ", ".join(T.RUNG_NAMES))
        return 0
    if args.trace:
        d = diagnose(args.trace)
        print(d)
        return 0
    if args.fixed and not args.scenario:
        raise LabkitError("--fixed goes with --scenario NAME")
    dev = pick_device(args.device)
    quick = args.quick or (quick_mode() and not args.full)
    if args.scenario:
        if args.scenario not in S.SCENARIOS:
            raise LabkitError(f"unknown scenario {args.scenario!r}: choose one of {', '.join(S.SCENARIOS)}")
        sc = S.SCENARIOS[args.scenario]
        if dev.type != "cuda" and not sc.cpu_shows_it:
            print(f"note: {sc.name} on a CPU: {sc.cpu_note}")
        target = S.workload(args.scenario, dev, fixed=args.fixed, quick=quick)
    else:
        name = args.preset or "baseline"
        target = T.preset(name, T.quick_base() if quick else T.TrainConfig())
        if dev.type != "cuda":
            T.check_config(target, dev)
    sched = suggest_schedule(target, dev, active=args.active)
    sched = ProfileSchedule(wait=sched.wait if args.wait is None else args.wait, warmup=args.warmup,
                            active=args.active)
    print(f"profiling {getattr(target, 'name', None) or target.cfg.name} on {dev} "
          f"(wait {sched.wait}, warmup {sched.warmup}, active {sched.active} steps)"
          + (" in quick mode" if quick else "") + ("" if dev.type == "cuda" else "; no GPU: CPU operators only"))
    prof = profile_steps(target, dev, schedule=sched, out=args.out, progress=True)
    d = prof.diagnose()
    diag_path = Path(args.out) / f"{_safe(prof.name)}.diagnosis.json"
    write_json(diag_path, d.to_dict())
    print("\n".join(prof.table.splitlines()[:14]))
    print(d)
    print(f"wrote {prof.trace_path} (open in https://ui.perfetto.dev), {diag_path}")
    return 0

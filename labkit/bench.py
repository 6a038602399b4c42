"""The one place where timing happens.

Rules it enforces: warm up before measuring, synchronize the device (CUDA events on GPU), repeat, report the
median with its spread (IQR, p95), compare A and B interleaved in one process and report the ratio with its
spread, and attach the environment record to every saved result.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit.env import REPO_ROOT, LabkitError, environment
from labkit.outputs import write_json  # noqa: F401  (re-exported: results are written through labkit.bench)

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
if not RESULTS_DIR.is_dir():  # an installed student release carries the recorded results inside the package
    RESULTS_DIR = Path(__file__).resolve().parent / "results"


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty sequence."""
    if not xs:
        raise ValueError("quantile of an empty sequence")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Timing:
    """Per-call times in seconds from repeated measurements."""

    samples: list[float]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> float:
        return quantile(self.samples, 0.75) - quantile(self.samples, 0.25)

    @property
    def p95(self) -> float:
        return quantile(self.samples, 0.95)

    @property
    def min(self) -> float:
        return min(self.samples)

    def throughput(self, items_per_call: float) -> float:
        """Items per second at the median time (e.g. img/s for a step of `items_per_call` images)."""
        return items_per_call / self.median

    def summary(self) -> dict:
        return {"median_s": self.median, "iqr_s": self.iqr, "p95_s": self.p95, "min_s": self.min,
                "n": len(self.samples)}

    def __str__(self) -> str:
        return f"{_fmt_s(self.median)} ± {_fmt_s(self.iqr)} (IQR, n={len(self.samples)})"


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on `device` (no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Clock:
    """Measures one region: CUDA events on a GPU (no host stall inside the region), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self):
        if self.cuda:
            self._a = torch.cuda.Event(enable_timing=True)
            self._b = torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._b.record()
            self._b.synchronize()
            return self._a.elapsed_time(self._b) / 1e3
        return time.perf_counter() - self._t


def time_fn(fn: Callable[[], object], *, device: torch.device | str | None = None, warmup: int = 3,
            repeats: int = 10, inner: int = 1) -> Timing:
    """Time `fn()` after `warmup` calls; `repeats` samples of `inner` calls each; seconds per call.

    On CUDA the region is bracketed by CUDA events and the device is synchronized before the first sample.
    """
    if repeats < 1 or inner < 1 or warmup < 0:
        raise LabkitError("time_fn needs repeats >= 1, inner >= 1 and warmup >= 0")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        fn()
    synchronize(dev)
    clock, samples = _Clock(dev), []
    for _ in range(repeats):
        clock.start()
        for _ in range(inner):
            fn()
        samples.append(clock.stop() / inner)
    return Timing(samples)


def torch_timer(fn: Callable[[], object], *, min_run_time: float = 0.5, label: str = "") -> Timing:
    """Time a small operation with torch.utils.benchmark (it picks the number of calls per sample itself)."""
    from torch.utils import benchmark as tub

    m = tub.Timer(stmt="fn()", globals={"fn": fn}, label=label).blocked_autorange(min_run_time=min_run_time)
    return Timing([t for t in m.times])


@dataclass
class ABResult:
    """Interleaved comparison of A (usually the baseline) and B: ratio = time_A / time_B, so >1 means B is faster."""

    a: Timing
    b: Timing
    ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def ratio_iqr(self) -> float:
        return quantile(self.ratios, 0.75) - quantile(self.ratios, 0.25)

    @property
    def ratio_range(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    def summary(self) -> dict:
        return {"a": self.a.summary(), "b": self.b.summary(), "ratio": self.ratio, "ratio_iqr": self.ratio_iqr,
                "ratio_min": self.ratio_range[0], "ratio_max": self.ratio_range[1], "rounds": len(self.ratios)}

    def __str__(self) -> str:
        lo, hi = self.ratio_range
        return (f"B (the second) is {self.ratio:.2f}x as fast as A (the first): A's time over B's, IQR "
                f"{self.ratio_iqr:.2f}, range {lo:.2f}-{hi:.2f}, {len(self.ratios)} rounds")


def compare(fn_a: Callable[[], object], fn_b: Callable[[], object], *, device: torch.device | str | None = None,
            rounds: int = 7, warmup: int = 2, inner: int = 1) -> ABResult:
    """Time A and B alternately (ABBA order) so that drift (clocks, caches, other load) hits both alike.

    Each round yields one time for A, one for B and their ratio; the ratio's median and spread are reported.
    """
    if rounds < 1:
        raise LabkitError("compare needs rounds >= 1")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        fn_a()
        fn_b()
    synchronize(dev)
    clock = _Clock(dev)
    ta, tb = [], []

    def one(fn):
        clock.start()
        for _ in range(inner):
            fn()
        return clock.stop() / inner

    for r in range(rounds):
        if r % 2 == 0:
            a = one(fn_a)
            b = one(fn_b)
        else:
            b = one(fn_b)
            a = one(fn_a)
        ta.append(a)
        tb.append(b)
    return ABResult(Timing(ta), Timing(tb), [x / y for x, y in zip(ta, tb, strict=True)])


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run a block with `n` intra-op CPU threads in this process (None: unchanged), then restore the count."""
    saved = torch.get_num_threads()
    try:
        if n is not None:
            torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def compile_cache(path: str | os.PathLike | None = None):
    """Point torch.compile's on-disk caches at `path`; a fresh temporary folder (a cold start) when None.

    Inductor keeps compiled graphs and kernels, and Triton its binaries, in a folder that outlives the process,
    so a machine that compiled the model once compiles it again in seconds: a compile time measured there is not
    what a student on a fresh Colab machine waits. Inside this context both caches live in `path` and compiled
    code held in memory is forgotten on entry and on exit, so the next compile reads only `path`. Entering twice
    with the same folder measures a cold start, then a warm one. The environment is restored afterwards and a
    temporary folder removed. A folder that cannot be written is replaced by a temporary one, with one line on
    stderr saying so. Yields the folder used.
    """
    import torch._dynamo

    def forget():
        torch._dynamo.reset()
        try:  # the in-memory twins of the disk caches; private, so tolerate its absence
            from torch._inductor.utils import clear_caches
        except ImportError:
            return
        clear_caches()

    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    tmp = tempfile.mkdtemp(prefix="labkit-compile-") if path is None else None
    folder = os.path.abspath(tmp or os.fspath(path))
    why = None if tmp else unwritable(folder)
    if why:  # torch.compile cannot work without writing there: compile cold in a folder that can be written
        tmp = tempfile.mkdtemp(prefix="labkit-compile-")
        print(f"compile cache folder {folder} cannot be written ({why}): compiling from scratch in {tmp}",
              file=sys.stderr, flush=True)
        folder = tmp
    forget()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    try:
        yield folder
    finally:
        forget()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def unwritable(folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot take new files (it is created if missing), or None when it can."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


# ---------------------------------------------------------------------------------------------- results


def save_result(name: str, data: dict, *, out_dir: str | os.PathLike | None = None, command=None,
                device=None) -> Path:
    """Save `data` as `<out_dir>/<name>.json` with the environment record under "env"; returns the path."""
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise LabkitError(f"bad result name {name!r}: use a plain file stem such as 'matmul_h100'")
    payload = {"name": name, "env": environment(command=command, device=device), **data}
    return write_json(Path(out_dir or RESULTS_DIR) / f"{name}.json", payload)


def result_path(name: str, *, topic: str | None = None, results_dir: str | os.PathLike | None = None) -> Path:
    """Where the recorded file or folder `name` (such as "ladder.json" or "trace_corpus") lives: in the results
    folder itself (an installed release keeps its records there) or in one of its topic folders (benchmarks/results/
    ladder/, coldstart/, ...; archive/ holds the superseded ones). Two of the same name are an error, so a name
    always means one record. A name found nowhere gives the path where it would go: in folder `topic` if given, else
    at the top (a path that does not exist either way)."""
    if not name or any(c in name for c in "/\\"):
        raise LabkitError(f"bad result name {name!r}: use a file or folder name such as 'ladder.json'")
    root = Path(results_dir or RESULTS_DIR)
    found = [p for p in (root / name, *sorted(root.glob(f"*/{glob.escape(name)}"))) if p.exists()]
    if len(found) > 1:
        raise LabkitError(f"two recorded results are named {name!r} ({', '.join(map(str, found))}): rename one")
    return found[0] if found else root / (topic or "") / name


class Records:
    """A results folder read by name: `Records() / "ladder.json"` is that record's path in whichever topic folder
    holds it (`result_path`), so a reader names a record without naming its topic."""

    def __init__(self, results_dir: str | os.PathLike | None = None):
        self.root = Path(results_dir or RESULTS_DIR)

    def __truediv__(self, name: str | os.PathLike) -> Path:
        return result_path(str(name), results_dir=self.root)

    def __repr__(self) -> str:
        return f"Records({str(self.root)!r})"


def load_result(name_or_path: str | os.PathLike, *, results_dir: str | os.PathLike | None = None) -> dict:
    """Load a saved result by name (from benchmarks/results/ and its topic folders, see `result_path`) or by path,
    with a clear error if it is missing."""
    p = Path(name_or_path)
    if not p.suffix:
        p = (result_path(f"{p}.json", results_dir=results_dir) if len(p.parts) == 1
             else Path(results_dir or RESULTS_DIR) / f"{p}.json")
    if not p.exists():
        raise LabkitError(f"no recorded result at {p}: run the benchmark that writes it, or check the name")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LabkitError(f"recorded result {p} is not valid JSON ({e.msg} at line {e.lineno})") from e


def recorded_note(result: dict) -> str:
    """One line naming where a recorded number came from: card, torch, commit, date."""
    env = result.get("env", {})
    return (f"recorded on {env.get('device_name', '?')}, torch {env.get('torch', '?')}, "
            f"commit {str(env.get('git_commit', '?'))[:12]}, {env.get('timestamp', '?')}: {env.get('command', '')}")


# ------------------------------------------------------------------------------------------------ machine load

# Other programs' CPU use above this share of the machine's cores makes a CPU timing untrustworthy: on 2 cores,
# 0.2 of a core taken by something else already shifts a compute-bound rate by about a tenth.
LOADED_SHARE = 0.10


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time every core has spent busy since boot (/proc/stat: user, nice, system, irq, softirq,
    steal), or None where there is no /proc/stat (macOS, Windows)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have exited (DataLoader workers once joined)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):  # Windows has no load average
        return None


class MachineLoad:
    """How much CPU other programs took while a measurement ran: start it, run, then `stop()`.

    Other programs' cores = (all cores' busy seconds - this process's own CPU seconds) / wall seconds, from
    /proc/stat and getrusage. Workers still alive at `stop()` count as others, so stop after they are joined.
    Without /proc/stat only the load averages are known (they count this process's threads too), and the
    verdict is None.
    """

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
        self.loadavg_before = _loadavg()

    def stop(self) -> dict:
        """{"cores", "wall_s", "own_cores" (this process's CPU seconds / wall seconds), "other_cores" (None
        without /proc/stat), "loadavg_before"/"loadavg_after" (1, 5, 15 minutes), "trustworthy" (other
        programs under LOADED_SHARE of the cores; None where unknown), "why" (a line saying so)}."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        busy = _busy_cpu_s()
        own = (_own_cpu_s() - self.own0) / wall
        other = None if busy is None or self.busy0 is None else max(0.0, (busy - self.busy0) / wall - own)
        rec = {"cores": self.cores, "wall_s": wall, "own_cores": own, "other_cores": other,
               "loadavg_before": self.loadavg_before, "loadavg_after": _loadavg(), "limit_share": LOADED_SHARE}
        return {**rec, **verdict(rec)}


def verdict(load: dict) -> dict:
    """{"trustworthy": bool | None, "why": str} for a `MachineLoad.stop()` record (or several merged)."""
    other, cores = load.get("other_cores"), load["cores"]
    avg = load.get("loadavg_before")
    if other is None:
        return {"trustworthy": None, "why": f"other programs' CPU use is unknown here (no /proc/stat); load "
                                            f"average before: {avg[0] if avg else 'unknown'}"}
    ok = other <= LOADED_SHARE * cores
    why = (f"other programs used {other:.2f} of the {cores} CPU cores on average while it ran "
           f"({'within' if ok else 'above'} the {100 * LOADED_SHARE:.0f}% that a trustworthy timing allows)")
    if avg:
        why += f"; load average {avg[0]:.1f} before, {(load.get('loadavg_after') or avg)[0]:.1f} after"
    return {"trustworthy": ok, "why": why}

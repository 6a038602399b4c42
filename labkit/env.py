"""What machine is this, what can it do, and which switches are on.

`environment()` is attached to every result file; `doctor()` is the `labkit doctor` command;
`torch_switches()` flips TF32 / cuDNN switches for a block and restores them afterwards. `gpu_facts()` is the one
reader of the card's facts (name, compute capability, memory, SMs): tests fake a T4 through it (tests/t4_fake.py).
Nothing here changes global state at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from labkit.errors import LabkitError
from labkit.outputs import write_json

REPO_ROOT = Path(__file__).resolve().parents[1]

# (distribution name, import name) of everything the course needs at run time.
REQUIRED_PACKAGES = [
    ("torch", "torch"),
    ("torchvision", "torchvision"),
    ("numpy", "numpy"),
    ("matplotlib", "matplotlib"),
    ("tqdm", "tqdm"),
    ("line-profiler", "line_profiler"),
    ("memory-profiler", "memory_profiler"),
    ("jupyterlab", "jupyterlab"),
    ("nbgrader", "nbgrader"),
]
# Useful but not required: their absence only disables one part.
OPTIONAL_PACKAGES = [("lightning", "lightning"), ("py-spy", None)]


def replace_fields(cfg, **changes):
    """A copy of dataclass instance `cfg` with fields replaced; unknown field names raise a LabkitError."""
    names = [f.name for f in dataclasses.fields(cfg)]
    bad = sorted(set(changes) - set(names))
    if bad:
        raise LabkitError(f"unknown {type(cfg).__name__} field(s) {bad}: choose from {', '.join(names)}")
    return dataclasses.replace(cfg, **changes)


def quick_mode() -> bool:
    """True when notebooks and commands should use their small CPU-sized settings.

    Set LABKIT_QUICK=1 to force it, LABKIT_QUICK=0 to force full size; by default it is on without CUDA.
    """
    flag = os.environ.get("LABKIT_QUICK")
    if flag is not None and flag.strip() != "":
        return flag.strip().lower() not in ("0", "false", "no")
    return not torch.cuda.is_available()


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """Resolve 'auto'/None (CUDA if present, else CPU) or a device string, with a clear error if unusable."""
    if isinstance(name, torch.device):
        name = str(name)
    if name in (None, "", "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise LabkitError(f"unknown device {name!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LabkitError(f"device {name!r} asked for, but this machine has no CUDA GPU: use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LabkitError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
        if dev.index is None:  # an explicit index, so that tensor.device == device comparisons hold
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise LabkitError("device 'mps' asked for, but MPS is not available here: use --device cpu")
    elif dev.type != "cpu":
        raise LabkitError(f"device type {dev.type!r} is not supported by labkit: use cpu or cuda")
    return dev


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checkout's commit hash, with '+dirty' when tracked files have uncommitted changes.

    Outside a git checkout (a copied tree on a benchmark host) LABKIT_GIT_COMMIT names it; else None.
    """
    if os.environ.get("LABKIT_GIT_COMMIT"):
        return os.environ["LABKIT_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# bf16 tensor cores arrived with Ampere (compute capability 8.0). torch.cuda.is_bf16_supported() also says yes on
# older cards, where bf16 is emulated in fp32 units: slower than fp32, not a tensor-core format.
NATIVE_BF16_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What the kit reads about a CUDA card: one record, so that a test can fake a card (tests/t4_fake.py)."""

    name: str  # as torch.cuda.get_device_name() reports it, e.g. "Tesla T4"
    capability: tuple[int, int]  # CUDA compute capability (major, minor)
    memory_bytes: int  # total device memory, bytes
    multiprocessors: int  # streaming multiprocessors (SMs)
    bf16_emulated: bool  # torch runs bf16 here without bf16 tensor cores (capability < 8.0)
    simulated: bool = False  # True only for a test's faked card: nothing measured under it is a GPU number


def gpu_facts(device: torch.device | str | None = None) -> GpuFacts | None:
    """The card behind `device` (None for a CPU or MPS device): the one place the kit asks torch.cuda about
    hardware, for native_bf16, capabilities, environment, waves.sm_count and the grader's hardware classes."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(dev)
    cap = tuple(torch.cuda.get_device_capability(dev))
    return GpuFacts(name=torch.cuda.get_device_name(dev), capability=cap, memory_bytes=props.total_memory,
                    multiprocessors=props.multi_processor_count,
                    bf16_emulated=cap < NATIVE_BF16_CAPABILITY and bool(torch.cuda.is_bf16_supported()))


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether bf16 runs on this device's matrix units: CUDA compute capability 8.0+, or a CPU (autocast's bf16).

    Not `torch.cuda.is_bf16_supported()`, which counts emulation (a T4, capability 7.5, answers yes).
    """
    facts = gpu_facts(device)
    return facts is None or facts.capability >= NATIVE_BF16_CAPABILITY


def amp_precision(device: torch.device | str | None = None) -> str:
    """The 16-bit autocast format the kit trains in here: "bf16" where native, "fp16" (+ GradScaler) on older GPUs."""
    return "bf16" if native_bf16(device) else "fp16"


def capabilities(device: torch.device | str | None = None) -> dict:
    """What the device supports: tensor cores, bf16/fp16/fp8 math, TF32, and the current switch settings.

    "bf16" is native bf16 only (compute capability 8.0+); "bf16_emulated" says torch runs it anyway, without
    tensor cores; "amp" is the 16-bit format the course uses here (`amp_precision`). "device_type" is where
    tensors compute; the card's fields come from `gpu_facts` (under a test's faked card: that card, on a CPU).
    """
    dev = pick_device(device)
    caps = {
        "device_type": dev.type,
        "cudnn_available": bool(torch.backends.cudnn.is_available()),
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "tf32_matmul_enabled": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn_enabled": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    facts = gpu_facts(dev)
    if facts is not None:
        major, minor = facts.capability
        cc = major + minor / 10
        native = facts.capability >= NATIVE_BF16_CAPABILITY
        caps.update(
            name=facts.name,
            capability=f"{major}.{minor}",
            tensor_cores=major >= 7,
            fp16_tensor_cores=major >= 7,
            bf16=native,
            bf16_emulated=facts.bf16_emulated,
            tf32=major >= 8,
            fp8=cc >= 8.9 and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm"),
            amp="bf16" if native else "fp16",
            memory_bytes=facts.memory_bytes,
            multiprocessors=facts.multiprocessors,
        )
        if facts.simulated:
            caps["simulated"] = True
    else:
        caps.update(name=platform.processor() or platform.machine(), capability=None, tensor_cores=False,
                    fp16_tensor_cores=False, bf16=True, bf16_emulated=False, tf32=False, fp8=False, amp="bf16")
    return caps


def environment(command: str | list[str] | None = None, device: torch.device | str | None = None) -> dict:
    """The record attached to every result: device, versions, CPU count, git commit and the command that ran."""
    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    if isinstance(command, list):
        command = shlex.join(command)
    try:
        dev = pick_device(device)
    except LabkitError:
        dev = torch.device("cpu")
    rec = {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "command": command,
        "git_commit": git_commit(),
        "labkit": _version("labkit"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device_type": dev.type,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        # NCCL settings change multi-GPU numbers (protocol, algorithm, NVLink multicast): keep them with the result
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        # without cached bytecode every process recompiles torch: a start-up time is not comparable across that
        "bytecode": bytecode_status(),
    }
    facts = gpu_facts(dev)
    if dev.type == "cuda" and facts is not None:
        rec.update(device_name=facts.name, capability="{}.{}".format(*facts.capability),
                   gpu_memory_bytes=facts.memory_bytes, driver=_nvidia_driver())
    else:  # timings made on the CPU are CPU numbers, whatever card a test fakes
        rec.update(device_name=f"CPU ({platform.machine()}, {os.cpu_count()} cores)", capability=None)
    if facts is not None and facts.simulated:
        rec["simulated_gpu"] = facts.name
    return rec


# Sources whose bytecode decides how long a new process takes to import torch and its compiler (torch.compile
# imports the last two). Checked by path, not by importing them: the check is for before the cost is paid.
BYTECODE_SOURCES = ("__init__.py", "_dynamo/convert_frame.py", "_inductor/compile_fx.py")


def bytecode_status() -> dict:
    """Whether a new Python process finds torch's compiled bytecode (.pyc) or compiles its sources again.

    pip and conda compile it at install; an install made with `pip --no-compile` into a folder Python may not
    write (a container image, PYTHONDONTWRITEBYTECODE=1) leaves every new process recompiling torch: seconds
    for `import torch` and more for torch.compile's modules, each run. Keys: cached (bool), missing (sources
    without bytecode), writes (whether this Python writes bytecode), prefix (sys.pycache_prefix, where it does).
    """
    spec = importlib.util.find_spec("torch")
    root = Path(spec.origin).parent if spec and spec.origin else None
    missing = [s for s in BYTECODE_SOURCES
               if root is None or not Path(importlib.util.cache_from_source(str(root / s))).exists()]
    return {"cached": not missing, "missing": missing, "writes": not sys.dont_write_bytecode,
            "prefix": sys.pycache_prefix}


def _bytecode_fix(code: dict) -> str:
    """What to do about a torch without cached bytecode (`bytecode_status()`), for doctor's line."""
    if not code["writes"]:
        return ("unset PYTHONDONTWRITEBYTECODE (Python writes no bytecode now) and set PYTHONPYCACHEPREFIX to a "
                "folder you may write")
    if code["prefix"]:
        return f"the processes after this one find it under PYTHONPYCACHEPREFIX={code['prefix']}"
    return "set PYTHONPYCACHEPREFIX=~/.cache/pycache (a folder you may write) to keep it"


def process_age_s(at: float | None = None) -> float | None:
    """Seconds from this process's start to `at` (a time.perf_counter() reading; now if None): the interpreter
    and imports before a command runs. None where the start time cannot be read (only Linux's /proc is read)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    now_age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    return max(0.0, now_age - (time.perf_counter() - at if at is not None else 0.0))


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


@contextlib.contextmanager
def torch_switches(*, tf32: bool | None = None, cudnn_benchmark: bool | None = None,
                   cudnn_deterministic: bool | None = None, cudnn_limit: int | None = None):
    """Set TF32 (matmul and cuDNN), cudnn.benchmark, cudnn.benchmark_limit (algorithms timed per shape) and
    cudnn.deterministic for a block, then restore them.

    None leaves a switch as it is, untouched, and a block leaves no trace: setting the float32 matmul precision,
    even to its current value, changes torch.compile's cache keys, so a compile-cache artifact built in one process
    would miss in another that had run such a block (`benchmarks/results/coldstart/cold_start_warmup_keys.json`). Strict fp32
    needs tf32=False: cuDNN convolutions use TF32 by default.
    """
    cudnn = torch.backends.cudnn
    given = {"benchmark": cudnn_benchmark, "deterministic": cudnn_deterministic, "benchmark_limit": cudnn_limit}
    saved = {k: getattr(cudnn, k) for k, v in given.items() if v is not None}
    if tf32 is not None:
        saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
        # the precision setters also mark these as set ("none" -> "ieee"): put back what they were, or the
        # compile-cache keys after the block differ from before it
        marks = [m for m in (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
                 if hasattr(m, "fp32_precision")]
        saved_marks = [m.fp32_precision for m in marks]
    try:
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            cudnn.allow_tf32 = tf32
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
        for k in saved:
            setattr(cudnn, k, given[k])
        yield
    finally:
        for k, v in saved.items():
            setattr(cudnn, k, v)
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32, prec = saved_tf32
            torch.set_float32_matmul_precision(prec)
            for m, mark in zip(marks, saved_marks, strict=True):
                m.fp32_precision = mark


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".strip()


def check_packages(packages=None) -> list[dict]:
    """Import each required package; returns one row per package with its version and any error (one line)."""
    rows = []
    for dist, mod in packages if packages is not None else REQUIRED_PACKAGES:
        row = {"package": dist, "version": _version(dist), "error": None}
        if mod is not None:
            try:
                importlib.import_module(mod)
            except Exception as e:  # any failure to import is what doctor reports
                row["error"] = error_line(e)
        if row["version"] is None and row["error"] is None and mod is not None:
            row["version"] = getattr(sys.modules.get(mod), "__version__", "unknown")
        rows.append(row)
    return rows


# What each week needs, for doctor's "what can run here" section.
_WEEKS = [
    ("1 floating-point formats", lambda c: "full", None),
    ("2 tensor cores", lambda c: "full" if c["tensor_cores"] else "quick",
     "no tensor cores: CPU timings only, recorded H100 results shown instead"),
    ("3 mixed precision", lambda c: "full" if c["fp16_tensor_cores"] else "quick",
     "no CUDA: fp16/GradScaler speed shown from recorded results, bf16 autocast on CPU"),
    ("4 data loading", lambda c: "full" if c["device_type"] == "cuda" else "quick",
     "no CUDA: GPU-side augmentation and GPU decoding skipped"),
    ("5 profiling", lambda c: "full" if c["device_type"] == "cuda" else "quick",
     "no CUDA: GPU kernel traces and two GPU-only bottleneck scenarios skipped"),
    ("6 ResNet-18 ladder", lambda c: "full" if c["device_type"] == "cuda" else "quick",
     "no CUDA: quick CPU ladder; AMP-fp16, compile-heavy and CUDA-graph rungs skipped"),
    ("6 (16-bit format)", lambda c: "full" if c.get("amp") == "bf16" or c["device_type"] != "cuda" else "fp16",
     "compute capability below 8.0 (a T4): the bf16 rung runs as fp16 autocast with GradScaler"),
]


def doctor(out=None, packages=None, device=None) -> int:
    """Print the environment, capabilities and what runs here; return 0, or 1 if a required package is broken."""
    out = out or sys.stdout
    env = environment(device=device)
    caps = capabilities(device)

    def p(*a):
        print(*a, file=out)

    p("labkit doctor")
    p(f"  python {env['python']} on {env['platform']}, {env['cpu_count']} CPU cores")
    p(f"  torch {env['torch']}  cuda {env['cuda']}  cudnn {env['cudnn']}  git {env['git_commit']}")
    p(f"  device: {caps['name']} ({caps['device_type']}"
      + (f", compute capability {caps['capability']}" if caps["capability"] else "") + ")")
    for key in ("tensor_cores", "bf16", "tf32", "fp8"):
        p(f"  {key:<14} {'yes' if caps[key] else 'no'}"
          + ("  (emulated by torch, no bf16 tensor cores: the course uses fp16 + loss scaling here)"
             if key == "bf16" and caps.get("bf16_emulated") else ""))
    p(f"  TF32 switches: matmul={caps['tf32_matmul_enabled']} cudnn={caps['tf32_cudnn_enabled']} "
      f"(float32_matmul_precision={caps['float32_matmul_precision']}); cudnn.benchmark={caps['cudnn_benchmark']}")
    code = bytecode_status()
    if not code["cached"]:
        p("  bytecode: no cached .pyc for torch, so every new Python process compiles its sources again (seconds "
          f"of each `import torch`, more for torch.compile): {_bytecode_fix(code)}")
    p("packages:")
    rows = check_packages(packages)
    for r in rows:
        state = "ok" if r["error"] is None and r["version"] else (r["error"] or "not installed")
        p(f"  {r['package']:<16} {r['version'] or '-':<14} {state}")
    for dist, _mod in OPTIONAL_PACKAGES:
        p(f"  {dist:<16} {_version(dist) or '-':<14} optional")
    p("what runs here:")
    for week, mode, why in _WEEKS:
        m = mode(caps)
        p(f"  week {week:<26} {m}" + (f"  ({why})" if m != "full" and why else ""))
    bad = [r for r in rows if r["error"] is not None or not r["version"]]
    if bad:
        names = ", ".join(r["package"] for r in bad)
        first = bad[0]["error"] or "not installed"
        print(f"labkit doctor: required package(s) missing or broken: {names} ({first}); "
              f"fix with: pip install -e . (or make setup)", file=sys.stderr)
        return 1
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("doctor", help="print the environment, capabilities and what the course can run here")
    p.add_argument("--device", default="auto", help="device to inspect (auto, cpu, cuda, cuda:N)")
    p.add_argument("--json", metavar="PATH", help="also write the environment and capabilities as JSON")
    p.set_defaults(func=_cli_doctor)


def _cli_doctor(args) -> int:
    code = doctor(device=args.device)
    if args.json:
        write_json(args.json, {"kind": "doctor", "env": environment(device=args.device),
                               "capabilities": capabilities(args.device),
                               "packages": check_packages(), "exit_code": code})
    return code

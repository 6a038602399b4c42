"""Tensor Core matmuls: TFLOP/s by dtype and by shape, the TF32 switches, arithmetic intensity and a roofline,
and which kernels ran.

Kinds: "fp32" is strict fp32 (TF32 off, CUDA cores), "tf32" the same fp32 tensors with TF32 tensor-core math,
"fp16"/"bf16" half-precision tensors, "fp8" float8_e4m3fn tensors multiplied by `torch._scaled_mm` with a bf16
output (Hopper/Ada). All timing goes through labkit.bench.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

import torch

from labkit import bench
from labkit.env import LabkitError, capabilities, environment, pick_device, quick_mode, torch_switches
from labkit.floats import round_to, text_table
from labkit.outputs import save_figure, write_json

KINDS = {
    "fp32": "strict fp32: TF32 off, CUDA cores",
    "tf32": "fp32 tensors, TF32 tensor-core math (allow_tf32 / matmul precision 'high')",
    "fp16": "float16 tensors, fp32 accumulation",
    "bf16": "bfloat16 tensors, fp32 accumulation",
    "fp8": "float8_e4m3fn tensors via torch._scaled_mm, per-tensor scales, bf16 output",
}
INPUT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
OUTPUT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
_TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise LabkitError(f"unknown matmul kind {kind!r}: use one of {', '.join(KINDS)}")
    return kind


@contextlib.contextmanager
def tf32(enabled: bool = True) -> Iterator[None]:
    """TF32 tensor-core math for fp32 matmuls and convolutions inside the block (restored afterwards)."""
    with torch_switches(tf32=enabled):
        yield


def strict_fp32() -> contextlib.AbstractContextManager:
    """True fp32 matmuls and convolutions inside the block: TF32 off for both cuBLAS and cuDNN."""
    return tf32(False)


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) product: one multiply and one add per term."""
    return 2 * m * n * k


def arithmetic_intensity(m: int, n: int, k: int, kind: str = "bf16") -> float:
    """FLOP per byte of DRAM traffic if each operand is read once and the output written once."""
    _check_kind(kind)
    moved = INPUT_BYTES[kind] * (m * k + k * n) + OUTPUT_BYTES[kind] * m * n
    return matmul_flops(m, n, k) / moved


def roofline(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Attainable FLOP/s at `intensity` (FLOP/byte): min(peak FLOP/s, bandwidth bytes/s * intensity)."""
    return min(peak_flops, bandwidth * intensity)


def pad_to_multiple(n: int, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that is >= n (pad a dimension so tensor-core tiles fit)."""
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------- fp8 matmul


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False) -> torch.Tensor:
    """fp8 matmul (a row-major, b column-major, float32 scalar dequantization scales) across torch versions:
    older torch returned (out, amax) and took optional scales; newer takes them as required keywords."""
    fn = getattr(torch, "_scaled_mm", None)
    if fn is None:
        raise LabkitError(f"torch {torch.__version__} has no torch._scaled_mm: fp8 matmuls need torch >= 2.1")
    try:
        out = fn(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    except TypeError:  # signatures before scale_a/scale_b were keywords
        out = fn(a, b, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b)
    return out[0] if isinstance(out, tuple) else out


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled cast to fp8: returns (x * s as fp8, 1/s as a float32 scalar tensor) with s chosen so
    the largest |x| maps to the format's max."""
    dtype = dtype or torch.float8_e4m3fn
    amax = x.abs().max().float().clamp(min=1e-12)
    s = torch.finfo(dtype).max / amax
    return (x.float() * s).to(dtype), (1.0 / s).float().reshape(())


def kind_support(kind: str, device=None) -> tuple[bool, str]:
    """Can `kind` run on `device`, and what it means there: (runs, one-line reason)."""
    _check_kind(kind)
    dev = pick_device(device)
    if dev.type != "cuda":
        if kind == "tf32":
            return True, "CPU: the TF32 switch only affects CUDA, so this is plain fp32"
        if kind == "fp8":
            ok, why = _fp8_probe(dev)
            return ok, ("CPU: emulated, no fp8 hardware" if ok else why)
        return True, "CPU: no tensor cores"
    caps = capabilities(dev)
    if kind == "tf32" and not caps["tf32"]:
        return True, f"compute capability {caps['capability']} has no TF32: runs as fp32"
    if kind == "bf16" and not caps["bf16"]:
        return False, f"compute capability {caps['capability']} has no bf16 math"
    if kind == "fp8":
        if not caps["fp8"]:
            return False, f"fp8 tensor cores need compute capability >= 8.9 (this card: {caps['capability']})"
        return _fp8_probe(dev)
    return True, "tensor cores" if caps["tensor_cores"] and kind != "fp32" else "CUDA cores"


def _fp8_probe(dev: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no float8_e4m3fn"
    try:
        a, sa = quantize_fp8(torch.randn(32, 32, device=dev))
        b, sb = quantize_fp8(torch.randn(32, 32, device=dev))
        scaled_mm(a, b.t(), sa, sb)
    except LabkitError as e:
        return False, str(e)
    except RuntimeError as e:
        return False, f"torch._scaled_mm failed here: {str(e).strip().splitlines()[0][:160]}"
    return True, "fp8 tensor cores via torch._scaled_mm"


# --------------------------------------------------------------------------------------------- timing


def make_matmul(kind: str, m: int, n: int | None = None, k: int | None = None, device=None,
                seed: int = 0, fast_accum: bool = False) -> Callable[[], torch.Tensor]:
    """A zero-argument function computing one (m x k) @ (k x n) product of random normal data in `kind`.

    The fp32/tf32 switch is set inside each call, so the two can be timed interleaved. fp8 needs every
    dimension to be a multiple of 16; `fast_accum` (fp8 only) lets Hopper accumulate in lower precision.
    """
    _check_kind(kind)
    n, k = n or m, k or m
    if min(m, n, k) < 1:
        raise LabkitError(f"matrix sizes must be positive, got m={m} n={n} k={k}")
    if kind == "fp8" and any(d % 16 for d in (m, n, k)):
        raise LabkitError(f"fp8 matmuls need every dimension to be a multiple of 16, got {m}x{n}x{k}: "
                          f"pad to {pad_to_multiple(m, 16)}x{pad_to_multiple(n, 16)}x{pad_to_multiple(k, 16)}")
    dev = pick_device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: 8192^2 normals on a CPU take seconds
    a32 = torch.randn(m, k, generator=g, device=dev)
    bt32 = torch.randn(n, k, generator=g, device=dev)  # b stored transposed: column-major, as fp8 requires
    if kind == "fp8":
        a, sa = quantize_fp8(a32)
        bt, sb = quantize_fp8(bt32)
        b = bt.t()
        return lambda: scaled_mm(a, b, sa, sb, use_fast_accum=fast_accum)
    dtype = _TORCH_DTYPE[kind]
    a, b = a32.to(dtype), bt32.to(dtype).t().contiguous()
    out = torch.empty(m, n, device=dev, dtype=dtype)
    if kind in ("fp32", "tf32"):
        use_tf32 = kind == "tf32"

        def run():
            with torch_switches(tf32=use_tf32):
                return torch.mm(a, b, out=out)

        return run
    return lambda: torch.mm(a, b, out=out)


def _inner_for(fn: Callable, dev: torch.device, target_s: float) -> int:
    """Calls per sample so that one sample lasts about `target_s` (CUDA events are coarse for tiny kernels)."""
    one = bench.time_fn(fn, device=dev, warmup=1, repeats=1).median
    return max(1, min(1000, int(target_s / max(one, 1e-7))))


def bench_matmul(kind: str, m: int, n: int | None = None, k: int | None = None, device=None, *,
                 warmup: int = 3, repeats: int = 10, target_s: float = 0.002) -> dict:
    """Time one matmul of `kind`; returns a row with seconds per call and TFLOP/s (at the median)."""
    n, k = n or m, k or m
    dev = pick_device(device)
    fn = make_matmul(kind, m, n, k, dev)
    t = bench.time_fn(fn, device=dev, warmup=warmup, repeats=repeats, inner=_inner_for(fn, dev, target_s))
    flops = matmul_flops(m, n, k)
    return {"kind": kind, "m": m, "n": n, "k": k, "device": str(dev), "median_s": t.median, "iqr_s": t.iqr,
            "tflops": flops / t.median / 1e12, "tflops_best": flops / t.min / 1e12,
            "intensity": arithmetic_intensity(m, n, k, kind)}


def matmul_grid(kinds: Sequence[str] = tuple(KINDS), sizes: Sequence[int | tuple[int, int, int]] = (4096, 8192),
                device=None, *, warmup: int = 3, repeats: int = 10, progress: bool = True) -> list[dict]:
    """TFLOP/s for every kind x size (an int n means n x n x n); kinds that cannot run here get a row with
    tflops None and the reason in 'note'."""
    dev = pick_device(device)
    shapes = [(s, s, s) if isinstance(s, int) else tuple(s) for s in sizes]
    jobs = [(kind, shape) for kind in kinds for shape in shapes]
    if progress:
        from tqdm.auto import tqdm

        jobs = tqdm(jobs, desc="matmul grid", unit="case")
    rows = []
    for kind, (m, n, k) in jobs:
        ok, why = kind_support(kind, dev)
        if ok and kind == "fp8" and any(d % 16 for d in (m, n, k)):
            ok, why = False, "fp8 needs dimensions that are multiples of 16"
        if not ok:
            rows.append({"kind": kind, "m": m, "n": n, "k": k, "device": str(dev), "median_s": None,
                         "iqr_s": None, "tflops": None, "tflops_best": None,
                         "intensity": arithmetic_intensity(m, n, k, kind), "note": why})
            continue
        rows.append({**bench_matmul(kind, m, n, k, dev, warmup=warmup, repeats=repeats), "note": why})
    return rows


def compare_matmuls(a: tuple, b: tuple, device=None, *, rounds: int = 9, warmup: int = 3) -> dict:
    """Interleaved A/B timing of two matmuls, each given as (kind, m, n, k).

    'time_ratio' = time_A / time_B (>1: B is faster per call); 'throughput_ratio' = TFLOP/s of B over A,
    which corrects for the two doing slightly different amounts of work (8192 vs 8191).
    """
    dev = pick_device(device)
    fa, fb = make_matmul(*a, device=dev), make_matmul(*b, device=dev)
    inner = _inner_for(fb, dev, 0.002)
    r = bench.compare(fa, fb, device=dev, rounds=rounds, warmup=warmup, inner=inner)
    flops_a, flops_b = matmul_flops(*a[1:]), matmul_flops(*b[1:])
    return {"a": {"kind": a[0], "shape": list(a[1:]), "tflops": flops_a / r.a.median / 1e12},
            "b": {"kind": b[0], "shape": list(b[1:]), "tflops": flops_b / r.b.median / 1e12},
            "time_ratio": r.ratio, "time_ratio_iqr": r.ratio_iqr, "time_ratio_range": list(r.ratio_range),
            "throughput_ratio": r.ratio * flops_b / flops_a, "rounds": len(r.ratios), "device": str(dev)}


def measure_copy_bandwidth(device=None, nbytes: int | None = None, *, repeats: int = 10) -> dict:
    """Device memory bandwidth from a large tensor copy: bytes read + bytes written per second (bytes/s)."""
    dev = pick_device(device)
    nbytes = nbytes or ((1 << 30) if dev.type == "cuda" else (64 << 20))
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = bench.time_fn(lambda: dst.copy_(src), device=dev, warmup=3, repeats=repeats)
    return {"bytes": 2 * src.numel() * 4, "median_s": t.median, "bytes_per_s": 2 * src.numel() * 4 / t.median,
            "device": str(dev)}


def roofline_points(kind: str = "bf16", shapes: Sequence[tuple[int, int, int]] | None = None, device=None, *,
                    repeats: int = 10, progress: bool = True) -> list[dict]:
    """Measured TFLOP/s of matmuls spanning low to high arithmetic intensity (default: m = n = 8192 on a
    GPU, 256 on CPU, k from 16 up)."""
    dev = pick_device(device)
    if shapes is None:
        big = 8192 if dev.type == "cuda" and not quick_mode() else 256
        shapes = [(big, big, k) for k in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if k <= big]
    it = shapes
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(shapes, desc=f"roofline {kind}", unit="shape")
    return [bench_matmul(kind, m, n, k, dev, repeats=repeats) for m, n, k in it]


# -------------------------------------------------------------------------------------------- accuracy


def accuracy_by_kind(n: int = 256, kinds: Sequence[str] = tuple(KINDS), seed: int = 0) -> list[dict]:
    """Relative error (Frobenius) of a product of random n x n matrices when only the inputs are rounded to
    each kind's format (tensor cores multiply exactly and accumulate in fp32); simulated, runs anywhere."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    exact = a.double() @ b.double()
    fmt = {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8_e4m3"}
    rows = []
    for kind in kinds:
        if kind == "fp8":
            sa, sb = 448 / a.abs().max(), 448 / b.abs().max()
            ar, br = round_to(a * sa, fmt[kind]) / sa, round_to(b * sb, fmt[kind]) / sb
        else:
            ar, br = round_to(a, fmt[_check_kind(kind)]), round_to(b, fmt[kind])
        err = (ar.double() @ br.double() - exact).norm() / exact.norm()
        rows.append({"kind": kind, "n": n, "relative_error": float(err)})
    return rows


def tf32_rounding_probe(device=None) -> str:
    """How the tensor cores turn fp32 inputs into TF32 here: 'nearest-even', 'nearest-away', 'truncate',
    or 'exact fp32' when no TF32 happens (CPU, pre-Ampere). Measured from a matmul with crafted inputs."""
    dev = pick_device(device)
    probes = torch.tensor([1 + 2**-11, 1 + 3 * 2**-12, 1 + 2**-10 + 2**-11])  # tie, above tie, tie from odd
    expect = {"exact fp32": probes.tolist(),
              "nearest-even": [1.0, 1 + 2**-10, 1 + 2**-9],
              "nearest-away": [1 + 2**-10, 1 + 2**-10, 1 + 2**-9],
              "truncate": [1.0, 1.0, 1 + 2**-10]}
    size = 256  # large enough that cuBLAS picks a tensor-core kernel
    a = torch.zeros(size, size)
    a[:, 0] = probes.repeat(size // 3 + 1)[:size]
    b = torch.zeros(size, size)
    b[0, :] = 1.0
    with tf32(True):
        got = torch.mm(a.to(dev), b.to(dev))[:3, 0].cpu().tolist()
    for name, want in expect.items():
        if got == want:
            return name
    return f"unrecognized: {got}"


# -------------------------------------------------------------------------------------------- kernels

# Name patterns, checked in this order. cuBLAS/CUTLASS names encode the math: "ffma"/"sgemm" are CUDA-core
# kernels; "tensorop", "wgmma"/"gmma"/"hmma", MMA shapes (16816, 1688, 884), "nvjet" (Hopper+ cuBLAS) or a
# tensor-core input type (tf32, bf16, f16, e4m3, e5m2) mean tensor cores. Heuristic: a name is evidence, not proof.
_NOT_TC_FIRST = re.compile(r"ffma|(?<![a-z0-9])[sd]gemm|dgemm|gemv", re.I)
_TC = re.compile(r"tensorop|wgmma|[hiq]?gmma|hmma|imma|16816|1688|884|tf32|bf16|f16|fp16|half|e4m3|e5m2|fp8|nvjet",
                 re.I)
_NOT_TC_LATE = re.compile(r"f32f32_f32|sgemm|_sss_", re.I)
_MATMUL = re.compile(r"gemm|gemv|mma|nvjet|cutlass|xmma|matmul|aten::mm|aten::_scaled_mm|aten::addmm|aten::bmm",
                     re.I)


def is_tensor_core_kernel(name: str) -> tuple[bool | None, str]:
    """(True/False/None, why) from a kernel's name; None when it is not a matmul kernel or nothing matches."""
    if name.startswith("aten::"):
        return (False, "CPU operator: no tensor cores") if _MATMUL.search(name) else (None, "CPU operator")
    if not _MATMUL.search(name):
        return None, "not a matmul kernel"
    if m := _NOT_TC_FIRST.search(name):
        return False, f"'{m.group(0)}': CUDA-core kernel"
    if m := _TC.search(name):
        return True, f"'{m.group(0)}' in the name"
    if m := _NOT_TC_LATE.search(name):
        return False, f"'{m.group(0)}': fp32 math"
    return None, "matmul kernel, tensor-core use not evident from the name"


@contextlib.contextmanager
def _native_stderr_filtered(drop=("USDT:", "gpuGetDeviceCount")):
    """The profiler's C++ side logs start/stop lines straight to fd 2; hide those, pass everything else on."""
    fd = 2  # C++ code writes to the process's fd 2, whatever Python's sys.stderr is
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(d in ln for d in drop)]
            if kept:
                sys.stderr.write("".join(kept))


def kernels_ran(fn: Callable[[], object], device=None, *, warmup: int = 1, top: int = 8) -> list[dict]:
    """Profile one call of `fn` (after `warmup` calls) and list what ran: GPU kernels on CUDA, operators on CPU.

    Each row: name, calls, time_us (device time on CUDA, CPU self time otherwise), tensor_core (True/False/
    None) and why (see `is_tensor_core_kernel`). Sorted by time, at most `top` rows.
    """
    from torch.profiler import ProfilerActivity, profile

    dev = pick_device(device)
    for _ in range(warmup):
        fn()
    bench.synchronize(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with _native_stderr_filtered(), profile(activities=acts) as prof:
        fn()
        bench.synchronize(dev)
    rows = []
    for e in prof.key_averages():
        on_device = e.device_type != torch.autograd.DeviceType.CPU
        if dev.type == "cuda":
            if not on_device:
                continue
            t = getattr(e, "self_device_time_total", None)
            t = t if t is not None else getattr(e, "self_cuda_time_total", 0.0)
        else:
            t = e.self_cpu_time_total
            if not e.key.startswith("aten::") or t <= 0:
                continue
        tc, why = is_tensor_core_kernel(e.key)
        rows.append({"name": e.key, "calls": e.count, "time_us": float(t), "tensor_core": tc, "why": why})
    rows.sort(key=lambda r: -r["time_us"])
    return rows[:top]


# ---------------------------------------------------------------------------------------------- plots


def plot_tflops(rows: Sequence[dict], ax=None, title: str = "Matmul throughput by dtype and shape"):
    """Grouped bars: TFLOP/s per kind, one bar per shape; kinds that did not run are left empty."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows))
    width = 0.8 / max(len(shapes), 1)
    for j, shape in enumerate(shapes):
        vals = [next((r["tflops"] or 0.0 for r in rows if r["kind"] == k and (r["m"], r["n"], r["k"]) == shape),
                     0.0) for k in kinds]
        label = "x".join(map(str, shape)) if len(set(shape)) > 1 else f"{shape[0]}^3"
        ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=label)
    ax.set_xticks([i + width * (len(shapes) - 1) / 2 for i in range(len(kinds))], kinds)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def plot_roofline(points: Sequence[dict], peak_tflops: float, bandwidth: float, ax=None, title: str = "Roofline"):
    """Measured points (intensity, TFLOP/s) against min(peak, bandwidth x intensity); bandwidth in bytes/s."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["intensity"] for p in points]
    ridge = peak_tflops * 1e12 / bandwidth
    lo, hi = min(xs + [ridge]) / 4, max(xs + [ridge]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [roofline(x, peak_tflops * 1e12, bandwidth) / 1e12 for x in grid], "k-", linewidth=1.5,
            label=f"roof: {peak_tflops:.4g} TFLOP/s, {bandwidth / 1e9:.4g} GB/s")
    ax.scatter(xs, [p["tflops"] for p in points], zorder=3, label="measured")
    for p in points:
        ax.annotate(f"k={p['k']}", (p["intensity"], p["tflops"]), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak_tflops), xytext=(4, 6), textcoords="offset points",
                fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def grid_table(rows: Sequence[dict]) -> str:
    """The grid as text: kind, shape, ms per call, TFLOP/s, note."""
    out = [{"kind": r["kind"], "shape": f"{r['m']}x{r['n']}x{r['k']}",
            "ms": None if r["median_s"] is None else r["median_s"] * 1e3,
            "TFLOP/s": r["tflops"], "note": r.get("note", "")} for r in rows]
    return text_table(out, floatfmt=".4g")


# ------------------------------------------------------------------------------------------------ CLI


def add_cli(sub) -> None:
    p = sub.add_parser("matmul", help="matmul TFLOP/s by dtype and shape, TF32 speedup, roofline, kernel names")
    p.add_argument("--device", default="auto", help="device to measure (auto, cpu, cuda, cuda:N)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kinds to time: {', '.join(KINDS)}")
    p.add_argument("--size", type=int, action="append", metavar="N",
                   help="time N x N x N products (repeatable); default 4096, 8192 and 8191 on a GPU, "
                        "256 and 255 on CPU or in quick mode")
    p.add_argument("--quick", action="store_true", help="quick mode: small sizes (the default without a GPU)")
    p.add_argument("--full", action="store_true", help="full sizes even on a CPU or with LABKIT_QUICK=1 (slow on CPU)")
    p.add_argument("--repeats", type=int, default=10, help="timed samples per case (median reported)")
    p.add_argument("--kernels", action="store_true", help="list the kernels each kind ran, flagging tensor cores")
    p.add_argument("--roofline", action="store_true", help="also measure copy bandwidth and a bf16 roofline")
    p.add_argument("--json", metavar="PATH", help="write the results, with the environment record, as JSON")
    p.add_argument("--plot", metavar="PATH", help="save a bar chart (and the roofline, if measured) to PATH")
    p.set_defaults(func=_cli_matmul)


def _cli_matmul(args) -> int:
    dev = pick_device(args.device)
    kinds = [_check_kind(k.strip()) for k in args.kinds.split(",") if k.strip()]
    if args.repeats < 1:
        raise LabkitError("--repeats must be at least 1")
    if args.quick and args.full:
        raise LabkitError("--quick and --full contradict each other: pick one")
    small = args.quick or (not args.full and (dev.type != "cuda" or quick_mode()))
    sizes = args.size or ([256, 255] if small else [4096, 8192, 8191])
    if dev.type != "cuda":
        print("no CUDA GPU: CPU timings only (no tensor cores, TF32 is plain fp32 here); the H100 numbers are "
              "recorded by benchmarks/week2_matmul.py")
    rows = matmul_grid(kinds, sizes, dev, repeats=args.repeats)
    print(grid_table(rows))
    result = {"grid": rows}
    if args.kernels:
        size = pad_to_multiple(min(sizes), 16)
        result["kernels"] = {}
        for kind in kinds:
            ok, why = kind_support(kind, dev)
            if not ok:
                print(f"\n{kind}: skipped ({why})")
                continue
            ks = kernels_ran(make_matmul(kind, size, device=dev), dev)
            result["kernels"][kind] = ks
            print(f"\n{kind} at {size}^3:")
            for r in ks:
                flag = {True: "tensor cores", False: "no tensor cores", None: "?"}[r["tensor_core"]]
                print(f"  {r['time_us']:10.1f} us  {flag:<15} {r['name'][:100]}")
    if args.roofline:
        bw = measure_copy_bandwidth(dev)
        pts = roofline_points("bf16", device=dev, repeats=args.repeats)
        peak = max([p["tflops"] for p in pts] + [r["tflops"] for r in rows if r["kind"] == "bf16" and r["tflops"]])
        result["roofline"] = {"bandwidth": bw, "peak_tflops": peak, "points": pts}
        print(f"\ncopy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s; bf16 peak measured {peak:.3g} TFLOP/s; "
              f"ridge at {peak * 1e12 / bw['bytes_per_s']:.0f} FLOP/byte")
        print(text_table([{"shape": f"{p['m']}x{p['n']}x{p['k']}", "FLOP/B": p["intensity"],
                           "TFLOP/s": p["tflops"],
                           "roof": roofline(p["intensity"], peak * 1e12, bw["bytes_per_s"]) / 1e12} for p in pts]))
    if args.json:
        path = write_json(args.json, {"kind": "matmul", "env": environment(device=dev), **result})
        print(f"\nresults written to {path}")
    if args.plot:
        import matplotlib.pyplot as plt

        n = 2 if "roofline" in result else 1
        fig, axes = plt.subplots(1, n, figsize=(7 * n, 4.5), squeeze=False)
        plot_tflops(rows, ax=axes[0][0])
        if n == 2:
            r = result["roofline"]
            plot_roofline(r["points"], r["peak_tflops"], r["bandwidth"]["bytes_per_s"], ax=axes[0][1])
        fig.tight_layout()
        save_figure(fig, args.plot, dpi=120)
        plt.close(fig)
        print(f"plot saved to {args.plot}")
    return 0


"""Week 2's exercises (Tensor Cores): the checks behind the notebook's self-check cells.

2.2 times a matmul and returns TFLOP/s. On a CPU its timing is checked against a fake clock: the check watches
every matmul the function runs (a TorchFunctionMode) and advances the clock by a known time per matmul, so the
warm-up, the FLOP count, the median and the random (not zero) operands are checked exactly, on a loaded machine
too. On a GPU the CUDA-event branch is also timed for real against labkit.matmul's measurement.
2.8 computes a matmul's arithmetic intensity and its roofline rate from the tensors' shapes and dtypes; it is
checked against labkit.matmul's `arithmetic_intensity` and `roofline`.
2.3 is a context manager for the TF32 switches; it is checked for what it sets and what it restores (on a GPU,
also that a matmul inside it runs with TF32 inputs).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from labkit import exercises as ex
from labkit import matmul as mm

_MATMULS = {"matmul", "mm", "__matmul__", "__rmatmul__", "addmm", "bmm", "baddbmm"}


class _WatchMatmuls(TorchFunctionMode):
    """Records each matmul's operands (shape, dtype, device, all-zero or constant) and calls `on_matmul`."""

    def __init__(self, on_matmul=None):
        super().__init__()
        self.calls: list[list[tuple]] = []
        self.on_matmul = on_matmul

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in _MATMULS:
            ops = [a for a in args if isinstance(a, torch.Tensor)]
            # inside its own handler the mode is off, so these reductions are not recorded
            self.calls.append([(tuple(t.shape), t.dtype, t.device.type,
                                bool(t.numel() > 1 and float(t.float().std()) == 0.0) or not bool(t.any()))
                               for t in ops])
            if self.on_matmul is not None:
                self.on_matmul()
        return out


class _FakeClock:
    """time.perf_counter (and its kin) replaced by a clock that moves only when a matmul runs."""

    NAMES = ("perf_counter", "monotonic", "time")

    def __init__(self, durations, namespace: dict):
        self.now, self.reads, self.durations, self.ns = 1000.0, 0, list(durations), namespace
        self.saved, self.saved_ns = {}, {}

    def tick(self):
        self.now += self.durations.pop(0) if self.durations else 1e-3

    def read(self) -> float:
        self.reads += 1
        return self.now

    def read_ns(self) -> int:
        self.reads += 1
        return int(self.now * 1e9)

    def __enter__(self):
        fakes = {n: self.read for n in self.NAMES} | {f"{n}_ns": self.read_ns for n in self.NAMES}
        for n, fake in fakes.items():
            self.saved[n] = getattr(time, n)
            setattr(time, n, fake)
        for k, v in list(self.ns.items()):  # `from time import perf_counter` binds the real one in the notebook
            for n, real in self.saved.items():
                if v is real:
                    self.saved_ns[k] = v
                    self.ns[k] = fakes[n]
        return self

    def __exit__(self, *exc):
        for n, real in self.saved.items():
            setattr(time, n, real)
        self.ns.update(self.saved_ns)
        return False


# ------------------------------------------------------------------------------- 2.2 timed matmul


def _ref_tflops():
    def matmul_tflops(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, device="cpu", *,
                      warmup: int = 3, repeats: int = 10) -> float:
        from labkit import bench

        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(m, k, generator=g, device=device).to(dtype)
        b = torch.randn(k, n, generator=g, device=device).to(dtype)
        t = bench.time_fn(lambda: torch.mm(a, b), device=device, warmup=warmup, repeats=repeats)
        return mm.matmul_flops(m, n, k) / t.median / 1e12

    return matmul_tflops


def _fake_clock_check(matmul_tflops) -> str | None:
    """The CPU branch against a fake clock; None when the function reads none of the clocks it knows."""
    m, n, k, warmup, repeats = 96, 64, 48, 2, 7
    slow_warmup, per_call, hiccup = 0.050, 0.001, 0.030
    # the first calls are slow (a cold start), one timed call is a hiccup: the median ignores it, a mean does not
    durations = [slow_warmup] * warmup + [per_call] * repeats
    durations[warmup + 3] = hiccup
    ns = getattr(matmul_tflops, "__globals__", {})
    with _FakeClock(durations, ns) as clock:
        watch = _WatchMatmuls(clock.tick)
        with watch:
            got = matmul_tflops(m, n, k, torch.float32, "cpu", warmup=warmup, repeats=repeats)
    if clock.reads == 0:
        return None
    calls = watch.calls
    if not calls:
        raise AssertionError("no matmul ran: multiply with torch.mm, torch.matmul or @")
    shapes = {tuple(s for s, *_ in c) for c in calls}
    if any(len(c) < 2 or c[-2][0] != (m, k) or c[-1][0] != (k, n) for c in calls):
        raise AssertionError(f"matmul_tflops({m}, {n}, {k}, ...) should multiply an ({m} x {k}) by a ({k} x {n}) "
                             f"matrix; it multiplied shapes {sorted(shapes)}")
    if any(c[-1][1] != torch.float32 or c[-2][1] != torch.float32 for c in calls):
        raise AssertionError("asked for dtype=torch.float32, the operands had other dtypes: build them in `dtype`")
    if any(c[-1][3] or c[-2][3] for c in calls):
        raise AssertionError("an operand is all zeros (or one constant): time random data (torch.randn), since "
                             "the work and the power a kernel draws depend on the values")
    if len(calls) < warmup + repeats:
        raise AssertionError(f"with warmup={warmup} and repeats={repeats} it ran {len(calls)} matmuls; run the "
                             f"warm-up calls untimed first, then {repeats} timed ones")
    if not isinstance(got, int | float) or isinstance(got, bool):
        raise AssertionError(f"return TFLOP/s as a float, got {type(got).__name__}")
    flops = 2 * m * n * k
    want = flops / per_call / 1e12
    if math.isclose(got, want, rel_tol=1e-6):
        return f"exact against a fake clock ({len(calls)} matmuls, warm-up untimed, median)"
    timed = durations[warmup:]
    hints = {flops / statistics.mean(timed) / 1e12: "that is the mean time per call: take the median, which one "
                                                    "slow call (a hiccup) does not move",
             flops / (sum(durations) / repeats) / 1e12: "the warm-up calls are inside the timing",
             flops / 2 / per_call / 1e12: "a matmul of (m x k) by (k x n) is 2*m*n*k FLOPs: a multiply and an add",
             flops / per_call: "TFLOP/s is FLOP/s / 1e12",
             flops / sum(timed) / 1e12: "that is the time of all the repeats together: divide by the repeat count "
                                        "(or take the median per call)"}
    why = next((h for v, h in hints.items() if math.isclose(got, v, rel_tol=1e-3)),
               "time each call after the warm-up, take the median seconds, and return 2*m*n*k / seconds / 1e12")
    raise AssertionError(f"against a clock that gives each timed matmul {per_call * 1e3:g} ms (one of them "
                         f"{hiccup * 1e3:g} ms, the warm-up {slow_warmup * 1e3:g} ms each), {m}x{n}x{k} should give "
                         f"{want:.6g} TFLOP/s; yours gave {got:.6g}. Hint: {why}")


def _real_check(matmul_tflops, device: str, dtype: torch.dtype, size: int, factor: float) -> str:
    """The student's rate on real hardware within `factor` of labkit's own measurement of the same matmul."""
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    with mm.tf32(False):  # strict fp32 for both, whatever the notebook set before
        theirs = matmul_tflops(size, size, size, dtype, device, warmup=3, repeats=10)
        ours = mm.bench_matmul(kind, size, device=device, repeats=10)["tflops"]
    if not (ours / factor <= theirs <= ours * factor):
        more = (" - far faster than the GPU can go: wait for the GPU (CUDA events with a synchronize, or "
                "torch.cuda.synchronize() before reading the clock)" if theirs > ours and device == "cuda" else "")
        raise AssertionError(f"{size}^3 {kind} on {device}: yours {theirs:.4g} TFLOP/s, labkit's measurement "
                             f"{ours:.4g}; more than {factor:g}x apart{more}")
    return f"{size}^3 {kind} on {device}: {theirs:.4g} TFLOP/s, labkit's {ours:.4g}"


@ex.exercise("2.2", "a timed matmul in TFLOP/s", reference=_ref_tflops)
def check_tflops(matmul_tflops) -> str:
    """The CPU branch against a fake clock (exact); the GPU branch against labkit's timing when a GPU is here."""
    verdict = _fake_clock_check(matmul_tflops)
    if verdict is None:  # reads a clock the check cannot fake: compare real rates, generously (a shared CPU)
        verdict = "real timing on CPU (no perf_counter read): " + _real_check(matmul_tflops, "cpu", torch.float32,
                                                                             256, 4.0)
    if torch.cuda.is_available():
        return verdict + "; " + _real_check(matmul_tflops, "cuda", torch.bfloat16, 4096, 2.0)
    return verdict + "; the CUDA-event branch is not checked here (no GPU)"


# ------------------------------------------------------------------------------ 2.8 the roofline


def _ref_roofline():
    def roofline_point(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, peak_flops: float,
                       bandwidth: float) -> dict:
        (m, k), n = a.shape, b.shape[1]
        flops = mm.matmul_flops(m, n, k)
        moved = a.element_size() * a.numel() + b.element_size() * b.numel() + \
            torch.empty(0, dtype=out_dtype).element_size() * m * n
        return {"flops": flops, "bytes": moved, "intensity": flops / moved,
                "attainable": mm.roofline(flops / moved, peak_flops, bandwidth)}

    return roofline_point


@ex.exercise("2.8", "arithmetic intensity and the roofline", reference=_ref_roofline)
def check_roofline(roofline_point) -> str:
    """Shapes from memory-bound to compute-bound, bf16, fp32 and fp8 (bf16 output), as meta tensors (no memory)."""
    peak, bw = 989.4e12, 3.35e12  # an example machine; the check varies them too
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    cases = [((8192, 8192, 8192), torch.bfloat16, torch.bfloat16, "bf16"),
             ((8192, 8192, 16), torch.bfloat16, torch.bfloat16, "bf16"),
             ((8192, 1, 8192), torch.bfloat16, torch.bfloat16, "bf16"),
             ((4096, 1024, 256), torch.float32, torch.float32, "fp32"),
             ((333, 77, 1000), torch.float16, torch.float16, "fp16")]
    if e4m3 is not None:
        cases.append(((4096, 4096, 64), e4m3, torch.bfloat16, "fp8"))
    for (m, n, k), dt, out_dt, kind in cases:
        for p, b in ((peak, bw), (peak / 10, bw * 2)):
            a_t = torch.empty(m, k, dtype=dt, device="meta")
            b_t = torch.empty(k, n, dtype=dt, device="meta")
            got = roofline_point(a_t, b_t, out_dt, p, b)
            if not isinstance(got, dict) or {"flops", "bytes", "intensity", "attainable"} - set(got):
                raise AssertionError("return a dict with keys flops, bytes, intensity, attainable")
            ai = mm.arithmetic_intensity(m, n, k, kind)
            want = {"flops": mm.matmul_flops(m, n, k), "intensity": ai, "bytes": mm.matmul_flops(m, n, k) / ai,
                    "attainable": mm.roofline(ai, p, b)}
            hints = {"flops": "2*m*n*k", "bytes": "each input read once (its numel times element_size()) and the "
                     "output written once, in out_dtype", "intensity": "FLOPs / bytes",
                     "attainable": "min(peak_flops, intensity * bandwidth)"}
            for key in ("flops", "bytes", "intensity", "attainable"):
                if not math.isclose(float(got[key]), want[key], rel_tol=1e-9):
                    raise AssertionError(f"{m}x{n}x{k} {kind} (inputs {dt}, output {out_dt}), peak {p:.4g} FLOP/s, "
                                         f"bandwidth {b:.4g} B/s: {key} should be {want[key]:.6g}, you gave "
                                         f"{float(got[key]):.6g}. Hint: {key} = {hints[key]}")
    return (f"FLOPs, bytes, intensity and the roofline agree with labkit.matmul for {len(cases)} shapes and dtypes, "
            "on both sides of the ridge")


# ------------------------------------------------------------------------------- 2.3 TF32 switches


@contextlib.contextmanager
def _state_kept():
    """Puts back every TF32-related switch as it was, whatever the student's code left behind."""
    cm, cd = torch.backends.cuda.matmul, torch.backends.cudnn
    marks = [x for x in (cm, getattr(torch.backends.mkldnn, "matmul", None)) if hasattr(x, "fp32_precision")]
    saved = (cm.allow_tf32, cd.allow_tf32, torch.get_float32_matmul_precision(), [x.fp32_precision for x in marks])
    try:
        yield
    finally:
        cm.allow_tf32, cd.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])
        for x, v in zip(marks, saved[3], strict=True):
            x.fp32_precision = v


def _switches() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())


def _set(matmul: bool, cudnn: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = matmul  # also sets the float32 matmul precision (high / highest)
    torch.backends.cudnn.allow_tf32 = cudnn


def _ref_tf32_mode():
    return mm.tf32


def _tf32_on_gpu(tf32_mode) -> str:
    """On a GPU: an fp32 matmul inside tf32_mode(True) has TF32's error, inside tf32_mode(False) fp32's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 512, device="cuda", generator=g)
    b = torch.randn(512, 512, device="cuda", generator=g)
    exact = a.double() @ b.double()
    errs = {}
    for on in (True, False):
        with tf32_mode(on):
            errs[on] = float((a @ b - exact).norm() / exact.norm())
    if not errs[True] > 10 * errs[False]:
        raise AssertionError(f"on the GPU, the fp32 matmul error was {errs[True]:.2g} inside tf32_mode(True) and "
                             f"{errs[False]:.2g} inside tf32_mode(False): TF32 should be far less exact")
    return f"; on the GPU, TF32 error {errs[True]:.2g} against strict fp32's {errs[False]:.2g}"


@ex.exercise("2.3", "a context manager for the TF32 switches", reference=_ref_tf32_mode)
def check_tf32_mode(tf32_mode) -> str:
    """What it sets inside (both switches, and so the matmul precision), and that it restores each as it was."""
    with _state_kept():
        for start in ((False, True), (True, False), (False, False), (True, True)):
            for enabled in (True, False):
                _set(*start)
                before = _switches()
                cm = tf32_mode(enabled)
                if not hasattr(cm, "__enter__"):
                    raise AssertionError("tf32_mode(enabled) should return a context manager (use "
                                         "@contextlib.contextmanager, or a class with __enter__ and __exit__)")
                with cm:
                    inside = _switches()
                    want = (enabled, enabled, "high" if enabled else "highest")
                    if inside != want:
                        raise AssertionError(
                            f"inside tf32_mode({enabled}), starting from matmul.allow_tf32={start[0]} and "
                            f"cudnn.allow_tf32={start[1]}: (matmul.allow_tf32, cudnn.allow_tf32, "
                            f"get_float32_matmul_precision()) should be {want}, got {inside}. Hint: set both "
                            "torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32")
                if _switches() != before:
                    raise AssertionError(f"after tf32_mode({enabled}) the switches are {_switches()}, not what they "
                                         f"were before, {before}: save both at the start and put them back")
        _set(False, True)
        before = _switches()
        try:
            with tf32_mode(True):
                raise KeyError("raised inside the block")
        except KeyError:
            pass
        if _switches() != before:
            raise AssertionError(f"an exception inside the block left the switches at {_switches()}, not {before}: "
                                 "put them back in a `finally:` (or in __exit__)")
        gpu = _tf32_on_gpu(tf32_mode) if torch.cuda.is_available() else \
            "; not checked here (no GPU): that a matmul inside it really uses TF32"
    return "sets both switches, restores each as it was, also after an exception" + gpu

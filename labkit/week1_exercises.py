"""Week 1's exercises (floating-point formats): the checks behind the notebook's self-check cells.

Each check runs the student's function on CPU-sized inputs and compares it with torch's own reading of the same
bits: `Tensor.view(dtype)` for decoding, `torch.finfo` for a format's range, `Tensor.to(dtype)` for rounding.
Where torch has no dtype (TF32) the comparison is with labkit.floats, whose simulation is itself checked against
torch bit for bit (`labkit.floats.verify_rounding`). The references are built on labkit.floats.

An IEEE-style format here is (exponent bits E, mantissa bits M) with bias 2^(E-1) - 1 and an all-ones exponent
field kept for infinity (mantissa 0) and NaN (mantissa not 0): fp32, fp16, bf16, TF32 and FP8 E5M2 are such
formats; FP8 E4M3 ("fn") is not.
"""

from __future__ import annotations

import math

import torch

from labkit import exercises as ex
from labkit import floats as fl
from labkit.errors import LabkitError

# (name, exponent bits, mantissa bits, torch dtype attribute or None)
IEEE_FORMATS = [("fp16", 5, 10, "float16"), ("bf16", 8, 7, "bfloat16"), ("fp8_e5m2", 5, 2, "float8_e5m2"),
                ("fp32", 8, 23, "float32"), ("tf32", 8, 10, None)]


def ieee_format(exp_bits: int, man_bits: int) -> fl.FloatFormat:
    """The IEEE-style format with `exp_bits` exponent and `man_bits` mantissa bits (bias 2^(E-1) - 1, inf/NaN)."""
    if not (isinstance(exp_bits, int) and isinstance(man_bits, int)) or exp_bits < 2 or man_bits < 1:
        raise LabkitError(f"an IEEE-style format needs integers exp_bits >= 2 and man_bits >= 1, "
                          f"got {exp_bits!r}, {man_bits!r}")
    for f in fl.FORMATS.values():
        if f.has_inf and (f.exponent_bits, f.mantissa_bits) == (exp_bits, man_bits):
            return f
    return fl.FloatFormat(f"e{exp_bits}m{man_bits}", exp_bits, man_bits, 2 ** (exp_bits - 1) - 1, True, "inf", None)


def _fields(bits: int, e: int, m: int) -> str:
    """A bit pattern written as 'S EEEEE MMMMMMMMMM'."""
    s = format(bits, f"0{1 + e + m}b")
    return f"{s[0]} {s[1:1 + e]} {s[1 + e:]}"


def _same(a: float, b: float) -> bool:
    """Identical floats: equal with the same sign (so -0.0 differs from 0.0), or both NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _dtype(attr: str | None) -> torch.dtype | None:
    return getattr(torch, attr, None) if attr else None


# ---------------------------------------------------------------------------------- 1.1 decoding


def _ref_decode():
    tables: dict[tuple[int, int], list[float]] = {}  # every pattern of a narrow format, decoded once

    def decode_bits(bits: int, exp_bits: int, man_bits: int) -> float:
        f = ieee_format(exp_bits, man_bits)
        if f.bits > 16:
            return float(fl.decode(torch.tensor([bits]), f)[0])
        if (exp_bits, man_bits) not in tables:
            tables[exp_bits, man_bits] = fl.decode(torch.arange(2**f.bits), f).double().tolist()
        return tables[exp_bits, man_bits][bits]

    return decode_bits


def _decode_hint(bits: int, e: int, m: int) -> str:
    exp = (bits >> m) & (2**e - 1)
    man = bits & (2**m - 1)
    if exp == 2**e - 1:
        return "an all-ones exponent is inf (mantissa 0) or NaN (any other mantissa)"
    if exp == 0:
        return (f"an exponent field of 0 is a subnormal (or zero): (-1)^S * 2^(1 - bias) * (M / 2^{m}), "
                "no implicit leading 1, and the exponent is 1 - bias, not 0 - bias")
    if bits >> (e + m):
        return "the top bit is the sign: -1 when it is set (and -0.0 for the negative zero pattern)"
    return f"a normal number is 2^(E - bias) * (1 + M / 2^{m}) with bias = 2^(E-1) - 1 (here E={exp}, M={man})"


@ex.exercise("1.1", "decode a bit pattern", reference=_ref_decode)
def check_decode(decode_bits) -> str:
    """Every fp16 and bf16 pattern (2^16 each), every FP8 E5M2 one, and 4,000 fp32 ones, against torch's view."""
    done = []
    g = torch.Generator().manual_seed(1)
    for name, e, m, attr in IEEE_FORMATS[:4]:
        dtype = _dtype(attr)
        if dtype is None:
            continue
        nbits = 1 + e + m
        if nbits == 32:
            pats = torch.cat([torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64),
                              torch.tensor([0, 1, 2**31, 2**31 + 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00800000,
                                            0x7F7FFFFF, 0x007FFFFF])])
        else:
            pats = torch.arange(2**nbits)
        want = fl.torch_decode(pats, dtype).double().tolist()
        for bits, w in zip(pats.tolist(), want, strict=True):
            got = decode_bits(bits, e, m)
            if not isinstance(got, int | float):
                raise AssertionError(f"decode_bits({bits}, {e}, {m}) returned {type(got).__name__}; return a Python "
                                     "float (float(...) of a tensor element, or plain arithmetic)")
            if not _same(float(got), w):
                hint = _decode_hint(bits, e, m)
                if not math.isnan(w) and not math.isnan(float(got)) and abs(float(got)) == abs(w):
                    hint = "the top bit is the sign: -1 when it is set (the negative zero pattern is -0.0)"
                raise AssertionError(f"{name} pattern {_fields(bits, e, m)} (= {bits}): torch reads {w!r}, your "
                                     f"decode_bits({bits}, {e}, {m}) gave {got!r}. Hint: {hint}")
        done.append(f"{name} ({len(want):,})")
    return "same values as torch's view for " + ", ".join(done) + " patterns"


# ------------------------------------------------------------------------------- 1.2 format range


PROPERTY_KEYS = ("max", "min_normal", "min_subnormal", "eps")


def _ref_properties():
    def format_properties(exp_bits: int, man_bits: int) -> dict:
        f = ieee_format(exp_bits, man_bits)
        return {"max": f.max, "min_normal": f.min_normal, "min_subnormal": f.min_subnormal, "eps": f.eps}

    return format_properties


_PROPERTY_HINTS = {
    "max": "the largest exponent field is all ones minus one (all ones is inf/NaN), and the mantissa all ones: "
           "(2 - 2^-M) * 2^(2^E - 2 - bias)",
    "min_normal": "the smallest normal has exponent field 1: 2^(1 - bias)",
    "min_subnormal": "the smallest subnormal is mantissa 1 with exponent field 0: 2^(1 - bias - M)",
    "eps": "eps is the gap between 1 and the next value: 2^-M",
}


def _torch_properties(dtype: torch.dtype) -> dict:
    fi = torch.finfo(dtype)
    nbits = fi.bits
    store = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[nbits]
    smallest = float(torch.tensor([1], dtype=store).view(dtype).double())  # pattern 0...01: finfo lacks it
    return {"max": fi.max, "min_normal": fi.smallest_normal, "min_subnormal": smallest, "eps": fi.eps}


@ex.exercise("1.2", "a format's range from its bit counts", reference=_ref_properties)
def check_properties(format_properties) -> str:
    """fp16, bf16, fp32, fp64 and FP8 E5M2 against torch.finfo (and torch's own smallest subnormal); TF32 against
    labkit's table, torch having no TF32 dtype."""
    cases = [(name, e, m, _torch_properties(_dtype(attr)) if _dtype(attr) else None) for name, e, m, attr in
             IEEE_FORMATS] + [("fp64", 11, 52, _torch_properties(torch.float64))]
    names = []
    for name, e, m, want in cases:
        if want is None:
            want = _ref_properties()(e, m)
            name += " (labkit's table: torch has no dtype)"
        got = format_properties(e, m)
        if not isinstance(got, dict) or set(PROPERTY_KEYS) - set(got):
            raise AssertionError(f"format_properties({e}, {m}) should return a dict with keys {', '.join(PROPERTY_KEYS)}; "
                                 f"got {got!r}")
        for key in PROPERTY_KEYS:
            if not math.isclose(float(got[key]), float(want[key]), rel_tol=1e-12, abs_tol=0.0):
                raise AssertionError(f"{name} (E={e}, M={m}): {key} should be {float(want[key])!r}, you gave "
                                     f"{float(got[key])!r}. Hint: {_PROPERTY_HINTS[key]}")
        names.append(name.split(" ")[0])
    return "max, min normal, min subnormal and eps equal torch.finfo for " + ", ".join(names)


# --------------------------------------------------------------------------------- 1.4 rounding


def _ref_round():
    def round_to_format(x: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
        return fl.round_to(x, ieee_format(exp_bits, man_bits))

    return round_to_format


def _round_hint(x: float, want: float, got: float, f: fl.FloatFormat) -> str:
    if math.isnan(want):
        return "NaN must stay NaN"
    if math.isnan(got):
        return "only a NaN input gives NaN; infinities stay infinite, and values past max become inf"
    if math.isinf(want):
        return (f"past the largest value ({f.max!r}) plus half a step at the top the value overflows to inf, with "
                "its sign; a tie there goes to inf too (fp16: 65519 -> 65504, 65520 -> inf)")
    if want == 0 and got == 0:
        return "zero keeps its sign: -0.0 stays -0.0 (torch.copysign restores it)"
    lo, hi = sorted((want, got))
    if not math.isinf(hi) and abs(x - (lo + hi) / 2) == 0:
        return "a tie (exactly half-way) goes to the neighbour whose last mantissa bit is 0: torch.round does that"
    if abs(x) < f.min_normal:
        return (f"below the smallest normal ({f.min_normal!r}) the step stops shrinking: every value there rounds "
                f"to a multiple of the smallest subnormal {f.min_subnormal!r}; half of that and below goes to 0")
    return f"round to the nearest multiple of 2^(floor(log2|x|) - {f.mantissa_bits}) (M = {f.mantissa_bits})"


def _compare_rounding(round_to_format, x: torch.Tensor, f: fl.FloatFormat, want: torch.Tensor, ref_name: str) -> int:
    """Mismatches between the student's rounding of `x` and `want`; raises with the first one explained."""
    xin = x.clone()
    got = round_to_format(x, f.exponent_bits, f.mantissa_bits)
    if not torch.equal(x.view(torch.int32), xin.view(torch.int32)):
        raise AssertionError("your function changed its input in place: work on a copy (x.double(), x.clone())")
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        raise AssertionError(f"return a tensor of x's shape {tuple(x.shape)}; got "
                             f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}")
    got = got.double()
    ok = fl.same_values(got.float(), want.float()) & (got == got.float().double()) | (torch.isnan(got) & torch.isnan(want))
    bad = (~ok).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        xi, wi, gi = float(x[i]), float(want[i]), float(got[i])
        raise AssertionError(f"{f.name} (E={f.exponent_bits}, M={f.mantissa_bits}): {bad.numel():,} of {x.numel():,} "
                             f"inputs differ from {ref_name}; e.g. x = {xi!r} (float32 bits "
                             f"0x{int(x[i:i + 1].view(torch.int32)) & 0xFFFFFFFF:08x}) should round to {wi!r}, you "
                             f"gave {gi!r}. Hint: {_round_hint(xi, wi, gi, f)}")
    return x.numel()


@ex.exercise("1.4", "round to a format (nearest, ties to even)", reference=_ref_round)
def check_round(round_to_format) -> str:
    """fp16 and bf16 against torch's own cast, on every value, every tie, the float32 numbers beside them, the edges and
    random bit patterns (both signs); TF32 against labkit's independent bit-manipulation reference."""
    done = []
    for name, _e, _m, attr in IEEE_FORMATS[:3] + IEEE_FORMATS[4:]:
        f = fl.get_format(name)
        dtype = f.dtype()
        n_random = 1 << 14
        x = fl.rounding_test_inputs(f, n_random=n_random, seed=3) if f.bits <= 16 else \
            torch.cat([fl.rounding_test_inputs("bf16", n_random=n_random, seed=3),
                       fl.float32_patterns(0, 2**32, 2**32 // n_random + 7)])
        if dtype is not None:
            if fl.torch_overflow_policy(dtype) != "inf":
                continue  # this torch saturates E5M2 casts: not the IEEE rule the exercise asks for
            want, ref = fl.torch_round(x, dtype).double(), f"torch's x.to(torch.{attr})"
        else:
            want, ref = fl.round_bits_reference(x, f).double(), "labkit's bit-level TF32 reference"
        done.append(f"{name} ({_compare_rounding(round_to_format, x, f, want, ref):,} inputs)")
    return "bit for bit the same as torch's casts (TF32: labkit's reference) for " + ", ".join(done)


# ------------------------------------------------------------------------------- 1.6 fp16 underflow


FP16_ZERO_ABOVE = 2.0**-25  # half fp16's smallest subnormal: at or below it a value rounds to 0 (the tie goes to 0)


def _ref_flush():
    def fp16_flush_share(g: torch.Tensor) -> float:
        nonzero = g[g != 0]
        if nonzero.numel() == 0:
            return 0.0
        return fl.underflow_summary(nonzero.abs(), "fp16")["to_zero"]

    return fp16_flush_share


@ex.exercise("1.6", "the share of a gradient that fp16 flushes to zero", reference=_ref_flush)
def check_flush(fp16_flush_share) -> str:
    """Crafted values at and beside 2^-25 and 2^-24, both signs, zeros left out; then a real gradient tensor."""
    t = torch.tensor
    sub = 2.0**-24
    half = t(FP16_ZERO_ABOVE, dtype=torch.float32)
    above = float(torch.nextafter(half, t(1.0)))  # the float32 neighbours of 2^-25
    below = float(torch.nextafter(half, t(0.0)))
    edge = [FP16_ZERO_ABOVE, above, below,
            0.75 * sub, 0.5 * sub, 0.25 * sub, sub, 1.5 * sub, 2.5 * sub, 1e-3, 1.0]
    cases = {
        "values just above half the smallest subnormal (2^-25), which round up to 2^-24":
            t([above] * 3 + [1.0], dtype=torch.float32),
        "values between 2^-25 and 2^-24": t([0.6 * sub, 0.9 * sub, 1e-3, 1e-4], dtype=torch.float32),
        "exactly 2^-25, a tie that goes to the even neighbour, 0": t([FP16_ZERO_ABOVE, 1.0], dtype=torch.float32),
        "negative gradients": -t([0.25 * sub, 0.75 * sub, 1e-3, 0.4 * sub], dtype=torch.float32),
        "zeros, which are not counted (they are not lost to rounding)": t([0.0, 0.0, 0.2 * sub, 1.0], dtype=torch.float32),
        "the edge values, both signs": t(edge + [-v for v in edge] + [0.0], dtype=torch.float32),
    }
    g = torch.Generator().manual_seed(0)
    cases["a gradient-like tensor of magnitudes 1e-10..1e-2"] = (
        torch.randn(20000, generator=g).sign() * torch.exp(torch.empty(20000).uniform_(-23, -4.6, generator=g)))
    for what, x in cases.items():
        nz = x[x != 0]
        want = int((nz.half() == 0).sum()) / max(nz.numel(), 1)
        got = fp16_flush_share(x.clone())
        if not isinstance(got, int | float | torch.Tensor):
            raise AssertionError(f"return a number (a share between 0 and 1), got {type(got).__name__}")
        if abs(float(got) - want) > 1e-9:
            raise AssertionError(f"on {what}: the share that fp16 flushes to zero is {want:.4g}, you gave "
                                 f"{float(got):.4g}. Hint: count only non-zero values; a value rounds to 0 only at or "
                                 "below half the smallest subnormal, 2^-25 (not 2^-24: above 2^-25 it rounds up "
                                 "to 2^-24); use the magnitude, so negative values count too")
    return "agrees with torch's own .half() cast on the 2^-25 and 2^-24 edges, negatives, zeros and random gradients"

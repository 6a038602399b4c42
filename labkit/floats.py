"""Floating-point formats: bit layouts, exact decoding, rounding to each format, ranges and plots.

Rounding is simulated with exact float64 arithmetic, so one code path covers the formats torch has (fp16,
bf16, both fp8) and one it has not (tf32), and it can be checked bit for bit against torch's own casts
(`verify_rounding`). float64 input (Python floats, numpy float64, float64 tensors) is rounded once, exactly;
`via_float32=True` reproduces torch's cast instead, which goes float64 -> float32 -> target and so rounds twice
(65519.999999999 becomes inf in fp16 that way, not 65504). `round_bits_reference` is a second, independent implementation by integer bit
manipulation, for the formats that share fp32's 8-bit exponent (fp32, tf32, bf16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from labkit.env import LabkitError

OVERFLOW_POLICIES = ("inf", "saturate", "nan")


@dataclass(frozen=True)
class FloatFormat:
    """A binary float: normal = (-1)^s * 2^(e - bias) * 1.m, subnormal (e = 0) = (-1)^s * 2^(1 - bias) * 0.m."""

    name: str  # short name used by the CLI and the tables
    exponent_bits: int  # width of the exponent field
    mantissa_bits: int  # stored fraction bits; normals carry an implicit leading 1 on top
    bias: int  # subtracted from the exponent field
    has_inf: bool  # IEEE style (all-ones exponent = inf or NaN); False = "fn": only S.1..1.1..1 is NaN
    overflow: str  # what a value past max becomes by default: "inf", "saturate" or "nan"
    torch_dtype: str | None  # attribute name of the matching torch dtype, None if torch has none
    note: str = ""  # one line on where the format is used

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def emax(self) -> int:
        """Largest unbiased exponent of a finite value."""
        top = 2**self.exponent_bits - (2 if self.has_inf else 1)
        return top - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal (also the scale of the subnormals)."""
        return 1 - self.bias

    @property
    def max(self) -> float:
        # "fn" formats keep the all-ones exponent for numbers, except the all-ones mantissa (NaN).
        lost = 2.0 ** -self.mantissa_bits * (1 if self.has_inf else 2)
        return 2.0**self.emax * (2.0 - lost)

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1 and the next larger value."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits carried by the (M+1)-bit significand."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def resolution(self) -> float:
        """torch.finfo's `resolution`: 10^-floor(M log10 2)."""
        return 10.0 ** -math.floor(self.mantissa_bits * math.log10(2))

    def dtype(self) -> torch.dtype | None:
        """The torch dtype, or None where this torch lacks it (tf32, or fp8 on an old torch)."""
        return getattr(torch, self.torch_dtype, None) if self.torch_dtype else None


FORMATS: dict[str, FloatFormat] = {f.name: f for f in [
    FloatFormat("fp32", 8, 23, 127, True, "inf", "float32", "IEEE single: the default for weights and math"),
    FloatFormat("tf32", 8, 10, 127, True, "inf", None,
                "tensor-core input format for fp32 matmuls (Ampere+); stored in 32 bits, fp16's precision"),
    FloatFormat("fp16", 5, 10, 15, True, "inf", "float16", "IEEE half: tensor cores since Volta; needs loss scaling"),
    FloatFormat("bf16", 8, 7, 127, True, "inf", "bfloat16", "fp32's range with 8 bits of precision"),
    FloatFormat("fp8_e4m3", 4, 3, 7, False, "saturate", "float8_e4m3fn",
                "OCP FP8 E4M3 (fn: no inf): forward activations and weights on Hopper"),
    FloatFormat("fp8_e5m2", 5, 2, 15, True, "inf", "float8_e5m2", "OCP FP8 E5M2: gradients on Hopper"),
]}

_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8": "fp8_e4m3", "e5m2": "fp8_e5m2",
            "float8_e5m2": "fp8_e5m2"}


def get_format(fmt: str | FloatFormat | torch.dtype) -> FloatFormat:
    """Look a format up by name ('fp16'), alias ('half', 'e4m3') or torch dtype."""
    if isinstance(fmt, FloatFormat):
        return fmt
    key = str(fmt).removeprefix("torch.") if isinstance(fmt, torch.dtype) else str(fmt).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise LabkitError(f"unknown float format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[key]


def _policy(f: FloatFormat, overflow: str | None) -> str:
    policy = overflow or f.overflow
    if policy not in OVERFLOW_POLICIES:
        raise LabkitError(f"overflow={overflow!r}: use one of {', '.join(OVERFLOW_POLICIES)}")
    if policy == "inf" and not f.has_inf:
        raise LabkitError(f"{f.name} has no infinity: use overflow='saturate' or 'nan'")
    return policy


def _as_float(x) -> torch.Tensor:
    """x as a float32 or float64 tensor, never losing precision: Python floats and ints become float64, numpy
    values keep their dtype (float64 stays float64), narrower floats widen exactly to float32."""
    if not isinstance(x, torch.Tensor):
        if hasattr(x, "dtype"):  # numpy arrays and scalars
            x = torch.as_tensor(x)
            x = x if x.is_floating_point() else x.double()
        else:
            x = torch.as_tensor(x, dtype=torch.float64)
    if x.dtype in (torch.float32, torch.float64):
        return x
    if x.is_floating_point() and x.element_size() <= 4:
        return x.float()
    raise LabkitError(f"rounding takes float input, got {x.dtype}")


def _as_float32(x) -> torch.Tensor:
    """x as float32, for the checks that compare float32 bit patterns; float64 input is refused, not rounded."""
    x = _as_float(x)
    if x.dtype == torch.float64:
        raise LabkitError("this check works on float32 inputs, got float64: round with round_to (exact) or "
                          "convert with .float() knowingly (that is a first rounding)")
    return x


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e as float64 (e an int64 tensor in the normal float64 range), built from the bits."""
    return ((e + 1023) << 52).view(torch.float64)


# ------------------------------------------------------------------------------------------- rounding


def round_to(x, fmt, *, overflow: str | None = None, via_float32: bool = False) -> torch.Tensor:
    """Round values to `fmt` (round to nearest, ties to even) once; returns float32 holding exact values.

    Takes float32 or float64 (tensors, numpy, Python floats): float64 is rounded exactly to `fmt`, not via
    float32. via_float32=True rounds to float32 first, as torch's own casts from float64 do (a second rounding
    that can move a value just past a halfway point back onto it, and then to the other neighbour).
    Subnormals are kept, NaN stays NaN, and a value past the format's max becomes what `overflow` says:
    "inf", "saturate" (the largest finite value, also for an infinite input) or "nan"; None = the format's default.
    """
    f = get_format(fmt)
    policy = _policy(f, overflow)
    x = _as_float(x)
    xd = x.float().double() if via_float32 else x.double()
    a = xd.abs()
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    e = (e.long() - 1).clamp(min=f.emin)  # below the normal range every value shares the subnormal quantum
    q = _pow2(e - f.mantissa_bits)
    r = a.div(q).round_().mul_(q)  # a / q is exact; round() rounds half to even
    over_value = {"inf": math.inf, "saturate": f.max, "nan": math.nan}[policy]
    r.masked_fill_((r > f.max) | torch.isinf(a), over_value)
    r.masked_fill_(torch.isnan(a), math.nan)
    return torch.copysign(r, xd).float()


def round_stochastic(x, fmt, *, generator: torch.Generator | None = None,
                     overflow: str | None = None) -> torch.Tensor:
    """Stochastic rounding to `fmt`: each value goes to its lower or upper neighbour in the format, up with
    probability (x - lower) / (upper - lower), so the expected result is x itself (unbiased); returns float32.

    Values already in the format stay as they are; NaN stays NaN. An upper neighbour past the format's max, and
    any input past it, become what `overflow` says (as in `round_to`). `generator` (a torch.Generator on x's
    device) makes the draws repeatable. Round to nearest (`round_to`) never moves a value by less than half a
    gap; this does, on average, which is why many tiny updates survive it.
    """
    f = get_format(fmt)
    policy = _policy(f, overflow)
    xd = _as_float(x).double()
    a = xd.abs()
    _, e = torch.frexp(a)
    q = _pow2((e.long() - 1).clamp(min=f.emin) - f.mantissa_bits)  # the gap between neighbours at |x|
    scaled = a / q  # exact: q is a power of two
    lower = scaled.floor()
    u = torch.rand(a.shape, generator=generator, dtype=torch.float64, device=a.device)
    r = (lower + (u < scaled - lower).double()) * q
    over_value = {"inf": math.inf, "saturate": f.max, "nan": math.nan}[policy]
    r.masked_fill_((r > f.max) | torch.isinf(a), over_value)
    r.masked_fill_(torch.isnan(a), math.nan)
    return torch.copysign(r, xd).float()


def encode(x, fmt, *, overflow: str | None = None, via_float32: bool = False) -> torch.Tensor:
    """Bit patterns (int64, 0 .. 2^bits - 1) of values rounded to `fmt` (as `round_to` rounds them)."""
    f = get_format(fmt)
    r = round_to(x, f, overflow=overflow, via_float32=via_float32).double()
    a = r.abs()
    M, all_ones = f.mantissa_bits, 2**f.exponent_bits - 1
    _, e = torch.frexp(a)
    e = e.long() - 1
    sub = a < f.min_normal
    exp_field = torch.where(sub, torch.zeros_like(e), e + f.bias)
    safe_e = torch.where(sub | ~torch.isfinite(a), torch.zeros_like(e), e)
    frac = torch.where(sub, a / f.min_subnormal, (a / _pow2(safe_e) - 1) * 2.0**M)
    man = torch.nan_to_num(frac, nan=0.0, posinf=0.0).round().long()
    inf, nan = torch.isinf(a), torch.isnan(a)
    exp_field = torch.where(inf | nan, torch.full_like(exp_field, all_ones), exp_field)
    nan_man = 1 << (M - 1) if f.has_inf else 2**M - 1  # IEEE quiet NaN / the single "fn" NaN
    man = torch.where(inf, torch.zeros_like(man), man)
    man = torch.where(nan, torch.full_like(man, nan_man), man)
    sign = torch.signbit(r).long()
    return (sign << (f.exponent_bits + M)) | (exp_field << M) | man


def decode(bits, fmt) -> torch.Tensor:
    """Values (float32, exact) of bit patterns of `fmt`; every pattern is valid, NaN patterns give NaN."""
    f = get_format(fmt)
    b = torch.as_tensor(bits, dtype=torch.int64)
    if b.numel() and (int(b.min()) < 0 or int(b.max()) >= 2**f.bits):
        raise LabkitError(f"{f.name} bit patterns run from 0 to {2**f.bits - 1}; got {int(b.min())}..{int(b.max())}")
    M, E = f.mantissa_bits, f.exponent_bits
    sign = (b >> (E + M)) & 1
    exp = (b >> M) & (2**E - 1)
    man = b & (2**M - 1)
    sub = man.double() * f.min_subnormal
    normal = (man + 2**M).double() * _pow2(exp.clamp(min=1) - f.bias - M)
    v = torch.where(exp == 0, sub, normal)
    top = exp == 2**E - 1
    if f.has_inf:
        v = torch.where(top & (man == 0), torch.full_like(v, math.inf), v)
        v = torch.where(top & (man != 0), torch.full_like(v, math.nan), v)
    else:
        v = torch.where(top & (man == 2**M - 1), torch.full_like(v, math.nan), v)
    return torch.where(sign == 1, -v, v).float()


def torch_round(x, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """What torch's own cast gives: x.to(dtype) and back to float32 (on `device`), returned on the CPU.

    float64 input (Python floats included) is cast from float64, as torch does it: through float32 on the CPU.
    """
    return _as_float(x).to(device).to(dtype).float().cpu()


def torch_decode(bits, dtype: torch.dtype) -> torch.Tensor:
    """torch's own reading of bit patterns (ints 0 .. 2^bits - 1) as `dtype`, widened to float32."""
    b = torch.as_tensor(bits, dtype=torch.int64)
    nbits = torch.finfo(dtype).bits
    b = torch.where(b >= 2 ** (nbits - 1), b - 2**nbits, b) if nbits > 8 else b
    store = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[nbits]
    return b.to(store).view(dtype).float()


def torch_bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns (int64, unsigned) of a tensor of a torch float dtype."""
    nbits = torch.finfo(x.dtype).bits
    store = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[nbits]
    return x.contiguous().view(store).long() & (2**nbits - 1)


def round_bits_reference(x, fmt) -> torch.Tensor:
    """Independent reference for formats with fp32's exponent (fp32, tf32, bf16): round the fp32 bit pattern.

    Adds half a unit of the dropped bits minus one, plus the kept last bit (ties to even), then clears them;
    a carry runs into the exponent by itself, and past fp32's max it lands exactly on the inf pattern.
    """
    f = get_format(fmt)
    if f.exponent_bits != 8 or f.bias != 127:
        raise LabkitError(f"the bit reference covers formats with fp32's 8-bit exponent, not {f.name}")
    drop = 23 - f.mantissa_bits
    b = _as_float32(x).contiguous().view(torch.int32).long() & 0xFFFFFFFF
    if drop:
        lsb = (b >> drop) & 1
        b = (b + (1 << (drop - 1)) - 1 + lsb) & ~((1 << drop) - 1) & 0xFFFFFFFF
    out = torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(_as_float32(x)), torch.full_like(out, math.nan), out)


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise 'identical float': equal with the same sign (so -0 != +0), or both NaN."""
    return (torch.isnan(a) & torch.isnan(b)) | ((a == b) & (torch.signbit(a) == torch.signbit(b)))


def torch_overflow_policy(dtype: torch.dtype, device: str | torch.device = "cpu") -> str:
    """How torch's cast to `dtype` treats a value past max on `device`: 'inf', 'saturate' or 'nan'.

    It differs between formats, devices and torch versions (casts to float8_e4m3fn have given NaN in some
    versions and the largest finite value in others), so tests and tables ask torch instead of assuming.
    """
    fmax = torch.finfo(dtype).max
    got = torch_round(torch.tensor([fmax * 4.0, math.inf]), dtype, device)
    kinds = ["inf" if torch.isinf(v) else "nan" if torch.isnan(v) else "saturate" if v == fmax else "?"
             for v in got]
    if kinds[0] != kinds[1] or kinds[0] == "?":
        raise LabkitError(f"torch casts overflow to {dtype} as {got.tolist()}, which matches no known policy")
    return kinds[0]


# ------------------------------------------------------------------------------------------- checking


def positive_values(fmt) -> torch.Tensor:
    """Every finite value >= 0 of `fmt`, ascending, as float64 (fp32 is too large to list: LabkitError)."""
    f = get_format(fmt)
    if f.bits > 20:
        raise LabkitError(f"{f.name} has too many values to list; sample it instead")
    v = decode(torch.arange(2 ** (f.bits - 1)), f).double()
    return v[torch.isfinite(v)]


def float32_patterns(start: int, stop: int, step: int = 1) -> torch.Tensor:
    """float32 values whose bit patterns, read as unsigned integers, run over range(start, stop, step)."""
    u = torch.arange(start, stop, step, dtype=torch.int64)
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def rounding_test_inputs(fmt, n_random: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """float32 inputs that catch rounding mistakes: every value of `fmt`, every midpoint (tie) between
    neighbours, the float32 numbers just beside each of those, the overflow and underflow edges, specials,
    and `n_random` random bit patterns (NaNs, infs and float32 subnormals included); both signs."""
    f = get_format(fmt)
    parts = []
    if f.bits <= 20:
        v = positive_values(f)
        step_top = 2.0 ** (f.emax - f.mantissa_bits)
        mids = torch.cat([(v[:-1] + v[1:]) / 2, torch.tensor([f.max + step_top / 2])])
        grid = torch.cat([v, mids]).float()  # exact: at most M + 1 significant bits
        up, down = torch.full_like(grid, math.inf), torch.full_like(grid, -math.inf)
        parts += [grid, torch.nextafter(grid, up), torch.nextafter(grid, down)]
    specials = [0.0, math.inf, math.nan, f.max, f.max * 2, f.min_normal, f.min_subnormal, f.min_subnormal / 2,
                f.min_subnormal / 4, 3.4028234663852886e38, 1.1754943508222875e-38, 1.401298464324817e-45]
    parts.append(torch.tensor(specials, dtype=torch.float32))
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(0, 2**32, (n_random,), generator=g, dtype=torch.int64)
    parts.append(torch.where(rnd >= 2**31, rnd - 2**32, rnd).to(torch.int32).view(torch.float32))
    x = torch.cat(parts)
    return torch.cat([x, -x])


def verify_rounding(fmt, inputs: torch.Tensor | None = None, *, exhaustive: bool = False,
                    chunk: int = 1 << 24, progress: bool = False) -> dict:
    """Compare `round_to` with torch's cast (or, for tf32, with `round_bits_reference`) on float32 inputs.

    Default inputs: `rounding_test_inputs`. exhaustive=True runs all 2^32 float32 bit patterns in chunks
    (tens of minutes per format on a laptop). The overflow policy compared is the one torch uses here (`torch_overflow_policy`).
    Returns counts and up to 5 mismatching inputs; the check passes when 'mismatches' is 0.
    """
    f = get_format(fmt)
    dtype = f.dtype()
    if dtype is not None:
        policy = torch_overflow_policy(dtype)
        reference, ref_name = (lambda x: torch_round(x, dtype)), f"torch.{f.torch_dtype}"
    elif f.exponent_bits == 8:
        policy, reference, ref_name = "inf", (lambda x: round_bits_reference(x, f)), "bit-manipulation reference"
    else:
        raise LabkitError(f"no reference to check {f.name} against on this torch")
    if exhaustive:
        batches: Iterable = (float32_patterns(s, min(s + chunk, 2**32)) for s in range(0, 2**32, chunk))
        total = 2**32 // chunk
    else:
        batches, total = [inputs if inputs is not None else rounding_test_inputs(f)], 1
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, total=total, desc=f"check {f.name}", unit="chunk")
    n, bad, examples = 0, 0, []
    for x in batches:
        x = _as_float32(x)
        ok = same_values(round_to(x, f, overflow=policy), reference(x))
        n += x.numel()
        nbad = int((~ok).sum())
        bad += nbad
        if nbad and len(examples) < 5:
            examples += x[~ok][: 5 - len(examples)].tolist()
    return {"format": f.name, "reference": ref_name, "overflow": policy, "inputs": n, "mismatches": bad,
            "examples": examples}


# ------------------------------------------------------------------------------------ one value, by hand


@dataclass
class Decomposed:
    """One value as `fmt` stores it: the raw fields, what kind of number it is, and the exact value."""

    format: str
    input: float  # the value asked for
    value: float  # what the format stores (after rounding)
    bits: int  # the whole bit pattern
    sign: int
    exponent: int  # raw (biased) exponent field
    mantissa: int  # raw fraction field
    kind: str  # zero, subnormal, normal, inf or nan

    def bit_string(self) -> str:
        f = FORMATS[self.format]
        s = format(self.bits, f"0{f.bits}b")
        return f"{s[0]} {s[1:1 + f.exponent_bits]} {s[1 + f.exponent_bits:]}"

    def formula(self) -> str:
        f = FORMATS[self.format]
        s, M = "-" if self.sign else "+", 2**f.mantissa_bits
        if self.kind == "normal":
            return f"{s}2^({self.exponent}-{f.bias}) * (1 + {self.mantissa}/{M}) = {self.value!r}"
        if self.kind == "zero":
            return f"{s}0"
        if self.kind == "subnormal":
            return f"{s}2^({f.emin}) * ({self.mantissa}/{M}) = {self.value!r}"
        return f"{s}{self.kind}"

    def __str__(self) -> str:
        err = "" if not math.isfinite(self.value) or self.value == self.input else \
            f"  (rounding error {self.value - self.input:+.3g})"
        return f"{self.format:>9}: {self.bit_string():<36} {self.kind:<9} {self.formula()}{err}"


def decompose(value: float, fmt, *, via_float32: bool = False) -> Decomposed:
    """Round `value` (a float64, exactly; via float32 if asked) to `fmt` and split it into its bit fields."""
    f = get_format(fmt)
    bits = int(encode(torch.tensor([value], dtype=torch.float64), f, via_float32=via_float32)[0])
    stored = float(decode(bits, f))
    M = f.mantissa_bits
    exp, man = (bits >> M) & (2**f.exponent_bits - 1), bits & (2**M - 1)
    if math.isnan(stored):
        kind = "nan"
    elif math.isinf(stored):
        kind = "inf"
    else:
        kind = "zero" if stored == 0 else "subnormal" if exp == 0 else "normal"
    return Decomposed(f.name, float(value), stored, bits, bits >> (f.bits - 1), exp, man, kind)


def compose(sign: int, exponent: int, mantissa: int, fmt) -> float:
    """The value of the fields (raw exponent field, raw mantissa field) in `fmt`."""
    f = get_format(fmt)
    if sign not in (0, 1) or not 0 <= exponent < 2**f.exponent_bits or not 0 <= mantissa < 2**f.mantissa_bits:
        raise LabkitError(f"{f.name} fields: sign 0/1, exponent 0..{2**f.exponent_bits - 1}, "
                          f"mantissa 0..{2**f.mantissa_bits - 1}; got {sign}, {exponent}, {mantissa}")
    return float(decode((sign << (f.bits - 1)) | (exponent << f.mantissa_bits) | mantissa, f))


# ------------------------------------------------------------------------------------------- tables


def property_table(formats: Sequence | None = None) -> list[dict]:
    """One row per format: layout, bias, max, min normal, min subnormal, eps, decimal digits, overflow."""
    rows = []
    for f in (get_format(x) for x in (formats or FORMATS)):
        rows.append({"format": f.name, "bits": f.bits, "exp": f.exponent_bits, "man": f.mantissa_bits,
                     "bias": f.bias, "max": f.max, "min_normal": f.min_normal, "min_subnormal": f.min_subnormal,
                     "eps": f.eps, "digits": round(f.decimal_digits, 2), "inf": f.has_inf, "overflow": f.overflow,
                     "torch": f.torch_dtype or "-"})
    return rows


def finfo_mismatches(formats: Sequence | None = None) -> list[str]:
    """Where the spec disagrees with torch.finfo (max, min, smallest normal, eps, resolution, bits) or with
    torch's smallest positive value; an empty list means every format torch has agrees."""
    out = []
    for f in (get_format(x) for x in (formats or FORMATS)):
        dtype = f.dtype()
        if dtype is None:
            continue
        fi = torch.finfo(dtype)
        ours = {"max": f.max, "min": -f.max, "smallest_normal": f.min_normal, "eps": f.eps,
                "resolution": f.resolution, "bits": f.bits}
        for key, val in ours.items():
            if getattr(fi, key) != val:
                out.append(f"{f.name}: {key} is {val!r} here but {getattr(fi, key)!r} in torch.finfo")
        tiny = float(torch_decode(1, dtype))
        if tiny != f.min_subnormal:
            out.append(f"{f.name}: min subnormal is {f.min_subnormal!r} here but {tiny!r} in torch")
    return out


def text_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> str:
    """Rows of dicts as an aligned plain-text table (numbers formatted with `floatfmt`)."""
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())

    def cell(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return "-" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, body)])


# ----------------------------------------------------------------------------------- fp16 underflow


def gradient_tensors(batch_size: int = 32, width: int = 8, steps: int = 1, seed: int = 0,
                     lr: float = 0.05) -> list[dict]:
    """Real gradients, kept per training step: `steps` fp32 SGD steps (momentum 0.9, learning rate `lr`) of the
    course's ResNet-18 (at `width`) on random 32x32 images with random labels. CPU, about a second per step.

    One dict per step, each {name: float32 tensor}: "weights" (the parameters the step's gradients were taken
    at), "weight_grads" (their gradients) and "activation_grads" (the gradient of every conv/linear layer's
    output, keyed by the layer's name, in the order backward produced them).
    """
    from labkit.models import resnet18

    if min(batch_size, width, steps) < 1:
        raise LabkitError(f"batch_size, width and steps must be positive, got {batch_size}, {width}, {steps}")
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = resnet18(width=width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    acts: dict[str, torch.Tensor] = {}

    def keep_grad(name):
        def hook(_m, _inp, out):
            if out.requires_grad:
                out.register_hook(lambda grad: acts.__setitem__(name, grad.detach().clone()))
        return hook

    hooks = [m.register_forward_hook(keep_grad(name)) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]
    out = []
    try:
        for _ in range(steps):
            x = torch.randn(batch_size, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (batch_size,), generator=g)
            acts = {}
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            out.append({"weights": {n: p.detach().clone() for n, p in named},
                        "weight_grads": {n: p.grad.detach().clone() for n, p in named},
                        "activation_grads": dict(acts)})
            opt.step()
    finally:
        for h in hooks:
            h.remove()
    return out


def gradient_magnitudes(batch_size: int = 32, width: int = 8, steps: int = 1, seed: int = 0) -> dict:
    """|gradient| of every weight and of every conv/linear output at the last of `steps` fp32 training steps
    (see `gradient_tensors`); zeros dropped. CPU, seconds.

    Returns {"weights": float32 tensor, "activations": float32 tensor}.
    """
    last = gradient_tensors(batch_size, width, steps, seed)[-1]
    w = torch.cat([t.abs().flatten() for t in last["weight_grads"].values()])
    a = torch.cat([t.abs().flatten() for t in last["activation_grads"].values()])
    return {"weights": w[w > 0].float(), "activations": a[a > 0].float()}


def underflow_summary(magnitudes: torch.Tensor, fmt, loss_scale: float = 1.0) -> dict:
    """What rounding `magnitudes * loss_scale` to `fmt` does: fractions that flush to zero, land among the
    subnormals (precision lost), stay normal, or overflow."""
    f = get_format(fmt)
    x = _as_float(magnitudes) * loss_scale
    r = round_to(x, f).abs()
    n = max(x.numel(), 1)
    zero = int(((r == 0) & (x != 0)).sum())
    over = int((torch.isinf(r) | torch.isnan(r) | ((r == f.max) & (x > f.max))).sum())
    sub = int(((r > 0) & (r < f.min_normal)).sum())
    return {"format": f.name, "loss_scale": loss_scale, "values": x.numel(), "to_zero": zero / n,
            "subnormal": sub / n, "normal": (x.numel() - zero - sub - over) / n, "overflow": over / n}


# -------------------------------------------------------------------------------------------- plots


_COLOURS = {"sign": "#d62728", "exponent": "#2ca02c", "mantissa": "#1f77b4"}


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_bit_layouts(formats: Sequence | None = None, ax=None):
    """Boxes for the sign, exponent and mantissa bits of each format, one row per format."""
    fs = [get_format(x) for x in (formats or FORMATS)]
    ax = _axes(ax, (10, 0.5 + 0.45 * len(fs)))
    for row, f in enumerate(reversed(fs)):
        fields = [("sign", 1), ("exponent", f.exponent_bits), ("mantissa", f.mantissa_bits)]
        if f.name == "tf32":
            fields.append(("unused", 13))  # stored in a 32-bit register, the low 13 bits ignored
        x = 0
        for kind, width in fields:
            ax.barh(row, width, left=x, color=_COLOURS.get(kind, "#dddddd"), edgecolor="white")
            if width:
                ax.text(x + width / 2, row, f"{kind[0].upper()}{width}" if kind != "unused" else "", ha="center",
                        va="center", fontsize=8, color="white")
            x += width
    ax.set_yticks(range(len(fs)), [f.name for f in reversed(fs)])
    ax.set_xlabel("bits (sign S, exponent E, mantissa M)")
    ax.set_xlim(0, 32)
    ax.set_title("Bit layouts")
    return ax


def plot_number_line(formats: Sequence = ("fp8_e4m3", "fp8_e5m2"), lo: float = 0.0, hi: float = 8.0,
                     log: bool = False, ax=None):
    """Every representable value of each format in [lo, hi] as a tick: see how density falls with magnitude."""
    fs = [get_format(x) for x in formats]
    ax = _axes(ax, (10, 0.6 + 0.5 * len(fs)))
    for row, f in enumerate(fs):
        v = positive_values(f)
        v = v[(v >= lo) & (v <= hi) & ((v > 0) if log else True)].numpy()
        ax.eventplot(v, lineoffsets=row, linelengths=0.7, linewidths=0.7)
    ax.set_yticks(range(len(fs)), [f.name for f in fs])
    if log:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("value")
    ax.set_title(f"Representable values in [{lo:g}, {hi:g}]")
    return ax


def plot_spacing(formats: Sequence | None = None, relative: bool = True, ax=None):
    """Gap to the next representable value against the value, over each format's whole range (log-log).

    relative=True divides the gap by the value: flat at about eps for normals (precision), rising towards 1
    in the subnormals, and the horizontal extent is the range.
    """
    ax = _axes(ax, (8, 4.5))
    for f in (get_format(x) for x in (formats or FORMATS)):
        x = torch.logspace(math.log10(f.min_subnormal), math.log10(f.max), 4000, dtype=torch.float64)
        _, e = torch.frexp(x)
        ulp = _pow2((e.long() - 1).clamp(min=f.emin) - f.mantissa_bits)
        y = ulp / x if relative else ulp
        ax.plot(x.numpy(), y.numpy(), label=f.name, linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("value")
    ax.set_ylabel("gap to next value / value" if relative else "gap to the next value (ulp)")
    ax.set_title("Relative spacing: flat (about eps) for normals, rising in the subnormals" if relative
                 else "Spacing doubles at every power of two")
    ax.legend(fontsize=8)
    return ax


def plot_gradient_histogram(grads: dict, formats: Sequence = ("fp16", "bf16", "fp8_e5m2"), ax=None):
    """Histogram of log2 |gradient| with each format's subnormal and normal range shaded beneath it."""
    ax = _axes(ax, (9, 4.5))
    allv = torch.cat(list(grads.values())).double().log2()
    bins = torch.linspace(float(allv.min()) - 1, float(allv.max()) + 1, 80).numpy()
    for label, mags in grads.items():  # each series as shares of its own total, so small sets stay visible
        logs = mags.double().log2().numpy()
        ax.hist(logs, bins=bins, weights=[1 / len(logs)] * len(logs), alpha=0.55,
                label=f"{label} ({mags.numel():,} values)")
    ymax = ax.get_ylim()[1]
    for i, f in enumerate(get_format(x) for x in formats):
        y0 = -ymax * (0.08 + 0.07 * i)
        lo, mid, hi = math.log2(f.min_subnormal), math.log2(f.min_normal), math.log2(f.max)
        ax.plot([lo, mid], [y0, y0], color=f"C{i + 2}", linewidth=2, linestyle=":")
        ax.plot([mid, hi], [y0, y0], color=f"C{i + 2}", linewidth=4, label=f"{f.name}: subnormal .. normal")
        ax.axvline(lo, color=f"C{i + 2}", linewidth=0.8, linestyle="--")
    ax.set_xlim(bins[0] - 2, max(bins[-1], 0) + 2)
    ax.set_ylim(-ymax * (0.12 + 0.07 * len(formats)), ymax)
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= ymax])
    ax.set_xlabel("log2 |gradient|   (dashed: smallest subnormal; left of it rounds to 0)")
    ax.set_ylabel("share of values per bin")
    ax.set_title("Real gradients against each format's range")
    ax.legend(fontsize=8, loc="upper left")
    return ax


# ---------------------------------------------------------------------------------------------- CLI


def add_cli(sub) -> None:
    p = sub.add_parser("formats", help="floating-point formats: property table, decode values, check rounding")
    p.add_argument("--format", dest="formats", action="append", metavar="NAME",
                   help=f"limit to this format (repeatable): {', '.join(FORMATS)}")
    p.add_argument("--value", type=float, action="append", metavar="X",
                   help="show how X is stored in each format: bits, fields, rounding error (repeatable)")
    p.add_argument("--check", action="store_true",
                   help="check rounding bit for bit against torch's casts (tf32: against a bit-level reference)")
    p.add_argument("--exhaustive", action="store_true",
                   help="with --check: all 2^32 float32 inputs instead of the targeted set (tens of minutes per format on a laptop)")
    p.add_argument("--plot", metavar="PATH", help="save bit layouts, number line and spacing plots to PATH (png)")
    p.set_defaults(func=_cli_formats)


def _cli_formats(args) -> int:
    names = [get_format(n).name for n in args.formats] if args.formats else list(FORMATS)
    print(text_table(property_table(names), floatfmt=".6g"))
    bad = finfo_mismatches(names)
    print("\ntorch.finfo agrees with every format above that torch has" if not bad else "\n" + "\n".join(bad))
    for v in args.value or []:
        print(f"\n{v!r}:")
        for n in names:
            print(decompose(v, n))
    failed = bool(bad)
    if args.check:
        print()
        for n in names:
            if FORMATS[n].dtype() is None and FORMATS[n].exponent_bits != 8:
                print(f"{n}: skipped (this torch has no {FORMATS[n].torch_dtype})")
                continue
            r = verify_rounding(n, exhaustive=args.exhaustive, progress=True)
            failed |= r["mismatches"] > 0
            print(f"{n}: {r['mismatches']} mismatches in {r['inputs']:,} inputs against {r['reference']} "
                  f"(overflow: {r['overflow']})" + (f", e.g. {r['examples']}" if r["mismatches"] else ""))
    if args.plot:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(3, 1, figsize=(10, 10), gridspec_kw={"height_ratios": [1.3, 1, 2]})
        plot_bit_layouts(names, ax=axes[0])
        plot_number_line(ax=axes[1])
        plot_spacing(names, ax=axes[2])
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplots saved to {args.plot}")
    return 1 if failed else 0

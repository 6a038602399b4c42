"""Week 1's exercise checks: labkit's references pass, and the usual wrong answers are caught with a clear message."""

import math

import pytest
import torch

from labkit import exercises as ex
from labkit import week1_exercises as w1


def test_week1_registers_its_code_exercises():
    assert ex.ids(1) == ["1.1", "1.2", "1.4", "1.6"]


@pytest.mark.parametrize("eid", ["1.1", "1.2", "1.4", "1.6"])
def test_reference_passes(eid):
    assert "right" in ex.check(eid, ex.reference(eid), quiet=True)


def test_ieee_format_refuses_bad_bit_counts():
    with pytest.raises(ex.LabkitError, match="exp_bits >= 2"):
        w1.ieee_format(1, 3)
    assert w1.ieee_format(5, 10).name == "fp16" and w1.ieee_format(4, 4).bias == 7


_decode = w1._ref_decode()  # one instance: it decodes each narrow format's patterns once


def test_decode_without_subnormals_is_caught():
    def no_subnormals(bits, e, m):  # treats exponent field 0 like a normal one
        if (bits >> m) & ((1 << e) - 1) == 0 and bits & ((1 << m) - 1):
            return math.copysign(math.ldexp((1 << m) + (bits & ((1 << m) - 1)), 1 - (2 ** (e - 1) - 1) - 1 - m),
                                 -1.0 if bits >> (e + m) else 1.0)
        return _decode(bits, e, m)

    with pytest.raises(ex.Wrong, match=r"fp16 pattern 0 00000 0000000001.*subnormal"):
        ex.check("1.1", no_subnormals)


def test_decode_losing_negative_zero_and_nan_is_caught():
    with pytest.raises(ex.Wrong, match="sign"):
        ex.check("1.1", lambda bits, e, m: abs(_decode(bits, e, m)))
    with pytest.raises(ex.Wrong, match="inf .mantissa 0. or NaN"):
        ex.check("1.1", lambda bits, e, m: math.inf if (bits >> m) & ((1 << e) - 1) == (1 << e) - 1
                 else _decode(bits, e, m))


def test_properties_with_the_all_ones_exponent_as_max_is_caught():
    ref = ex.reference("1.2")

    def wrong_max(e, m):
        d = dict(ref(e, m))
        d["max"] = (2 - 2.0**-m) * 2.0 ** (2**e - 1 - (2 ** (e - 1) - 1))
        return d

    with pytest.raises(ex.Wrong, match=r"fp16 \(E=5, M=10\): max should be 65504.0"):
        ex.check("1.2", wrong_max)
    with pytest.raises(ex.Wrong, match="keys"):
        ex.check("1.2", lambda e, m: (1, 2, 3, 4))


def _steps(x, e, m):
    xd = x.double()
    bias = 2 ** (e - 1) - 1
    _, ee = torch.frexp(xd.abs())
    return xd, torch.exp2(((ee - 1).clamp(min=1 - bias) - m).double()), (2 - 2.0**-m) * 2.0**bias


def test_rounding_mistakes_are_caught():
    def truncates(x, e, m):
        xd, step, _ = _steps(x, e, m)
        return (torch.trunc(xd / step) * step).float()

    def saturates(x, e, m):
        xd, step, top = _steps(x, e, m)
        y = torch.round(xd / step) * step
        return torch.where(torch.isfinite(xd), y.clamp(-top, top), xd).float()

    def half_up(x, e, m):
        xd, step, top = _steps(x, e, m)
        y = torch.copysign(torch.floor(xd.abs() / step + 0.5) * step, xd)
        y = torch.where(y.abs() > top, torch.copysign(torch.tensor(math.inf, dtype=torch.float64), xd), y)
        return torch.where(torch.isnan(xd), xd, y).float()

    with pytest.raises(ex.Wrong, match="differ from torch's x.to.torch.float16."):
        ex.check("1.4", truncates)
    with pytest.raises(ex.Wrong, match="overflows to inf"):
        ex.check("1.4", saturates)
    with pytest.raises(ex.Wrong, match="tie"):
        ex.check("1.4", half_up)


def test_rounding_in_place_is_caught():
    ref = ex.reference("1.4")

    def in_place(x, e, m):
        out = ref(x, e, m)
        x.copy_(out)
        return out

    with pytest.raises(ex.Wrong, match="in place"):
        ex.check("1.4", in_place)


@pytest.mark.parametrize("wrong, says", [
    (lambda g: float((g[g != 0].abs() < 2.0**-24).double().mean()), r"2\^-25 \(not 2\^-24"),
    (lambda g: float((g[g != 0] <= 2.0**-25).double().mean()), "negative gradients"),
    (lambda g: float((g.abs() <= 2.0**-25).double().mean()), "zeros"),
    (lambda g: float((g[g != 0].abs() < 2.0**-25).double().mean()), "exactly 2\\^-25"),
])
def test_flush_share_mistakes_are_caught(wrong, says):
    with pytest.raises(ex.Wrong, match=says):
        ex.check("1.6", wrong)


def test_flush_share_by_casting_is_right():
    assert "right" in ex.check("1.6", lambda g: float((g[g != 0].half() == 0).double().mean()), quiet=True)

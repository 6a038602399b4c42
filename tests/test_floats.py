"""labkit.floats: format specs against torch.finfo, bit-exact decoding, rounding checked against torch's casts."""

import bisect
import functools
import math
from fractions import Fraction

import pytest
import torch

from labkit import floats as fl
from labkit.cli import main as cli_main
from labkit.env import LabkitError

TORCH_FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]


def test_property_table_equals_torch_finfo():
    assert fl.finfo_mismatches() == []
    # The check itself must be able to fail: a format with one mantissa bit too many disagrees.
    wrong = fl.FloatFormat("fp16", 5, 11, 15, True, "inf", "float16")
    assert any("eps" in m for m in fl.finfo_mismatches([wrong]))
    rows = {r["format"]: r for r in fl.property_table()}
    assert set(rows) == set(fl.FORMATS)
    for name, f in fl.FORMATS.items():
        dtype = f.dtype()
        if dtype is not None:
            fi = torch.finfo(dtype)
            assert (rows[name]["max"], rows[name]["min_normal"], rows[name]["eps"]) == (fi.max, fi.tiny, fi.eps)


def test_format_facts_from_the_specs():
    f = fl.FORMATS
    assert f["fp8_e4m3"].max == 448 and f["fp8_e5m2"].max == 57344 and f["fp16"].max == 65504
    assert f["tf32"].eps == f["fp16"].eps == 2**-10 and f["tf32"].max == pytest.approx(f["fp32"].max, rel=1e-3)
    assert f["bf16"].min_subnormal == 2.0**-133 and f["fp16"].min_subnormal == 2.0**-24
    assert f["fp8_e4m3"].min_subnormal == 2.0**-9 and f["fp8_e5m2"].min_normal == 2.0**-14
    assert [f[n].bits for n in ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3")] == [32, 19, 16, 16, 8]


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_every_bit_pattern_decodes_like_torch_and_round_trips(name):
    f = fl.FORMATS[name]
    bits = torch.arange(2**f.bits)
    ours = fl.decode(bits, f)
    theirs = fl.torch_decode(bits, f.dtype())
    assert fl.same_values(ours, theirs).all()
    finite = ~torch.isnan(ours)
    assert torch.equal(fl.encode(ours, f)[finite], bits[finite])
    # Torch's own bit patterns for the decoded values agree too (NaN payloads aside).
    assert torch.equal(fl.torch_bits(ours.to(f.dtype()))[finite], bits[finite])


def test_every_tf32_pattern_is_the_top_19_bits_of_fp32():
    bits = torch.arange(2**19)
    as_fp32 = fl.float32_patterns(0, 2**32, 2**13)  # every fp32 pattern whose low 13 bits are zero
    assert fl.same_values(fl.decode(bits, "tf32"), as_fp32).all()
    finite = ~torch.isnan(as_fp32)
    assert torch.equal(fl.encode(as_fp32, "tf32")[finite], bits[finite])


@pytest.mark.parametrize("name", TORCH_FORMATS + ["fp32"])
def test_rounding_matches_torch_cast_on_ties_edges_and_random_bits(name):
    x = fl.rounding_test_inputs(name)
    r = fl.verify_rounding(name, x)
    assert r["reference"].startswith("torch.") and r["mismatches"] == 0, r
    assert r["inputs"] == x.numel() > 2_000_000
    # The inputs really contain the ties: every midpoint between neighbours is there.
    if name != "fp32":
        v = fl.positive_values(name)
        mids = ((v[:-1] + v[1:]) / 2).float()
        assert torch.isin(mids, x).all()


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_rounding_matches_torch_on_a_sweep_of_all_float32_patterns(name):
    x = fl.float32_patterns(0, 2**32, 8191)  # ~524k patterns spread over every exponent, both signs, NaNs
    assert fl.verify_rounding(name, x)["mismatches"] == 0


def test_tf32_rounding_matches_independent_bit_reference():
    assert fl.verify_rounding("tf32")["reference"] == "bit-manipulation reference"
    assert fl.verify_rounding("tf32")["mismatches"] == 0
    sweep = fl.float32_patterns(0, 2**32, 4099)
    assert fl.verify_rounding("tf32", sweep)["mismatches"] == 0
    # The reference itself agrees with torch where torch has the format (bf16 shares the exponent layout).
    x = fl.rounding_test_inputs("bf16", n_random=1 << 16)
    assert fl.same_values(fl.round_bits_reference(x, "bf16"), fl.torch_round(x, torch.bfloat16)).all()
    with pytest.raises(LabkitError, match="8-bit exponent"):
        fl.round_bits_reference(x, "fp16")


def test_the_check_catches_ties_rounded_away_from_zero(monkeypatch):
    real = fl.round_to

    def ties_away(x, fmt, overflow=None):
        f = fl.get_format(fmt)
        xd = fl._as_float32(x).double()
        _, e = torch.frexp(xd.abs())
        q = fl._pow2((e.long() - 1).clamp(min=f.emin) - f.mantissa_bits)
        r = torch.floor(xd.abs() / q + 0.5) * q  # half-way cases go up in magnitude: the classic mistake
        return real(torch.copysign(r, xd).float(), fmt, overflow=overflow)

    monkeypatch.setattr(fl, "round_to", ties_away)
    r = fl.verify_rounding("fp16")
    assert r["mismatches"] > 1000 and r["examples"]


@functools.cache
def _values_and_overflow(name: str) -> list[float]:
    """Every finite value >= 0 of the format (index = bit pattern, so an even index is an even mantissa), then
    one value past max (max + one top ulp) that stands for overflow."""
    f = fl.get_format(name)
    return fl.positive_values(f).tolist() + [f.max + 2.0 ** (f.emax - f.mantissa_bits)]


def _exact_round(x: float, fmt) -> float:
    """Rational reference: the nearest value of `fmt` to the float64 `x`, ties to the even bit pattern.

    Independent of round_to's arithmetic: it searches the format's listed values with exact Fractions, and
    the overflow threshold is a tie like any other.
    """
    f = fl.get_format(fmt)
    vals = _values_and_overflow(f.name)
    a = Fraction(abs(x))
    i = bisect.bisect_left(vals, a)
    if i == len(vals):
        r = vals[-1]
    elif vals[i] == a or i == 0:
        r = vals[i]
    else:
        lo, hi = vals[i - 1], vals[i]
        d_lo, d_hi = a - Fraction(lo), Fraction(hi) - a
        r = lo if d_lo < d_hi or (d_lo == d_hi and (i - 1) % 2 == 0) else hi
    if r == vals[-1]:
        r = {"inf": math.inf, "saturate": f.max, "nan": math.nan}[f.overflow]
    return math.copysign(r, x)


def _near_ties(fmt, n: int = 600) -> list[float]:
    """float64 midpoints between neighbours of `fmt` and the float64 numbers just beside them (both signs):
    all of them among the smallest and the largest 64 values, about `n` spread over the rest."""
    f = fl.get_format(fmt)
    vals = _values_and_overflow(f.name)[:-1]
    v = vals[:64] + vals[64:-64:max(1, len(vals) // n)] + vals[-64:]
    out = []
    for lo in v:
        ulp = 2.0 ** (max(math.frexp(lo)[1] - 1, f.emin) - f.mantissa_bits) if lo else f.min_subnormal
        mid = lo + ulp / 2
        out += [mid, math.nextafter(mid, math.inf), math.nextafter(mid, -math.inf)]
    return out + [-x for x in out]


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "tf32"])
def test_float64_rounds_once_exactly_like_rational_rounding(name):
    xs = _near_ties(name)
    xs += [65519.999999999, 2.98e-08, 2.980232238769532e-08, 1e300, 5e-324, 0.1, 1 / 3]
    exact = torch.tensor([_exact_round(x, name) for x in xs])
    x64 = torch.tensor(xs, dtype=torch.float64)
    assert fl.same_values(fl.round_to(x64, name), exact.float()).all()
    # numpy float64 and plain Python floats take the same single rounding
    np = pytest.importorskip("numpy")
    assert fl.same_values(fl.round_to(np.array(xs), name), exact.float()).all()
    assert fl.same_values(fl.round_to(xs, name), exact.float()).all()
    # through float32 first, some near-ties land on the wrong neighbour
    twice = fl.round_to(x64, name, via_float32=True)
    assert (~fl.same_values(twice, exact.float())).sum() > 0
    dtype = fl.get_format(name).dtype()
    if dtype is not None:  # ... which is what torch's own cast from float64 does
        torch_policy = fl.torch_overflow_policy(dtype)
        ours = fl.round_to(x64, name, via_float32=True, overflow=torch_policy)
        assert fl.same_values(ours, fl.torch_round(x64, dtype)).all()


def test_double_rounding_examples_from_the_issue():
    assert fl.round_to(65519.999999999, "fp16").item() == 65504.0
    assert fl.round_to(65519.999999999, "fp16", via_float32=True).item() == math.inf
    # Just above half the smallest subnormal (2**-25): exactly, it rounds up to 2**-24; float32 rounds it onto
    # 2**-25 itself, a tie, which goes to the even neighbour, 0. (2.98e-08 is just below 2**-25: 0 either way.)
    above_half = 2.980232238769532e-08
    assert above_half == math.nextafter(2.0**-25, 1.0)
    assert fl.round_to(above_half, "fp16").item() == 2.0**-24
    assert fl.round_to(above_half, "fp16", via_float32=True).item() == 0.0
    assert fl.round_to(2.98e-08, "fp16").item() == 0.0
    assert torch.tensor(65519.999999999, dtype=torch.float64).to(torch.float16).item() == math.inf  # torch: twice
    assert fl.decompose(65519.999999999, "fp16").value == 65504.0
    assert fl.decompose(65519.999999999, "fp16", via_float32=True).kind == "inf"
    bits = fl.encode(torch.tensor([above_half], dtype=torch.float64), "fp16")
    assert bits.tolist() == [1]  # the smallest subnormal


def test_overflow_policies():
    x = torch.tensor([500.0, -1e9, math.inf, math.nan, 448.0, 465.0, 463.0])
    sat = fl.round_to(x, "fp8_e4m3", overflow="saturate")
    assert sat[:3].tolist() == [448.0, -448.0, 448.0] and math.isnan(sat[3]) and sat[4:].tolist() == [448.0] * 3
    nan = fl.round_to(x, "fp8_e4m3", overflow="nan")
    # 465 lies past the 464 tie between 448 and 480 (the NaN slot), so it overflows; 463 does not.
    assert torch.isnan(nan[[0, 1, 2, 3, 5]]).all() and nan[[4, 6]].tolist() == [448.0, 448.0]
    assert fl.round_to(torch.tensor([65520.0, 65519.0]), "fp16").tolist() == [math.inf, 65504.0]
    with pytest.raises(LabkitError, match="no infinity"):
        fl.round_to(x, "fp8_e4m3", overflow="inf")
    assert fl.torch_overflow_policy(torch.float16) == "inf"
    assert fl.torch_overflow_policy(torch.float8_e4m3fn) in ("saturate", "nan")


def test_subnormals_and_signed_zero():
    f = fl.FORMATS["fp16"]
    tiny = f.min_subnormal
    x = torch.tensor([tiny * 0.5, tiny * 0.51, tiny * 1.5, tiny * 2.5, -tiny * 0.25, f.min_normal - tiny / 2])
    r = fl.round_to(x, "fp16")
    assert r.tolist() == [0.0, tiny, 2 * tiny, 2 * tiny, -0.0, f.min_normal]  # ties to even, in the subnormals too
    assert torch.signbit(r[4])


def test_decompose_and_compose():
    d = fl.decompose(1.0, "fp16")
    assert (d.bits, d.sign, d.exponent, d.mantissa, d.kind) == (0x3C00, 0, 15, 0, "normal")
    assert d.bit_string() == "0 01111 0000000000"
    assert fl.decompose(-2.0, "bf16").bits == 0xC000
    assert fl.decompose(448.0, "fp8_e4m3").bits == 0x7E and fl.decompose(1e6, "fp8_e4m3").value == 448.0
    assert fl.decompose(2.0**-24, "fp16").kind == "subnormal"
    assert fl.decompose(1e-9, "fp16").kind == "zero" and fl.decompose(1e9, "fp16").kind == "inf"
    assert fl.decompose(math.nan, "fp8_e4m3").bits == 0x7F
    d = fl.decompose(0.1, "bf16")
    assert d.value == 0.10009765625 and "rounding error" in str(d)
    assert fl.compose(d.sign, d.exponent, d.mantissa, "bf16") == d.value
    assert fl.compose(0, 0, 1, "fp8_e5m2") == 2.0**-16
    with pytest.raises(LabkitError, match="exponent 0..15"):
        fl.compose(0, 16, 0, "fp8_e4m3")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(LabkitError, match="unknown float format"):
        fl.get_format("fp7")
    assert fl.get_format(torch.bfloat16).name == "bf16" and fl.get_format("E4M3").name == "fp8_e4m3"
    with pytest.raises(LabkitError, match="float input"):
        fl.round_to(torch.ones(3, dtype=torch.int32), "fp16")
    with pytest.raises(LabkitError, match="float32 inputs, got float64"):
        fl.round_bits_reference(torch.ones(3, dtype=torch.float64), "bf16")
    with pytest.raises(LabkitError, match="bit patterns run from 0 to 255"):
        fl.decode([256], "fp8_e5m2")
    with pytest.raises(LabkitError, match="overflow"):
        fl.round_to(torch.ones(1), "fp16", overflow="wrap")
    assert fl.round_to(torch.ones(2, dtype=torch.float16), "bf16").dtype == torch.float32


def test_underflow_summary_and_real_gradients():
    mags = torch.tensor([1e-9, 1e-6, 1e-3, 1e6])
    s = fl.underflow_summary(mags, "fp16")
    assert (s["to_zero"], s["subnormal"], s["normal"], s["overflow"]) == (0.25, 0.25, 0.25, 0.25)
    scaled = fl.underflow_summary(mags, "fp16", loss_scale=1024)
    assert scaled["to_zero"] == 0 and scaled["subnormal"] == 0.25
    assert fl.underflow_summary(mags, "bf16")["normal"] == 1.0
    grads = fl.gradient_magnitudes(batch_size=8, steps=2)
    assert set(grads) == {"weights", "activations"}
    for g in grads.values():
        assert g.numel() > 1000 and (g > 0).all() and torch.isfinite(g).all()
    # Activation gradients of a mean loss sit lower than weight gradients: the fp16 problem is real there.
    assert grads["activations"].median() < grads["weights"].median()


def test_gradient_tensors_keep_each_step_by_name():
    steps = fl.gradient_tensors(batch_size=4, width=4, steps=2)
    assert len(steps) == 2
    for step in steps:
        assert set(step) == {"weights", "weight_grads", "activation_grads"}
        assert set(step["weights"]) == set(step["weight_grads"]) and "fc" in step["activation_grads"]
        for name, g in step["weight_grads"].items():
            assert g.shape == step["weights"][name].shape and torch.isfinite(g).all()
    # The second step's weights are the first's moved by SGD: the gradients were taken at different points.
    assert not torch.equal(steps[0]["weights"]["fc.weight"], steps[1]["weights"]["fc.weight"])
    last = steps[-1]["activation_grads"]
    mags = fl.gradient_magnitudes(batch_size=4, width=4, steps=2)["activations"]
    assert mags.numel() == sum(int((t != 0).sum()) for t in last.values())
    with pytest.raises(LabkitError, match="positive"):
        fl.gradient_tensors(steps=0)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1 + 2**-9)  # a quarter of the way from 1 to the next bf16 value, 1 + 2^-7
    r = fl.round_stochastic(x, "bf16", generator=g)
    assert set(r.unique().tolist()) == {1.0, 1 + 2**-7}
    assert float((r > 1).double().mean()) == pytest.approx(0.25, abs=0.005)
    assert float(r.double().mean()) == pytest.approx(1 + 2**-9, rel=2e-5)
    assert fl.round_to(x, "bf16").unique().tolist() == [1.0]  # round to nearest always goes down
    # Values of the format are kept, signs and specials too; subnormals round within the subnormal grid.
    exact = fl.positive_values("fp8_e4m3").float()
    assert torch.equal(fl.round_stochastic(exact, "fp8_e4m3", generator=g), exact)
    assert torch.equal(fl.round_stochastic(-exact, "fp8_e4m3", generator=g), -exact)
    tiny = fl.round_stochastic(torch.full((1000,), 2.0**-11), "fp8_e4m3", generator=g)  # 1/4 of the subnormal gap
    assert set(tiny.unique().tolist()) == {0.0, 2.0**-9}
    special = fl.round_stochastic(torch.tensor([math.nan, math.inf, 1e6, 470.0]), "fp8_e4m3", generator=g)
    assert math.isnan(special[0]) and special[1:3].tolist() == [448.0, 448.0] and special[3] == 448.0
    assert fl.round_stochastic(torch.tensor([7e4]), "fp16").item() == math.inf
    # Repeatable with a seeded generator.
    a = fl.round_stochastic(x[:100], "bf16", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, fl.round_stochastic(x[:100], "bf16", generator=torch.Generator().manual_seed(3)))


def test_plots_return_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grads = {"weights": torch.tensor([1e-3, 1e-5, 2e-7]), "activations": torch.tensor([1e-8, 1e-4])}
    for ax in (fl.plot_bit_layouts(), fl.plot_number_line(), fl.plot_number_line(["fp16"], 1e-8, 1e5, log=True),
               fl.plot_spacing(), fl.plot_gradient_histogram(grads)):
        assert ax.get_title()
    plt.close("all")


def test_cli_formats(capsys, tmp_path):
    assert cli_main(["formats", "--format", "fp16", "--format", "e4m3", "--value", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "65504" in out.replace(",", "") or "6.55e+04" in out
    assert "0 01011 1001100110" in out and "torch.finfo agrees" in out
    assert cli_main(["formats", "--format", "fp8_e5m2", "--format", "tf32", "--check",
                     "--plot", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert out.count(" 0 mismatches") == 2 and (tmp_path / "f.png").stat().st_size > 1000
    assert cli_main(["formats", "--format", "fp7"]) == 2
    assert "unknown float format" in capsys.readouterr().err

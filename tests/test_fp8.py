"""labkit.fp8: per-tensor, delayed and MX block scaling into fp8, against torch's casts and on real gradients."""

import math

import pytest
import torch

from labkit import floats as fl
from labkit import fp8
from labkit.env import LabkitError


def test_per_tensor_scaling_maps_amax_to_max_and_matches_torch():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-4
    s = fp8.scale_for(float(x.abs().max()), "fp8_e4m3")
    assert float(x.abs().max()) * s == pytest.approx(448.0)
    q = fp8.per_tensor(x, "fp8_e4m3")
    if hasattr(torch, "float8_e4m3fn"):  # the same cast, done by torch
        ref = ((x.double() * s).float().to(torch.float8_e4m3fn).double() / s).float()
        assert torch.equal(q, ref)
    assert (q - x).abs().max() <= float(x.abs().max()) * 2**-4  # half a gap at the top binade
    assert fp8.scale_for(0.0) == 1.0 and fp8.scale_for(math.inf) == 1.0
    assert fp8.scale_for(448.0, "fp8_e4m3", margin=1) == 0.5
    with pytest.raises(LabkitError, match="positive finite"):
        fp8.quantize(x, "fp8_e4m3", scale=0.0)
    with pytest.raises(LabkitError, match="float tensors"):
        fp8.per_tensor(torch.ones(3, dtype=torch.int64))


def test_unscaled_gradients_flush_to_zero_in_e4m3():
    x = torch.full((10,), 1e-4)
    assert (fp8.quantize(x, "fp8_e4m3") == 0).all()  # below half of e4m3's smallest subnormal, 2^-10
    assert (fp8.per_tensor(x, "fp8_e4m3") == x).all()  # scaled: 1e-4 maps to exactly 448 and back


def test_mx_exponents_follow_the_spec_and_rounding_up_avoids_saturation():
    x = torch.zeros(64)
    x[0], x[1], x[32] = 500.0, 1.0, 0.25
    floor = fp8.mx_exponents(x, "fp8_e4m3")
    assert floor.tolist() == [8 - 8, -2 - 8]  # floor(log2 amax) - emax(e4m3) = 8
    assert fp8.mx_exponents(x, "fp8_e4m3", exponent="up").tolist() == [1, -10]  # ceil(log2(amax / 448))
    assert fp8.mx_exponents(torch.zeros(40), "fp8_e5m2").tolist() == [0, 0]
    q = fp8.mx_block(x, "fp8_e4m3")
    assert q[0] == 448.0 and q[1] == 1.0  # the floor scale leaves 500 past the max: it saturates
    assert fp8.mx_block(x, "fp8_e4m3", exponent="up")[0] == 512.0  # 250 * 2 exactly
    assert fp8.mx_block(torch.arange(40.0), "fp8_e5m2").shape == (40,)  # a partial last block
    with pytest.raises(LabkitError, match="exponent"):
        fp8.mx_exponents(x, exponent="nearest")
    with pytest.raises(LabkitError, match="block"):
        fp8.mx_block(x, block=0)


def test_mx_block_keeps_small_blocks_that_per_tensor_flushes():
    x = torch.cat([torch.full((32,), 1000.0), torch.full((32,), 1e-3)])  # one outlier block
    assert (fp8.per_tensor(x, "fp8_e4m3")[32:] == 0).all()
    assert torch.allclose(fp8.mx_block(x, "fp8_e4m3", exponent="up")[32:], x[32:], rtol=2**-4)


def test_delayed_scaling_uses_the_history_and_saturates_on_a_spike():
    d = fp8.DelayedScaler("fp8_e4m3", history_len=2)
    assert d.scale("g") is None
    x = torch.linspace(-1, 1, 101)
    assert torch.equal(d.quantize("g", x), fp8.per_tensor(x, "fp8_e4m3"))  # first cast: its own amax
    assert d.scale("g") == pytest.approx(448.0)
    spike = d.quantize("g", 4 * x)  # scaled with amax 1: everything past 1 clips
    assert spike.abs().max() == pytest.approx(1.0)
    d.quantize("g", 0.5 * x)
    assert list(d.history["g"]) == [4.0, 0.5]  # only the last two are kept
    with pytest.raises(LabkitError, match="history_len"):
        fp8.DelayedScaler(history_len=0)


def test_compare_scaling_on_real_gradients():
    steps = [s["activation_grads"] for s in fl.gradient_tensors(batch_size=4, width=4, steps=3)]
    rows = {r["method"]: r for r in fp8.compare_scaling(steps, "fp8_e4m3")}
    assert list(rows) == ["no scaling", "per-tensor amax", "delayed (amax history)", "MX block of 32, exponent floor",
                          "MX block of 32, exponent up"]
    assert all(r["tensors"] == 2 * len(steps[0]) for r in rows.values())  # steps 1 and 2, every layer
    assert rows["no scaling"]["to_zero"] > 0.3  # gradients sit far below e4m3's range
    for m in ("per-tensor amax", "delayed (amax history)", "MX block of 32, exponent up"):
        assert rows[m]["relative_error"] < 0.05 and rows[m]["to_zero"] < 0.02, m
    assert rows["MX block of 32, exponent up"]["saturated"] == 0 < rows["MX block of 32, exponent floor"]["saturated"]
    spiked = steps[:-1] + [{k: 8 * v for k, v in steps[-1].items()}]
    hit = {r["method"]: r for r in fp8.compare_scaling(spiked, "fp8_e4m3", evaluate_from=2)}
    assert hit["delayed (amax history)"]["relative_error"] > 5 * hit["per-tensor amax"]["relative_error"]
    with pytest.raises(LabkitError, match="evaluate"):
        fp8.compare_scaling(steps, evaluate_from=3)


def test_plot_scaling():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"method": m, "format": f, "relative_error": e, "to_zero": 0.1}
            for f in ("fp8_e4m3", "fp8_e5m2") for m, e in (("no scaling", 0.4), ("per-tensor amax", 0.03))]
    ax = fp8.plot_scaling(rows)
    assert ax.get_yscale() == "log" and ax.get_ylabel() and len(ax.patches) == 4
    plt.close("all")

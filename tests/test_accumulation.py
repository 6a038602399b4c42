"""labkit.accumulation: swamping in narrow running sums, lost updates, and stochastic rounding as the fix."""

import pytest
import torch

from labkit import accumulation as acc
from labkit import floats as fl
from labkit.env import LabkitError


def test_round_to_nearest_stalls_where_stochastic_rounding_keeps_going():
    steps, inc = 2000, 1e-4  # half the bf16 gap above 1.0 is 2^-8, about 0.0039: far more than 1e-4
    nearest = acc.repeated_add(1.0, inc, steps, "bf16")
    assert nearest.shape == (1, steps + 1) and (nearest == 1.0).all()
    sr = acc.repeated_add(1.0, inc, steps, "bf16", rounding="stochastic", trials=64, seed=1)
    final = sr[:, -1]
    assert float(final.mean()) == pytest.approx(1 + steps * inc, abs=0.02)  # unbiased on average
    assert final.std() > 0  # trials differ
    assert set(torch.unique(fl.round_to(sr.flatten(), "bf16") == sr.flatten().float()).tolist()) == {True}
    fp32 = acc.repeated_add(1.0, inc, steps, "fp32")
    assert float(fp32[0, -1]) == pytest.approx(1.2, rel=1e-4)


def test_running_sum_is_exact_when_nothing_is_rounded_away():
    v = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 0.125]])
    assert acc.running_sum(v, "bf16").tolist() == [[1.0, 3.0, 6.0], [0.5, 0.75, 0.875]]
    assert acc.running_sum(torch.tensor([256.0, 1.0]), "bf16").tolist() == [256.0, 256.0]  # 257 ties to even
    with pytest.raises(LabkitError, match="rounding"):
        acc.running_sum(v, "bf16", rounding="up")
    with pytest.raises(LabkitError, match="non-empty float"):
        acc.running_sum(torch.tensor([1, 2]), "bf16")
    with pytest.raises(LabkitError, match="steps"):
        acc.repeated_add(1.0, 1e-4, 0)


def test_bf16_running_sum_swamps_and_the_fixes_do_not():
    v = fl.round_to(torch.rand(2048, generator=torch.Generator().manual_seed(0)), "bf16")
    rows = {r["method"]: r for r in acc.summation_errors(v, "bf16", block=32)}
    assert rows["bf16 running sum, round to nearest"]["sum"] == 256.0  # adding values < 1 to 256 changes nothing
    assert rows["bf16 running sum, round to nearest"]["relative_error"] > 0.7
    for method in ("bf16 pairwise (tree) sum", "bf16 blocks of 32, then the block sums", "fp32 running sum",
                   "torch.sum of a bfloat16 tensor"):
        assert rows[method]["relative_error"] < 0.02, method
    # Stochastic rounding is unbiased but noisy: every addition moves by up to a whole gap at random.
    assert rows["bf16 running sum, stochastic rounding"]["relative_error"] < 0.25
    assert rows["fp32 running sum"]["relative_error"] < 1e-6
    assert acc.pairwise_sum(torch.ones(5), "bf16") == 5.0
    # Blocks too small swamp the outer sum, blocks too large swamp the inner ones.
    exact = float(v.double().sum())
    assert abs(acc.blocked_sum(v, "bf16", 2) - exact) / exact > 0.05
    assert abs(acc.blocked_sum(v, "bf16", 2048) - exact) / exact > 0.7
    with pytest.raises(LabkitError, match="block"):
        acc.blocked_sum(v, "bf16", 0)


def test_update_survival_counts_lost_updates():
    w = torch.tensor([1.0, 1.0, 1.0, 0.001])
    u = torch.tensor([1e-3, 1e-2, 0.0, 1e-3])  # 1e-3 on 1.0 is below half a bf16 gap; 1e-2 is not
    r = acc.update_survival(w, u, "bf16")
    assert r["updates"] == 3 and r["lost"] == pytest.approx(1 / 3)
    assert acc.update_survival(w, u, "fp32")["lost"] == 0
    assert acc.update_survival({"a": w[:2], "b": w[2:]}, [u[:2], u[2:]], "bf16") == r
    big = acc.update_survival(torch.ones(20000), torch.full((20000,), 1e-3), "bf16", rounding="stochastic")
    assert big["applied"] == pytest.approx(1.0, abs=0.05) and 0.6 < big["lost"] < 0.95
    with pytest.raises(LabkitError, match="differ in size"):
        acc.update_survival(w, u[:3])


def test_plot_repeated_add():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = {"bf16, nearest": acc.repeated_add(1.0, 1e-3, 20),
         "bf16, stochastic": acc.repeated_add(1.0, 1e-3, 20, rounding="stochastic", trials=4)}
    ax = acc.plot_repeated_add(t, 1.0, 1e-3)
    assert ax.get_title() and ax.get_xlabel() == "step" and len(ax.get_legend().get_texts()) == 3
    plt.close("all")

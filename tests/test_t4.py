"""A faked T4 (compute capability 7.5, the free Colab GPU): bf16 is emulated there, so every path that would use
it (capabilities, the ladder's rungs, the notebooks' precision choice, lab 4's reference twin and speed tiers)
must fall back to fp16 with loss scaling and say so. The card is faked by tests/t4_fake.py with a "cuda" device
that resolves; nothing runs on a GPU, only the decisions are checked. tests/test_t4_fake.py runs the notebooks'
card-reading cells and lab 4's speed check under the same fake."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import t4_fake
import torch

from labkit import env
from labkit import train as T
from labkit.env import LabkitError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def t4():
    with t4_fake.fake_t4(cuda_device=True):
        yield torch.device("cuda", 0)


@pytest.fixture
def a100():
    facts = env.GpuFacts(name="NVIDIA A100", capability=(8, 0), memory_bytes=40 * 2**30, multiprocessors=108,
                         bf16_emulated=False, simulated=True)
    with t4_fake.fake_gpu(facts, cuda_device=True):
        yield torch.device("cuda", 0)


def test_capabilities_count_only_native_bf16(t4):
    caps = env.capabilities("cuda")
    assert caps["capability"] == "7.5" and caps["tensor_cores"] and caps["fp16_tensor_cores"]
    assert caps["bf16"] is False and caps["bf16_emulated"] is True and caps["amp"] == "fp16"
    assert not caps["tf32"] and not caps["fp8"]
    assert env.native_bf16("cuda") is False and env.amp_precision("cuda") == "fp16"


def test_ampere_and_the_cpu_keep_bf16(a100):
    caps = env.capabilities("cuda")
    assert caps["bf16"] and not caps["bf16_emulated"] and caps["amp"] == "bf16" and caps["tf32"]
    assert env.native_bf16("cpu") and env.amp_precision("cpu") == "bf16"


def test_doctor_says_bf16_is_emulated_and_what_the_course_uses(t4, monkeypatch):
    import io

    monkeypatch.setattr(env, "environment", lambda **k: {"python": "3", "platform": "x", "cpu_count": 2, "torch": "t",
                                                         "cuda": "c", "cudnn": 1, "git_commit": "g"})
    out = io.StringIO()
    env.doctor(out=out, packages=[])
    text = out.getvalue()
    assert "bf16           no  (emulated by torch, no bf16 tensor cores: the course uses fp16" in text
    assert "bf16 rung runs as fp16 autocast with GradScaler" in text


def test_the_ladder_runs_its_bf16_rungs_as_fp16_with_loss_scaling_and_says_so(t4):
    plan = T.plan_ladder(t4, quick=False)
    prec = {c.name: c.precision for c in plan.rungs}
    assert prec["resident_data"] == "default" and prec["bf16"] == "fp16" and prec["muon"] == "fp16"
    assert plan.notes and "compute capability 7.5 has no bf16 tensor cores" in plan.notes[0]
    assert "GradScaler" in plan.notes[0]
    for cfg in plan.rungs:
        T.check_config(cfg, t4)  # every planned rung is valid there
    with pytest.raises(LabkitError, match="need compute capability 8.0.*use precision=fp16"):
        T.check_config(T.preset("bf16"), t4)


def test_a_native_bf16_gpu_keeps_the_bf16_rungs(a100):
    plan = T.plan_ladder(torch.device("cuda", 0), quick=False)
    assert {c.name: c.precision for c in plan.rungs}["bf16"] == "bf16" and not plan.notes


def test_the_ladder_measures_its_mfu_peak_in_fp16_there(t4, monkeypatch):
    asked = []
    monkeypatch.setattr(T, "peak_matmul_tflops", lambda dev, dtype=torch.bfloat16: asked.append(dtype) or 65.0)
    assert T._mfu_peak(t4) == (65.0, "fp16") and asked == [torch.float16]


def test_lab4_reference_twin_and_speed_tiers_follow_the_hardware_class(t4):
    from autograder.checks import gpu_policy, lab4_checks

    assert lab4_checks._twin_dtype(t4) == torch.float16
    klass, tiers = gpu_policy.lab4_speed_tiers(t4, "tensor_core_gpu")
    assert klass == "fp16_tensor_core_gpu" and tiers is gpu_policy.LAB4_SPEED_TIERS["fp16_tensor_core_gpu"]
    assert "policy" in gpu_policy.LAB4_TIER_BASIS[klass]
    h100 = gpu_policy.LAB4_SPEED_TIERS["bf16_tensor_core_gpu"]
    assert tiers.fraction(2.0) == 1.0 and h100.fraction(2.0) < 1.0  # a T4 is not held to the H100's 3x
    assert lab4_checks.SPEED_TIERS["tensor_core_gpu"] is h100
    assert gpu_policy.lab4_speed_tiers("cpu", "cpu") is None


def test_lab4_speed_check_grades_a_t4_on_its_own_tiers(t4, monkeypatch):
    from autograder.checks import lab4_checks

    seen = []
    monkeypatch.setattr(lab4_checks, "_speed", lambda ctx, tiers, klass: seen.append(tiers) or {"fraction": 1.0})
    lab4_checks.check_speed(SimpleNamespace(device=t4, hardware="tensor_core_gpu"))
    from autograder.checks import gpu_policy

    assert seen == [gpu_policy.LAB4_SPEED_TIERS["fp16_tensor_core_gpu"]]


def test_lab4_speed_check_on_an_h100_class_card_keeps_the_calibrated_tiers(a100, monkeypatch):
    from autograder.checks import gpu_policy, lab4_checks

    seen = []
    monkeypatch.setattr(lab4_checks, "_speed", lambda ctx, tiers, klass: seen.append(tiers) or {"fraction": 1.0})
    lab4_checks.check_speed(SimpleNamespace(device=torch.device("cuda", 0), hardware="tensor_core_gpu"))
    assert seen == [gpu_policy.LAB4_SPEED_TIERS["bf16_tensor_core_gpu"]]


@pytest.mark.parametrize("nb", ["03_mixed_precision", "06_resnet_ladder"])
def test_notebooks_pick_their_16_bit_format_from_the_device(nb, t4):
    """The notebooks that train in 16 bits ask labkit which format (amp_precision) instead of naming bf16; on the
    faked T4 that answer is fp16, and the week-6 quick path's plan follows it."""
    cells = json.loads((ROOT / "notebooks" / f"{nb}.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "amp_precision(DEVICE)" in code
    assert env.amp_precision(t4) == "fp16"
    if nb == "06_resnet_ladder":
        plan = T.plan_ladder(t4, quick=True, names=["resident_data", "bf16"])
        assert [c.precision for c in plan.rungs] == ["default", "fp16"]

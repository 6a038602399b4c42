"""Lab 4's reference solution trains in the card's own 16-bit format: bf16 where it is native, fp16 with a
GradScaler on a T4-class card (faked on the CPU by tests/t4_fake.py).

What the reference's step chose is read from its closure (`half`, `scaler`, `opt`): no CUDA kernel runs. The fp16
step itself runs on the CPU under the fake (torch's CPU autocast takes fp16) through lab 4's trusted correctness
check, in this process, against the fp16 twin the grader uses on a T4: same first loss, same first update,
momentum, one optimizer update per call. On a CPU without the fake the reference still trains bf16 with the scaler
off, as the CPU-sized lab 4 tests (test_harness, test_hostile_lab4, test_assignments) grade it.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import t4_fake
import torch
import torch.nn.functional as F

from autograder.checks import lab4_checks as L
from autograder.checks.harness import student_file_from_notebook
from autograder.student import lab4 as scen

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "assignments" / "source" / "lab4_speedrun" / "lab4_speedrun.ipynb"
FP16_MAX = torch.finfo(torch.float16).max  # 65504
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference solution's module, as the notebook's %%writefile cell writes it."""
    f = student_file_from_notebook(NB, tmp_path_factory.mktemp("lab4_ref"))
    spec = importlib.util.spec_from_file_location("lab4_reference_fp16", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def chosen(step) -> dict:
    """What build_train_step decided, from the step's closure."""
    return inspect.getclosurevars(step).nonlocals


def build(reference, width: int = 8):
    return reference.build_train_step(scen.fresh_model(width, CPU), device=CPU, **scen.HYPER)


def test_on_a_t4_the_reference_picks_fp16_with_a_loss_scaler(reference):
    with t4_fake.fake_t4():
        got = chosen(build(reference))
    assert got["half"] == torch.float16
    assert isinstance(got["scaler"], torch.amp.GradScaler) and got["scaler"].is_enabled()
    assert got["scaler"].get_scale() == 2.0**10  # the initial scale test_the_initial_scale_... checks


def test_where_bf16_is_native_the_reference_keeps_bf16_and_no_scaler(reference):
    got = chosen(build(reference))  # a CPU: autocast's bf16 (an A100/H100 takes the same branch: amp_precision)
    assert got["half"] == torch.bfloat16 and not got["scaler"].is_enabled()


def test_the_fp16_step_passes_lab4_correctness_against_the_fp16_twin(reference):
    """Lab 4's trusted correctness check (the T4's fp16 twin) on the reference's fp16 + GradScaler step, run in
    this process on the CPU under the fake; the scaler never skipped an update (its scale never halved)."""
    steps = []

    def trajectory(name, params):
        assert name == "lab4.trajectory"

        def builder(model, device, hyper):
            steps.append(reference.build_train_step(model, device=device, **hyper))
            return steps[-1]

        return scen.trajectory(builder, CPU, params)

    ctx = SimpleNamespace(device=CPU, small=True, call=trajectory)
    with t4_fake.fake_t4():
        assert L._twin_dtype(CPU) == torch.float16
        m, _ = L._correctness(ctx, scen.HYPER, seed=L.SEEDS["correctness"])
    scaler = chosen(steps[0])["scaler"]
    assert chosen(steps[0])["half"] == torch.float16 and scaler.is_enabled()
    assert m["steps_that_updated"] == m["k"] and scaler.get_scale() == 2.0**10, (m, scaler.get_scale())


def test_the_initial_scale_cannot_overflow_fp16_on_the_first_step(reference):
    """The full-width model's fp32 gradients at its initial weights on the grader's first batch, times the
    reference's initial scale, stay 16x below fp16's largest value: the first update is never skipped.
    (Batch 16 here, 512 on a GPU: parameter gradients are batch means, activation gradients shrink with the
    batch, so the small batch errs high. At batch 512 the largest one stayed below 1 over 65 steps, measured
    in fp32 on a CPU.)"""
    scale = chosen(build(reference))["scaler"].get_scale()  # a disabled scaler still reports its initial scale
    model = scen.fresh_model(64, CPU, seed=L.SEEDS["correctness"])
    (x, y), = scen.make_batches(1, 16, CPU, seed=L.SEEDS["correctness"])
    largest = [0.0]

    def hook(module, grad_in, grad_out):
        largest[0] = max([largest[0]] + [float(g.abs().max()) for g in grad_out if g is not None])

    for mod in model.modules():
        if not list(mod.children()):
            mod.register_full_backward_hook(hook)
    mean, std = torch.tensor(scen.MEAN).view(1, 3, 1, 1), torch.tensor(scen.STD).view(1, 3, 1, 1)
    x = ((x.float() / 255 - mean) / std).requires_grad_()
    F.cross_entropy(model(x), y).backward()
    largest[0] = max([largest[0]] + [float(p.grad.abs().max()) for p in model.parameters()])
    assert scale * largest[0] < FP16_MAX / 16, (scale, largest[0])


def test_with_a_fused_optimizer_the_scaler_reads_nothing_on_the_host():
    """The reference's T4 step is GradScaler + fused SGD (fused on CUDA): the scaler hands its scale and inf flag
    to the fused kernel (`_step_supports_amp_scaling`), so no value comes back to the host; a foreach optimizer
    would read the inf flag every step. Shown on CPU tensors with .item() made to fail."""
    def step_with(**kind):
        p = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, **kind)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (p * 2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return p

    def no_host_read(self):
        raise AssertionError("a host read in the scaler's step")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "item", no_host_read)
        assert torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], fused=True)._step_supports_amp_scaling
        assert torch.allclose(step_with(fused=True).detach(), torch.full((8,), 0.8))  # unscaled in the kernel
        with pytest.raises(AssertionError, match="host read"):
            step_with(foreach=True)

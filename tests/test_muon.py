import math

import pytest
import torch

from labkit import train as T
from labkit.env import LabkitError
from labkit.muon import Muon, orthogonalize


def test_orthogonalize_flattens_the_spectrum_and_batches_without_mixing_matrices():
    torch.manual_seed(0)
    g = torch.randn(3, 16, 40) * torch.logspace(-3, 1, 40)  # singular values spread over orders of magnitude
    assert torch.linalg.svdvals(g[0]).max() / torch.linalg.svdvals(g[0]).min() > 20
    out = orthogonalize(g).float()
    for i in range(3):
        s = torch.linalg.svdvals(out[i])
        assert 0.5 < s.min() and s.max() < 1.5, s
        assert torch.equal(out[i], orthogonalize(g[i]).float())  # batched = one at a time
    tall = orthogonalize(g[0].T).float()  # a tall matrix is done through its transpose
    assert tall.shape == (40, 16) and torch.allclose(tall, out[0].T)
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(5))


def _step_both(ours, ref, params_ours, params_ref, grads, steps=4):
    """Same gradients into both optimizers, under the same falling learning-rate schedule."""
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (ours, ref)]
    for k in range(steps):
        for p, q, g in zip(params_ours, params_ref, grads, strict=True):
            p.grad = (g * (k + 1)).reshape(p.shape).clone()
            q.grad = (g * (k + 1)).reshape(q.shape).clone()
        ours.step()
        ref.step()
        for s in scheds:
            s.step()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon (the reference) needs torch >= 2.9")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the captured CUDA graph needs a GPU"))])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_muon_steps_match_torch_muon_for_matrices_and_flattened_conv_filters(cuda_graph, device):
    torch.manual_seed(0)
    shapes = [(8, 4, 3, 3), (8, 4, 3, 3), (8, 8, 3, 3), (10, 8), (16, 36)]  # two share a shape: batched together
    init = [torch.randn(s, device=device) * 0.1 for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    ref = [torch.nn.Parameter(w.reshape(w.shape[0], -1).clone()) for w in init]
    kw = dict(lr=0.02, momentum=0.9, weight_decay=0.1)
    opt = Muon(ours, cuda_graph=cuda_graph, **kw)
    _step_both(opt, torch.optim.Muon(ref, adjust_lr_fn="match_rms_adamw", **kw), ours, ref, grads)
    for p, q, w in zip(ours, ref, init, strict=True):
        assert not torch.allclose(p, w)  # it moved
        # on a GPU, bf16 products in a batched and a single GEMM kernel may round differently
        assert torch.allclose(p.reshape(q.shape), q, atol=1e-6 if device == "cpu" else 2e-3), "differs from torch's"
    assert (opt._graph is not None) == (cuda_graph and device == "cuda")  # steps 2-4 replayed the captured graph


def test_muon_runs_adamw_for_vectors_with_the_scheduled_lr():
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6))
    b_ref = torch.nn.Parameter(b.detach().clone())
    opt = Muon([{"params": [w]}, {"params": [b], "adamw": True, "weight_decay": 0.0}], lr=0.1, momentum=0.8)
    ref = torch.optim.AdamW([b_ref], lr=0.1, betas=(0.8, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        g = torch.randn(6)
        w.grad, b.grad, b_ref.grad = torch.randn(6, 6), g.clone(), g.clone()
        opt.step(), ref.step(), sched.step(), ref_sched.step()
    assert torch.allclose(b, b_ref)
    with pytest.raises(ValueError, match="adamw=True"):
        Muon([b])  # a vector has no orthogonal form: it must go to the AdamW part


def test_muon_option_trains_resnet_with_conv_filters_on_muon():
    from labkit import data as D
    from labkit.models import resnet18

    model = resnet18(width=8)
    cfg = T.with_changes(T.TrainConfig(), optimizer="muon", bn_weight_decay=False, weight_decay=0.05)
    opt = T._make_optimizer(cfg, model, lr=1e-3)
    muon_params = [p for g in opt.param_groups if not g["adamw"] for p in g["params"]]
    assert muon_params and all(p.ndim == 4 for p in muon_params)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    assert [g["weight_decay"] for g in opt.param_groups if g["adamw"]] == [0.05, 0.0]  # classifier, then BN/biases
    ds = D.synthetic_cifar(2048, 256, seed=0, cache=False)
    r = T.train(T.TrainConfig(width=8, epochs=3, batch_size=64, augment=False, workers=0, optimizer="muon", channels_last=True,
                              lr=1e-2, weight_decay=0.05), "cpu", dataset=ds)
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < 0.8 * r["losses"][0]
    assert r["accuracy"] > 0.4  # chance is 0.10; 96 steps of AdamW or SGD reach 0.5-0.7
    with pytest.raises(LabkitError, match="momentum"):
        T.check_config(T.with_changes(cfg, momentum=1.0), torch.device("cpu"))


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_checkpointed_muon_resumes_exactly_adamw_moments_included(cuda_graph):
    torch.manual_seed(0)
    init = [torch.randn(8, 4, 3, 3), torch.randn(8)]
    grads = [[torch.randn_like(w) for w in init] for _ in range(4)]

    def make():
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon([{"params": ps[:1]}, {"params": ps[1:], "adamw": True}], lr=0.01, momentum=0.9,
                   cuda_graph=cuda_graph)
        return ps, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

    def run(ps, opt, sched, steps):
        for gs in steps:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
            sched.step()

    ps, opt, sched = make()
    run(ps, opt, sched, grads)  # four steps straight through
    ps2, opt2, sched2 = make()
    run(ps2, opt2, sched2, grads[:2])
    saved, weights = (opt2.state_dict(), sched2.state_dict()), [p.detach().clone() for p in ps2]
    assert "adamw" in saved[0] and saved[0]["adamw"]["state"]  # AdamW's moments are in the checkpoint
    ps3, opt3, sched3 = make()
    with torch.no_grad():
        for p, w in zip(ps3, weights, strict=True):
            p.copy_(w)
    opt3.load_state_dict(saved[0])
    sched3.load_state_dict(saved[1])
    run(ps3, opt3, sched3, grads[2:])  # two more after a restart, the schedule moving on
    for a, b in zip(ps, ps3, strict=True):
        assert torch.equal(a, b)

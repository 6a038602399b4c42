"""Muon: momentum whose update is orthogonalized, for the convolution weights of a training run.

Muon (Jordan et al., 2024) takes SGD's momentum for a weight matrix and replaces it by the nearest
semi-orthogonal matrix (all singular values about 1), found by a few Newton-Schulz iterations in bf16. Every
direction of the update then moves at the same rate, which makes each step count for more: that is what a
large-batch run, short on optimizer steps, needs. A convolution's (out, in, kh, kw) filter is treated as the
(out, in*kh*kw) matrix it multiplies by.

`Muon` here follows `torch.optim.Muon` (torch >= 2.9) step for step: the same momentum, Newton-Schulz
coefficients and "match_rms_adamw" learning-rate scale, so one learning rate serves both Muon and the AdamW
that `Muon` runs for everything that is not a matrix (BatchNorm, biases, the classifier). Two differences,
both for speed and neither changing the arithmetic: weights of the same shape are orthogonalized together in
one batched product, and convolution filters are accepted.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, as in torch.optim.Muon


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately the nearest semi-orthogonal matrix to each matrix of `g` (shape (m, n) or (batch, m, n)).

    Returns bf16. Singular values come out between about 0.5 and 1.5, not exactly 1: the coefficients trade
    accuracy for speed, which training does not notice.
    """
    if g.ndim not in (2, 3):
        raise ValueError(f"orthogonalize takes a matrix or a batch of matrices, not shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    # scale each matrix to spectral norm <= 1 (Frobenius bounds it), where the iteration converges
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.baddbmm if x.ndim == 3 else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the groups whose params are matrices or conv filters; fused AdamW for groups with `adamw=True`.

    Each param group has lr, momentum (Muon's momentum and AdamW's beta1), weight_decay (decoupled: x lr) and
    adamw (bool). A learning-rate scheduler drives both kinds of group. For a matrix of shape (A, B) the step is
    lr x 0.2 x sqrt(max(A, B)), which gives the update about the RMS of an AdamW update.

    cuda_graph=True replays Muon's part of the step as one CUDA graph (captured at the second step) instead of
    launching its few hundred small kernels one by one; gradients are copied into fixed buffers and the
    learning rate lives in a device tensor, so the graph stays valid as the schedule moves. On CPU the same
    path runs without a graph.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, ns_steps: int = 5, beta2: float = 0.99, cuda_graph: bool = False):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"Muon needs lr > 0, momentum in [0, 1) and weight_decay >= 0, "
                             f"not {lr}, {momentum}, {weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, adamw=False))
        self.nesterov, self.ns_steps, self.cuda_graph = nesterov, ns_steps, cuda_graph
        adam_groups = [g for g in self.param_groups if g["adamw"]]
        for g in self.param_groups:
            if not g["adamw"]:
                bad = [tuple(p.shape) for p in g["params"] if p.ndim < 2]
                if bad:
                    raise ValueError(f"Muon orthogonalizes matrices and conv filters; put params of shape "
                                     f"{bad[0]} in a group with adamw=True")
        self._adam = None
        if adam_groups:
            on_gpu = adam_groups[0]["params"][0].is_cuda
            self._adam = torch.optim.AdamW(
                [dict(params=g["params"], lr=g["lr"], weight_decay=g["weight_decay"], betas=(g["momentum"], beta2))
                 for g in adam_groups], fused=True if on_gpu else None)
        self._plans = {}  # padded batches per list of params, see _buckets
        self._graph = None  # the captured Muon step
        self._static = None  # (gradient buffers per group, lr tensor per group, what the graph was captured with)

    def state_dict(self):
        """Muon's momentum buffers and, under "adamw", the AdamW part's moments: a checkpoint loses neither."""
        sd = super().state_dict()
        if self._adam is not None:
            sd["adamw"] = self._adam.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        adam = state_dict.pop("adamw", None)
        if (adam is None) != (self._adam is None):
            raise ValueError("this Muon state_dict comes from an optimizer with different AdamW groups")
        super().load_state_dict(state_dict)
        if adam is not None:
            self._adam.load_state_dict(adam)
        self._graph = self._static = None  # a captured graph would still read the replaced buffers

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [g for g in self.param_groups if not g["adamw"]]
        if self.cuda_graph and all(p.grad is not None for g in groups for p in g["params"]):
            self._fixed_buffer_step(groups)
        else:
            for g in groups:
                kept = [p for p in g["params"] if p.grad is not None]
                self._update(g, kept, [p.grad for p in kept], g["lr"])
        if self._adam is not None:  # the scheduler set our groups' lr; AdamW keeps its own groups, in the same order
            mine = [g for g in self.param_groups if g["adamw"]]  # looked up each step: load_state_dict swaps them
            for ours, theirs in zip(mine, self._adam.param_groups, strict=True):
                theirs["lr"], theirs["weight_decay"] = ours["lr"], ours["weight_decay"]
                theirs["betas"] = (ours["momentum"], theirs["betas"][1])
            self._adam.step()
        return loss

    def _fixed_buffer_step(self, groups):
        consts = [(g["momentum"], g["weight_decay"]) for g in groups]
        if self._static is None or self._static[2] != consts:  # first step, or constants the graph baked in moved
            self._static = ([[p.grad.detach().clone() for p in g["params"]] for g in groups],
                            [torch.zeros((), device=g["params"][0].device) for g in groups], consts)
            self._graph = None
            fresh = True
        else:
            fresh = False
        grads, lrs, _ = self._static
        for buf, lr, g in zip(grads, lrs, groups, strict=True):
            if not fresh:
                torch._foreach_copy_(buf, [p.grad for p in g["params"]])
            lr.fill_(g["lr"])

        def run():
            for g, buf, lr in zip(groups, grads, lrs, strict=True):
                self._update(g, g["params"], buf, lr)

        on_gpu = groups[0]["params"][0].is_cuda
        if self._graph is not None:
            self._graph.replay()
        elif on_gpu and not fresh:  # the eager first step has made the buffers and warmed up cuBLAS
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                run()
            self._graph.replay()  # capturing records the kernels without running them
        else:
            run()

    def _buffer(self, p):
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p)
        return st["momentum_buffer"]

    def _update(self, group, params, grads, lr):
        """One Muon step for `params` with `grads`; lr is a float or a 0-dim tensor on their device."""
        mu, wd = group["momentum"], group["weight_decay"]
        bufs = [self._buffer(p) for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        upd = torch._foreach_lerp(grads, bufs, mu) if self.nesterov else bufs
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        for x, scales, items in self._buckets(params):
            for j, (i, rows, cols) in enumerate(items):
                _slot(x, j, rows, cols).unflatten(1, params[i].shape[1:]).copy_(upd[i])
            out = orthogonalize(x, self.ns_steps).float().mul_(scales * -lr)
            for j, (i, rows, cols) in enumerate(items):
                params[i].add_(_slot(out, j, rows, cols).unflatten(1, params[i].shape[1:]))

    def _buckets(self, params):
        """Matrices padded with zeros into a few batches, by their shorter side rounded up to a power of two.

        Zero rows and columns stay zero through Newton-Schulz and leave the norm alone, so padding changes no
        result; it turns ResNet-18's eleven filter shapes into four batched products, and the step's time is
        mostly kernel count. A matrix taller than wide sits transposed in its slot, as orthogonalize would do.
        """
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            by_side: dict[int, list[tuple[int, int, int]]] = {}
            for i, p in enumerate(params):
                rows, cols = p.shape[0], p[0].numel()
                side = max(64, 1 << (min(rows, cols) - 1).bit_length())
                by_side.setdefault(side, []).append((i, rows, cols))
            plans = []
            for side, items in sorted(by_side.items()):
                long = max(max(r, c) for _, r, c in items)
                x = torch.zeros(len(items), side, long, dtype=torch.bfloat16, device=params[0].device)
                scales = torch.tensor([0.2 * math.sqrt(max(r, c)) for _, r, c in items], device=x.device)
                plans.append((x, scales.view(-1, 1, 1), items))
            self._plans[key] = plans
        return self._plans[key]


def _slot(x: torch.Tensor, j: int, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) matrix held in batch entry j of a padded batch (stored transposed when taller than wide)."""
    return x[j, :rows, :cols] if rows <= cols else x[j, :cols, :rows].mT

"""Lab 1 probes: drive the student's loss scalers and training step on inputs the trusted side sends.

Each scenario takes the scaler class (or step function) as an argument, so the trusted side runs the very same
scenario with its reference and compares what came out; a probe only reports observations. The problem is a
small regression whose targets are in tiny units (about 1e-3): under fp16 autocast most weight gradients
underflow to zero without loss scaling (training stalls) and match fp32 with it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autograder.student.probes import call, gemm_dtypes, host_sync_sites, require

LOSS_UNIT = 1e6  # losses are reported in (1e-3 units)^2, so they read as ~1 instead of ~1e-6


class Net(nn.Module):
    """Two-layer MLP whose output is in small units: the fp16 gradients underflow without loss scaling."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.f(x) * 1e-3


def problem(device, seed: int = 0, n: int = 1024, d: int = 32):
    """Inputs (n, d) and tiny targets (n, 1) on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return x.to(device), (torch.tanh(x @ w / 4) * 1e-3).to(device)


def _param(device, n=8, lr=0.1):
    p = nn.Parameter(torch.zeros(n, device=device))
    return p, torch.optim.SGD([p], lr=lr)


def _scaled_step(scaler, p, opt, c, explicit_unscale=False):
    """One step of loss (p*c).sum(): the gradient is c (times the scale); returns what step() returned."""
    opt.zero_grad(set_to_none=True)
    call("scaler.scale(loss).backward()", lambda: scaler.scale((p * c).sum()).backward())
    if explicit_unscale:
        call("scaler.unscale_(optimizer)", scaler.unscale_, opt)
    stepped = call("scaler.step(optimizer)", scaler.step, opt)
    call("scaler.update()", scaler.update)
    return stepped


def _flag(v) -> bool | None:
    """What step() returned, as True/False, or None when it is neither."""
    if v is True or v is False:
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return bool(v)
    return None


def static_scenario(cls, device, params: dict) -> dict:
    """StaticScaler(scale) on a known loss and gradient: scale, unscale_, a finite step, an inf step, a finite step."""
    scale, loss_value, lr = float(params["scale"]), float(params["loss"]), float(params["lr"])
    c = params["grad"].to(device)
    sc = call(f"StaticScaler(scale={scale:g})", cls, scale=scale)
    scaled = call("StaticScaler.scale", sc.scale, torch.tensor(loss_value, device=device))
    require(isinstance(scaled, torch.Tensor), f"scale(loss) must return a tensor, got {type(scaled).__name__}")
    p, opt = _param(device, c.numel(), lr)
    opt.zero_grad()
    call("scaler.scale(loss).backward()", lambda: sc.scale((p * c).sum()).backward())
    call("scaler.unscale_(optimizer)", sc.unscale_, opt)
    grad = p.grad.detach().clone() if p.grad is not None else torch.full_like(c, float("nan"))
    first = _flag(call("scaler.step(optimizer)", sc.step, opt))
    call("scaler.update()", sc.update)
    after_first = p.detach().clone()
    bad = c.clone()
    bad[int(params["bad_index"])] = float("inf")
    skipped = _flag(_scaled_step(sc, p, opt, bad))
    after_bad = p.detach().clone()
    scale_now = float(call("get_scale()", sc.get_scale))
    last = _flag(_scaled_step(sc, p, opt, c))
    return {"scaled": float(scaled.detach().float().reshape(-1)[0]), "grad": grad, "first": first,
            "after_first": after_first, "bad": skipped, "after_bad": after_bad, "scale": scale_now, "last": last,
            "after_last": p.detach().clone()}


def trajectory(cls, device, params: dict) -> dict:
    """DynamicScaler(**kw) over `steps` steps with inf (or NaN) gradients at `bad`: (stepped, scale) per step."""
    kw, steps, bad = params["kw"], int(params["steps"]), set(params["bad"])
    scaler = call("DynamicScaler(...)", cls, **kw)
    p, opt = _param(device)
    c = torch.linspace(-1, 1, 8, device=device)
    out = []
    for s in range(steps):
        cc = c.clone()
        if s in bad:
            cc[1] = float("nan") if params.get("nan") else float("inf")
        stepped = _scaled_step(scaler, p, opt, cc, bool(params.get("explicit_unscale")))
        out.append([_flag(stepped), float(call("get_scale()", scaler.get_scale))])
    return {"steps": out, "param": p.detach().clone()}


def train(step_fn, scaler, device, steps: int, seed: int = 0, batch: int = 64):
    """Train Net with `step_fn` and `scaler`; returns losses (LOSS_UNIT), optimizer steps, samples, and the state."""
    torch.manual_seed(seed)
    x, y = problem(device, seed)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts = {"opt_steps": 0, "samples": 0}
    opt.register_step_post_hook(lambda *a: counts.__setitem__("opt_steps", counts["opt_steps"] + 1))
    model.register_forward_pre_hook(lambda m, a: counts.__setitem__("samples", counts["samples"] + a[0].shape[0]))
    losses = []
    for s in range(steps):
        i = torch.arange(s * batch, (s + 1) * batch, device=device) % x.shape[0]
        loss = step_fn(model, opt, scaler, x[i], y[i])
        require(isinstance(loss, torch.Tensor) and loss.numel() == 1,
                f"fp16_train_step must return the loss as a one-element tensor, got {type(loss).__name__}")
        losses.append(loss.detach().float().reshape(()))
    return torch.stack(losses) * LOSS_UNIT, counts, (model, opt, x, y)


def torch_amp_step(model, optimizer, scaler, x, y):
    """PyTorch's documented AMP recipe with the scaler handed in: fp16 autocast forward, fp32 loss, scaled
    backward, scaler step and update (the reference step of lab 1's training checks, public and trusted)."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def ref_style_step(step):
    return lambda *a: call("fp16_train_step", step, *a)


def probe_default_scale(p, params: dict) -> dict:
    d = call("DynamicScaler()", p.attr("DynamicScaler"))
    return {"scale": float(call("get_scale()", d.get_scale))}


def probe_static(p, params: dict) -> dict:
    return static_scenario(p.attr("StaticScaler"), p.device, params)


def probe_trajectory(p, params: dict) -> dict:
    return trajectory(p.attr("DynamicScaler"), p.device, params)


def probe_fp16_training(p, params: dict) -> dict:
    """Train with the student's step and DynamicScaler; then the dtypes of one more step's matrix multiplies."""
    step, cls = p.attr("fp16_train_step"), p.attr("DynamicScaler")
    scaler = call("DynamicScaler(init_scale=...)", cls, init_scale=float(params["init_scale"]))
    losses, counts, (model, opt, x, y) = train(ref_style_step(step), scaler, p.device, int(params["steps"]),
                                                seed=int(params.get("seed", 0)))
    out = {"losses": losses, **counts}
    if params.get("dtypes"):
        i = torch.arange(64, device=p.device)
        out["gemm_dtypes"] = gemm_dtypes(lambda: call("fp16_train_step", step, model, opt, scaler, x[i], y[i]))
    return out


def probe_host_syncs(p, params: dict) -> dict:
    """Sync sites of each of `steps` steps after a warm-up (SGD: Adam's own counters sync on their own)."""
    step, cls = p.attr("fp16_train_step"), p.attr("DynamicScaler")
    torch.manual_seed(int(params.get("seed", 0)))
    x, y = problem(p.device, int(params.get("seed", 0)))
    model = Net().to(p.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = call("DynamicScaler()", cls)
    xb, yb = x[:64].contiguous(), y[:64].contiguous()
    for _ in range(5):  # warm-up: the first overflows back the scale off, momentum buffers appear
        call("fp16_train_step", step, model, opt, scaler, xb, yb)
    return {"sites": [host_sync_sites(lambda: call("fp16_train_step", step, model, opt, scaler, xb, yb), p.device)
                      for _ in range(int(params["steps"]))]}

"""Lab 4 probes: drive the student's ResNet-18 training step on batches the trusted side names, report what happened.

The student's file defines `build_train_step(model, *, lr, momentum, weight_decay, device)` returning
`step(x_uint8, y) -> loss`. The naive step below is the baseline and the reference; it is public (students
start from it). Each scenario takes a builder (model, hyper-parameters) -> step as an argument, so the trusted
side runs the very same scenario with the naive step and compares; a probe only reports observations: losses
and the flattened parameters after each step. Hyper-parameters and seeds arrive as request params.

Timed rounds (`timed_steps`) draw fresh batches on the device from the round's seed, keep device copies of the
parameters before the round and after every step (fetched afterwards, untimed, by `probe_snapshots`, for the
rounds the trusted side picks to check) and commit to the last one with a random projection drawn from the same
seed, so the trusted side can check a round's steps against the naive step's gradient at the very weights each
step started from, that nothing moved the weights after the clock stopped, and that rounds chain.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from autograder.student.probes import call, host_sync_sites, require, synchronize

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}


def sizes(small: bool) -> dict:
    """Problem size: the full model on a GPU, a narrow one on a CPU (`small`) so checks take seconds."""
    if small:
        return {"width": 8, "batch": 16, "k": 3}
    return {"width": 64, "batch": 512, "k": 5}


@contextlib.contextmanager
def naive_switches():
    """The naive step's settings (PyTorch defaults): cuDNN TF32 convolutions on, TF32 matmuls off, no autotune.

    Set for the naive step's calls only and restored after, so whatever else runs in the process keeps its own.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             torch.get_float32_matmul_precision())
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False
        yield
    finally:
        torch.set_float32_matmul_precision(saved[3])
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) = \
            saved[:3]


class NaiveStep:
    """The naive training step: fp32, NCHW, torch.optim.SGD with its defaults, and loss.item() every step.

    `amp=torch.bfloat16` gives the mixed-precision twin the correctness check uses to measure how far AMP
    rounding alone moves the losses on this machine.
    """

    def __init__(self, model, *, lr, momentum, weight_decay, device, amp: torch.dtype | None = None):
        self.model, self.amp, self.device_type = model, amp, torch.device(device).type
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def __call__(self, x_u8, y) -> float:
        with naive_switches():
            x = (x_u8.float() / 255 - self.mean) / self.std
            with torch.autocast(self.device_type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            return loss.item()


def make_batches(n: int, batch: int, device, seed: int = 0):
    """n batches of (uint8 images (B, 3, 32, 32), int64 labels (B,)) on `device`, learnable but synthetic."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        y = torch.randint(0, 10, (batch,), generator=g)
        base = (y.float()[:, None, None, None] * 23 + torch.arange(3).float()[None, :, None, None] * 40) % 200
        x = (base + 30 * torch.randn(batch, 3, 32, 32, generator=g)).clamp(0, 255).to(torch.uint8)
        out.append((x.to(device), y.to(device)))
    return out


def round_draws(n: int, batch: int, n_params: int, device, seed: int):
    """A timed round's n batches (uint8 noise images, labels) and its random projection (float64, n_params).

    Drawn on `device` from `seed`, in this order, with two kernels a batch: cheap enough to sit inside the timed
    request, so the inputs are unknown to the student's process until its clock runs. (The step's speed does not
    depend on the pixel values; the trusted side draws the same tensors to check the round.)
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    batches = [(torch.randint(0, 256, (batch, 3, 32, 32), generator=gen, device=device, dtype=torch.uint8),
                torch.randint(0, 10, (batch,), generator=gen, device=device)) for _ in range(n)]
    return batches, torch.randn(n_params, generator=gen, device=device, dtype=torch.float64)


def fresh_model(width: int, device, seed: int = 0):
    from labkit.models import resnet18

    torch.manual_seed(seed)
    return resnet18(width=width).to(device).train()


def param_keys(model) -> list[str]:
    """The state_dict keys of the trained tensors (BatchNorm running statistics are not trained)."""
    return [k for k, v in model.state_dict().items() if v.is_floating_point() and "running" not in k]


def flat(model, keys) -> torch.Tensor:
    """The tensors named `keys`, flattened (logical order) and concatenated, float32 on the CPU."""
    sd = model.state_dict()
    return torch.cat([sd[k].detach().float().flatten() for k in keys]).cpu()


def naive_builder(amp: torch.dtype | None = None):
    """A builder (model, device, hyper) -> step for the naive step (or its AMP twin)."""
    return lambda model, device, hyper: NaiveStep(model, device=device, amp=amp, **hyper)


def student_builder(build_train_step):
    """A builder (model, device, hyper) -> step for the submission's build_train_step, failures reported."""
    def build(model, device, hyper):
        step = call("build_train_step(model, ...)", build_train_step, model, device=device, **hyper)
        require(callable(step), f"build_train_step must return a callable step(x, y), got {type(step).__name__}")
        return lambda x, y: call("step(x, y)", step, x, y)
    return build


def as_loss(loss) -> torch.Tensor:
    """The loss a step returned as a 0-d float32 tensor (not synchronized)."""
    require(isinstance(loss, (torch.Tensor, float, int)) and not isinstance(loss, bool),
            f"step(x, y) must return the loss, got {type(loss).__name__}")
    if isinstance(loss, torch.Tensor):
        require(loss.numel() >= 1, "step(x, y) returned an empty tensor instead of the loss")
        return loss.detach().float().reshape(-1)[0]
    return torch.tensor(float(loss))


def trajectory(build, device, params: dict, keep: dict | None = None) -> dict:
    """K steps from the fresh weights of `seed`: the loss of each and the parameters before and after each.

    Returns {"losses": float64 (k,), "params": float32 (k+1, n_params)}; row 0 is taken after the builder ran.
    `keep` receives the step, model and keys so later probes keep training the same (compiled) step.
    """
    width, batch, k, seed = int(params["width"]), int(params["batch"]), int(params["k"]), int(params["seed"])
    model = fresh_model(width, device, seed)
    keys = param_keys(model)
    step = build(model, device, dict(params["hyper"]))
    rows, losses = [flat(model, keys)], []
    for x, y in make_batches(k, batch, device, seed):
        losses.append(float(as_loss(step(x, y))))  # read at once: a CUDA-graph output is overwritten by the next
        rows.append(flat(model, keys))
    if keep is not None:
        keep.update(step=step, model=model, keys=keys)
    return {"losses": torch.tensor(losses, dtype=torch.float64), "params": torch.stack(rows)}


def dense_layout(shape, stride) -> bool:
    """Whether (shape, stride) lays a tensor out densely with no overlap (contiguous, channels_last, ...)."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


class _Rows:
    """n device buffers of all parameters, each parameter laid out as the model lays it out (one copy kernel).

    A timed round of n steps uses n + 2: row 0 holds the weights before the step that preceded the round (so the
    round's first update can be checked for momentum on its own), row 1 the weights before the round's first
    step, row j + 2 the weights after step j. The commitment's random vector is drawn in logical order and laid
    out like the rows (`proj`), so a commitment means the same whatever layout the parameters have.
    """

    def __init__(self, params, n: int, device):
        self.sizes = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.strides = [list(p.stride()) if dense_layout(p.shape, p.stride()) else
                        list(torch.empty(p.shape).stride()) for p in params]
        self.flat = torch.empty(n, sum(self.sizes), device=device)
        self.views = [self._lay(self.flat[j]) for j in range(n)]
        self.proj = torch.empty(sum(self.sizes), device=device, dtype=torch.float64)
        self.proj_views = self._lay(self.proj)
        self.key = self.signature(params, n)

    def _lay(self, buf) -> list:
        out, off = [], 0
        for shape, size, st in zip(self.shapes, self.sizes, self.strides, strict=True):
            out.append(buf[off:off + size].as_strided(shape, st))
            off += size
        return out

    def commit(self, j: int, r) -> torch.Tensor:
        """Row j's dot product with the logical-order vector r (float64, 0-d, on the device)."""
        _copy_all(self.proj_views, [c.view(s) for c, s in zip(r.split(self.sizes), self.shapes, strict=True)])
        return torch.dot(self.flat[j].double(), self.proj)

    @staticmethod
    def signature(params, n: int):
        return n, tuple((tuple(p.shape), tuple(p.stride()), p.device) for p in params)


def _copy_all(dst: list, src: list) -> None:
    with torch.no_grad():
        try:
            torch._foreach_copy_(dst, src)
        except (AttributeError, RuntimeError):  # older torch, or a list the fused copy does not take
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)


def timed_steps(step, model, device, params: dict, state: dict) -> dict:
    """`n` steps on fresh batches drawn from `seed`; the losses and a commitment to the parameters at the end.

    The parameters are copied to n + 2 device buffers (see _Rows; fetched later by `probe_snapshots`, outside the
    clock): row 0 takes the previous round's weights before its last step (on the first round, the current
    weights: the trusted side takes that update from the correctness trajectory), row 1 the current weights, row
    j + 2 the weights after step j. The commitment is the last row's dot product (logical order) with a random
    vector from the same seed (float64). The device is synchronized before returning, so the request's wall time covers the work.
    """
    n, batch, seed = int(params["n"]), int(params["batch"]), int(params["seed"])
    named = list(model.named_parameters())
    require([k for k, _ in named] == state["keys"], "the model's parameters changed names or number during training")
    src = [p for _, p in named]
    rows = old = state.get("rows")
    if rows is None or rows.key != _Rows.signature(src, n + 2):  # first round, or the layout changed
        rows = state["rows"] = _Rows(src, n + 2, device)
        same = old is not None and len(old.views) == n + 2 and old.shapes == rows.shapes
        _copy_all(rows.views[0], old.views[n] if same else src)
    else:
        with torch.no_grad():
            rows.flat[0].copy_(rows.flat[n])
    _copy_all(rows.views[1], src)
    batches, r = round_draws(n, batch, rows.flat.shape[1], device, seed)
    out = torch.empty(n + 1, device=device, dtype=torch.float64)  # the losses, then the commitment
    for j, (x, y) in enumerate(batches):
        out[j] = as_loss(step(x, y))  # copied at once: a CUDA-graph output is overwritten by the next replay
        _copy_all(rows.views[j + 2], src)
    out[n] = rows.commit(n + 1, r)
    out = out.cpu()  # one transfer, which waits for the work
    synchronize(device)
    return {"losses": out[:n], "commit": float(out[n])}


def probe_trajectory(p, params: dict) -> dict:
    """The student's step over K batches; with `keep`, the built step stays in this process for later probes."""
    keep = {} if params.get("keep") else None
    out = trajectory(student_builder(p.attr("build_train_step")), p.device, params, keep)
    if keep is not None:
        p.state["lab4"] = keep
    return out


def _kept(p) -> dict:
    require("lab4" in p.state, "no training step was built in this process yet")
    return p.state["lab4"]


def probe_host_syncs(p, params: dict) -> dict:
    """Sync sites of `n` steps of the kept step on one batch, after `warmup` steps (compilation may sync)."""
    kept = _kept(p)
    (x, y), = make_batches(1, int(params["batch"]), p.device, int(params.get("seed", 0)))
    for _ in range(int(params["warmup"])):
        kept["step"](x, y)
    synchronize(p.device)
    n = int(params["n"])
    return {"sites": host_sync_sites(lambda: [kept["step"](x, y) for _ in range(n)], p.device)}


def probe_timed_student(p, params: dict) -> dict:
    """One timed round of the kept student step (see timed_steps)."""
    kept = _kept(p)
    return timed_steps(kept["step"], kept["model"], p.device, params, kept)


def probe_snapshots(p, params: dict) -> dict:
    """The last timed round's parameter rows (see _Rows): raw (n + 2, n_params) float32 and each tensor's strides."""
    kept = _kept(p)
    rows = kept.get("rows")
    require(rows is not None, "no timed round ran in this process yet")
    return {"rows": rows.flat.cpu(), "strides": rows.strides}


def probe_naive_setup(p, params: dict) -> dict:
    """The baseline: the naive step on fresh weights (never touches the student's code)."""
    model = fresh_model(int(params["width"]), p.device, int(params.get("seed", 0)))
    step = NaiveStep(model, device=p.device, **dict(params["hyper"]))
    p.state["lab4_naive"] = {"step": step, "model": model, "keys": param_keys(model)}
    return {"n_params": sum(q.numel() for q in model.parameters())}


def probe_timed_naive(p, params: dict) -> dict:
    """One timed round of the naive step, the same work around it as the student's (see timed_steps)."""
    kept = p.state["lab4_naive"]
    return timed_steps(kept["step"], kept["model"], p.device, params, kept)


def probe_kernels(p, params: dict) -> dict:
    """GPU kernels of two steps of the kept step, from the profiler: [name, self device time (us)] per kernel."""
    kept = _kept(p)
    (x, y), = make_batches(1, int(params["batch"]), p.device, int(params.get("seed", 0)))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kept["step"](x, y)
        kept["step"](x, y)
        synchronize(p.device)
    out = []
    for e in prof.key_averages():
        if "CUDA" not in str(getattr(e, "device_type", "")):
            continue  # CPU-side ops also carry their kernels' time: count each kernel once
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
        out.append([str(e.key)[:200], float(t)])
    return {"kernels": out}

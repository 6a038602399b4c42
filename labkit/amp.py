"""Mixed precision, built by hand: precision presets, the AMP training step, memory per parameter, checkpointing.

`AmpTrainer` runs one training step for any `PRECISIONS` preset (fp32, tf32, fp16 + scaler, bf16, pure
`.half()`, fp16 with fp32 master weights) with gradient accumulation and clipping; `precision_race` trains the
week's model (`ResidualMLP`) under several presets side by side. The loss scalers it uses live in
`labkit.loss_scaling` (re-exported here: `amp.DynamicLossScaler` and friends). Memory: `predicted_bytes_per_param`
and `measured_bytes_per_param` (params, grads, optimizer state, master weights), `SavedTensorMeter` (activation
bytes kept for backward, any device), `cuda_peak_bytes`. `checkpoint_blocks` wraps residual blocks in activation
checkpointing. Nothing here changes global state at import time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from labkit.env import LabkitError, pick_device, quick_mode, torch_switches
from labkit.loss_scaling import (  # noqa: F401  (re-exported: the week's API is labkit.amp)
    DynamicLossScaler,
    Fp32MasterWeights,
    ScalerTrace,
    ScalerUsageError,
    StaticLossScaler,
    clip_grad_norm_,
    compare_scalers,
    crafted_sequences,
    drive_scaler,
)

# --------------------------------------------------------------------------------------- precision presets


@dataclass(frozen=True)
class Precision:
    """How one training step handles number formats."""

    name: str  # preset name
    param_dtype: torch.dtype = torch.float32  # dtype the model's parameters are stored in
    autocast_dtype: torch.dtype | None = None  # dtype autocast runs matmuls/convs in; None = no autocast
    loss_scaling: bool = False  # use a dynamic loss scaler
    master_weights: bool = False  # keep fp32 master copies of low-precision parameters for the optimizer
    tf32: bool | None = None  # TF32 switches on CUDA during the step (None = leave as they are)
    note: str = ""  # one line for tables


PRECISIONS: dict[str, Precision] = {p.name: p for p in [
    Precision("fp32", tf32=False, note="strict fp32 (TF32 off, also for cuDNN convolutions)"),
    Precision("tf32", tf32=True, note="fp32 storage, TF32 tensor-core matmuls/convs (CUDA only)"),
    Precision("fp16", autocast_dtype=torch.float16, loss_scaling=True, note="autocast fp16 + dynamic loss scaling"),
    Precision("fp16_noscale", autocast_dtype=torch.float16, note="autocast fp16 without loss scaling"),
    Precision("bf16", autocast_dtype=torch.bfloat16, note="autocast bf16 (fp32 range: no scaling needed)"),
    Precision("half", param_dtype=torch.float16, note="pure model.half(): fp16 weights, grads and Adam state"),
    Precision("fp16_master", param_dtype=torch.float16, loss_scaling=True, master_weights=True,
              note="fp16 model + fp32 master weights + loss scaling (pre-autocast recipe)"),
]}


def get_precision(name: str | Precision) -> Precision:
    """A `PRECISIONS` preset by name, with a clear error listing the names."""
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise LabkitError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


# ------------------------------------------------------------------------------------------- week's model


@dataclass(frozen=True)
class MLPConfig:
    """The week's model: a pre-norm residual MLP classifier on vectors."""

    in_features: int = 32  # input vector length
    dim: int = 64  # residual stream width
    depth: int = 3  # residual blocks
    expansion: int = 4  # hidden width = expansion * dim inside a block
    classes: int = 10  # output classes


MLP_PRESETS = {
    "tiny": MLPConfig(),  # CPU demos and tests: 0.1M params
    "small": MLPConfig(in_features=64, dim=256, depth=4),  # GPU demos: 2.1M params
    "h100": MLPConfig(in_features=1024, dim=1024, depth=8),  # GPU benchmark: 68M params, matmul-bound
}


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): LayerNorm keeps each sample independent, so accumulation is exact."""

    def __init__(self, dim: int, expansion: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, expansion * dim)
        self.fc2 = nn.Linear(expansion * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, cfg: MLPConfig = MLPConfig()):
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_features, cfg.dim)
        self.blocks = nn.Sequential(*[Block(cfg.dim, cfg.expansion) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.classes)

    def forward(self, x):
        return self.out(self.norm(self.blocks(self.inp(x))))


def build_mlp(cfg: MLPConfig | str = "tiny", *, seed: int = 0, device=None) -> ResidualMLP:
    """The week's model with weights from `seed` (same seed, same weights, whatever the device)."""
    if isinstance(cfg, str):
        if cfg not in MLP_PRESETS:
            raise LabkitError(f"unknown MLP preset {cfg!r}: choose one of {', '.join(MLP_PRESETS)}")
        cfg = MLP_PRESETS[cfg]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResidualMLP(cfg)
    return model.to(pick_device(device))


def teacher_batch(step: int, batch: int, cfg: MLPConfig = MLPConfig(), *, seed: int = 0, device=None):
    """A learnable synthetic batch: x ~ N(0, 1), label = argmax of a fixed random linear teacher (fixed by seed)."""
    teacher = torch.randn(cfg.in_features, cfg.classes, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(batch, cfg.in_features, generator=torch.Generator().manual_seed(seed * 1_000_003 + step + 1))
    y = (x @ teacher).argmax(1)
    dev = pick_device(device)
    return x.to(dev), y.to(dev)


# -------------------------------------------------------------------------------------------- train step


def autocast_context(precision: Precision | str, device):
    """torch.autocast for the preset on `device`, or a no-op context when the preset does not autocast."""
    p = get_precision(precision)
    dev = pick_device(device)
    if p.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(dev.type, dtype=p.autocast_dtype)


def make_scaler(kind: str, device, precision: Precision | str = "fp16"):
    """A dynamic loss scaler: kind 'torch' (torch.amp.GradScaler) or 'labkit' (DynamicLossScaler)."""
    p = get_precision(precision)
    if kind == "torch":
        return torch.amp.GradScaler(pick_device(device).type, enabled=p.loss_scaling)
    if kind == "labkit":
        return DynamicLossScaler(enabled=p.loss_scaling)
    raise LabkitError(f"unknown scaler kind {kind!r}: use 'torch' or 'labkit'")


class AmpTrainer:
    """One optimizer step for a `Precision` preset, with optional gradient accumulation and clipping.

    Converts `model` in place to the preset's parameter dtype and moves it to `device`. `step(x, y)` returns the
    mean loss of the batch (a detached fp32 tensor: no host sync). With `micro_batches=k` the batch is split
    into k slices whose losses are weighted by slice size, so the gradient equals the full batch's.
    """

    def __init__(self, model: nn.Module, precision: Precision | str = "fp32", *, device=None, optimizer: str = "adam",
                 lr: float = 1e-3, scaler: str = "torch", micro_batches: int = 1, max_grad_norm: float | None = None,
                 loss_fn: Callable = F.cross_entropy, loss_weight: float = 1.0):
        self.precision = p = get_precision(precision)
        self.device = pick_device(device)
        if micro_batches < 1:
            raise LabkitError(f"micro_batches must be >= 1, got {micro_batches}")
        self.model = model.to(device=self.device, dtype=p.param_dtype)
        self.master = Fp32MasterWeights(self.model) if p.master_weights else None
        params = self.master.master_params if self.master else [q for q in self.model.parameters() if q.requires_grad]
        if optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=lr)
        elif optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        else:
            raise LabkitError(f"unknown optimizer {optimizer!r}: use 'adam' or 'sgd'")
        self.scaler = make_scaler(scaler, self.device, p) if p.loss_scaling else None
        self.micro_batches, self.max_grad_norm = micro_batches, max_grad_norm
        self.loss_fn, self.loss_weight = loss_fn, loss_weight

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Accumulate the (scaled) gradients of the batch mean loss over `micro_batches` slices."""
        p, n = self.precision, x.shape[0]
        if self.micro_batches > n:
            raise LabkitError(f"micro_batches={self.micro_batches} is more than the batch size {n}")
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if p.autocast_dtype is None and x.is_floating_point():
            x = x.to(p.param_dtype)
        total = torch.zeros((), device=self.device)
        for xs, ys in zip(torch.tensor_split(x, self.micro_batches), torch.tensor_split(y, self.micro_batches),
                          strict=True):
            with autocast_context(p, self.device):
                out = self.model(xs)
            # Loss in fp32 even for pure-half models, as autocast does for cross-entropy.
            loss = self.loss_fn(out.float(), ys) * (xs.shape[0] / n)
            scaled = loss * self.loss_weight
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total += loss.detach()
        return total

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """zero_grad, forward/backward (accumulated), unscale + clip if asked, optimizer step, scaler update."""
        with torch_switches(tf32=self.precision.tf32) if self.device.type == "cuda" else contextlib.nullcontext():
            self.model.zero_grad(set_to_none=True)
            loss = self.forward_backward(x, y)
            if self.master is not None:
                self.master.grads_to_master()
            if self.max_grad_norm is not None:
                clip_grad_norm_(self.optimizer, self.max_grad_norm, self.scaler)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.master is not None:
                self.master.master_to_model()
        return loss


# ----------------------------------------------------------------------------------------- precision race


@dataclass
class RaceResult:
    """Loss curves of the same model, data and seed trained under several precision presets."""

    losses: dict[str, list[float]]  # preset -> loss per step (unweighted, nan once diverged)
    zero_grad_fraction: dict[str, float]  # preset -> share of parameter-gradient elements exactly 0 at the end
    loss_weight: float = 1.0  # factor the loss was multiplied by before backward
    scales: dict[str, list[float]] = field(default_factory=dict)  # preset -> loss scale per step, where scaled

    def first_nonfinite(self, name: str) -> int | None:
        """First step whose loss is inf/NaN, or None if the run stayed finite."""
        return next((i for i, v in enumerate(self.losses[name]) if not math.isfinite(v)), None)

    def final(self, name: str, last: int = 5) -> float:
        """Mean loss over the last `last` steps (nan if any of them is not finite)."""
        tail = self.losses[name][-last:]
        return sum(tail) / len(tail)

    def table(self) -> str:
        rows = [f"{'precision':<13} {'first loss':>10} {'final loss':>10} {'diverged at':>11} {'zero grads':>10}"]
        for name, ls in self.losses.items():
            nf = self.first_nonfinite(name)
            rows.append(f"{name:<13} {ls[0]:>10.4f} {self.final(name):>10.4f} {'-' if nf is None else nf:>11} "
                        f"{self.zero_grad_fraction[name]:>10.1%}")
        return "\n".join(rows)

    def plot(self, ax=None, title: str | None = None):
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(6, 3.5))[1]
        for name, ls in self.losses.items():
            ax.plot(ls, label=name + (" (NaN)" if self.first_nonfinite(name) is not None else ""))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(title or f"same model, same data, loss weight {self.loss_weight:g}")
        ax.legend()
        return ax


def precision_race(precisions: Sequence[str] = ("fp32", "half", "fp16_master", "fp16_noscale", "fp16", "bf16"),
                   *,
                   steps: int | None = None, batch: int | None = None, cfg: MLPConfig | str | None = None,
                   lr: float = 1e-3, loss_weight: float = 1.0, scaler: str = "torch", seed: int = 0,
                   device=None, progress: bool = True) -> RaceResult:
    """Train the week's model under each preset from the same weights on the same batches (Adam, `lr`).

    `loss_weight` < 1 mimics a loss whose gradients are tiny (a down-weighted auxiliary loss, a mean over
    millions of elements): Adam does not care about the gradient's size, but fp16 does.
    """
    from tqdm.auto import tqdm

    dev = pick_device(device)
    quick = quick_mode()
    steps = (40 if quick else 200) if steps is None else steps
    batch = (64 if quick else 256) if batch is None else batch
    cfg = cfg or ("tiny" if quick else "small")
    cfg = MLP_PRESETS[cfg] if isinstance(cfg, str) else cfg
    if steps < 1 or batch < 1:
        raise LabkitError("precision_race needs steps >= 1 and batch >= 1")
    data = [teacher_batch(i, batch, cfg, seed=seed, device=dev) for i in range(steps)]
    res = RaceResult({}, {}, loss_weight)
    for name in precisions:
        trainer = AmpTrainer(build_mlp(cfg, seed=seed), name, device=dev, lr=lr, scaler=scaler,
                             loss_weight=loss_weight)
        losses, scales = [], []
        # disable only when asked, so that TQDM_DISABLE=1 in the environment still works otherwise
        for x, y in tqdm(data, desc=f"race {name}", leave=False, **({} if progress else {"disable": True})):
            losses.append(float(trainer.step(x, y)))
            if trainer.scaler is not None:
                scales.append(trainer.scaler.get_scale())
        grads = [q.grad for q in trainer.model.parameters() if q.grad is not None]
        n = sum(g.numel() for g in grads)
        res.losses[name] = losses
        res.zero_grad_fraction[name] = sum(int((g == 0).sum()) for g in grads) / n if n else float("nan")
        if scales:
            res.scales[name] = scales
    return res


def underflow_fraction(grads: Iterable[torch.Tensor], scale: float = 1.0, dtype=torch.float16) -> dict:
    """Of the nonzero gradient elements, the share that `dtype` flushes to 0 / turns to inf after `* scale`."""
    nonzero = under = over = 0
    for g in grads:
        g = g.detach().float().flatten()
        nz = g != 0
        cast = (g * scale).to(dtype)
        nonzero += int(nz.sum())
        under += int((nz & (cast == 0)).sum())
        over += int(torch.isinf(cast).sum() - torch.isinf(g).sum())
    if nonzero == 0:
        raise LabkitError("underflow_fraction: all gradients are zero (run a backward pass first)")
    return {"underflow": under / nonzero, "overflow": over / nonzero, "elements": nonzero}


# ------------------------------------------------------------------------------------------------- memory

_STATE_BYTES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}  # fp32 state tensors per parameter


def predicted_bytes_per_param(precision: Precision | str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Bytes per parameter of training state that lives across steps: params, grads, optimizer state, master.

    Autocast keeps fp32 parameters (they are the master weights) and makes fp16/bf16 copies on the fly, so
    Adam costs 4 + 4 + 8 = 16 bytes in fp32 and in AMP alike; the fp16-model recipe costs 2 + 2 + 8 + 4 = 16.
    Activations come on top and scale with the batch (see SavedTensorMeter).
    """
    p = get_precision(precision)
    if optimizer not in _STATE_BYTES:
        raise LabkitError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(_STATE_BYTES)}")
    w = p.param_dtype.itemsize
    opt_item = 4 if p.master_weights or p.param_dtype == torch.float32 else w
    parts = {"params": w, "grads": w, "optimizer_state": _STATE_BYTES[optimizer] * opt_item,
             "master_weights": 4 if p.master_weights else 0}
    parts["total"] = sum(parts.values())
    return parts


def _storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return (st.device, st.data_ptr()), st.nbytes()


def measured_bytes_per_param(model: nn.Module, optimizer: torch.optim.Optimizer,
                             master: Fp32MasterWeights | None = None) -> dict[str, float]:
    """Bytes per model parameter actually held by params, grads, optimizer state and master weights.

    Counted from the live tensors (each storage once), so run at least one step first: Adam creates its state
    lazily. The model's parameter count is the denominator.
    """
    n = sum(p.numel() for p in model.parameters())
    if n == 0:
        raise LabkitError("the model has no parameters")
    seen: set = set()

    def total(tensors) -> int:
        b = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                b += nbytes
        return b

    master_ps = master.master_params if master else []
    parts = {
        "params": total(model.parameters()),
        "grads": total(p.grad for p in model.parameters()),
        "master_weights": total(master_ps),
        "optimizer_state": total(v for s in optimizer.state.values() for v in s.values()),
    }
    parts["grads"] += total(p.grad for p in master_ps)
    out = {k: v / n for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


class SavedTensorMeter:
    """Bytes that autograd keeps for the backward pass (the activation memory), on any device.

        with SavedTensorMeter(model) as m:
            loss = loss_fn(model(x), y)
        m.bytes   # activations + autocast's low-precision weight copies; parameters themselves excluded

    Each storage counts once (ReLU's output and the next layer's input are the same memory).
    """

    def __init__(self, model: nn.Module | None = None):
        self._exclude = {_storage_key(p)[0] for p in model.parameters()} if model is not None else set()
        self.bytes = 0
        self.tensors = 0

    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage_key(t)
        if key not in self._seen and key not in self._exclude:
            self._seen.add(key)
            self.bytes += nbytes
            self.tensors += 1
        return t

    def __enter__(self):
        self._seen, self.bytes, self.tensors = set(), 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen = set()
        return False


def activation_bytes(model: nn.Module, x: torch.Tensor, precision: Precision | str = "fp32") -> int:
    """Bytes saved for backward by one forward pass of `model` on `x` under the preset's autocast."""
    p = get_precision(precision)
    dev = next(model.parameters()).device
    model.train()
    with SavedTensorMeter(model) as m, autocast_context(p, dev):
        xin = x.to(dev) if p.autocast_dtype is not None or not x.is_floating_point() else x.to(dev, p.param_dtype)
        out = model(xin)
    del out
    return m.bytes


def cuda_peak_bytes(fn: Callable[[], object], device=None) -> dict[str, int]:
    """Run `fn` once on CUDA: peak bytes allocated during it, and bytes resident before it (CUDA only)."""
    dev = pick_device(device)
    if dev.type != "cuda":
        raise LabkitError("cuda_peak_bytes measures the CUDA caching allocator: it needs a CUDA device")
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    return {"peak_bytes": peak, "resident_before_bytes": before, "peak_above_resident_bytes": peak - before}


def memory_breakdown(trainer: AmpTrainer, x: torch.Tensor, y: torch.Tensor, warmup: int = 2) -> dict[str, int]:
    """Where one training step's CUDA memory goes, in bytes, after `warmup` steps (Adam's state, cuDNN's autotune
    and the allocator's first blocks all happen there, not in the measured step).

    Keys: params, grads, optimizer_state, master_weights (live tensors, each storage once); activations (saved for
    backward by one forward pass: what autocast and checkpointing change); resident (allocated before the step:
    the state plus anything else still alive); other_resident (resident minus the state that lives across steps:
    leftovers of earlier work, cuBLAS workspaces); step_peak (the step's peak above resident); workspace (step_peak
    minus activations: cuDNN/cuBLAS workspaces, autocast's weight copies, temporaries); peak (the state that lives
    across steps plus step_peak: the step's peak with nothing else resident); reserved
    (what the caching allocator holds from the driver after the step, free blocks included). CUDA only.
    """
    dev = trainer.device
    if dev.type != "cuda":
        raise LabkitError("memory_breakdown reads the CUDA caching allocator: it needs a CUDA device")
    if warmup < 1:
        raise LabkitError(f"warmup must be >= 1 (Adam creates its state in the first step), not {warmup}")
    for _ in range(warmup):
        trainer.step(x, y)
    n = sum(q.numel() for q in trainer.model.parameters())
    per = measured_bytes_per_param(trainer.model, trainer.optimizer, trainer.master)
    out = {k: round(per[k] * n) for k in ("params", "grads", "optimizer_state", "master_weights")}
    peak = cuda_peak_bytes(lambda: trainer.step(x, y), dev)
    out["resident"] = peak["resident_before_bytes"]
    out["step_peak"] = peak["peak_above_resident_bytes"]
    # zero_grad(set_to_none) frees the gradients at the start of the step: they are rebuilt inside the peak
    out["other_resident"] = max(0, out["resident"] - out["params"] - out["optimizer_state"] - out["master_weights"]
                                - out["grads"])
    out["activations"] = activation_bytes(trainer.model, x, trainer.precision)
    # the step frees the old gradients before backward makes new ones: they cancel in step_peak
    out["workspace"] = max(0, out["step_peak"] - out["activations"])
    out["peak"] = out["params"] + out["grads"] + out["optimizer_state"] + out["master_weights"] + out["step_peak"]
    out["reserved"] = torch.cuda.memory_reserved(dev)
    return out


def recorded_memory_split(result: dict) -> list[dict]:
    """The rows of a week3_amp result (benchmarks/week3_amp.py) with their peak split, in bytes: state (params,
    grads, Adam), "step_adds" (the step's peak above what was resident before it: peak minus state), and the
    activations saved for backward, in the order the benchmark measured them.

    The activations are not subtracted from step_adds: zero_grad(set_to_none=True) frees the previous step's
    gradients before the forward pass and backward frees activations while it makes the new gradients, so the
    peak never holds the whole state and all the activations at once (peak - state - activations can be
    negative). Rows recorded before the benchmark measured above the resident memory hold an absolute peak.
    """
    rows = []
    for r in result.get("speed", []):
        if r.get("peak_bytes") is None:
            continue
        state, act = r["state_bytes"], r["activation_bytes"]
        rows.append({"model": r["model"], "batch": r["batch"], "precision": r["precision"], "peak": r["peak_bytes"],
                     "state": state, "step_adds": max(0, r["peak_bytes"] - state), "activations": act,
                     "resident": r.get("resident_bytes")})
    return rows


# ---------------------------------------------------------------------------------- checkpointing helpers


class Checkpointed(nn.Module):
    """Run `inner` under activation checkpointing while training: keep only its input, recompute in backward.

    Caveat: BatchNorm inside is run twice per step, so its running statistics move twice (gradients are exact).
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


def checkpoint_blocks(model: nn.Module, block_types: tuple[type, ...] | None = None) -> int:
    """Wrap every residual block of `model` in `Checkpointed`, in place; returns how many were wrapped.

    Default blocks: the week model's `Block` and ResNet-18's `BasicBlock`. The trade: activation memory of
    the blocks drops to their inputs; each step pays about one extra forward pass of them.
    """
    if block_types is None:
        from labkit.models import BasicBlock

        block_types = (Block, BasicBlock)
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, Checkpointed):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, block_types):
                setattr(parent, name, Checkpointed(child))
                count += 1
    if count == 0:
        raise LabkitError(f"no blocks of type {', '.join(t.__name__ for t in block_types)} found to checkpoint "
                          "(outside Checkpointed wrappers): pass block_types, or the model is already wrapped")
    return count


# ------------------------------------------------------------------------------------------ fp8 outlook


def recorded_dtype_rows(result: dict) -> list[dict]:
    """Every record in a saved matmul result that names a dtype and a TFLOP/s figure, as flat rows.

    Walks the JSON rather than assuming one layout, so it reads any week-2 matmul result file.
    """
    rows = []

    def walk(obj):
        if isinstance(obj, dict):
            dtype = next((obj[k] for k in ("dtype", "kind", "format", "precision") if isinstance(obj.get(k), str)),
                         None)
            tflops = obj.get("tflops")
            if dtype is not None and isinstance(tflops, (int, float)):
                if all(isinstance(obj.get(k), int) for k in "mnk"):
                    shape = f"{obj['m']}x{obj['n']}x{obj['k']}"
                else:
                    shape = obj.get("shape", obj.get("size"))
                rows.append({"dtype": dtype, "shape": shape, "tflops": float(tflops)})
            for k, v in obj.items():
                if k != "env":
                    walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(result)
    return rows


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def benchmark_summary(result: dict, parts: Sequence[str] = ("speed", "checkpointing", "bytes", "race", "scalers")) -> str:
    """Text tables of a `week3_amp` result (benchmarks/week3_amp.py): speed, memory, checkpointing, claims."""
    lines = []
    if "speed" in parts and result.get("speed"):
        lines.append("training step: speed vs strict fp32 (interleaved) and memory (MiB)")
        lines.append(f"{'model':<9} {'batch':>5} {'precision':<9} {'samples/s':>10} {'vs fp32':>8} {'±IQR':>5} "
                     f"{'peak MiB':>9} {'activ MiB':>9}")
        for r in result["speed"]:
            lines.append(f"{r['model']:<9} {r['batch']:>5} {r['precision']:<9} {r['samples_per_s']:>10,.0f} "
                         f"{r['speedup_vs_fp32']:>7.2f}x {r['speedup_iqr']:>5.2f} {_mib(r.get('peak_bytes')):>9} "
                         f"{_mib(r.get('activation_bytes')):>9}")
    if "checkpointing" in parts and result.get("checkpointing"):
        lines.append("\nactivation checkpointing (residual blocks): memory saved vs time lost")
        lines.append(f"{'model':<9} {'batch':>5} {'prec':<5} {'peak MiB plain/ckpt':>20} "
                     f"{'activ MiB plain/ckpt':>21} {'slowdown':>8}")
        for r in result["checkpointing"]:
            peak = f"{_mib(r.get('plain_peak_bytes'))}/{_mib(r.get('checkpointed_peak_bytes'))}"
            act = f"{_mib(r['plain_activation_bytes'])}/{_mib(r['checkpointed_activation_bytes'])}"
            lines.append(f"{r['model']:<9} {r['batch']:>5} {r['precision']:<5} {peak:>20} {act:>21} "
                         f"{r['slowdown']:>7.2f}x")
    if "bytes" in parts and result.get("bytes_per_param"):
        lines.append("\nbytes per parameter after one Adam step: predicted, live tensors, CUDA allocator")
        for p, r in result["bytes_per_param"].items():
            alloc = r.get("allocator")
            lines.append(f"  {p:<12} predicted {r['predicted']['total']:>2}  tensors {r['tensors']['total']:6.2f}  "
                         f"allocator {'-' if alloc is None else f'{alloc:6.2f}'}")
    if "race" in parts and result.get("race"):
        lines.append("\n.half() vs autocast race (final loss; NaN step; zero-gradient share)")
        for w, r in result["race"].items():
            cells = []
            for p, ls in r["losses"].items():
                nf = r["first_nonfinite"][p]
                cells.append(f"{p} {'NaN@' + str(nf) if nf is not None else f'{ls[-1]:.3f}'}"
                             f" ({r['zero_grad_fraction'][p]:.0%} zero)")
            lines.append(f"  loss weight {w}: " + "; ".join(cells))
    if "scalers" in parts and result.get("scalers"):
        same = [n for n, r in result["scalers"].items() if r["identical"]]
        lines.append(f"\nDynamicLossScaler identical to GradScaler on {len(same)}/{len(result['scalers'])} "
                     "crafted sequences")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- CLI


def add_cli(sub) -> None:
    p = sub.add_parser("amp", help="mixed precision: .half() vs autocast race, hand-made scaler vs GradScaler, "
                                   "bytes per parameter")
    p.add_argument("--device", default="auto", help="device to run on (auto, cpu, cuda, cuda:N)")
    p.add_argument("--steps", type=int, default=None, help="training steps per race (default 40 quick, 200 full)")
    p.add_argument("--what", default="race,scalers,memory",
                   help="comma-separated parts to run: race, scalers, memory")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.set_defaults(func=_cli_amp)


def _cli_amp(args) -> int:
    from labkit.bench import write_json

    dev = pick_device(args.device)
    parts = {w.strip() for w in args.what.split(",") if w.strip()}
    unknown = parts - {"race", "scalers", "memory"}
    if unknown:
        raise LabkitError(f"unknown part(s) {', '.join(sorted(unknown))}: use race, scalers, memory")
    record: dict = {"device": str(dev)}
    if dev.type != "cuda":
        print("no CUDA: fp16 speed and peak memory are GPU-only (python benchmarks/week3_amp.py records them); "
              "fp16 here runs on slow CPU kernels")
    if "race" in parts:
        for w in (1.0, 1e-5):
            res = precision_race(steps=args.steps, loss_weight=w, device=dev, progress=True)
            print(f"\nprecision race on {dev}, loss weight {w:g} (same weights, same batches, Adam):")
            print(res.table())
            record[f"race_loss_weight_{w:g}"] = {"losses": res.losses, "zero_grad_fraction": res.zero_grad_fraction}
    if "scalers" in parts:
        print(f"\nhand-made scalers vs torch.amp.GradScaler({dev.type!r}) on crafted gradient sequences:")
        print(f"{'sequence':<17} {'scale history (GradScaler)':<44} {'skipped':<15} dynamic static-skips")
        ok = True
        for name, tr in compare_scalers(dev).items():
            ref, dyn, sta = tr["GradScaler"], tr["DynamicLossScaler"], tr["StaticLossScaler"]
            same = ref.scales == dyn.scales and ref.skipped == dyn.skipped and ref.params == dyn.params
            ok &= same
            hist = ",".join(f"{s:g}" for s in ref.scales)
            print(f"{name:<17} {hist[:43]:<44} {''.join('x' if s else '.' for s in ref.skipped):<15} "
                  f"{'identical' if same else 'DIFFERENT'} {sum(sta.skipped)}")
            record.setdefault("scalers", {})[name] = {k: vars(v) for k, v in tr.items()}
        print("DynamicLossScaler matches GradScaler on every sequence" if ok else "MISMATCH with GradScaler")
    if "memory" in parts:
        print("\nbytes per parameter of training state (Adam), predicted vs measured on the live tensors:")
        print(f"{'precision':<13} {'predicted':>9} {'measured':>9}  params grads state master")
        for name in ("fp32", "fp16", "bf16", "fp16_master", "half"):
            tr = AmpTrainer(build_mlp("tiny"), name, device=dev)
            tr.step(*teacher_batch(0, 16, device=dev))
            pred = predicted_bytes_per_param(name)
            meas = measured_bytes_per_param(tr.model, tr.optimizer, tr.master)
            print(f"{name:<13} {pred['total']:>9} {meas['total']:>9.2f}  {meas['params']:>6.2f} {meas['grads']:>5.2f}"
                  f" {meas['optimizer_state']:>5.2f} {meas['master_weights']:>6.2f}")
            record.setdefault("bytes_per_param", {})[name] = {"predicted": pred, "measured": meas}
    if args.json:
        write_json(args.json, record)
    return 0

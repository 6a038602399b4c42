"""One ResNet-18 training engine; every optimization is a switch in `TrainConfig`.

The ladder (`LADDER`, in `labkit.presets` with `TrainConfig`, and re-exported here) is a list of presets, each
rung adding one idea to the rung before it (some ideas take several settings: `labkit ladder --list`), all run
by the same `train()`. `labkit ladder` runs each rung several times in interleaved rounds and writes a table
(median img/s and its spread), JSON and a chart; `labkit train` runs one.

What makes a compiled rung's first seconds short (the compile-cache artifact, the saved forward, the tiered start,
the cuDNN warm-up) lives apart, in `labkit.faststart`: `labkit train` readies a run with one call,
`faststart.start`, and hands `train()` what it readied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from labkit import data as D
from labkit import faststart, report
from labkit import gpu_power as GP
from labkit.bench import MachineLoad, synchronize
from labkit.env import LabkitError, environment, native_bf16, pick_device, process_age_s, torch_switches
from labkit.models import resnet18, train_flops_per_image
from labkit.outputs import check_writable, write_json, write_text
from labkit.presets import (  # noqa: F401  (re-exported: labkit.train is where users find the configs)
    AUTOCAST,
    COMPILE_MODES,
    FULL_REPEATS,
    GRAPH_MODES,
    LADDER,
    LOADERS,
    OPTIMIZERS,
    PRECISIONS,
    RUNG_NAMES,
    TF32,
    TrainConfig,
    ablation,
    add_set_argument,
    live_ladder_size,
    preset,
    quick_base,
    with_changes,
)
from labkit.progress import Stages, fmt_duration
from labkit.waves import datasheet_peak

# ------------------------------------------------------------------------------------------------ checks


def check_config(cfg: TrainConfig, device: torch.device) -> None:
    """Reject impossible combinations before anything runs, with the fix in the message."""
    def need(cond, msg):
        if not cond:
            raise LabkitError(f"{cfg.name}: {msg}")

    need(cfg.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, not {cfg.precision!r}")
    need(cfg.loader in LOADERS, f"loader must be one of {LOADERS}, not {cfg.loader!r}")
    need(cfg.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, not {cfg.optimizer!r}")
    need(cfg.compile in COMPILE_MODES, f"compile must be one of {COMPILE_MODES}, not {cfg.compile!r}")
    need(cfg.batch_size >= 1 and cfg.epochs >= 1 and cfg.width >= 1, "batch_size, epochs and width must be >= 1")
    need(cfg.n_train is None or cfg.batch_size <= cfg.n_train,
         f"batch_size {cfg.batch_size} is larger than the {cfg.n_train} training images (n_train): lower batch_size "
         "or raise n_train")
    need(cfg.compile or not (cfg.compile_tuning or cfg.compile_combo or not cfg.compile_autotune or cfg.matmul_edges),
         "compile_tuning, compile_autotune, compile_combo and matmul_edges change torch.compile's kernels: set "
         "compile too")
    need(cfg.cudnn_limit >= 0, f"cudnn_limit must be >= 0 (0: time every algorithm), not {cfg.cudnn_limit}")
    need(cfg.lr_scaling in ("sqrt", "linear"), f"lr_scaling must be sqrt or linear, not {cfg.lr_scaling!r}")
    need(cfg.ddp_bucket_mb >= 1, f"ddp_bucket_mb must be at least 1 (MiB), not {cfg.ddp_bucket_mb}")
    need(cfg.accumulation >= 1 and cfg.batch_size % cfg.accumulation == 0,
         f"batch_size {cfg.batch_size} must be a multiple of accumulation {cfg.accumulation}")
    need(cfg.lr > 0, "lr must be positive")
    need(cfg.max_steps is None or cfg.max_steps >= 1, f"max_steps must be >= 1 (or None), not {cfg.max_steps}")
    need(0 <= cfg.momentum < 1, f"momentum (AdamW: beta1) must be in [0, 1), not {cfg.momentum}")
    need(cfg.weight_decay >= 0, f"weight_decay must be >= 0, not {cfg.weight_decay}")
    rank, n = world()
    if n > 1:
        need(cfg.loader in ("resident", "tensor"), "distributed runs shard resident data: use loader=resident")
        need(not cfg.checkpointing, "checkpointing is not wired through DistributedDataParallel here")
        need(cfg.batch_size % (n * cfg.accumulation) == 0,
             f"batch_size {cfg.batch_size} must split evenly over {n} processes x {cfg.accumulation} micro-batches")
    if device.type != "cuda":
        need(cfg.precision != "fp16", "fp16 autocast with GradScaler needs a CUDA GPU: use --device cuda or bf16")
        need(cfg.compile not in GRAPH_MODES, f"CUDA graphs (compile={cfg.compile}) need a CUDA GPU")
        need(not cfg.optimizer.endswith("-fused") or _fused_optimizers_on_cpu(), "fused optimizers on CPU need torch >= 2.4")
    else:
        cc = torch.cuda.get_device_capability(device)
        # torch runs bf16 on older cards too, emulated and slower than fp32: refuse it rather than time that
        need(cfg.precision != "bf16" or native_bf16(device),
             f"bf16 tensor cores need compute capability 8.0+, this GPU is {cc[0]}.{cc[1]}: use precision=fp16 "
             f"(autocast with GradScaler)")


def _fused_optimizers_on_cpu() -> bool:
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


# ------------------------------------------------------------------------------------------------ engine


def world() -> tuple[int, int]:
    """(rank, number of processes) of a torch.distributed run; (0, 1) otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Batches:
    """Yields (images, labels) on the device for one epoch, whatever the loading path.

    Under DistributedDataParallel every rank walks the same global order and takes its share (rank::world) of
    each global batch, so N processes see exactly the batches one process would.
    """

    def __init__(self, cfg: TrainConfig, ds: D.ImageData, device: torch.device):
        self.cfg, self.device = cfg, device
        self.rank, self.world = world()
        self.n = len(ds.y_train)
        self.per_step = cfg.batch_size
        if self.n < cfg.batch_size:
            raise LabkitError(f"{cfg.name}: batch_size {cfg.batch_size} is larger than the {self.n} training images")
        self.steps_per_epoch = self.n // cfg.batch_size  # partial batches dropped: a new shape recompiles
        self.gen = torch.Generator(device=device if cfg.loader == "resident" else "cpu")
        self.gen.manual_seed(cfg.seed + 1 + 1000 * self.rank)  # per-rank augmentation streams
        if cfg.loader == "pil":
            if cfg.data_dir:  # a folder the user gave must already hold <class>/<image> files
                folder = cfg.data_dir
            else:
                root = D.cache_dir() / f"images-{ds.name}-{self.n}-{D.fingerprint(ds)}"
                folder = D.write_image_folder(ds, root, "train")
            workers = min(16, os.cpu_count() or 1) if cfg.workers < 0 else cfg.workers
            self.sampler = D.EpochSampler(self.n, cfg.seed)
            kw = dict(batch_size=cfg.batch_size, sampler=self.sampler, num_workers=workers, drop_last=True,
                      pin_memory=cfg.pin_memory and device.type == "cuda")
            if workers > 0:
                kw.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                          worker_init_fn=_seed_worker, generator=torch.Generator().manual_seed(cfg.seed))
            self.loader = torch.utils.data.DataLoader(D.ImageFileDataset(folder, augment=cfg.augment), **kw)
        else:
            where = device if cfg.loader == "resident" else "cpu"
            self.x = D.to_nchw_uint8(ds.x_train, where)
            self.y = torch.from_numpy(ds.y_train).to(where)

    def epoch(self, e: int):
        cfg, dev = self.cfg, self.device
        fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
        if cfg.loader == "pil":
            self.sampler.set_epoch(e)
            for x, y in self.loader:
                yield (x.to(dev, non_blocking=True, memory_format=fmt), y.to(dev, non_blocking=True))
            return
        order = D.epoch_order(self.n, cfg.seed, e).to(self.x.device)
        for s in range(self.steps_per_epoch):
            idx = order[s * cfg.batch_size:(s + 1) * cfg.batch_size][self.rank::self.world]
            x, y = self.x[idx], self.y[idx]
            if cfg.augment:
                x = D.augment_batch(x, self.gen)
            if x.device.type != dev.type:
                x = x.pin_memory() if cfg.pin_memory and dev.type == "cuda" else x
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            yield D.normalize(x).contiguous(memory_format=fmt), y


def _seed_worker(worker_id: int) -> None:
    # torchvision's random transforms use torch's RNG, which DataLoader already seeds per worker; numpy and
    # random are seeded too so that custom transforms stay reproducible.
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision in AUTOCAST:
        return torch.autocast(device.type, dtype=getattr(torch, AUTOCAST[cfg.precision]))
    return contextlib.nullcontext()


@contextlib.contextmanager
def _switches(cfg: TrainConfig):
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_switches(tf32=TF32.get(cfg.precision), cudnn_benchmark=cfg.cudnn_benchmark,
                                           cudnn_limit=cfg.cudnn_limit))
        # torch.compile compiles lazily, inside the loop: the patch must cover it. Only settings that differ from
        # inductor's defaults are patched, so a default config keeps its compile-cache keys.
        patch = {k: v for k, v, default in (("coordinate_descent_tuning", cfg.compile_tuning, False),
                                            ("triton.autotune_pointwise", cfg.compile_autotune, True),
                                            ("combo_kernels", cfg.compile_combo, False)) if v != default}
        if cfg.compile and patch:
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(patch))
        import torch._dynamo.config as dynamo_config  # optimize_ddp is read when DDP's module compiles, in the loop

        stack.enter_context(dynamo_config.patch(optimize_ddp=cfg.ddp_split_graphs))
        yield


def _make_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float):
    params = list(model.parameters())
    if not cfg.bn_weight_decay:  # BatchNorm scales/shifts and biases are the 1-D parameters
        params = [{"params": [p for p in params if p.ndim > 1]},
                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if cfg.optimizer == "muon":
        from labkit.muon import Muon

        # conv filters are Muon's; BatchNorm, biases and the classifier take AdamW steps at the same lr
        decay = [p for p in model.parameters() if p.ndim > 1 and p.ndim != 4]
        vectors = [p for p in model.parameters() if p.ndim <= 1]
        groups = [{"params": [p for p in model.parameters() if p.ndim == 4]},
                  {"params": decay, "adamw": True},
                  {"params": vectors, "adamw": True, **({} if cfg.bn_weight_decay else {"weight_decay": 0.0})}]
        # the CUDA-graphs rungs replay Muon's few hundred small kernels as one graph too
        graphed = cfg.compile in GRAPH_MODES and next(model.parameters()).is_cuda
        return Muon([g for g in groups if g["params"]], lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    cuda_graph=graphed)
    if cfg.optimizer == "adamw-fused":
        # momentum is Adam's beta1; beta2 0.99 rather than 0.999 because runs here last a few hundred steps,
        # too few for a 1000-step average of squared gradients to settle. weight_decay is decoupled (x lr).
        return torch.optim.AdamW(params, lr=lr, betas=(cfg.momentum, 0.99), weight_decay=cfg.weight_decay,
                                 fused=True)
    kw = dict(lr=lr, momentum=cfg.momentum, nesterov=True, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd-foreach":
        kw["foreach"] = True
    elif cfg.optimizer == "sgd-fused":
        kw["fused"] = True
    else:
        kw["foreach"] = False
    opt = torch.optim.SGD(params, **kw)
    if kw.get("fused") and cfg.momentum:
        # Fused SGD makes its momentum buffers with empty_like in its first step, and when GradScaler skips that
        # step (fp16 gradients overflow at GradScaler's starting scale) the kernel never writes them: the next
        # step reads garbage. Zeroed buffers make every step a regular one; with dampening 0 the first update
        # is the same (buffer = momentum x 0 + gradient).
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


def _checkpointed_forward(model, x):
    from torch.utils.checkpoint import checkpoint

    out = F.relu(model.bn1(model.conv1(x)))
    for block in model.layers:
        out = checkpoint(block, out, use_reentrant=False)
    return model.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, ds: D.ImageData, cfg: TrainConfig, device: torch.device,
             batch_size: int = 1000) -> float:
    """Top-1 accuracy on the test split (fraction in [0, 1]).

    Without cuDNN autotuning whatever the config says: the test batch is not the training batch, so
    cudnn.benchmark would time every convolution's algorithms again for a few batches of forward passes, a
    cost far larger than the evaluation it speeds up.
    """
    model.eval()
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    x_all = D.to_nchw_uint8(ds.x_test, device)
    y_all = torch.from_numpy(ds.y_test).to(device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    with _autocast(cfg, device), torch_switches(cudnn_benchmark=False):
        for i in range(0, len(y_all), batch_size):
            x = D.normalize(x_all[i:i + batch_size]).contiguous(memory_format=fmt)
            correct += (model(x).argmax(1) == y_all[i:i + batch_size]).sum()
    model.train()
    return correct.item() / len(y_all)


def micro_batch(cfg: TrainConfig, world_size: int = 1) -> int:
    """Images per forward call: the batch split across ranks (`world_size` processes) and accumulation steps."""
    return cfg.batch_size // world_size // cfg.accumulation


def peak_lr(cfg: TrainConfig) -> float:
    """The learning rate at the top of the schedule: cfg.lr (given for batch 128) scaled to cfg.batch_size."""
    return cfg.lr * (cfg.batch_size / 128 if cfg.lr_scaling == "linear" else math.sqrt(cfg.batch_size / 128))


def train(cfg: TrainConfig, device: str | torch.device | None = None, dataset: D.ImageData | None = None,
          peak_tflops: float | None = None, progress=None, on_step=None, warmup=None, precompiled=None, tier=None,
          read_power: bool = True) -> dict:
    """Train ResNet-18 as `cfg` says and return a result record.

    Record keys: img_per_s (steady state: epochs after the first, data loading and augmentation included),
    img_per_s_all (every epoch, the first with its compile and warm-up included), epoch_s (seconds per epoch),
    first_step_s (the first step alone: compile/autotune cost), peak_mem_bytes (CUDA only), flops_per_image,
    mfu (against `peak_tflops`), losses (one per optimizer step), accuracy, config, env, gpu_power (the steady
    epochs' median SM clock in MHz and board power in W beside the card's limits, `labkit.gpu_power`; None without
    NVML).
    `progress` (a tqdm bar) and `on_step(steps_done)` (e.g. a profiler's `step`) are called after each step;
    the step's phases carry record_function labels: data, forward, backward, optimizer.
    `warmup`, `precompiled`, `tier`: what the caller's fast start readied (`labkit.faststart.start`, passed as its
    `train_args()`). `warmup`: a cuDNN warm-up started for `cfg` so that it overlaps the caller's own loading too;
    without one, one starts here where it applies. Its report is `cudnn_warmup`. `precompiled`: the compiled
    forward loaded from its file, run instead of torch.compile; the record's `precompiled` says whether it was.
    `tier`: a compiled forward on its way, the steps eager until it is ready; the caller closes it and records its
    report.
    `read_power=False` leaves the GPU's clock and power unread (gpu_power None): for a caller reading them itself,
    such as `labkit.profiling.profile_steps`, since a second NVML thread would only add to the step it measures.
    """
    t_start = time.perf_counter()
    dev = pick_device(device)
    check_config(cfg, dev)
    if warmup is None:  # cuDNN times backward convolutions while the data and model load, where cfg asks for it
        warmup = faststart.start(cfg, dev, graph_key(cfg), world_size=world()[1]).warmup
    marks = [("device_and_faststart", time.perf_counter())]  # each part named with the time it ended
    if dataset is None:
        dataset = D.load(cfg.data, cfg.n_train, cfg.n_test, seed=0)
    ds = dataset.subset(cfg.n_train, cfg.n_test)
    marks.append(("data", time.perf_counter()))
    torch.manual_seed(cfg.seed)
    model, net, flops = _build_model(cfg, ds.num_classes, dev)
    marks.append(("model", time.perf_counter()))
    batches = _Batches(cfg, ds, dev)
    marks.append(("batches", time.perf_counter()))
    steps_total = batches.steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        steps_total = min(steps_total, cfg.max_steps)
    lr = peak_lr(cfg)
    step = _make_step(cfg, model, net, lr, steps_total, dev, precompiled, tier)
    marks.append(("step", time.perf_counter()))
    warmed = warmup.wait() if warmup is not None else None  # before the first step: none of its kernels beside ours
    marks.append(("warmup_wait", time.perf_counter()))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    on_epoch = (lambda: evaluate(model, ds, cfg, dev)) if cfg.eval_every_epoch else None
    meter = GP.Meter.open(dev) if read_power else None
    t_loop = time.perf_counter()
    with _switches(cfg):
        model.train()
        run = _run_epochs(cfg, step, batches, dev, steps_total, progress, on_step, on_epoch, meter)
        t_eval = time.perf_counter()
        if not all(math.isfinite(v) for v in run.losses):
            raise LabkitError(f"{cfg.name}: the loss became NaN/inf (lr {lr:.3g}, precision {cfg.precision}): "
                              f"lower lr or use bf16 / fp16 with GradScaler")
        if run.curve and run.curve[-1]["steps"] == run.steps:
            acc = run.curve[-1]["accuracy"]  # the last epoch's evaluation is the final one: not twice
        else:
            acc = evaluate(model, ds, cfg, dev) if cfg.evaluate else None
    if cfg.loader == "pil" and cfg.workers != 0:
        del batches.loader  # stop persistent workers now, not at interpreter exit
    rec = _record(cfg, dev, run, batches.steps_per_epoch * cfg.batch_size, flops, peak_tflops, acc)
    rec["cudnn_warmup"] = warmed
    rec["precompiled"] = precompiled is not None
    rec["gpu_power"] = meter.report() if meter is not None else None
    # where a run's wall time goes besides its epochs: a compiled rung's wait is not all in the first step
    rec["stages_s"] = {"setup": t_loop - t_start, "loop": t_eval - t_loop, "final_evaluation": time.perf_counter() - t_eval}
    # setup's parts (seconds): device and fast start, data, model, batches (on-device data), step (its build),
    # the cuDNN warm-up's wait: where a cold run's time before its first step goes
    ends = [t_start] + [t for _, t in marks]
    rec["setup_parts_s"] = {name: round(t - ends[i], 4) for i, (name, t) in enumerate(marks)}
    return rec


def _build_model(cfg: TrainConfig, num_classes: int, dev: torch.device):
    """(model, net, FLOPs per training image): the ResNet-18 on `dev` in the configured memory format, and what
    the step calls (the model, or its DistributedDataParallel wrapper)."""
    model = resnet18(num_classes=num_classes, width=cfg.width, zero_init_residual=cfg.zero_init_residual,
                     matmul_edges=cfg.matmul_edges).to(dev)
    flops = train_flops_per_image(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if world()[1] == 1:
        return model, model, flops
    from torch.nn.parallel import DistributedDataParallel  # gradients all-reduced in buckets during backward

    # torch 2.14 renamed broadcast_buffers (deprecated there, with a warning) to forward_sync_buffers, which also
    # syncs the buffers once at wrap time: the same here, since every rank builds the model from one seed
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else "broadcast_buffers")
    net = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                  bucket_cap_mb=cfg.ddp_bucket_mb, static_graph=cfg.ddp_static_graph,
                                  gradient_as_bucket_view=cfg.ddp_static_graph, **{sync: cfg.ddp_broadcast_buffers})
    if cfg.ddp_bf16_grads:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return model, net, flops


# The TrainConfig fields that shape what torch.compile compiles (the model's forward and backward): the dataset's
# images and classes, the model, the micro-batch, dtype, memory format and inductor's settings. Two configs with
# the same values compile the same graph, so a compile-cache artifact built for one holds the other's.
GRAPH_FIELDS = ("data", "width", "batch_size", "accumulation", "precision", "channels_last", "checkpointing",
                "matmul_edges", "compile", "compile_tuning", "compile_autotune", "compile_combo")


def graph_key(cfg: TrainConfig) -> dict:
    """What of `cfg` decides the compiled graph (GRAPH_FIELDS and their values)."""
    return {f: getattr(cfg, f) for f in GRAPH_FIELDS}


def _make_step(cfg: TrainConfig, model: torch.nn.Module, net: torch.nn.Module, lr: float, steps_total: int,
               dev: torch.device, precompiled=None, tier=None):
    """The optimizer step as a function step(x, y) -> the first micro-batch's loss (on the device).

    Holds the optimizer, the warm-up-then-linear-decay schedule, the fp16 GradScaler, checkpointing and
    torch.compile, or `precompiled` (a saved forward, `labkit.faststart`) in its place, or `tier` (one on its way):
    eager until its forward is ready, then that forward. Its phases carry record_function labels, which cost
    next to nothing without a profiler and let labkit.profiling split the step.
    """
    opt = _make_optimizer(cfg, model, lr)
    warm = max(1, int(cfg.warmup_frac * steps_total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps_total - s) / max(1, steps_total - warm)))
    scaler = torch.amp.GradScaler(dev.type, enabled=cfg.precision == "fp16")
    fwd = net
    if cfg.checkpointing:
        def fwd(x):
            return _checkpointed_forward(model, x)
    if precompiled is not None:
        fwd = _loaded_forward(precompiled, model, dev)
    elif cfg.compile and tier is None:
        # static shapes: the batch never changes (partial batches are dropped), so no dynamic-shape kernels
        fwd = torch.compile(fwd, mode=None if cfg.compile == "default" else cfg.compile, dynamic=False)
    micro = micro_batch(cfg, world()[1])
    compiled = tier is None  # with a tier: from the step that switches

    def update(x, y, fwd):
        if compiled and cfg.compile in GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: graph outputs of the last may be reused
        for i in range(cfg.accumulation):
            xs, ys = (x, y) if cfg.accumulation == 1 else (x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro])
            with record_function("forward"), _autocast(cfg, dev):
                loss = F.cross_entropy(fwd(xs), ys, label_smoothing=cfg.label_smoothing)
            with record_function("backward"):
                scaler.scale(loss / cfg.accumulation).backward()
            if i == 0:
                first = loss.detach()
        with record_function("optimizer"):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
        return first

    if tier is None:
        return lambda x, y: update(x, y, fwd)
    loaded = None

    def step(x, y):  # eager until the tier's forward is ready: the switch comes between steps, timed once
        nonlocal compiled, loaded
        if loaded is None and (fn := tier.forward()) is not None:
            compiled, loaded = True, _loaded_forward(fn, model, dev)
            synchronize(dev)
            t0 = time.perf_counter()
            try:
                loss = update(x, y, loaded)
            except LabkitError as e:  # its guards reject this run: the step again, eager, and eager to the end
                compiled, loaded = False, None
                opt.zero_grad(set_to_none=True)  # what micro-batches it took before refusing one
                tier.reject(str(e))
                tier.count(False)
                return update(x, y, fwd)
            synchronize(dev)
            tier.count(True, time.perf_counter() - t0)
            return loss
        tier.count(loaded is not None)
        return update(x, y, loaded or fwd)

    return step


def _loaded_forward(fn, model: torch.nn.Module, dev: torch.device):
    """fwd(x) calling a loaded compiled forward f(model, x) (`labkit.faststart.precompiled`): outside the step's
    autocast, as at its build (its own autocast is inside it and its guards check that); a guard failure is a clear error."""
    def fwd(x):
        with torch.autocast(dev.type, enabled=False):
            try:
                return fn(model, x)
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                raise LabkitError(f"the saved forward (labkit compile-cache) does not fit this run ({e}): "
                                  f"rebuild it, or set LABKIT_PRECOMPILED=0") from None
    return fwd


@dataclass
class _Run:
    """What the training loop measured."""

    losses: list[float] = field(default_factory=list)   # one per optimizer step (the global batch's, under DDP)
    epoch_s: list[float] = field(default_factory=list)  # seconds per epoch, device synchronized at both ends
    first_step_s: float | None = None                   # seconds of the first step alone (compile, autotune)
    steps: int = 0                                      # optimizer steps taken
    total_s: float = 0.0                                # seconds of the whole loop, evaluations left out
    curve: list[dict] = field(default_factory=list)     # per epoch (eval_every_epoch): train seconds so far, accuracy


def _run_epochs(cfg: TrainConfig, step, batches: _Batches, dev: torch.device, steps_total: int, progress,
                on_step, on_epoch=None, meter: GP.Meter | None = None) -> _Run:
    """Run `step` over the epochs' batches until `steps_total` steps; times each epoch and the first step.

    `meter` (`labkit.gpu_power`) reads the GPU's clock and power through the steady epochs.

    `on_epoch()` (an evaluation returning accuracy) runs after each epoch, outside the timed span: its
    accuracy joins `run.curve` beside the training seconds so far.
    """
    run = _Run()
    eval_s = 0.0
    t_start = time.perf_counter()
    for e in range(cfg.epochs):
        synchronize(dev)
        t0 = time.perf_counter()
        dev_losses = []
        it = iter(batches.epoch(e))
        # the steady epochs' clock and power, as img_per_s counts them: not the first (compile) unless it is the only
        with meter.reading() if meter is not None and (e > 0 or cfg.epochs == 1) else contextlib.nullcontext():
            _epoch_steps(cfg, step, it, run, steps_total, dev, t0, dev_losses, progress, on_step)
            synchronize(dev)  # the queued kernels run inside the readings too
        run.epoch_s.append(time.perf_counter() - t0)
        run.losses += _epoch_losses(dev_losses)
        if on_epoch is not None:
            t_eval = time.perf_counter()
            run.curve.append({"epoch": e + 1, "steps": run.steps, "train_s": sum(run.epoch_s), "accuracy": on_epoch()})
            eval_s += time.perf_counter() - t_eval
        if run.steps >= steps_total:
            break
    run.total_s = time.perf_counter() - t_start - eval_s
    return run


def _epoch_steps(cfg: TrainConfig, step, it, run: _Run, steps_total: int, dev: torch.device, t0: float,
                 dev_losses: list, progress, on_step) -> None:
    """One epoch's steps from the batch iterator `it`, counted into `run` (the first step's seconds from `t0`)."""
    while run.steps < steps_total:
        with record_function("data"):
            batch = next(it, None)
        if batch is None:
            break
        loss = step(*batch)
        dev_losses.append(loss)
        if cfg.sync_every_step:
            loss.item()  # the naive script's per-step logging: a host sync
        run.steps += 1
        if run.first_step_s is None:
            synchronize(dev)
            run.first_step_s = time.perf_counter() - t0
        if progress is not None:
            progress.update(1)
        if on_step is not None:
            on_step(run.steps)


def _epoch_losses(dev_losses: list[torch.Tensor]) -> list[float]:
    """An epoch's per-step losses as floats, read from the device once; under DDP the mean over ranks."""
    if not dev_losses:
        return []
    losses = torch.stack(dev_losses).float()
    n_proc = world()[1]
    if n_proc > 1:  # log the global batch's loss: the mean over ranks (once per epoch, not per step)
        import torch.distributed as dist

        dist.all_reduce(losses)
        losses /= n_proc
    return losses.cpu().tolist()


def _record(cfg: TrainConfig, dev: torch.device, run: _Run, imgs_per_epoch: int, flops: float,
            peak_tflops: float | None, acc: float | None) -> dict:
    """The result record of a run (see `train`): rates in img/s, times in seconds, memory in bytes."""
    images_done = run.steps * cfg.batch_size
    steady = run.epoch_s[1:] if len(run.epoch_s) > 1 else run.epoch_s
    steady_imgs = imgs_per_epoch * len(steady) if len(run.epoch_s) > 1 else images_done
    img_per_s = steady_imgs / sum(steady)
    return {
        "name": cfg.name,
        "img_per_s": img_per_s,
        "img_per_s_all": images_done / run.total_s,
        "epoch_s": run.epoch_s,
        "first_step_s": run.first_step_s,
        "steps": run.steps,
        "images": images_done,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "flops_per_image": flops,
        "achieved_tflops": flops * img_per_s / 1e12,
        "mfu": flops * img_per_s / (peak_tflops * 1e12) if peak_tflops else None,
        "losses": run.losses,
        "final_loss": float(np.mean(run.losses[-max(1, min(10, len(run.losses) // 5)):])),
        "accuracy": acc,
        "accuracy_curve": run.curve or None,
        "device": str(dev),
        "processes": world()[1],
        "config": dataclasses.asdict(cfg),
    }


def peak_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Dense matmul rate (TFLOP/s) measured now on `device` with random data: the MFU denominator."""
    from labkit.matmul import bench_matmul

    kind = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return bench_matmul(kind, n, device=device)["tflops"]


@dataclass
class LadderPlan:
    """Which rungs run on this device, and which are skipped with the reason."""

    base: TrainConfig
    rungs: list[TrainConfig] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # rungs run differently here than their presets say, and why


def _skip_reason(name: str, device: torch.device, quick: bool) -> str | None:
    """Why ladder rung `name` does not run on `device` (None: it runs)."""
    if device.type == "cuda":
        return None
    return {"bf16": "no tensor cores: bf16 autocast only slows a CPU without bf16 matrix units",
            "cuda_graphs": "CUDA graphs need a CUDA GPU",
            "muon": "builds on the CUDA-graphs rung (Muon alone runs on CPU: labkit train --set optimizer=muon)",
            "compile": "torch.compile's cold start (minutes on 2 cores) dwarfs a quick CPU run" if quick else None,
            # a CPU runs each op before the call returns: there is no queue of device work for .item() to wait on
            "no_sync": "a CPU has no asynchronous device queue, so loss.item() waits for nothing: the same work as "
                       "the baseline" if quick else None,
            "cudnn_benchmark": "cuDNN exists only on CUDA GPUs"}.get(name)


# A quick CPU run keeps the batch rung at quick mode's batch. On 2 cores a larger batch is no faster per image
# (batch 256 ran at 1.59x the baseline against channels_last's 1.65x at 64), and on 4,096 images it only cuts the
# optimizer steps (48 against 192), so the rung ended at 72.9%, below the baseline's band (both in
# benchmarks/results/ladder/ladder_quick_cpu.json as of commit bb5d680). At batch 64 it measures the fused SGD alone.
QUICK_CPU_BATCH = 64
QUICK_CPU_BATCH_NOTE = (f"batch_fused keeps batch {QUICK_CPU_BATCH} on a CPU: 2 cores run a larger batch no faster "
                        "per image, and on quick mode's 4,096 images it only cuts the steps (batch 256: 48 against "
                        "192, ending below the baseline's accuracy), so here the rung measures the fused SGD alone")


def fit_rung(cfg: TrainConfig, device: torch.device, quick: bool) -> TrainConfig:
    """A ladder rung's `cfg` as it runs on `device` (the ladder, `labkit train`, loader_bench's model rates): a
    quick CPU run keeps quick mode's batch (QUICK_CPU_BATCH), a quick GPU run caps it at its images (the top
    rung's 4096 is more than quick mode trains on), a CPU trains bf16 rungs in its default precision, a GPU
    without bf16 tensor cores in fp16 with loss scaling."""
    if quick and device.type == "cpu" and cfg.batch_size > QUICK_CPU_BATCH:
        cfg = with_changes(cfg, batch_size=QUICK_CPU_BATCH)
    if quick and cfg.n_train is not None and cfg.batch_size > cfg.n_train:
        cfg = with_changes(cfg, batch_size=cfg.n_train)
    if device.type != "cuda":
        return with_changes(cfg, precision="default" if cfg.precision == "bf16" else cfg.precision)
    if cfg.precision == "bf16" and not native_bf16(device):
        return with_changes(cfg, precision="fp16")
    return cfg


def plan_ladder(device: torch.device, quick: bool, names: list[str] | None = None,
                base: TrainConfig | None = None) -> LadderPlan:
    """The rungs to run. On CPU the GPU-only rungs are skipped (and compile in quick mode, for its cold-start)."""
    for n in names or []:
        if n not in RUNG_NAMES:
            raise LabkitError(f"unknown rung {n!r}: choose from {', '.join(RUNG_NAMES)}")
    base = base or (quick_base() if quick else TrainConfig())
    plan = LadderPlan(base)
    for name in RUNG_NAMES:
        if names and name not in names:
            continue
        why = _skip_reason(name, device, quick)
        if why:
            plan.skipped.append((name, why))
            continue
        plan.rungs.append(fit_rung(preset(name, base), device, quick))
    if quick and device.type == "cpu" and any(preset(c.name, base).batch_size > c.batch_size for c in plan.rungs):
        plan.notes.append(QUICK_CPU_BATCH_NOTE)
    fp16 = [c.name for c in plan.rungs if c.precision == "fp16" and preset(c.name).precision == "bf16"]
    if fp16:
        major, minor = torch.cuda.get_device_capability(device)
        plan.notes.append(f"bf16 -> fp16: compute capability {major}.{minor} has no bf16 tensor cores (torch would "
                          f"emulate bf16, slower than fp32), so {', '.join(fp16)} run fp16 autocast with GradScaler "
                          "loss scaling instead")
    if not plan.rungs:
        why = "; ".join(f"{n}: {w}" for n, w in plan.skipped)
        raise LabkitError(f"no rung can run on this device with those names ({why}): see labkit ladder --list")
    return plan


def plan_ablation(device: torch.device, quick: bool, top: str | None = None, drop: list[str] | None = None,
                  base: TrainConfig | None = None) -> LadderPlan:
    """Leave-one-out from the top rung (`labkit.presets.ablation`): the baseline (its accuracy is the target),
    the top rung, then the top rung without each change. `top` defaults to the highest rung this device runs;
    a change that cannot run here, or that changes nothing here, is skipped with the reason."""
    ladder = plan_ladder(device, quick, None, base)
    fitted = {c.name: c for c in ladder.rungs}
    top = top or ladder.rungs[-1].name
    if top not in fitted:
        why = dict(ladder.skipped).get(top, f"unknown rung (choose from {', '.join(RUNG_NAMES)})")
        raise LabkitError(f"cannot ablate from {top!r} here: {why}")
    for n in drop or []:
        if n not in RUNG_NAMES[1:RUNG_NAMES.index(top) + 1]:
            raise LabkitError(f"--drop {n!r}: choose changes on the way to {top}: "
                              f"{', '.join(RUNG_NAMES[1:RUNG_NAMES.index(top) + 1])}")
    variants, skipped = ablation(top, ladder.base, drop)
    plan = LadderPlan(ladder.base, rungs=[fitted["baseline"], fitted[top]], skipped=skipped, notes=ladder.notes)
    for cfg in variants[1:]:
        why = _skip_reason(cfg.name.removeprefix("without_"), device, quick)
        cfg = fit_rung(cfg, device, quick)
        if with_changes(cfg, name=top) == fitted[top]:  # e.g. bf16 on a CPU, which trains it in fp32 anyway
            plan.skipped.append((cfg.name, f"no effect on {device.type}: {why or 'the same config as ' + top}"))
            continue
        plan.rungs.append(cfg)
    return plan


# ------------------------------------------------------------------------------------------------ CLI


# Runs per rung. Speed differs from run to run by several percent (other processes, clocks, the loader's
# workers), as much as some rungs change it; one number per rung cannot tell a gain from noise. Quick CPU mode
# runs each rung once, on quick_base()'s full 4,096 images: split over two runs (2,048 images, 64 steps each)
# the runs stopped before training left its first plateau, and rungs ended at chance. Its timing noise is
# judged by the machine-load check instead (labkit.bench.MachineLoad), and `--repeats 2` still gives a spread.
REPEATS = FULL_REPEATS
QUICK_REPEATS = 1


def ladder_order(names: list[str], round_index: int) -> list[str]:
    """The rungs in the order round `round_index` runs them: rotated by one each round, so that no rung always
    runs first (cold caches, a cool GPU) or right after the same neighbour."""
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


def merge_runs(runs: list[dict]) -> dict:
    """One rung's record from its repeated runs: the first run's record (config, losses, accuracy) with img/s
    replaced by the median over the runs, its spread (min and max, img/s) and every run under "runs"."""
    keep = ("img_per_s", "img_per_s_all", "first_step_s", "final_loss", "accuracy", "peak_mem_bytes", "epoch_s",
            "mfu", "mfu_datasheet", "accuracy_curve", "round", "position", "gpu_power", "machine_load")
    rec = {k: v for k, v in runs[0].items() if k not in ("round", "position")}
    ips = [r["img_per_s"] for r in runs]
    rec.update(img_per_s=float(np.median(ips)), img_per_s_min=min(ips), img_per_s_max=max(ips), repeats=len(runs),
               img_per_s_all=float(np.median([r["img_per_s_all"] for r in runs])),
               runs=[{k: r.get(k) for k in keep} for r in runs])
    if rec.get("flops_per_image"):
        rec["achieved_tflops"] = rec["flops_per_image"] * rec["img_per_s"] / 1e12
    for k in ("mfu", "mfu_datasheet"):
        if runs[0].get(k):
            rec[k] = float(np.median([r[k] for r in runs]))
    return rec


def run_ladder(device=None, quick: bool = False, names: list[str] | None = None, epochs: int | None = None,
               data: str = "synthetic", out: str | os.PathLike | None = None, base: TrainConfig | None = None,
               show_progress: bool = True, log=print, repeats: int | None = None, ablation: bool = False,
               top: str | None = None, drop: list[str] | None = None) -> dict:
    """Run the ladder's rungs on one device, each `repeats` times (default REPEATS; quick: QUICK_REPEATS) in
    interleaved rounds (`ladder_order`); returns {"rungs": [...], "skipped": [...], ...}.

    Each rung's record is `merge_runs` of its runs: img/s is the median, with its min-max spread and every run.
    With `out` (a folder, checked writable before any work), ladder.json, ladder.md and ladder.png are written
    there after every run, so an interrupt or a crash keeps the rungs that finished a run; "complete" in the
    JSON says whether every planned run finished, "stopped" why not. Progress: a bar per run in a terminal, else a
    line per run with the time spent and left (`labkit.progress`); `show_progress=False` prints only the results.
    "wall_s" is the whole run's time in seconds, data preparation included.

    Every run evaluates after each epoch, so each record has an accuracy curve and the table the time to the
    baseline's accuracy ("target_accuracy"); MFU is against the measured peak and, for a card in
    `labkit.waves.DATASHEETS`, its datasheet peak ("datasheet_tflops"). `ablation=True` runs `plan_ablation`
    (baseline, `top`, then `top` without each change in `drop`) instead of the rungs, into ablation.json/.md/.png.
    """
    t0 = time.perf_counter()
    dev = pick_device(device)
    repeats = (QUICK_REPEATS if quick else REPEATS) if repeats is None else repeats
    plan = ladder_plan(dev, quick, names, epochs, data, base, repeats, ablation, top, drop)
    base = plan.base
    plan.rungs = [with_changes(c, eval_every_epoch=c.evaluate) for c in plan.rungs]  # time to target accuracy
    for cfg in plan.rungs:
        check_config(cfg, dev)
    out = None if out is None else check_writable(out, "dir", "--out")
    if dev.type == "cuda":
        for group in cudnn_shared_shapes(plan.rungs):
            plan.notes.append(f"{', '.join(group)} run the same convolution shapes, with and without cudnn_benchmark: "
                              "in one process they share cuDNN's first pick per shape, so these runs cannot show "
                              "what autotuning is worth (benchmarks/cold_start.py measures in fresh processes)")
    env = environment(device=dev)
    _log_plan(plan, env, base, data, quick, repeats, "ablation" if ablation else "ladder", log)
    ds = D.load(data, base.n_train, base.n_test)
    peak, peak_format = _mfu_peak(dev)
    sheet = datasheet_peak(env["device_name"], peak_format) if peak_format else None
    if peak:
        log(f"  measured {peak_format} matmul peak: {peak:.0f} TFLOP/s (MFU denominator)"
            + (f"; datasheet {sheet:.0f} TFLOP/s" if sheet else ""))
    result = {"kind": "ablation" if ablation else "ladder", "env": env, "datasheet_tflops": sheet,
              "target_accuracy": None, "peak_bf16_tflops": peak if peak_format == "bf16" else None,
              "peak_tflops": peak, "peak_format": peak_format, "quick": quick, "repeats": repeats,
              "order": "interleaved: every rung once per round, the order rotated by one rung each round",
              "mode": _mode_note(base, quick), "planned": [c.name for c in plan.rungs],
              "skipped": [{"rung": n, "why": w} for n, w in plan.skipped], "notes": plan.notes,
              "columns": report.LADDER_COLUMNS, "complete": False, "stopped": None, "rungs": []}
    by_name = {c.name: c for c in plan.rungs}
    runs: dict[str, list[dict]] = {c.name: [] for c in plan.rungs}
    meter = MachineLoad()
    stages = Stages(len(plan.rungs) * repeats, "ladder", log=log, mode="auto" if show_progress else "off")
    try:
        for r in range(repeats):
            for i, name in enumerate(ladder_order(list(by_name), r)):
                rec = _ladder_rung(by_name[name], dev, ds, (peak, sheet), stages, log, run=(r, repeats))
                runs[name].append({**rec, "round": r, "position": i})
                result["rungs"] = [merge_runs(v) for v in runs.values() if v]
                result["target_accuracy"] = _target_accuracy(runs.get("baseline", []))
                result["accuracy_band"], result["accuracy_notes"] = accuracy_band(result["rungs"])
                result["machine_load"] = meter.stop()
                result["timings_trustworthy"] = result["machine_load"]["trustworthy"]
                if out is not None:
                    _save_ladder(out, result)
        result["complete"] = True
    except BaseException as e:
        result["stopped"] = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        if out is not None and result["rungs"]:
            _save_ladder(out, result)
            log(f"stopped ({result['stopped']}): the {len(result['rungs'])} rung(s) with a finished run are saved "
                f"in {out}")
        raise
    result["wall_s"] = time.perf_counter() - t0
    log("\n" + ladder_markdown(result))
    if out is not None:
        _save_ladder(out, result)
        log(f"wrote {out}/{result['kind']}.json, .md, .png")
    log(f"ladder finished in {fmt_duration(result['wall_s'])}")
    return result


def ablation_from(result: dict, device=None, top: str | None = None, drop: list[str] | None = None,
                  log=print) -> dict:
    """A leave-one-out ablation built on a finished `run_ladder` result: a variant whose config equals a rung
    the ladder ran (leaving out the top rung's own change gives the rung below it) reuses that rung's runs
    under its new name; only the others are trained, once each. Returns {"rungs", "skipped", "target_accuracy",
    "reused"}: the records in `plan_ablation`'s order, for `labkit.report.ablation_table`."""
    dev = pick_device(device)
    ran = {r["name"]: r for r in result["rungs"]}
    if "baseline" not in ran:
        raise LabkitError("ablation_from needs a ladder result with the baseline rung (its accuracy is the target)")
    base = TrainConfig(**{**ran["baseline"]["config"], "name": "custom", "eval_every_epoch": False})
    plan = plan_ablation(dev, result.get("quick", False), top or result["rungs"][-1]["name"], drop, base)
    bare = lambda c: {**c, "name": None, "eval_every_epoch": None}  # noqa: E731  (same training, another label)
    ds = None
    rungs, reused = [], []
    for cfg in plan.rungs:
        cfg = with_changes(cfg, eval_every_epoch=cfg.evaluate)
        same = next((r for r in result["rungs"] if bare(r["config"]) == bare(dataclasses.asdict(cfg))), None)
        if same is not None:
            rungs.append({**same, "name": cfg.name})
            reused += [f"{cfg.name} = {same['name']}"] if same["name"] != cfg.name else []
            continue
        ds = ds or D.load(cfg.data, cfg.n_train, cfg.n_test)
        rec = train(cfg, dev, dataset=ds)
        log(f"  {cfg.name:<24} {rec['img_per_s']:>10,.0f} img/s")
        rungs.append(rec)
    target = _target_accuracy(ran["baseline"].get("runs") or [ran["baseline"]])
    return {"rungs": rungs, "skipped": plan.skipped, "target_accuracy": target, "reused": reused}


def ladder_plan(dev: torch.device, quick: bool, names: list[str] | None = None, epochs: int | None = None,
                data: str = "synthetic", base: TrainConfig | None = None, repeats: int | None = None,
                ablation: bool = False, top: str | None = None, drop: list[str] | None = None) -> LadderPlan:
    """What `run_ladder` (or its ablation) runs with these arguments, before anything loads or trains."""
    repeats = (QUICK_REPEATS if quick else REPEATS) if repeats is None else repeats
    if repeats < 1:
        raise LabkitError(f"repeats must be at least 1, not {repeats}")
    if base is None and quick:
        base = quick_base()  # every run on all of its images: fewer steps stop before the rungs learn
    base = with_changes(base or TrainConfig(), data=data, **({"epochs": epochs} if epochs else {}))
    return plan_ablation(dev, quick, top, drop, base) if ablation else plan_ladder(dev, quick, names, base)


def _log_plan(plan: LadderPlan, env: dict, base: TrainConfig, data: str, quick: bool, repeats: int, what: str,
              log) -> None:
    log(f"{what} on {env['device_name']}: {len(plan.rungs)} rungs x {repeats} run{'s' if repeats > 1 else ''}"
        + (" (interleaved rounds), " if repeats > 1 else ", ") +
        f"{base.epochs} epochs each, ResNet-18 width {base.width}, {data} data" + (" (quick mode)" if quick else ""))
    if quick and repeats == QUICK_REPEATS:
        log(f"  quick mode runs each rung {QUICK_REPEATS} time{'s' if QUICK_REPEATS > 1 else ''} (not {REPEATS}) "
            f"on {base.n_train} images, so the demo takes minutes; whether other programs shared the cores is "
            "checked and said under the table (--repeats 2 adds a spread)")
    for name, why in plan.skipped:
        log(f"  skipped {name}: {why}")
    for note in plan.notes:
        log(f"  {note}")


def cudnn_shared_shapes(rungs: list[TrainConfig]) -> list[list[str]]:
    """Groups of rungs that run the same convolution shapes, some with cuDNN autotuning and some without.

    PyTorch keeps the cuDNN algorithm it first picks for a shape (timed or from cuDNN's heuristics) for the rest of
    the process and looks there first whatever `cudnn.benchmark` says, so inside one process such rungs run the
    same convolutions: the difference autotuning makes can only be measured in fresh processes.
    """
    groups: dict[tuple, list[TrainConfig]] = {}
    for c in rungs:
        key = (c.batch_size // c.accumulation, c.width, c.channels_last, c.precision)
        groups.setdefault(key, []).append(c)
    return [[c.name for c in g] for g in groups.values() if len({c.cudnn_benchmark for c in g}) == 2]


def _target_accuracy(baseline_runs: list[dict]) -> float | None:
    """The accuracy every rung's time-to-target aims at (`report.target_accuracy`): the lowest final test accuracy
    among the baseline's runs."""
    accs = [r["accuracy"] for r in baseline_runs if r.get("accuracy") is not None]
    return float(min(accs)) if accs else None


def accuracy_band(rungs: list[dict]) -> tuple[dict | None, list[str]]:
    """(the baseline's accuracy band, one line per rung that ended below it and why), from merged rung records.

    The band is the baseline's runs' lowest to highest test accuracy, widened by two standard errors of an
    accuracy measured on the test set's n images (sqrt(p(1 - p) / n), p the baseline's mean): a rung inside it
    learned as well as the baseline as far as this test set can tell. (None, []) without a baseline run."""
    base = next((r for r in rungs if r["name"] == "baseline"), None)
    accs = [x["accuracy"] for x in (base.get("runs") or [base])] if base else []
    accs = [a for a in accs if a is not None]
    if not accs:
        return None, []
    n_test = (base.get("config") or {}).get("n_test") or 10_000
    p = sum(accs) / len(accs)
    tol = 2 * math.sqrt(p * (1 - p) / n_test)
    band = {"low": max(0.0, min(accs) - tol), "high": min(1.0, max(accs) + tol), "tolerance": tol,
            "baseline": accs, "n_test": n_test}
    notes = []
    for r in rungs:
        if r["name"] == "baseline" or r.get("accuracy") is None:
            continue
        acc = float(np.median([x["accuracy"] for x in (r.get("runs") or [r]) if x.get("accuracy") is not None]))
        if acc >= band["low"]:
            continue
        cfg = r.get("config") or {}
        why = (f"its batch of {cfg.get('batch_size')} takes {r['steps']} optimizer steps in "
               f"{cfg.get('epochs')} epochs against the baseline's {base['steps']}, too few to catch up"
               if r.get("steps") and base.get("steps") and r["steps"] < base["steps"] else
               "the same steps as the baseline: this change costs accuracy here, or the runs vary more than "
               "the test set's sampling error")
        notes.append(f"{r['name']} ended at {100 * acc:.1f}% test accuracy, below the baseline's band "
                     f"({100 * band['low']:.1f}-{100 * band['high']:.1f}%): {why}")
    return band, notes


def ladder_markdown(result: dict) -> str:
    """`report.ladder_markdown`, with two things right under the table: whether the timings can be trusted (the
    machine-load check) and the rungs whose accuracy ended below the baseline's band, with why."""
    lines = report.ladder_markdown(result).split("\n")
    extra = []
    load = result.get("machine_load")
    if load:
        extra.append(("**Timings not trustworthy**: " if load["trustworthy"] is False else "Machine load: ")
                     + load["why"] + ("; run it again on an idle machine" if load["trustworthy"] is False else
                                      ": the timings are this run's own" if load["trustworthy"] else "") + ".")
    band = result.get("accuracy_band")
    if band:
        extra.append(f"Accuracy band of the baseline: {100 * band['low']:.1f}-{100 * band['high']:.1f}% (its runs "
                     f"± 2 standard errors on {band['n_test']} test images)"
                     + (": every rung ended inside it or above." if not result.get("accuracy_notes") else "."))
    extra += [f"- below the band: {n}" for n in result.get("accuracy_notes", [])]
    last = max((i for i, line in enumerate(lines) if line.startswith("|")), default=len(lines) - 1)
    return "\n".join(lines[:last + 1] + ["", *extra] + lines[last + 1:]) if extra else "\n".join(lines)


def quick_ladder_summary(result: dict) -> str:
    """The README's sentence on a recorded quick CPU ladder (benchmarks/results/ladder/ladder_quick_cpu.json): each
    rung's steady img/s over the baseline's, its accuracy, and the machine-load verdict."""
    rows = report.ladder_rows(result["rungs"])
    base = rows[0]
    parts = [f"{r['rung']} {r['speedup']:.2f}x ({100 * r['accuracy']:.1f}%)" for r in rows[1:]]
    load = result.get("machine_load") or {}
    trust = {True: "on idle cores", False: f"while other programs took {load.get('other_cores') or 0:.1f} of its "
                                           f"{load.get('cores')} cores, so the timings are not trustworthy",
             None: "machine load unknown"}[load.get("trustworthy")]
    return (f"the baseline {base['img_per_s']:,.0f} img/s ({100 * base['accuracy']:.1f}% test accuracy), then "
            + ", ".join(parts) + f"; the whole ladder took {fmt_duration(result['wall_s'])} {trust}")


def _mfu_peak(dev: torch.device) -> tuple[float | None, str | None]:
    """(TFLOP/s, format) of the MFU denominator: the dense matmul peak in the 16-bit format the ladder trains in
    here, measured now; (None, None) off CUDA."""
    if dev.type != "cuda":
        return None, None
    fmt = "bf16" if native_bf16(dev) else "fp16"
    return peak_matmul_tflops(dev, torch.bfloat16 if fmt == "bf16" else torch.float16), fmt


def _mode_note(base: TrainConfig, quick: bool) -> str:
    size = (f"ResNet-18 width {base.width}, {base.n_train or 'all'} training images, {base.epochs} epochs per rung, "
            f"{base.data} data")
    if not quick:
        return f"full: {size}"
    return (f"quick (CPU demo size): {size}, batch {QUICK_CPU_BATCH}; it shows the method on a CPU, not GPU speeds "
            "(the recorded H100 ladder: docs/results/ladder.md)")


def _ladder_rung(cfg: TrainConfig, dev: torch.device, ds: D.ImageData, peaks: tuple[float | None, float | None],
                 stages: Stages, log, run: tuple[int, int] = (0, 1)) -> dict:
    """Train one rung (run `run[0]` of `run[1]`) under a progress stage and log its result line; the record.
    `peaks`: (measured, datasheet) TFLOP/s, the two MFU denominators (None where unknown)."""
    peak, sheet = peaks
    n_steps = (min(len(ds.y_train), cfg.n_train or len(ds.y_train)) // cfg.batch_size) * cfg.epochs
    label = cfg.name if run[1] == 1 else f"{cfg.name} (run {run[0] + 1}/{run[1]})"
    meter = MachineLoad()
    with stages.stage(label, n_steps) as bar:
        rec = train(cfg, dev, dataset=ds, peak_tflops=peak, progress=bar)
    rec["machine_load"] = meter.stop()
    if cfg.compile:
        _release_compiled(dev)
    rec["mfu_datasheet"] = rec["achieved_tflops"] / sheet if sheet else None
    acc = "-" if rec["accuracy"] is None else f"{100 * rec['accuracy']:.1f}%"
    power = GP.describe(rec.get("gpu_power"))
    busy = rec["machine_load"]["other_cores"] if rec["machine_load"]["trustworthy"] is False else None
    log(f"  {label:<24} {rec['img_per_s']:>10,.0f} img/s  loss {rec['final_loss']:.3f}  acc {acc}"
        + (f"  ({power})" if power else "")
        + (f"  (other programs took {busy:.1f} of {rec['machine_load']['cores']} cores: timing not trustworthy)"
           if busy is not None else ""))
    return rec


def _release_compiled(dev: torch.device) -> None:
    """Drop the compiled graphs and their CUDA-graph memory pools after a compiled run. Each such run keeps a
    private pool about its own peak, so an ablation's eight CUDA-graph runs in one process fill an 80 GB card;
    the compile cache on disk stays, so the next run of the same graph reads it instead of compiling cold."""
    if dev.type != "cuda":
        return
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def _save_ladder(out: Path, result: dict) -> None:
    """(Re)write ladder.json, ladder.md and ladder.png (ablation.*: an ablation) in `out` from the rungs finished
    so far."""
    kind = result["kind"]
    write_json(out / f"{kind}.json", result)
    write_text(out / f"{kind}.md", ladder_markdown(result) + "\n")
    title = f"ResNet-18 {kind} on {result['env']['device_name']}" + (" (quick mode)" if result["quick"] else "")
    report.ladder_chart(result["rungs"], out / f"{kind}.png", title=title, note=report.ladder_chart_note(result))


def parse_sets(pairs: list[str]) -> dict:
    """TrainConfig changes from FIELD=VALUE strings, each value converted to the field's type; clear errors."""
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    out = {}
    for p in pairs:
        if "=" not in p:
            raise LabkitError(f"--set takes field=value, got {p!r}")
        k, v = p.split("=", 1)
        if k not in types:
            raise LabkitError(f"unknown TrainConfig field {k!r}: choose from {', '.join(types)}")
        t = str(types[k])
        if v.lower() in ("none", "null"):
            out[k] = None
        elif "bool" in t:
            if v.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise LabkitError(f"{k} takes true or false, got {v!r}")
            out[k] = v.lower() in ("1", "true", "yes", "on")
        elif "int" in t and "str" not in t:
            try:
                out[k] = int(v)
            except ValueError as e:
                raise LabkitError(f"{k} takes a whole number, got {v!r}") from e
        elif "float" in t:
            try:
                out[k] = float(v)
            except ValueError as e:
                raise LabkitError(f"{k} takes a number, got {v!r}") from e
        else:
            out[k] = v
    return out


def parse_variant(text: str, check=None) -> tuple[str, list[str]]:
    """A labelled set of changes, "LABEL:FIELD=VALUE[,FIELD=VALUE]", as (label, ["FIELD=VALUE", ...]).

    `check(pairs)` validates the changes (default `parse_sets`: TrainConfig fields); a typo fails here, before any
    run starts."""
    label, sep, changes = text.partition(":")
    if not sep or not label.strip() or not changes:
        raise LabkitError(f"variant {text!r}: write LABEL:FIELD=VALUE[,FIELD=VALUE]")
    pairs = changes.split(",")
    (check or parse_sets)(pairs)
    return label.strip(), pairs


def add_cli(sub) -> None:
    p = sub.add_parser("ladder", help="run the ResNet-18 optimization ladder and write a table, JSON and chart")
    p.add_argument("--quick", action="store_true", help="small run (width-16 model, 4k images); the default on CPU")
    p.add_argument("--full", action="store_true", help="full size even on CPU (slow)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--rungs", help="comma-separated rung names to run (default: all that fit the device)")
    p.add_argument("--epochs", type=int, help="epochs per rung (default 5; quick: 3)")
    p.add_argument("--repeats", type=int,
                   help=f"runs per rung, in interleaved rounds (default {REPEATS}; quick: {QUICK_REPEATS})")
    p.add_argument("--data", default="synthetic", choices=["synthetic", "digits", "cifar10"], help="dataset")
    p.add_argument("--out", default="runs/ladder",
                   help="folder for ladder.json, ladder.md, ladder.png, rewritten after each rung (default runs/ladder)")
    p.add_argument("--json", metavar="PATH",
                   help="also write the result (ladder.json's content) to this file, e.g. a record under "
                        "benchmarks/results/ladder/")
    p.add_argument("--list", action="store_true", help="list the rungs and what each changes, then exit")
    p.add_argument("--ablation", action="store_true",
                   help="leave-one-out from the top rung instead: baseline, top, then top without each change "
                        "(writes ablation.json, .md, .png)")
    p.add_argument("--top", help="the rung to ablate from (default: the highest this device runs)")
    p.add_argument("--drop", help="comma-separated changes to leave out one at a time (default: every one)")
    faststart.add_flag(p)
    p.set_defaults(func=_cli_ladder)

    t = sub.add_parser("train", help="train ResNet-18 with one ladder preset (and overrides)",
                       epilog="A compiled preset trains eager until its compiled forward is loaded (or, on a GPU "
                              "with none saved, compiled beside the run), then switches to it "
                              "(labkit.faststart.tiered); "
                              "LABKIT_TIERED=0 waits for it before the first step instead.")
    t.add_argument("--preset", default="baseline", help=f"ladder rung: {', '.join(RUNG_NAMES)}")
    t.add_argument("--quick", action="store_true", help="small CPU-sized run")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_set_argument(t)
    t.add_argument("--json", metavar="PATH", help="write the result record here")
    faststart.add_flag(t)
    t.set_defaults(func=_cli_train)


def _cli_ladder(args) -> int:
    if args.list:
        for name, what, _ in LADDER:
            print(f"{name:<16} {what}")
        return 0
    dev = pick_device(args.device)
    quick = args.quick or (dev.type == "cpu" and not args.full)
    if args.epochs is not None and args.epochs < 1:
        raise LabkitError("--epochs must be >= 1")
    names = [n.strip() for n in args.rungs.split(",") if n.strip()] if args.rungs else None
    drop = [n.strip() for n in args.drop.split(",") if n.strip()] if args.drop else None
    if (args.top or drop) and not args.ablation:
        raise LabkitError("--top and --drop go with --ablation")
    if args.ablation and names:
        raise LabkitError("--rungs and --ablation do not mix: --ablation picks its runs (use --drop)")
    if args.repeats is not None and args.repeats < 1:
        raise LabkitError("--repeats must be >= 1")
    # a bad --top or --drop fails here, before anything loads
    plan = ladder_plan(dev, quick, names, args.epochs, args.data, None, args.repeats, args.ablation, args.top, drop)
    faststart.load_artifact(args, dev, [graph_key(c) for c in plan.rungs if c.compile])
    result = run_ladder(dev, quick=quick, names=names, epochs=args.epochs, data=args.data, out=args.out,
                        repeats=args.repeats, ablation=args.ablation, top=args.top, drop=drop)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _cli_train(args) -> int:
    t0 = time.perf_counter()
    dev = pick_device(args.device)
    rung = preset(args.preset, quick_base() if args.quick else TrainConfig())
    fitted = fit_rung(rung, dev, args.quick)  # the rung as the ladder runs it here; --set still overrides
    if fitted.batch_size != rung.batch_size and dev.type == "cpu":
        print(f"{rung.name}: batch {rung.batch_size} -> {fitted.batch_size}, as the ladder runs it here: "
              + QUICK_CPU_BATCH_NOTE.split(": ", 1)[1])
    if fitted.precision != rung.precision:
        print(f"{rung.name}: {rung.precision} -> {fitted.precision}, as the ladder runs it here: "
              + ("this GPU has no bf16 tensor cores (fp16 autocast with GradScaler loss scaling instead)"
                 if dev.type == "cuda" else "a CPU trains bf16 rungs in its default precision"))
    cfg = with_changes(fitted, **parse_sets(args.set))
    check_config(cfg, dev)
    # the cold start (labkit.faststart): cuDNN warm-up, then the saved forward, the tiered start or the artifact
    cold = faststart.start(cfg, dev, graph_key(cfg), args, world_size=world()[1])
    cfg = cold.cfg
    try:
        t_train = time.perf_counter()
        rec = train(cfg, dev, **cold.train_args())
    finally:
        tier_report = cold.close()
    rec["tiered"] = tier_report
    rec["stages_s"] = {"process_before_command": process_age_s(t0), "device_and_config": cold.loading_began - t0,
                       "compile_cache_load": t_train - cold.loading_began, **rec.get("stages_s", {})}
    power = GP.describe(rec.get("gpu_power"))
    print(f"{cfg.name}: {rec['img_per_s']:,.0f} img/s, final loss {rec['final_loss']:.3f}, "
          f"accuracy {rec['accuracy']}" + (f" (steady epochs at {power})" if power else ""))
    if args.json:
        write_json(args.json, {"kind": "train", "env": environment(device=dev), "compile_cache": cold.compile_cache,
                               **rec})
    return 0

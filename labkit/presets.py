"""What a training run is: `TrainConfig`, and the ladder of presets built from it.

Every optimization the course teaches is a field of `TrainConfig`. `LADDER` lists the rungs, each adding one
idea to the rung before it (one setting, or several: batch_fused, muon); `preset(name)` is the config of a rung,
`quick_base()` the CPU demo size.
`labkit.train` runs them; `labkit.report` reads result records against them. Nothing here runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.env import LabkitError, gpu_facts, native_bf16, replace_fields

PRECISIONS = ("fp32", "default", "tf32", "fp16", "bf16")
LOADERS = ("pil", "tensor", "resident")
OPTIMIZERS = ("sgd", "sgd-foreach", "sgd-fused", "adamw-fused", "muon")
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the compile modes that replay CUDA graphs
AUTOCAST = {"fp16": "float16", "bf16": "bfloat16"}  # precisions that train under autocast, and its torch dtype
TF32 = {"fp32": False, "tf32": True}  # precisions that set TF32 (matmul and cuDNN); the others keep torch's defaults


@dataclass
class TrainConfig:
    name: str = "custom"                 # label in tables and result files
    data: str = "synthetic"              # dataset: synthetic | digits | cifar10
    n_train: int | None = None           # training images (None: the dataset's full train split)
    n_test: int | None = None            # test images (None: full test split)
    width: int = 64                      # ResNet-18 base width; 64 is the real model, smaller only for CPU demos
    epochs: int = 5                      # passes over the training set
    batch_size: int = 128                # images per optimizer step
    lr: float = 0.1                      # peak learning rate at batch 128; scaled to the batch by lr_scaling
    lr_scaling: str = "sqrt"             # peak lr = lr x sqrt(batch/128) | linear: lr x batch/128 (the large-batch rule of Goyal et al.)
    momentum: float = 0.9                # SGD Nesterov momentum (AdamW: beta1; Muon: its momentum and AdamW's beta1)
    weight_decay: float = 5e-4           # L2 on the weights (AdamW: decoupled), on BatchNorm and biases too while bn_weight_decay
    bn_weight_decay: bool = True         # False: no weight decay on BatchNorm scales/shifts and biases, only on conv/linear weights
    zero_init_residual: bool = False     # each residual block starts as the identity (its last BatchNorm scale at 0)
    label_smoothing: float = 0.1         # cross-entropy label smoothing
    warmup_frac: float = 0.2             # share of steps with linearly rising LR, then linear decay to 0
    precision: str = "default"           # fp32 (strict, TF32 off) | default (torch defaults: cuDNN TF32 on) | tf32 | fp16 (autocast + GradScaler) | bf16 (autocast)
    channels_last: bool = False          # NHWC memory format: tensor-core convolutions without transposes
    optimizer: str = "sgd"               # sgd (per-parameter loop) | sgd-foreach | sgd-fused (one kernel) | adamw-fused | muon (conv filters; AdamW for the rest)
    loader: str = "pil"                  # pil: PNG files + PIL transforms in a DataLoader | tensor: packed uint8 in host memory, batched aug on CPU | resident: uint8 on the training device, batched aug there
    workers: int = 2                     # DataLoader worker processes (pil loader); -1: one per CPU core, at most 16
    pin_memory: bool = False             # page-locked host batches for asynchronous copies to the GPU
    persistent_workers: bool = False     # keep workers alive between epochs (no restart cost)
    prefetch_factor: int | None = None   # batches each worker prepares ahead (None: torch default of 2)
    augment: bool = True                 # random crop (pad 4) + horizontal flip
    sync_every_step: bool = True         # read loss.item() every step like a naive script (forces a host sync)
    cudnn_benchmark: bool = False        # let cuDNN time its algorithms for each shape and keep the fastest
    cudnn_limit: int = 10                # with cudnn_benchmark: how many of cuDNN's candidate algorithms it times per shape (PyTorch's default 10; 0: all). Fewer: a shorter first step
    cudnn_warmup: bool | None = None     # with cudnn_benchmark on CUDA: time the backward convolutions' algorithms in a thread while the data and model load. None: where `labkit train` starts tiered (whole run shorter there: cold_start_tiered_final.json)
    matmul_edges: bool = False           # with compile: the stem's convolution (3 input channels) and the 1x1 stride-2 shortcuts as matrix products (labkit.models.MatmulConv2d), shapes cuDNN runs far below its rate. 1.03x at steady speed, but its saved forward loads later, so a 5-epoch run is slower: not in the ladder (docs/results/top_rung.md)
    compile: str | None = None           # torch.compile mode: None | default | max-autotune-no-cudagraphs | reduce-overhead | max-autotune (the last two replay CUDA graphs)
    accumulation: int = 1                # micro-batches per optimizer step (batch_size is split among them)
    checkpointing: bool = False          # recompute each stage's activations in backward to save memory
    compile_tuning: bool = False         # inductor coordinate-descent tuning of its Triton kernels: runs a few % faster, tunes for minutes in every run (the compile-cache artifact does not keep it), never from a saved forward
    compile_autotune: bool = True        # inductor times launch configs of its pointwise kernels at the first step (seconds of a cold start); False: its heuristic pick
    compile_combo: bool = False          # inductor combines independent kernels into combo kernels: fewer kernels to compile and launch
    ddp_bucket_mb: int = 25              # DDP gradient bucket (MiB): small buckets overlap all-reduce with backward, large ones mean fewer calls and (compiled) fewer graph splits
    ddp_split_graphs: bool = False       # under DDP, split torch.compile's graph at the buckets so all-reduce overlaps backward (more graphs, more host work); False: one graph, all-reduce after it
    ddp_bf16_grads: bool = False         # DDP all-reduces gradients in bf16 (a comm hook): half the bytes, each gradient rounded to bf16 before the mean
    ddp_static_graph: bool = True        # DDP static_graph + gradient_as_bucket_view: the same graph every step, so no per-step bookkeeping and no copy into buckets
    ddp_broadcast_buffers: bool = False  # True: DDP broadcasts rank 0's BatchNorm running statistics before every forward. Training uses batch statistics, so rank 0 (which evaluates) trains the same; False saves a collective per step
    seed: int = 0                        # model init, data order and augmentation
    max_steps: int | None = None         # stop after this many optimizer steps (tests, profiling)
    evaluate: bool = True                # compute test accuracy after training
    eval_every_epoch: bool = False       # test accuracy after every epoch too (time to a target accuracy); its time is not counted
    data_dir: str | None = None          # an existing image folder (<class>/<file>) for the pil loader; None: written from `data` into the cache


def with_changes(cfg: TrainConfig, **changes) -> TrainConfig:
    """A copy of `cfg` with fields replaced; unknown field names raise a clear error."""
    return replace_fields(cfg, **changes)


# ------------------------------------------------------------------------------------------------ ladder

# Each rung: (name, what it changes, the fields it changes). Rungs are cumulative; a rung that changes several
# fields measures them together.
LADDER = [
    ("baseline", "naive script: torch defaults (cuDNN TF32), PNG files + PIL transforms, batch 128, 2 workers, "
                 ".item() every step", {}),
    ("no_sync", "keep losses on the device: no .item() host sync inside the step", dict(sync_every_step=False)),
    ("loader", "tuned DataLoader: a worker per core, pinned memory, persistent workers, prefetch 4",
     dict(workers=-1, pin_memory=True, persistent_workers=True, prefetch_factor=4)),
    ("resident_data", "uint8 data resident on the GPU; crop, flip and normalize there in one batched gather",
     dict(loader="resident")),
    ("bf16", "mixed precision: bf16 autocast", dict(precision="bf16")),
    ("channels_last", "channels_last (NHWC) memory format for model and inputs", dict(channels_last=True)),
    ("batch_fused", "batch 512 (learning rate 0.14) with a fused SGD kernel",
     dict(batch_size=512, lr=0.07, optimizer="sgd-fused")),
    ("cudnn_benchmark", "cudnn.benchmark: cuDNN picks the fastest algorithm per shape", dict(cudnn_benchmark=True)),
    ("compile", "torch.compile: fused elementwise work (BN, ReLU, adds) and fewer kernels", dict(compile="default")),
    ("cuda_graphs", "CUDA graphs (torch.compile mode='reduce-overhead'): no per-kernel launch cost",
     dict(compile="reduce-overhead")),
    # SGD and AdamW at batch 2048+ lose 3-13 points in 5 epochs (too few steps); Muon's steps each count for more
    ("muon", "batch 4096 with Muon on the conv filters (AdamW for the rest): an eighth of the steps, each worth more",
     dict(batch_size=4096, optimizer="muon", lr=4e-3, weight_decay=0.05, zero_init_residual=True,
          bn_weight_decay=False)),
]
RUNG_NAMES = [r[0] for r in LADDER]


def add_set_argument(parser, help: str = "override TrainConfig fields") -> None:
    """A command's --set FIELD=VALUE ... (values parsed by `labkit.train.parse_sets`). Repeatable: each --set adds
    to the ones before it, where argparse's default would let the last silently replace the others."""
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="FIELD=VALUE", help=help)


def preset(name: str, base: TrainConfig | None = None) -> TrainConfig:
    """The config of ladder rung `name` (all changes up to and including it), on top of `base`."""
    if name not in RUNG_NAMES:
        raise LabkitError(f"unknown preset {name!r}: choose one of {', '.join(RUNG_NAMES)}")
    cfg = base or TrainConfig()
    for rung, _, changes in LADDER:
        cfg = with_changes(cfg, **changes)
        if rung == name:
            return with_changes(cfg, name=name)
    raise AssertionError("unreachable")


def quick_base() -> TrainConfig:
    """CPU demo size: width-16 ResNet-18, 4,096 training images, 3 epochs, batch 64 (batch rung: 256).

    192 steps, because fewer sit on a knife edge: the loss stays near ln 10 for the first 30-odd steps, and at
    128 steps (2 epochs) whether a run left that plateau in time hung on the seed (seed 0: the baseline ended at
    30%, resident_data at 20%, where seeds 1-3 reached 69-76%). At 192 every quick rung reached 75-81% with
    seed 0. `labkit ladder --quick` trains every rung on all of these images, once.
    """
    return TrainConfig(width=16, n_train=4096, n_test=512, epochs=3, batch_size=64)


# ------------------------------------------------------------------------------------------------ live ladder

LIVE_SIZES = ("auto", "full", "short")
FULL_SIZE_SMS = 100  # the full live ladder is sized for A100/H100-class cards: bf16 tensor cores and 100+ SMs
# Short keeps every image (the large-batch rungs still take 12+ steps an epoch) and cuts epochs: the second epoch
# is still a whole steady-state epoch to time, and each rung still has two runs for a spread.
SHORT_EPOCHS, SHORT_REPEATS, FULL_REPEATS = 2, 2, 3
QUICK_RUNGS = ["baseline", "resident_data", "channels_last"]  # the rungs that mean something on a 2-core CPU


def live_ladder_size(device=None, quick: bool = False, size: str = "auto"
                     ) -> tuple[TrainConfig | None, list[str] | None, int, str]:
    """How big a ladder a notebook runs live on `device`: (base config or None for the full size, rung names or
    None for all, runs per rung, a line saying what was chosen and why).

    "full": every rung 3 times for 5 epochs (about a quarter of an hour on an H100); "short": 2 times for 2
    epochs, 4/15 of the images trained; "auto": full on a card with bf16 tensor cores and at least FULL_SIZE_SMS
    SMs, short on any other GPU (a T4 has 40 SMs and fp16 only). Quick mode (a CPU) always runs the quick
    ladder: 3 rungs, 2 runs of 512 images, 2 epochs.
    """
    if size not in LIVE_SIZES:
        raise LabkitError(f"live ladder size {size!r}: choose one of {', '.join(LIVE_SIZES)}")
    if quick:
        base = with_changes(quick_base(), n_train=512, epochs=2)  # two runs of 512 images: one of 1024's time
        return base, QUICK_RUNGS, SHORT_REPEATS, (f"quick mode: rungs {', '.join(QUICK_RUNGS)}, {SHORT_REPEATS} "
                                                 f"runs each on 512 images")
    facts = gpu_facts(device)
    card = f"{facts.name}, {facts.multiprocessors} SMs" if facts else "no GPU"
    if size != "auto":
        why = f"LIVE_SIZE = {size!r}"
    elif facts is None:
        size, why = "full", "full size asked for on a CPU"
    elif native_bf16(device) and facts.multiprocessors >= FULL_SIZE_SMS:
        size, why = "full", f"bf16 tensor cores and {FULL_SIZE_SMS}+ SMs"
    else:
        size, why = "short", f"fewer than {FULL_SIZE_SMS} SMs or no bf16 tensor cores"
    full = TrainConfig()
    if size == "full":
        return None, None, FULL_REPEATS, (f"live ladder: full size, every rung {FULL_REPEATS} times for "
                                          f"{full.epochs} epochs ({card}: {why})")
    return (with_changes(full, epochs=SHORT_EPOCHS), None, SHORT_REPEATS,
            f"live ladder: short, every rung {SHORT_REPEATS} times for {SHORT_EPOCHS} epochs, "
            f"{SHORT_REPEATS * SHORT_EPOCHS}/{FULL_REPEATS * full.epochs} of the full size's images ({card}: {why}); "
            f"LIVE_SIZE = \"full\" runs the recorded size")


# ------------------------------------------------------------------------------------------------ ablation

def without(rung: str, top: str = RUNG_NAMES[-1], base: TrainConfig | None = None) -> TrainConfig:
    """The `top` rung's config with one rung's change left out: every rung up to `top` applied except `rung`.

    A field that a later rung sets again keeps the later value (dropping `compile` under `cuda_graphs` changes
    nothing: the CUDA-graphs rung sets the compile mode itself); `ablation` leaves such no-op variants out.
    """
    for n in (rung, top):
        if n not in RUNG_NAMES:
            raise LabkitError(f"unknown preset {n!r}: choose one of {', '.join(RUNG_NAMES)}")
    if RUNG_NAMES.index(rung) > RUNG_NAMES.index(top) or rung == RUNG_NAMES[0]:
        raise LabkitError(f"{rung!r} is not a change on the way to {top!r}: choose a rung after "
                          f"{RUNG_NAMES[0]} and up to {top}")
    cfg = base or TrainConfig()
    for name, _, changes in LADDER[:RUNG_NAMES.index(top) + 1]:
        if name != rung:
            cfg = with_changes(cfg, **changes)
    return with_changes(cfg, name=f"without_{rung}")


def ablation(top: str = RUNG_NAMES[-1], base: TrainConfig | None = None, drop: list[str] | None = None
             ) -> tuple[list[TrainConfig], list[tuple[str, str]]]:
    """Leave-one-out from `top`: ([the top rung, then one `without(rung)` per change], [(rung, why skipped)]).

    `drop` picks the rungs to leave out (default: every rung after the baseline up to `top`). A variant whose
    config equals the top rung's (a later rung sets the same fields) is skipped with the reason, not run.
    """
    full = preset(top, base)
    names = RUNG_NAMES[1:RUNG_NAMES.index(top) + 1] if drop is None else list(drop)
    configs, skipped = [full], []
    for rung in names:
        cfg = without(rung, top, base)
        if with_changes(cfg, name=full.name) == full:
            later = [n for n, _, ch in LADDER[RUNG_NAMES.index(rung) + 1:RUNG_NAMES.index(top) + 1]
                     if set(ch) & set(_changes(rung))]
            skipped.append((f"without_{rung}", f"identical to {top}: {', '.join(later) or 'a later rung'} sets "
                                               f"the same fields"))
            continue
        configs.append(cfg)
    return configs, skipped


def _changes(rung: str) -> dict:
    return next(ch for n, _, ch in LADDER if n == rung)

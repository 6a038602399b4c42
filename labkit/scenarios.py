"""Four planted bottlenecks and their fixes, as configurations of one small training engine.

Each scenario is a `WorkloadConfig` (an MLP on CIFAR-shaped uint8 images) with one switch set the slow way, and
a fixed version that flips it back; `Workload.step()` runs one training step with the profiler labels data,
forward, backward, optimizer and metrics, so `labkit.profiling.profile_steps` and `diagnose` can read it:

- data:     per-sample PNG decoding and transforms in the training process -> packed uint8, batched augmentation
- overhead: tiny kernels at batch 32 and a per-parameter optimizer   -> a large batch and multi-tensor SGD
- sync:     one `.item()` per sample to count correct predictions   -> counts kept on the device, read once
- compute:  a wide fp32 MLP (CUDA cores only)                       -> bf16 autocast (tensor cores)

Sizes come in two sets: "full" (for a GPU) and "quick" (seconds on a 2-core CPU).
"""

from __future__ import annotations

import contextlib
import io
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from labkit import data as D
from labkit.env import LabkitError, pick_device, replace_fields, torch_switches

LOADERS = ("per_sample", "batched")
HOST_READS = ("none", "step", "sample")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("sgd", "sgd-foreach")


@dataclass
class WorkloadConfig:
    name: str = "custom"          # label in tables, traces and result files
    width: int = 256              # features of each hidden layer
    depth: int = 4                # hidden layers (Linear + ReLU each)
    batch: int = 256              # samples per optimizer step
    n_samples: int = 4096         # uint8 32x32 RGB images in the dataset; each step draws a random batch from it
    loader: str = "batched"       # per_sample: decode a PNG, pad/crop/flip/normalize, one image at a time | batched: packed uint8, one gather + augmentation for the whole batch
    augment: bool = True          # random crop (pad 4) and horizontal flip of every image
    resident: bool = True         # batched loader: keep the uint8 images on the training device (False: host, then copy)
    host_reads: str = "none"      # none: losses and counts stay on the device | step: loss.item() and a .cpu() count each step | sample: loss.item() and one .item() per sample
    precision: str = "fp32"       # fp32 (strict: TF32 off, CUDA cores) | bf16 (autocast: tensor cores on a GPU)
    optimizer: str = "sgd"        # sgd: a Python loop over parameters (several tiny kernels each) | sgd-foreach: multi-tensor kernels
    lr: float = 0.02              # SGD learning rate (momentum 0.9)
    threads: int | None = None    # CPU threads for torch during the step (None: leave torch's setting); quick sizes use 1
    seed: int = 0                 # model init, batch draws and augmentation


def with_changes(cfg: WorkloadConfig, **changes) -> WorkloadConfig:
    """A copy of `cfg` with fields replaced; unknown field names raise a clear error."""
    return replace_fields(cfg, **changes)


def check_workload(cfg: WorkloadConfig) -> None:
    """Reject impossible settings before anything is built, naming the fix."""
    for field_, allowed in (("loader", LOADERS), ("host_reads", HOST_READS), ("precision", PRECISIONS),
                            ("optimizer", OPTIMIZERS)):
        if getattr(cfg, field_) not in allowed:
            raise LabkitError(f"{cfg.name}: {field_} must be one of {allowed}, not {getattr(cfg, field_)!r}")
    if cfg.threads is not None and cfg.threads < 1:
        raise LabkitError(f"{cfg.name}: threads must be >= 1 or None")
    if min(cfg.width, cfg.depth, cfg.batch, cfg.n_samples) < 1:
        raise LabkitError(f"{cfg.name}: width, depth, batch and n_samples must all be >= 1")
    if cfg.lr <= 0:
        raise LabkitError(f"{cfg.name}: lr must be positive")


@dataclass(frozen=True)
class Scenario:
    """One planted bottleneck: the diagnosis it should get, what is slow, the fix, and sizes per mode."""

    name: str            # the diagnosis kind it plants: data | overhead | sync | compute
    planted: str         # what the slow version does
    fix: str             # what the fixed version does instead (the course's fix)
    slow: dict           # WorkloadConfig fields of the slow version
    fixed: dict          # fields the fixed version changes
    sizes: dict          # {"full": {...}, "quick": {...}}: sizes for a GPU and for a small CPU (over `slow`)
    cpu_shows_it: bool   # whether a CPU run shows the planted bottleneck at all
    cpu_note: str = ""   # why not, when it does not


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("data", "decode one PNG and transform one image at a time (pad, crop, flip, normalize) in the "
                     "training process, then a copy to the device",
             "one vectorized gather + crop/flip/normalize for the whole batch, where the uint8 data lives",
             dict(loader="per_sample", optimizer="sgd-foreach"), dict(loader="batched"),
             # quick width 512: at 256 the fixed loader's gather still took 35-47% of a CPU step, a coin toss
             # against compute; at 512 it takes about a quarter, and the slow loader still about 60%.
             {"full": dict(width=1024, depth=4, batch=2048), "quick": dict(width=512, depth=2, batch=128)}, True),
    Scenario("overhead", "a deep thin MLP at batch 32 with a per-parameter SGD loop: hundreds of kernels of a few "
                         "microseconds each, so launching them costs more than running them",
             "a large batch (more work per kernel) and multi-tensor (foreach) SGD; torch.compile and CUDA graphs "
             "go further",
             dict(depth=8, batch=32, optimizer="sgd", augment=False), dict(batch=8192, optimizer="sgd-foreach"),
             {"full": dict(width=512), "quick": dict(width=64, depth=8, batch=8)}, True),
    Scenario("sync", "one .item() per sample to count correct predictions, plus loss.item(), every step: the host "
                     "waits for the device hundreds of times per step",
             "keep losses and counts on the device and read them once at the end",
             dict(host_reads="sample", optimizer="sgd-foreach"), dict(host_reads="none"),
             {"full": dict(width=2048, depth=4, batch=512), "quick": dict(width=128, depth=2, batch=128)}, False,
             "a CPU has no asynchronous queue to drain: .item() costs no wait there, only Python per sample"),
    Scenario("compute", "a wide MLP in strict fp32: the matmuls run on CUDA cores",
             "bf16 autocast, so the matmuls run on tensor cores (then fuse and cut work; the GPU stays the limit)",
             dict(precision="fp32", optimizer="sgd-foreach"), dict(precision="bf16"),
             {"full": dict(width=4096, depth=4, batch=2048), "quick": dict(width=512, depth=2, batch=256)}, True,
             "a CPU has no tensor cores: the fix needs a GPU"),
]}


def scenario_config(name: str, fixed: bool = False, quick: bool = False) -> WorkloadConfig:
    """The WorkloadConfig of scenario `name` (slow, or `fixed`), at GPU ("full") or CPU ("quick") size."""
    if name not in SCENARIOS:
        raise LabkitError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}")
    s = SCENARIOS[name]
    cfg = with_changes(WorkloadConfig(name=f"{name}-{'fixed' if fixed else 'slow'}", **s.slow),
                       **s.sizes["quick" if quick else "full"])
    if quick:
        # Small CPU runs: tiny operators gain nothing from a team of threads, and on a shared machine one
        # descheduled thread stalls the rest (a 2-thread matmul was seen 10x slower than 1 thread under load).
        cfg = with_changes(cfg, threads=1)
    if fixed:
        cfg = with_changes(cfg, **s.fixed)
    if quick and fixed and name == "overhead":
        cfg = with_changes(cfg, batch=512)  # enough to swamp per-op overhead on a CPU, still seconds per run
    return cfg


def _encode_png(x: np.ndarray) -> list[bytes]:
    """Each uint8 HWC image as PNG bytes in memory: the per-sample path decodes one file per image, as a naive
    image-folder pipeline does, without touching the disk."""
    from PIL import Image

    out = []
    for img in x:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


@contextlib.contextmanager
def _threads(n: int | None):
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class _MLP(nn.Module):
    def __init__(self, cfg: WorkloadConfig, classes: int):
        super().__init__()
        dims = [3 * 32 * 32] + [cfg.width] * cfg.depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.head = nn.Linear(cfg.width, classes)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.head(x)


class Workload:
    """The engine: a dataset, an MLP and an optimizer on one device; `step()` is one labelled training step.

    Losses and correct counts are kept on the device unless `host_reads` says otherwise; `summary()` reads them.
    """

    # Batches are made inside step() itself (no worker processes, no queue): profile_steps writes this into the
    # trace, so diagnose ranks the `data` wait by its share, as it does DataLoader's num_workers=0.
    data_loading = "in-thread"

    def __init__(self, cfg: WorkloadConfig, device: str | torch.device | None = None,
                 dataset: D.ImageData | None = None):
        check_workload(cfg)
        self.cfg, self.device = cfg, pick_device(device)
        ds = dataset or D.synthetic_cifar(cfg.n_samples, 1, seed=0)
        if len(ds.y_train) < cfg.n_samples:
            raise LabkitError(f"{cfg.name}: the dataset has {len(ds.y_train)} images, n_samples asks for {cfg.n_samples}")
        on_dev = cfg.loader == "batched" and cfg.resident
        where = self.device if on_dev else torch.device("cpu")
        self.x = D.to_nchw_uint8(ds.x_train[:cfg.n_samples], where)
        self.png = _encode_png(ds.x_train[:cfg.n_samples]) if cfg.loader == "per_sample" else None
        self.y = torch.from_numpy(ds.y_train[:cfg.n_samples]).to(where)
        # Indices and augmentation draws live where the images do: a CPU index tensor copied to the GPU with
        # .to() would be a blocking copy (a host sync) every step.
        self.index_gen = torch.Generator(device=where).manual_seed(cfg.seed)
        self.mean = torch.tensor(D.CIFAR_MEAN, device=where).view(1, 3, 1, 1)  # made once: torch.tensor(..., device=
        self.std = torch.tensor(D.CIFAR_STD, device=where).view(1, 3, 1, 1)    # 'cuda') in the step would sync
        self.py_rng = random.Random(cfg.seed)  # per-sample choices as Python numbers, like a per-sample transform
        self.aug_gen = torch.Generator(device=where).manual_seed(cfg.seed + 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.model = _MLP(cfg, ds.num_classes).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9,
                                   foreach=cfg.optimizer == "sgd-foreach")
        self.steps = 0
        self.loss_sum = torch.zeros((), device=self.device)
        self.correct = torch.zeros((), device=self.device, dtype=torch.long)
        self.host_losses: list[float] = []
        self.host_correct = 0

    # -- loading

    def _per_sample(self, idx: torch.Tensor) -> torch.Tensor:
        xs = []
        from PIL import Image

        for i in idx.tolist():
            with Image.open(io.BytesIO(self.png[i])) as im:
                img = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
            if self.cfg.augment:
                img = F.pad(img, (4, 4, 4, 4))
                oy, ox = self.py_rng.randrange(9), self.py_rng.randrange(9)
                img = img[:, oy:oy + 32, ox:ox + 32]
                if self.py_rng.random() < 0.5:
                    img = img.flip(2)
            xs.append(D.normalize(img[None])[0])
        return torch.stack(xs).to(self.device, non_blocking=True)

    def _batched(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.x[idx]
        x = D.augment_batch(x, self.aug_gen) if self.cfg.augment else x
        x = (x.float() / 255 - self.mean) / self.std  # labkit.data.normalize's arithmetic, constants made once
        if x.device != self.device:
            x = x.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else x.to(self.device)
        return x

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of (normalized float images NCHW, labels) on the training device."""
        idx = torch.randint(0, self.cfg.n_samples, (self.cfg.batch,), generator=self.index_gen, device=self.x.device)
        x = self._per_sample(idx) if self.cfg.loader == "per_sample" else self._batched(idx)
        return x, self.y[idx].to(self.device, non_blocking=True)

    # -- the step

    def _precision(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _record(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        mode = self.cfg.host_reads
        if mode == "none":
            self.loss_sum += loss.detach()
            self.correct += (logits.argmax(1) == y).sum()
            return
        self.host_losses.append(loss.item())  # a host sync on a GPU
        if mode == "step":
            self.host_correct += int((logits.argmax(1) == y).sum().cpu())
        else:
            pred = logits.argmax(1)
            for i in range(len(y)):
                self.host_correct += int(pred[i] == y[i])  # one sync (and one tiny kernel) per sample

    def step(self) -> None:
        """One training step; the phases carry record_function labels data, forward, backward, optimizer, metrics."""
        with _threads(self.cfg.threads), torch_switches(tf32=False if self.cfg.precision == "fp32" else None):
            with record_function("data"):
                x, y = self.next_batch()
            with record_function("forward"), self._precision():
                logits = self.model(x)
                loss = F.cross_entropy(logits, y)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            with record_function("metrics"):
                self._record(loss, logits.detach(), y)
        self.steps += 1

    def summary(self) -> dict:
        """Steps run, mean loss and training accuracy so far (reads the device once)."""
        seen = self.steps * self.cfg.batch
        if self.cfg.host_reads == "none":
            loss_sum, correct = self.loss_sum.item(), int(self.correct.item())
        else:
            loss_sum, correct = sum(self.host_losses), self.host_correct
        return {"name": self.cfg.name, "steps": self.steps, "samples": seen,
                "mean_loss": loss_sum / max(1, self.steps), "train_accuracy": correct / max(1, seen)}


def workload(name_or_cfg: str | WorkloadConfig, device=None, fixed: bool = False, quick: bool | None = None,
             dataset: D.ImageData | None = None) -> Workload:
    """A ready Workload from a scenario name (quick sizes by default on CPU) or a WorkloadConfig."""
    if isinstance(name_or_cfg, WorkloadConfig):
        return Workload(name_or_cfg, device, dataset)
    dev = pick_device(device)
    if quick is None:
        from labkit.env import quick_mode

        quick = quick_mode()
    return Workload(scenario_config(name_or_cfg, fixed=fixed, quick=quick), dev, dataset)


def step_rate(wl: Workload, *, warmup: int = 2, repeats: int = 5) -> dict:
    """Seconds per step and samples/s of a workload, through labkit.bench.time_fn."""
    from labkit.bench import time_fn

    t = time_fn(wl.step, device=wl.device, warmup=warmup, repeats=repeats)
    return {"step_s": t.median, "step_iqr_s": t.iqr, "samples_per_s": wl.cfg.batch / t.median}


def compare_fix(name: str, device=None, quick: bool | None = None, rounds: int = 5) -> dict:
    """Slow vs fixed version of scenario `name`, interleaved (labkit.bench.compare): samples/s and the speedup."""
    from labkit.bench import compare

    slow, fixed = workload(name, device, False, quick), workload(name, device, True, quick)
    ab = compare(slow.step, fixed.step, device=slow.device, rounds=rounds, warmup=2)
    a_rate, b_rate = slow.cfg.batch / ab.a.median, fixed.cfg.batch / ab.b.median
    return {"scenario": name, "slow_samples_per_s": a_rate, "fixed_samples_per_s": b_rate,
            "speedup": b_rate / a_rate, "step_ratio": ab.summary()}

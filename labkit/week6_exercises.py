"""Week 6's exercises (the ResNet-18 ladder): the checks behind the notebook's self-check cells.

6.1 computes model FLOPs utilization (MFU, PaLM's definition: 3 x the forward FLOPs per training image, over the
datasheet peak) from img/s, counting the forward with `torch.utils.flop_counter.FlopCounterMode`; checked against
labkit.models' count and against the MFU that `benchmarks/results/ladder/ladder.json` records for its top rung.
6.2 is the top rungs' training step in eager PyTorch: channels_last, bf16 autocast, a fused (or foreach) SGD with
Nesterov momentum, no host sync. It runs beside labkit's own step on a width-8 ResNet-18 from the same weights;
the losses and weights must agree within AMP tolerance, and a dispatch-level watch checks the convolutions' dtype
and layout, the optimizer's kernels and that nothing read a number back to the host.
6.3 captures a training step in a CUDA graph (warm-up on a side stream, static inputs, replay). On a GPU the
replayed losses are checked against the same steps run eagerly and the step's Python must not run during replays;
on a CPU there is nothing to capture, so the check runs the eager fallback against the same reference, reads the
code for the capture's parts, and says that it skipped the capture.
6.4 is time to accuracy from a training log: the whole process's seconds (start-up and evaluations included) and
the training seconds until the first evaluation at or above a target, or None; checked on edge cases.
6.6-6.9 are data parallelism written by hand on 2 CPU processes (gloo): gradients averaged with one all_reduce per
tensor, then in flat buckets, then overlapped with backward through post-accumulate-grad hooks, then ZeRO-1
(optimizer state sharded: reduce-scatter, a shard's step, all-gather). Each check trains a small MLP with the answer
and under DistributedDataParallel from the same weights on the same shards (labkit.dp_scratch) and compares the
parameters (bit for bit where nothing reorders the arithmetic); a right answer is then timed against DDP.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import exercises as ex
from labkit.env import LabkitError

IMAGE = (3, 32, 32)  # CIFAR-sized images: what the ladder's synthetic data holds


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# -------------------------------------------------------------------------------------------- 6.1 MFU


def _ref_mfu():
    def mfu(model: nn.Module, img_per_s: float, peak_tflops: float, image_shape=IMAGE) -> float:
        from labkit.models import layer_macs

        if img_per_s <= 0 or peak_tflops <= 0:
            raise ValueError(f"img_per_s and peak_tflops must be positive, got {img_per_s} and {peak_tflops}")
        forward = 2.0 * sum(r["macs"] for r in layer_macs(model, (1, *image_shape)))  # FLOPs: 2 per MAC
        return 3.0 * forward * img_per_s / (peak_tflops * 1e12)

    return mfu


def _forward_flops(model: nn.Module) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(torch.zeros(1, *IMAGE))
    finally:
        model.train(was)
    return float(fc.get_total_flops())


def _mfu_hint(got: float, want: float, measured: float | None = None) -> str:
    hints = {want / 3: "that is the forward alone: a training image costs ~3 forwards (forward, input gradients, "
                       "weight gradients)",
             want * 2 / 3: "that counts 2 forwards per image: the backward is two products (input and weight "
                           "gradients), each about a forward",
             want / 2: "that counts a multiply-accumulate as one FLOP: it is two (a multiply and an add)",
             want * 1e12: "peak_tflops is in TFLOP/s: multiply it by 1e12 to divide FLOP/s by FLOP/s",
             want * 100: "return a fraction (0.29), not a percentage (29)"}
    if measured:
        hints[measured] = "that is the share of the *measured* matmul peak: MFU (PaLM's) divides by the datasheet peak"
    return next((h for v, h in hints.items() if _rel(got, v) < 5e-3),
                "MFU = img/s x 3 x forward FLOPs per image / (peak TFLOP/s x 1e12), the forward counted by "
                "FlopCounterMode on one image")


@ex.exercise("6.1", "MFU against the datasheet peak", reference=_ref_mfu)
def check_mfu(mfu) -> str:
    """A width-8 ResNet-18 against FlopCounterMode's count (exact), then ladder.json's top rung against its record."""
    from labkit.models import resnet18

    torch.manual_seed(0)
    small = resnet18(num_classes=10, width=8)
    want = 3 * _forward_flops(small) * 2500.0 / 1e12  # 2500 img/s on a 1 TFLOP/s chip
    got = mfu(small, 2500.0, 1.0)
    if not isinstance(got, int | float) or isinstance(got, bool):
        raise AssertionError(f"return MFU as a float (a fraction), got {type(got).__name__}")
    if _rel(got, want) > 1e-6:
        raise AssertionError(f"a width-8 ResNet-18 at 2,500 img/s on a 1 TFLOP/s chip: MFU {want:.6g}, yours "
                             f"{got:.6g}. Hint: {_mfu_hint(got, want)}")
    verdict = f"width-8 model: {got:.4g} at 2,500 img/s on 1 TFLOP/s, as FlopCounterMode counts"
    try:
        from labkit.bench import load_result
        from labkit.waves import datasheet_peak

        rec = load_result("ladder")
    except LabkitError:
        return verdict + "; ladder.json not found here, so the record's MFU was not compared"
    top = rec["rungs"][-1]
    sheet = datasheet_peak(rec["env"]["device_name"], "bf16")
    got = mfu(resnet18(num_classes=10), top["img_per_s"], sheet)
    measured = top.get("mfu")
    if _rel(got, top["mfu_datasheet"]) > 0.01:  # labkit skips the image's gradient: 0.3% fewer FLOPs than 3x
        raise AssertionError(f"ladder.json's {top['name']} rung ({top['img_per_s']:,.0f} img/s on "
                             f"{rec['env']['device_name']}, datasheet {sheet:g} TFLOP/s): its record says MFU "
                             f"{top['mfu_datasheet']:.4f}, yours {got:.4f}. Hint: "
                             f"{_mfu_hint(got, top['mfu_datasheet'], measured)}")
    return (verdict + f"; ladder.json's {top['name']} rung: {100 * got:.1f}% of the datasheet's {sheet:g} TFLOP/s "
            f"(the record: {100 * top['mfu_datasheet']:.1f}%; labkit skips the image's own gradient)")


# ----------------------------------------------------------------------------------- 6.2 the training step


class _Watch(TorchDispatchMode):
    """Counts aten ops by name and records each forward convolution's input dtype and layout."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.convs: list[tuple[torch.dtype, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in ("convolution", "mkldnn_convolution", "cudnn_convolution") and args:
            x = args[0]
            self.convs.append((x.dtype, x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)))
        return func(*args, **(kwargs or {}))


STEP = dict(lr=0.05, momentum=0.9, weight_decay=5e-4, label_smoothing=0.1)


def _ref_step():
    def make_train_step(model: nn.Module, lr: float, *, momentum: float = 0.9, weight_decay: float = 5e-4,
                        label_smoothing: float = 0.1):
        dev = next(model.parameters()).device
        model = model.to(memory_format=torch.channels_last)  # NHWC weights: oneDNN's and cuDNN's layout
        sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True,
                              weight_decay=weight_decay, fused=True)
        smooth = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

        def one_step(images, labels):
            images = images.to(device=dev, memory_format=torch.channels_last)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                out = smooth(model(images), labels.to(dev))
            sgd.zero_grad(set_to_none=True)
            out.backward()
            sgd.step()
            return out.detach()

        return one_step

    return make_train_step


def _labkit_step(model: nn.Module, dev: torch.device):
    """labkit's own step for the bf16 / channels_last / fused-SGD rungs, at a constant learning rate."""
    from labkit.presets import TrainConfig
    from labkit.train import _make_step

    cfg = TrainConfig(width=8, batch_size=16, precision="bf16", channels_last=True, optimizer="sgd-fused",
                      momentum=STEP["momentum"], weight_decay=STEP["weight_decay"],
                      label_smoothing=STEP["label_smoothing"], warmup_frac=0.0)
    model.to(memory_format=torch.channels_last)
    # warm-up of 1 step and a decay over 10^9: the schedule stays at 1.0 for the few steps compared
    step = _make_step(cfg, model, model, STEP["lr"], 10**9, dev)
    return lambda x, y: step(x.contiguous(memory_format=torch.channels_last), y)


def _batches(n: int, dev: torch.device, batch: int = 16, classes: int = 10):
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(batch, *IMAGE, generator=g).to(dev), torch.randint(0, classes, (batch,), generator=g).to(dev))
            for _ in range(n)]


def _step_findings(watch: _Watch, losses: list) -> list[str]:
    wrong = []
    if not watch.convs:
        wrong.append("no convolution ran: the step must run the model's forward")
    elif any(d != torch.bfloat16 for d, _ in watch.convs):
        wrong.append("some convolutions ran in float32: run the forward and the loss under "
                     "torch.autocast(device_type, dtype=torch.bfloat16)")
    elif not all(cl for _, cl in watch.convs):
        wrong.append("some convolutions got NCHW input: put the model in channels_last "
                     "(model.to(memory_format=torch.channels_last)) and the batch too (x.contiguous(memory_format=...))")
    if "_fused_sgd_" not in watch.ops and not any(k.startswith("_foreach_") for k in watch.ops):
        wrong.append("the optimizer ran a loop of per-parameter ops: give torch.optim.SGD fused=True (one kernel) "
                     "or foreach=True (a few batched kernels)")
    if watch.ops.get("_local_scalar_dense"):
        wrong.append("the step reads a number back to the host (.item(), float(), print of a tensor): return the "
                     "loss tensor; a sync per step is what the no_sync rung removes")
    if not all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in losses):
        wrong.append("step(x, y) should return the loss as a one-element tensor (on the device)")
    elif any(v.requires_grad for v in losses):
        wrong.append("the returned loss still holds its graph: return loss.detach()")
    return wrong


@ex.exercise("6.2", "a bf16 channels_last step with a fused optimizer", reference=_ref_step)
def check_step(make_train_step) -> str:
    """Three steps of a width-8 ResNet-18 beside labkit's step from the same weights, on CPU (and the GPU)."""
    from labkit.models import resnet18

    devs = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    out = []
    for dev in devs:
        torch.manual_seed(0)
        theirs_model = resnet18(num_classes=10, width=8).to(dev)
        ours_model = copy.deepcopy(theirs_model)
        start = torch.cat([p.detach().float().flatten().cpu() for p in theirs_model.parameters()])
        step = make_train_step(theirs_model, STEP["lr"], momentum=STEP["momentum"],
                               weight_decay=STEP["weight_decay"], label_smoothing=STEP["label_smoothing"])
        if not callable(step):
            raise AssertionError(f"make_train_step should return a function step(x, y), got {type(step).__name__}")
        ours = _labkit_step(ours_model, dev)
        batches = _batches(3, dev)
        watch = _Watch()
        with watch:
            got = [step(x.contiguous(), y) for x, y in batches]
        if wrong := _step_findings(watch, got):
            raise AssertionError(f"on {dev.type}: " + "; ".join(wrong))
        want = [float(ours(x, y)) for x, y in batches]
        got = [float(v) for v in got]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if abs(a - b) > 0.02 + 0.02 * abs(b):  # bf16: about 3 significant digits per op
                raise AssertionError(f"on {dev.type}, step {i + 1}: your loss {a:.4f}, labkit's {b:.4f} (same "
                                     f"weights, same batches). Check the loss (cross-entropy with "
                                     f"label_smoothing), that each step zeroes the gradients, and the optimizer "
                                     f"(SGD, nesterov=True, momentum, weight_decay, lr)")
        pt = torch.cat([p.detach().float().flatten().cpu() for p in theirs_model.parameters()])
        po = torch.cat([p.detach().float().flatten().cpu() for p in ours_model.parameters()])
        moved = float((po - start).norm()) or 1.0  # how far labkit's 3 steps moved the weights
        off = float((pt - po).norm()) / moved
        if off > 0.05:
            raise AssertionError(f"on {dev.type}: after 3 steps your weights differ from labkit's by {100 * off:.0f}% "
                                 f"of how far the steps moved them. Check that each step zeroes the gradients "
                                 f"(zero_grad), SGD's nesterov=True, momentum, weight_decay and lr, and that "
                                 f"optimizer.step() runs once per step")
        out.append(f"{dev.type}: losses {', '.join(f'{v:.3f}' for v in got)} against labkit's "
                   f"{', '.join(f'{v:.3f}' for v in want)}, bf16 channels_last convolutions, "
                   + ("fused" if "_fused_sgd_" in watch.ops else "foreach") + " SGD, no host sync")
    return "; ".join(out) + ("" if torch.cuda.is_available() else " (no GPU here: checked on CPU only)")


# ----------------------------------------------------------------------------------------- 6.3 CUDA graph


def _ref_graph():
    def graph_step(step, static_x: torch.Tensor, static_y: torch.Tensor, warmup: int = 3):
        if not static_x.is_cuda:  # nothing to capture: the same steps, eagerly
            for _ in range(warmup):
                step(static_x, static_y)
            def replay(x, y):
                static_x.copy_(x)
                static_y.copy_(y)
                return step(static_x, static_y)

            return replay
        # torch.cuda.make_graphed_callables graphs forward and backward only, not the optimizer's step: for the
        # whole step, labkit's top rungs use torch.compile(mode="reduce-overhead"); here it is captured by hand
        # eager steps first, on a side stream (a capture must not see the legacy stream's pending work): the
        # optimizer's state and cuDNN's choices then exist before the capture records addresses
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step(static_x, static_y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = step(static_x, static_y)

        def replay_cuda(x, y):
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            graph.replay()
            return static_loss

        return replay_cuda

    return graph_step


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Linear(48, 5))

    def forward(self, x):
        return self.body(x)


def _tiny_step(model: nn.Module):
    """A capturable training step: the gradients exist before the capture and are zeroed in place, SGD's
    momentum buffers are made by the warm-up, the loss comes back as a tensor."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = [0]

    def step(x, y):
        calls[0] += 1
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, calls


def _graph_source_findings(fn) -> list[str]:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return []  # no source to read (built elsewhere): the run checks still apply
    need = {"a capture (torch.cuda.CUDAGraph() with torch.cuda.graph(g), or torch.cuda.graph(g) itself)":
            ("CUDAGraph", "torch.cuda.graph("),
            "a replay (g.replay())": (".replay(",),
            "a warm-up on a side stream (s = torch.cuda.Stream(); s.wait_stream(...); with torch.cuda.stream(s): "
            "...)": ("wait_stream",),
            "copies into the static inputs (static_x.copy_(x)), since the graph reads their addresses": ("copy_(",)}
    if "make_graphed_callables" in src and "CUDAGraph" not in src:
        return ["torch.cuda.make_graphed_callables graphs a module's forward and backward, not the optimizer's "
                "step: capture the whole step with torch.cuda.CUDAGraph and torch.cuda.graph"]
    return [what for what, keys in need.items() if not any(k in src for k in keys)]


@ex.exercise("6.3", "a CUDA-graph capture of a training step", reference=_ref_graph)
def check_graph(graph_step) -> str:
    """The replayed steps against the same steps run eagerly from the same weights (on CPU: the eager fallback)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = _Tiny().to(dev)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 24, generator=g).to(dev), torch.randint(0, 5, (8,), generator=g).to(dev))
               for _ in range(5)]
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    step, calls = _tiny_step(model)
    replay = graph_step(step, static_x, static_y, warmup=3)
    if not callable(replay):
        raise AssertionError(f"graph_step should return a function replay(x, y), got {type(replay).__name__}")
    before = calls[0]
    if before < 3:
        raise AssertionError(f"with warmup=3 the step ran {before} times before replaying: run it `warmup` times "
                             "first (on a GPU on a side stream), so its optimizer state and kernels' choices exist")
    got = [float(replay(x, y)) for x, y in batches[1:]]
    ref_step, _ = _tiny_step(twin)
    for _ in range(3):
        ref_step(batches[0][0], batches[0][1])
    want = [float(ref_step(x, y)) for x, y in batches[1:]]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if abs(a - b) > 1e-4 + 1e-4 * abs(b):
            raise AssertionError(f"replay {i + 1}: loss {a:.5f}, the same step run eagerly {b:.5f}. Copy each new "
                                 f"batch into the static inputs (static_x.copy_(x)) before replaying; on a GPU, "
                                 f"warm up before capturing, and do not run the step an extra time eagerly")
    if missing := _graph_source_findings(graph_step):  # what a CPU cannot run, it reads
        raise AssertionError("graph_step lacks " + "; ".join(missing))
    if dev.type == "cuda":
        if calls[0] - before:
            raise AssertionError(f"the step's Python ran {calls[0] - before} times during 4 replays: replay the "
                                 "graph (g.replay()) instead of calling the step")
        return f"4 replays on {torch.cuda.get_device_name()} match the eager steps: {', '.join(f'{v:.4f}' for v in got)}"
    return ("CPU: the eager fallback matches the eager steps and the code has a capture, a replay and static "
            "inputs; the capture itself was skipped (no GPU here)")


# -------------------------------------------------------------------------------------- 6.4 time to accuracy


def _ref_tta():
    def time_to_accuracy(log: dict, target: float) -> tuple[float, float] | None:
        from labkit import report

        if not 0.0 < target <= 1.0:
            raise ValueError(f"target is an accuracy as a fraction in (0, 1], got {target}")
        epochs = log["epochs"]
        if log["process_start"] > log["train_start"]:
            raise ValueError("train_start is before process_start")
        if any(e["train_s"] < 0 or e["eval_s"] < 0 for e in epochs):
            raise ValueError("an epoch's train_s or eval_s is negative")
        curve, trained = [], 0.0
        for e in epochs:
            trained += e["train_s"]
            curve.append({"accuracy": e["accuracy"], "train_s": trained})
        hit = report.time_to_target({"accuracy_curve": curve}, target)
        if hit is None:
            return None
        n = next(i for i, c in enumerate(curve) if c["accuracy"] >= target) + 1
        wall = log["train_start"] - log["process_start"] + sum(e["train_s"] + e["eval_s"] for e in epochs[:n])
        return wall, hit[0]

    return time_to_accuracy


def _log(accs, start_up=4.0, train_s=10.0, eval_s=0.5):
    return {"process_start": 1_000.0, "train_start": 1_000.0 + start_up,
            "epochs": [{"train_s": train_s, "eval_s": eval_s, "accuracy": a} for a in accs]}


TTA_CASES = [  # (what it tests, log, target, the answer)
    ("reached at the third epoch", _log([0.60, 0.85, 0.915, 0.93]), 0.91, (4.0 + 3 * 10.5, 30.0)),
    ("reached at the first epoch", _log([0.95, 0.96]), 0.91, (14.5, 10.0)),
    ("equal to the target counts (at or above)", _log([0.80, 0.9146, 0.93]), 0.9146, (25.0, 20.0)),
    ("never reached", _log([0.80, 0.90, 0.9145]), 0.9146, None),
    ("no epochs yet", _log([]), 0.5, None),
    ("a dip after reaching it: the first time counts", _log([0.92, 0.88, 0.95]), 0.9, (14.5, 10.0)),
    ("a diverged epoch (NaN) never counts", _log([float("nan"), 0.95], eval_s=0.0), 0.9, (24.0, 20.0)),
    ("a warm process: no start-up", _log([0.5, 0.99], start_up=0.0, eval_s=1.0), 0.99, (22.0, 20.0)),
]
TTA_BAD = [("a target given in percent (91.5)", _log([0.9]), 91.5),
           ("a target of 0", _log([0.9]), 0.0),
           ("train_start before process_start", {**_log([0.9]), "train_start": 999.0}, 0.5),
           ("a negative epoch time", _log([0.9], train_s=-1.0), 0.5)]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == 2 and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(a, b, strict=True))


@ex.exercise("6.4", "time to a target accuracy, cold process included", reference=_ref_tta)
def check_tta(time_to_accuracy) -> str:
    """Eight logs with known answers, then four bad inputs that must raise ValueError."""
    for what, log, target, want in TTA_CASES:
        got = time_to_accuracy(copy.deepcopy(log), target)
        if got is not None:
            try:
                got = tuple(float(v) for v in got)
            except (TypeError, ValueError):
                raise AssertionError(f"{what}: return (whole-process s, training s) or None, got {got!r}") from None
        if not _same(got, want):
            accs = [e["accuracy"] for e in log["epochs"]]
            raise AssertionError(
                f"{what}: accuracies {accs}, target {target}, start-up {log['train_start'] - log['process_start']:g} s, "
                f"each epoch {log['epochs'][0]['train_s'] if log['epochs'] else 0:g} s training + "
                f"{log['epochs'][0]['eval_s'] if log['epochs'] else 0:g} s evaluation: want {want}, got {got}. The "
                f"whole-process time counts the start-up and every evaluation up to and including the first at or "
                f"above the target; the training time counts only training")
    for what, log, target in TTA_BAD:
        try:
            time_to_accuracy(copy.deepcopy(log), target)
        except (ValueError, LabkitError):
            continue
        raise AssertionError(f"{what}: should raise ValueError with a clear message before any work (a wrong "
                             f"log or target gives a number that looks right and is not)")
    return f"{len(TTA_CASES)} logs right (first-hit, equality, never, NaN, dips) and {len(TTA_BAD)} bad inputs refused"


# --------------------------------------------------------------- 6.6-6.9 data parallelism, written by hand
# Each check forks 2 CPU processes in a gloo group (labkit.dp_scratch), trains the same tiny MLP with the answer
# and under DistributedDataParallel from the same weights on the same data shards, compares, then times both.

BUCKET_BYTES = 300_000  # the checks' bucket budget: 3 buckets of the check's MLP in either order, not 8 tensors
DP_TOL = 1e-6  # how far (a fraction of how far DDP moved the weights) an answer may land from DDP's parameters
ZERO_TOL = 1e-5  # the same for ZeRO-1: its optimizer steps one flat shard instead of each parameter tensor
LAST_TIMING: dict[str, list] = {}  # exercise id -> the last check's [(your s/step, DDP's s/step), ...] per round
LAST_STATE: dict[str, dict] = {}  # "6.9" -> {"per_rank": [bytes, ...], "unsharded": bytes} from its last check


def buckets(params: list, bucket_bytes: int) -> list[list]:
    """Greedy buckets in the given order: a new bucket when the next tensor would pass bucket_bytes (bytes)."""
    out, size = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def _ref_naive():
    def average_gradients(model: nn.Module) -> None:
        import torch.distributed as dist

        n = dist.get_world_size()
        for p in model.parameters():
            if p.grad is None:
                continue
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= n

    return average_gradients


def _copy_back(flat: torch.Tensor, grads: list[torch.Tensor], scale: float) -> None:
    from torch._utils import _unflatten_dense_tensors

    flat.mul_(scale)
    for g, part in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(part)


def _ref_buckets():
    def allreduce_buckets(params: list, bucket_bytes: int) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        live = [p for p in params if p.grad is not None]
        for group in buckets(live, bucket_bytes):
            grads = [p.grad for p in group]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            _copy_back(flat, grads, 1.0 / dist.get_world_size())

    return allreduce_buckets


def _ref_overlap():
    def overlap_gradients(model: nn.Module, bucket_bytes: int):
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        order = [p for p in model.parameters() if p.requires_grad][::-1]  # backward reaches the last layer first
        groups = buckets(order, bucket_bytes)
        home = {p: i for i, group in enumerate(groups) for p in group}
        waiting = [len(group) for group in groups]
        launched: list = []

        def ready(p):
            i = home[p]
            waiting[i] -= 1
            if waiting[i] == 0:  # the bucket's last gradient just landed: send it while backward goes on
                grads = [q.grad for q in groups[i]]
                flat = _flatten_dense_tensors(grads)
                launched.append((dist.all_reduce(flat, async_op=True), flat, grads))

        for p in order:
            p.register_post_accumulate_grad_hook(ready)

        def finish():
            for work, flat, grads in launched:
                work.wait()
                _copy_back(flat, grads, 1.0 / dist.get_world_size())
            launched.clear()
            waiting[:] = [len(group) for group in groups]

        return finish

    return overlap_gradients


def _collective(name: str):
    """torch.distributed's function by its newer name where this torch has it (2.14 renamed two of them)."""
    import torch.distributed as dist

    new = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}[name]
    return getattr(dist, new, None) or getattr(dist, name)


def _ref_zero1():
    def zero1(params, make_optimizer):
        import torch.distributed as dist

        params = list(params)
        world = dist.get_world_size()
        rank = dist.get_rank()
        total = sum(p.numel() for p in params)
        per = -(-total // world)  # ceil: the last shard is padded with zeros
        whole = torch.zeros(per * world)
        torch.cat([p.detach().reshape(-1) for p in params], out=whole[:total])
        mine = whole[rank * per:(rank + 1) * per].clone().requires_grad_(True)
        opt = make_optimizer([mine])  # state for this rank's shard only

        def step():
            flat_grad = torch.zeros(per * world)
            torch.cat([p.grad.reshape(-1) for p in params], out=flat_grad[:total])
            shard_grad = torch.empty(per)
            _collective("reduce_scatter_tensor")(shard_grad, flat_grad)
            mine.grad = shard_grad.div_(world)
            opt.step()
            _collective("all_gather_into_tensor")(whole, mine.detach())
            with torch.no_grad():
                at = 0
                for p in params:
                    p.copy_(whole[at:at + p.numel()].view_as(p))
                    at += p.numel()

        return step, opt

    return zero1


def _split(flat: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, numels))


def _grad_hint(r: dict, world: int) -> str:
    """Which parameter's gradient differs from DDP's, and the likely slip: summed, never reduced, or other."""
    names, numels = r["names"], r["numels"]
    for name, g, d, own in zip(names, _split(r["grads"], numels), _split(r["ddp_grads"], numels),
                               _split(r["local_grads"], numels), strict=True):
        if torch.equal(g, d) or torch.allclose(g, d, rtol=1e-5, atol=1e-8):
            continue
        if torch.allclose(g, world * d, rtol=1e-5, atol=1e-8):
            return (f"{name}'s gradient is {world}x DDP's: the sum over the ranks, not the mean. Divide by the "
                    f"world size (dist.get_world_size()) after the all_reduce")
        if torch.allclose(g, own, rtol=1e-5, atol=1e-8):
            return (f"{name}'s gradient is still this rank's own: it was never all-reduced (a bucket skipped, or a "
                    f"reduced copy that never went back into .grad)")
        return f"{name}'s gradient differs from DDP's by up to {float((g - d).abs().max()):.3g}"
    return ""


def _dp_compare(results: list[dict], tol: float, what: str, drift_hint: str | None = None,
                far_hint: str | None = None) -> str:
    """Raise with what differed, rank by rank; return how close the answer came to DDP's parameters.

    drift_hint, far_hint: what to say when the ranks' parameters disagree, and when they agree but differ from
    DDP's (None: find the parameter whose .grad differs from DDP's, which fits answers that reduce the .grads)."""
    world = len(results)
    if not torch.equal(results[0]["params"], results[-1]["params"]):
        diff = float((results[0]["params"] - results[-1]["params"]).abs().max())
        hint = drift_hint or _grad_hint(results[0], world)
        raise AssertionError(f"after {what}, rank 0's and rank {world - 1}'s parameters differ (up to {diff:.3g}): "
                             f"the ranks' replicas drifted apart. {hint}".rstrip())
    worst = 0.0
    for r in results:
        moved = float((r["ddp_params"] - r["start"]).abs().max()) or 1.0
        worst = max(worst, float((r["params"] - r["ddp_params"]).abs().max()) / moved)
    if worst > tol:
        hint = far_hint or _grad_hint(results[0], world) or (
            "the first step's gradients agree with DDP's, so look at what changes after it: is everything reset "
            "between steps?")
        raise AssertionError(f"after {what}, your parameters are {worst:.3g} (of how far DDP moved them) away from "
                             f"DDP's, more than the tolerance {tol:g}: {hint}")
    if worst == 0.0:
        return "parameters bit-identical to DDP's"
    return f"parameters within {worst:.2g} of DDP's (tolerance {tol:g} of how far DDP moved them)"


# gloo's words when one collective's tensors do not fit each other (an output the size of its input, say)
SIZE_MISFIT = ("outputShape", "inputShape", "invalid tensor size")
SIZE_HINT = ("A collective got tensors whose sizes do not fit each other: reduce_scatter_single and "
             "all_gather_single take the output first, then the input; the flat vector (reduce-scatter's input, "
             "all-gather's output) holds world size x one slice, padded with zeros to a multiple of the world size")
DP_TIMEOUT_S = 20.0  # seconds for one 2-process run: a rank stuck in a collective is reported, never waited on


def _on_ranks(fn) -> list:
    from labkit import dp_scratch as D

    D.preload()
    try:
        return D.run_ranks(fn, timeout_s=DP_TIMEOUT_S)
    except D.RankFailed as e:
        if e.not_implemented:
            raise NotImplementedError() from None
        misfit = any(k in e.message for k in SIZE_MISFIT)
        out_of_step = not misfit and e.kind in ("RuntimeError", "DistBackendError") and any(
            k in e.message for k in ("Gloo", "gloo", "Connection closed", "Timed out", "timed out"))
        why = (". The ranks' collectives went out of step: every rank must make the same collectives, in the same "
               "order, with the same sizes" if out_of_step else f". {SIZE_HINT}" if misfit else "")
        said = re.sub(r"^\[rank\d+\]:\[[^\]]*\]\s*", "", e.message.strip())  # gloo's log-line prefix, its newline
        raise AssertionError(f"on rank {e.rank} your code raised {e.kind}: {said} (at {e.where}){why}") from None
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def _recipe(adam: bool):
    """The checks' run. ZeRO-1's (the Adam one) ends in 11 classes: an odd count of parameters, so that its flat
    vector needs the padding to a multiple of the world size that the exercise asks for."""
    from labkit import dp_scratch as D

    return D.Recipe(sizes=(64, 256, 256, 256, 11)) if adam else D.Recipe()


def _launch(make_sync, *, adam: bool = False) -> list[dict]:
    """The answer and DDP trained side by side in 2 forked gloo processes: each rank's findings."""
    from labkit import dp_scratch as D

    recipe = _recipe(adam)
    return _on_ranks(lambda rank, world: D.train_side_by_side(rank, world, recipe, make_sync, adam=adam))


def _timed(eid: str, make_sync, *, adam: bool = False) -> str:
    """Only a right answer is timed: yours and DDP's steps in interleaved rounds, in 2 fresh processes."""
    from labkit import dp_scratch as D

    recipe = _recipe(adam)
    pairs = _on_ranks(lambda rank, world: D.time_side_by_side(rank, world, recipe, make_sync, adam=adam))[0]
    LAST_TIMING[eid] = pairs
    return D.ratio_summary(pairs)


def _no_fork(eid: str) -> str | None:
    from labkit import dp_scratch as D

    if D.can_fork() and torch.cuda.is_available() and torch.cuda.is_initialized():
        # autograd's GPU worker threads, started by any backward on the GPU, cannot be forked (torch refuses)
        return (f"skipped: this kernel has already used the GPU, and autograd's GPU threads cannot be forked into "
                f"the 2 processes the check runs. Restart the kernel, run the setup cell and then exercise {eid}'s "
                "cells before any GPU cell (the check itself runs on the CPU)")
    if D.can_fork():
        return None
    return (f"skipped: {sys.platform} cannot fork safely, and the check runs your function in 2 forked processes "
            f"(a notebook's function cannot be imported by a spawned one). Run exercise {eid} on Linux or Colab")


COUNTED = (" (none seen: the check counts calls made through the module, so write dist.all_reduce(...), not a "
           "name imported from torch.distributed before the check ran)")


def _counts(r: dict) -> tuple[int, int]:
    """How many buckets the check's MLP makes in forward and in reverse parameter order."""
    sizes = [torch.empty(n) for n in r["numels"]]
    return len(buckets(sizes, BUCKET_BYTES)), len(buckets(sizes[::-1], BUCKET_BYTES))


@ex.exercise("6.6", "gradients averaged by hand, one all_reduce per tensor", reference=_ref_naive)
def check_naive(average_gradients) -> str:
    """2 gloo processes, 3 SGD steps on each rank's shard: the parameters against DDP's, then both timed."""
    if skip := _no_fork("6.6"):
        return skip

    def sync(model, make_opt):
        return make_opt(model.parameters()), lambda: average_gradients(model)

    results = _launch(sync)
    calls = [c for c in results[0]["calls"] if c.name == "all_reduce"]
    close = _dp_compare(results, DP_TOL, "3 SGD steps")
    return f"2 processes: {close}, {len(calls)} all_reduce calls per step; {_timed('6.6', sync)}"


@ex.exercise("6.7", "gradients in flat buckets, one all_reduce per bucket", reference=_ref_buckets)
def check_buckets(allreduce_buckets) -> str:
    """As 6.6, and the number of all_reduce calls must be that of greedy buckets of BUCKET_BYTES."""
    if skip := _no_fork("6.7"):
        return skip

    def sync(model, make_opt):
        params = list(model.parameters())
        return make_opt(params), lambda: allreduce_buckets(params, BUCKET_BYTES)

    results = _launch(sync)
    close = _dp_compare(results, DP_TOL, "3 SGD steps")
    calls = [c for c in results[0]["calls"] if c.name == "all_reduce"]
    want = set(_counts(results[0]))
    if len(calls) not in want:
        raise AssertionError(f"{len(calls)} all_reduce calls in one step, of {[c.numel for c in calls]} elements; "
                             f"buckets of at most {BUCKET_BYTES:,} bytes (a tensor larger than that alone) make "
                             f"{' or '.join(map(str, sorted(want)))} for these {len(results[0]['numels'])} tensors. "
                             f"Fill a bucket until the next tensor would overflow it, then start a new one"
                             + (COUNTED if not calls else ""))
    return (f"2 processes: {close}, {len(calls)} buckets of {[c.numel for c in calls]} elements; "
            f"{_timed('6.7', sync)}")


@ex.exercise("6.8", "all_reduce overlapped with backward through gradient hooks", reference=_ref_overlap)
def check_overlap(overlap_gradients) -> str:
    """As 6.7, and every bucket's all_reduce must be launched asynchronously from inside backward."""
    if skip := _no_fork("6.8"):
        return skip

    def sync(model, make_opt):
        return make_opt(model.parameters()), overlap_gradients(model, BUCKET_BYTES)

    results = _launch(sync)
    calls = [c for c in results[0]["calls"] if c.name == "all_reduce"]
    if not calls:
        first = sum(c.name == "all_reduce" for c in results[0]["first_step_calls"])
        raise AssertionError(f"no all_reduce ran in the last step, {first} in the first: finish() must reset each "
                             "bucket's count of ready gradients, or the hooks never reach a bucket's last one again"
                             if first else "no all_reduce ran in the last step: launch one per bucket from the hooks"
                             + COUNTED)
    if not all(c.in_backward for c in calls):
        late = sum(not c.in_backward for c in calls)
        raise AssertionError(f"{late} of {len(calls)} all_reduce calls started after backward returned, where "
                             f"nothing is left to overlap with: launch each bucket's from the hook of its last "
                             f"gradient (Tensor.register_post_accumulate_grad_hook)")
    if not all(c.async_op for c in calls):
        raise AssertionError("an all_reduce ran with async_op=False, so backward stopped until it finished: pass "
                             "async_op=True and keep its Work, then wait() on it in finish()")
    if not all(c.waited for c in calls):
        raise AssertionError(f"{sum(not c.waited for c in calls)} of {len(calls)} all_reduce handles were never "
                             "waited on: with async_op=True the sum lands in the flat buffer only once the Work is "
                             "done, so finish() must call work.wait() on each handle before it divides and copies "
                             "back (a run where it happened to land in time is luck, not a right answer)")
    try:
        close = _dp_compare(results, DP_TOL, "3 SGD steps")
    except AssertionError as e:  # what 6.7 did not have: a collective still running when its buffer is read
        raise AssertionError(f"{e}. With async_op=True the sum lands in the flat buffer only once the Work is done: "
                             "finish() must call work.wait() on each handle before it divides and copies back, and "
                             "the flat buffer the all_reduce got must be the one copied back") from None
    want = set(_counts(results[0]))
    if len(calls) not in want:
        raise AssertionError(f"{len(calls)} all_reduce calls in one step; buckets of {BUCKET_BYTES:,} bytes make "
                             f"{' or '.join(map(str, sorted(want)))}")
    _check_backward_order([c.numel for c in calls], results[0]["numels"])
    return f"2 processes: {close}, {len(calls)} buckets launched during backward; {_timed('6.8', sync)}"


def _bucket_numels(numels: list[int], reverse: bool) -> list[int]:
    """Elements in each greedy bucket of BUCKET_BYTES over fp32 tensors of `numels`, in forward or reverse order."""
    sizes = [torch.empty(n) for n in (numels[::-1] if reverse else numels)]
    return [sum(t.numel() for t in group) for group in buckets(sizes, BUCKET_BYTES)]


def _check_backward_order(launched: list[int], numels: list[int]) -> None:
    """6.8's buckets must follow backward's order (parameters reversed): in forward order the same count of
    buckets passes 6.7, but the bucket backward fills first is not the first to be sent."""
    want = _bucket_numels(numels, reverse=True)
    if sorted(launched) == sorted(want):
        return
    hint = ("they are bucketed in model.parameters()' forward order. Backward produces the last layer's gradients "
            "first: bucket the parameters reversed, so that the first bucket to fill is the first one sent"
            if sorted(launched) == sorted(_bucket_numels(numels, reverse=False)) else
            "fill each bucket, in the order backward reaches the parameters, until the next tensor would overflow it")
    raise AssertionError(f"buckets of {launched} elements, where greedy buckets of {BUCKET_BYTES:,} bytes over the "
                         f"parameters in backward's order hold {want}: {hint}")


class _ShardedOpt:
    """6.9's answer dressed as an optimizer for the check's loop: zero_grad, then step() runs the answer's step."""

    def __init__(self, params, step, optimizer):
        self.params, self._step, self.optimizer = list(params), step, optimizer

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def step(self):
        self._step()


@ex.exercise("6.9", "ZeRO-1: optimizer state sharded over the ranks", reference=_ref_zero1)
def check_zero1(zero1) -> str:
    """3 Adam steps against DDP with an unsharded Adam; each rank's state bytes measured against the unsharded."""
    if skip := _no_fork("6.9"):
        return skip

    def sync(model, make_opt):
        params = list(model.parameters())
        out = zero1(params, make_opt)
        if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])):
            raise TypeError("zero1 should return (step, optimizer): a function and the shard's torch optimizer")
        return _ShardedOpt(params, *out), lambda: None

    results = _launch(sync, adam=True)
    close = _dp_compare(results, ZERO_TOL, "3 Adam steps",
                        drift_hint="Each rank steps only its own shard: after the step, all-gather every rank's "
                                   "updated shard and copy the whole flat vector back into the parameters",
                        far_hint="the ranks agree with each other, not with DDP's Adam. Check that the "
                                 "reduce-scattered gradient is divided by the world size, that rank r's slice "
                                 "starts at r x the shard's length in the flat vector of both the parameters and "
                                 "the gradients, and that the slices go back to the parameters they came from")
    full = results[0]["ddp_state_bytes"]
    mine = [r["state_bytes"] for r in results]
    if max(mine) >= full:
        raise AssertionError(f"each rank's optimizer holds {max(mine):,} bytes of state, the unsharded Adam "
                             f"{full:,}: nothing is sharded. Give the optimizer this rank's slice of the flat "
                             f"parameters only")
    names = sorted({c.name for c in results[0]["calls"]})
    if "reduce_scatter" not in names or "all_reduce" in names:
        seen = ", ".join(names) or ("none that the check saw (it counts calls made through the module: write "
                                    "dist.reduce_scatter_single(...), not a name imported before the check ran)")
        raise AssertionError(f"the parameters are right, but your step's collectives were {seen}: ZeRO-1 "
                             "reduce-scatters the flat gradient, so that each "
                             "rank receives the sum of its own slice only, where an all_reduce sends every rank the "
                             "whole sum and the rank then uses one slice of it. Call reduce_scatter_single "
                             "(reduce_scatter_tensor before torch 2.14) on the flat gradient, and no all_reduce")
    LAST_STATE["6.9"] = {"per_rank": mine, "unsharded": full}
    return (f"2 processes: {close}; Adam state per rank {', '.join(f'{b:,}' for b in mine)} bytes against "
            f"{full:,} unsharded ({max(mine) / full:.2f} of it), collectives {', '.join(names) or 'none seen'}; "
            f"{_timed('6.9', sync, adam=True)}")

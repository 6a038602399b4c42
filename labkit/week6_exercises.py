"""Week 6's exercises (the ResNet-18 ladder): the checks behind the notebook's self-check cells.

6.1 computes model FLOPs utilization (MFU, PaLM's definition: 3 x the forward FLOPs per training image, over the
datasheet peak) from img/s, counting the forward with `torch.utils.flop_counter.FlopCounterMode`; checked against
labkit.models' count and against the MFU that `benchmarks/results/ladder.json` records for its top rung.
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
"""

from __future__ import annotations

import copy
import inspect
import math

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

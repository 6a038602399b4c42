"""Time cuDNN's convolution algorithms before the first step, while the compile-cache artifact loads beside it.

With `cudnn.benchmark`, PyTorch times cuDNN's candidate algorithms the first time it meets a convolution shape,
forward and both halves of backward, and keeps the fastest. At the top rung's batch of 4096 that timing is part
of the first step. The shapes are known from the config alone, before the data, the model or the compiled graph
exist, so `warm_while(cfg, device, load)` times them on this thread while `load` (the artifact: files and Python)
runs in another; the timing is GPU work inside cuDNN, which releases the GIL.

The timing must run on the threads that train. PyTorch keeps the timed choices per thread (its cuDNN v8 cache is
thread_local: an execution plan is tied to its thread's cuDNN handle), and a choice is found again only by the same
shape, dtype, memory format and switches. So the forward convolutions run here, on the thread that will run the
model's forward, and their backward goes through autograd, whose device thread runs every backward on that GPU
(the compiled graph's too). A warm-up timed in a thread of its own filled a cache no step reads
(`benchmarks/results/cold_start_warmup.json`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from labkit.presets import AUTOCAST, TF32, TrainConfig

IMAGE = (3, 32, 32)  # every dataset labkit.data loads is 32x32 RGB


@dataclass(frozen=True)
class ConvShape:
    """One convolution call of the training step, as the cuDNN algorithm cache sees it."""

    input: tuple[int, ...]     # N, C, H, W of the convolution's input
    weight: tuple[int, ...]    # out channels, in channels / groups, kH, kW
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    input_grad: bool           # whether backward computes the input's gradient (not for the image)


def micro_batch(cfg: TrainConfig, world_size: int = 1) -> int:
    """Images per forward call: the batch split across ranks and accumulation steps."""
    return cfg.batch_size // world_size // cfg.accumulation


def conv_shapes(cfg: TrainConfig, world_size: int = 1, image: tuple[int, int, int] = IMAGE) -> list[ConvShape]:
    """The distinct convolution calls of one training step of `cfg`'s ResNet-18: one image through the model on
    the CPU (milliseconds; the meta device would import torch's compiler first), each input's batch then set to
    the micro-batch."""
    import torch
    from torch import nn

    from labkit.models import resnet18

    shapes: dict[ConvShape, None] = {}
    n = micro_batch(cfg, world_size)

    def hook(m, inp, out):
        shapes[ConvShape((n, *inp[0].shape[1:]), tuple(m.weight.shape), tuple(m.stride), tuple(m.padding),
                         tuple(m.dilation), m.groups, inp[0].requires_grad)] = None

    model = resnet18(width=cfg.width).eval()
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.enable_grad():
        model(torch.zeros(1, *image))
    return list(shapes)


def applies(cfg: TrainConfig, device) -> bool:
    """Whether a warm-up has anything to do: cuDNN autotuning on, on a CUDA device with cuDNN."""
    import torch

    return (cfg.cudnn_warmup and cfg.cudnn_benchmark and getattr(device, "type", None) == "cuda"
            and torch.backends.cudnn.is_available())


def warm_while(cfg: TrainConfig, device, load, world_size: int = 1, work=None):
    """Run `load()` in a thread while this thread times `cfg`'s convolutions; returns (load's result, report).

    The report is None where nothing applies (`applies`), else shapes (distinct convolutions timed), seconds
    (the timing's own), waited_s (how long `load` took beyond it) and error (None, or one line: the first step
    then times what is missing itself; the warm-up only saves time, so it never fails the run). An exception
    from `load` is raised here, after the timing. `work(shapes)` replaces the timing (tests).
    """
    if not applies(cfg, device):
        return load(), None
    box: dict = {}

    def run_load():
        try:
            box["result"] = load()
        except BaseException as e:  # noqa: BLE001  (re-raised on the calling thread)
            box["error"] = e

    loader = threading.Thread(target=run_load, name="labkit-load-beside-warmup", daemon=True)
    loader.start()
    shapes = conv_shapes(cfg, world_size)
    t0 = time.perf_counter()
    error = None
    try:
        (work or (lambda sh: time_algorithms(cfg, device, sh)))(shapes)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    seconds = time.perf_counter() - t0
    loader.join()
    report = {"shapes": len(shapes), "seconds": seconds, "waited_s": time.perf_counter() - t0 - seconds,
              "error": error}
    if "error" in box:
        raise box["error"]
    return box.get("result"), report


def time_algorithms(cfg: TrainConfig, device, shapes: list[ConvShape]) -> None:
    """Run each shape's forward convolution on this thread and its backward through autograd, under
    cudnn.benchmark in `cfg`'s dtype and memory format, so cuDNN's timed choices are cached where training
    looks them up."""
    import torch
    import torch.nn.functional as F

    from labkit.env import torch_switches

    dtype = getattr(torch, AUTOCAST.get(cfg.precision, "float32"))
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    with torch.cuda.device(device), torch_switches(tf32=TF32.get(cfg.precision), cudnn_benchmark=True,
                                                   cudnn_limit=cfg.cudnn_limit), torch.enable_grad():
        gen = torch.Generator(device=device).manual_seed(0)  # not the default generator: training's seeds stay as set

        def rand(shape, grad=False):
            t = torch.randn(shape, device=device, dtype=dtype, generator=gen).contiguous(memory_format=fmt)
            return t.requires_grad_(grad)

        for s in shapes:
            x, w = rand(s.input, s.input_grad), rand(s.weight, True)
            y = F.conv2d(x, w, None, s.stride, s.padding, s.dilation, s.groups)
            y.backward(rand(y.shape))
            del x, w, y
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the activations it allocated are the caller's memory again, not this cache's

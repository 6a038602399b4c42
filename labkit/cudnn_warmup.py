"""Time cuDNN's convolution algorithms in a thread, while the process loads, instead of in the first step.

With `cudnn.benchmark`, PyTorch times cuDNN's candidate algorithms the first time it meets a convolution shape,
forward and both halves of backward, and keeps the fastest for the rest of the process. At the top rung's batch
of 4096 that timing is seconds of the first step. The shapes are known from the config alone, before the data,
the model or the compiled graph exist, so `start()` times them in a thread while the main thread loads the
compile-cache artifact, the data and the model. That work is Python and files; the timing is GPU work inside
cuDNN, which runs without the GIL. The training loop calls `wait()` before its first step, so no timing runs
beside the step's own kernels.

The algorithm cache is keyed by shape, dtype, memory format and the TF32/deterministic switches, not by the tensors,
so convolutions of random tensors of the same shapes fill the entries the model's convolutions (eager or inside a
compiled graph) look up.
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
    """The distinct convolution calls of one training step of `cfg`'s ResNet-18, found on the meta device (no
    memory, no kernels)."""
    import torch
    from torch import nn

    from labkit.models import resnet18

    shapes: dict[ConvShape, None] = {}

    def hook(m, inp, out):
        shapes[ConvShape(tuple(inp[0].shape), tuple(m.weight.shape), tuple(m.stride), tuple(m.padding),
                         tuple(m.dilation), m.groups, inp[0].requires_grad)] = None

    with torch.device("meta"):
        model = resnet18(width=cfg.width)
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.register_forward_hook(hook)
        with torch.enable_grad():
            model(torch.empty(micro_batch(cfg, world_size), *image))
    return list(shapes)


def applies(cfg: TrainConfig, device) -> bool:
    """Whether a warm-up has anything to do: cuDNN autotuning on, on a CUDA device with cuDNN."""
    import torch

    return (cfg.cudnn_warmup and cfg.cudnn_benchmark and getattr(device, "type", None) == "cuda"
            and torch.backends.cudnn.is_available())


class Warmup:
    """A thread timing `shapes` on `device`; `wait()` joins it and returns what it did.

    `work(shapes)` does the timing (the default, `time_algorithms`, needs CUDA); any exception it raises is
    recorded, not raised: the first step then times what is missing itself.
    """

    def __init__(self, shapes: list[ConvShape], work):
        self.shapes = shapes
        self._work = work
        self._seconds: float | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="labkit-cudnn-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._work(self.shapes)
        except Exception as e:  # noqa: BLE001  (the warm-up only saves time; training must not fail for it)
            self._error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        self._seconds = time.perf_counter() - t0

    def wait(self) -> dict:
        """Block until the timing is done. Returns shapes (distinct convolutions timed), seconds (the thread's
        own time), waited_s (how long this call blocked: the part of the warm-up the caller did not hide) and
        error (None, or one line)."""
        t0 = time.perf_counter()
        self._thread.join()
        return {"shapes": len(self.shapes), "seconds": self._seconds, "waited_s": time.perf_counter() - t0,
                "error": self._error}


def start(cfg: TrainConfig, device, world_size: int = 1) -> Warmup | None:
    """Start timing `cfg`'s convolutions on `device` in a thread; None where nothing applies (`applies`).

    Until `wait()` returns, the thread holds the process's cuDNN switches (benchmark, its limit, TF32) at
    `cfg`'s values: the caller runs no convolutions of its own before then.
    """
    if not applies(cfg, device):
        return None
    return Warmup(conv_shapes(cfg, world_size), lambda shapes: time_algorithms(cfg, device, shapes))


def time_algorithms(cfg: TrainConfig, device, shapes: list[ConvShape]) -> None:
    """Run each shape's forward and backward convolution once under cudnn.benchmark, in `cfg`'s dtype and memory
    format, so cuDNN's timed choice for each is cached for the process."""
    import torch

    from labkit.env import torch_switches

    dtype = getattr(torch, AUTOCAST.get(cfg.precision, "float32"))
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    conv, conv_backward = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
    with torch.cuda.device(device), torch_switches(tf32=TF32.get(cfg.precision), cudnn_benchmark=True,
                                                   cudnn_limit=cfg.cudnn_limit), torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(0)  # not the default generator: training's seeds stay as set

        def rand(shape):
            return torch.randn(shape, device=device, dtype=dtype, generator=gen).contiguous(memory_format=fmt)

        for s in shapes:
            x, w = rand(s.input), rand(s.weight)
            args = (s.stride, s.padding, s.dilation, False, [0] * len(s.padding), s.groups)
            y = conv(x, w, None, *args)
            conv_backward(rand(y.shape), x, w, None, *args, [s.input_grad, True, False])
            del x, w, y
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the activations it allocated are the caller's memory again, not this cache's

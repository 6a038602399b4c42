"""Time cuDNN's backward convolution algorithms in a thread while the process loads (`TrainConfig.cudnn_warmup`).

With `cudnn.benchmark`, PyTorch times cuDNN's candidate algorithms the first time it meets a convolution shape,
forward and both halves of backward, and keeps the fastest. At the top rung's batch of 4096 that timing is part
of the first step. The shapes are known from the config alone, before the data, the model or the compiled graph
exist, so `start()` times them while the main thread loads the compile-cache artifact, the data and the model.

PyTorch keeps the timed choices per thread (its cuDNN v8 cache is thread_local: an execution plan is tied to its
thread's cuDNN handle), so a choice is found again only on the thread that timed it. Backward is what another
thread can reach: autograd runs every backward on a GPU in that device's own worker thread, the compiled graph's
backward too. So the warm-up's thread hands each backward convolution to autograd and waits, the GIL released,
while cuDNN times it there, and the step's backward finds the choice. The forward convolutions run on the thread
that calls the model, so their timing stays in the first step.

Measured on an H100 with the top rung's artifact, on and off in alternating fresh processes: timing on a thread
of its own filled a cache no step reads (`benchmarks/results/coldstart/cold_start_warmup_thread.json`); timing on the
training thread with the artifact loading beside it shortened the first step but not the whole run
(`cold_start_warmup_main.json`); this design left both within noise (`cold_start_warmup.json`) where the first
step waited for the compiled forward. Beside the tiered start (`labkit.faststart.tiered`), whose first step runs eager,
it shortened the whole run in every round (`cold_start_tiered_warmup_rounds.json`), so `TrainConfig.cudnn_warmup`
is None by default: on where `labkit train` starts tiered, off elsewhere.
"""

from __future__ import annotations

import contextlib
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


def conv_calls(cfg: TrainConfig, world_size: int = 1, image: tuple[int, int, int] = IMAGE) -> list[ConvShape]:
    """Every convolution call of one training step of `cfg`'s ResNet-18, in order, repeats included: one image
    through the model on the CPU (`labkit.models.layer_macs`; milliseconds, where the meta device would import
    torch's compiler first), each input's batch then set to the micro-batch."""
    import torch
    from torch import nn

    from labkit.models import layer_macs, resnet18

    with torch.random.fork_rng(devices=[]):  # the model's initialisation leaves the caller's random stream alone
        model = resnet18(width=cfg.width)
    n = micro_batch(cfg, world_size)
    return [ConvShape((n, *r["input_shape"][1:]), tuple(m.weight.shape), tuple(m.stride), tuple(m.padding),
                      tuple(m.dilation), m.groups, r["input_grad"])
            for r in layer_macs(model, (1, *image)) if isinstance(m := r["layer"], nn.Conv2d)]


def conv_shapes(cfg: TrainConfig, world_size: int = 1, image: tuple[int, int, int] = IMAGE) -> list[ConvShape]:
    """The distinct convolution calls of one training step (`conv_calls` without repeats), in order."""
    return list(dict.fromkeys(conv_calls(cfg, world_size, image)))


def applies(cfg: TrainConfig, device) -> bool:
    """Whether a warm-up has anything to do: cuDNN autotuning on, on a CUDA device with cuDNN."""
    import torch

    return (bool(cfg.cudnn_warmup) and cfg.cudnn_benchmark and getattr(device, "type", None) == "cuda"
            and torch.backends.cudnn.is_available())


class Warmup:
    """A thread running `work(shapes)`; `wait()` joins it and reports. An exception from `work` is recorded, not
    raised: the warm-up only saves time, and the first step times whatever is missing itself."""

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
        except Exception as e:  # noqa: BLE001
            from labkit.env import error_line

            self._error = error_line(e)
        self._seconds = time.perf_counter() - t0

    def wait(self) -> dict:
        """Block until the warm-up is done. Returns shapes (distinct convolutions), seconds (the thread's own time),
        waited_s (how long this call blocked: the part the caller did not hide) and error (None, or one line)."""
        t0 = time.perf_counter()
        self._thread.join()
        return {"shapes": len(self.shapes), "seconds": self._seconds, "waited_s": time.perf_counter() - t0,
                "error": self._error}


def start(cfg: TrainConfig, device, world_size: int = 1) -> Warmup | None:
    """Start timing `cfg`'s backward convolutions on `device`; None where nothing applies (`applies`).

    Until `wait()` returns, the warm-up holds the process's cuDNN switches (benchmark, its limit, TF32) at `cfg`'s
    values and uses autograd's device thread: the caller runs no convolution and no backward of its own before.
    """
    if not applies(cfg, device):
        return None
    return Warmup(conv_shapes(cfg, world_size), lambda shapes: time_backward(cfg, device, shapes))


def out_shape(s: ConvShape) -> tuple[int, ...]:
    """The output shape of convolution `s`: N, out channels, H, W."""
    hw = [(n + 2 * p - d * (k - 1) - 1) // st + 1
          for n, k, st, p, d in zip(s.input[2:], s.weight[2:], s.stride, s.padding, s.dilation, strict=True)]
    return (s.input[0], s.weight[0], *hw)


def time_backward(cfg: TrainConfig, device, shapes: list[ConvShape]) -> None:
    """Give autograd each shape's backward convolution (input and weight gradients) under cudnn.benchmark, in
    `cfg`'s dtype and memory format, so cuDNN's timed choices are cached in autograd's thread for `device`."""
    import torch

    from labkit.env import torch_switches

    class ConvBackward(torch.autograd.Function):
        """A node whose backward is the convolution's backward; its forward computes nothing."""

        @staticmethod
        def forward(ctx, x, w, s):
            ctx.save_for_backward(x, w)
            ctx.s = s
            return x.new_empty(out_shape(s))  # only its shape matters: backward gets the gradient it is given

        @staticmethod
        def backward(ctx, gy):
            x, w = ctx.saved_tensors
            s = ctx.s
            gx, gw, _ = torch.ops.aten.convolution_backward(gy, x, w, None, s.stride, s.padding, s.dilation, False,
                                                            [0] * len(s.padding), s.groups, [s.input_grad, True, False])
            return gx, gw, None

    dtype = getattr(torch, AUTOCAST.get(cfg.precision, "float32"))
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    cuda = torch.device(device).type == "cuda"  # on a CPU (tests) the same nodes run, with nothing to time
    with torch.cuda.device(device) if cuda else contextlib.nullcontext(), torch.enable_grad(), \
            torch_switches(tf32=TF32.get(cfg.precision), cudnn_benchmark=True, cudnn_limit=cfg.cudnn_limit):
        gen = torch.Generator(device=device).manual_seed(0)  # not the default generator: training's seeds stay as set

        def rand(shape, grad=False):
            t = torch.randn(shape, device=device, dtype=dtype, generator=gen).contiguous(memory_format=fmt)
            return t.requires_grad_(grad)

        for s in shapes:
            x, w = rand(s.input, s.input_grad), rand(s.weight, True)
            ConvBackward.apply(x, w, s).backward(rand(out_shape(s)))
            del x, w
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the tensors it allocated are the caller's memory again, not this cache's


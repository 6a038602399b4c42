"""What the sandbox of a lab that bans torch's GradScaler shows in place of torch's grad-scaler modules.

Lab 1 asks for loss scalers written without `torch.amp.GradScaler`. The grader's reader catches the class named
in the student's file (autograder.labkit_answers.TORCH_BANNED), but a name built at run time, a pickle or a search
of torch.amp's attributes found it all the same. In that lab's sandbox this file is bound over
`torch/amp/grad_scaler.py` and `torch/distributed/fsdp/sharded_grad_scaler.py` (their bytecode is hidden too), so
torch imports as usual and every way to the class reaches this one, which refuses to be built. The names torch's
other modules import from those files are here so that importing torch, torch.cuda.amp or torch.cpu.amp still works.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["OptState", "GradScaler", "ShardedGradScaler"]

MESSAGE = ("torch's GradScaler is not available when this lab is graded: the lab asks for the scaler written "
           "without it (see its instructions)")


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class GradScaler:
    """Refuses to be built, by any route: the lab's answer is a scaler of the student's own."""

    def __new__(cls, *args, **kwargs):
        raise RuntimeError(MESSAGE)

    def __getattr__(self, name):  # an instance made without __new__ (object.__new__) has no method of torch's
        raise RuntimeError(MESSAGE)


ShardedGradScaler = GradScaler


class _MultiDeviceReplicator:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(MESSAGE)


def _refresh_per_optimizer_state():
    raise RuntimeError(MESSAGE)

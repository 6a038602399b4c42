"""What every variant of lab 3's slow_train.py shares: the data, the model, and loading a variant's source.

Each student's slow_train.py is rendered by the grader (autograder.checks.lab3_variants, instructor-only) from the course
secret and the student id; they all build on the `make_data` and `Net` below, so the probes can run a student's
fixed `train` on the same data and model as the slow one. The baseline's process receives the variant's source
from the trusted side and loads it with `load`.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN = torch.tensor([0.4914, 0.4822, 0.4465])
STD = torch.tensor([0.2470, 0.2435, 0.2616])


def make_data(n: int = 2048, seed: int = 0):
    """uint8 images (n, 32, 32, 3) and int64 labels (n,), as they would come from disk: learnable, 10 classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    colours = torch.rand(10, 3, generator=g) * 60 + 100
    stripes = (torch.arange(32)[None, :] * (labels[:, None] % 5 + 1) / 32 * 3.14159).sin()
    img = colours[labels][:, None, None, :] + 40 * stripes[:, None, :, None] * (labels[:, None, None, None] >= 5)
    img = img + torch.randn(n, 32, 32, 3, generator=g) * 90
    return img.clamp(0, 255).to(torch.uint8), labels


class Net(nn.Module):
    """A small CNN: a strided 3x3 convolution, pooling, a second convolution, pooling, one linear layer."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.c1 = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def load(source: str) -> types.ModuleType:
    """A slow_train.py variant's source as a module named slow_train (the trusted side rendered it)."""
    mod = types.ModuleType("slow_train")
    exec(compile(source, "slow_train.py", "exec"), mod.__dict__)  # noqa: S102  (the grader's own rendering)
    return mod

"""The top rung's ResNet-18 cut at its stage boundaries into regions that run in turn (benchmarks/compile_regions.py).

Its own module, imported by name: a region compiled ahead of time and saved (torch's aot_compile) refers to the
classes it was traced through by module and name, so the process that loads it must import them from here.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

# The model as 10 pieces (stem, 8 residual blocks, pooling and classifier); a split cuts it between pieces, so
# each region's input has one fixed shape. Up to 4 regions the cuts fall at stage boundaries; 5 pairs the pieces
# and 10 gives every piece its own region.
CUTS = {1: [0, 10], 2: [0, 5, 10], 3: [0, 3, 7, 10], 4: [0, 3, 5, 7, 10], 5: [0, 2, 4, 6, 8, 10],
        10: list(range(11))}
# (channels, side) of the activation entering piece c, at width 64 and 32x32 images
ENTERING = {0: (3, 32), 1: (64, 32), 2: (64, 32), 3: (64, 32), 4: (128, 16), 5: (128, 16), 6: (256, 8), 7: (256, 8),
            8: (512, 4), 9: (512, 4)}


class Stem(nn.Module):
    """The model's first convolution, BatchNorm and ReLU (its own modules, shared)."""

    def __init__(self, model):
        super().__init__()
        self.conv1, self.bn1 = model.conv1, model.bn1

    def forward(self, x):
        return F.relu(self.bn1(self.conv1(x)))


class Head(nn.Module):
    """The model's pooling and classifier (its own modules, shared)."""

    def __init__(self, model):
        super().__init__()
        self.fc = model.fc

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def pieces(model) -> list:
    """The model's 10 pieces, in order, each a module sharing the model's parameters."""
    return [Stem(model), *model.layers, Head(model)]


def regions(model, k: int) -> list:
    """The model as k nn.Sequential regions (CUTS), sharing its parameters."""
    p, cuts = pieces(model), CUTS[k]
    return [nn.Sequential(*p[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

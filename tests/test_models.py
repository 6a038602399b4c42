"""labkit.models: the FLOP count of a training step against torch's own FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.models import count_macs, resnet18, train_flops_per_image


def _counted(model, x, backward: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("width,size", [(4, 16), (8, 64)])
def test_train_flops_match_torch_flop_counter_exactly(width, size):
    torch.manual_seed(0)
    model = resnet18(width=width)
    batch = 2
    x = torch.randn(batch, 3, size, size)
    assert _counted(model, x, backward=False) == 2 * count_macs(model, (1, 3, size, size)) * batch
    assert _counted(model, x, backward=True) == train_flops_per_image(model, size) * batch
    # the old count (6 FLOPs per forward MAC) included the image's gradient, which autograd never computes
    stem = 2 * 3 * 9 * width * size * size
    assert 6 * count_macs(model, (1, 3, size, size)) - train_flops_per_image(model, size) == stem


def test_frozen_weights_are_not_counted_twice():
    model = resnet18(width=4)
    full = train_flops_per_image(model, 16)
    model.fc.weight.requires_grad_(False)
    assert train_flops_per_image(model, 16) == full - 2 * model.fc.in_features * model.fc.out_features


def test_docstring_figures_at_full_width():
    model = resnet18()
    import labkit.models as M

    assert f"{count_macs(model) / 1e9:.4f} GMAC" in M.__doc__
    assert f"{train_flops_per_image(model) / 1e9:.3f} GFLOP" in M.__doc__

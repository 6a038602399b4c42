"""labkit.models: the FLOP count of a training step against torch's own FLOP counter; the matmul edges."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.models import MatmulConv2d, count_macs, resnet18, train_flops_per_image


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


@pytest.mark.parametrize("cin,cout,k,stride,pad,bias,size", [
    (3, 16, 3, 1, 1, False, 12),   # the stem: 27-long patches, padded to 32
    (8, 16, 1, 2, 0, False, 12),   # a shortcut
    (5, 7, 3, 2, 1, True, 11),     # odd sizes, a bias and an odd input
])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_convolution_as_a_matrix_product_gives_the_convolutions_result_and_gradients(cin, cout, k, stride, pad,
                                                                                         bias, size, channels_last):
    torch.manual_seed(0)
    m = MatmulConv2d(cin, cout, k, stride, pad, bias=bias).double()
    x = torch.randn(3, cin, size, size, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    ref, out = torch.nn.functional.conv2d(x, m.weight, m.bias, stride, pad), m.as_matmul(x)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, [x, *m.parameters()], g)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kw", [dict(groups=2), dict(dilation=2), dict(padding="same"), dict(padding_mode="reflect")])
def test_a_matmul_convolution_refuses_what_its_product_does_not_compute(kw):
    with pytest.raises(ValueError, match="plain convolutions only"):
        MatmulConv2d(4, 8, 3, **{"padding": 1, **kw})


def test_matmul_edges_are_the_same_model_and_compile_to_matrix_products():
    """Same parameters, initialisation and FLOP count; eager runs cuDNN's convolution, torch.compile the product."""
    torch.manual_seed(0)
    plain = resnet18(width=8)
    torch.manual_seed(0)
    edges = resnet18(width=8, matmul_edges=True)
    assert list(plain.state_dict()) == list(edges.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), edges.state_dict().values(), strict=True))
    assert train_flops_per_image(edges) == train_flops_per_image(plain)
    swapped = [n for n, m in edges.named_modules() if isinstance(m, MatmulConv2d)]
    assert swapped == ["conv1", "layers.2.shortcut.0", "layers.4.shortcut.0", "layers.6.shortcut.0"]
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(edges(x), plain(x))

    traced = []

    def backend(gm, inputs):
        traced.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(edges, backend=backend)(x), plain(x))
    assert sum("conv2d" in t for t in traced) == 16  # 20 convolutions, 4 of them now matrix products
    assert sum("matmul" in t for t in traced) == 4

"""ResNet-18, CIFAR variant: 3x3 stem convolution, no max-pool, so 32x32 inputs keep spatial detail.

Forward cost at 32x32: 0.5554 GMAC per image (`count_macs`). One training step computes each conv/linear
layer's forward, its weight gradient and the gradient of its input, except the first layer's (the image needs
none): 6 FLOPs per MAC less 2 per MAC of the stem, 3.329 GFLOP per image (`train_flops_per_image`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MatmulConv2d(nn.Conv2d):
    """A Conv2d (same weight, same result) that torch.compile computes as one matrix product over its patches.

    For the two convolutions of ResNet-18 that cuDNN runs far below its rate elsewhere in the network
    (`benchmarks/results/ladder/top_rung_conv_shapes_h200.json`, batch 4096 on an H200): the 3x3 stem over 3 input
    channels (17-21 TFLOP/s, where the 3x3 convolutions run 282-744) and the 1x1 stride-2 shortcuts, whose input
    gradient cuDNN writes at full resolution, three zeros in four. As a matrix product over channels_last patches,
    inductor fuses the patch gather into one kernel and the shortcut's sparse input gradient into the add it flows
    into (`top_rung_matmul_edges_h200.json`). Eager, the gather is several kernels and the step is slower
    (`top_rung_matmul_edges_eager_h200.json`), so outside torch.compile this is cuDNN's convolution.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.groups != 1 or self.dilation != (1, 1) or self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise ValueError("MatmulConv2d computes plain convolutions only: groups 1, dilation 1, numeric zero "
                             f"padding (got groups={self.groups}, dilation={self.dilation}, padding={self.padding!r}, "
                             f"padding_mode={self.padding_mode!r})")

    def forward(self, x):
        if not torch.compiler.is_compiling():
            return super().forward(x)
        return self.as_matmul(x)

    def as_matmul(self, x):
        """The convolution of `x` as patches @ weight (zero padding, groups and dilation 1); an NCHW-shaped result
        in channels_last memory. The patch length is padded to a multiple of 8 so a bf16 product can use tensor
        cores."""
        kh, kw = self.kernel_size
        sh, sw = self.stride
        ph, pw = self.padding
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph))
        b, c = x.shape[:2]
        ho, wo = (x.shape[2] - kh) // sh + 1, (x.shape[3] - kw) // sw + 1
        taps = [x[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] for i in range(kh) for j in range(kw)]
        cols = (taps[0] if len(taps) == 1 else torch.cat(taps, dim=1)).permute(0, 2, 3, 1).reshape(b * ho * wo, -1)
        w = self.weight.permute(0, 2, 3, 1).reshape(self.out_channels, -1)  # (out, kh*kw*c), the taps' order
        if (k := cols.shape[1]) % 8:
            cols, w = F.pad(cols, (0, 8 - k % 8)), F.pad(w, (0, 8 - k % 8))
        out = cols @ w.t()
        if self.bias is not None:
            out = out + self.bias
        return out.view(b, ho, wo, self.out_channels).permute(0, 3, 1, 2)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, matmul_edges: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            conv = MatmulConv2d if matmul_edges else nn.Conv2d
            self.shortcut = nn.Sequential(conv(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: widths 64-128-256-512, two BasicBlocks per stage."""

    def __init__(self, num_classes: int = 10, width: int = 64, matmul_edges: bool = False):
        super().__init__()
        w = width
        self.conv1 = (MatmulConv2d if matmul_edges else nn.Conv2d)(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        layers, in_planes = [], w
        for i, planes in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(in_planes, planes, stride, matmul_edges), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def resnet18(num_classes: int = 10, width: int = 64, zero_init_residual: bool = False,
             matmul_edges: bool = False) -> ResNet18:
    """The CIFAR-variant ResNet-18 (width=64 is the standard model; smaller widths make CPU tests fast).

    zero_init_residual: start the last BatchNorm scale of every block at 0, so each block begins as the identity
    (plus its shortcut) and the network starts shallow; large-batch recipes use it to survive high learning rates.
    """
    model = ResNet18(num_classes=num_classes, width=width, matmul_edges=matmul_edges)
    if zero_init_residual:  # after the default init, so the random stream (and every other weight) is unchanged
        for block in model.layers:
            nn.init.zeros_(block.bn2.weight)
    return model


def layer_macs(model: nn.Module, input_shape=(1, 3, 32, 32)) -> list[dict]:
    """Per conv/linear layer call of one forward pass: its multiply-accumulates (per input, batch 1 assumed),
    its input's shape, and whether autograd will compute the gradient of its input and of its weight.

    Runs the forward with autograd on (eval mode, zeros input), so `input_grad` is exactly what backward
    will compute: False for a layer fed the image (or anything else that does not require grad).
    """
    rows: list[dict] = []

    def conv_hook(m, inp, out):
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        rows.append({"layer": m, "macs": out.numel() // out.shape[0] * k, "input_shape": tuple(inp[0].shape),
                     "input_grad": inp[0].requires_grad, "weight_grad": m.weight.requires_grad})

    def linear_hook(m, inp, out):
        rows.append({"layer": m, "macs": out.numel() // out.shape[-1] // out.shape[0] * m.in_features
                     * m.out_features, "input_shape": tuple(inp[0].shape), "input_grad": inp[0].requires_grad,
                     "weight_grad": m.weight.requires_grad})

    hooks = [m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_hook(linear_hook) for m in model.modules() if isinstance(m, nn.Linear)]
    was_training = model.training
    try:
        model.eval()
        with torch.enable_grad():
            p = next(model.parameters())
            model(torch.zeros(input_shape, device=p.device, dtype=p.dtype))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return rows


def count_macs(model: nn.Module, input_shape=(1, 3, 32, 32)) -> int:
    """Multiply-accumulates of one forward pass of a single input, counted from conv and linear layers."""
    return sum(r["macs"] for r in layer_macs(model, input_shape))


def train_flops_per_image(model: nn.Module, image_size: int = 32) -> float:
    """FLOPs (2 per MAC) of one training step per image, counting what autograd computes for conv and linear
    layers: the forward, each weight gradient, and each input gradient except where the input needs none
    (the image). `torch.utils.flop_counter.FlopCounterMode` counts the same operations and agrees exactly.
    """
    rows = layer_macs(model, (1, 3, image_size, image_size))
    return 2.0 * sum(r["macs"] * (1 + r["input_grad"] + r["weight_grad"]) for r in rows)

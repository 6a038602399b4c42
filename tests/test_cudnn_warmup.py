"""labkit.faststart.cudnn_warmup: the convolutions it times, when it runs, and that it never fails or changes a run."""

import torch
import torch.nn.functional as F

from labkit.faststart import cudnn_warmup as CW
from labkit.presets import preset, with_changes
from labkit.train import micro_batch, train

TOP = preset("muon")


def test_conv_shapes_are_the_resnet18_steps_distinct_convolutions_at_the_micro_batch():
    shapes = CW.conv_shapes(TOP)
    assert len(shapes) == 11  # the stem, layer1's 3x3, and three per later stage (two 3x3 and the 1x1 shortcut)
    calls = CW.conv_calls(TOP)  # every call, repeats included: 20 convolutions, in the step's order
    assert len(calls) == 20 and list(dict.fromkeys(calls)) == shapes
    assert {s.input[0] for s in shapes} == {TOP.batch_size}
    assert [s.input_grad for s in shapes] == [False] + [True] * 10  # no gradient for the image
    assert shapes[0].input == (TOP.batch_size, 3, 32, 32) and shapes[0].weight == (64, 3, 3, 3)
    assert {s.input[0] for s in CW.conv_shapes(with_changes(TOP, accumulation=2), world_size=2)} == {1024}
    for cfg, world in ((TOP, 1), (with_changes(TOP, accumulation=2), 2), (with_changes(TOP, batch_size=96), 4)):
        assert CW.micro_batch(cfg, world) == micro_batch(cfg, world)  # the warm-up's micro-batch is the step's
    assert CW.conv_shapes(with_changes(TOP, width=16))[1].weight == (16, 16, 3, 3)
    # matmul_edges: compiled, the stem and the shortcuts are matrix products, but a tiered start's eager steps
    # (where the warm-up runs by default) still run them on cuDNN
    assert CW.conv_shapes(with_changes(TOP, matmul_edges=True)) == shapes


def test_out_shape_is_what_the_convolution_returns():
    for s in CW.conv_shapes(with_changes(TOP, batch_size=2, width=8)):
        y = F.conv2d(torch.zeros(s.input), torch.zeros(s.weight), None, s.stride, s.padding, s.dilation, s.groups)
        assert CW.out_shape(s) == tuple(y.shape)


def test_backward_nodes_run_and_leave_the_switches_and_the_seeds_as_they_were():
    cfg = with_changes(TOP, batch_size=2, width=8)
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit,
              torch.get_float32_matmul_precision())
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    CW.time_backward(cfg, "cpu", CW.conv_shapes(cfg))  # on a CPU the same autograd nodes run, nothing is timed
    assert torch.equal(torch.rand(3), expected)  # its random tensors come from a generator of its own
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit,
            torch.get_float32_matmul_precision()) == before


def test_it_starts_only_where_cudnn_autotunes_on_a_gpu_and_is_off_by_default():
    assert TOP.cudnn_warmup is None and TOP.cudnn_benchmark is True  # None: on only where labkit train starts tiered
    on = with_changes(TOP, cudnn_warmup=True)
    assert CW.start(on, torch.device("cpu")) is None
    assert not CW.applies(TOP, torch.device("cuda"))
    assert not CW.applies(with_changes(on, cudnn_benchmark=False), torch.device("cuda"))


def test_a_failing_warmup_is_reported_not_raised():
    report = CW.Warmup([], lambda shapes: (_ for _ in ()).throw(RuntimeError("CUDA out of memory\nmore"))).wait()
    assert report["error"] == "RuntimeError: CUDA out of memory" and report["shapes"] == 0
    assert report["seconds"] >= 0 and report["waited_s"] >= 0


def test_a_run_records_no_warmup_where_none_applies():
    cfg = with_changes(preset("channels_last"), n_train=64, n_test=32, batch_size=32, epochs=1, width=8,
                       cudnn_warmup=True, loader="resident", workers=0)
    assert train(cfg, "cpu")["cudnn_warmup"] is None

"""Week 7's checks: labkit's kernels pass, wrong kernels fail saying what is wrong, the timing helpers and the
benchmark's loading of the notebook's answers work (on a CPU, in Triton's interpreter)."""

import importlib.util
import math
import os
import sys

import pytest
import torch

from labkit import data as D
from labkit import exercises as ex
from labkit import kernels_bench as kb
from labkit import week7_exercises as w7
from labkit.bench import Timing
from labkit.env import REPO_ROOT, LabkitError

try:
    w7.load_triton()
    HAVE_TRITON = True
except w7.TritonMissing:
    HAVE_TRITON = False
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable here")


def _bench_module():
    spec = importlib.util.spec_from_file_location("triton_kernels_bench", REPO_ROOT / "benchmarks" / "triton_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_composition_is_the_top_rungs_data_path():
    """torch_augment_normalize with augment_batch's own draws gives exactly augment_batch, then normalize."""
    x = torch.randint(0, 256, (6, 3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = D.normalize(D.augment_batch(x, torch.Generator().manual_seed(5), pad=3))
    g = torch.Generator().manual_seed(5)  # the same draws, in augment_batch's order
    oy, ox = torch.randint(0, 7, (6,), generator=g), torch.randint(0, 7, (6,), generator=g)
    flip = torch.rand(6, generator=g) < 0.5
    got = w7.torch_augment_normalize(x, oy, ox, flip, torch.tensor(D.CIFAR_MEAN), torch.tensor(D.CIFAR_STD), 3)
    assert torch.equal(got, want)


@needs_triton
def test_labkits_kernels_pass_and_count_as_launches():
    for eid in ("7.1", "7.2", "7.3", "7.4"):
        assert "right" in ex.check(eid, ex.reference(eid), quiet=True)
    ref = ex.reference("7.2")
    x = torch.randn(2, 3, 4, 4)
    with w7.count_launches() as n:
        ref(x, torch.ones(3), torch.zeros(3))
    assert n[0] == 1
    with w7.count_launches() as n:
        w7.torch_bn_relu(x, torch.ones(3), torch.zeros(3))
    assert n[0] == 0


@needs_triton
@pytest.mark.parametrize("wrong, message", [
    (lambda x, oy, ox, flip, m, s, pad: ex.reference("7.1")(x, oy, ox, torch.zeros_like(flip), m, s, pad),
     "flip is ignored"),
    (lambda x, oy, ox, flip, m, s, pad: ex.reference("7.1")(x, oy, ox, flip, m[:1].expand(len(m)), s, pad),
     "one channel's mean"),
    (lambda x, oy, ox, flip, m, s, pad: ex.reference("7.1")(x, ox, oy, flip, m, s, pad), "rows and columns"),
    (lambda x, oy, ox, flip, m, s, pad: ex.reference("7.1")(x, oy, ox, flip, m, s, pad).double(), "float64"),
    (w7.torch_augment_normalize, "no Triton kernel ran"),
    # right numbers, but through the padded batch the prose says never to build
    (lambda x, oy, ox, flip, m, s, pad: (torch.nn.functional.pad(x, (pad,) * 4),
                                         ex.reference("7.1")(x, oy, ox, flip, m, s, pad))[1],
     r"built the padded batch \(constant_pad_nd\)"),
])
def test_a_wrong_data_path_kernel_fails_saying_why(wrong, message):
    with pytest.raises(ex.Wrong, match=message):
        ex.check("7.1", wrong, quiet=True)


@needs_triton
def test_a_blank_kernel_is_not_done():
    def blank(*args, **kwargs):
        raise NotImplementedError()

    for eid in ("7.1", "7.2", "7.3", "7.4"):
        with pytest.raises(ex.NotDone):
            ex.check(eid, blank if eid != "7.3" else type("Blank", (torch.autograd.Function,),
                                                              {"forward": staticmethod(blank),
                                                               "backward": staticmethod(blank)}), quiet=True)


@needs_triton
def test_a_wrong_bn_relu_fails_saying_why():
    ref = ex.reference("7.2")
    with pytest.raises(ex.Wrong, match="residual is ignored"):
        ex.check("7.2", lambda x, s, b, r=None: ref(x, s, b), quiet=True)
    with pytest.raises(ex.Wrong, match="after the ReLU"):
        ex.check("7.2", lambda x, s, b, r=None: ref(x, s, b) + (0 if r is None else r), quiet=True)
    with pytest.raises(ex.Wrong, match="no Triton kernel ran"):
        ex.check("7.2", w7.torch_bn_relu, quiet=True)
    # the float32 cases alone let a kernel that always stores float32 pass: a bf16 batch must come back bf16
    with pytest.raises(ex.Wrong, match="bf16 batch with a residual returned torch.float32, want torch.bfloat16"):
        ex.check("7.2", lambda x, s, b, r=None: ref(x.float(), s, b, None if r is None else r.float()), quiet=True)


@needs_triton
def test_a_wrong_backward_fails_and_the_optional_sums_may_be_skipped():
    good = ex.reference("7.3")

    class Doubled(good):
        @staticmethod
        def backward(ctx, g):
            gx, gs, gb, gr = good.backward(ctx, g)
            return 2 * gx, gs, gb, gr

    class NoSums(good):
        @staticmethod
        def backward(ctx, g):
            gx, _, _, gr = good.backward(ctx, g)
            return gx, None, None, gr

    class Eager(torch.autograd.Function):  # right numbers, no kernel in the backward
        @staticmethod
        def forward(ctx, x, scale, shift, residual=None):
            ctx.save_for_backward(x, scale, shift, residual)
            return w7.torch_bn_relu(x, scale, shift, residual)

        @staticmethod
        def backward(ctx, g):
            x, scale, shift, residual = ctx.saved_tensors
            c = x.shape[1]
            z = x * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1) + (0 if residual is None else residual)
            gz = g * (z > 0)
            return (gz * scale.view(1, c, 1, 1), (gz * x).sum((0, 2, 3)), gz.sum((0, 2, 3)),
                    None if residual is None else gz)

    with pytest.raises(ex.Wrong, match="gradient of x differs.*scale\\[c\\]"):
        ex.check("7.3", Doubled, quiet=True)
    assert "optional part" in ex.check("7.3", NoSums, quiet=True)
    with pytest.raises(ex.Wrong, match="no Triton kernel ran: BNReLU.backward"):
        ex.check("7.3", Eager, quiet=True)
    with pytest.raises(ex.Wrong, match="subclass of torch.autograd.Function"):
        ex.check("7.3", w7.torch_bn_relu, quiet=True)


def _first_block_only(fn, block=256):
    """fn with every plane of its output (or of its gradient of x) right on its first `block` positions only, as a
    kernel whose programs all read their plane's first block leaves it."""
    def spoil(t):
        t = t.clone()
        t.view(-1, t.shape[2] * t.shape[3])[:, block:] = 7.0
        return t
    return spoil, fn


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _bn_relu_first_block_kernel(x_ptr, scale_ptr, shift_ptr, res_ptr, y_ptr, C, HW, HAS_RESIDUAL: tl.constexpr,
                                    BLOCK: tl.constexpr):
        # the exercise's grid, (planes, blocks of a plane), with the block's index left out of the offsets
        plane = tl.program_id(0)
        pos = tl.arange(0, BLOCK)
        live = pos < HW
        at = plane * HW + pos
        z = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32) * tl.load(scale_ptr + plane % C) \
            + tl.load(shift_ptr + plane % C)
        if HAS_RESIDUAL:
            z += tl.load(res_ptr + at, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, tl.maximum(z, 0.0).to(y_ptr.dtype.element_ty), mask=live)


@needs_triton
def test_a_kernel_that_reads_only_the_first_block_of_each_plane_fails_saying_why():
    """Every case used to fit in one block of 256 positions, so a kernel that left the block's index out of its
    offsets passed 7.1-7.3 and was wrong on a 32 x 32 image: a plane of 33 x 35 now catches it, with its hint."""
    def bn_relu(x, scale, shift, residual=None):
        y = torch.empty_like(x)
        n, c, h, w = x.shape
        _bn_relu_first_block_kernel[(n * c, triton.cdiv(h * w, 256))](
            x, scale.float(), shift.float(), x if residual is None else residual, y, c, h * w,
            HAS_RESIDUAL=residual is not None, BLOCK=256)
        return y

    hint = "right on its first 256 positions and wrong past them.*tl.program_id\\(1\\) \\* BLOCK"
    with pytest.raises(ex.Wrong, match="33x35.*" + hint):
        ex.check("7.2", bn_relu, quiet=True)
    spoil, aug = _first_block_only(ex.reference("7.1"))
    with pytest.raises(ex.Wrong, match="2x2x33x35 batch.*" + hint):
        ex.check("7.1", lambda *a: spoil(aug(*a)), quiet=True)
    good = ex.reference("7.3")

    class FirstBlock(good):
        @staticmethod
        def backward(ctx, g):
            gx, gs, gb, gr = good.backward(ctx, g)
            return spoil(gx), gs, gb, gr

    with pytest.raises(ex.Wrong, match="the gradient of x differs.*" + hint):
        ex.check("7.3", FirstBlock, quiet=True)


@pytest.mark.parametrize("wrong, message", [
    (lambda k, n, itemsize=4, residual=False: w7.bytes_moved(k, n, itemsize, False), "residual is a tensor too"),
    (lambda k, n, itemsize=4, residual=False: w7.bytes_moved(k, n, itemsize, residual) / 1e9, "not GB"),
    (lambda k, n, itemsize=4, residual=False: n * 2 * itemsize if k == "augment_normalize"
     else w7.bytes_moved(k, n, itemsize, residual), "uint8 input is 1 byte"),
    (lambda k, n, itemsize=4, residual=False: w7.bytes_moved(k, n, itemsize, residual)
     + (n * itemsize if k == "bn_relu_backward" else 0), "never reads y"),
])
def test_wrong_byte_counts_fail_with_a_hint(wrong, message):
    with pytest.raises(ex.Wrong, match=message):
        ex.check("7.4", wrong, quiet=True)


def test_bytes_and_flops_formulas():
    assert w7.bytes_moved("augment_normalize", 10) == 50
    assert w7.bytes_moved("bn_relu", 10, 2, residual=True) == 60
    assert w7.bytes_moved("bn_relu_backward", 10, 4, residual=True) == 200
    assert w7.flops("bn_relu", 10, residual=True) == 40 and w7.flops("augment_normalize", 10, residual=True) == 30
    with pytest.raises(LabkitError, match="unknown kernel"):
        w7.bytes_moved("softmax", 10)


def test_without_triton_the_stub_defines_kernels_and_says_why(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    triton, tl, why = w7.triton_or_stub()
    assert "Linux only" in why

    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):
        return x_ptr

    assert kernel(3, 4) == 3  # left as it is: the cell defines it, nothing runs it
    with pytest.raises(w7.TritonMissing, match="Linux only"):
        triton.cdiv(3, 2)


def test_side_by_side_interleaves_and_summarizes():
    order = []
    fns = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    out = kb.side_by_side(fns, device="cpu", rounds=3, warmup=0, inner=1)
    assert set(out) == {"a", "b", "c"} and all(len(t.samples) == 3 for t in out.values())
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts one further along
    rows = kb.summarize({"k": Timing([2e-3, 1e-3, 3e-3])}, nbytes=4e6, flop=1e6)
    assert rows["k"]["median_s"] == 2e-3 and rows["k"]["gb_per_s"] == pytest.approx(2.0)
    assert rows["k"]["intensity"] == 0.25 and rows["k"]["iqr_s"] == pytest.approx(1e-3)
    assert kb.floor_seconds(3e9, 1.5e12) == pytest.approx(2e-3)
    assert kb.ceiling(0.5, 989.0, 4e12) == pytest.approx(2.0)
    with pytest.raises(LabkitError):
        kb.side_by_side({}, device="cpu")
    with pytest.raises(LabkitError):
        kb.achieved(0, 1.0)


def test_week2_roof_reads_the_record():
    roof = kb.week2_roof()
    assert roof["peak_tflops"] > 0 and roof["bandwidth"] > 0 and "recorded on" in roof["note"]
    with pytest.raises(LabkitError, match="no roofline"):
        kb.week2_roof({"env": {}})


def test_the_floors_come_from_the_card_the_kernels_were_recorded_on():
    """Section 4 printed floors at week 2's card (an H100) beside section 5's H200 times, which beat them (bn_relu
    "at least 135 µs", recorded at 109 µs): the roof is now the recorded card's, and every recorded float32 time
    takes at least the floor its bytes allow there, as the prose says."""
    from labkit.bench import load_result

    rec = load_result("triton_kernels_h200")
    roof = kb.kernels_roof(rec)
    assert roof["device_name"] == rec["env"]["device_name"] and "recorded on" in roof["note"]
    assert roof["bandwidth"] == rec["copy_bandwidth"]["bytes_per_s"] and roof["peak_tflops"] > 0
    timed = [k for k in rec["kernels"] if k["dtype"] == "float32" and k.get("contenders")]
    assert {k["kernel"] for k in timed} == set(w7.KERNELS)
    for k in timed:
        assert k["bytes"] == w7.bytes_moved(k["kernel"], math.prod(k["shape"]), 4, k.get("residual", False))
        floor = kb.floor_seconds(k["bytes"], roof["bandwidth"])
        assert all(c["median_s"] >= floor for c in k["contenders"].values()), k["kernel"]
    points = kb.recorded_points(rec)
    assert len(points) == sum(len(k["contenders"]) for k in timed)
    assert all(p["tflops"] > 0 and p["tflops"] <= kb.ceiling(p["intensity"], roof["peak_tflops"], roof["bandwidth"])
               for p in points)
    with pytest.raises(LabkitError, match="no roof"):
        kb.kernels_roof({"env": {}})


@needs_triton
def test_the_benchmark_takes_the_notebooks_worked_answers(tmp_path):
    """The answers it extracts pass the notebook's own checks; a blanked notebook falls back to labkit's."""
    bench = _bench_module()
    source = bench.worked_answers()
    assert source and ex.SOLUTION_BEGIN in source
    mod = bench.load_answers(source, tmp_path)
    ex.check("7.1", mod.augment_normalize, quiet=True)
    ex.check("7.2", mod.bn_relu, quiet=True)
    ex.check("7.3", mod.BNReLU, quiet=True)
    import json

    blank = tmp_path / "blank.ipynb"
    blank.write_text(json.dumps(ex.blank_notebook(json.loads(bench.NOTEBOOK.read_text()))))
    assert bench.worked_answers(blank) is None


@needs_triton
def test_the_benchmark_pipeline_runs_end_to_end_on_tiny_tensors(monkeypatch):
    """Its whole run on the CPU (the interpreter, no inductor compile), as on the GPU but tiny."""
    bench = _bench_module()
    monkeypatch.setattr(kb, "eager_and_inductor", lambda fn, *a, **_: {"eager": lambda: fn(*a),
                                                                       "inductor": lambda: fn(*a)})
    monkeypatch.setattr(kb, "inner_for", lambda *a, **k: 1)  # the interpreter is slow: one call per sample
    payload = bench.run(False, True, 1, dev="cpu", sizes=(2, 1))
    assert "worked answers" in payload["kernels_from"]
    rows = payload["kernels"]
    assert [(r["kernel"], r["dtype"]) for r in rows] == [
        ("augment_normalize", "float32"), ("bn_relu", "float32"), ("bn_relu_backward", "float32"),
        ("bn_relu", "bfloat16"), ("bn_relu_backward", "bfloat16")]
    for r in rows:
        assert "skipped" not in r, r
        assert set(r["contenders"]) == {"triton", "eager", "inductor"}
        assert all(c["median_s"] > 0 and "iqr_s" in c and c["gb_per_s"] > 0 for c in r["contenders"].values())


def test_the_benchmark_refuses_without_a_gpu(monkeypatch, capsys):
    bench = _bench_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


@needs_triton
def test_the_interpreter_works_after_torch_imported_triton():
    """torch.compile imports triton before a notebook sets TRITON_INTERPRET: tl.sum and friends still work."""
    import subprocess

    code = ("import os, torch, torch._inductor, sys; assert 'triton' in sys.modules; "
            "os.environ.pop('TRITON_INTERPRET', None); torch.cuda.is_available = lambda: False; "
            "from labkit import exercises as ex; ex.check('7.3', ex.reference('7.3'), quiet=True); print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_agreement_forgives_a_few_relu_flips_in_millions_but_not_a_wrong_kernel():
    want = torch.randn(50_000)
    few = want.clone()
    few[7] += 1.0  # one pre-activation on the other side of the ReLU
    assert w7.agrees(few, want, 1e-4) is False  # one in 50,000 is over MAX_SHARE
    big = torch.randn(2_000_000)
    one = big.clone()
    one[3] += 1.0
    assert w7.agrees(one, big) and not w7.agrees(big * 1.01, big)
    sums = torch.randn(64) * 700
    assert w7.agrees((one, sums + 0.5), (big, sums)) and not w7.agrees((one, sums * 1.1), (big, sums))
    assert not w7.agrees((big, None), (big, sums)) and w7.agrees((big, None), (big, None))
    assert w7.agreement(big[:10], big[:5], 1e-4)["share_off"] == 1.0


def test_the_benchmark_records_a_failing_or_wrong_kernel_instead_of_timing_it():
    bench = _bench_module()
    case = bench.cases(torch.device("cpu"), 2, 1)[1]  # bn_relu, float32

    def broken(*args):
        raise RuntimeError("no such instruction")

    row = bench.measure(case, broken, torch.device("cpu"), rounds=1)
    assert "failed: RuntimeError: no such instruction" in row["skipped"] and "contenders" not in row
    row = bench.measure(case, lambda x, s, t, r: w7.torch_bn_relu(x, s, t), torch.device("cpu"), rounds=1)
    assert "differ from the PyTorch composition" in row["skipped"] and row["share_off"] > 0.1


def test_plot_points_draws_measured_points_and_intensity_lines():
    import matplotlib

    matplotlib.use("Agg")
    ax = kb.plot_points([{"label": "a", "intensity": 0.4, "tflops": 0.5}, {"label": "b", "intensity": 0.6,
                                                                          "tflops": None}], 67.0, 4e12)
    assert ax.get_xscale() == "log" and len(ax.collections) == 1 and len(ax.lines) == 3  # roof, b's line, ridge

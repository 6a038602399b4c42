"""Week 2's exercise checks: labkit's references pass, and the usual wrong answers are caught with a clear message."""

import contextlib
import statistics
import time

import pytest
import torch

from labkit import exercises as ex
from labkit import waves as wv
from labkit import week2_exercises as w2


def test_week2_registers_its_code_exercises():
    assert ex.ids(2) == ["2.2", "2.3", "2.8"]


@pytest.mark.parametrize("eid", ["2.2", "2.3", "2.8"])
def test_reference_passes(eid):
    assert "right" in ex.check(eid, ex.reference(eid), quiet=True)


def _timed(make, *, mean=False, warm=True, flops=2):
    """A CPU timing function with one mistake switched on."""
    def matmul_tflops(m, n, k, dtype=torch.float32, device="cpu", *, warmup=3, repeats=10):
        a, b = make(m, k), make(k, n)
        for _ in range(warmup if warm else 0):
            a @ b
        if mean:
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ b
            return flops * m * n * k / ((time.perf_counter() - t0) / repeats) / 1e12
        s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            s.append(time.perf_counter() - t0)
        return flops * m * n * k / statistics.median(s) / 1e12
    return matmul_tflops


@pytest.mark.parametrize("wrong, says", [
    (_timed(torch.randn, mean=True), "mean time per call: take the median"),
    (_timed(torch.zeros), "all zeros"),
    (_timed(torch.ones), "constant"),
    (_timed(torch.randn, warm=False), "ran 7 matmuls"),
    (_timed(torch.randn, flops=1), "2\\*m\\*n\\*k FLOPs"),
    (_timed(lambda r, c: torch.randn(64, 64)), "should multiply an"),
])
def test_timing_mistakes_are_caught(wrong, says):
    with pytest.raises(ex.Wrong, match=says):
        ex.check("2.2", wrong)


def test_a_right_timing_passes_and_the_clock_is_put_back():
    real = time.perf_counter
    assert "exact against a fake clock" in ex.check("2.2", _timed(torch.randn), quiet=True)
    assert time.perf_counter is real


def test_roofline_without_the_output_bytes_is_caught():
    ref = ex.reference("2.8")

    def no_output(a, b, out_dtype, peak, bw):
        d = dict(ref(a, b, out_dtype, peak, bw))
        d["bytes"] = a.numel() * a.element_size() + b.numel() * b.element_size()
        d["intensity"] = d["flops"] / d["bytes"]
        d["attainable"] = min(peak, d["intensity"] * bw)
        return d

    with pytest.raises(ex.Wrong, match="bytes should be"):
        ex.check("2.8", no_output)
    with pytest.raises(ex.Wrong, match="attainable"):
        ex.check("2.8", lambda a, b, o, p, bw: {**ref(a, b, o, p, bw), "attainable": p})


def _cm(restore=True, cudnn=True, finally_=True):
    @contextlib.contextmanager
    def tf32_mode(enabled):
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = enabled
        if cudnn:
            torch.backends.cudnn.allow_tf32 = enabled
        if finally_:
            try:
                yield
            finally:
                if restore:
                    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        else:
            yield
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    return tf32_mode


@pytest.mark.parametrize("wrong, says", [
    (_cm(restore=False), "not what they were before"),
    (_cm(cudnn=False), "set both"),
    (_cm(finally_=False), "finally"),
    (lambda enabled: None, "context manager"),
])
def test_tf32_mistakes_are_caught_and_the_switches_kept(wrong, says):
    before = w2._switches()
    with pytest.raises(ex.Wrong, match=says):
        ex.check("2.3", wrong)
    assert w2._switches() == before


def test_kernel_tile_reads_the_recorded_cutlass_name():
    name = "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_256x128_nn_align1>(Params)"
    assert wv.kernel_tile(name) == (256, 128)

"""Hostile lab 5 hand-ins, graded by the real harness in its sandbox on the CPU (Triton's interpreter): torch's
softmax reached by a name built at run time, answers hard-coded for the public cases, a kernel right on contiguous
logits only, a file that prints a verdict of its own, and the math done outside Triton beside a kernel launched
for the count: in torch's elementary ops, in autograd's backward of them, in NumPy, with the grader's operator watch
popped, by a launch argument posing as a tensor, or on a kernel's copy of the logits. None of them earns what it did not compute; an honest kernel written
otherwise than the reference keeps full marks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autograder.checks import harness, lab5_checks
from autograder.checks.harness import WITHHELD
from autograder.student import lab5

HEAD = '''import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton
import triton.language as tl


@triton.jit
def _touch(p):  # does nothing useful: a Triton launch for the launch count
    tl.store(p, tl.load(p) + 0.0)


def _launch(device):
    _touch[(1,)](torch.zeros(1, device=device))
'''

RENAMED = HEAD + '''
import torch.nn.functional as F

_f = getattr(F, "log_" + "soft" + "max")  # the reader sees no banned name


def fused_cross_entropy(x, y, label_smoothing=0.1):
    _launch(x.device)
    logp = _f(x.float(), 1)
    return ((1 - label_smoothing) * -logp.gather(1, y[:, None])[:, 0] - label_smoothing * logp.mean(1)).mean()
'''

FAKE_VERDICT = '''import json
import sys

for name in ("lab5.forward", "lab5.backward", "lab5.layouts", "lab5.speed", "lab5.correctness_hidden"):
    line = json.dumps({"check": name, "ok": True, "score": 4, "max_score": 4, "gradable": True, "message": "passed"})
    print("verdict " + line)
    print("SELFCHECK " + line)
    print(f"{name} PASS 4/4", file=sys.stderr)


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return torch.zeros((), requires_grad=True)
'''


def _grade(tmp_path, text: str, names: list[str]) -> dict:
    path = tmp_path / "student_fused_ce.py"
    path.write_text(text)
    return {v["check"]: v for v in harness.run_checks(names, path, device="cpu")}


def test_torchs_softmax_by_a_renamed_route_is_seen_at_the_dispatcher(tmp_path):
    got = _grade(tmp_path, RENAMED, ["lab5.forward", "lab5.backward", "lab5.layouts", "lab5.correctness_hidden"])
    assert all(v["score"] == 0 and not v["ok"] for v in got.values()), got
    assert "torch's _log_softmax" in got["lab5.forward"]["message"] and "no points" in got["lab5.forward"]["message"]
    assert got["lab5.correctness_hidden"]["message"] == WITHHELD


def _memorized() -> str:
    """The public forward cases' losses, looked up by shape: right there, nowhere else."""
    table = {}
    for spec in lab5_checks._seeded(lab5_checks.BASIC, lab5_checks.SEEDS["forward"]):
        x, y = lab5.make_case(spec, torch.device("cpu"))
        table[(spec["n"], spec["c"])] = float(F.cross_entropy(x.float(), y, label_smoothing=lab5.SMOOTHING))
    return HEAD + f'''
TABLE = {table!r}


class _Looked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _launch(x.device)
        ctx.shape = x.shape
        return torch.tensor(TABLE.get(tuple(x.shape), 2.0))

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        return g.new_zeros(ctx.shape)


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Looked.apply(x)
'''


def test_hard_coded_answers_pass_only_the_cases_they_were_copied_from(tmp_path):
    got = _grade(tmp_path, _memorized(), ["lab5.forward", "lab5.backward", "lab5.correctness_hidden"])
    assert got["lab5.forward"]["ok"]  # the public cases, hard-coded
    assert not got["lab5.backward"]["ok"] and not got["lab5.correctness_hidden"]["ok"]
    assert got["lab5.correctness_hidden"]["message"] == WITHHELD and got["lab5.correctness_hidden"]["score"] == 0


def test_a_kernel_right_on_contiguous_logits_only_fails_the_layouts_and_the_hidden_cases(tmp_path):
    from tests.test_lab5 import NB

    ref = harness.student_file_from_notebook(NB, tmp_path).read_text()
    flat = ref.replace("base = x_ptr + row * stride_n", "base = x_ptr + row * C")
    flat = flat.replace("cols * stride_c, mask=mask, other=float(\"-inf\")", "cols, mask=mask, other=float(\"-inf\")")
    flat = flat.replace("x_ptr + row * stride_n + cols * stride_c", "x_ptr + row * C + cols")
    flat = flat.replace("base + target * stride_c", "base + target")
    assert flat.count("stride_c") == 2  # only the kernels' parameters are left
    got = _grade(tmp_path, flat, ["lab5.forward", "lab5.backward", "lab5.layouts", "lab5.correctness_hidden"])
    assert got["lab5.forward"]["ok"] and got["lab5.backward"]["ok"]
    assert not got["lab5.layouts"]["ok"] and "transposed" in got["lab5.layouts"]["message"], got["lab5.layouts"]
    assert not got["lab5.correctness_hidden"]["ok"] and got["lab5.correctness_hidden"]["message"] == WITHHELD


def test_a_printed_verdict_is_not_a_verdict(tmp_path):
    got = _grade(tmp_path, "import torch\n" + FAKE_VERDICT, ["lab5.forward", "lab5.layouts", "lab5.correctness_hidden"])
    assert all(v["score"] == 0 and not v["ok"] for v in got.values()), got
    assert got["lab5.forward"]["message"] == "backward gave no gradient for the logits"


# The math outside Triton, a kernel launched in each pass only to be counted (HEAD's _launch). Each earned 10 of
# the 10 correctness points before the grader counted what torch reads of the logits outside the launches.
TORCH_MATH = HEAD + '''
def _terms(x, y, eps):
    xf = x.float()
    m = xf.amax(1, keepdim=True)
    lse = (xf - m).exp().sum(1, keepdim=True).log() + m
    return xf, lse


class _Ce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        _launch(x.device)
        xf, lse = _terms(x, y, eps)
        loss = lse[:, 0] - (1 - eps) * xf.gather(1, y[:, None])[:, 0] - eps * xf.mean(1)
        ctx.save_for_backward(x, y, lse)
        ctx.eps = eps
        return loss.mean()

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        x, y, lse = ctx.saved_tensors
        n, c = x.shape
        q = torch.full((n, c), ctx.eps / c, device=x.device)
        q.scatter_add_(1, y[:, None], torch.full((n, 1), 1 - ctx.eps, device=x.device))
        return (((x.float() - lse).exp() - q) * g / n).to(x.dtype), None, None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Ce.apply(x, y, label_smoothing)
'''

AUTOGRAD_BACKWARD = HEAD + '''
class _Dummy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _launch(x.device)
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        return None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    # autograd's own backward of these torch ops computes the gradient; the dummy's backward is the "kernel"
    xf = x.float()
    m = xf.detach().amax(1, keepdim=True)
    lse = (xf - m).exp().sum(1).log() + m[:, 0]
    loss = lse - (1 - label_smoothing) * xf.gather(1, y[:, None])[:, 0] - label_smoothing * xf.mean(1)
    return loss.mean() + _Dummy.apply(x)
'''

NUMPY_MATH = HEAD + '''
import numpy as np


class _Np(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        _launch(x.device)
        a = x.detach().cpu().float().numpy().astype(np.float64)
        t = y.detach().cpu().numpy()
        m = a.max(1, keepdims=True)
        lse = np.log(np.exp(a - m).sum(1, keepdims=True)) + m
        p = np.exp(a - lse)
        n, c = a.shape
        q = np.full((n, c), eps / c)
        q[np.arange(n), t] += 1 - eps
        loss = (lse[:, 0] - (q * a).sum(1)).mean()
        ctx.grad = torch.from_numpy(((p - q) / n).astype(np.float32))
        ctx.dtype = x.dtype
        return torch.tensor(loss, dtype=torch.float32, device=x.device)

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        return (ctx.grad.to(g.device) * g).to(ctx.dtype), None, None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Np.apply(x, y, label_smoothing)
'''

WATCH_POPPED = HEAD + '''
import torch.nn.functional as F
from torch.utils import _python_dispatch as _pd

_f = getattr(F, "cross_" + "entropy")


class _Ce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        _launch(x.device)
        modes = [_pd._pop_mode() for _ in range(_pd._len_torch_dispatch_stack())]  # the watch, off
        try:
            with torch.enable_grad():
                xr = x.detach().float().requires_grad_()
                loss = _f(xr, y, label_smoothing=eps)
                (gr,) = torch.autograd.grad(loss, xr)
        finally:
            for m in reversed(modes):
                _pd._push_mode(m)
        ctx.gr = gr.to(x.dtype)
        return loss.detach()

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        return ctx.gr * g, None, None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Ce.apply(x, y, label_smoothing)
'''

POSING_POINTER = HEAD + '''
class _Pointer:
    """Posing as a tensor: the launch asks it for its address, and it does the math then."""

    def __init__(self, x, y, eps):
        self.x, self.y, self.eps, self.out = x, y, eps, None
        self.dtype = torch.float32

    def data_ptr(self):
        if self.out is None:
            xf = self.x.float()
            m = xf.amax(1, keepdim=True)
            lse = (xf - m).exp().sum(1).log() + m[:, 0]
            self.out = (lse - (1 - self.eps) * xf.gather(1, self.y[:, None])[:, 0] - self.eps * xf.mean(1)).mean()
        return torch.zeros(1, device=self.x.device).data_ptr()


class _Ce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        p = _Pointer(x, y, eps)
        try:
            _touch[(1,)](p)
        except Exception:
            p.data_ptr()
        ctx.shape = x.shape
        return p.out.reshape(())

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        return g.new_zeros(ctx.shape), None, None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Ce.apply(x, y, label_smoothing)
'''

COPY_KERNEL = HEAD + '''
@triton.jit
def _copy(x_ptr, o_ptr, C, sn, sc, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + r * sn + cols * sc, mask=cols < C)
    tl.store(o_ptr + r * C + cols, v.to(tl.float32), mask=cols < C)


class _Ce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        n, c = x.shape
        buf = torch.empty(n, c, device=x.device)
        _copy[(n,)](x, buf, c, x.stride(0), x.stride(1), BLOCK=triton.next_power_of_2(c))  # "my kernel"
        m = buf.amax(1, keepdim=True)
        lse = (buf - m).exp().sum(1, keepdim=True).log() + m
        ctx.save_for_backward(buf, y, lse)
        ctx.eps, ctx.dtype = eps, x.dtype
        return (lse[:, 0] - (1 - eps) * buf.gather(1, y[:, None])[:, 0] - eps * buf.mean(1)).mean()

    @staticmethod
    def backward(ctx, g):
        _launch(g.device)
        buf, y, lse = ctx.saved_tensors
        n, c = buf.shape
        q = torch.full((n, c), ctx.eps / c, device=buf.device)
        q.scatter_add_(1, y[:, None], torch.full((n, 1), 1 - ctx.eps, device=buf.device))
        return (((buf - lse).exp() - q) * g / n).to(ctx.dtype), None, None


def fused_cross_entropy(x, y, label_smoothing=0.1):
    return _Ce.apply(x, y, label_smoothing)
'''

OUTSIDE = {"TORCH_MATH": (TORCH_MATH, "aten.exp"), "AUTOGRAD_BACKWARD": (AUTOGRAD_BACKWARD, "aten.exp"),
           "NUMPY_MATH": (NUMPY_MATH, "Tensor.numpy"), "COPY_KERNEL": (COPY_KERNEL, "aten.exp"),
           "WATCH_POPPED": (WATCH_POPPED, "went around the grader's watch on torch's operators (_pop_mode"),
           "POSING_POINTER": (POSING_POINTER, "a launch argument of type _Pointer, not a tensor")}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_the_math_outside_triton_beside_a_counted_launch_earns_nothing(tmp_path, name):
    text, says = OUTSIDE[name]
    got = _grade(tmp_path, text, ["lab5.forward", "lab5.backward", "lab5.layouts", "lab5.correctness_hidden"])
    assert all(v["score"] == 0 and not v["ok"] for v in got.values()), got
    assert says in got["lab5.forward"]["message"] and "no points" in got["lab5.forward"]["message"], got
    assert got["lab5.correctness_hidden"]["message"] == WITHHELD


# An honest solution written otherwise than the reference: two sweeps over C per row (the max, then the sums), the
# row's max and sum kept for backward, torch finishing the mean (N elements read outside the kernels), the
# incoming gradient read on the host, the gradient written in the logits' own layout.
HONEST_OTHERWISE = '''
"""An honest variant: one program per row, two sweeps over C (the max, then the sums), torch finishing the mean."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _fwd(x_ptr, y_ptr, out_ptr, m_ptr, s_ptr, C, sn, sc, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(x_ptr + r * sn + cols * sc, mask=cols < C, other=float("-inf")).to(tl.float32))
    mx = tl.max(m, axis=0)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * sn + cols * sc, mask=cols < C, other=float("-inf")).to(tl.float32)
        s += tl.exp(v - mx)
        t += tl.where(cols < C, v, 0.0)
    ssum = tl.sum(s, axis=0)
    xt = tl.load(x_ptr + r * sn + tl.load(y_ptr + r) * sc).to(tl.float32)
    tl.store(out_ptr + r, mx + tl.log(ssum) - (1 - eps) * xt - eps * tl.sum(t, axis=0) / C)
    tl.store(m_ptr + r, mx)
    tl.store(s_ptr + r, ssum)


@triton.jit
def _bwd(x_ptr, y_ptr, m_ptr, s_ptr, d_ptr, C, sn, sc, dn, dc, g, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    mx = tl.load(m_ptr + r)
    ssum = tl.load(s_ptr + r)
    yt = tl.load(y_ptr + r)
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * sn + cols * sc, mask=cols < C, other=0.0).to(tl.float32)
        p = tl.exp(v - mx) / ssum
        q = eps / C + tl.where(cols == yt, 1 - eps, 0.0)
        tl.store(d_ptr + r * dn + cols * dc, ((p - q) * g).to(d_ptr.dtype.element_ty), mask=cols < C)


class _CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        n, c = x.shape
        rows = x.new_empty(n, dtype=torch.float32)
        m, s = torch.empty_like(rows), torch.empty_like(rows)
        _fwd[(n,)](x, y, rows, m, s, c, x.stride(0), x.stride(1), eps, BLOCK=BLOCK)
        ctx.save_for_backward(x, y, m, s)
        ctx.eps = eps
        return rows.sum() / n

    @staticmethod
    def backward(ctx, grad):
        x, y, m, s = ctx.saved_tensors
        n, c = x.shape
        d = torch.empty_like(x)  # the logits' layout and dtype
        _bwd[(n,)](x, y, m, s, d, c, x.stride(0), x.stride(1), d.stride(0), d.stride(1), float(grad) / n, ctx.eps,
                   BLOCK=BLOCK)
        return d, None, None


def fused_cross_entropy(logits, target, label_smoothing=0.1):
    return _CE.apply(logits, target, label_smoothing)
'''


def test_an_honest_kernel_written_otherwise_keeps_full_marks(tmp_path):
    got = _grade(tmp_path, HONEST_OTHERWISE, ["lab5.forward", "lab5.backward", "lab5.layouts", "lab5.correctness_hidden"])
    assert all(v["ok"] and v["score"] == v["max_score"] for v in got.values()), got


def test_the_public_self_check_says_the_same_of_the_math_outside_triton(tmp_path):
    from autograder import selfcheck_labs
    from autograder.student.probes import Probe

    cpu = torch.device("cpu")
    for text, fails in ((TORCH_MATH, True), (HONEST_OTHERWISE, False)):
        path = tmp_path / ("bad" if fails else "good") / "student_fused_ce.py"
        path.parent.mkdir()
        path.write_text(text)
        try:
            selfcheck_labs.lab5_forward(Probe(str(path), cpu, {}), cpu)
            said = None
        except selfcheck_labs.Failed as e:
            said = str(e)
        assert (said is not None) == fails, said
        assert not fails or "outside your Triton kernels" in said


# Honest kernels on every size the correctness cases use, the math in torch at the timed rounds' size: the timed
# rounds check answers, not who computed them, so a compiled torch path there would have been timed as the
# student's. The untimed round at that size is now watched as the correctness cases are.
SIZED = TORCH_MATH.replace("def fused_cross_entropy(", "def _torch_path(") + HONEST_OTHERWISE.replace(
    "def fused_cross_entropy(logits, target, label_smoothing=0.1):\n",
    "def fused_cross_entropy(logits, target, label_smoothing=0.1):\n"
    "    if logits.shape[0] >= 64:\n        return _torch_path(logits, target, label_smoothing)\n")


def test_a_torch_path_at_the_timed_size_alone_fails_the_watched_untimed_round(tmp_path):
    from tests.test_lab5 import NB, _ctx

    params = {"n": 1, "rows": 64, "cols": 50, "seed": 5}
    for text, fails in ((SIZED, True), (HONEST_OTHERWISE, False)):
        path = tmp_path / ("sized" if fails else "honest") / "student_fused_ce.py"
        path.parent.mkdir()
        path.write_text(text)
        assert lab5_checks._judge(_ctx(path), lab5_checks._seeded(lab5_checks.LAYOUT, 3), forward=True, backward=True)
        ctx = _ctx(path)
        if fails:
            with pytest.raises(harness.CheckFailed, match="outside your Triton kernels"):
                lab5_checks._check_warm(ctx, ctx.call("lab5.warm_student", params), params)
        else:
            lab5_checks._check_warm(ctx, ctx.call("lab5.warm_student", params), params)
    (tmp_path / "ref").mkdir()
    ref = harness.student_file_from_notebook(NB, tmp_path / "ref")
    ctx = _ctx(ref)
    lab5_checks._check_warm(ctx, ctx.call("lab5.warm_student", params), params)


def test_a_contiguous_copy_of_the_logits_in_torch_loses_the_strided_cases_only(tmp_path):
    from tests.test_lab5 import NB

    ref = harness.student_file_from_notebook(NB, tmp_path).read_text()
    old = "    return FusedCrossEntropy.apply(logits, target, label_smoothing)"
    assert old in ref
    got = _grade(tmp_path, ref.replace(old, "    logits = logits.contiguous()\n" + old),
                 ["lab5.forward", "lab5.layouts"])
    assert got["lab5.forward"]["ok"]  # contiguous logits: .contiguous() copies nothing
    assert not got["lab5.layouts"]["ok"] and "aten.clone" in got["lab5.layouts"]["message"], got["lab5.layouts"]

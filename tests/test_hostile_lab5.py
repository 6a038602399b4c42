"""Hostile lab 5 hand-ins, graded by the real harness in its sandbox on the CPU (Triton's interpreter): torch's
softmax reached by a name built at run time, answers hard-coded for the public cases, a kernel right on contiguous
logits only, and a file that prints a verdict of its own. None of them earns what it did not compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autograder import harness, lab5_checks
from autograder.harness import WITHHELD
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

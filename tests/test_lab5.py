"""Lab 5, a fused kernel: the reference solution gets full marks on a CPU (its kernels in Triton's interpreter, the
speed check refused as lab 4's is), the released blank gets 0, and wrong answers get messages that say what is
wrong. The wrong answers run through the probes in this process (fast); the reference and the blank through the
real harness and its sandbox."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autograder import labkit_answers
from autograder.checks import gpu_policy, harness, lab5_checks
from autograder.checks.harness import CheckFailed
from autograder.student import lab5
from autograder.student.probes import Probe

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "assignments" / "source" / "lab5_fused_kernel" / "lab5_fused_kernel.ipynb"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return harness.student_file_from_notebook(NB, tmp_path_factory.mktemp("lab5-ref"))


def _variant(reference: Path, folder: Path, old: str, new: str) -> Path:
    text = reference.read_text()
    assert old in text, old
    out = folder / "student_fused_ce.py"
    out.write_text(text.replace(old, new))
    return out


def _ctx(path: Path) -> SimpleNamespace:
    """A check's context whose student side is the probe module in this process (no sandbox: trusted files)."""
    probe = Probe(str(path), torch.device("cpu"), {})
    return SimpleNamespace(call=lambda name, params: getattr(lab5, "probe_" + name.split(".")[1])(probe, params),
                           device=torch.device("cpu"), hardware="cpu", student_id=None, handin=None)


def test_the_reference_gets_full_cpu_marks_and_the_speed_check_is_refused_as_lab_4s(reference):
    verdicts = harness.run_checks(harness.checks_for("lab5"), reference, device="cpu")
    by = {v["check"]: v for v in verdicts}
    assert set(by) == {"lab5.forward", "lab5.backward", "lab5.layouts", "lab5.speed", "lab5.correctness_hidden"}
    for name, v in by.items():
        if name == "lab5.speed":
            assert not v["gradable"] and v["score"] == 0 and "not gradable on this hardware (cpu)" in v["message"]
        else:
            assert v["ok"] and v["score"] == v["max_score"], v
    assert by["lab5.forward"]["sandbox"] in ("bwrap", "none")
    # the class grader refuses a CPU machine for lab 5 as for lab 4, with the same words
    cpu = [{"card": "cpu", "class": "cpu"}]
    with pytest.raises(Exception, match="cannot be fully graded on this machine") as lab5_err:
        gpu_policy.refuse_ungradable("lab5_fused_kernel", ["lab5.forward", "lab5.speed"], cpu, allow=False)
    with pytest.raises(Exception) as lab4_err:
        gpu_policy.refuse_ungradable("lab4_speedrun", ["lab4.speed"], cpu, allow=False)
    assert str(lab5_err.value).replace("lab5", "lab4").replace("_fused_kernel", "_speedrun") == str(lab4_err.value)


def test_the_blank_gets_zero(tmp_path):
    text = NB.read_text()
    cells = json.loads(text)["cells"]
    src = "".join(next(c for c in cells if "".join(c["source"]).startswith("%%writefile"))["source"])
    blank = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "# YOUR CODE HERE\nraise NotImplementedError()", src,
                   flags=re.S)
    path = tmp_path / "student_fused_ce.py"
    path.write_text(blank.partition("\n")[2])
    verdicts = harness.run_checks(["lab5.forward", "lab5.layouts", "lab5.correctness_hidden"], path, device="cpu")
    assert all(v["score"] == 0 and not v["ok"] for v in verdicts), verdicts
    assert "not implemented yet" in verdicts[0]["message"]


def test_the_speed_tiers_cover_the_classes_that_may_grade_it():
    assert set(gpu_policy.NEEDS_GPU["lab5.speed"]) == set(lab5_checks.SPEED_TIERS)


@pytest.mark.parametrize(("old", "new", "check", "says"), [
    ("loss = lse - (1.0 - smoothing) * x_target - smoothing * total / C", "loss = lse - x_target", "forward",
     "matches the cross-entropy without label smoothing"),
    ("return loss.mean()", "return loss.sum()", "forward", "the sum over rows, not the mean"),
    ("scale = (grad.float() / n).reshape(1)", "scale = grad.float().reshape(1)", "backward",
     "N times the answer: scale by grad / N"),
    ("scale = (grad.float() / n).reshape(1)", "scale = torch.ones(1, device=grad.device) / n", "backward",
     "multiply by the incoming grad"),
    ("d = (tl.exp(x - lse) - q) * scale", "d = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale",
     "backward", "the target is the smoothed one-hot"),
    ("new_m = tl.maximum(m, tl.max(x, axis=0))", "new_m = tl.maximum(m, 0.0)", "forward",
     "take the row's running max out"),
    ("cols * stride_c, mask=mask, other=float(\"-inf\")", "cols, mask=mask, other=float(\"-inf\")", "layouts",
     "transposed"),
    # every stride assumed: the message named the layout and two losses, not what the kernel did wrong
    ("base = x_ptr + row * stride_n", "base = x_ptr + row * C\n    stride_c = 1", "layouts",
     "read as if contiguous (row i at i * C, column j at j): read them through logits.stride(0)"),
    # a copy of the logits is named as what the student wrote, not only as the operator that ran
    ("        n, c = logits.shape\n        loss = torch.empty", "        logits = logits.contiguous()\n"
     "        n, c = logits.shape\n        loss = torch.empty", "layouts", "aten.clone is a .contiguous() copy"),
    ("        n, c = logits.shape\n        loss = torch.empty", "        logits = logits.float()\n"
     "        n, c = logits.shape\n        loss = torch.empty", "layouts", "aten._to_copy is a .float() or .to() copy"),
])
def test_wrong_answers_get_messages_that_say_what_is_wrong(reference, tmp_path, old, new, check, says):
    ctx = _ctx(_variant(reference, tmp_path, old, new))
    with pytest.raises(CheckFailed) as e:
        getattr(lab5_checks, f"check_{check}")(ctx)
    assert says in str(e.value), str(e.value)


def test_a_failed_check_measures_the_case_that_failed(reference, tmp_path):
    """A check failing on its first case reported `loss_rel_err: 0.0` beside a loss that was off: the measurements
    were the cases before it. Now they hold the failing case's error too."""
    ctx = _ctx(_variant(reference, tmp_path, "return loss.mean()", "return loss.sum()"))
    with pytest.raises(CheckFailed) as e:
        lab5_checks.check_forward(ctx)
    assert e.value.measurements["loss_rel_err"] > 1, e.value.measurements
    ctx = _ctx(_variant(reference, tmp_path, "scale = (grad.float() / n).reshape(1)", "scale = grad.float().reshape(1)"))
    with pytest.raises(CheckFailed) as e:
        lab5_checks.check_backward(ctx)
    assert e.value.measurements["grad_err_in_tolerances"] > 1, e.value.measurements


def test_a_pytorch_composition_is_told_that_no_kernel_ran(tmp_path):
    path = tmp_path / "student_fused_ce.py"
    path.write_text("import torch\n\n\ndef fused_cross_entropy(x, y, label_smoothing=0.1):\n"
                    "    x = x.float()\n    m = x.max(1, keepdim=True).values\n"
                    "    lse = (x - m).exp().sum(1).log() + m[:, 0]\n"
                    "    nll = lse - x.gather(1, y[:, None])[:, 0]\n"
                    "    return ((1 - label_smoothing) * nll + label_smoothing * (lse - x.mean(1))).mean()\n")
    with pytest.raises(CheckFailed, match="no Triton kernel ran in the forward pass"):
        lab5_checks.check_forward(_ctx(path))


def test_the_reader_bans_torchs_softmax_family_and_week_7s_kernels_but_not_tritons_own():
    banned = {
        "import torch.nn.functional as F\nF.cross_entropy(x, y)": ["torch.nn.functional.cross_entropy"],
        "def f(x):\n    return x.log_softmax(1)": ["torch.log_softmax"],
        "from torch import nn\nloss = nn.CrossEntropyLoss()": ["torch.nn.CrossEntropyLoss"],
        "import torch\nf = getattr(torch, 'logsumexp')": ["torch.logsumexp"],
        "from labkit.week7_exercises import load_triton": ["week7_exercises"],
    }
    for src, want in banned.items():
        assert labkit_answers.banned_uses(src, "lab5") == want, src
    fine = ["import triton.language as tl\ny = tl.softmax(x)", '"""an online softmax, one pass"""',
            "def my_softmax(x):\n    return x"]
    for src in fine:
        assert labkit_answers.banned_uses(src, "lab5") == [], src
    assert labkit_answers.banned_uses("x.softmax(1)", "lab1") == []  # lab 1's reader is unchanged
    text = " ".join("".join(json.loads(NB.read_text())["cells"][0]["source"]).split())
    for name in [*labkit_answers.TORCH_BANNED["lab5"].values(), "labkit.week7_exercises", "x.softmax(1)"]:
        assert f"`{name}`" in text, name


def test_the_notebook_states_the_speed_tiers_the_check_uses():
    text = " ".join("".join(json.loads(NB.read_text())["cells"][0]["source"]).split())
    tiers = lab5_checks.SPEED_TIERS["tensor_core_gpu"]
    points = harness.CHECKS["lab5.speed"].max_score
    for need, share in tiers.steps:
        assert f"{need:g}x: {share * points:g} points" in text
    assert f"at {tiers.bonus:g}x" in text and lab5_checks.TIER_BASIS in text


def test_the_tiers_come_from_the_reference_measured_through_the_sandbox_on_an_h200():
    rec = json.loads((ROOT / "benchmarks" / "results" / "grading" / "grade_reference_gpu_lab5_h200.json").read_text())
    assert rec["card"] == "NVIDIA H200" and rec["hardware"] == "tensor_core_gpu" and rec["all_gradable_full_marks"]
    by = {v["check"]: v for v in rec["labs"]["lab5"]["verdicts"]}
    assert set(by) == set(harness.checks_for("lab5")) and all(v["score"] == v["max_score"] for v in by.values())
    m = by["lab5.speed"]["measurements"]
    assert by["lab5.speed"]["sandbox"] == "bwrap" and {"rows": m["rows"], "cols": m["cols"]} == lab5_checks.SPEED_SHAPE
    tiers = lab5_checks.SPEED_TIERS["tensor_core_gpu"]
    assert m["tiers"] == tiers.describe() and tiers.fraction(m["speedup"]) == 1.0
    # full marks sit below the reference by more than its spread, the bonus above it
    assert tiers.steps[-1][0] <= m["speedup"] - m["speedup_iqr"] and tiers.bonus > m["speedup"]
    assert rec["spread"] == {"speedup": m["speedup"], "speedup_iqr": m["speedup_iqr"], "timed_rounds": m["timed_rounds"]}
    assert f"{m['speedup']:.2f}x" in rec["note"] and f"IQR {m['speedup_iqr']:g}" in rec["note"]
    assert "lab5_kernels_h200.json" in rec["note"]
    kern = json.loads((ROOT / "benchmarks" / "results" / "kernels" / "lab5_kernels_h200.json").read_text())
    assert kern["env"]["device_name"] == rec["card"] and kern["cols"] == lab5_checks.SPEED_SHAPE["cols"]
    alone = kern["rows"][str(lab5_checks.SPEED_SHAPE["rows"])]
    # without the per-pass input draws both sides pay, the kernels alone beat the eager composition by more
    assert alone["ratio"] > m["speedup"] and alone["draws_ms"] > 0
    from autograder import selfcheck_labs

    assert sorted(selfcheck_labs.LAB5_TIERS) == [(need, share) for need, share in tiers.steps]


def test_the_tests_cell_says_how_to_hand_in_headless_while_a_check_fails():
    """A failing test cell raises, so `jupyter nbconvert --execute --inplace` (the hand-in cell's command) stopped
    without saving and the hand-in found no outputs: the Tests cell names nbconvert's flag that runs on."""
    from nbconvert.preprocessors import ExecutePreprocessor

    cells = json.loads(NB.read_text())["cells"]
    tests = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("## Tests"))
    assert "--allow-errors" in " ".join(tests.split()) and ExecutePreprocessor().has_trait("allow_errors")
    handin = next("".join(c["source"]) for c in cells if "handin.save(" in "".join(c["source"]))
    assert "nbconvert --to notebook --execute --inplace" in handin


def test_the_public_list_names_one_labs_checks_and_the_mean_of_rows_is_not_blamed():
    from autograder import selfcheck
    from autograder.student import lab5 as scen

    out = subprocess.run([sys.executable, "-m", "autograder.selfcheck", "--list", "lab5"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert names == [n for n in selfcheck.PUBLIC if n.startswith("lab5.")], out.stdout
    assert scen.readers(["aten._to_copy", "aten.mean"]) == "aten._to_copy" and scen.readers(["aten.mean"]) == "aten.mean"
    assert "in the logits' dtype from your kernel" in scen.copy_hint(["aten._to_copy"], "backward")
    assert scen.copy_hint(["aten.mean"], "forward") == ""

"""Hostile lab 3 submissions: right when checked but cheating when timed, and reading the trusted answer key."""

from __future__ import annotations

from pathlib import Path

import pytest

from autograder.base import course_secret
from autograder.checks import harness, lab3_variants
from autograder.checks.harness import run_check, run_checks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "assignments" / "source" / "lab3_profile_fix" / "lab3_profile_fix.ipynb"

# Honest for the first two calls (the correctness gate and the warm-up round), then the result of the last honest
# run of as many steps is replayed, with just enough forward passes and optimizer steps to fool the counters.
REPLAY = '''

_real_train = train
_honest = {}


def train(model, optimizer, images, labels, *, steps, batch_size=64, seed=0, device="cpu"):
    if len(_honest) < 2 and steps not in _honest:
        _honest[steps] = _real_train(model, optimizer, images, labels, steps=steps, batch_size=batch_size,
                                     seed=seed, device=device)
        return _honest[steps]
    if steps in _honest:
        x = torch.zeros(batch_size, 3, 32, 32, device=device)
        for _ in range(steps):
            model(x)
            optimizer.step()
        return _honest[steps]
    return _real_train(model, optimizer, images, labels, steps=steps, batch_size=batch_size, seed=seed,
                       device=device)
'''


def _reference(dest: Path) -> Path:
    return harness.student_file_from_notebook(NOTEBOOK, dest)


def test_replaying_results_while_timed_gets_no_speed_points(tmp_path):
    f = _reference(tmp_path)
    f.write_text(f.read_text() + REPLAY)
    v = run_check("lab3.speedup", f, device="cpu")
    assert not v["ok"] and v["score"] == 0, v
    assert "timed run 2" in v["message"] and "loss" in v["message"], v["message"]


def test_importing_the_trusted_checks_fails_cleanly(tmp_path):
    from autograder.sandbox import jail

    if jail.probe() is not None:
        pytest.skip(f"no sandbox here: {jail.probe()}")
    f = _reference(tmp_path)
    text = f.read_text().replace("import torch\n", "import torch\n\nimport autograder.checks.lab3_checks as _key\n", 1)
    f.write_text(text.replace('return {"B": "data", "C": "overhead", "H": "sync", "I": "sync"}',
                              "return {k: v[0] for k, v in _key.lab3_variants.answer_key(_key.lab3_variants.CLASSIC).items()}"))
    v = run_check("lab3.answers", f, device="cpu")
    assert v.get("sandbox") == "bwrap", v
    assert not v["ok"] and v["score"] == 0 and v["gradable"], v
    # The trusted package is not inside the sandbox at all, so the import stops at it.
    assert "No module named 'autograder.checks" in v["message"], v["message"]



def test_each_student_is_graded_on_their_own_variant_and_a_classmates_answer_loses(tmp_path, monkeypatch):
    """Under a course secret every student has their own slow_train.py: its reference fix earns full marks (the
    speed tiers included), and the same answers handed in under a classmate's id do not."""
    monkeypatch.setenv(course_secret.ENV, "a course secret for the lab 3 tests")
    ref = _reference(tmp_path).read_text()
    alice, bob = lab3_variants.spec_for("alice"), lab3_variants.spec_for("bob")
    assert lab3_variants.answer_key(alice) != lab3_variants.answer_key(bob)
    f = tmp_path / "alice" / "student_fix.py"
    f.parent.mkdir()
    f.write_text(lab3_variants.reference_fix(ref, alice))
    own = run_checks(harness.checks_for("lab3"), f, device="cpu", student="alice")
    assert all(v["ok"] and v["score"] == v["max_score"] for v in own), [(v["check"], v["message"]) for v in own]
    assert all(v["secret"] == course_secret.COURSE_LABEL for v in own)
    copied, classic = run_checks(["lab3.answers"], f, device="cpu", student="bob")[0], \
        run_checks(["lab3.answers"], _reference(tmp_path), device="cpu", student="alice")[0]
    assert copied["score"] < copied["max_score"] and copied["measurements"].get("false_alarms"), copied
    assert classic["score"] < classic["max_score"], classic  # the open kit's answer is no course's answer

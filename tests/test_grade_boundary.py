"""benchmarks/grade_boundary.py: the GPU grading record's shape (its --quick dry path) and its refusal on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grade_boundary as gb  # noqa: E402


def test_quick_writes_a_record_of_the_right_shape(tmp_path, capsys):
    assert gb.main(["--quick", "--out", str(tmp_path), "--commit", "abc123"]) == 0
    rec = json.loads((tmp_path / "grade_boundary_quick.json").read_text())
    assert rec["quick"] is True and rec["measured_commit"] == "abc123" and "git_head" in rec
    assert rec["card"].startswith("none") and "grade_boundary" in rec["command"] and rec["env"]["command"]
    ref, border = rec["verdicts"]
    assert ref["submission"] == "reference" and ref["remeasured"] is False and not ref["regrade_recommended"]
    assert border["remeasured"] is True and border["first_measurement"]["rounds"] == 9
    assert border["remeasurement"]["rounds"] == 18 and border["pooled"]["rounds"] == 27 == border["timed_rounds"]
    assert "of the 3x boundary" in border["remeasure_reason"] and "Re-measured" in border["message"]
    for v in (ref, border):
        assert {"ratio", "spread_iqr", "score", "max_score", "gpu_state"} <= set(v)
        before = v["gpu_state"]["first_measurement"]["before"]
        assert set(before) == set(gb.GPU_KEYS), before
    assert set(border["gpu_state"]) == {"first_measurement", "remeasurement"}
    assert "saved" in capsys.readouterr().out


def test_quick_never_writes_into_the_committed_results(capsys):
    assert gb.main(["--quick"]) == 2
    assert "outside benchmarks/results" in capsys.readouterr().err


def test_borderline_submission_is_the_reference_plus_a_gpu_delay(tmp_path):
    ref = tmp_path / "student_speedrun.py"
    ref.write_text("def build_train_step(model, **kw):\n    return lambda x, y: 0.0\n")
    text = gb.borderline(ref, tmp_path / "b", 12345).read_text()
    assert text.startswith(ref.read_text()) and "DELAY_CYCLES = 12345" in text and "_torch.cuda._sleep" in text
    compile(text, "student_speedrun.py", "exec")


def test_the_target_is_the_highest_boundary_well_below_the_reference():
    v = {"measurements": {"speedup": 3.81, "tiers": ">=1.5x: 50%, >=2x: 67%, >=2.5x: 83%, >=3x: 100%, bonus >=4x"}}
    assert gb.target_boundary(v, None) == 3.0 and gb.target_boundary(v, 2.5) == 2.5
    assert gb.card_tag("NVIDIA H100 80GB HBM3") == "h100" and gb.card_tag(None) == "gpu"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_on_a_cpu_it_says_what_it_skips_and_writes_nothing(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/grade_boundary.py", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no CUDA GPU here: skipping" in p.stderr and "nothing written" in p.stderr
    assert list(tmp_path.iterdir()) == []

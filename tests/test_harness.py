"""The trusted speed harness on a CPU: verdict format, correctness gating speed, a measured data-pipeline
speed-up, fake-fast and timer-patching submissions, timeouts, and what nbgrader test cells see."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autograder.checks import harness
from autograder.checks.harness import CHECKS, Tiers, grade, run_check, run_checks, student_file_from_notebook
from autograder.student import probes

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"check", "ok", "score", "max_score", "gradable", "message", "measurements"}


def reference(lab: str, dest: Path) -> Path:
    """The reference solution of a lab, extracted from its source notebook's %%writefile cell."""
    nb = ROOT / "assignments" / "source" / harness.ASSIGNMENTS[lab] / f"{harness.ASSIGNMENTS[lab]}.ipynb"
    return student_file_from_notebook(nb, dest)


def variant(src: Path, dest: Path, old: str, new: str, extra: str = "") -> Path:
    text = src.read_text()
    assert old in text, old
    dest.write_text(text.replace(old, new) + extra)
    return dest


def test_unknown_check_is_a_clear_error(tmp_path):
    from labkit.env import LabkitError

    with pytest.raises(LabkitError, match="unknown check"):
        run_check("lab9.nothing", tmp_path / "x.py")


def test_missing_student_file_fails_with_a_hint(tmp_path):
    v = run_check("lab2.bucket_sampler", tmp_path / "student_pipeline.py")
    assert KEYS <= set(v) and not v["ok"] and v["score"] == 0 and "%%writefile" in v["message"]


def test_cli_prints_one_json_verdict(tmp_path):
    f = reference("lab2", tmp_path)
    p = subprocess.run([sys.executable, "-m", "autograder.harness", "lab2.bucket_sampler", str(f), "--json",
                        "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    v = json.loads(p.stdout)
    assert KEYS <= set(v) and v["ok"] and v["gradable"] and v["score"] == v["max_score"] == 2
    assert v["measurements"]["padding_waste"] < 0.35 * v["measurements"]["random_batching_waste"]


def test_data_pipeline_speedup_is_measured_and_fake_fast_gets_nothing(tmp_path, monkeypatch):
    # The loader runs in the student's sandboxed process; the PIL baseline in a process of its own; the clock
    # is the grader's, and every timed epoch is checked sample by sample.
    ref = reference("lab2", tmp_path)
    # Wrong but fast: every batch is the first one again (no per-sample work, wrong samples).
    fake = variant(ref, tmp_path / "student_fake.py", "            x = self.images[idx]",
                   "            idx = order[:len(idx)]\n            x = self.images[idx]")
    # Correct but slow: packed storage, per-sample Python augmentation.
    slow = variant(ref, tmp_path / "student_slow.py", "                x = self._augment(x)",
                   "                x = torch.cat([self._augment(x[i:i + 1]) for i in range(len(x))])")
    # The kernel's clocks are no part of the measurement: break them here, in the calling process.
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    good, bad, meh = (run_check("lab2.loader_speed", f, device="cpu") for f in (ref, fake, slow))
    # The reference's ratio on a 2-core CPU sits near the 8x top tier, and a loaded machine put it under (3 of 4):
    # this test's claim is that the ratio is measured and checked, not which tier a CI machine reaches.
    assert good["ok"] and good["gradable"] and good["max_score"] == 4 and good["score"] >= 3
    m = good["measurements"]
    assert m["speedup"] >= 5 and m["packed_samples_per_s"] > m["baseline_samples_per_s"]
    # every timed epoch is checked, each measurement's warm-up round included; a ratio that lands near a tier
    # boundary on a busy machine is measured once more (autograder.checks.remeasure) and scored on the pooled rounds
    measurements = [m["first_measurement"], m["remeasurement"]] if m["remeasured"] else [m]
    assert measurements[0]["rounds"] == 5 and sum(x["rounds"] for x in measurements) == m["rounds"]
    assert m["epochs_checked"] == 2 * (m["rounds"] + len(measurements))
    assert not bad["ok"] and bad["score"] == 0 and "exactly once" in bad["message"]
    assert meh["score"] < good["score"] and meh["measurements"]["speedup"] < m["speedup"]


def test_submission_that_replaces_timers_gains_nothing(tmp_path):
    # The grader's process times every request; a submission that slows its own clock 1000x would look 1000x
    # faster if any of its clocks were read.
    ref = reference("lab2", tmp_path)
    cheat = variant(ref, tmp_path / "student_cheat.py", "import numpy as np",
                    "import numpy as np\nimport time\n_real = time.perf_counter\n"
                    "time.perf_counter = lambda: _real() / 1000")
    v = run_check("lab2.loader_speed", cheat, device="cpu")
    assert v["ok"] and 1 < v["measurements"]["speedup"] < 200, v


def test_a_hanging_check_times_out_and_the_others_still_run(tmp_path, monkeypatch):
    ref = reference("lab2", tmp_path)
    hang = variant(ref, tmp_path / "student_hang.py", "def pack(image_paths, labels, out_dir):",
                   "def pack(image_paths, labels, out_dir):\n    while True:\n        pass\n\n\ndef _unused():")
    monkeypatch.setattr(harness, "_STARTUP_S", 10.0)
    for name in ("lab2.packed_roundtrip", "lab2.bucket_sampler"):
        monkeypatch.setitem(CHECKS, name, dataclasses.replace(CHECKS[name], timeout_s=6))
    first, second = run_checks(["lab2.packed_roundtrip", "lab2.bucket_sampler"], hang, device="cpu")
    assert not first["ok"] and "timed out" in first["message"]
    assert second["ok"] and second["score"] == 2


def test_speedrun_fakes_fail_on_cpu(tmp_path):
    # (The reference's verdicts on a CPU, speed "not gradable" included, are checked through the GPU script below.)
    ref = reference("lab4", tmp_path)
    # Fake-fast: no backward, no update. Wrong, so no points anywhere, the sync check and speed included.
    fake = variant(ref, tmp_path / "student_fake.py", "        scaler.scale(loss).backward()\n        scaler.step(opt)"
                   "  # skips the update only if a gradient is inf/NaN (fp16; never with bf16)\n", "")
    f_ok, f_sync, f_speed = run_checks(["lab4.correctness", "lab4.no_host_sync", "lab4.speed"], fake, device="cpu")
    assert not f_ok["ok"] and "parameters changed in 0" in f_ok["message"]
    assert f_sync["score"] == 0 and f_speed["score"] == 0 and not f_speed["gradable"]
    # Momentum dropped: the loss trajectory is close under AMP tolerance, the update signature is not.
    nomom = variant(ref, tmp_path / "student_nomom.py", "momentum=momentum, weight_decay=weight_decay, fused",
                    "momentum=0.0, weight_decay=weight_decay, fused")
    v = run_check("lab4.correctness", nomom, device="cpu")
    assert not v["ok"] and "momentum" in v["message"]
    # A host sync per step is caught without a GPU (counted in the sandboxed process), and its line is named.
    sync = variant(ref, tmp_path / "student_sync.py", "        return loss.detach()  # a tensor: no host sync",
                   "        print(float(loss))\n        return loss.detach()")
    v = run_check("lab4.no_host_sync", sync, device="cpu")
    line = next(i for i, t in enumerate(sync.read_text().splitlines(), 1) if "print(float(loss))" in t)
    assert v["score"] == 0 and f"student_sync.py:{line}" in v["message"], v["message"]


def test_profile_fix_fake_fast_gets_no_speed_points(tmp_path):
    ref = reference("lab3", tmp_path)
    fake = variant(ref, tmp_path / "student_fake.py", "            loss.backward()\n            optimizer.step()\n", "")
    v = run_check("lab3.speedup", fake, device="cpu")
    assert not v["ok"] and v["score"] == 0 and "optimizer steps" in v["message"]


def test_profile_fix_sync_per_step_loses_the_sync_points_and_is_told_where(tmp_path):
    ref = reference("lab3", tmp_path)
    sync = variant(ref, tmp_path / "student_sync.py", "losses.append(loss.detach())",
                   "losses.append(torch.tensor(loss.item()))")
    v = run_check("lab3.no_host_sync", sync, device="cpu")
    line = next(i for i, t in enumerate(sync.read_text().splitlines(), 1) if "loss.item()" in t)
    assert v["score"] == 0 and v["measurements"]["host_syncs"] > v["measurements"]["allowed"]
    assert f"student_sync.py:{line} (24x)" in v["message"], v["message"]


def test_tiers_give_partial_credit():
    t = Tiers(((1.5, 0.5), (2.0, 2 / 3), (3.0, 1.0)), bonus=5.0)
    assert [t.fraction(r) for r in (1.0, 1.49, 1.5, 2.5, 3.0, 9.0)] == [0, 0, 0.5, 2 / 3, 1.0, 1.0]
    assert "bonus >=5x" in t.describe()


def test_host_sync_counter_sees_item_and_bool_on_cpu():
    x = torch.ones(3)
    assert len(probes.host_sync_sites(lambda: x.sum().item() + bool(x.all()), "cpu")) == 2
    assert probes.host_sync_sites(lambda: (x * 2).sum(), "cpu") == []
    assert harness.hardware_class("cpu") == "cpu"


def test_host_sync_sites_name_the_calling_line():
    x = torch.ones(3)

    def two_syncs():
        a = x.sum().item()  # first sync
        return a + float(x.max())  # second sync

    sites = probes.host_sync_sites(two_syncs, "cpu")
    line = two_syncs.__code__.co_firstlineno
    assert sites == [f"test_harness.py:{line + 1}", f"test_harness.py:{line + 2}"]


def test_loss_scaler_syncing_per_parameter_loses_the_sync_points_and_is_told_where(tmp_path):
    ref = reference("lab1", tmp_path)
    good = run_check("lab1.host_syncs", ref, device="cpu")
    assert good["score"] == good["max_score"] and good["measurements"]["host_syncs_per_step"] == 1
    (tmp_path / "bad").mkdir()
    bad = variant(ref, tmp_path / "bad" / "student_scaler.py", "found = found | ~torch.isfinite(g).all()",
                  "found = found | bool(~torch.isfinite(g).all())")
    v = run_check("lab1.host_syncs", bad, device="cpu")
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "found = found | bool(" in t)
    assert v["score"] == 0 and f"student_scaler.py:{line}" in v["message"], v["message"]


def _verdict(**kw):
    v = {"check": "lab4.speed", "ok": True, "score": 6.0, "max_score": 6.0, "gradable": True, "message": "m",
         "measurements": {}}
    v.update(kw)
    return v


def test_grade_maps_verdicts_to_nbgrader_outcomes(tmp_path, monkeypatch, capsys):
    f = tmp_path / "student_speedrun.py"
    f.write_text("x = 1\n")
    box = {}
    monkeypatch.setattr(harness, "run_check", lambda name, path: box["v"])
    monkeypatch.setattr(harness, "run_checks", lambda names, path: [dict(box["v"], check=n) for n in names])
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    box["v"] = _verdict(score=3.0)
    assert grade("lab4.speed", str(f), points=6) == 3.0  # a number below the points: partial credit
    box["v"] = _verdict(ok=False, score=0.0, message="too slow")
    with pytest.raises(AssertionError, match="too slow"):
        grade("lab4.speed", str(f), points=6)
    box["v"] = _verdict(ok=False, score=0.0, gradable=False, message="not gradable on this hardware (cpu): x")
    assert grade("lab4.speed", str(f), points=6) is None  # interactive: say so, do not fail
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")
    assert grade("lab4.speed", str(f), points=6) is None
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    harness._SUITE_CACHE.clear()
    with pytest.raises(harness.NotGradableHere, match="scores 0 on this machine"):
        grade("lab4.speed", str(f), points=6)
    assert "not gradable" in capsys.readouterr().out
    harness._SUITE_CACHE.clear()


def test_student_file_from_notebook_refuses_other_notebooks(tmp_path):
    from labkit.env import LabkitError

    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "print(1)"}]}))
    with pytest.raises(LabkitError, match="no %%writefile cell"):
        student_file_from_notebook(nb, tmp_path)


def test_grade_reference_gpu_script_runs_on_cpu(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/grade_reference_gpu.py", "--quick", "--labs", "lab4",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "grade_reference_gpu.json").read_text())
    assert res["env"]["device_name"] and res["env"]["torch"] and res["all_gradable_full_marks"]
    lab4 = res["labs"]["lab4"]
    assert lab4["not_gradable"] == ["lab4.speed"] and lab4["score"] == lab4["gradable_max_score"] == 8

"""GPU verdicts an instructor can defend: the card's state around the timed rounds, and what to look at again.

nvidia-smi is faked by a script on PATH (a real one is never needed); NVML is taken out where pynvml imports. The
state is read by the trusted grading process around `Context.compare`, never asked of the student's process:
the student's replies carry timings only, so a student cannot fake GPU state or a "measure again".
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from autograder import grade
from autograder.checks import harness, review
from autograder.gradebook import classbook, summary
from autograder.sandbox import gpu_state
from labkit.env import REPO_ROOT

IDLE_H100 = "GPU-1234, NVIDIA H100 80GB HBM3, {sm}, 2619, {temp}, 312.40, 700.00, {mask}"


def _fake_smi(bin_dir: Path, lines: list[str], *, reject_old_name: bool = False, fail: str | None = None,
              sleep_s: float = 0) -> None:
    """An nvidia-smi that prints lines[k] on its k-th call (the last one after that)."""
    bin_dir.mkdir(exist_ok=True)
    data = bin_dir / "lines.txt"
    data.write_text("\n".join(lines) + "\n")
    count = bin_dir / "count"
    count.write_text("0")
    body = [f"#!/bin/sh\nPATH=/usr/bin:/bin\nsleep {sleep_s}"]
    if fail:
        body.append(f"echo '{fail}' >&2; exit 9")
    if reject_old_name:
        body.append('case "$*" in *clocks_throttle_reasons*) echo "Field \\"clocks_throttle_reasons.active\\" is not '
                    'a valid field to query." >&2; exit 2;; esac')
    body.append(f'n=$(cat {count}); echo $((n + 1)) > {count}; total=$(wc -l < {data})\n'
                f'if [ "$n" -ge "$total" ]; then n=$((total - 1)); fi\nsed -n "$((n + 1))p" {data}')
    script = bin_dir / "nvidia-smi"
    script.write_text("\n".join(body) + "\n")
    script.chmod(0o755)


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """Make a fake nvidia-smi the only one on PATH (and NVML unavailable)."""
    monkeypatch.setattr(gpu_state, "read_nvml", lambda select=None: None)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))

    def make(lines, **kw):
        _fake_smi(bin_dir, lines, **kw)

    return make


def _watch():
    w = gpu_state.Watch(types.SimpleNamespace(type="cuda", index=0))  # torch without CUDA: the first GPU is read
    return w.measurements()


def test_a_steady_card_is_recorded_and_not_flagged(smi):
    smi([IDLE_H100.format(sm=1980, temp=51, mask="0x0000000000000000"),
         IDLE_H100.format(sm=1965, temp=58, mask="0x0000000000000000")])
    m = _watch()
    start, end = m["gpu_state"]["start"], m["gpu_state"]["end"]
    assert start["sm_clock_mhz"] == 1980 and start["mem_clock_mhz"] == 2619 and start["temperature_c"] == 51
    assert start["power_w"] == 312.4 and start["power_limit_w"] == 700 and start["throttle_reasons"] == []
    assert end["temperature_c"] == 58 and start["name"] == "NVIDIA H100 80GB HBM3" and start["source"] == "nvidia-smi"
    assert "gpu_measure_again" not in m


def test_throttling_or_moving_clocks_mean_measure_again(smi):
    smi([IDLE_H100.format(sm=1980, temp=60, mask="0x0"), IDLE_H100.format(sm=1755, temp=88, mask="0x0000000000000020")])
    why = _watch()["gpu_measure_again"]
    assert "throttling at the end" in why and "sw_thermal_slowdown" in why and "88 C" in why
    assert "SM clock moved 1980 -> 1755 MHz" in why and "more than 10%" in why
    smi([IDLE_H100.format(sm=1980, temp=60, mask="0x4"), IDLE_H100.format(sm=1980, temp=60, mask="0x4")])
    assert "sw_power_cap" in _watch()["gpu_measure_again"]  # at its power cap: power-limited the whole time
    smi([IDLE_H100.format(sm=1980, temp=60, mask="0x0"), IDLE_H100.format(sm=1400, temp=60, mask="0x0")])
    assert _watch()["gpu_measure_again"].startswith("SM clock moved")
    # An idle card drops its clocks between requests: that is not a slower card, so it is not judged.
    smi([IDLE_H100.format(sm=1980, temp=60, mask="0x0"), IDLE_H100.format(sm=345, temp=50, mask="0x1")])
    assert "gpu_measure_again" not in _watch()
    assert gpu_state.judge({"sm_clock_mhz": 1000}, {"sm_clock_mhz": 1080}) == []  # within the stated share
    readme = (REPO_ROOT / "assignments" / "README.md").read_text()
    assert f"clock moved more than {gpu_state.CLOCK_DRIFT:.0%} between the" in readme.replace("\n", " ")


def test_no_gpu_missing_failing_or_hung_nvidia_smi(smi, tmp_path):
    calls = []
    w = gpu_state.Watch("cpu", reader=lambda s: calls.append(s) or {})
    assert w.measurements() == {} and calls == []  # no GPU: nothing read, nothing recorded
    m = _watch()  # PATH holds no nvidia-smi yet
    assert m == {"gpu_state": {"error": "nvidia-smi not found"}}
    smi(["x"], fail="NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver")
    err = _watch()["gpu_state"]["error"]
    assert err.startswith("nvidia-smi exited with status 9") and "communicate" in err
    smi(["not, a, reading"])
    assert "nvidia-smi printed" in _watch()["gpu_state"]["error"]
    smi([IDLE_H100.format(sm=1980, temp=50, mask="0x0")], reject_old_name=True)  # a driver with the new name only
    assert _watch()["gpu_state"]["start"]["sm_clock_mhz"] == 1980
    smi(["x"], sleep_s=5)
    assert "TimeoutExpired" in gpu_state.read_smi(timeout_s=0.3)["error"]
    smi([IDLE_H100.format(sm="[N/A]", temp=50, mask="[N/A]")])
    r = gpu_state.read()
    assert r["sm_clock_mhz"] is None and r["throttle_reasons"] is None and "at" in r


def test_compare_records_the_state_around_the_rounds_from_the_trusted_side(monkeypatch, tmp_path):
    seen = []

    def reader(select):
        seen.append(len(seen))
        return {"sm_clock_mhz": 1980.0 if len(seen) == 1 else 1500.0, "mem_clock_mhz": 2619.0,
                "throttle_reasons": [], "temperature_c": 70.0}

    monkeypatch.setattr(gpu_state, "read", reader)

    def interleave(self, *a, **kw):  # what the runners' replies give the check: times, never GPU state
        assert len(seen) == (1 if self.device != "cpu" else 2)  # the start was read before the rounds
        return [2.0, 2.1, 2.0, 2.2], [1.0, 1.0, 1.1, 1.0]

    monkeypatch.setattr(harness.Context, "interleave", interleave)
    ctx = harness.Context(device=types.SimpleNamespace(type="cuda", index=0), hardware="tensor_core_gpu",
                          small=False, work_dir=tmp_path, student_file=tmp_path / "s.py")
    ab, notes = ctx.compare(None, None, rounds=4, warmup=0)
    assert ab.ratio == pytest.approx(2.0, rel=0.1) and len(seen) == 2
    assert notes["gpu_state"]["start"]["sm_clock_mhz"] == 1980 and "SM clock moved" in notes["gpu_measure_again"]
    ctx.device = "cpu"
    _, notes = ctx.compare(None, None, rounds=4, warmup=0)
    assert "gpu_state" not in notes and len(seen) == 2


def _res(sid, **m):
    return grade.StudentResult(sid, "lab", "graded", 6.0, 6.0, checks=[{
        "check": "lab4.speed", "passed": True, "fraction": 1.0, "message": "", "cause": None, "measurements": m}],
        hardware={"class": "tensor_core_gpu", "card": "NVIDIA H100"})


TIERS = harness.Tiers(((1.5, 0.5), (2.0, 2 / 3), (2.5, 5 / 6), (3.0, 1.0)), bonus=4.0).describe()


def test_the_summary_lists_measure_again_and_near_boundary_verdicts_without_failing_anyone():
    res = [_res("ann", speedup=3.05, speedup_iqr=0.12, tiers=TIERS),  # 3x is within its spread
           _res("bob", speedup=3.4, speedup_iqr=0.1, tiers=TIERS, gpu_measure_again="GPU throttling at the end"),
           _res("cat", speedup=3.4, speedup_iqr=0.1, tiers=TIERS),
           _res("dan", ratio=3.97, ratio_iqr=0.05, required_ratio=4),
           _res("eve", speedup=1.45, ratios=[1.3, 1.4, 1.45, 1.55, 1.6], tiers=TIERS)]  # just below the first tier
    assert review.boundaries({"tiers": TIERS}) == [1.5, 2.0, 2.5, 3.0, 4.0]
    info = classbook.ClassInfo("lab", 6.0, [], ["lab"], [], "d")
    rows = classbook.final_rows(info, res, None, {})
    by = {r["student_id"]: r for r in rows}
    assert [f["kind"] for f in by["ann"]["review"]] == [review.NEAR_BOUNDARY] and by["cat"]["review"] == []
    assert "3.05x is within its measured spread (IQR 0.12) of the 3x boundary" == by["ann"]["review"][0]["why"]
    assert [f["kind"] for f in by["bob"]["review"]] == [review.MEASURE_AGAIN]
    assert by["dan"]["review"][0]["why"].endswith("of the 4x boundary") and by["eve"]["review"]
    assert all(r["total"] == 6.0 for r in rows)  # neither is a failure: the points stand as measured
    text = "\n".join(summary.final_sections(rows, None, None))
    assert "MEASURE AGAIN" in text and "  bob: lab4.speed: GPU throttling at the end" in text
    assert "NEAR A TIER BOUNDARY: regrade recommended" in text and "  ann: lab4.speed: 3.05x" in text
    assert "cat" not in text

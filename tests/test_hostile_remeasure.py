"""The near-boundary re-measurement (autograder.checks.remeasure) against submissions that try to game it, on the CPU-sized
toy assignment (autograder.rehearsal): the real sandboxed runner, interleaved timing and per-round verification.

Which first ratios count as near a boundary is forced (landing there on purpose is not reproducible on a busy
CPU); everything else is what a grading run does. The student's process tells the measurements apart only by
counting its own calls: 3 total() calls for the correctness probe, then 8 per request (2 warm-up requests and 7
timed rounds in the first measurement, then the re-measurement's own warm-up and rounds).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from autograder import rehearsal
from autograder.checks import remeasure, review
from autograder.checks.harness import CheckFailed, Context
from autograder.sandbox import jail

SANDBOX = "bwrap" if jail.probe() is None else "none"
FIRST = 3 + 8 * (2 + 7)  # total() calls up to the end of the first measurement

# Right and fast throughout, but its first warm-up request takes seconds: the warm-up is not part of the ratio, so
# this costs nothing, and under a budget priced by the first measurement's whole time it skipped the
# re-measurement (keeping a lucky first ratio).
SLOW_WARMUP = rehearsal.REFERENCE + '''
import time as _time

_fast, _calls = total, [0]


def total(xs):
    _calls[0] += 1
    if _calls[0] == 4:
        _time.sleep(SLEEP)
    return _fast(xs)
'''

# Right through the first measurement, then the same answer every time: a bet that the extra rounds are not checked.
STALE_IN_REMEASUREMENT = rehearsal.REFERENCE + f'''
_fast, _calls, _last = total, [0], [0]


def total(xs):
    _calls[0] += 1
    if _calls[0] > {FIRST}:
        return _last[0]
    _last[0] = _fast(xs)
    return _last[0]
'''


def _speed(tmp_path: Path, monkeypatch, text: str, budget_s: float) -> dict:
    monkeypatch.setattr(remeasure, "near", lambda ab, tiers, required_ratio=None: "near (forced by the test)")
    monkeypatch.setattr(rehearsal, "N_ELEMENTS", 20_000)  # a tenth of the work: the test stays a few seconds
    box, work = tmp_path / "box", tmp_path / "work"
    box.mkdir()
    work.mkdir()
    f = box / "pipeline.py"
    f.write_text(text)
    ctx = Context(device="cpu", hardware="cpu", small=True, work_dir=work, student_file=f, sandbox=SANDBOX)
    try:
        ctx.baseline().wait_ready()  # both processes up before the check's clock starts, as a warm worker has them
        ctx.student().wait_ready()
        ctx.deadline = time.monotonic() + budget_s
        return rehearsal.check_speed(ctx)
    finally:
        ctx.close()


def test_a_slow_warm_up_does_not_buy_a_skipped_remeasurement(tmp_path, monkeypatch):
    sleep = 6.0
    # One re-measurement of as many rounds. The first measurement takes ~8 s, all but ~2 s of it the stretched
    # warm-up, and leaves ~8 s of the budget: priced by its whole time the re-measurement (x1.5 margin: ~12 s)
    # does not fit; priced without the stretched warm-up (~3 s) it does.
    _policy(monkeypatch, rounds_factor=1.0)
    out = _speed(tmp_path, monkeypatch, SLOW_WARMUP.replace("SLEEP", str(sleep)), budget_s=sleep + 10)
    m = out["measurements"]
    assert m["remeasured"] is True and "remeasure_skipped" not in m, (m.get("remeasure_skipped"), m.get("first_measurement"))
    assert m["pooled"]["rounds"] == 7 + m["remeasurement"]["rounds"] and "Re-measured" in out["message"]
    assert remeasure.WARMUP_EXCESS_S not in m  # a pricing detail, not a measurement of the student


def test_cheating_only_in_the_toy_remeasurement_fails_the_check(tmp_path, monkeypatch):
    with pytest.raises(CheckFailed, match="wrong answer"):
        _speed(tmp_path, monkeypatch, STALE_IN_REMEASUREMENT, budget_s=60)


def test_a_skipped_remeasurement_is_flagged_for_the_instructor(tmp_path, monkeypatch):
    """No budget is enough (as for a check that really ran long): scored as measured, and the summary says so."""
    _policy(monkeypatch, time_margin=1e9)
    try:
        m = _speed(tmp_path, monkeypatch, rehearsal.REFERENCE, budget_s=60)["measurements"]
    except CheckFailed as e:  # a tenth of the work can measure under 4x on a busy machine: not the point here
        m = e.measurements
    assert m["remeasured"] is False and "a re-measurement needs" in m["remeasure_skipped"], m

    class Res:
        checks = [{"check": rehearsal.CHECK, "measurements": {**m, "ratio": 4.0, "ratio_iqr": 0.5}}]

    why = {f["kind"]: f["why"] for f in review.flags(Res())}[review.NEAR_BOUNDARY]
    assert "not re-measured: the check's time budget has" in why, why


def _policy(monkeypatch, **kw) -> None:
    """remeasure.measured's default policy, changed for one test."""
    policy = remeasure.Policy(**kw)
    monkeypatch.setattr(remeasure.measured, "__kwdefaults__", {**remeasure.measured.__kwdefaults__, "policy": policy})

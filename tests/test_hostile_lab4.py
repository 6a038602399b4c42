"""Lab 4 against hostile submissions: right when checked, cheating when timed; reaching for the trusted module.

The speed check grades only on a CUDA GPU, so these tests drive its CPU-sized body (`_speed`, with a CPU tier
and fewer rounds) directly from a trusted Context: the same probes, sandbox, interleaved timing and spot checks
a GPU grading runs. A speed cheat must cheat in most timed rounds to move the median ratio, so the cheats below
cheat in every timed round; the verdicts then do not depend on which rounds the draw verifies (at least one
timed round always is), and the test of the chain fixes the draw.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from autograder.checks import harness
from autograder.checks import lab4_checks as L
from autograder.checks.harness import CheckFailed, Context, Tiers, run_checks, student_file_from_notebook
from autograder.sandbox import jail

ROOT = Path(__file__).resolve().parents[1]
ANY_SPEED = Tiers(((0.01, 1.0),))  # every measured ratio earns the points: only the verification can fail
SANDBOX = "bwrap" if jail.probe() is None else "none"

# Wraps the reference's step: honest for the correctness probes and the warm-up (9 calls with the rounds below),
# then, in every timed round, returns the last loss and does no work at all.
STALE = '''
_honest = build_train_step


def build_train_step(model, **kw):
    step, calls, last = _honest(model, **kw), [0], [None]

    def cheat(x, y):
        calls[0] += 1
        if calls[0] > 9:
            return last[0]
        last[0] = step(x, y)
        return last[0]

    return cheat
'''

# Computes the right loss in every timed round, but skips the backward pass and steps on the last gradient again.
OLD_GRADIENT = '''
import torch
import torch.nn.functional as F

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def build_train_step(model, *, lr, momentum, weight_decay, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    calls = [0]

    def step(x, y):
        calls[0] += 1
        x = (x.float() / 255 - mean) / std
        if calls[0] > 9:
            with torch.no_grad():
                loss = F.cross_entropy(model(x), y)
            opt.step()  # .grad still holds the last honest step's gradient
            return loss
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step
'''

# Rewrites the public probes in its own process: the last step of every timed round only runs its forward pass;
# its backward pass and update wait for the untimed fetch of the snapshots, which then shows the finished weights.
DEFERRED = '''
import torch
import torch.nn.functional as F

import autograder.student.lab4 as P

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
DEFER, PENDING = [False], []


def build_train_step(model, *, lr, momentum, weight_decay, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)

    def finish():
        while PENDING:
            loss = PENDING.pop()
            opt.zero_grad()
            loss.backward()
            opt.step()

    def step(x, y):
        finish()
        loss = F.cross_entropy(model((x.float() / 255 - mean) / std), y)
        if DEFER[0]:
            PENDING.append(loss)
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.detach()

    PENDING_FINISH[:] = [finish]
    return step


PENDING_FINISH = []
_timed, _snapshots = P.timed_steps, P.probe_snapshots


def lazy_timed(step, model, device, params, state):
    calls = [0]

    def last_one_lazy(x, y):
        calls[0] += 1
        DEFER[0] = calls[0] == int(params["n"])
        try:
            return step(x, y)
        finally:
            DEFER[0] = False

    return _timed(last_one_lazy, model, device, params, state)


def lazy_snapshots(p, params):
    kept = p.state["lab4"]
    if PENDING:
        PENDING_FINISH[0]()
        rows = kept["rows"]
        P._copy_all(rows.views[-1], [q for _, q in kept["model"].named_parameters()])
    return _snapshots(p, params)


P.timed_steps, P.probe_snapshots = lazy_timed, lazy_snapshots
'''


# Rewrites the public probe in its own process: from the first timed round on, the last step of each round only
# runs its forward pass; its backward pass and update run when the next request arrives, before the probe copies
# the weights the round starts from (as work done while no clock runs would be).
BETWEEN = '''
import torch
import torch.nn.functional as F

import autograder.student.lab4 as P

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
DEFER, PENDING, ROUNDS = [False], [], [0]


def build_train_step(model, *, lr, momentum, weight_decay, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)

    def finish():
        while PENDING:
            loss = PENDING.pop()
            opt.zero_grad()
            loss.backward()
            opt.step()

    def step(x, y):
        loss = F.cross_entropy(model((x.float() / 255 - mean) / std), y)
        PENDING.append(loss)
        if not DEFER[0]:
            finish()
        return loss.detach()

    FINISH[:] = [finish]
    return step


FINISH = []
_timed = P.timed_steps


def lazy_timed(step, model, device, params, state):
    ROUNDS[0] += 1
    FINISH[0]()  # the last round's deferred backward and update, before the round's start is copied
    calls = [0]

    def last_one_lazy(x, y):
        calls[0] += 1
        DEFER[0] = ROUNDS[0] > 2 and calls[0] == int(params["n"])
        try:
            return step(x, y)
        finally:
            DEFER[0] = False

    return _timed(last_one_lazy, model, device, params, state)


P.timed_steps = lazy_timed
'''


class _SkipFirstTimedRound:
    """A fixed draw: declines every round it may decline (the first timed round of four), then verifies."""

    @staticmethod
    def randbelow(k: int) -> int:
        return k - 1


def reference(dest: Path) -> Path:
    nb = ROOT / "assignments" / "source" / "lab4_speedrun" / "lab4_speedrun.ipynb"
    return student_file_from_notebook(nb, dest)


def speed(tmp_path: Path, monkeypatch, text: str, rounds: int = 2) -> dict:
    """The speed check's body on a CPU for a submission with source `text` (3 steps a round, 1 + 1 + `rounds`
    rounds; the first warm-up round and up to 3 timed rounds verified)."""
    monkeypatch.setattr(L, "SPEED_ROUNDS", {"rounds": rounds, "warmup": 1, "inner": 3})
    monkeypatch.setattr(L, "SPEED_WARMUP_STEPS", 3)
    box, work = tmp_path / "box", tmp_path / "work"
    box.mkdir()
    work.mkdir()
    f = box / "student_speedrun.py"
    f.write_text(text)
    ctx = Context(device=torch.device("cpu"), hardware="cpu", small=True, work_dir=work, student_file=f,
                  sandbox=SANDBOX)
    ctx.deadline = time.monotonic() + 300
    try:
        return L._speed(ctx, ANY_SPEED)
    finally:
        ctx.close()


def test_the_reference_passes_every_verified_timed_round(tmp_path, monkeypatch):
    ref = reference(tmp_path).read_text()
    out = speed(tmp_path, monkeypatch, ref, rounds=4)  # 3 of the 4 timed rounds drawn, the 4th 1 time in 4
    m = out["measurements"]
    assert out["fraction"] == 1.0 and 3 <= m["timed_rounds_verified"] <= 4 and m["warmup_rounds_verified"] == 1, m
    # 3 steps a round, every verified round's steps checked (the count includes the verified warm-up round's)
    assert m["timed_steps_verified"] == 3 * (m["timed_rounds_verified"] + m["warmup_rounds_verified"]), m
    assert m["worst_timed_loss_gap_share"] < 1 and m["worst_timed_update_cosine_margin"] > 0, m


@pytest.mark.parametrize("cheat, says", [
    (STALE, "parameters did not change"),
    (OLD_GRADIENT, "not the SGD step of this batch's gradient"),
    (DEFERRED, "not the ones the step left when the clock stopped"),
], ids=["stale-loss-no-work", "old-gradient", "work-deferred-past-the-clock"])
def test_right_when_checked_cheating_when_timed_gets_no_speed_points(tmp_path, monkeypatch, cheat, says):
    text = reference(tmp_path).read_text() + cheat if cheat is STALE else cheat
    with pytest.raises(CheckFailed, match="no speed points") as e:
        speed(tmp_path, monkeypatch, text)
    assert says in str(e.value)


def test_work_slipped_between_rounds_breaks_the_chain(tmp_path, monkeypatch):
    """The round that deferred its last update is not verified; the next one is, and starts off its commitment."""
    monkeypatch.setattr(L, "secrets", _SkipFirstTimedRound)
    with pytest.raises(CheckFailed, match="no speed points") as e:
        speed(tmp_path, monkeypatch, BETWEEN, rounds=4)
    assert "timed round 2: the weights the round started from are not the ones the previous round left" in \
        str(e.value), e.value


def test_spot_checks_draw_a_uniform_subset_round_by_round():
    """The first warm-up round always, then 3 of the 9 timed rounds, each about as often (3/9); and after those 3,
    each later round with probability 1/4. A hand-in sees every verified round's parameter fetch: it used to know
    that no round after the third fetch would be checked, and skipped its work there (57 rounds in 16 runs, none
    caught)."""
    v = object.__new__(L._Verifier)
    counts, after, later = [0] * 14, 0, 0
    for _ in range(900):
        v.seen, v.total = 0, {"warmup": 0, "timed": 0}
        v.phase(5, 9)
        for i in range(14):
            met = v.done["timed"] >= 3
            if v._pick():
                counts[i] += 1
                v.done["warmup" if i < 5 else "timed"] += 1
                after += met
            later += met and i >= 5
            v.seen += 1
        assert v.done["warmup"] == 1 and v.done["timed"] >= 3
    assert counts[:5] == [900, 0, 0, 0, 0] and sum(counts[5:]) == 2700 + after
    assert all(200 <= c <= 500 for c in counts[5:]), counts
    assert later > 1000 and 0.19 < after / later < 0.31, (after, later)  # a round is never known to be safe


@pytest.mark.skipif(SANDBOX != "bwrap", reason="needs the bubblewrap sandbox (the trusted module is visible without)")
def test_importing_the_trusted_module_fails_cleanly(tmp_path):
    ref = reference(tmp_path)
    ref.write_text("from autograder.checks.lab4_checks import hidden_case  # noqa\n" + ref.read_text())
    v, = run_checks(["lab4.correctness_hidden"], ref, device="cpu")
    assert not v["ok"] and v["score"] == 0 and v["gradable"] and v["sandbox"] == "bwrap"
    assert v["message"] == harness.WITHHELD, v["message"]  # a hidden check says no more
    assert harness.CHECKS["lab4.correctness_hidden"].module == "autograder.checks.lab4_checks"


# Slower in every other step: its rounds jitter, so a ratio of it can sit near a boundary run after run.
JITTER = """
import time as _time

_steady = build_train_step


def build_train_step(model, **kw):
    step, calls = _steady(model, **kw), [0]

    def jittery(x, y):
        calls[0] += 1
        if calls[0] % 2:
            _time.sleep(0.01)
        return step(x, y)

    return jittery
"""

# Honest through the first measurement (9 + 2 x 3 calls with the rounds below), then no work at all: a bet that the
# re-measurement a near-boundary ratio earns is timed without the spot checks.
STALE_IN_REMEASUREMENT = STALE.replace("calls[0] > 9", "calls[0] > 15")


def _always_near(monkeypatch) -> list:
    """Every first ratio counts as near a boundary (landing there on purpose is not reproducible on a busy CPU);
    returns the list the measurements' round counts go to."""
    monkeypatch.setattr(L.remeasure, "near", lambda ab, tiers, required_ratio=None: "near (forced by the test)")
    counted, compare = [], Context.compare

    def counting(self, *a, **kw):
        counted.append(kw["rounds"])
        return compare(self, *a, **kw)

    monkeypatch.setattr(Context, "compare", counting)
    return counted


def test_a_jittery_submission_near_a_boundary_is_remeasured_once_and_gets_its_pooled_grade(tmp_path, monkeypatch):
    counted = _always_near(monkeypatch)
    tiers = Tiers(((0.01, 0.5), (50.0, 1.0)))
    monkeypatch.setattr(L, "SPEED_ROUNDS", {"rounds": 2, "warmup": 1, "inner": 3})
    monkeypatch.setattr(L, "SPEED_WARMUP_STEPS", 3)
    box, work = tmp_path / "box", tmp_path / "work"
    box.mkdir()
    work.mkdir()
    f = box / "student_speedrun.py"
    f.write_text(reference(tmp_path).read_text() + JITTER)
    ctx = Context(device=torch.device("cpu"), hardware="cpu", small=True, work_dir=work, student_file=f,
                  sandbox=SANDBOX)
    ctx.deadline = time.monotonic() + 300
    try:
        out = L._speed(ctx, tiers)
    finally:
        ctx.close()
    m = out["measurements"]
    assert len(counted) == 2 and counted[0] == 2 and counted[1] >= 2, counted  # exactly one re-measurement
    assert m["remeasured"] and m["timed_rounds"] == 2 + counted[1] == m["pooled"]["rounds"], m
    # scored on the pooled ratio (recorded to 3 decimals, the speed-up to 2: compare within their rounding)
    assert abs(m["speedup"] - m["pooled"]["ratio"]) <= 0.0051 and out["fraction"] == tiers.fraction(m["speedup"]) == 0.5
    assert m["first_measurement"]["rounds"] == 2 and "Re-measured" in out["message"], out["message"]
    # each measurement spot-checks its own rounds: 3 (or all, if fewer), then a quarter of the rest
    assert 2 + min(3, counted[1]) <= m["timed_rounds_verified"] <= 2 + counted[1], m


def test_cheating_only_in_the_remeasurement_gets_no_speed_points(tmp_path, monkeypatch):
    _always_near(monkeypatch)
    text = reference(tmp_path).read_text() + STALE_IN_REMEASUREMENT
    with pytest.raises(CheckFailed, match="no speed points") as e:
        speed(tmp_path, monkeypatch, text)
    assert "re-measurement, " in str(e.value) and "parameters did not change" in str(e.value), e.value

"""Lab 2 submissions written to fool the grader: right while checked, cheating while timed; reading the grader.

Each one is the reference solution plus a few lines; the speed check must give none of them a point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autograder.checks import harness
from autograder.checks.harness import run_check, run_checks, student_file_from_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "assignments" / "source" / "lab2_data_pipeline" / "lab2_data_pipeline.ipynb"

# Counts the augmented loaders built: the first (the grader's correctness epoch) is honest, later ones cheat.
_COUNT = '''
_real_init, _real_iter, _CACHE = PackedLoader.__init__, PackedLoader.__iter__, {}


def _init(self, *a, **kw):
    _real_init(self, *a, **kw)
    _CACHE["built"] = _CACHE.get("built", 0) + bool(self.augment)
    self._nth = _CACHE["built"]


PackedLoader.__init__ = _init
'''

# Timed epochs replay the checked epoch's batches: no work at all, every sample once, valid crops.
REPLAY = _COUNT + '''

def _iter(self):
    if not self.augment or self._nth <= 1:
        batches = list(_real_iter(self))
        _CACHE.setdefault("batches", batches) if self.augment else None
        yield from batches
        return
    yield from _CACHE["batches"]


PackedLoader.__iter__ = _iter
'''

# Timed epochs are shuffled anew but serve each image as augmented in the checked epoch: no augmentation work.
STALE = _COUNT + '''

def _iter(self):
    if not self.augment or self._nth <= 1:
        batches = list(_real_iter(self))
        if self.augment:
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            _CACHE["images"] = torch.empty_like(x)
            _CACHE["images"][y] = x
        yield from batches
        return
    order = torch.randperm(len(self.labels), generator=self.gen)
    for b in range(len(self)):
        idx = order[b * self.batch_size:(b + 1) * self.batch_size]
        yield _CACHE["images"][idx], self.labels[idx]


PackedLoader.__iter__ = _iter
'''


def _submission(tmp_path: Path, extra: str) -> Path:
    f = student_file_from_notebook(NOTEBOOK, tmp_path)
    f.write_text(f.read_text() + extra)
    return f


@pytest.mark.parametrize(("cheat", "caught"), [(REPLAY, "same order as the checked epoch"),
                                               (STALE, "repeats the crop and flip of the checked epoch")],
                         ids=["replays-the-checked-epoch", "stale-crops-when-timed"])
def test_loader_right_when_checked_but_cheating_when_timed_gets_no_speed_points(tmp_path, cheat, caught):
    v = run_check("lab2.loader_speed", _submission(tmp_path, cheat), device="cpu")
    assert not v["ok"] and v["gradable"] and v["score"] == 0, v
    assert caught in v["message"] and "gets no speed points" in v["message"], v["message"]


def test_importing_the_trusted_checks_fails_cleanly_with_zero(tmp_path):
    from autograder.sandbox.jail import probe

    if probe() is not None:
        pytest.skip(f"no sandbox here ({probe()}): the trusted modules are importable without one")
    f = _submission(tmp_path, "\nimport autograder.checks.lab2_checks as _leak  # the hidden cases and seeds\n")
    names = harness.checks_for("lab2")
    verdicts = run_checks(names, f, device="cpu")
    assert [v["check"] for v in verdicts] == names
    for v in verdicts:
        assert not v["ok"] and v["score"] == 0 and v["sandbox"] == "bwrap", v
        if harness.CHECKS[v["check"]].hidden:  # its failures name no details (below)
            assert v["message"] == harness.WITHHELD, v["message"]
            continue
        assert "importing student_pipeline.py raised ModuleNotFoundError" in v["message"], v["message"]
        # The trusted package is not inside the sandbox at all, so the import stops at it.
        assert "No module named 'autograder.checks" in v["message"], v["message"]


LEAKY_SAMPLER = """

class BucketSampler:  # hands each case it is given back in its error, which the verdict used to carry to the feedback
    def __init__(self, lengths, batch_size, *, seed=0):
        raise ValueError(f"HIDDEN n={len(lengths)} bs={batch_size} seed={seed} head={list(lengths[:10])}")
"""


def test_a_hidden_check_fails_without_handing_back_its_inputs(tmp_path):
    """The hidden sampler cases come from the course secret, the same for the whole course. A sampler that raises
    with its lengths, batch size and seed in the message got them back in its feedback, to hard-code next time.
    Naming the failed case, the error type or the check's seconds also let a hand-in send bits home (it chose its
    error, or slept, by the inputs): a hidden check now says pass or fail, and nothing else."""
    f = _submission(tmp_path, LEAKY_SAMPLER)
    public, hidden = run_checks(["lab2.bucket_sampler", "lab2.bucket_sampler_hidden"], f, device="cpu")
    assert not public["ok"] and "HIDDEN n=" in public["message"]  # public inputs: the student's error is shown
    assert not hidden["ok"] and hidden["gradable"] and hidden["score"] == 0
    assert hidden["message"] == harness.WITHHELD and hidden["measurements"] == {} and "seconds" not in hidden
    assert "n=" not in json.dumps(hidden)
    # passed, it says so and nothing more: its measurements were computed from the hidden lengths
    (tmp_path / "ref").mkdir()
    ok, = run_checks(["lab2.bucket_sampler_hidden"], student_file_from_notebook(NOTEBOOK, tmp_path / "ref"),
                     device="cpu")
    assert ok["ok"] and ok["score"] == ok["max_score"] and ok["measurements"] == {} and "seconds" not in ok, ok

"""Hand-ins that try to learn a hidden check's inputs, on the toy assignment (no torch, seconds a check).

A hidden check says pass or fail (harness.Check.hidden), but its inputs reach the student's process, which can
keep them, send them out through a later check, or sleep or swell by them. Two defences, each tried here:
the hidden checks run after the others, and each must pass two sets of cases (harness.hidden_draws), one drawn
for the student and one for the hand-in, so what one hand-in learns of its cases is no use to the next, and a
re-roll cannot pass the student's.
"""

from __future__ import annotations

import hashlib
import json

from autograder import rehearsal
from autograder.base import course_secret
from autograder.checks import harness, lab1_checks, lab2_checks, lab4_checks
from autograder.checks.harness import run_checks

# From its 7th call on, total() raises with every array it was given. toy.correct calls it 3 times and toy.hidden 3
# times: in the order the course lists them (correct, hidden, speed), toy.speed's message, which is not withheld,
# carried the hidden arrays to the feedback page.
LEAKY = '''import numpy as np
_calls = []


def total(xs):
    _calls.append((len(xs), [int(v) for v in xs[:3]]))
    if len(_calls) >= 7:
        raise ValueError("KEPT " + repr(_calls))
    return int(np.dot(xs, xs))
'''


def test_hidden_checks_run_last_so_no_later_check_reports_what_the_process_kept(tmp_path):
    f = tmp_path / "pipeline.py"
    f.write_text(LEAKY)
    names = ["toy.correct", "toy.hidden", "toy.speed"]
    verdicts = run_checks(names, f, device="cpu")
    assert [v["check"] for v in verdicts] == names  # reported in the order asked, run hidden-last
    assert "KEPT" in verdicts[2]["message"]  # the leak ran, and held only what the public checks gave
    from autograder.student.toy import arrays

    for draw in ({"student": None}, {"handin": harness._box_digest(f)}):  # the course's cases and the hand-in's
        for xs in arrays(**rehearsal.hidden_params(**draw)):
            assert f"({len(xs)}, {[int(v) for v in xs[:3]]})" not in json.dumps(verdicts)
    hidden = verdicts[1]
    assert not hidden["ok"] and hidden["message"] == harness.WITHHELD and hidden["measurements"] == {}
    assert verdicts[0]["ok"]


def test_hidden_inputs_are_drawn_for_the_hand_in_too(monkeypatch, tmp_path):
    """The same hand-in draws the same cases (a regrade agrees); another draws others, so inputs a hand-in
    spelled out by timing or memory are no use to the next one. Unset, the hand-in is every file the student's
    sandbox gets: the student file and the files beside it."""
    def values(handin):
        return (rehearsal.hidden_params(handin=handin), lab1_checks.hidden_edge_cases(handin=handin),
                lab2_checks._hidden_cases(handin=handin), lab4_checks.hidden_case(handin=handin))

    monkeypatch.setenv(course_secret.ENV, "a course secret of some length")
    a, b = values("sha-a"), values("sha-b")
    assert values("sha-a") == a and all(x != y for x, y in zip(a, b, strict=True))
    assert rehearsal.hidden_params() != rehearsal.hidden_params(handin="sha-a")
    seen = []

    def spawn(names, path, budget, device, sandbox, memory_gb, cache, student, disk_gb, handin):
        seen.append(handin)
        return [], {n: harness._failed(n, "stub") for n in names}, None
    monkeypatch.setattr(harness, "_spawn", spawn)
    f = tmp_path / "pipeline.py"
    f.write_text("def total(xs):\n    return 0\n")
    run_checks(["toy.hidden"], f, device="cpu")
    run_checks(["toy.hidden"], f, device="cpu", handin="intake-digest")
    # a file beside it goes into the sandbox too, and counts: one read at run time set a hidden check's answer
    # while the student file, and so its cases, stayed the same
    (tmp_path / "gf.txt").write_text("3.0")
    run_checks(["toy.hidden"], f, device="cpu")
    assert seen[1] == "intake-digest" and len({seen[0], seen[2]}) == 2
    assert seen[2] == harness._box_digest(f) and seen[0] != hashlib.sha256(f.read_bytes()).hexdigest()


def test_a_hidden_check_that_takes_its_process_down_says_no_more_than_a_failure(monkeypatch, tmp_path):
    """Past the worker's time budget the running check fails with the timeout; a hidden one with WITHHELD, as a
    hand-in that hangs on some inputs and answers wrong on others must not tell the two apart."""
    def spawn(names, *a):
        return list(names), {}, "timed out after 60 s (an endless loop, or far too slow)"
    monkeypatch.setattr(harness, "_spawn", spawn)
    f = tmp_path / "pipeline.py"
    f.write_text("def total(xs):\n    return 0\n")
    v, = run_checks(["toy.hidden"], f, device="cpu")
    assert v["message"] == harness.WITHHELD and v["measurements"] == {}
    v, = run_checks(["toy.correct"], f, device="cpu")
    assert "timed out" in v["message"]


def test_a_hidden_check_passes_only_on_the_students_cases_and_the_hand_ins():
    """Cases drawn for the hand-in alone could be re-rolled: a scaler that never reset its growth counter passed 118
    draws in 2,000, and a blank line changed the draw. Each hidden check also runs the student's own cases, the
    same for every hand-in of theirs, so a re-roll cannot pass those."""
    import types

    from autograder.student.toy import arrays, baseline

    asked = []

    def call(name, params):
        asked.append(params)
        return {"totals": [baseline(xs) for xs in arrays(**params)]}

    for handin in ("first", "second"):
        rehearsal.check_hidden(types.SimpleNamespace(student_id="amy", handin=handin, call=call))
    mine, first, again, second = asked
    assert mine == again == rehearsal.hidden_params(student="amy")  # the student's cases stay put
    assert first == rehearsal.hidden_params(handin="first") and second == rehearsal.hidden_params(handin="second")
    assert len({json.dumps(p, sort_keys=True) for p in (mine, first, second)}) == 3
    assert harness.hidden_draws(types.SimpleNamespace(student_id=None, handin=None)) == [{"student": None}]

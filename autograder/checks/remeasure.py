"""Re-measure a speed ratio that lands within its own spread of a tier boundary, once, before it is scored.

A speed check times its baseline and the student's code alternately and scores the median of the per-round
ratios against its tiers. When that median lies within the rounds' own spread (IQR) of a tier boundary
(autograder.checks.review.near_boundary: the one definition of "near"), another run could land on the other side, so
the trusted side times the check again, with more rounds and the same interleaving, verification and sandboxed
runners as the first time, and scores the pooled rounds of both runs. At most one re-measurement per check
(`measured` has no loop): a submission whose speed jitters wildly costs one more measurement of up to twice the
timed rounds (`Policy.rounds_factor`), never longer than the check had run before it (so at most ~2x the check's
time) and only within the check's own time budget, priced by the first measurement less the part of its warm-up
that took longer than its timed rounds (a warm-up the student made slow buys no skip); never a loop. A pooled
ratio still within its spread of a boundary is scored as measured and keeps the summary's "regrade recommended"
flag (review.flags reads the pooled `speedup`/`speedup_iqr`).

A ratio whose rounds' IQR exceeds the ratio itself is a coin toss, unless the middle half of its rounds lies above
every tier boundary: then it has full marks whichever round is believed, and is scored. (Wholly below a boundary
it is still a coin toss: a busy machine may have pushed an honest hand-in down.) Whose coin it is, the baseline's
own rounds tell. When they spread too (the machine was busy) the check is not gradable here and waits for a quieter machine.
When they held steady, the spread is the hand-in's own (its code, or its sleeping on purpose to dodge a low score)
and the ratio is scored as measured, with a note to the student and a line in the summary: a hand-in's own
jitter never buys "not graded yet", which it would carry to every machine it is regraded on.

Everything here runs in the trusted grading process; the student's process only answers timed requests.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from autograder.checks import review
from autograder.checks.harness import WARMUP_EXCESS_S, NotGradable


@dataclasses.dataclass(frozen=True)
class Policy:
    """When and how much a near-boundary speed ratio is measured again."""

    enabled: bool = True  # measure a near-boundary ratio again: once, never more (no student can make it loop)
    rounds_factor: float = 2.0  # the re-measurement's timed rounds, as a multiple of the first measurement's
    time_margin: float = 1.5  # re-measure only if the check's budget still holds this x the re-measurement's estimate
    max_spread: float = 1.0  # a ratio whose rounds' IQR exceeds this x the ratio is not scored: the machine was too busy
    # ... unless the baseline's own rounds (their IQR over their median, the steadier of the two interleaved halves)
    # spread by at most this much: then the machine was quiet, the spread is the hand-in's own, and it is scored
    quiet_baseline: float = 0.25


POLICY = Policy()


def _pool(a, b):
    """One ABResult holding the rounds of both measurements (ratios, baseline and student seconds)."""
    timing = type(a.a)  # labkit.bench's classes, taken from the results (this module imports no torch)
    return type(a)(timing(a.a.samples + b.a.samples), timing(a.b.samples + b.b.samples), a.ratios + b.ratios)


def _brief(ab, notes: dict | None = None) -> dict:
    out = {"ratio": round(ab.ratio, 3), "iqr": round(ab.ratio_iqr, 3), "rounds": len(ab.ratios)}
    for k in ("gpu_state", "gpu_measure_again", "baseline_interference", "baseline_after_student_slowdown"):
        if notes and k in notes:
            out[k] = notes[k]
    return out


def near(ab, tiers, required_ratio: float | None = None) -> str | None:
    """Why ratio `ab` is too close to a boundary of `tiers` (harness.Tiers) to score as is; None when it is not."""
    # rounded as the verdict records them, so this and the summary's flag (review.flags) agree on "near"
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2), "tiers": tiers.describe() if tiers else "",
         "required_ratio": required_ratio}
    return review.near_boundary(m)


def measured(measure: Callable[[int], tuple], rounds: int, tiers, *, required_ratio: float | None = None,
             time_left: Callable[[], float] | None = None, spent: Callable[[], float] | None = None,
             policy: Policy = POLICY,
             clock: Callable[[], float] = time.monotonic) -> tuple:
    """Time a speed check, and once more if its ratio is near a tier boundary; returns (ABResult, notes, record).

    `measure(rounds)` runs one interleaved measurement of `rounds` timed rounds (its warm-up included) and
    returns (ABResult, notes) as harness.Context.compare does. The ABResult returned is what to score: the first
    measurement, or both pooled. `record` goes into the verdict's measurements: `remeasured` (bool), and when
    the first ratio was near a boundary `remeasure_reason`, `first_measurement` {ratio, iqr, rounds},
    `remeasurement` (the same, with its own GPU state) and `pooled`, or `remeasure_skipped` (why not: no budget
    left, or the policy allows none). `time_left()` gives the check's remaining budget in seconds; `spent()` the
    seconds the check has run so far, which the re-measurement's estimated time may not exceed (fewer rounds then,
    never fewer than the first measurement's).
    """
    ab, notes, record, parts = _measured(measure, rounds, tiers, required_ratio=required_ratio,
                                         time_left=time_left, spent=spent, policy=policy, clock=clock)
    bounds = review.boundaries({"tiers": tiers.describe() if tiers else "", "required_ratio": required_ratio})
    too_wide(ab, record, policy, parts, interfered=bool(notes.get("baseline_interference")), bounds=bounds)
    return ab, notes, record


def baseline_spread(parts: list) -> float:
    """How much the machine itself moved during the timed rounds of `parts` (the measurements scored together):
    the baseline's IQR over its median seconds, in whichever of its two interleaved halves is steadier.

    The baseline runs in a process that never held student code, but every other baseline round follows a
    student round (harness.Context.compare's ABBA order) and can carry work the student's process left queued (a
    GPU kernel still running): a hand-in could make that half jitter to pass for a busy machine. The other half
    follows a baseline round. Each measurement starts its rounds with the same warm-up, so an index's parity
    means the same in each; a half of fewer than 3 rounds is not judged alone (both are used)."""
    halves = ([t for p in parts for t in p.a.samples[0::2]], [t for p in parts for t in p.a.samples[1::2]])
    if min(map(len, halves)) < 3:
        halves = ([t for p in parts for t in p.a.samples],)
    timing = type(parts[0].a)  # labkit.bench's Timing, taken from the results (this module imports no torch)
    return min(timing(h).iqr / timing(h).median for h in halves)


def above_every_boundary(ratios: list[float], bounds: list[float] | None) -> bool:
    """Whether the middle half of per-round `ratios` (from their first quartile up) lies above every tier
    boundary in `bounds`, so that the check has full marks whichever round is believed (False without bounds)."""
    if not bounds or len(ratios) < 2:
        return False
    q1 = statistics.quantiles(ratios, n=4, method="inclusive")[0]  # labkit.bench.quantile's interpolation
    return q1 > max(bounds)


def too_wide(ab, record: dict, policy: Policy = POLICY, parts: list | None = None, *, interfered: bool = False,
             bounds: list[float] | None = None) -> None:
    """Refuse to score a ratio whose rounds disagree by more than the ratio itself (the IQR above
    `policy.max_spread` x the median) on a busy machine: a score would be a coin toss, so the check is not
    gradable here and goes to a quieter machine. On a quiet one (the baseline's rounds within
    `policy.quiet_baseline`, `baseline_spread` of `parts`, default [ab]) the spread is the hand-in's own: the ratio
    is scored as measured and `record` gets `own_spread` (the message says so), so that jittering on purpose
    cannot turn a low score into "not graded yet" on every machine. So it is when the hand-in's process was seen
    slowing the baseline (`interfered`: work it left queued, harness.Context.compare): then the baseline's spread
    may be the hand-in's doing too, and says nothing of the machine. A spread whose middle half lies above every
    boundary (`bounds`, the check's tiers; `above_every_boundary`) is scored whatever the machine did: a 70x ratio
    whose rounds ran 30x to 100x on a busy machine has a 4x top tier whichever round is believed."""
    if ab.ratio_iqr <= policy.max_spread * ab.ratio or above_every_boundary(ab.ratios, bounds):
        return
    steady = round(baseline_spread(parts or [ab]), 3)
    if steady <= policy.quiet_baseline or interfered:
        record["own_spread"] = {"ratio": round(ab.ratio, 3), "iqr": round(ab.ratio_iqr, 3), "rounds": len(ab.ratios),
                                "baseline_iqr_share": steady, "baseline_interference": interfered}
        return
    raise NotGradable(f"the timing was too noisy to score here ({ab.ratio:.2f}x, but its rounds' IQR is "
                      f"{ab.ratio_iqr:.2f} over {len(ab.ratios)} rounds, and the baseline's own rounds spread by "
                      f"{steady:.0%} of their median: the machine was busy); time it again on a quiet machine",
                      speedup=round(ab.ratio, 3), speedup_iqr=round(ab.ratio_iqr, 3), rounds=len(ab.ratios),
                      baseline_iqr_share=steady, **record)


def _measured(measure, rounds, tiers, *, required_ratio, time_left, spent, policy, clock) -> tuple:
    t0 = clock()
    ab, notes = measure(rounds)
    excess = notes.pop(WARMUP_EXCESS_S, 0.0)
    why = near(ab, tiers, required_ratio)
    if why is None:
        return ab, notes, {"remeasured": False}, [ab]
    record = {"remeasured": False, "remeasure_reason": why, "first_measurement": _brief(ab, notes)}
    # seconds of the first measurement, less a warm-up slower than its timed rounds: the student's process can
    # stretch that at no cost to its ratio, and must not buy a skipped re-measurement with it (a slow warm-up in
    # the re-measurement itself then runs into the check's deadline, and the check fails)
    took = max(clock() - t0 - excess, 1e-9)
    more = round(rounds * policy.rounds_factor)
    if spent is not None:  # the whole check so far bounds the re-measurement: a check costs at most ~2x
        more = min(more, int(rounds * spent() / took))
    more = max(more, rounds)
    estimate = took * more / rounds
    if not policy.enabled:
        return ab, notes, {**record, "remeasure_skipped": "re-measurement is switched off (remeasure.Policy)"}, [ab]
    if time_left is not None and time_left() < policy.time_margin * estimate:
        return ab, notes, {**record, "remeasure_skipped": f"the check's time budget has {time_left():.0f} s left, "
                                                          f"a re-measurement needs ~{estimate:.0f} s"}, [ab]
    ab2, notes2 = measure(more)  # the one re-measurement; whatever it shows, nothing times this check again
    notes2.pop(WARMUP_EXCESS_S, None)
    pooled = _pool(ab, ab2)
    record.update(remeasured=True, remeasurement=_brief(ab2, notes2), pooled=_brief(pooled))
    merged = dict(notes)
    again = "; ".join(n["gpu_measure_again"] for n in (notes, notes2) if n.get("gpu_measure_again"))
    if again:
        merged["gpu_measure_again"] = again
    if notes2.get("baseline_interference"):
        merged["baseline_interference"] = True
    return pooled, merged, record, [ab, ab2]


def message(record: dict) -> str:
    """One line for the student's feedback about a re-measurement, and about a spread that was the hand-in's
    own ("" when neither)."""
    return _remeasured_line(record) + _own_spread_line(record)


def _remeasured_line(record: dict) -> str:
    if record.get("remeasured"):
        f, p = record["first_measurement"], record["pooled"]
        return (f" Re-measured: the first {f['ratio']:.2f}x (IQR {f['iqr']:.2f}, {f['rounds']} rounds) was within "
                f"its spread of a tier boundary; scored on the pooled {p['rounds']} rounds: {p['ratio']:.2f}x.")
    if record.get("remeasure_skipped"):
        return f" Near a tier boundary, not re-measured ({record['remeasure_skipped']})."
    return ""


def _own_spread_line(record: dict) -> str:
    o = record.get("own_spread")
    if not isinstance(o, dict):
        return ""
    why = ("your process left work that slowed the baseline" if o.get("baseline_interference") else
           f"the baseline's held within {o['baseline_iqr_share']:.0%} of their median")
    return (f" Your rounds disagree by more than the ratio itself (IQR {o['iqr']:.2f} of {o['ratio']:.2f}x over "
            f"{o['rounds']} rounds) while {why}: the spread is your code's own, so the ratio is scored as measured.")

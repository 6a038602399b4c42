"""Lab 3, profile and fix: the answer key, and the checks of the student's fixed training loop.

The baseline is the student's own variant of the slow script, regenerated here from the course secret and the
student id (autograder.checks.lab3_variants; the open-kit default gives everyone the repository's slow_train.py). The
student's file defines `bottlenecks() -> {site letter: kind}` and a `train(...)` with the slow script's
signature and result that must compute the same losses and accuracy, without a host sync per step, faster.
Every run of the student's code happens in a probe of `autograder.student.lab3` in the sandbox; the references
(the variant run here, or in the baseline's process for timed rounds), the answer key, the seeds used when
grading and every verdict stay here.
"""

from __future__ import annotations

import collections
import math
import secrets
import time

import torch

from autograder.base import course_secret
from autograder.checks import lab3_variants, remeasure
from autograder.checks.harness import CheckFailed, Tiers, require
from autograder.student import lab3 as scen

SITES = lab3_variants.LETTERS
KINDS = lab3_variants.KINDS
# Ratio of the fixed loop's speed to the slow script's, each in its own process, interleaved (the idle one frozen).
# On a CPU the small CNN's own math is a large share of a step, so the reachable ratio is ~1.8-2x; on a GPU the
# step is launch bound and the planted syncs and Python loops dominate, so 3x is easy for a complete fix.
SPEED_TIERS = {
    "tensor_core_gpu": Tiers(((2.0, 0.5), (3.0, 1.0))),
    "gpu": Tiers(((2.0, 0.5), (3.0, 1.0))),
    "cpu": Tiers(((1.2, 0.5), (1.45, 1.0))),
}
SPEED_ROUNDS, SPEED_WARMUP = 5, 1  # timed rounds (each on fresh seeds and data) and untimed warm-up rounds
BATCH = 64
PUBLIC_SEEDS = {"data_seed": 0, "init_seed": 0, "seed": 0}  # the notebook's own run: a student can reproduce it


def _fresh_seeds() -> dict:
    """Seeds drawn for one timed round (never fixed anywhere): data, model initialization and batch order."""
    return {k: secrets.randbelow(2**31) for k in PUBLIC_SEEDS}


def _hidden_seeds(ctx, label: str) -> dict:
    """The hidden run's seeds, from the course secret and the student (so a regrade draws the same ones)."""
    return {k: course_secret.seed(f"lab3.hidden/{label}/{k}", ctx.student_id) for k in PUBLIC_SEEDS}


_VARIANTS: dict = {}


def variant(ctx):
    """(spec, module, source) of the student's slow_train.py variant, rendered once per process."""
    secret = course_secret.load()
    key = (ctx.student_id, secret.key)
    if key not in _VARIANTS:
        spec = lab3_variants.spec_for(ctx.student_id, secret)
        source = lab3_variants.render(spec)
        _VARIANTS[key] = (spec, lab3_variants.load(spec), source)
    return _VARIANTS[key]


def _run_params(ctx, steps: int, seeds: dict) -> dict:
    return {"n": 1024 if ctx.small else 2048, "steps": steps, "batch_size": BATCH, **seeds}


# ---------------------------------------------------------------------------------- part A: the answer key


def check_answers(ctx) -> dict:
    """Grade the written findings: what bottlenecks() declares (read in the sandbox) against the answer key of
    the student's variant."""
    answer_key = lab3_variants.answer_key(variant(ctx)[0])
    neutral = lab3_variants.neutral_sites(variant(ctx)[0])
    got = ctx.call("lab3.answers", {})
    kind = got.get("type") if isinstance(got, dict) else None
    require(kind == "dict", f"bottlenecks() must return a dict {{site letter: kind}}, got {str(kind)[:40]}")
    pairs = got["pairs"]
    require(isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
                                            for p in pairs), "the submission's process sent malformed answers")
    ans = {k.strip().upper(): v.strip().lower() for k, v in pairs}
    extra = max(0, int(got.get("size", len(pairs))) - len(pairs))  # entries past the first 64 are not sent
    bad_sites = sorted(set(ans) - set(SITES))
    bad_kinds = sorted({v for v in ans.values() if v not in KINDS})
    require(not bad_sites and not extra, f"unknown site(s) {_few(bad_sites)}{f' and {extra} more' if extra else ''}: "
            f"use the letters {', '.join(SITES)} from slow_train.py")
    require(not bad_kinds, f"unknown kind(s) {_few(bad_kinds)}: use one of {', '.join(KINDS)}")
    points = 0.0
    for site, kinds in answer_key.items():
        if site in ans:
            points += 1.0 if ans[site] in kinds else 0.5
    neutral_named = sorted(s for s in set(ans) - set(answer_key) if ans[s] in neutral.get(s, ()))
    false_alarms = sorted(set(ans) - set(answer_key) - set(neutral_named))
    points = max(0.0, points - len(false_alarms))
    frac = points / len(answer_key)
    found = sorted(set(ans) & set(answer_key))
    m = {"found": found, "right_kind": sorted(s for s in found if ans[s] in answer_key[s]),
         "false_alarms": false_alarms, "neutral": neutral_named, "planted": len(answer_key)}
    if frac == 0:
        raise CheckFailed("none of the named sites is a planted bottleneck (or false alarms cancel them)", **m)
    return {"fraction": frac, "message": f"{len(found)} of {len(answer_key)} bottlenecks found, "
                                         f"{len(m['right_kind'])} with the right kind, {len(false_alarms)} false alarm(s)"
                                         + (f"; {', '.join(neutral_named)} (the per-batch copy, never planted) "
                                            "neither counted nor cost" if neutral_named else ""),
            "measurements": m}


def _few(items: list, k: int = 10) -> str:
    return str([str(s)[:20] for s in items[:k]]) + (f" (+{len(items) - k})" if len(items) > k else "")


# ---------------------------------------------------------------------------------- runs and their comparison


def _observation(got) -> dict:
    """A run's observation from the student's process, type-checked: losses (list of floats), counters (ints)."""
    require(isinstance(got, dict), "the submission's process sent no result of the run")
    losses = got["losses"]
    require(isinstance(losses, torch.Tensor) and losses.dim() == 1 and losses.dtype == torch.float64,
            "the submission's process sent malformed losses")
    ints = {k: got[k] for k in ("correct", "steps", "samples")}
    require(all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()),
            "the submission's process sent malformed counts")
    return {"losses": losses.tolist(), **ints}


def _compare(got: dict, ref: dict, steps: int, label: str = "") -> dict:
    """Check a run against the slow script's run on the same seeds; returns the measurements of the run."""
    g, r = _observation(got), _observation(ref)
    gl, rl = g["losses"], r["losses"]
    m = {"steps": g["steps"], "samples": g["samples"], "first_losses": [round(v, 4) for v in gl[:4]],
         "reference_first_losses": [round(v, 4) for v in rl[:4]], "correct": g["correct"],
         "reference_correct": r["correct"]}
    require(len(gl) == steps, f"{label}{len(gl)} losses returned for {steps} steps", **m)
    require(g["steps"] == steps, f"{label}{g['steps']} optimizer steps for steps={steps}", **m)
    require(g["samples"] == steps * BATCH, f"{label}the model saw {g['samples']} samples, expected {steps * BATCH} "
            "(one forward pass of batch_size samples per step)", **m)
    # Reordering float operations (batched normalization, another memory layout) changes the last bits, and
    # training amplifies that a little over the steps; a different order of samples changes it a lot.
    for s in range(steps):
        tol = 2e-3 if s < 5 else 5e-2
        require(math.isclose(gl[s], rl[s], rel_tol=tol, abs_tol=tol), f"{label}step {s}: loss {gl[s]:.5f}, the slow "
                f"script gives {rl[s]:.5f}: same data order, normalization, model and optimizer as slow_train.py", **m)
    require(abs(g["correct"] - r["correct"]) <= max(2, 0.01 * steps * BATCH), f"{label}{g['correct']} correct "
            f"training predictions, the slow script counts {r['correct']}", **m)
    return m


def _same_result(ctx, steps: int, seeds: dict | None = None, label: str = "") -> dict:
    params = _run_params(ctx, steps, seeds or PUBLIC_SEEDS)
    ref = scen.train_run(variant(ctx)[1].train, ctx.device, params)
    return _compare(ctx.call("lab3.train", params), ref, steps, label)


def check_same_result(ctx) -> dict:
    """Losses, correct count, optimizer steps and samples against the slow script: on the notebook's seeds, then
    on seeds drawn when grading (so a result that only holds for the public seeds does not pass)."""
    steps = 20 if ctx.small else 60
    m = _same_result(ctx, steps)
    _same_result(ctx, steps, _hidden_seeds(ctx, "same_result"), "with other seeds (data, initialization and batch order): ")
    return {"message": f"same losses and accuracy as the slow script over {m['steps']} steps (on the notebook's "
                       "seeds and on others)", "measurements": m}


# ---------------------------------------------------------------------------------- part C: host syncs


def check_no_host_sync(ctx) -> dict:
    """At most steps // 4 + 4 host syncs in one run: a few at the start and end, one per epoch, not one per step.

    The count (and where the syncs happen) is the student process's own report: nothing outside that process can
    see a host sync. What the counted run returned is checked against the slow script on the same (fresh) seeds,
    so a loop cannot skip its work while it is being counted.
    """
    steps = 24 if ctx.small else 60
    _same_result(ctx, steps=8)  # a loop that does not train has nothing to sync: correctness first
    params = {**_run_params(ctx, steps, _hidden_seeds(ctx, "no_host_sync")), "warmup_steps": 4}  # warm-up: lazy init may sync once
    got = ctx.call("lab3.host_syncs", params)
    sites = got["sites"]
    require(isinstance(sites, list) and all(isinstance(s, str) for s in sites),
            "the submission's process sent malformed sync sites")
    _compare(got, scen.train_run(variant(ctx)[1].train, ctx.device, params), steps, "the run whose host syncs were counted: ")
    syncs, allowed = len(sites), steps // 4 + 4
    by_site = collections.Counter(s[:120] for s in sites)
    m = {"host_syncs": syncs, "steps": steps, "allowed": allowed, "sync_sites": dict(by_site.most_common(6))}
    where = ", ".join(f"{k} ({v}x)" for k, v in by_site.most_common(3))
    require(syncs <= allowed, f"{syncs} host syncs in {steps} steps (at most {allowed}): keep losses and counts "
            f"as tensors inside the loop and convert once at the end; they happen at {where}", **m)
    return {"message": f"{syncs} host sync{'' if syncs == 1 else 's'} in {steps} steps", "measurements": m}


# ---------------------------------------------------------------------------------- part D: speed


class _Rounds:
    """Pairs each timed round's two replies (the baseline's and the student's, same seeds) and compares them.

    The slow script's reply is the reference: it ran on the same seeds in a process that never held student
    code. Whichever reply of a round arrives second triggers the comparison (the order alternates by round).
    """

    def __init__(self, steps: int):
        self.steps, self.base, self.student, self.checked = steps, {}, {}, set()

    def on_base(self, result, params) -> None:
        self.base[params["round"]] = result
        self._match(params["round"])

    def on_student(self, result, params) -> None:
        self.student[params["round"]] = result
        self._match(params["round"])

    def _match(self, r: int) -> None:
        if r in self.base and r in self.student:
            _compare(self.student.pop(r), self.base.pop(r), self.steps,
                     f"timed run {r + 1} (every timed run is checked, each on fresh seeds): ")
            self.checked.add(r)


def check_speedup(ctx) -> dict:
    """Fixed vs slow training, each in its own process, interleaved with the idle one frozen: ratio, tiered.

    Every round (warm-up included) runs both on fresh seeds and data, made ahead outside the timing, and the
    student's timed reply must match the slow script's reply of the same round: a loop that is right when
    checked but skips or reuses work when timed gets no speed points. The data is made here, on the trusted
    side, and travels inside each timed request to both processes alike: a call into the student's process
    before the clock starts (as a preparation step was) is time their code could spend on the timed run's
    work, converting or moving its data, at no cost to the ratio.
    """
    t0 = time.monotonic()
    _same_result(ctx, steps=8)  # correctness gates speed
    steps = 20 if ctx.small else 50
    seeds, rounds, tiers = [], _Rounds(steps), SPEED_TIERS[ctx.hardware]

    def timed(k: int):
        """One measurement of k timed runs (its warm-up first), on data made ahead for fresh seeds."""
        off = len(seeds)
        seeds.extend(_fresh_seeds() for _ in range(SPEED_WARMUP + k))
        n = _run_params(ctx, steps, PUBLIC_SEEDS)["n"]
        made = [scen.data({"n": n, "data_seed": s["data_seed"]}) for s in seeds[off:]]  # here, untimed
        if not off:  # the baseline's process times the student's own slow script: it gets the variant's source
            ctx.baseline_call("lab3.prepare", {"n": n, "data_seeds": [], "slow_source": variant(ctx)[2]})

        def request(probe):
            return lambda r: (probe, {**_run_params(ctx, steps, seeds[off + r]), "round": off + r,
                                      "images": made[r][0], "labels": made[r][1]})

        return ctx.compare(request("lab3.slow_train"), request("lab3.timed_train"), rounds=k, warmup=SPEED_WARMUP,
                           check_base=rounds.on_base, check_student=rounds.on_student)

    ab, notes, record = remeasure.measured(timed, SPEED_ROUNDS, tiers, time_left=ctx._left,
                                           spent=lambda: time.monotonic() - t0)
    require(len(rounds.checked) == len(seeds), "not every timed run could be checked")
    frac = tiers.fraction(ab.ratio)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2),
         "slow_ms_per_step": round(1e3 * ab.a.median / steps, 3), "fixed_ms_per_step": round(1e3 * ab.b.median / steps, 3),
         "tiers": tiers.describe(), "timed_runs_checked": len(rounds.checked), **record, **notes}
    again = remeasure.message(record)
    if frac == 0:
        raise CheckFailed(f"the fixed loop is {ab.ratio:.2f}x the slow script, below the first tier "
                          f"({tiers.describe()}).{again}", **m)
    return {"fraction": frac, "message": f"{ab.ratio:.2f}x faster than slow_train.py "
                                         f"({m['fixed_ms_per_step']} vs {m['slow_ms_per_step']} ms/step).{again}",
            "measurements": m}

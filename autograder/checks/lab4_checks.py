"""Lab 4, ResNet-18 speedrun: the trusted checks (the naive step itself is public: autograder.student.lab4).

The student's file defines `build_train_step(model, *, lr, momentum, weight_decay, device)` returning
`step(x_uint8, y) -> loss`: normalize the uint8 NCHW batch with the CIFAR mean/std, forward, cross-entropy,
backward, one SGD step (momentum, weight decay). It may change *how* (channels_last, bf16/fp16 autocast,
torch.compile, fused optimizer, cudnn.benchmark, CUDA graphs) but not *what*: same batches, same number of
steps, same update rule. The batch size is the harness's, not the student's.

The student's step runs only in the sandbox (probes in autograder.student.lab4), which reports losses and the
flattened parameters after each step; the naive fp32 step and its bf16 twin run here, in the trusted process,
on the same scenario, and every decision is taken here. The speed check times the naive step in the baseline's
process against the student's, interleaved, and spot-checks the rounds, chained (see `_Verifier`).
"""

from __future__ import annotations

import math
import re
import secrets
import time

import torch
import torch.nn.functional as F

from autograder.checks import gpu_policy, remeasure
from autograder.checks.harness import CheckFailed, NotGradable, Tiers, hidden_draws, require
from autograder.student import lab4 as scen
from autograder.student.lab4 import HYPER, MEAN, STD, NaiveStep, make_batches  # noqa: F401  (public names)
from labkit.env import native_bf16

SEEDS = {"correctness": 0, "no_host_sync": 2, "speed": 3}  # public; the hidden case is hidden_case()'s

# Speed-up of the student's step over the naive step, separate processes, interleaved. On an H100 bf16 +
# channels_last + torch.compile + a fused optimizer reach ~2.2x at batch 512 and CUDA graphs on top ~3.8x (the
# reference solution, like the ladder's cuda_graphs rung); 3x earns full marks, the bonus sits a little above
# that reference. benchmarks/results/grading/grade_reference_gpu.json and grade_reliability.json hold the measured ratios.
SPEED_TIERS = {  # per harness class; gpu_policy.LAB4_SPEED_TIERS splits tensor-core GPUs (the T4 class is fp16)
    "tensor_core_gpu": gpu_policy.LAB4_SPEED_TIERS["bf16_tensor_core_gpu"],
    "gpu": gpu_policy.LAB4_SPEED_TIERS["gpu"],
}
SPEED_ROUNDS = {"rounds": 9, "warmup": 3, "inner": 5}  # interleaved rounds, each `inner` steps per request
SPEED_WARMUP_STEPS = 10  # compile, cuDNN autotune, CUDA-graph capture: all before the clock starts
# Rounds verified in full (see _Verifier): the first warm-up round, then 3 of the timed rounds drawn at random
# (4 of 14 at the settings above), and each timed round after those 3 with probability 1 / "after": a round is
# never known to be safe. The rest carry losses and a commitment only.
SPEED_SPOT = {"warmup": 1, "timed": 3, "after": 4}
TENSOR_CORE_KERNEL = re.compile(r"xmma|hmma|wgmma|gmma|tensorop|16816|1688|884|bf16|f16|tf32|nvjet|cutlass", re.I)


def sizes(ctx) -> dict:
    """Problem size by hardware: the full model on a GPU, a narrow one on a CPU so checks take seconds."""
    return scen.sizes(ctx.small)


def _twin_dtype(device) -> torch.dtype:
    """bf16 where the device has it (CPU, Ampere and newer), else fp16 (older GPUs)."""
    return torch.bfloat16 if native_bf16(device) else torch.float16


def _student_trajectory(ctx, params: dict, n_params: int):
    """The student's losses (k,) and parameter rows (k+1, n_params) from the sandbox, validated."""
    got = ctx.call("lab4.trajectory", params)
    k = int(params["k"])
    losses, rows = got["losses"], got["params"]
    require(isinstance(losses, torch.Tensor) and losses.numel() == k,
            f"the submission's process sent no {k} losses (a malformed answer)")
    require(isinstance(rows, torch.Tensor) and rows.dtype == torch.float32 and tuple(rows.shape) == (k + 1, n_params),
            f"the submission's process sent no parameter trajectory of shape ({k + 1}, {n_params}) (a malformed answer)")
    return [float(v) for v in losses.double().reshape(-1)], list(rows.unbind(0))


def _correctness(ctx, hyper, seed, keep: bool = False) -> tuple[dict, dict]:
    """Run K batches through the naive fp32 step, its bf16 twin (here) and the student's step (sandbox).

    Whole trajectories drift apart under AMP rounding (a small BatchNorm network is chaotic), so the check
    compares what a correct step must preserve, each against the AMP rounding measured on the twin:
    the step-0 loss (same weights, same batch: normalization, loss and whole batch), the first update's
    direction and size (gradient, lr, weight decay), the second update's component along the first (momentum)
    and one parameter update per call. Later losses only need to stay near the naive ones. Returns the
    measurements and the end of the student's trajectory (weights and last update, for the speed check).
    """
    sz = sizes(ctx)
    params = {"width": sz["width"], "batch": sz["batch"], "k": sz["k"], "seed": seed, "hyper": dict(hyper),
              "keep": keep}
    ref = scen.trajectory(scen.naive_builder(), ctx.device, params)
    twin = scen.trajectory(scen.naive_builder(_twin_dtype(ctx.device)), ctx.device, params)
    n_params = ref["params"].shape[1]
    losses, theirs = _student_trajectory(ctx, params, n_params)
    ref_losses, amp_losses = ref["losses"].tolist(), twin["losses"].tolist()
    trail = {"theirs": theirs, "mine": list(ref["params"].unbind(0)), "twin": list(twin["params"].unbind(0))}
    changed = sum(not torch.equal(theirs[i + 1], theirs[i]) for i in range(sz["k"]))
    u = {k: [t[i + 1] - t[i] for i in range(len(t) - 1)] for k, t in trail.items()}
    m = {"losses": [round(v, 4) for v in losses], "reference_losses": [round(v, 4) for v in ref_losses],
         "bf16_reference_losses": [round(v, 4) for v in amp_losses], "steps_that_updated": changed,
         "batch": sz["batch"], "k": sz["k"],
         "first_update_cosine": round(_cos(u["theirs"][0], u["mine"][0]), 4),
         "first_update_norm_ratio": round(_norm_ratio(u["theirs"][0], u["mine"][0]), 4),
         "momentum_carry": round(_carry(u["theirs"][1], u["theirs"][0]), 4),
         "reference_momentum_carry": round(_carry(u["mine"][1], u["mine"][0]), 4),
         "bf16_reference_first_update_cosine": round(_cos(u["twin"][0], u["mine"][0]), 4)}
    start = float((theirs[0] - trail["mine"][0]).abs().max())
    require(start <= 1e-3 * float(trail["mine"][0].abs().max()), f"build_train_step changed the model's weights "
            f"before the first step (by up to {start:.3g}): train the given model from its given weights", **m)
    _judge(m, losses, ref_losses, amp_losses, changed, sz, hyper)
    return m, {"w": theirs[-1], "u": theirs[-1] - theirs[-2]}


def _cos(a, b) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()).clamp_min(1e-30))


def _norm_ratio(a, b) -> float:
    return float(a.double().norm() / b.double().norm().clamp_min(1e-30))


def _carry(u2, u1) -> float:  # how much of the previous update the next one repeats: ~momentum
    return float(u2.double() @ u1.double() / (u1.double() @ u1.double()).clamp_min(1e-30))


def _judge(m, losses, ref_losses, amp_losses, changed, sz, hyper) -> None:
    require(all(math.isfinite(v) for v in losses), "a loss is not finite", **m)
    require(changed == sz["k"], f"the parameters changed in {changed} of {sz['k']} steps: every call is one optimizer "
            "step on the given model's parameters (modify them in place)", **m)
    gap0 = abs(amp_losses[0] - ref_losses[0])
    require(abs(losses[0] - ref_losses[0]) <= 0.01 + 3 * gap0,
            f"first loss {losses[0]:.4f} vs the naive step's {ref_losses[0]:.4f} on the same weights and batch: "
            "same normalization (v / 255 - mean) / std, cross-entropy, whole batch?", **m)
    twin_cos = m["bf16_reference_first_update_cosine"]
    require(m["first_update_cosine"] >= min(0.8, twin_cos - 0.1), f"the first update points elsewhere than the naive "
            f"step's (cosine {m['first_update_cosine']:.3f}; AMP rounding alone gives {twin_cos:.3f}): same batch, "
            "loss and gradient?", **m)
    require(0.85 <= m["first_update_norm_ratio"] <= 1.15, f"the first update is {m['first_update_norm_ratio']:.2f}x "
            "the naive step's in size: same learning rate and weight decay?", **m)
    require(abs(m["momentum_carry"] - m["reference_momentum_carry"]) <= 0.25,
            f"the second update repeats {m['momentum_carry']:.2f} of the first, the naive step's "
            f"{m['reference_momentum_carry']:.2f}: SGD momentum={hyper['momentum']} (buffer kept across steps)?", **m)
    # A gross-divergence guard only: from one step to the next the trajectories separate chaotically (on an H100
    # the reference's bf16 step sat 0.72 from the naive step at step 4 while the bf16 twin sat 0.13 away:
    # benchmarks/results/grading/grade_reference_gpu_53896f9.json), so the floor grows with the step; the precise checks
    # are the ones above.
    for s_ in range(1, sz["k"]):
        tol = max(4 * abs(amp_losses[s_] - ref_losses[s_]), 0.2 + 0.3 * s_)
        require(abs(losses[s_] - ref_losses[s_]) <= tol, f"step {s_}: loss {losses[s_]:.4f} vs the naive step's "
                f"{ref_losses[s_]:.4f}, beyond AMP drift ({tol:.3f})", **m)


def check_correctness(ctx) -> dict:
    m, _ = _correctness(ctx, HYPER, seed=SEEDS["correctness"])
    return {"message": f"same loss, update (cosine {m['first_update_cosine']:.3f}, size "
                       f"{m['first_update_norm_ratio']:.2f}x) and momentum as the naive step; one update per call",
            "measurements": m}


def hidden_case(student: str | None = None, handin: str | None = None) -> tuple[dict, int]:
    """The hidden test's hyper-parameters and seed, from the course secret and the student or the hand-in
    (autograder.checks.harness.hidden_draws): near the public ones (the step must use what it is given), never equal to
    them."""
    from autograder.base import course_secret

    r = course_secret.rng("lab4.hidden/hyper", student, handin=handin)
    hyper = {"lr": round(float(r.uniform(0.01, 0.04)), 4), "momentum": round(float(r.uniform(0.7, 0.88)), 3),
             "weight_decay": round(float(10 ** r.uniform(-2, -1)), 4)}
    return hyper, int(r.integers(2**31))


def check_correctness_hidden(ctx) -> dict:
    for draw in hidden_draws(ctx):
        hyper, seed = hidden_case(**draw)
        m, _ = _correctness(ctx, hyper, seed=seed)
    return {"message": "other hyper-parameters and seed: losses match the naive step's", "measurements": m}


def check_no_host_sync(ctx) -> dict:
    """Host syncs per step of the checked step, after a warm-up. The count is the student process's own report
    (nothing outside the process can see a host sync): see the threat model in autograder.student.probes."""
    _correctness(ctx, HYPER, seed=SEEDS["no_host_sync"], keep=True)  # a step that does nothing never syncs
    n = 4
    got = ctx.call("lab4.host_syncs", {"batch": sizes(ctx)["batch"], "seed": 0, "warmup": 3, "n": n})
    require(isinstance(got.get("sites"), list), "the submission's process sent no sync sites (a malformed answer)")
    sites = [str(s) for s in got["sites"]]
    syncs = len(sites)
    m = {"host_syncs_per_step": syncs / n, "sync_sites": sorted(set(sites))[:6]}
    where = f" (at {', '.join(m['sync_sites'])})" if sites else ""
    require(syncs <= n // 2, f"{syncs / n:g} host syncs per step{where}: return the loss as a tensor, no .item(), "
            "print or Python branches on tensor values inside the step", **m)
    return {"message": f"{syncs / n:g} host syncs per step", "measurements": m}


class _Verifier:
    """Spot-checks the student's timed rounds against the naive step, here, outside the clock.

    A round (seed s, n steps) ran in the sandbox on batches drawn from s; its reply holds the n losses and a
    commitment to the parameters after the last step (their dot product with a random vector drawn from s). After
    each reply, and only then (the student's process cannot know it in advance), `secrets` decides whether to
    verify that round in full: the first warm-up round always (its start is checked against the end of the
    correctness trajectory, which also gives it its previous update), then SPEED_SPOT["timed"] of the R timed
    rounds, a uniformly random subset drawn round by round (verify with probability need / rounds left), and
    once those are done each later timed round with probability 1 / SPEED_SPOT["after"]: every verified round
    fetches the parameters, which the student's process sees, so without it a cheat could count three fetches and
    skip its work in the rounds left. A
    verified round fetches its n + 2 parameter rows (untimed; see autograder.student.lab4._Rows) and checks:
    - the commitment against the last row (nothing may move the weights after the clock stopped);
    - the chain: the row it started from against the previous round's commitment, with that round's vector (the
      weights may change only inside the step, so work cannot slip between rounds either);
    - every step j from the weights w_j it started from: the parameters changed (one optimizer step per call);
      the loss is the naive loss at w_j on batch j, within 0.02 + 4x the bf16 twin's distance from it; SGD's
      update u_j = m u_{j-1} - lr (g_j + wd w_j), so u_j - m u_{j-1} must point along the naive fp32 gradient
      term (cosine at least min(0.8, the twin's - 0.1)) with its size (0.85x to 1.15x).
    An unverified round fetches and recomputes nothing: its commitment is kept for the next round's chain check.
    Why this suffices: a cheat that skips, repeats, fakes or defers work in k of the R timed rounds escapes only
    if none of the v verified ones is among those k: probability C(R - k, v) / C(R, v), so it is caught with
    1 - C(R - k, v) / C(R, v) (work deferred past the clock of round t is also caught when round t + 1 is verified,
    by the chain). The speed-up is the median of the R per-round ratios, so moving it needs a faster step in
    more than half the rounds: with R = 9 and v = 3 that is k >= 5, caught with probability at least 1 - 4/84
    (95%) by the quota alone, and k >= 7 always; a cheat in fewer rounds leaves the median to the honest rounds.
    A cheat that waits for the quota's three fetches and then skips k rounds is caught with 1 - (3/4)^k.
    A re-measurement near a tier boundary (autograder.checks.remeasure) is a `phase` of its own on the same chain: its
    warm-up and timed rounds get the same quotas, drawn the same way, so rounds timed a second time are spot-checked
    like the first ones and the pooled median still needs a faster step in more than half of all timed rounds.
    """

    def __init__(self, ctx, hyper: dict, sz: dict, start: dict, warmup: int, rounds: int):
        self.ctx, self.hyper, self.sz = ctx, hyper, sz
        self.model = scen.fresh_model(sz["width"], ctx.device)
        self.params = list(self.model.parameters())
        self.n_params = sum(p.numel() for p in self.params)
        self.start = {"w": start["w"].to(ctx.device), "u": start["u"].to(ctx.device)}
        self.mean = torch.tensor(MEAN, device=ctx.device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=ctx.device).view(1, 3, 1, 1)
        self.amp = _twin_dtype(ctx.device)
        self.seen = self.steps = 0
        self.total = {"warmup": 0, "timed": 0}  # rounds verified over all measurements
        self.phase(warmup, rounds)
        self.prev = None  # the previous round's params and commitment, for the chain check
        self.worst = {"loss_gap_share": 0.0, "update_cosine_margin": 1.0}

    def phase(self, warmup: int, rounds: int, label: str = "") -> None:
        """The next measurement's rounds: `warmup` (untimed or discarded), then `rounds` timed, each group with its
        own quota of verified rounds; the chain goes on from the last round of the previous measurement."""
        self.offset, self.label = self.seen, label  # rounds seen before this measurement; "re-measurement, "
        self.warmup, self.rounds = warmup, rounds
        self.quota = {"warmup": min(SPEED_SPOT["warmup"], warmup), "timed": min(SPEED_SPOT["timed"], rounds)}
        self.done = {"warmup": 0, "timed": 0}  # rounds of this measurement verified so far

    def _pick(self) -> bool:
        """Whether to verify the round that just replied: drawn now, a uniform subset of each group's rounds."""
        k = self.seen - self.offset
        group = "warmup" if k < self.warmup else "timed"
        if self.seen == 0:
            return True
        left = self.warmup - k if group == "warmup" else self.warmup + self.rounds - k
        need = self.quota[group] - self.done[group]
        if need <= 0:  # quota met: a cheat that counted the fetches would skip the rest, so they stay at risk
            return group == "timed" and secrets.randbelow(SPEED_SPOT["after"]) == 0
        return secrets.randbelow(max(left, 1)) < need

    def _loss_and_grad(self, w, x, y, amp):
        """The naive loss at weights `w` on (x, y), and its gradient (flat), fp32 or under `amp` autocast."""
        torch.nn.utils.vector_to_parameters(w, self.params)
        self.model.zero_grad(set_to_none=True)
        with scen.naive_switches():
            xn = (x.float() / 255 - self.mean) / self.std
            with torch.autocast(self.ctx.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = F.cross_entropy(self.model(xn), y)
            loss.backward()
        return float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in self.params])

    def _rows(self, n: int) -> list:
        """The round's n + 2 parameter rows from the sandbox, in logical order (float32 on the device)."""
        got = self.ctx.call("lab4.snapshots", {})
        raw, strides = got["rows"], got["strides"]
        require(isinstance(raw, torch.Tensor) and raw.dtype == torch.float32
                and tuple(raw.shape) == (n + 2, self.n_params), "the submission's process sent no parameter "
                f"snapshots of shape ({n + 2}, {self.n_params}) (a malformed answer)")
        require(isinstance(strides, list) and len(strides) == len(self.params) and all(
            isinstance(st, list) and len(st) == p.dim() and all(type(v) is int for v in st)
            and scen.dense_layout(p.shape, st) for st, p in zip(strides, self.params, strict=False)),
            "the submission's process sent malformed parameter layouts")
        raw = raw.to(self.ctx.device)
        rows = []
        for j in range(n + 2):
            off, parts = 0, []
            for p, st in zip(self.params, strides, strict=True):
                parts.append(raw[j, off:off + p.numel()].as_strided(p.shape, st).reshape(-1))
                off += p.numel()
            rows.append(torch.cat(parts))
        return rows

    def _committed(self, row, r, commit: float) -> bool:
        """Whether `row` (logical order) is the one committed to with vector r (float64 rounding aside)."""
        row = row.double()
        return abs(commit - float(row @ r)) <= 1e-9 * float(row.norm() * r.norm()) + 1e-9

    def _chain(self, where: str, rows: list) -> torch.Tensor:
        """Checks the round's start against the previous round's end; returns the update before the round."""
        if self.prev is None:  # the first round: its start is the correctness trajectory's end, held here
            w = self.start["w"]
            ok = float((rows[1] - w).abs().max()) <= 1e-6 * float(w.abs().max())
        else:
            p = self.prev
            _, r = scen.round_draws(p["n"], p["batch"], self.n_params, self.ctx.device, p["seed"])
            ok = self._committed(rows[1], r, p["commit"])
        require(ok, f"{where}: the weights the round started from are not the ones the previous round left when "
                "its clock stopped: the weights may change only inside the step; no speed points")
        return self.start["u"] if self.prev is None else rows[1] - rows[0]

    def __call__(self, result, params) -> None:
        n, k = int(params["n"]), self.seen - self.offset
        timed = k >= self.warmup
        where = self.label + (f"timed round {k - self.warmup + 1}" if timed else f"warm-up round {k + 1}")
        require(isinstance(result, dict) and isinstance(result.get("losses"), torch.Tensor)
                and result["losses"].numel() == n and isinstance(result.get("commit"), float),
                f"{where}: the submission's process sent no {n} losses (a malformed answer)")
        if self._pick():
            self._verify(where, n, params, result)
            self.done["timed" if timed else "warmup"] += 1
            self.total["timed" if timed else "warmup"] += 1
        self.prev = {"n": n, "batch": int(params["batch"]), "seed": int(params["seed"]), "commit": result["commit"]}
        self.seen += 1

    def _verify(self, where: str, n: int, params: dict, result: dict) -> None:
        losses = [float(v) for v in result["losses"].double().reshape(-1)]
        batches, r = scen.round_draws(n, int(params["batch"]), self.n_params, self.ctx.device, int(params["seed"]))
        rows = self._rows(n)
        require(self._committed(rows[n + 1], r, result["commit"]), f"{where}: the parameters fetched after the "
                "round are not the ones the step left when the clock stopped: work must happen inside the step; "
                "no speed points")
        w, u_prev = rows[1], self._chain(where, rows)
        for j, (x, y) in enumerate(batches):
            u = rows[j + 2] - w
            self._step(f"{where}, step {j}", w, u, u_prev, x, y, losses[j])
            w, u_prev = rows[j + 2], u
            self.steps += 1

    def _step(self, at: str, w, u, u_prev, x, y, loss: float) -> None:
        """One step from weights w (update u, previous update u_prev) against the naive step on (x, y)."""
        lr, mom, wd = self.hyper["lr"], self.hyper["momentum"], self.hyper["weight_decay"]
        require(bool(u.any()), f"{at}: the parameters did not change; every call must make one optimizer step, "
                "timed or not: no speed points")
        l32, g32 = self._loss_and_grad(w, x, y, None)
        l16, g16 = self._loss_and_grad(w, x, y, self.amp)
        tol = 0.02 + 4 * abs(l16 - l32)
        require(math.isfinite(loss) and abs(loss - l32) <= tol, f"{at}: the step returned loss {loss:.4f}, the naive "
                f"step's loss on these weights and this batch is {l32:.4f} (AMP tolerance {tol:.3f}): the step must "
                "compute this batch's loss every call, timed or not; no speed points")
        want, twin = -lr * (g32 + wd * w), -lr * (g16 + wd * w)
        d = u - mom * u_prev
        cos, need, size = _cos(d, want), min(0.8, _cos(twin, want) - 0.1), _norm_ratio(d, want)
        require(cos >= need and 0.85 <= size <= 1.15, f"{at}: the update is not the SGD step of this batch's "
                f"gradient (cosine {cos:.3f}, need {need:.3f}; size {size:.2f}x the naive step's, need 0.85-1.15x)"
                ": every call, timed or not, must take one SGD step (momentum, weight decay) on the gradient of "
                "the batch it is given; no speed points")
        self.worst["loss_gap_share"] = max(self.worst["loss_gap_share"], abs(loss - l32) / tol)
        self.worst["update_cosine_margin"] = min(self.worst["update_cosine_margin"], cos - need)


def _check_base(result, params) -> None:
    """The baseline's reply (the grader's own code): n finite losses."""
    losses = result["losses"]
    if not (isinstance(losses, torch.Tensor) and losses.numel() == int(params["n"]) and bool(losses.isfinite().all())):
        raise RuntimeError("the naive baseline returned no finite losses")


def check_speed(ctx) -> dict:
    picked = SPEED_TIERS.get(ctx.hardware) and gpu_policy.lab4_speed_tiers(ctx.device, ctx.hardware)
    if not picked:
        raise NotGradable("the ResNet-18 speed tiers need a CUDA GPU (they are calibrated on tensor-core GPUs); "
                          "correctness and host syncs are graded here, speed on a GPU machine")
    klass, tiers = picked
    return _speed(ctx, tiers, klass)


def _speed(ctx, tiers: Tiers, klass: str | None = None) -> dict:
    """Correctness first, then the student's step against the naive step, each round on fresh batches, timed
    rounds spot-checked (`_Verifier`); the tiers (of hardware class `klass`, gpu_policy) decide the share of
    the points, and the verdict names the class and its basis (calibrated, or a policy)."""
    t0 = time.monotonic()
    m, start = _correctness(ctx, HYPER, seed=SEEDS["speed"], keep=True)  # correctness gates speed
    sz = sizes(ctx)
    inner = SPEED_ROUNDS["inner"]
    untimed = SPEED_WARMUP_STEPS // inner
    verify = _Verifier(ctx, HYPER, sz, start, warmup=untimed + SPEED_ROUNDS["warmup"], rounds=SPEED_ROUNDS["rounds"])
    ctx.baseline_call("lab4.naive_setup", {"width": sz["width"], "hyper": dict(HYPER), "seed": 0})
    for _ in range(untimed):  # untimed; spot-checked like the timed rounds
        params = {"n": inner, "batch": sz["batch"], "seed": secrets.randbelow(2**31)}
        verify(ctx.call("lab4.timed_student", params), params)
        _check_base(ctx.baseline_call("lab4.timed_naive", params), params)
    measured = [0]

    def timed(rounds: int):
        """One interleaved measurement of `rounds` timed rounds on fresh seeds, spot-checked on one chain."""
        if measured[0]:  # the re-measurement: its own warm-up and quota of verified rounds, the same chain
            verify.phase(SPEED_ROUNDS["warmup"], rounds, label="re-measurement, ")
        measured[0] += 1
        seeds = [secrets.randbelow(2**31) for _ in range(SPEED_ROUNDS["warmup"] + rounds)]
        return ctx.compare(lambda r: ("lab4.timed_naive", {"n": inner, "batch": sz["batch"], "seed": seeds[r]}),
                           lambda r: ("lab4.timed_student", {"n": inner, "batch": sz["batch"], "seed": seeds[r]}),
                           rounds=rounds, warmup=SPEED_ROUNDS["warmup"], inner=inner,
                           check_base=_check_base, check_student=verify)

    ab, notes, record = remeasure.measured(timed, SPEED_ROUNDS["rounds"], tiers, time_left=ctx._left,
                                           spent=lambda: time.monotonic() - t0)
    frac = tiers.fraction(ab.ratio)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2), "timed_rounds": len(ab.ratios),
         **record, "batch": sz["batch"],
         "naive_img_per_s": round(sz["batch"] / ab.a.median), "student_img_per_s": round(sz["batch"] / ab.b.median),
         "tiers": tiers.describe(), "tier_class": klass, "tier_basis": gpu_policy.LAB4_TIER_BASIS.get(klass),
         "twin_dtype": str(_twin_dtype(ctx.device)), "bonus": bool(tiers.bonus and ab.ratio >= tiers.bonus),
         "extra_credit": 1 if tiers.bonus and ab.ratio >= tiers.bonus else 0, **notes,
         "timed_steps_verified": verify.steps, "timed_rounds_verified": verify.total["timed"],
         "warmup_rounds_verified": verify.total["warmup"],
         "worst_timed_loss_gap_share": round(verify.worst["loss_gap_share"], 3),
         "worst_timed_update_cosine_margin": round(verify.worst["update_cosine_margin"], 4)}
    m.update(_tensor_core_evidence(ctx, sz))
    again = remeasure.message(record)
    on = f" Tiers of the {klass} class ({m['tier_basis']})." if klass else ""
    if frac == 0:
        raise CheckFailed(f"{ab.ratio:.2f}x the naive step, below the first tier ({tiers.describe()}).{on}{again}",
                          **m)
    bonus = " BONUS tier reached (+1 extra credit)" if m["bonus"] else ""
    return {"fraction": frac, "message": f"{ab.ratio:.2f}x the naive step ({m['student_img_per_s']} vs "
                                         f"{m['naive_img_per_s']} img/s at batch {sz['batch']}).{bonus}{on}{again}",
            "measurements": m}


def _tensor_core_evidence(ctx, sz) -> dict:
    """How much GPU time of two steps ran in tensor-core (16-bit/TF32) kernels: the student process's own profile.

    Evidence only (no points ride on it), so a profiler problem must not cost the student anything.
    """
    if ctx.device.type != "cuda":
        return {}
    try:
        got = ctx.call("lab4.kernels", {"batch": sz["batch"], "seed": 5})
        kernels = [(str(k), float(t)) for k, t in got["kernels"]]
    except (CheckFailed, KeyError, TypeError, ValueError) as e:
        return {"tensor_core_evidence": f"unavailable ({type(e).__name__}: {str(e)[:120]})"}
    total = sum(t for _, t in kernels)
    tc = [(k, t) for k, t in kernels if TENSOR_CORE_KERNEL.search(k)]
    return {"tensor_core_time_share": round(sum(t for _, t in tc) / total, 3) if total else None,
            "tensor_core_kernels": sorted({k[:80] for k, _ in tc})[:8]}

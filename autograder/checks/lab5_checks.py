"""Lab 5, a fused Triton kernel: the trusted checks (the baseline composition is public: autograder.student.lab5).

The student's file defines `fused_cross_entropy(logits, target, label_smoothing=0.1) -> loss`, the training loss
of the course's ResNet (label-smoothed cross-entropy, labkit.presets.TrainConfig) as their own Triton kernels:
forward (per-row loss with an online max / sum-exp, fp32 accumulation for 16-bit logits) and backward
(softmax minus the smoothed one-hot, times grad / N) behind a torch.autograd.Function. The probes
(autograder.student.lab5) build each case in the sandbox from a seed; the reference here is torch's own
`F.cross_entropy(x.float(), y, label_smoothing=eps)` on the same values, and every decision is taken here.
Correctness runs anywhere (on a CPU through Triton's interpreter); speed needs a GPU, against the eager
composition in a process that never held student code, interleaved, every timed round's answers checked.
"""

from __future__ import annotations

import math
import secrets
import time

import torch
import torch.nn.functional as F

from autograder.checks import remeasure
from autograder.checks.harness import CheckFailed, NotGradable, Tiers, hidden_draws, require
from autograder.student import lab5 as scen

# Public cases. Forward and backward: contiguous fp32, odd sizes, several column blocks, and logits large enough
# that exp() overflows without the row max taken out.
BASIC = [{"n": 7, "c": 10}, {"n": 33, "c": 100}, {"n": 9, "c": 1000}, {"n": 5, "c": 2049},
         {"n": 5, "c": 100, "scale": 100.0}]
# Strided rows and columns, and 16-bit logits (fp32 accumulation inside the kernel).
LAYOUT = [{"n": 9, "c": 1003, "dtype": "bfloat16", "layout": "transposed"},
          {"n": 13, "c": 100, "dtype": "float16", "layout": "sliced"},
          {"n": 11, "c": 1000, "dtype": "bfloat16", "layout": "rows"},
          {"n": 7, "c": 10, "dtype": "float16"},
          {"n": 5, "c": 2049, "dtype": "float32", "layout": "sliced"}]
SEEDS = {"forward": 0, "backward": 1, "layouts": 2}
# Tolerances. The loss is compared in fp32 whatever the logits' dtype (the reference reads the same values):
# a kernel that accumulates in 16 bits misses it by far more. The gradient is rounded to the logits' dtype,
# so each element may differ by its dtype's epsilon, plus fp32 noise relative to the largest element.
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
GRAD_RTOL = {"float32": 1e-5, "float16": torch.finfo(torch.float16).eps, "bfloat16": torch.finfo(torch.bfloat16).eps}
GRAD_ATOL = 1e-5  # share of the gradient's largest element

# Speed: forward + backward on bf16 logits (rows, cols), the student's kernels against the eager composition,
# fresh inputs each pass (autograder.student.lab5.round_draws). benchmarks/results/grading/grade_reference_gpu_lab5_h200.json
# holds the reference's measured ratio; tests/test_lab5.py ties the tiers to it. The reference's side is bound by
# the host (its two Triton launches cost the same at 16,384 rows as at 131,072: lab5_kernels_h200.json), so the
# ratio falls on a slower host CPU: 2.82x on one H200 machine, 2.22x (IQR 0.30) on another. Full marks sit below
# the lower of the two by more than its spread, so an honest kernel is not graded by the host it landed on.
SPEED_SHAPE = {"rows": 131072, "cols": 1000}
SPEED_ROUNDS = {"rounds": 9, "warmup": 3, "inner": 5}
# One class for every GPU: the kernel is memory-bound, so the ratio is about bytes moved, not 16-bit units.
SPEED_TIERS = {"tensor_core_gpu": Tiers(((1.25, 0.5), (1.5, 0.75), (1.8, 1.0)), bonus=3.5),
               "gpu": Tiers(((1.25, 0.5), (1.5, 0.75), (1.8, 1.0)), bonus=3.5)}
TIER_BASIS = "calibrated on an H200"


def _case(ctx, spec: dict) -> tuple[dict, dict]:
    """The student's answer to one case and the reference's, validated: (theirs, mine)."""
    got = ctx.call("lab5.case", spec)
    x, y = scen.make_case(spec, torch.device("cpu"))
    n, c = x.shape
    dtype = spec.get("dtype", "float32")
    loss, grad = got.get("loss"), got.get("grad")
    require(isinstance(loss, torch.Tensor) and loss.numel() == 1, "the submission's process sent no loss "
            "(a malformed answer)")
    require(got.get("loss_dtype") == "float32", f"the loss is {got.get('loss_dtype')}: return it as float32 "
            "(accumulate in fp32 whatever the logits' dtype)")
    require(isinstance(grad, torch.Tensor) and tuple(grad.shape) == (n, c), f"backward gave a gradient of shape "
            f"{tuple(getattr(grad, 'shape', ()))}, the logits are ({n}, {c})")
    require(got.get("grad_dtype") == dtype, f"backward gave a {got.get('grad_dtype')} gradient for {dtype} logits: "
            "return it in the logits' dtype")
    launches, ops, reads = got.get("launches"), got.get("torch_ops"), got.get("logit_reads")
    read_ops, switched = got.get("logit_ops"), got.get("switched")
    require(isinstance(launches, list) and len(launches) == 2 and isinstance(ops, list)
            and isinstance(reads, list) and len(reads) == 2 and all(isinstance(r, int) for r in reads)
            and isinstance(read_ops, list) and isinstance(switched, list),
            "the submission's process sent a malformed report")
    xr = x.detach().float().requires_grad_()
    eps, g = float(spec.get("smoothing", scen.SMOOTHING)), float(spec.get("grad", 1.0))
    ref = F.cross_entropy(xr, y, label_smoothing=eps)
    ref.backward(torch.tensor(g))
    mine = {"loss": float(ref), "grad": xr.grad, "x": xr.detach(), "y": y, "eps": eps, "g": g, "view": x.detach()}
    return {"loss": float(loss), "grad": grad.float(), "launches": launches, "ops": [str(o) for o in ops],
            "reads": reads, "logit_ops": [str(o) for o in read_ops], "switched": [str(o) for o in switched]}, mine


def _where(spec: dict) -> str:
    lay = spec.get("layout", "contiguous")
    return (f"{spec.get('dtype', 'float32')} logits ({spec['n']}, {spec['c']}), {lay}"
            + (f", scale {spec['scale']:g}" if "scale" in spec else ""))


def _own_kernels(theirs: dict, spec: dict, backward: bool) -> None:
    """The pass must launch a Triton kernel, run none of torch's softmax family, and leave the logits to the
    kernels: outside the launches, torch may read fewer elements of the logits (or of what a kernel wrote from
    them) than the logits hold, per pass (autograder.student.lab5.Watch): `loss.mean()` of per-row losses, not
    the math over N x C."""
    where = _where(spec)
    require(not theirs["ops"], f"{where}: torch's {', '.join(theirs['ops'])} ran inside fused_cross_entropy: the "
            "softmax, log-sum-exp and cross-entropy are yours to write as Triton kernels; no points")
    require(not theirs["switched"], f"{where}: fused_cross_entropy went around the grader's watch on "
            f"torch's operators ({', '.join(theirs['switched'])}); no points")
    require(theirs["launches"][0] >= 1, f"{where}: no Triton kernel ran in the forward pass: launch your "
            "@triton.jit kernel (kernel[grid](...)); a PyTorch composition is what the check compares against")
    if backward:
        require(theirs["launches"][1] >= 1, f"{where}: no Triton kernel ran in the backward pass: "
                "FusedCrossEntropy.backward must launch your backward kernel")
    size = int(spec["n"]) * int(spec["c"])
    for phase, reads in [("forward", theirs["reads"][0])] + [("backward", theirs["reads"][1])] * backward:
        require(reads < size, f"{where}: outside your Triton kernels, {scen.readers(theirs['logit_ops'])} read "
                f"{reads} elements of the logits or of what your kernels computed from them in the {phase} pass, "
                f"as many as the logits hold ({size}): the loss and the gradient are your kernels' to compute "
                f"(torch may only finish per-row results, such as loss.mean()){scen.copy_hint(theirs['logit_ops'], phase)}"
                "; no points")


def _loss_hint(loss: float, mine: dict) -> str:
    """What a wrong loss looks like it computed instead (a hint for the student)."""
    x, y, eps = mine["x"], mine["y"], mine["eps"]
    n, c = x.shape
    lse = torch.logsumexp(x, dim=1)
    nll = lse - x.gather(1, y[:, None]).squeeze(1)
    flat = _read_as_contiguous(mine)
    variants = {"the cross-entropy without label smoothing": float(nll.mean()),
                "the sum over rows, not the mean": mine["loss"] * n,
                "eps * sum_c(-log p_c) for the smoothing term: it is eps * mean_c (divide by C)":
                    float(((1 - eps) * nll + eps * (c * lse - x.sum(1))).mean()),
                "(1 - eps) missing on the target term": float((nll + eps * (lse - x.mean(1))).mean())}
    if flat is not None:
        variants["the logits read as if contiguous (row i at i * C, column j at j): read them through "
                 "logits.stride(0) and logits.stride(1)"] = float(F.cross_entropy(flat, y, label_smoothing=eps))
    if not math.isfinite(loss):
        return " (not finite: take the row's running max out before exp, the online log-sum-exp)"
    for what, v in variants.items():
        if math.isclose(loss, v, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL):
            return f" (it matches {what})"
    return ""


def _read_as_contiguous(mine: dict) -> torch.Tensor | None:
    """The (N, C) values a kernel that ignores the strides reads (element (i, j) at i * C + j of the view's memory),
    in fp32; None for a contiguous case, where they are the logits."""
    view = mine.get("view")
    if view is None or view.is_contiguous():
        return None
    n, c = view.shape
    if view.untyped_storage().nbytes() < (view.storage_offset() + n * c) * view.element_size():
        return None
    return torch.as_strided(view, (n, c), (c, 1), view.storage_offset()).float()


def _grad_far(got: torch.Tensor, want: torch.Tensor, dtype: str) -> float:
    """How far the gradient is, in units of its tolerance (<= 1 passes)."""
    tol = GRAD_RTOL[dtype] * want.abs() + GRAD_ATOL * float(want.abs().max()) + 1e-12
    return float(((got - want).abs() / tol).max())


def _grad_hint(got: torch.Tensor, mine: dict, dtype: str) -> str:
    want, x, y, eps, g = mine["grad"], mine["x"], mine["y"], mine["eps"], mine["g"]
    n, c = x.shape
    p = torch.softmax(x, dim=1)
    hot = F.one_hot(y, c).float()
    variants = {"N times the answer: scale by grad / N (the loss is a mean)": want * n,
                "the answer for an incoming gradient of 1: multiply by the incoming grad": want / g,
                "softmax minus the plain one-hot: the target is the smoothed one-hot": (p - hot) * g / n,
                "the smoothed one-hot minus softmax: the sign is flipped": -want}
    if not bool(got.isfinite().all()):
        return " (not finite: exp(x - logsumexp), with the forward's log-sum-exp)"
    for what, v in variants.items():
        if _grad_far(got, v, dtype) <= 1:
            return f" (it is {what})"
    del eps
    return ""


def _judge(ctx, specs: list[dict], *, forward: bool, backward: bool) -> dict:
    """Every case: the loss (forward) and the gradient (backward) against the reference; measurements."""
    worst = {"loss_rel_err": 0.0, "grad_err_in_tolerances": 0.0}
    for spec in specs:
        theirs, mine = _case(ctx, spec)
        _own_kernels(theirs, spec, backward)
        where = _where(spec)
        # each case's error joins the measurements before it is judged: a failed check reports its own case's
        if forward:
            err = abs(theirs["loss"] - mine["loss"])
            worst["loss_rel_err"] = max(worst["loss_rel_err"], err / max(abs(mine["loss"]), 1e-12))
            require(math.isfinite(theirs["loss"]) and err <= LOSS_RTOL * abs(mine["loss"]) + LOSS_ATOL,
                    f"{where}: loss {theirs['loss']:.6g}, F.cross_entropy(x.float(), y, label_smoothing="
                    f"{mine['eps']:g}) gives {mine['loss']:.6g}{_loss_hint(theirs['loss'], mine)}", **_rounded(worst))
        if backward:
            dtype = spec.get("dtype", "float32")
            far = _grad_far(theirs["grad"], mine["grad"], dtype)
            worst["grad_err_in_tolerances"] = max(worst["grad_err_in_tolerances"], far)
            require(far <= 1, f"{where}: the gradient of the logits is off by up to "
                    f"{float((theirs['grad'] - mine['grad']).abs().max()):.3g} (largest element "
                    f"{float(mine['grad'].abs().max()):.3g}; {far:.3g}x the {dtype} tolerance){_grad_hint(theirs['grad'], mine, dtype)}",
                    **_rounded(worst))
    return _rounded(worst)


def _rounded(worst: dict) -> dict:
    return {k: float(f"{v:.3g}") for k, v in worst.items()}


def _seeded(specs: list[dict], seed: int, **extra) -> list[dict]:
    return [{**s, "seed": seed * 100 + i, **extra} for i, s in enumerate(specs)]


def check_forward(ctx) -> dict:
    m = _judge(ctx, _seeded(BASIC, SEEDS["forward"]), forward=True, backward=False)
    return {"message": f"the loss matches F.cross_entropy(label_smoothing={scen.SMOOTHING:g}) on {len(BASIC)} "
                       "contiguous fp32 cases, large logits included", "measurements": m}


def check_backward(ctx) -> dict:
    m = _judge(ctx, _seeded(BASIC, SEEDS["backward"], grad=0.7), forward=False, backward=True)
    return {"message": f"the gradient of the logits matches autograd's on {len(BASIC)} contiguous fp32 cases "
                       "(incoming gradient 0.7)", "measurements": m}


def check_layouts(ctx) -> dict:
    m = _judge(ctx, _seeded(LAYOUT, SEEDS["layouts"], grad=1.3), forward=True, backward=True)
    return {"message": f"loss and gradient right on {len(LAYOUT)} strided and 16-bit cases", "measurements": m}


def hidden_cases(student: str | None = None, handin: str | None = None) -> list[dict]:
    """The hidden test's cases, from the course secret and the student or the hand-in (hidden_draws): odd sizes,
    every dtype and layout, other smoothings, incoming gradients and logit scales than the public cases'."""
    from autograder.base import course_secret

    r = course_secret.rng("lab5.hidden/cases", student, handin=handin)
    dtypes, layouts = list(scen.DTYPES), list(scen.LAYOUTS)
    out = []
    for i in range(4):
        c = int(r.integers(3, 2200)) | 1
        out.append({"n": int(r.integers(2, 24)) * 2 + 1, "c": c, "dtype": dtypes[int(r.integers(3))] if i else
                    "bfloat16", "layout": layouts[i], "scale": round(float(r.uniform(1.0, 12.0)), 2),
                    "smoothing": round(float(r.uniform(0.02, 0.3)), 3), "grad": round(float(r.uniform(0.3, 3.0)), 3),
                    "seed": int(r.integers(2**31))})
    return out


def check_cases_hidden(ctx) -> dict:
    for draw in hidden_draws(ctx):
        _judge(ctx, hidden_cases(**draw), forward=True, backward=True)
    return {"message": "right on other sizes, dtypes, layouts, smoothings and incoming gradients"}


# ---------------------------------------------------------------------------------- speed


class _Verifier:
    """Checks every timed round's answers against the reference on the same inputs, here, outside the clock.

    Each reply holds n losses and n commitments, one per pass: the sum over 64 drawn rows of the gradient times
    drawn float64 weights. The inputs come from the round's seed (autograder.student.lab5.round_draws), drawn
    in the request, so no answer can be computed before its clock runs; every round is checked, so a round that
    skipped or faked work fails the check."""

    def __init__(self, ctx):
        self.ctx, self.rounds, self.worst = ctx, 0, 0.0

    def __call__(self, result, params) -> None:
        n = int(params["n"])
        where = f"round {self.rounds + 1}"
        require(isinstance(result, dict) and all(isinstance(result.get(k), torch.Tensor)
                                                 and result[k].numel() == n for k in ("losses", "commits")),
                f"{where}: the submission's process sent no {n} losses and commitments (a malformed answer)")
        draws = scen.round_draws(n, int(params["rows"]), int(params["cols"]), self.ctx.device, int(params["seed"]))
        for j, (x, y, idx, w) in enumerate(draws):
            xr = x.float().requires_grad_()
            ref = F.cross_entropy(xr, y, label_smoothing=scen.SMOOTHING)
            (gr,) = torch.autograd.grad(ref, xr)
            want = float((gr[idx].double() * w).sum())
            # each element may be off by a bf16 rounding (epsilon relative) and fp32 noise
            bound = float((gr[idx].double().abs() * w.abs()).sum())
            tol = GRAD_RTOL["bfloat16"] * bound + 1e-6
            loss, commit = float(result["losses"][j]), float(result["commits"][j])
            require(math.isfinite(loss) and abs(loss - float(ref)) <= LOSS_RTOL * abs(float(ref)) + LOSS_ATOL,
                    f"{where}, pass {j}: loss {loss:.6g}, the reference's {float(ref):.6g}: every pass, timed "
                    "or not, must compute its own inputs' loss; no speed points")
            require(math.isfinite(commit) and abs(commit - want) <= tol, f"{where}, pass {j}: the gradient is not "
                    "the reference's on these inputs: every pass, timed or not, must compute it; no speed points")
            self.worst = max(self.worst, abs(commit - want) / tol)
        self.rounds += 1


def _check_warm(ctx, result, params) -> None:
    """The untimed round at the timed shape: right answers, and each pass's kernels held to the correctness cases'
    rule (_own_kernels), so that no path taken at this size alone leaves the math to torch."""
    n = int(params["n"])
    seen = result.get("watched") if isinstance(result, dict) else None
    require(isinstance(seen, list) and len(seen) == n and all(isinstance(s, dict) for s in seen),
            "the submission's process sent a malformed report of the untimed round")
    spec = {"n": params["rows"], "c": params["cols"], "dtype": "bfloat16"}
    for s in seen:
        reads, names = s.get("logit_reads"), (s.get("torch_ops"), s.get("logit_ops"), s.get("switched"))
        require(isinstance(s.get("launches"), list) and len(s["launches"]) == 2 and isinstance(reads, list)
                and len(reads) == 2 and all(isinstance(r, int) for r in reads + s["launches"])
                and all(isinstance(v, list) for v in names), "the submission's process sent a malformed report "
                "of the untimed round")
        _own_kernels({"ops": [str(o) for o in names[0]], "launches": s["launches"], "reads": reads,
                      "logit_ops": [str(o) for o in names[1]], "switched": [str(o) for o in names[2]]}, spec, True)
    _Verifier(ctx)(result, params)


def _check_base(result, params) -> None:
    losses = result["losses"]
    if not (isinstance(losses, torch.Tensor) and losses.numel() == int(params["n"]) and bool(losses.isfinite().all())):
        raise RuntimeError("the eager baseline returned no finite losses")


def check_speed(ctx) -> dict:
    tiers = SPEED_TIERS.get(ctx.hardware)
    if tiers is None or ctx.device.type != "cuda":
        raise NotGradable("the fused kernel's speed tiers need a CUDA GPU (calibrated on an H200); correctness is "
                          "graded here, speed on a GPU machine")
    t0 = time.monotonic()
    _judge(ctx, _seeded(LAYOUT[:1], 7), forward=True, backward=True)  # correctness gates speed
    inner = SPEED_ROUNDS["inner"]
    shape = dict(SPEED_SHAPE)
    warm = {"n": 2, **shape, "seed": secrets.randbelow(2**31)}
    _check_warm(ctx, ctx.call("lab5.warm_student", warm), warm)  # Triton compiles here
    verify = _Verifier(ctx)

    def timed(rounds: int):
        seeds = [secrets.randbelow(2**31) for _ in range(SPEED_ROUNDS["warmup"] + rounds)]
        return ctx.compare(lambda r: ("lab5.timed_eager", {"n": inner, **shape, "seed": seeds[r]}),
                           lambda r: ("lab5.timed_student", {"n": inner, **shape, "seed": seeds[r]}),
                           rounds=rounds, warmup=SPEED_ROUNDS["warmup"], inner=inner,
                           check_base=_check_base, check_student=verify)

    ab, notes, record = remeasure.measured(timed, SPEED_ROUNDS["rounds"], tiers, time_left=ctx._left,
                                           spent=lambda: time.monotonic() - t0)
    frac = tiers.fraction(ab.ratio)
    bonus = bool(tiers.bonus and ab.ratio >= tiers.bonus)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2), "timed_rounds": len(ab.ratios),
         **record, **shape, "eager_ms": round(ab.a.median * 1e3, 4), "student_ms": round(ab.b.median * 1e3, 4),
         "tiers": tiers.describe(), "tier_basis": TIER_BASIS, "bonus": bonus, "extra_credit": 1 if bonus else 0,
         "rounds_verified": verify.rounds, "worst_commit_err_in_tolerances": round(verify.worst, 3), **notes}
    again = remeasure.message(record)
    size = f"bf16 logits ({shape['rows']}, {shape['cols']}), forward + backward"
    if frac == 0:
        raise CheckFailed(f"{ab.ratio:.2f}x the eager composition on {size}, below the first tier "
                          f"({tiers.describe()}; {TIER_BASIS}).{again}", **m)
    extra = " BONUS tier reached (+1 extra credit)" if bonus else ""
    return {"fraction": frac, "message": f"{ab.ratio:.2f}x the eager composition on {size} ({m['student_ms']} vs "
                                         f"{m['eager_ms']} ms a pass; tiers {TIER_BASIS}).{extra}{again}",
            "measurements": m}

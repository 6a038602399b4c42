"""The public checks of the student release, one function per check: `labN_what(probe, device) -> dict`.

Each calls the student's code through the public probes (`autograder.student.labN`, in this process) and compares
with a public reference: torch.amp.GradScaler (lab 1), the decoded images (lab 2), the student's own handed-out
slow_train.py (lab 3: the file beside theirs, which may be their own variant; never a copy from this package),
the naive step (lab 4), torch's F.cross_entropy (lab 5). Inputs are the notebooks' own public ones; the course's grader uses others.
A function returns {"message", "measurements", "fraction"} or raises selfcheck.Failed / selfcheck.NotHere.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from autograder.selfcheck_core import Failed, NotHere, alternate, need
from autograder.student import lab1, lab2, lab3, lab4, lab5
from autograder.student import lab3_slow as slow

# ---------------------------------------------------------------------------------- lab 1: torch's GradScaler


class _TorchScaler:
    """torch.amp.GradScaler behind the lab's API (step returns whether it stepped): the public reference."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, scale=None):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.s = torch.amp.GradScaler(dev, init_scale=scale or init_scale, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor, growth_interval=growth_interval)
        self._unscaled, self._opt = False, None

    def scale(self, loss):
        return self.s.scale(loss)

    def unscale_(self, opt):
        self.s.unscale_(opt)
        self._unscaled = True

    def step(self, opt) -> bool:
        if not self._unscaled:
            self.unscale_(opt)
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        self.s.step(opt)
        return finite

    def update(self):
        self.s.update()
        self._unscaled = False

    def get_scale(self) -> float:
        return float(self.s.get_scale())


def lab1_static_scaler(p, dev) -> dict:
    params = {"scale": 512.0, "loss": 0.25, "lr": 0.05, "grad": torch.linspace(-2, 2, 8), "bad_index": 5}
    # GradScaler cannot hold its scale still; after one overflow it halves it, which leaves the unscaled
    # gradients (powers of two) and so the parameters the same as a static scaler's.
    want = lab1.static_scenario(lambda scale: _TorchScaler(scale, growth_interval=10**9), dev, params)
    got = lab1.probe_static(p, params)
    need(math.isclose(got["scaled"], 128.0), f"scale(loss) should be loss * 512 = 128.0, got {got['scaled']}")
    need(torch.allclose(got["grad"].float().cpu(), params["grad"]), "after unscale_ the gradients should equal the "
         "unscaled ones: divide each .grad by the scale, in place")
    need(got["first"] is True, f"step() should return True after a finite step, got {got['first']!r}")
    need(torch.allclose(got["after_first"].cpu(), want["after_first"].cpu()), "after one finite step the parameter "
         "should move by -lr * grad")
    need(got["bad"] is False, f"step() must return False (skip) when a gradient is inf, got {got['bad']!r}")
    need(torch.equal(got["after_bad"], got["after_first"]), "the parameters changed on a step with an inf gradient")
    need(got["scale"] == 512.0, "a static scaler's scale must never change")
    need(got["last"] is True and torch.allclose(got["after_last"].cpu(), want["after_last"].cpu()),
         "after a skipped step the next finite step must go through normally")
    return {"message": "static scaler: scale, unscale_ and the skip on inf behave like GradScaler's"}


def lab1_dynamic_scaler(p, dev) -> dict:
    need(lab1.probe_default_scale(p, {})["scale"] == 2.0**16, "DynamicScaler() should start at 2**16 like GradScaler")
    params = {"kw": dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=4), "steps": 14,
              "bad": [1, 6, 7]}
    want, got = lab1.trajectory(_TorchScaler, dev, params), lab1.probe_trajectory(p, params)
    for s, (a, b) in enumerate(zip(want["steps"], got["steps"], strict=True)):
        need(list(a) == list(b), f"step {s}: GradScaler gives (stepped, scale after update) = {tuple(a)}, yours "
             f"{tuple(b)}; overflow steps are {params['bad']}")
    need(torch.allclose(want["param"].cpu(), got["param"].cpu()), "the parameters differ from GradScaler's run")
    return {"message": "dynamic scaler: backoff and growth follow GradScaler's",
            "measurements": {"scale_trajectory": [s for _, s in got["steps"]]}}


def lab1_fp16_training(p, dev) -> dict:
    steps = 80
    ref, ref_counts, _ = lab1.train(lab1.torch_amp_step, _TorchScaler(), dev, steps)
    got = lab1.probe_fp16_training(p, {"steps": steps, "init_scale": 2.0**16, "dtypes": True})
    losses, want = got["losses"].reshape(-1).tolist(), ref.tolist()
    need(len(losses) == steps and all(math.isfinite(v) for v in losses), "return the unscaled, finite loss each step")
    for s in range(20):
        need(math.isclose(losses[s], want[s], rel_tol=2e-2, abs_tol=1e-3), f"step {s}: loss {losses[s]:.5f}, "
             f"GradScaler's recipe gives {want[s]:.5f}")
    need(got["samples"] == steps * 64, f"the model saw {got['samples']} samples in {steps} steps (one forward each)")
    need(abs(got["opt_steps"] - ref_counts["opt_steps"]) <= 3, f"{got['opt_steps']} optimizer steps, GradScaler's "
         f"recipe takes {ref_counts['opt_steps']}")
    dtypes = {str(name): int(n) for name, n in (got.get("gemm_dtypes") or {}).items()}
    need(dtypes.get("float16", 0) > 0 and all(v == 0 for k, v in dtypes.items() if k != "float16"),
         f"every matrix multiply should run in float16 (autocast), saw {dtypes}")
    final = sum(losses[-10:]) / 10
    need(final <= 0.1 * losses[0], f"training did not converge (final loss {final:.4f})")
    return {"message": f"fp16 training follows GradScaler's recipe and converges (final loss {final:.4f})"}


def lab1_host_syncs(p, dev) -> dict:
    lab1_fp16_training(p, dev)  # correctness first: a step that does nothing never syncs
    counts = [len(s) for s in lab1.probe_host_syncs(p, {"steps": 6})["sites"]]
    need(statistics.median(counts) <= 1, f"{statistics.median(counts):g} host syncs in a typical step (at most 1)")
    return {"message": f"host syncs per step: {counts}"}


# ---------------------------------------------------------------------------------- lab 2: the decoded images

_N2 = 256


def _epoch(p, **kw) -> dict:
    got = lab2.probe_epoch(p, {"n": _N2, "data_seed": 0, "drop_last": False, **kw})
    ys = got["y"]
    need(kw.get("drop_last") or sorted(ys.tolist()) == list(range(_N2)), "every sample must appear once per epoch")
    return got


def lab2_packed_roundtrip(p, dev) -> dict:
    packed = lab2.probe_pack(p, {"n": _N2, "data_seed": 0})
    img = torch.from_numpy(lab2.dataset_arrays(_N2, 0)[0])
    got = _epoch(p, batch_size=64, shuffle=False, augment=False, seed=0)
    need(torch.equal(got["y"], torch.arange(_N2)), "with shuffle=False the samples must come in file order")
    err = float((got["x"] - lab2.normalize(img)).abs().max())
    need(err < 1e-4, f"without augmentation the images must equal the decoded, normalized files (error {err:.3g})")
    sh = _epoch(p, batch_size=64, shuffle=True, augment=False, seed=1)
    need(not torch.equal(sh["y"], torch.arange(_N2)), "with shuffle=True the order must change")
    need(torch.allclose(sh["x"], got["x"][sh["y"]], atol=1e-4), "shuffled images do not match their labels")
    return {"message": "exact round trip and shuffle", "measurements": packed}


def lab2_batched_augment(p, dev) -> dict:
    img = torch.from_numpy(lab2.dataset_arrays(_N2, 0)[0])
    got = _epoch(p, batch_size=128, shuffle=True, augment=True, seed=0)
    x = lab2.normalize(img)
    fill = (-torch.tensor(lab2.MEAN) / torch.tensor(lab2.STD)).view(1, 3, 1, 1)
    pad = fill.expand(_N2, 3, 40, 40).clone()
    pad[:, :, 4:36, 4:36] = x
    offsets, flips = [], 0
    for out, label in zip(got["x"][:64], got["y"][:64].tolist(), strict=True):
        crops = pad[label:label + 1].unfold(2, 32, 1).unfold(3, 32, 1).permute(0, 2, 3, 1, 4, 5).reshape(81, 3, 32, 32)
        cand = torch.cat([crops, crops.flip(-1)])
        d = (cand - out[None]).abs().flatten(1).amax(1)
        best = int(d.argmin())
        need(float(d[best]) < 1e-4, f"image {label} is no padded 32x32 crop (or its mirror) of its source")
        offsets.append(best % 81)
        flips += best >= 81
    need(len(set(offsets)) >= 10, f"{len(set(offsets))} distinct crop offsets in 64 images: draw one per sample")
    need(10 <= flips <= 54, f"{flips} of 64 images flipped: flip each with probability 0.5")
    return {"message": "each checked image is a padded crop/flip of its source, drawn per sample"}


def lab2_bucket_sampler(p, dev) -> dict:
    g = torch.Generator().manual_seed(5)
    lengths = (torch.randn(1500, generator=g) * 0.8 + 3.5).exp().clamp(5, 300).int().tolist()
    bs = 32
    got = lab2.probe_sampler(p, {"lengths": lengths, "batch_size": bs, "seed": 0})
    batches = got["batches"]
    need(sorted(i for b in batches for i in b) == list(range(len(lengths))), "every index must appear exactly once")
    need(all(0 < len(b) <= bs for b in batches), "batch sizes must be between 1 and batch_size")
    need(got["len"] == len(batches), f"len(sampler) is {got['len']}, an epoch yielded {len(batches)} batches")

    def waste(bb):
        return 1 - sum(lengths) / sum(max(lengths[i] for i in b) * len(b) for b in bb)

    perm = torch.randperm(len(lengths), generator=g).tolist()
    w, rw = waste(batches), waste([perm[i:i + bs] for i in range(0, len(perm), bs)])
    need(w <= 0.35 * rw, f"padding waste {w:.1%} vs {rw:.1%} for random batches: bucket by length")
    need(got["again"] == batches, "two samplers with the same seed must give the same batches")
    need(got["other"] != batches and got["next_epoch"] != batches, "another seed, and each new epoch, must reshuffle")
    return {"message": f"padding waste {w:.1%} (random batches: {rw:.1%})"}


def _loader_params(seed: int) -> dict:
    proj = torch.randn(4, 3 * 32 * 32, generator=torch.Generator().manual_seed(seed))
    return {"n": 512, "data_seed": 0, "batch_size": 128, "shuffle": True, "augment": True, "drop_last": False,
            "seed": seed, "epochs": 2, "proj": proj}


def lab2_loader_speed(p, dev) -> dict:
    lab2_packed_roundtrip(p, dev)  # correctness first
    params = _loader_params(3)
    lab2.probe_pack(p, {"n": 512, "data_seed": 0})
    t = alternate(lambda: lab2.probe_baseline_epochs(p, params), lambda: lab2.probe_timed_epochs(p, params), rounds=3)
    need(t["ratio"] >= 2.0, f"your loader is {t['ratio']:.2f}x the PIL loader's samples/s (the lowest tier is 2x)")
    tiers = [(8.0, 1.0), (5.0, 0.75), (3.0, 0.5), (2.0, 0.25)]
    frac = next(f for r, f in tiers if t["ratio"] >= r)
    return {"message": f"{t['ratio']:.2f}x the PIL loader (tiers 2x, 3x, 5x, 8x)", "fraction": frac,
            "measurements": {k: round(v, 4) for k, v in t.items()}}


def lab2_data_wait(p, dev) -> dict:
    params = {**_loader_params(4), "batch_size": 64, "steps": 6}  # 512 images: 8 batches, 2 of them warm-up
    got = lab2.probe_data_wait(p, params)
    share = sum(got["waits"]) / max(sum(got["waits"]) + sum(got["steps"]), 1e-9)
    need(share <= 0.25, f"{share:.0%} of a training step waits for data (at most 25%)")
    return {"message": f"{share:.0%} of a step waits for data", "measurements": {"wait_share": round(share, 3)}}


# ---------------------------------------------------------------------------------- lab 3: the slow script

_RUN3 = lab3.PUBLIC_RUN  # the notebook's seeds and data size, the same as the public timing's


def _same(got: dict, ref: dict, steps: int) -> None:
    gl, rl = got["losses"].tolist(), ref["losses"].tolist()
    need(len(gl) == steps and got["steps"] == steps, f"{got['steps']} optimizer steps and {len(gl)} losses for "
         f"steps={steps}")
    need(got["samples"] == steps * 64, f"the model saw {got['samples']} samples, expected {steps * 64}")
    for s in range(steps):
        tol = 2e-3 if s < 5 else 5e-2
        need(math.isclose(gl[s], rl[s], rel_tol=tol, abs_tol=tol), f"step {s}: loss {gl[s]:.5f}, the slow script "
             f"gives {rl[s]:.5f}: same data order, normalization, model and optimizer as slow_train.py")
    need(abs(got["correct"] - ref["correct"]) <= 2, f"{got['correct']} correct, the slow script {ref['correct']}")


def _slow_train(p):
    """`train` of the student's own slow_train.py, the one handed out to them, beside their student file."""
    path = Path(p.student_file).parent / "slow_train.py"
    need(path.is_file(), f"slow_train.py not found beside {Path(p.student_file).name}: put the slow_train.py you "
         f"were handed out (your own, if your course gave you one) in {path.parent}")
    train = getattr(slow.load(path.read_text()), "train", None)
    need(callable(train), "slow_train.py defines no train(): use the slow_train.py you were handed out, unedited")
    return train


def lab3_same_result(p, dev) -> dict:
    params = {**_RUN3, "steps": 20}
    _same(lab3.probe_train(p, params), lab3.train_run(_slow_train(p), dev, params), 20)
    return {"message": "same losses and accuracy as the slow script over 20 steps"}


def lab3_no_host_sync(p, dev) -> dict:
    lab3_same_result(p, dev)
    steps = 24
    params = {**_RUN3, "steps": steps, "warmup_steps": 4}
    got = lab3.probe_host_syncs(p, params)
    _same(got, lab3.train_run(_slow_train(p), dev, params), steps)
    syncs, allowed = len(got["sites"]), steps // 4 + 4
    need(syncs <= allowed, f"{syncs} host syncs in {steps} steps (at most {allowed}), at {sorted(set(got['sites']))[:3]}")
    return {"message": f"{syncs} host syncs in {steps} steps"}


def lab3_speedup(p, dev) -> dict:
    """The notebook's Try-it timing, the same call (lab3.compare_speed: lab3.TIMING), then the tiers."""
    lab3_same_result(p, dev)
    ab = lab3.compare_speed(_slow_train(p), lab3.student_train(p), dev)
    low, full = (1.2, 1.45) if dev.type == "cpu" else (2.0, 3.0)
    line = lab3.describe_speed(ab)
    need(ab.ratio >= low, f"{line}: half the points from {low}x, all from {full}x")
    return {"message": f"{line}; timed {lab3.TIMING}", "fraction": 1.0 if ab.ratio >= full else 0.5,
            "measurements": {"ratio": round(ab.ratio, 3), "ratio_iqr": round(ab.ratio_iqr, 3),
                             "baseline_s": round(ab.a.median, 4), "yours_s": round(ab.b.median, 4),
                             "rounds": len(ab.ratios)}}


# ---------------------------------------------------------------------------------- lab 4: the naive step


def _lab4_params(dev, keep=False) -> dict:
    sz = lab4.sizes(dev.type != "cuda")
    return {"width": sz["width"], "batch": sz["batch"], "k": sz["k"], "seed": 0, "hyper": dict(lab4.HYPER),
            "keep": keep}


def lab4_correctness(p, dev) -> dict:
    params = _lab4_params(dev, keep=True)
    ref = lab4.trajectory(lab4.naive_builder(), dev, params)
    twin = lab4.trajectory(lab4.naive_builder(torch.bfloat16), dev, params)
    got = lab4.probe_trajectory(p, params)
    losses, rl, tl = got["losses"].tolist(), ref["losses"].tolist(), twin["losses"].tolist()
    rows, refrows = got["params"], ref["params"]
    need(all(math.isfinite(v) for v in losses), "a loss is not finite")
    need(all(not torch.equal(rows[i + 1], rows[i]) for i in range(params["k"])), "every call must make one "
         "optimizer step on the given model's parameters (in place)")
    need(abs(losses[0] - rl[0]) <= 0.01 + 3 * abs(tl[0] - rl[0]), f"first loss {losses[0]:.4f}, the naive step's "
         f"{rl[0]:.4f}: same normalization, cross-entropy, whole batch?")
    u, v = (rows[1] - rows[0]).double(), (refrows[1] - refrows[0]).double()
    cos, size = float(u @ v / (u.norm() * v.norm()).clamp_min(1e-30)), float(u.norm() / v.norm().clamp_min(1e-30))
    need(cos >= 0.8 and 0.85 <= size <= 1.15, f"the first update differs from the naive step's (cosine {cos:.3f}, "
         f"size {size:.2f}x): same lr, momentum and weight decay?")
    return {"message": f"same first loss and update as the naive step (cosine {cos:.3f}, size {size:.2f}x)"}


def lab4_no_host_sync(p, dev) -> dict:
    lab4_correctness(p, dev)
    n = 4
    sites = lab4.probe_host_syncs(p, {"batch": _lab4_params(dev)["batch"], "seed": 0, "warmup": 3, "n": n})["sites"]
    need(len(sites) <= n // 2, f"{len(sites) / n:g} host syncs per step, at {sorted(set(sites))[:3]}")
    return {"message": f"{len(sites) / n:g} host syncs per step"}


def lab4_speed(p, dev) -> dict:
    if dev.type != "cuda":
        raise NotHere("the speed of lab 4 is measured on a CUDA GPU (on Colab: Runtime > Change runtime type)")
    lab4_correctness(p, dev)
    params = _lab4_params(dev)
    lab4.probe_naive_setup(p, {"width": params["width"], "hyper": dict(lab4.HYPER), "seed": 0})
    for _ in range(10):  # compile, autotune, graph capture: before the clock
        lab4.probe_timed_student(p, {"n": 1, "batch": params["batch"], "seed": 1})
    req = {"n": 5, "batch": params["batch"], "seed": 2}
    t = alternate(lambda: lab4.probe_timed_naive(p, req), lambda: lab4.probe_timed_student(p, req), rounds=7, warmup=2)
    tiers = [(3.0, 1.0), (2.5, 5 / 6), (2.0, 4 / 6), (1.5, 0.5)]
    frac = next((f for r, f in tiers if t["ratio"] >= r), 0.0)
    if not frac:
        raise Failed(f"{t['ratio']:.2f}x the naive step (the lowest tier is 1.5x)")
    return {"message": f"{t['ratio']:.2f}x the naive step", "fraction": frac,
            "measurements": {k: round(v, 5) for k, v in t.items()}}


# ---------------------------------------------------------------------------------- lab 5: F.cross_entropy


def _lab5_cases(p, dev, specs: list[dict], *, loss: bool, grad: bool) -> str:
    """Each case through the student's function against F.cross_entropy on the same values; a line for the verdict."""
    import torch.nn.functional as F

    for spec in specs:
        got = lab5.probe_case(p, spec)
        x, y = lab5.make_case(spec, torch.device("cpu"))
        eps, g = spec.get("smoothing", lab5.SMOOTHING), spec.get("grad", 1.0)
        xr = x.detach().float().requires_grad_()
        ref = F.cross_entropy(xr, y, label_smoothing=eps)
        ref.backward(torch.tensor(g))
        where = f"{spec.get('dtype', 'float32')} logits ({spec['n']}, {spec['c']}), {spec.get('layout', 'contiguous')}"
        if grad and g != 1.0:
            where += f", incoming gradient {g:g}"
        need(not got["torch_ops"], f"{where}: torch's {', '.join(got['torch_ops'])} ran inside fused_cross_entropy: "
             "write the softmax, log-sum-exp and cross-entropy as your own Triton kernels")
        need(got["launches"][0] >= 1 and (not grad or got["launches"][1] >= 1), f"{where}: no Triton kernel ran in "
             f"the {'forward' if not got['launches'][0] else 'backward'} pass: launch your @triton.jit kernel")
        need(not got["switched"], f"{where}: fused_cross_entropy went around the grader's watch on torch's operators "
             f"({', '.join(got['switched'])})")
        size = x.numel()
        for phase, reads in [("forward", got["logit_reads"][0])] + [("backward", got["logit_reads"][1])] * grad:
            need(reads < size, f"{where}: outside your Triton kernels, {lab5.readers(got['logit_ops'])} read {reads} "
                 f"elements of the logits or of what your kernels computed from them in the {phase} pass, as many as "
                 f"the logits hold ({size}): compute the loss and the gradient in your kernels (torch may only finish "
                 f"per-row results, such as loss.mean()){lab5.copy_hint(got['logit_ops'], phase)}")
        if loss:
            v = float(got["loss"])
            need(got["loss_dtype"] == "float32", f"{where}: return the loss as float32, got {got['loss_dtype']}")
            need(math.isfinite(v) and abs(v - float(ref)) <= 1e-4 * abs(float(ref)) + 1e-5,
                 f"{where}: loss {v:.6g}, F.cross_entropy(x.float(), y, label_smoothing={eps:g}) gives {float(ref):.6g}")
        if grad:
            d = got["grad"]
            need(tuple(d.shape) == tuple(x.shape) and got["grad_dtype"] == str(x.dtype).replace("torch.", ""),
                 f"{where}: the gradient must be shaped and typed like the logits, got {got['grad_dtype']} "
                 f"{tuple(d.shape)}")
            rel = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 1e-5
            want = xr.grad
            far = float(((d.float() - want).abs() / (rel * want.abs() + 1e-5 * want.abs().max() + 1e-12)).max())
            need(far <= 1, f"{where}: the gradient of the logits is off by up to "
                 f"{float((d.float() - want).abs().max()):.3g} ({far:.3g}x the tolerance)")
    return f"{len(specs)} cases"


def lab5_forward(p, dev) -> dict:
    specs = [{"n": 3, "c": 10, "seed": 11}, {"n": 15, "c": 100, "seed": 12}, {"n": 7, "c": 1000, "seed": 13},
             {"n": 3, "c": 1500, "seed": 14}, {"n": 3, "c": 30, "scale": 80.0, "seed": 15}]
    return {"message": f"the loss matches F.cross_entropy on {_lab5_cases(p, dev, specs, loss=True, grad=False)}"}


def lab5_backward(p, dev) -> dict:
    specs = [{"n": 3, "c": 10, "seed": 21, "grad": 0.5}, {"n": 15, "c": 100, "seed": 22, "grad": 2.0},
             {"n": 3, "c": 1500, "seed": 23, "grad": 1.0}]
    return {"message": f"the gradient matches autograd's on {_lab5_cases(p, dev, specs, loss=False, grad=True)}"}


def lab5_layouts(p, dev) -> dict:
    specs = [{"n": 5, "c": 1003, "dtype": "bfloat16", "layout": "sliced", "seed": 31},
             {"n": 7, "c": 100, "dtype": "float16", "layout": "transposed", "seed": 32},
             {"n": 5, "c": 10, "dtype": "float32", "layout": "rows", "seed": 33, "grad": 1.5}]
    return {"message": f"loss and gradient right on {_lab5_cases(p, dev, specs, loss=True, grad=True)}"}


def lab5_speed(p, dev) -> dict:
    if dev.type != "cuda":
        raise NotHere("the speed of lab 5 is measured on a CUDA GPU (on Colab: Runtime > Change runtime type)")
    lab5_layouts(p, dev)
    params = {"n": 5, "rows": 131072, "cols": 1000, "seed": 1}
    fn = lab5.student_fn(p)
    lab5.timed_round(fn, dev, params)  # Triton compiles before the clock
    t = alternate(lambda: lab5.timed_round(lab5.eager_cross_entropy, dev, params), lambda: lab5.timed_round(fn, dev, params),
                  rounds=7, warmup=2)
    frac = next((f for r, f in LAB5_TIERS if t["ratio"] >= r), 0.0)
    line = f"{t['ratio']:.2f}x the eager composition on bf16 logits (131072, 1000), forward + backward"
    if not frac:
        raise Failed(f"{line} (the lowest tier is {LAB5_TIERS[-1][0]:g}x)")
    return {"message": f"{line} (timed here in one process; the course's grader times it in two, interleaved)",
            "fraction": frac, "measurements": {k: round(v, 5) for k, v in t.items()}}


LAB5_TIERS = [(1.8, 1.0), (1.5, 0.75), (1.25, 0.5)]  # the lab's stated tiers (its first cell), highest first

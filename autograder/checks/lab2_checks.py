"""Lab 2, fast data pipeline: the trusted checks.

The student's file defines `pack`, `PackedLoader` and `BucketSampler` (see the notebook for the API). Their
code runs only in the sandbox, driven by the probes in `autograder.student.lab2`; the baseline (the PIL
image-file loader) runs the same scenarios in a process that never held student code. This side knows the
dataset (it regenerates the images from their seed), draws every loader seed, sampler case and projection
direction at grading time, and checks every answer: the untimed epochs image by image, every timed epoch
sample by sample through dot products with directions drawn for that request alone (a reply cannot be reused
from an earlier epoch), and every epoch for the order and crops of the epochs before it (a loader that
repeats itself cannot be told from one that replays a cache, and gets no speed points).
"""

from __future__ import annotations

import math
import secrets
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from autograder.checks import remeasure
from autograder.checks.harness import CheckFailed, Tiers, hidden_draws, require
from autograder.student import lab2 as pub

# Samples/s of the packed loader over the PIL image-file loader, both on the CPU with one thread each.
# Decoding PNGs and per-sample PIL transforms cost ~100 us per image; a packed uint8 array with batched
# tensor augmentation costs a few us, so a good solution is >10x; per-sample Python augmentation on the
# packed array reaches ~2-4x.
LOADER_TIERS = {cls: Tiers(((2.0, 0.25), (3.0, 0.5), (5.0, 0.75), (8.0, 1.0))) for cls in
                ("tensor_core_gpu", "gpu", "cpu")}
SPEED_ROUNDS, SPEED_WARMUP = 5, 1  # timed requests per side, and untimed (but checked) ones before them
# Epochs per timed request, all of one new loader: amortizes its construction (timed too, so that no work
# can move out of the timed region) and the request's round trip, as timing epochs in-process did.
SPEED_EPOCHS = 2
# Largest share of a training step (a fixed small CNN on one CPU thread) spent waiting for the next batch.
MAX_DATA_WAIT = 0.25
DATA_SEED = 0  # the dataset is the notebook's own (public); the seeds below are sent at grading time
SEEDS = {"plain": 0, "shuffled": 1, "drop_last": 2, "augment": 0, "gate": 3, "sampler": 0}  # untimed, public
# (every timed request draws a new loader seed and new directions with `secrets`; the hidden sampler cases come
# from the course secret, see _hidden_cases)
DIRECTIONS = 4  # projection directions per timed epoch: each sample must match a crop in all of them
PIXEL_TOL = 1e-4  # largest error of one normalized pixel (the round trip's tolerance)
MAX_REPEATED_CROPS = 0.2  # share of samples with the crop of an earlier epoch (an honest loader: ~1/162)
PAD = pub.PAD
_CROPS = (2 * PAD + 1) ** 2  # crop offsets (81); each also flipped


def _data(ctx) -> tuple[int, np.ndarray]:
    n = 512 if ctx.small else 2048
    return n, pub.dataset_arrays(n, DATA_SEED)[0]


def _fresh_seed(used: set) -> int:
    while True:
        s = 1000 + secrets.randbelow(2**31 - 1000)
        if s not in used:
            used.add(s)
            return s


# ------------------------------------------------------------------------------------ what came back


def _tensor(v, what: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor the student's process sent, of `dtype` and `shape` (None: any size), or a failed check."""
    require(isinstance(v, torch.Tensor), f"the submission's process sent no tensor for {what}")
    require(v.dtype == dtype and v.dim() == len(shape) and all(s is None or s == g for s, g in zip(shape, v.shape,
            strict=True)), f"{what} must be {str(dtype).removeprefix('torch.')} of shape "
            f"{tuple('N' if s is None else s for s in shape)}, got {str(v.dtype).removeprefix('torch.')} "
            f"{tuple(v.shape)}")
    return v


def _ints(v, what: str) -> list[int]:
    require(isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v),
            f"the submission's process sent malformed {what}")
    return v


def _check_epoch(got, n: int, batch_size: int, drop_last: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Labels of one epoch (validated: every sample once, batch sizes), and the batch sizes."""
    require(isinstance(got, dict), "the submission's process sent a malformed epoch")
    sizes = _ints(got.get("sizes"), "batch sizes")
    require(len(sizes) > 0, "the loader yielded no batches")
    require(max(sizes) <= batch_size, f"a batch has {max(sizes)} samples, more than batch_size={batch_size}")
    ys = _tensor(got.get("y"), "the labels", torch.int64, (None,))
    require(ys.numel() == sum(sizes), "the labels do not add up to the batch sizes")
    want = n - n % batch_size if drop_last else n
    require(ys.numel() == want, f"one epoch yielded {ys.numel()} samples, expected {want}", samples=ys.numel())
    inside = bool(((ys >= 0) & (ys < n)).all())
    require(inside and ys.unique().numel() == want and (drop_last or torch.equal(ys.sort().values, torch.arange(n))),
            "every sample must appear exactly once per epoch")
    return ys, sizes


def _epoch(ctx, n: int, batch_size: int, **kw) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One untimed epoch of the student's loader, checked: (images, labels, batch sizes)."""
    got = ctx.call("lab2.epoch", {"n": n, "data_seed": DATA_SEED, "batch_size": batch_size, **kw})
    ys, sizes = _check_epoch(got, n, batch_size, kw.get("drop_last", False))
    xs = _tensor(got.get("x"), "the images", torch.float32, (ys.numel(), 3, 32, 32))
    return xs, ys, sizes


# ------------------------------------------------------------------------------------ crops of the sources


def _candidates(src_u8: np.ndarray) -> torch.Tensor:
    """All (2 flips x 9 x 9 offsets) augmentations of one image, normalized: (162, 3, 32, 32)."""
    crops = _padded(src_u8[None]).unfold(2, 32, 1).unfold(3, 32, 1)  # (1, 3, 9, 9, 32, 32)
    crops = crops.permute(0, 2, 3, 1, 4, 5).reshape(_CROPS, 3, 32, 32)
    return torch.cat([crops, crops.flip(-1)])


def _match_augmentation(out: torch.Tensor, src_u8: np.ndarray) -> int | None:
    """Index of the (flip, dy, dx) candidate equal to `out`, or None if it is no crop/flip of the source."""
    d = (_candidates(src_u8) - out.float().cpu()[None]).abs().flatten(1).amax(1)
    best = int(d.argmin())
    return best if float(d[best]) < PIXEL_TOL else None


def _padded(img_u8: np.ndarray) -> torch.Tensor:
    """The normalized source images with the 4-pixel zero padding (normalized zeros): (N, 3, 40, 40)."""
    x = pub.normalize(torch.from_numpy(img_u8))
    fill = (-torch.tensor(pub.MEAN) / torch.tensor(pub.STD)).view(1, 3, 1, 1)
    padded = fill.expand(x.shape[0], 3, 32 + 2 * PAD, 32 + 2 * PAD).clone()
    padded[:, :, PAD:PAD + 32, PAD:PAD + 32] = x
    return padded


class Crops:
    """What every crop and flip of every source image gives along a set of directions, for checking samples
    the trusted side never sees whole (a timed epoch sends only each sample's dot products)."""

    def __init__(self, img_u8: np.ndarray):
        self.img, self.padded = img_u8, _padded(img_u8)

    @staticmethod
    def directions(seed: int) -> torch.Tensor:
        return torch.randn(DIRECTIONS, 3 * 32 * 32, generator=torch.Generator().manual_seed(seed))

    def values(self, proj: torch.Tensor) -> torch.Tensor:
        """(N, 162, k): the dot product of crop (flip, dy, dx) of image i with direction j, as a correlation."""
        n, k = self.padded.shape[0], proj.shape[0]
        w = proj.view(k, 3, 32, 32)
        out = F.conv2d(self.padded, torch.cat([w, w.flip(-1)]))  # (N, 2k, 9, 9): plain, then flipped crops
        return out.view(n, 2, k, _CROPS).permute(0, 1, 3, 2).reshape(n, 2 * _CROPS, k)

    def match(self, what: str, ys: torch.Tensor, z, proj: torch.Tensor, values: torch.Tensor | None = None):
        """The crop index (flip * 81 + dy * 9 + dx) of every sample; a failed check naming the first sample
        that is no padded crop (+ optional flip) of its source image."""
        z = _tensor(z, "the projected images", torch.float32, (ys.numel(), proj.shape[0]))
        values = self.values(proj) if values is None else values
        # An error of PIXEL_TOL in every pixel moves a dot product by at most PIXEL_TOL * |direction|_1.
        tol = PIXEL_TOL * proj.abs().sum(1) + 1e-3
        d = ((values[ys] - z[:, None, :]).abs() / tol).amax(-1)  # (N, 162), <= 1: within tolerance
        best = d.argmin(1)
        ok = d.gather(1, best[:, None])[:, 0] <= 1
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise CheckFailed(f"{what}: the augmented image with label {int(ys[i])} is not a padded random crop "
                              "(+ optional horizontal flip) of its source image", sample=i)
        return best


def _augment_evidence(xs: torch.Tensor, ys: torch.Tensor, img: np.ndarray, limit: int = 64):
    """(offsets seen, flips, checked) over the first `limit` samples, each matched pixel by pixel."""
    seen, flips, checked = [], 0, 0
    for xi, yi in zip(xs[:limit], ys[:limit], strict=True):
        k = _match_augmentation(xi, img[int(yi)])
        checked += 1
        if k is None:
            raise CheckFailed(f"the augmented image with label {int(yi)} is not a padded random crop "
                              f"(+ optional horizontal flip) of its source image", checked=checked)
        flips += k >= _CROPS
        seen.append(k % _CROPS)
    return seen, flips, checked


class History:
    """The order and crops of the epochs seen so far: a new epoch must differ from each of them."""

    def __init__(self, n: int):
        self.n, self.epochs = n, []

    def add(self, what: str, ys: torch.Tensor, crops: torch.Tensor) -> None:
        flips = float((crops >= _CROPS).float().mean())
        first = (crops[:64] % _CROPS).unique().numel()
        require(0.25 <= flips <= 0.75, f"{what}: {flips:.0%} of the images flipped: flip each with probability 0.5")
        require(first >= min(10, len(crops)), f"{what}: only {first} distinct crop offsets among the first 64 "
                "samples: draw the offset per sample, not once per batch")
        by = torch.full((self.n,), -1, dtype=torch.long)
        by[ys] = crops
        for prev, pys, pby in self.epochs:
            m = min(len(ys), len(pys))
            require(not torch.equal(ys[:m], pys[:m]), f"{what} came in the same order as {prev}: each PackedLoader "
                    "must shuffle from its own seed (a repeated epoch cannot be told from a cached one)")
            both = (by >= 0) & (pby >= 0)
            same = float((by[both] == pby[both]).float().mean()) if bool(both.any()) else 0.0
            require(same <= MAX_REPEATED_CROPS, f"{what} repeats the crop and flip of {prev} for {same:.0%} of the "
                    f"samples (about {1 / (2 * _CROPS):.1%} expected): every epoch must draw new crops and flips "
                    "from the loader's seed (a repeated epoch cannot be told from a cached one)", repeated=same)
        self.epochs.append((what, ys, by))


# ------------------------------------------------------------------------------------ part A and B


def check_packed_roundtrip(ctx) -> dict:
    n, img = _data(ctx)
    packed = ctx.call("lab2.pack", {"n": n, "data_seed": DATA_SEED})
    files, size = packed["packed_files"], packed["packed_bytes"]
    require(isinstance(files, int) and isinstance(size, int), "the submission's process sent a malformed answer")
    xs, ys, _ = _epoch(ctx, n, 64, shuffle=False, augment=False, seed=SEEDS["plain"], drop_last=False)
    require(torch.equal(ys, torch.arange(n)), "with shuffle=False the samples must come in file order")
    err = float((xs - pub.normalize(torch.from_numpy(img))).abs().max())
    require(err < PIXEL_TOL, f"without augmentation the images must equal the decoded, normalized files (max error "
            f"{err:.3g})", max_abs_error=err)
    xs2, ys2, _ = _epoch(ctx, n, 64, shuffle=True, augment=False, seed=SEEDS["shuffled"], drop_last=False)
    require(not torch.equal(ys2, torch.arange(n)), "with shuffle=True the order must change")
    require(torch.allclose(xs2, xs[ys2], atol=PIXEL_TOL), "shuffled images do not match their labels")
    got = ctx.call("lab2.epoch", {"n": n, "data_seed": DATA_SEED, "batch_size": 100, "shuffle": True,
                                  "augment": False, "seed": SEEDS["drop_last"], "drop_last": True})
    sizes = _ints(got.get("sizes") if isinstance(got, dict) else None, "batch sizes")
    require(sum(sizes) == n - n % 100 and all(s == 100 for s in sizes), "drop_last=True must yield only full batches")
    return {"message": f"{n} images packed into {files} file(s); exact round trip, shuffle and drop_last work",
            "measurements": {"packed_files": files, "packed_bytes": size}}


def check_batched_augment(ctx) -> dict:
    n, img = _data(ctx)
    kw = dict(shuffle=True, augment=True, seed=SEEDS["augment"], drop_last=False)
    xs, ys, _ = _epoch(ctx, n, 128, **kw)
    seen, flips, checked = _augment_evidence(xs, ys, img, limit=128)
    first = seen[:64]
    m = {"distinct_offsets_in_first_batch": len(set(first)), "flip_share": flips / checked}
    require(len(set(first)) >= 10, f"only {len(set(first))} distinct crop offsets in a batch of 64: draw the "
            "offset per sample, not once per batch", **m)
    require(0.25 <= flips / checked <= 0.75, f"{flips}/{checked} images flipped: flip each with probability 0.5", **m)
    again = ctx.call("lab2.epoch", {"n": n, "data_seed": DATA_SEED, "batch_size": 128, **kw})
    x2 = again.get("x") if isinstance(again, dict) else None
    m["same_seed_reproducible"] = isinstance(x2, torch.Tensor) and x2.shape == xs.shape and torch.equal(x2, xs)
    return {"message": f"every checked image ({checked}) is a padded crop/flip of its source; offsets drawn per "
                       "sample", "measurements": m}


# ------------------------------------------------------------------------------------ part C and hidden


def _padding_waste(batches, lengths) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def _index_batches(v, what: str) -> list[list[int]]:
    require(isinstance(v, list), f"the submission's process sent malformed {what}")
    return [_ints(b, what) for b in v]


def _sampler_checks(ctx, lengths: list[int], batch_size: int, seed: int) -> dict:
    n = len(lengths)
    got = ctx.call("lab2.sampler", {"lengths": lengths, "batch_size": batch_size, "seed": seed})
    batches = _index_batches(got["batches"], "batches")
    n_len = got["len"]
    require(isinstance(n_len, int), "the submission's process sent a malformed len()")
    flat = [i for b in batches for i in b]
    require(sorted(flat) == list(range(n)), f"(n={n}, batch_size={batch_size}) every index must appear exactly "
            f"once per epoch: got {len(flat)} indices, {len(set(flat))} distinct")
    require(all(0 < len(b) <= batch_size for b in batches), f"(batch_size={batch_size}) batch sizes must be "
            "between 1 and batch_size")
    require(n_len == len(batches), f"len(sampler) is {n_len} but an epoch yielded {len(batches)} batches")
    require(len(batches) <= math.ceil(n / batch_size) * 1.25 + 2, f"{len(batches)} batches for {n} samples: too "
            "many small batches (sort within large chunks, then cut into full batches)")
    g = torch.Generator().manual_seed(seed + 1000)
    perm = torch.randperm(n, generator=g).tolist()
    rand = [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    waste, rwaste = _padding_waste(batches, lengths), _padding_waste(rand, lengths)
    m = {"padding_waste": round(waste, 4), "random_batching_waste": round(rwaste, 4), "batches": len(batches)}
    require(waste <= 0.35 * rwaste + 1e-9 or n <= batch_size, f"padding waste {waste:.1%} vs {rwaste:.1%} for "
            "random batches: bucket by length (at most 35% of random batching's waste)", **m)
    maxlens = [max(lengths[i] for i in b) for b in batches]
    # Sortedness needs several distinct batch lengths to show: with three (tied lengths) an honest shuffle's rank
    # correlation passed 0.5 for 4 of 300 seeds, measured on the reference solution.
    if len(batches) >= 8 and len(set(maxlens)) >= 5:
        rho = _spearman(list(range(len(maxlens))), maxlens)
        m["order_vs_length_rank_corr"] = round(rho, 3)
        require(abs(rho) < 0.5, f"batches come sorted by length (rank correlation {rho:.2f}): shuffle the batches", **m)
    require(_index_batches(got["again"], "batches") == batches, "two samplers with the same seed must yield the same "
            "batches", **m)
    if len(batches) > 1:
        require(_index_batches(got["other"], "batches") != batches, "a different seed must give a different order", **m)
        require(_index_batches(got["next_epoch"], "batches") != batches, "each new epoch (a new iter()) must "
                "reshuffle", **m)
    return m


def _spearman(a, b) -> float:
    ra = torch.tensor(a, dtype=torch.float64).argsort().argsort().double()
    rb = torch.tensor(b, dtype=torch.float64).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den else 0.0


def _lognormal_lengths(n, seed, lo=5, hi=300) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(3.5, 0.8, n), lo, hi).astype(int).tolist()


def check_bucket_sampler(ctx) -> dict:
    m = _sampler_checks(ctx, _lognormal_lengths(2000, 0), 32, SEEDS["sampler"])
    return {"message": f"bucketing cuts padding to {m['padding_waste']:.1%} (random batches: "
                       f"{m['random_batching_waste']:.1%})", "measurements": m}


def _hidden_cases(student: str | None = None,
                  handin: str | None = None) -> tuple[dict[str, tuple[list[int], int]], int]:
    """The hidden sampler cases (lengths, batch size) and the sampler's seed, from the course secret and the
    student or the hand-in (autograder.checks.harness.hidden_draws): the kinds of case are public (uniform, tied, fewer
    than a batch, long-tailed), their sizes and values are not."""
    from autograder.base import course_secret

    r = course_secret.rng("lab2.hidden/sampler_cases", student, handin=handin)
    # Each kind of case varies around a size the reference solution was measured on, well inside the checks'
    # margins (an honest sampler must pass every course's cases, not most).
    bs_few = int(r.integers(6, 12))
    cases = {"uniform": (r.integers(1, int(r.integers(40, 61)), int(r.integers(950, 1050))).tolist(),
                         int(r.integers(6, 9))),
             "many_equal": ([int(r.integers(8, 17))] * int(r.integers(280, 320)) + [int(r.integers(36, 49))]
                            * int(r.integers(280, 320)) + [int(r.integers(2, 6))] * int(r.integers(10, 17)), 16),
             "fewer_than_a_batch": (r.integers(1, 20, int(r.integers(2, bs_few))).tolist(), bs_few),
             "long_tail": (_lognormal_lengths(int(r.integers(2800, 3200)), int(r.integers(2**31)), 1, 500), 64)}
    return cases, int(r.integers(2**31))


def check_bucket_sampler_hidden(ctx) -> dict:
    ms = {}
    for i, draw in enumerate(hidden_draws(ctx)):
        cases, seed = _hidden_cases(**draw)
        for name, (lengths, bs) in cases.items():
            try:
                ms[f"{name}/{i}"] = _sampler_checks(ctx, lengths, bs, seed)
            except CheckFailed as e:
                raise CheckFailed(f"[{name}] {e}", **e.measurements) from None
    return {"message": "sampler correct on uniform, tied, tiny and long-tailed lengths", "measurements": ms}


# ------------------------------------------------------------------------------------ part D and E


def _gate(ctx, n: int, img: np.ndarray, batch_size: int, crops: Crops, history: History) -> None:
    """Correctness before speed: one augmented epoch has every sample once and valid crops (16 of them checked
    pixel by pixel, all of them along random directions); its crops start the history timed epochs must avoid."""
    xs, ys, _ = _epoch(ctx, n, batch_size, shuffle=True, augment=True, seed=SEEDS["gate"], drop_last=False)
    _augment_evidence(xs, ys, img, limit=16)
    proj = Crops.directions(secrets.randbelow(2**31))
    history.add("the checked epoch", ys, crops.match("the checked epoch", ys, xs.flatten(1) @ proj.t(), proj))


class _Rounds:
    """Fresh parameters for every timed request (a new loader seed and new directions), and their checks."""

    def __init__(self, n: int, batch_size: int, crops: Crops, history: History):
        self.n, self.bs, self.crops, self.history, self.used = n, batch_size, crops, history, set()
        self.params: dict[int, dict] = {}
        self.checked = 0

    def __call__(self, r: int) -> dict:
        if r not in self.params:
            self.params[r] = {"n": self.n, "data_seed": DATA_SEED, "batch_size": self.bs, "shuffle": True,
                              "augment": True, "drop_last": False, "seed": _fresh_seed(self.used),
                              "epochs": SPEED_EPOCHS, "proj": Crops.directions(secrets.randbelow(2**31))}
        return self.params[r]

    def _epochs(self, result) -> list:
        require(isinstance(result, list) and len(result) == SPEED_EPOCHS,
                f"a timed request must return {SPEED_EPOCHS} epochs")
        return result

    def check_base(self, result, params) -> None:
        for e in self._epochs(result):  # the baseline holds no student code: a check of the grader
            _check_epoch(e, self.n, self.bs)

    def check_student(self, result, params) -> None:
        values = self.crops.values(params["proj"])
        try:
            for e in self._epochs(result):
                what = f"timed epoch {self.checked + 1} (seed {params['seed']})"
                ys, _ = _check_epoch(e, self.n, self.bs)
                self.history.add(what, ys, self.crops.match(what, ys, e.get("z"), params["proj"], values))
                self.checked += 1
        except CheckFailed as e:
            raise CheckFailed(f"{e}; every timed epoch is checked, and a loader that is right when checked but not "
                              "when timed gets no speed points", **e.measurements) from None


def check_loader_speed(ctx) -> dict:
    """Samples/s of a new PackedLoader (a new seed every request: built, then iterated for SPEED_EPOCHS epochs)
    vs the PIL file loader doing the same, timed from here.

    Both sides run in their own processes, one CPU thread each, alternately with the idle one frozen; every
    timed reply of the student's process is checked sample by sample (see `Crops`, `History`).
    """
    ctx.baseline()  # start the baseline's process now: it imports torch while the student's epoch is checked
    n, img = _data(ctx)
    bs = 128
    crops, history = Crops(img), History(n)
    _gate(ctx, n, img, bs, crops, history)
    rounds = _Rounds(n, bs, crops, history)
    tiers = LOADER_TIERS[ctx.hardware]
    t0 = time.monotonic()

    def timed(k: int):  # one measurement; a re-measurement goes on with fresh round parameters
        off = len(rounds.params)
        return ctx.compare(lambda r: ("lab2.baseline_epochs", rounds(off + r)),
                           lambda r: ("lab2.timed_epochs", rounds(off + r)), rounds=k, warmup=SPEED_WARMUP,
                           inner=SPEED_EPOCHS, check_base=rounds.check_base, check_student=rounds.check_student)

    ab, notes, record = remeasure.measured(timed, SPEED_ROUNDS, tiers, time_left=ctx._left,
                                           spent=lambda: time.monotonic() - t0)
    frac = tiers.fraction(ab.ratio)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2),
         "baseline_samples_per_s": round(n / ab.a.median), "packed_samples_per_s": round(n / ab.b.median),
         "tiers": tiers.describe(), "rounds": len(ab.ratios), "epochs_checked": rounds.checked, **record, **notes}
    again = remeasure.message(record)
    if frac == 0:
        raise CheckFailed(f"packed loader is {ab.ratio:.2f}x the PIL file loader, below the first tier "
                          f"({tiers.describe()}).{again}", **m)
    return {"fraction": frac, "message": f"packed loader: {ab.ratio:.1f}x the PIL file loader "
                                         f"({m['packed_samples_per_s']} vs {m['baseline_samples_per_s']} samples/s)."
                                         f"{again}", "measurements": m}


def _seconds(v, steps: int, what: str) -> list[float]:
    require(isinstance(v, list) and len(v) == steps and all(isinstance(t, float) and math.isfinite(t) and t >= 0
                                                             for t in v), f"the submission's process sent malformed {what}")
    return v


def check_data_wait(ctx) -> dict:
    """Share of a training step spent in next(loader), a small CNN training on one CPU thread.

    The wait and step times are the student process's own report (nothing outside it can see where its time
    goes inside one request); the batches the model trained on are checked here like a timed epoch's, and the
    PIL loader's share is measured by the same scenario in the baseline's process.
    """
    ctx.baseline()  # start the baseline's process now, as in check_loader_speed
    n, img = _data(ctx)
    bs = 64
    crops, history = Crops(img), History(n)
    _gate(ctx, n, img, bs, crops, history)
    steps = min(n // bs - 2, 12)
    params = {"n": n, "data_seed": DATA_SEED, "batch_size": bs, "seed": _fresh_seed(set()), "steps": steps,
              "proj": Crops.directions(secrets.randbelow(2**31))}
    got = ctx.call("lab2.data_wait", params)
    sizes = _ints(got["sizes"], "batch sizes")
    ys = _tensor(got["y"], "the labels", torch.int64, ((steps + 2) * bs,))
    require(sizes == [bs] * (steps + 2) and bool(((ys >= 0) & (ys < n)).all()) and ys.unique().numel() == len(ys),
            f"the {steps + 2} batches the model trained on must be full batches of distinct samples")
    what = "the epoch the model trained on"
    history.add(what, ys, crops.match(what, ys, got["z"], params["proj"]))
    waits, st = _seconds(got["waits"], steps, "wait times"), _seconds(got["steps"], steps, "step times")
    base = ctx.baseline_call("lab2.baseline_data_wait", params)
    share = sum(waits) / (sum(waits) + sum(st))
    base_share = sum(base["waits"]) / (sum(base["waits"]) + sum(base["steps"]))
    m = {"data_wait_share": round(share, 3), "pil_loader_data_wait_share": round(base_share, 3),
         "median_wait_ms": round(1e3 * statistics.median(waits), 3),
         "median_step_ms": round(1e3 * statistics.median(st), 3), "limit": MAX_DATA_WAIT}
    require(share <= MAX_DATA_WAIT, f"{share:.0%} of each training step waits for data (limit "
            f"{MAX_DATA_WAIT:.0%}; the PIL file loader: {base_share:.0%})", **m)
    return {"message": f"{share:.1%} of step time waiting for data (PIL file loader: {base_share:.0%})",
            "measurements": m}

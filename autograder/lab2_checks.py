"""Lab 2, fast data pipeline: the trusted image-file baseline, the dataset, and the checks.

The student's file defines `pack(image_paths, labels, out_dir)`, `PackedLoader(out_dir, batch_size, *,
shuffle, augment, seed, drop_last)` and `BucketSampler(lengths, batch_size, *, seed)`. The baseline is the
textbook path: one PNG file per image decoded by PIL in `__getitem__`, torchvision's RandomCrop(32, padding=4),
RandomHorizontalFlip, ToTensor and Normalize per sample, batched by a DataLoader.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from autograder.harness import CheckFailed, Tiers, call_student, require, student_attr
from labkit import bench

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4

# Samples/s of the packed loader over the PIL image-file loader, both on the CPU with one process each.
# Decoding PNGs and per-sample PIL transforms cost ~100 us per image; a packed uint8 array with batched
# tensor augmentation costs a few us, so a good solution is >10x; per-sample Python augmentation on the
# packed array reaches ~2-4x.
LOADER_TIERS = {cls: Tiers(((2.0, 0.25), (3.0, 0.5), (5.0, 0.75), (8.0, 1.0))) for cls in
                ("tensor_core_gpu", "gpu", "cpu")}
# Largest share of a training step (a fixed small CNN on one CPU thread) spent waiting for the next batch.
MAX_DATA_WAIT = 0.25


def make_dataset(root: Path, n: int = 1024, seed: int = 0) -> tuple[list[Path], np.ndarray, np.ndarray]:
    """Write n 32x32 RGB PNG files with smooth content and noise; returns (paths, images uint8 NHWC, labels)."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (n, 8, 8, 3)).astype(np.float32)
    img = base.repeat(4, axis=1).repeat(4, axis=2) + rng.normal(0, 12, (n, 32, 32, 3))
    img = np.clip(img, 0, 255).astype(np.uint8)
    labels = np.arange(n, dtype=np.int64)  # one label per image, so every output names its source
    paths = []
    for i in range(n):
        p = root / f"{i:05d}.png"
        if not p.exists():
            Image.fromarray(img[i]).save(p)
        paths.append(p)
    return paths, img, labels


def _dataset(ctx):
    n = 512 if ctx.small else 2048
    return make_dataset(ctx.work_dir / f"images{n}", n)


class PILFileDataset(torch.utils.data.Dataset):
    """The baseline: decode one PNG per sample and run torchvision's per-sample transforms."""

    def __init__(self, paths, labels, augment: bool = True):
        from torchvision import transforms as T

        self.paths, self.labels = list(paths), list(labels)
        aug = [T.RandomCrop(32, padding=PAD), T.RandomHorizontalFlip()] if augment else []
        self.tf = T.Compose([*aug, T.ToTensor(), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            return self.tf(im.convert("RGB")), self.labels[i]


def baseline_loader(paths, labels, batch_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(PILFileDataset(paths, labels), batch_size=batch_size, shuffle=True,
                                       generator=g, num_workers=0)


def _normalize(img_u8: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW normalized like the baseline."""
    x = img_u8.permute(0, 3, 1, 2).float() / 255
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _candidates(src_u8: np.ndarray) -> torch.Tensor:
    """All (2 flips x 9 x 9 offsets) augmentations of one image, normalized: (162, 3, 32, 32)."""
    x = _normalize(torch.from_numpy(src_u8[None]))
    fill = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1)
    padded = fill.expand(1, 3, 32 + 2 * PAD, 32 + 2 * PAD).clone()
    padded[:, :, PAD:PAD + 32, PAD:PAD + 32] = x
    crops = padded.unfold(2, 32, 1).unfold(3, 32, 1)  # (1, 3, 9, 9, 32, 32)
    crops = crops.permute(0, 2, 3, 1, 4, 5).reshape(81, 3, 32, 32)
    return torch.cat([crops, crops.flip(-1)])


def _match_augmentation(out: torch.Tensor, src_u8: np.ndarray) -> int | None:
    """Index of the (flip, dy, dx) candidate equal to `out`, or None if it is no crop/flip of the source."""
    d = (_candidates(src_u8) - out.float().cpu()[None]).abs().flatten(1).amax(1)
    best = int(d.argmin())
    return best if float(d[best]) < 1e-4 else None


def _loader(mod, out_dir, batch_size, **kw):
    cls = student_attr(mod, "PackedLoader")
    return call_student(f"PackedLoader(batch_size={batch_size}, {', '.join(f'{k}={v}' for k, v in kw.items())})",
                        cls, str(out_dir), batch_size, **kw)


def _epoch(loader, what="iterating PackedLoader"):
    def run():
        return [(x, y) for x, y in loader]
    return call_student(what, run)


def _pack(mod, ctx, paths, labels):
    out = ctx.work_dir / "packed"
    if not (out / ".packed-by-check").exists():
        out.mkdir(exist_ok=True)
        call_student("pack(image_paths, labels, out_dir)", student_attr(mod, "pack"), [str(p) for p in paths],
                     [int(v) for v in labels], str(out))
        (out / ".packed-by-check").touch()
    return out


def _check_batches(batches, n, batch_size, drop_last=False):
    require(len(batches) > 0, "the loader yielded no batches")
    for x, y in batches:
        require(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 4 and tuple(x.shape[1:]) == (3, 32, 32),
                f"images must be float32 (B, 3, 32, 32), got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        require(isinstance(y, torch.Tensor) and y.dtype == torch.int64 and y.shape == (x.shape[0],),
                "labels must be an int64 tensor with one label per image")
        require(x.shape[0] <= batch_size, f"a batch has {x.shape[0]} samples, more than batch_size={batch_size}")
    ys = torch.cat([y for _, y in batches])
    want = n - n % batch_size if drop_last else n
    require(ys.numel() == want, f"one epoch yielded {ys.numel()} samples, expected {want}", samples=ys.numel())
    require(ys.unique().numel() == want and (drop_last or torch.equal(ys.sort().values, torch.arange(n))),
            "every sample must appear exactly once per epoch")
    return ys


def check_packed_roundtrip(mod, ctx) -> dict:
    paths, img, labels = _dataset(ctx)
    out = _pack(mod, ctx, paths, labels)
    n = len(paths)
    plain = _epoch(_loader(mod, out, 64, shuffle=False, augment=False, seed=0, drop_last=False))
    ys = _check_batches(plain, n, 64)
    require(torch.equal(ys, torch.arange(n)), "with shuffle=False the samples must come in file order")
    xs = torch.cat([x for x, _ in plain])
    err = float((xs - _normalize(torch.from_numpy(img))).abs().max())
    require(err < 1e-4, f"without augmentation the images must equal the decoded, normalized files (max error {err:.3g})",
            max_abs_error=err)
    sh = _epoch(_loader(mod, out, 64, shuffle=True, augment=False, seed=1, drop_last=False))
    ys2 = _check_batches(sh, n, 64)
    require(not torch.equal(ys2, torch.arange(n)), "with shuffle=True the order must change")
    xs2 = torch.cat([x for x, _ in sh])
    require(torch.allclose(xs2, xs[ys2], atol=1e-4), "shuffled images do not match their labels")
    dl = _epoch(_loader(mod, out, 100, shuffle=True, augment=False, seed=2, drop_last=True))
    require(sum(len(y) for _, y in dl) == n - n % 100 and all(len(y) == 100 for _, y in dl),
            "drop_last=True must yield only full batches")
    files = [p for p in out.rglob("*") if p.is_file() and p.name != ".packed-by-check"]
    return {"message": f"{n} images packed into {len(files)} file(s); exact round trip, shuffle and drop_last work",
            "measurements": {"packed_files": len(files), "packed_bytes": sum(p.stat().st_size for p in files)}}


def _augment_evidence(batches, img, limit=64):
    """(matched, checked, offsets seen, flips) over the first `limit` samples."""
    seen, flips, checked = [], 0, 0
    for x, y in batches:
        for xi, yi in zip(x, y, strict=True):
            if checked >= limit:
                return seen, flips, checked
            k = _match_augmentation(xi, img[int(yi)])
            checked += 1
            if k is None:
                raise CheckFailed(f"the augmented image with label {int(yi)} is not a padded random crop "
                                  f"(+ optional horizontal flip) of its source image", checked=checked)
            flips += k >= 81
            seen.append(k % 81)
    return seen, flips, checked


def check_batched_augment(mod, ctx) -> dict:
    paths, img, labels = _dataset(ctx)
    out = _pack(mod, ctx, paths, labels)
    batches = _epoch(_loader(mod, out, 128, shuffle=True, augment=True, seed=0, drop_last=False))
    _check_batches(batches, len(paths), 128)
    seen, flips, checked = _augment_evidence(batches, img, limit=128)
    first = seen[:64]
    m = {"distinct_offsets_in_first_batch": len(set(first)), "flip_share": flips / checked}
    require(len(set(first)) >= 10, f"only {len(set(first))} distinct crop offsets in a batch of 64: draw the "
            "offset per sample, not once per batch", **m)
    require(0.25 <= flips / checked <= 0.75, f"{flips}/{checked} images flipped: flip each with probability 0.5", **m)
    again = _epoch(_loader(mod, out, 128, shuffle=True, augment=True, seed=0, drop_last=False))
    same = all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=False))
    m["same_seed_reproducible"] = same
    return {"message": f"every checked image ({checked}) is a padded crop/flip of its source; offsets drawn per "
                       "sample", "measurements": m}


def _padding_waste(batches, lengths) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def _sampler_batches(mod, lengths, batch_size, seed):
    cls = student_attr(mod, "BucketSampler")
    s = call_student(f"BucketSampler(lengths, {batch_size}, seed={seed})", cls, list(lengths), batch_size, seed=seed)
    batches = call_student("iterating BucketSampler", lambda: [[int(i) for i in b] for b in s])
    n_len = call_student("len(BucketSampler)", len, s)
    return s, batches, n_len


def _sampler_checks(mod, lengths, batch_size, seed=0) -> dict:
    n = len(lengths)
    s, batches, n_len = _sampler_batches(mod, lengths, batch_size, seed)
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
    require(waste <= 0.35 * rwaste + 1e-9 or n <= batch_size, f"padding waste {waste:.1%} vs {rwaste:.1%} for random batches: bucket "
            "by length (at most 35% of random batching's waste)", **m)
    maxlens = [max(lengths[i] for i in b) for b in batches]
    if len(batches) >= 8 and len(set(maxlens)) > 1:
        rho = _spearman(list(range(len(maxlens))), maxlens)
        m["order_vs_length_rank_corr"] = round(rho, 3)
        require(abs(rho) < 0.5, f"batches come sorted by length (rank correlation {rho:.2f}): shuffle the batches", **m)
    _, again, _ = _sampler_batches(mod, lengths, batch_size, seed)
    require(again == batches, "two samplers with the same seed must yield the same batches", **m)
    if len(batches) > 1:
        _, other, _ = _sampler_batches(mod, lengths, batch_size, seed + 1)
        next_epoch = call_student("a second epoch of BucketSampler", lambda: [[int(i) for i in b] for b in s])
        require(other != batches, "a different seed must give a different order", **m)
        require(next_epoch != batches, "each new epoch (a new iter()) must reshuffle", **m)
    return m


def _spearman(a, b) -> float:
    ra = torch.tensor(a, dtype=torch.float64).argsort().argsort().double()
    rb = torch.tensor(b, dtype=torch.float64).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den else 0.0


def _lognormal_lengths(n, seed, lo=5, hi=300):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(3.5, 0.8, n), lo, hi).astype(int).tolist()


def check_bucket_sampler(mod, ctx) -> dict:
    m = _sampler_checks(mod, _lognormal_lengths(2000, 0), 32)
    return {"message": f"bucketing cuts padding to {m['padding_waste']:.1%} (random batches: "
                       f"{m['random_batching_waste']:.1%})", "measurements": m}


def check_bucket_sampler_hidden(mod, ctx) -> dict:
    ms = {}
    rng = np.random.default_rng(7)
    cases = {"uniform_1_50_bs7": (rng.integers(1, 51, 999).tolist(), 7),
             "many_equal_bs16": ([12] * 300 + [40] * 300 + [3] * 13, 16),
             "fewer_than_a_batch": ([5, 9, 2, 7, 4], 8),
             "long_tail_bs64": (_lognormal_lengths(3001, 3, 1, 2000), 64)}
    for name, (lengths, bs) in cases.items():
        try:
            ms[name] = _sampler_checks(mod, lengths, bs, seed=11)
        except CheckFailed as e:
            raise CheckFailed(f"[{name}] {e}", **e.measurements) from None
    return {"message": "sampler correct on uniform, tied, tiny and long-tailed lengths", "measurements": ms}


def _gate(mod, ctx, out, img, batch_size):
    """Correctness before speed: one augmented epoch has every sample once and valid crops."""
    batches = _epoch(_loader(mod, out, batch_size, shuffle=True, augment=True, seed=3, drop_last=False))
    _check_batches(batches, len(img), batch_size)
    _augment_evidence(batches, img, limit=16)


def check_loader_speed(mod, ctx) -> dict:
    paths, img, labels = _dataset(ctx)
    out = _pack(mod, ctx, paths, labels)
    bs = 128
    _gate(mod, ctx, out, img, bs)
    base = baseline_loader(paths, labels.tolist(), bs)
    mine = _loader(mod, out, bs, shuffle=True, augment=True, seed=0, drop_last=False)
    counted = {"base": 0, "mine": 0}

    def epoch(loader, key):
        def run():
            for _x, y in loader:
                counted[key] += len(y)
        return run

    fa, fb = epoch(base, "base"), epoch(mine, "mine")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same CPU budget on every machine, so the ratio means the same everywhere
    try:
        ab = bench.compare(fa, lambda: call_student("iterating PackedLoader", fb), device="cpu", rounds=5, warmup=1)
    finally:
        torch.set_num_threads(threads)
    n = len(paths)
    require(counted["mine"] == counted["base"] == 6 * n, f"the timed epochs yielded {counted['mine']} samples, "
            f"expected {6 * n}")
    tiers = LOADER_TIERS[ctx.hardware]
    frac = tiers.fraction(ab.ratio)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2),
         "baseline_samples_per_s": round(n / ab.a.median), "packed_samples_per_s": round(n / ab.b.median),
         "tiers": tiers.describe(), "rounds": len(ab.ratios)}
    if frac == 0:
        raise CheckFailed(f"packed loader is {ab.ratio:.2f}x the PIL file loader, below the first tier "
                          f"({tiers.describe()})", **m)
    return {"fraction": frac, "message": f"packed loader: {ab.ratio:.1f}x the PIL file loader "
                                         f"({m['packed_samples_per_s']} vs {m['baseline_samples_per_s']} samples/s)",
            "measurements": m}


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def _wait_share(loader, steps: int) -> tuple[float, list[float], list[float]]:
    """Share of step time spent in next(loader) while a small CNN trains on one CPU thread."""
    torch.manual_seed(0)
    model = _SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    it = iter(loader)
    box = {}

    def fetch():
        box["b"] = next(it)

    def train():
        x, y = box["b"]
        loss = F.cross_entropy(model(x), y % 10)
        opt.zero_grad()
        loss.backward()
        opt.step()

    waits, steps_t = [], []
    for s in range(steps + 2):
        w = bench.time_fn(fetch, warmup=0, repeats=1).median
        t = bench.time_fn(train, warmup=0, repeats=1).median
        if s >= 2:  # the first batches pay start-up costs (file opens, mmap faults)
            waits.append(w)
            steps_t.append(t)
    return sum(waits) / (sum(waits) + sum(steps_t)), waits, steps_t


def check_data_wait(mod, ctx) -> dict:
    paths, img, labels = _dataset(ctx)
    out = _pack(mod, ctx, paths, labels)
    bs = 64
    _gate(mod, ctx, out, img, bs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = min(len(paths) // bs - 2, 12)
        mine = _loader(mod, out, bs, shuffle=True, augment=True, seed=0, drop_last=True)
        share, waits, st = call_student("iterating PackedLoader", _wait_share, mine, steps)
        base_share, bw, _ = _wait_share(baseline_loader(paths, labels.tolist(), bs), steps)
    finally:
        torch.set_num_threads(threads)
    m = {"data_wait_share": round(share, 3), "pil_loader_data_wait_share": round(base_share, 3),
         "median_wait_ms": round(1e3 * statistics.median(waits), 3),
         "median_step_ms": round(1e3 * statistics.median(st), 3), "limit": MAX_DATA_WAIT}
    require(share <= MAX_DATA_WAIT, f"{share:.0%} of each training step waits for data (limit "
            f"{MAX_DATA_WAIT:.0%}; the PIL file loader: {base_share:.0%})", **m)
    return {"message": f"{share:.1%} of step time waiting for data (PIL file loader: {base_share:.0%})",
            "measurements": m}

"""Week 4's exercises (data loading): the checks behind the notebook's self-check cells.

4.2 builds a DataLoader with workers, pinned memory, persistent workers, a prefetch depth and seeded workers; it
is checked by running it (every sample exactly once per epoch, the same batches as the serial loader, the same
worker processes in both epochs, reproducible per-worker random draws) and by reading its settings.
4.4 is a one-ahead host-to-device prefetcher on a side stream. On a CPU the check runs it (values, order, that
batch i+1 is fetched before batch i is handed over) and reads the CUDA branch's source for the pinned,
non-blocking, side-stream calls; on a GPU it also watches each copy (pinned source, non_blocking, not on the
consumer's stream) and the record_stream call.
4.6 augments a uint8 batch on its device (random crop with zero padding, horizontal flip); each output image is
decoded back to its crop offsets and flip, checked pixel for pixel, and their distribution is compared with
torchvision's RandomCrop + RandomHorizontalFlip decoded the same way.
4.7 is a dynamic-padding collate_fn and 4.8 a length-bucketing batch sampler, checked against labkit.bucketing
(`pad_collate`, `index_waste`, `BucketBatchSampler`).
The references are built on labkit.data, labkit.bucketing and torch.
"""

from __future__ import annotations

import inspect
import os
import random
import textwrap

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from labkit import bucketing as B
from labkit import data as D
from labkit import exercises as ex

# ------------------------------------------------------------------------------- 4.2 the DataLoader

PREFETCH = 4  # batches each worker prepares ahead, as the ladder's `loader` rung sets it


class _Probe(torch.utils.data.Dataset):
    """Item i: (i, the worker's pid, a NumPy draw, a Python `random` draw, a torch draw) - what a loader check
    needs to see which process served which sample and whether the workers' random streams are seeded."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (torch.tensor(i), torch.tensor(os.getpid()), torch.tensor(int(np.random.randint(2**31))),
                torch.tensor(random.random(), dtype=torch.float64), torch.rand((), dtype=torch.float64))


def _seed_from_torch(worker_id: int) -> None:
    # DataLoader gives each worker its own torch seed (base seed + worker id); NumPy and `random` follow it,
    # so a custom transform drawing from them is reproducible per worker too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _ref_loader():
    def make_loader(dataset, batch_size: int, num_workers: int, seed: int):
        kw = {}
        if num_workers > 0:
            kw = dict(persistent_workers=True, prefetch_factor=PREFETCH, worker_init_fn=_seed_from_torch)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                                           pin_memory=torch.cuda.is_available(),
                                           generator=torch.Generator().manual_seed(seed), **kw)

    return make_loader


def _epochs(loader, n_epochs: int) -> list[dict]:
    """Per epoch: the index order, which pid served each index, and each index's draws."""
    out = []
    for _ in range(n_epochs):
        order, pids, draws, pinned = [], {}, {}, []
        for batch in loader:
            if not (isinstance(batch, list | tuple) and len(batch) == 5):
                raise AssertionError(f"a batch should be the default collate's list of 5 tensors (index, pid, three "
                                     f"draws), got {type(batch).__name__}: keep collate_fn the default")
            idx, pid, npd, pyd, td = batch
            pinned.append(bool(idx.is_pinned()) if torch.cuda.is_available() else None)
            for i, p, a, b, c in zip(idx.tolist(), pid.tolist(), npd.tolist(), pyd.tolist(), td.tolist(), strict=True):
                order.append(i)
                pids[i] = p
                draws[i] = (a, b, c)
        out.append({"order": order, "pids": pids, "draws": draws, "pinned": pinned})
    return out


def _close(loader) -> None:
    # a persistent loader keeps its workers until its iterator goes: stop them now, not at interpreter exit
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _check_settings(loader, workers: int, batch_size: int) -> None:
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise AssertionError(f"make_loader should return a torch.utils.data.DataLoader, got {type(loader).__name__}")
    cuda = torch.cuda.is_available()
    want = {"batch_size": batch_size, "num_workers": workers, "pin_memory": cuda,
            "persistent_workers": workers > 0, "prefetch_factor": PREFETCH if workers > 0 else None}
    for key, w in want.items():
        got = getattr(loader, key)
        if got != w:
            why = {"pin_memory": "pin only where there is a GPU to copy to: pin_memory=torch.cuda.is_available()",
                   "persistent_workers": "keep workers alive between epochs when there are any (not with 0 workers, "
                                         "which DataLoader refuses)",
                   "prefetch_factor": f"{PREFETCH} batches ahead per worker; leave it None with 0 workers"}.get(key, "")
            raise AssertionError(f"with num_workers={workers}: loader.{key} is {got!r}, want {w!r}. {why}")
    if workers > 0 and loader.worker_init_fn is None:
        raise AssertionError("worker_init_fn is None: pass a function that seeds `random` and NumPy in each worker")
    if loader.generator is None:
        raise AssertionError("no generator: shuffle with generator=torch.Generator().manual_seed(seed), so that the "
                             "order (and the workers' base seed) follow `seed`")


def _check_worker_init(fn) -> None:
    """The student's worker_init_fn, called here in-process, seeds NumPy and `random` from torch.initial_seed()."""
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        torch.manual_seed(123_456_789)
        fn(0)
        got_np, got_py = np.random.random(), random.random()
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
    if got_np != np.random.RandomState(123_456_789).random() or got_py != random.Random(123_456_789).random():
        raise AssertionError("after torch.manual_seed(s), your worker_init_fn should leave NumPy and `random` seeded "
                             "with torch.initial_seed() % 2**32 (PyTorch's reproducibility recipe): inside a worker "
                             "that is the worker's own seed")


@ex.exercise("4.2", "a DataLoader with workers, pinned memory and seeded workers", reference=_ref_loader)
def check_loader(make_loader) -> str:
    """Serial and 2-worker loaders over 64 probe items, two epochs each: exactly once, same order, same workers."""
    n, bs, w = 64, 8, 2
    ds = _Probe(n)
    serial = make_loader(ds, bs, 0, 0)
    _check_settings(serial, 0, bs)
    ref = _epochs(serial, 2)
    for e, ep in enumerate(ref):
        if sorted(ep["order"]) != list(range(n)):
            raise AssertionError(f"serial loader, epoch {e}: not every sample exactly once "
                                 f"({len(ep['order'])} samples, {len(set(ep['order']))} distinct of {n})")
    if ref[0]["order"] == list(range(n)) or ref[0]["order"] == ref[1]["order"]:
        raise AssertionError("the order should be shuffled, and differ from one epoch to the next (shuffle=True)")
    if _epochs(make_loader(ds, bs, 0, 1), 1)[0]["order"] == ref[0]["order"]:
        raise AssertionError("seed 1 gave the same order as seed 0: seed the loader's generator with `seed`")
    runs = []
    for _ in range(2):  # two fresh loaders, same seed: the workers' draws must repeat
        loader = make_loader(ds, bs, w, 0)
        try:
            _check_settings(loader, w, bs)
            runs.append(_epochs(loader, 2))
        finally:
            _close(loader)
    _check_worker_init(loader.worker_init_fn)
    par = runs[0]
    # Epoch 0 only: each new iterator draws its workers' base seed from the same generator after the sampler's
    # draw, so a serial loader (a new iterator per epoch) and a persistent one (one iterator) part ways at epoch 1.
    if par[0]["order"] != ref[0]["order"]:
        raise AssertionError(f"epoch 0: the {w}-worker loader's order differs from the serial loader's with the "
                             "same seed; the sampler (and its generator), not the workers, decides the order")
    if sorted(par[1]["order"]) != list(range(n)) or par[1]["order"] == par[0]["order"]:
        raise AssertionError(f"epoch 1 of the {w}-worker loader: want every sample once, in a new order")
    pids = [set(ep["pids"].values()) for ep in par]
    if os.getpid() in pids[0] or len(pids[0]) != w:
        raise AssertionError(f"the samples came from processes {sorted(pids[0])}: want {w} worker processes, "
                             "not the main one")
    if pids[0] != pids[1]:
        raise AssertionError("epoch 1 was served by new worker processes: persistent_workers=True keeps them")
    if any(par[e]["draws"] != runs[1][e]["draws"] for e in range(2)):
        raise AssertionError("two loaders with the same seed gave different random draws in their workers: seed "
                             "the generator, and seed NumPy/random from torch.initial_seed() in worker_init_fn")
    by_worker = {}
    for i, p in par[0]["pids"].items():
        by_worker.setdefault(p, []).append(par[0]["draws"][i][0])
    if len({tuple(sorted(v)[:3]) for v in by_worker.values()}) < w:
        raise AssertionError("the workers drew the same NumPy numbers: each worker needs its own seed")
    if torch.cuda.is_available() and not all(par[0]["pinned"]):
        raise AssertionError("with CUDA here, the batches should arrive pinned (pin_memory=True)")
    pin = "batches pinned" if torch.cuda.is_available() else "pinning not exercised (no CUDA here)"
    return (f"{n} samples exactly once per epoch, the serial order with {w} workers, the same {w} worker processes "
            f"in both epochs, reproducible per-worker draws; {pin}")


# ------------------------------------------------------------------------- 4.4 the side-stream copy


class _Ref4Prefetcher:
    """labkit's one-ahead prefetcher: batch i+1's copy is issued (on a side stream on CUDA) before batch i is
    handed over; the consumer's stream waits for the copy and the device tensors are recorded on it."""

    def __init__(self, batches, device):
        self.src, self.dev = iter(batches), torch.device(device)
        self.side = torch.cuda.Stream(self.dev) if self.dev.type == "cuda" else None
        self.ahead = self._issue()

    def _issue(self):
        host = next(self.src, None)
        if host is None:
            return None
        if self.side is None:
            return tuple(t.to(self.dev) for t in host)
        with torch.cuda.stream(self.side):
            return tuple(t.pin_memory().to(self.dev, non_blocking=True) for t in host)

    def __iter__(self):
        return self

    def __next__(self):
        ready = self.ahead
        if ready is None:
            raise StopIteration
        if self.side is not None:
            consumer = torch.cuda.current_stream(self.dev)
            consumer.wait_stream(self.side)
            for t in ready:  # allocated on the side stream, used on the consumer's: keep it until that is done
                t.record_stream(consumer)
        self.ahead = self._issue()
        return ready


def _ref_prefetch():
    return _Ref4Prefetcher


class _Counted:
    """An iterable of batches that counts how many have been taken from it."""

    def __init__(self, batches):
        self.batches, self.taken = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.taken += 1
            yield b


_COPY_NAMES = {"to", "cuda", "copy_"}


class _WatchCopies(TorchFunctionMode):
    """Records each host-to-CUDA copy (pinned source?, non_blocking?, on the default stream?) and record_stream."""

    def __init__(self):
        super().__init__()
        self.copies, self.recorded = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name == "record_stream":
            self.recorded += 1
        elif name in _COPY_NAMES and args and isinstance(out, torch.Tensor) and out.is_cuda:
            src = args[1] if name == "copy_" else args[0]
            if isinstance(src, torch.Tensor) and not src.is_cuda:
                nb = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
                side = torch.cuda.current_stream() != torch.cuda.default_stream()
                self.copies.append((bool(src.is_pinned()), bool(nb), side))
        return out


def _source_calls(fn) -> list[str]:
    """What a CUDA prefetcher must call that its source does not mention."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return []  # no source to read (built in a string): the run checks are all there is
    need = {"a side stream (torch.cuda.Stream)": ("cuda.Stream",), "pinned host memory (.pin_memory())": ("pin_memory",),
            "an asynchronous copy (non_blocking=True)": ("non_blocking=True",),
            "the consumer waiting for the copy (wait_stream or wait_event)": ("wait_stream", "wait_event"),
            "record_stream on the consumer's stream": ("record_stream",)}
    return [what for what, words in need.items() if not any(w in src for w in words)]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


def _run_prefetch(to_device_ahead, device: str, n: int) -> None:
    batches = _batches(n)
    src = _Counted(batches)
    got = []
    for i, b in enumerate(to_device_ahead(src, device)):
        if i < n - 1 and src.taken < i + 2:
            raise AssertionError(f"when batch {i} was handed over only {src.taken} batches had been taken from the "
                                 f"source: issue batch {i + 1}'s copy first, then yield batch {i} (one ahead)")
        got.append(b)
    if len(got) != n:
        raise AssertionError(f"{n} batches in, {len(got)} out")
    for i, (b, want) in enumerate(zip(got, batches, strict=True)):
        if not isinstance(b, tuple | list) or len(b) != len(want):
            raise AssertionError(f"batch {i}: yield a tuple of {len(want)} tensors (x, y), got {type(b).__name__}")
        for t, w in zip(b, want, strict=True):
            if t.device.type != torch.device(device).type or not torch.equal(t.cpu(), w):
                raise AssertionError(f"batch {i}: a tensor on {t.device} or with other values than the source's "
                                     f"(want the same values on {device}, in order)")


@ex.exercise("4.4", "copy the next batch to the device on a side stream", reference=_ref_prefetch)
def check_prefetch(to_device_ahead) -> str:
    """Runs on the CPU (values, order, one ahead), reads the source; on a GPU also watches the copies."""
    for n in (0, 1, 6):
        _run_prefetch(to_device_ahead, "cpu", n)
    missing = _source_calls(to_device_ahead)
    if missing:
        raise AssertionError("the CUDA path is missing " + "; ".join(missing) + ". On CUDA: copy inside "
                             "`with torch.cuda.stream(side):`, then torch.cuda.current_stream().wait_stream(side) "
                             "and t.record_stream(torch.cuda.current_stream()) before handing t over")
    if not torch.cuda.is_available():
        return ("values, order and one-ahead prefetch right on the CPU, the CUDA calls present in the source; "
                "skipped without CUDA: the copies' pinned source, non_blocking flag and side stream, and "
                "record_stream, watched as they run")
    _run_prefetch(to_device_ahead, "cuda", 6)
    with _WatchCopies() as w:
        for b in to_device_ahead(_batches(6), "cuda"):
            (b[0] * 2).sum()  # the consumer uses each batch on its own stream
    torch.cuda.synchronize()
    if len(w.copies) < 12:
        raise AssertionError(f"saw {len(w.copies)} host-to-device copies for 6 batches of 2 tensors: copy each with "
                             ".to(device, non_blocking=True)")
    if not all(p for p, _, _ in w.copies):
        raise AssertionError("a copy came from pageable memory: .pin_memory() the host tensor first")
    if not all(nb for _, nb, _ in w.copies):
        raise AssertionError("a copy ran with non_blocking=False: the host waited for it")
    if not all(s for _, _, s in w.copies):
        raise AssertionError("a copy was issued on the default stream: issue it inside `with torch.cuda.stream(side):`")
    if w.recorded < 12:
        raise AssertionError(f"record_stream called {w.recorded} times for 12 device tensors: call it on each")
    return "values, order and one-ahead prefetch right on the CPU and CUDA; every copy pinned, non_blocking, on a side stream"


# --------------------------------------------------------------------------- 4.6 augmentation on the device

PAD4 = 4  # pixels of zero padding around each image before the random crop (torchvision's RandomCrop padding=4)


def _ref_augment():
    def augment_on_device(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return D.augment_batch(x, generator, pad=PAD4)

    return augment_on_device


def _coded(b: int, size: int = 32, device="cpu") -> torch.Tensor:
    """uint8 images whose channel 0 is row + 1, channel 1 column + 1 and channel 2 the image's number + 1 (mod
    250): after a crop and flip, each output pixel says where it came from (0: padding)."""
    r = torch.arange(1, size + 1, dtype=torch.uint8)
    x = torch.empty(b, 3, size, size, dtype=torch.uint8)
    x[:, 0] = r[:, None]
    x[:, 1] = r[None, :]
    x[:, 2] = (torch.arange(b) % 250 + 1).to(torch.uint8)[:, None, None]
    return x.to(device)


def _decode_crops(out: torch.Tensor, pad: int = PAD4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(oy, ox, flip) per image of an augmented `_coded` batch, each offset in 0..2*pad; raises where an image
    is no crop-and-flip of its padded original."""
    out = out.cpu().long()
    b, _, h, w = out.shape
    rows = out[:, 0].amax(2)  # (B, H): row + 1 of each output row, 0 for a padded row
    cols = out[:, 1].amax(1)  # (B, W)
    oy = torch.full((b,), -1)
    ox = torch.full((b,), -1)
    flip = torch.zeros(b, dtype=torch.bool)
    ar = torch.arange(h)
    for k in range(b):
        rk, ck = rows[k], cols[k]
        real_r, real_c = rk > 0, ck > 0
        if real_r.sum() < h - 2 * pad or real_c.sum() < w - 2 * pad:
            raise AssertionError(f"image {k}: fewer than {h - 2 * pad} rows or columns of the original are left; a "
                                 f"crop of a {pad}-pixel zero padding keeps at least that many")
        cand = rk[real_r] - 1 - ar[real_r] + pad
        if not (cand == cand[0]).all():
            raise AssertionError(f"image {k}: its rows are not consecutive rows of the padded image (a crop keeps "
                                 "them in order, no vertical flip)")
        ccol, arc = ck[real_c] - 1, torch.arange(w)[real_c]
        fwd, back = ccol - arc + pad, ccol + arc - (w - 1) + pad
        if (fwd == fwd[0]).all():
            ox[k], flip[k] = fwd[0], False
        elif (back == back[0]).all():
            ox[k], flip[k] = back[0], True
        else:
            raise AssertionError(f"image {k}: its columns are neither a crop nor a mirrored crop of the padded image")
        oy[k] = cand[0]
    if (oy < 0).any() or (oy > 2 * pad).any() or (ox < 0).any() or (ox > 2 * pad).any():
        raise AssertionError(f"a crop offset outside 0..{2 * pad}: crop a window of the padded image")
    return oy, ox, flip


def _crop_flip(x: torch.Tensor, oy, ox, flip, pad: int = PAD4) -> torch.Tensor:
    """The batch cropped at (oy, ox) from its zero-padded copy and mirrored where `flip`, image by image."""
    xp = torch.nn.functional.pad(x.cpu(), (pad, pad, pad, pad))
    h, w = x.shape[-2:]
    out = torch.stack([xp[k, :, int(oy[k]):int(oy[k]) + h, int(ox[k]):int(ox[k]) + w] for k in range(len(x))])
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


class _CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _torchvision_crops(n: int) -> tuple[set, set, float]:
    """The offsets and flip share torchvision's CPU transform draws, decoded as the student's output is."""
    from torchvision import transforms as T

    tf = T.Compose([T.RandomCrop(32, padding=PAD4), T.RandomHorizontalFlip()])
    state = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        x = _coded(n)
        oy, ox, flip = _decode_crops(torch.stack([tf(img) for img in x]))
    finally:
        torch.set_rng_state(state)
    return set(oy.tolist()), set(ox.tolist()), float(flip.float().mean())


def _one_device(fn, dev: torch.device) -> None:
    n = 2048
    x = _coded(n, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    state = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
    out = fn(x, g)
    after = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise AssertionError(f"want a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}, got "
                             + (f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
                                else type(out).__name__))
    if not torch.equal(state, after):
        raise AssertionError("the global RNG moved: draw every random number from `generator`")
    oy, ox, flip = _decode_crops(out)
    want = _crop_flip(x, oy, ox, flip)
    bad = (want != out.cpu()).flatten(1).any(1).nonzero().flatten().tolist()
    if bad:
        raise AssertionError(f"images {bad[:5]}: right offsets and flip, other pixels (the padding must be zeros, and "
                             "each image must stay in its place in the batch)")
    ty, tx, tflip = _torchvision_crops(400)
    for name, got, tv in (("vertical", oy, ty), ("horizontal", ox, tx)):
        counts = torch.bincount(got, minlength=2 * PAD4 + 1)
        if set(got.tolist()) != tv or counts.min() < n / len(tv) * 0.6:
            raise AssertionError(f"{name} offsets drawn {counts.tolist()} times over 0..{2 * PAD4} in {n} images; "
                                 f"torchvision's RandomCrop draws them uniformly over {sorted(tv)}")
    share = float(flip.float().mean())
    if abs(share - 0.5) > 0.06:
        raise AssertionError(f"{share:.1%} of images flipped (torchvision's RandomHorizontalFlip: 50%, here "
                             f"{tflip:.0%} of 400)")
    again = fn(x, torch.Generator(device=dev).manual_seed(0))
    other = fn(x, torch.Generator(device=dev).manual_seed(1))
    if not torch.equal(again, out) or torch.equal(other, out):
        raise AssertionError("the same generator seed should give the same batch, another seed another one")


@ex.exercise("4.6", "random crop and flip of a uint8 batch on its device", reference=_ref_augment)
def check_augment(augment_on_device) -> str:
    """2,048 coded images per device: crops decoded and checked pixel for pixel, offsets' and flips' distribution
    against torchvision's transform, seeded, and the number of torch calls independent of the batch size."""
    devs = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for dev in devs:
        _one_device(augment_on_device, dev)
    calls = []
    for b in (8, 256):
        with _CountCalls() as c:
            augment_on_device(_coded(b), torch.Generator().manual_seed(0))
        calls.append(c.n)
    if calls[1] > calls[0]:
        raise AssertionError(f"{calls[0]} torch calls for 8 images, {calls[1]} for 256: a Python loop over images. "
                             "Draw all offsets at once and crop with one gather (advanced indexing)")
    where = " and ".join(d.type for d in devs)
    return (f"every crop and flip right on {where}, offsets uniform over 0..{2 * PAD4} and half the images flipped "
            f"as torchvision draws them, seeded, {calls[0]} torch calls whatever the batch size"
            + ("" if torch.cuda.is_available() else "; the GPU run skipped (no CUDA here)"))


# ------------------------------------------------------------------------------ 4.7 dynamic padding


def _ref_collate():
    def pad_to_longest(seqs):
        b = B.pad_collate(list(seqs))
        return b.tokens, b.segments > 0

    return pad_to_longest


def _small_corpus():
    return B.synthetic_corpus(n=600, seed=3, median_len=20, max_len=200)


@ex.exercise("4.7", "a collate_fn that pads to the longest in the batch", reference=_ref_collate)
def check_collate(pad_to_longest) -> str:
    """Batches of a long-tailed corpus against labkit.bucketing.pad_collate, and an epoch's padding waste
    through a DataLoader against labkit.bucketing.index_waste."""
    corpus = _small_corpus()
    seqs = [torch.from_numpy(s) for s in corpus.seqs]
    cases = [[seqs[0]], [seqs[1], seqs[1].clone()], seqs[:7], [seqs[i] for i in (5, 2, 9)]]
    for batch in cases:
        got = pad_to_longest(batch)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise AssertionError(f"return (tokens, mask), got {type(got).__name__}")
        tokens, mask = got
        want = B.pad_collate(batch)
        lens = [len(s) for s in batch]
        if tuple(tokens.shape) != tuple(want.tokens.shape):
            raise AssertionError(f"lengths {lens}: tokens of shape {tuple(tokens.shape)}, want "
                                 f"{tuple(want.tokens.shape)} (batch size x the longest in this batch)")
        if tokens.dtype != torch.int64 or mask.dtype != torch.bool or mask.shape != tokens.shape:
            raise AssertionError(f"want int64 tokens and a bool mask of the same shape, got {tokens.dtype} and "
                                 f"{mask.dtype} {tuple(mask.shape)}")
        if not torch.equal(mask, want.segments > 0):
            raise AssertionError(f"lengths {lens}: the mask should be True on each row's first len(seq) tokens only")
        if not torch.equal(tokens, want.tokens):
            raise AssertionError(f"lengths {lens}: tokens differ; copy each sequence to the start of its row and fill "
                                 f"the rest with the pad id {B.PAD}")
    sampler = D.EpochSampler(len(corpus), 0)
    loader = torch.utils.data.DataLoader(B.TokenDataset(corpus), batch_size=32, sampler=sampler,
                                         collate_fn=pad_to_longest)
    real = total = 0
    for _tokens, mask in loader:
        real += int(mask.sum())
        total += mask.numel()
    order = D.epoch_order(len(corpus), 0, 0).tolist()
    want = B.index_waste([order[i:i + 32] for i in range(0, len(order), 32)], corpus.lengths)
    got = 1 - real / total
    if abs(got - want) > 1e-12:
        raise AssertionError(f"an epoch through DataLoader(collate_fn=pad_to_longest) wastes {got:.2%} in padding, "
                             f"labkit's index_waste of the same batches {want:.2%}")
    corpus_max = B.index_waste([order[i:i + 32] for i in range(0, len(order), 32)], corpus.lengths,
                               pad_to=int(corpus.lengths.max()))
    return (f"same tokens and mask as labkit's pad_collate; an epoch's padding waste {got:.1%}, as index_waste "
            f"says (padding to the corpus maximum: {corpus_max:.1%})")


# --------------------------------------------------------------------------------- 4.8 length bucketing


def _ref_bucket():
    def bucket_batches(lengths, batch_size: int, seed: int, epoch: int, chunk_batches: int = 64):
        return B.BucketBatchSampler(lengths, batch_size, seed, chunk_batches).batches(epoch)

    return bucket_batches


def _batch_list(got, what: str) -> list[list[int]]:
    if not isinstance(got, list | tuple) or not all(isinstance(b, list | tuple) for b in got):
        raise AssertionError(f"{what}: return a list of batches, each a list of indices")
    return [[int(i) for i in b] for b in got]


@ex.exercise("4.8", "a length-bucketing batch sampler", reference=_ref_bucket)
def check_bucket(bucket_batches) -> str:
    """On a long-tailed corpus: every index once, full batches, seeded per epoch, padding waste near
    labkit's BucketBatchSampler's, batches in random order, chunks that bound the sorting."""
    lengths = B.synthetic_corpus(n=3000, seed=5).lengths
    n, bs = len(lengths), 32
    eps = []
    for e in (0, 1):
        bat = _batch_list(bucket_batches(lengths, bs, 0, e), f"epoch {e}")
        flat = sorted(i for b in bat for i in b)
        if flat != list(range(n)):
            raise AssertionError(f"epoch {e}: {len(flat)} indices, {len(set(flat))} distinct, want each of {n} once")
        short = [len(b) for b in bat if len(b) != bs]
        if len(short) > 1 or any(s > bs for s in short):
            raise AssertionError(f"epoch {e}: batches of sizes {sorted(set(len(b) for b in bat))}; want {bs}, at "
                                 "most one smaller (the last of a chunk)")
        eps.append(bat)
    if _batch_list(bucket_batches(lengths, bs, 0, 0), "again") != eps[0]:
        raise AssertionError("the same (seed, epoch) gave other batches: draw from a generator seeded by both")
    if eps[0] == eps[1]:
        raise AssertionError("epoch 1 repeats epoch 0's batches: seed the shuffle with the epoch too")
    mine = B.index_waste(eps[0], lengths)
    ref = B.index_waste(B.BucketBatchSampler(lengths, bs, 0).batches(0), lengths)
    order = D.epoch_order(n, 0, 0).tolist()
    rand = B.index_waste([order[i:i + bs] for i in range(0, n, bs)], lengths)
    if mine > max(1.5 * ref, ref + 0.03):
        raise AssertionError(f"padding waste {mine:.1%}, labkit's BucketBatchSampler {ref:.1%} (random batches "
                             f"{rand:.1%}): sort each chunk of batch_size * chunk_batches indices by length")
    means = [float(lengths[b].mean()) for b in eps[0]]
    rising = float(np.mean(np.diff(means) > 0))
    if not 0.3 <= rising <= 0.7:
        raise AssertionError(f"{rising:.0%} of consecutive batches are longer than the one before: shuffle the "
                             "batches' order, or every epoch goes short to long")
    one = B.index_waste(_batch_list(bucket_batches(lengths, bs, 0, 0, chunk_batches=1), "chunk_batches=1"), lengths)
    if one < rand - 0.1:
        raise AssertionError(f"chunk_batches=1 wastes {one:.1%}, random batches {rand:.1%}: with one batch per chunk "
                             "sorting inside the chunk should change nothing; sort within chunks, not the whole epoch")
    return (f"every index once per epoch, seeded per epoch; padding waste {mine:.1%} (labkit's "
            f"BucketBatchSampler {ref:.1%}, random batches {rand:.1%}), batches in random order")


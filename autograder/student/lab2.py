"""Lab 2 probes: drive the student's packer, loader and sampler on inputs the trusted side sends.

The student's file defines `pack(image_paths, labels, out_dir)`, `PackedLoader(out_dir, batch_size, *,
shuffle, augment, seed, drop_last)` and `BucketSampler(lengths, batch_size, *, seed)`. The baseline is the
textbook path, public because students start from it: one PNG file per image decoded by PIL in
`__getitem__`, torchvision's RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor and Normalize per
sample, batched by a DataLoader.

Each scenario takes the loader (or sampler class) as an argument, so the baseline's process runs the very
same scenario on the PIL loader; a probe only reports observations (tensors, numbers, lists). A timed epoch
returns each sample's label and its dot products with directions the trusted side drew for that request
alone, so the trusted side checks every sample of every timed epoch against its source image without the
images crossing the channel. Seeds, lengths and directions arrive as request parameters at grading time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from autograder.student.probes import call, require

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4
_PACKED_MARK = ".packed-by-check"  # written after pack() returned, so a half-written folder is packed again


def dataset_arrays(n: int = 1024, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The images (uint8 NHWC, n x 32 x 32 x 3: smooth 4x4 blocks plus noise) and labels (0..n-1, int64)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (n, 8, 8, 3)).astype(np.float32)
    img = base.repeat(4, axis=1).repeat(4, axis=2) + rng.normal(0, 12, (n, 32, 32, 3))
    # one label per image, so every output names its source
    return np.clip(img, 0, 255).astype(np.uint8), np.arange(n, dtype=np.int64)


def make_dataset(root: Path, n: int = 1024, seed: int = 0) -> tuple[list[Path], np.ndarray, np.ndarray]:
    """Write n 32x32 RGB PNG files with smooth content and noise; returns (paths, images uint8 NHWC, labels)."""
    from PIL import Image

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    img, labels = dataset_arrays(n, seed)
    paths = []
    for i in range(n):
        p = root / f"{i:05d}.png"
        if not p.exists():
            Image.fromarray(img[i]).save(p)
        paths.append(p)
    return paths, img, labels


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


def baseline_loader(paths, labels, batch_size: int, seed: int = 0, drop_last: bool = False):
    """The PIL image-file loader: shuffled, augmented per sample, one process."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(PILFileDataset(paths, labels), batch_size=batch_size, shuffle=True,
                                       generator=g, num_workers=0, drop_last=drop_last)


def normalize(img_u8: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW normalized like the baseline."""
    x = img_u8.permute(0, 3, 1, 2).float() / 255
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


@contextlib.contextmanager
def one_thread():
    """One intra-op thread while timing: the same CPU budget on every machine, so ratios mean the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- scenarios


def _check_batch(x, y, batch_size: int) -> None:
    require(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 4
            and tuple(x.shape[1:]) == (3, 32, 32),
            f"images must be float32 (B, 3, 32, 32), got {getattr(x, 'dtype', type(x))} "
            f"{tuple(getattr(x, 'shape', ()))}")
    require(isinstance(y, torch.Tensor) and y.dtype == torch.int64 and tuple(y.shape) == (x.shape[0],),
            "labels must be an int64 tensor with one label per image")
    require(x.shape[0] <= batch_size, f"a batch has {x.shape[0]} samples, more than batch_size={batch_size}")


def each_batch(loader, batch_size: int, fn) -> None:
    """Iterate one epoch of the student's loader, checking each (x, y) and handing it to `fn(x, y)`."""
    def run():
        for item in loader:
            require(isinstance(item, (tuple, list)) and len(item) == 2, "each batch must be a pair (x, y)")
            x, y = item
            _check_batch(x, y, batch_size)
            fn(x.detach(), y.detach())

    call("iterating PackedLoader", run)


def full_epoch(loader, batch_size: int) -> dict:
    """One epoch, every image returned: {"x": (N, 3, 32, 32), "y": (N,), "sizes": batch sizes}."""
    xs, ys = [], []
    each_batch(loader, batch_size, lambda x, y: (xs.append(x), ys.append(y)))
    return {"x": torch.cat(xs) if xs else torch.empty(0, 3, 32, 32),
            "y": torch.cat(ys) if ys else torch.empty(0, dtype=torch.int64), "sizes": [len(y) for y in ys]}


def projected_epoch(loader, batch_size: int, proj: torch.Tensor) -> dict:
    """One epoch, each image reduced to its dot products with the rows of `proj` (k, 3*32*32).

    {"y": (N,) labels, "z": (N, k) float32, "sizes": batch sizes}. The directions are new in every request,
    so the values cannot be reused from an earlier epoch; the trusted side knows which values every padded
    crop (and flip) of each source image gives.
    """
    proj = proj.float().contiguous()  # (k, D) @ its transpose view: the fast kernel for a skinny product
    ys, zs = [], []
    each_batch(loader, batch_size, lambda x, y: (zs.append(x.reshape(x.shape[0], -1) @ proj.t()), ys.append(y)))
    return {"y": torch.cat(ys) if ys else torch.empty(0, dtype=torch.int64),
            "z": torch.cat(zs) if zs else torch.empty(0, proj.shape[0]), "sizes": [len(y) for y in ys]}


class SmallCNN(nn.Module):
    """The fixed small model of the data-wait measurement."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def wait_share(loader, steps: int, batch_size: int, proj: torch.Tensor) -> dict:
    """Seconds spent in next(loader) and in a training step of a small CNN, per step, on one CPU thread.

    The first two steps pay start-up costs (file opens, mmap faults) and are not reported. Also returns the
    labels and projections (as in `projected_epoch`) of every batch consumed, so the trusted side can check
    that the batches the model trained on were real.
    """
    from labkit import bench

    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    it = call("iter(PackedLoader)", iter, loader)
    box: dict = {}

    def fetch():
        box["b"] = call("next(iter(PackedLoader))", next, it)

    def train():
        x, y = box["b"]
        loss = F.cross_entropy(model(x), y % 10)
        opt.zero_grad()
        loss.backward()
        opt.step()

    waits, step_s, ys, zs = [], [], [], []
    proj = proj.float().contiguous()
    for s in range(steps + 2):
        w = bench.time_fn(fetch, warmup=0, repeats=1).median
        item = box["b"]
        require(isinstance(item, (tuple, list)) and len(item) == 2, "each batch must be a pair (x, y)")
        _check_batch(item[0], item[1], batch_size)
        t = bench.time_fn(train, warmup=0, repeats=1).median
        ys.append(item[1].detach())
        zs.append(item[0].detach().reshape(len(item[0]), -1) @ proj.t())
        if s >= 2:
            waits.append(w)
            step_s.append(t)
    return {"waits": waits, "steps": step_s, "y": torch.cat(ys), "z": torch.cat(zs), "sizes": [len(y) for y in ys]}


def sampler_run(cls, lengths: list, batch_size: int, seed: int) -> dict:
    """BucketSampler(lengths, batch_size, seed=seed): its first epoch, len(), the same seed again, seed + 1, and
    the first sampler's second epoch, each as lists of int indices."""
    def batches(s):
        return call("iterating BucketSampler", lambda: [[int(i) for i in b] for b in s])

    def make(sd):
        return call(f"BucketSampler(lengths, {batch_size}, seed={sd})", cls, list(lengths), batch_size, seed=sd)

    s = make(seed)
    first = batches(s)
    n_len = call("len(BucketSampler)", len, s)
    again, other = batches(make(seed)), batches(make(seed + 1))
    nxt = call("a second epoch of BucketSampler", lambda: [[int(i) for i in b] for b in s])
    return {"batches": first, "len": n_len, "again": again, "other": other, "next_epoch": nxt}


# ---------------------------------------------------------------------------------------------- probes


def _dataset(p, n: int, seed: int) -> list[Path]:
    """PNG files of the dataset in this process's own folder, written once per process."""
    key = ("lab2.images", n, seed)
    if key not in p.state:
        p.state[key] = make_dataset(Path.cwd() / f"lab2_images_{n}_{seed}", n, seed)[0]
    return p.state[key]


def _packed(p, n: int, seed: int) -> Path:
    """The folder the student's pack() filled with the dataset, packing it on first use."""
    out = Path.cwd() / f"lab2_packed_{n}_{seed}"
    if not (out / _PACKED_MARK).exists():
        paths = _dataset(p, n, seed)
        out.mkdir(exist_ok=True)
        call("pack(image_paths, labels, out_dir)", p.attr("pack"), [str(q) for q in paths], list(range(n)), str(out))
        (out / _PACKED_MARK).touch()
    return out


def _loader(p, params: dict, out: Path):
    bs = int(params["batch_size"])
    kw = {k: params[k] for k in ("shuffle", "augment", "seed", "drop_last")}
    kw["seed"] = int(kw["seed"])
    return call(f"PackedLoader(batch_size={bs}, {', '.join(f'{k}={v}' for k, v in kw.items())})",
                p.attr("PackedLoader"), str(out), bs, **kw)


def probe_pack(p, params: dict) -> dict:
    """Pack the dataset (n, data_seed) with the student's pack(); the packed folder's size."""
    out = _packed(p, int(params["n"]), int(params["data_seed"]))
    files = [q for q in out.rglob("*") if q.is_file() and q.name != _PACKED_MARK]
    return {"packed_files": len(files), "packed_bytes": sum(q.stat().st_size for q in files)}


def probe_epoch(p, params: dict) -> dict:
    """One epoch of the student's PackedLoader with the given options, every image returned."""
    out = _packed(p, int(params["n"]), int(params["data_seed"]))
    return full_epoch(_loader(p, params, out), int(params["batch_size"]))


def timed_epochs(loader, params: dict) -> list[dict]:
    """`epochs` epochs in a row of one new loader, each reduced to projections (see `projected_epoch`)."""
    bs = int(params["batch_size"])
    return [projected_epoch(loader, bs, params["proj"]) for _ in range(int(params["epochs"]))]


def probe_timed_epochs(p, params: dict) -> list[dict]:
    """A timed request: a new PackedLoader (fresh seed) built and iterated for `epochs` epochs, shuffled and
    augmented; its construction is timed too, so no work can move out of the timed region."""
    out = _packed(p, int(params["n"]), int(params["data_seed"]))
    with one_thread():
        return timed_epochs(_loader(p, params, out), params)


def probe_baseline_epochs(p, params: dict) -> list[dict]:
    """The baseline's timed request (PIL files); runs in the baseline's process, never touches p.student."""
    n, bs = int(params["n"]), int(params["batch_size"])
    paths = _dataset(p, n, int(params["data_seed"]))
    with one_thread():
        return timed_epochs(baseline_loader(paths, list(range(n)), bs, int(params["seed"])), params)


def probe_data_wait(p, params: dict) -> dict:
    """Data wait of the student's PackedLoader (drop_last) feeding a small CNN, measured in this process."""
    out = _packed(p, int(params["n"]), int(params["data_seed"]))
    with one_thread():
        loader = _loader(p, {**params, "shuffle": True, "augment": True, "drop_last": True}, out)
        return wait_share(loader, int(params["steps"]), int(params["batch_size"]), params["proj"])


def probe_baseline_data_wait(p, params: dict) -> dict:
    """The same measurement on the PIL file loader, in the baseline's process (never touches p.student)."""
    n, bs = int(params["n"]), int(params["batch_size"])
    paths = _dataset(p, n, int(params["data_seed"]))
    with one_thread():
        loader = baseline_loader(paths, list(range(n)), bs, int(params["seed"]), drop_last=True)
        return wait_share(loader, int(params["steps"]), bs, params["proj"])


def probe_sampler(p, params: dict) -> dict:
    """The student's BucketSampler on the lengths, batch size and seed the trusted side sent."""
    return sampler_run(p.attr("BucketSampler"), [int(v) for v in params["lengths"]], int(params["batch_size"]),
                       int(params["seed"]))

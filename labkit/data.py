"""Image datasets for the course, all as packed uint8 arrays (N, 32, 32, 3) plus int64 labels.

- `synthetic_cifar`: deterministic, learnable, CIFAR-shaped; generated from a seed in seconds, cached on disk.
  Each class is a texture (vertical or horizontal stripes, cross-hatch, checkerboard, rings; wide or fine)
  inside a soft blob at a random place, with random phase, colours, contrast and a weaker distractor
  grating. Random phase and position defeat a linear classifier on raw pixels; a CNN reads texture easily.
  Every class is unchanged by a horizontal flip, so flip augmentation never changes the true label.
- `image_folder`: the same arrays written as PNG files, for the naive PIL loading path.
- `digits32`: scikit-learn's handwritten digits (real data shipped inside the package), upscaled to 32x32 RGB.
- `cifar10`: CIFAR-10 through torchvision when the machine is online, with a clear error when it is not.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.env import LabkitError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CLASSES = [f"{kind}-{f}" for kind in ("vstripes", "hstripes", "crosshatch", "checker", "rings")
           for f in ("wide", "fine")]


@dataclass
class ImageData:
    """Packed image dataset: uint8 images (N, H, W, 3) and int64 labels (N,), train and test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]
    name: str

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def subset(self, n_train: int | None = None, n_test: int | None = None) -> ImageData:
        """The first n_train / n_test samples (generation order is already random)."""
        return ImageData(self.x_train[:n_train], self.y_train[:n_train], self.x_test[:n_test],
                         self.y_test[:n_test], self.classes, self.name)


def cache_dir() -> Path:
    """Where generated data is cached: $LABKIT_DATA, else ~/.cache/labkit."""
    d = Path(os.environ.get("LABKIT_DATA") or Path.home() / ".cache" / "labkit")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _render(labels: np.ndarray, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """Render one image per label; vectorized over the batch. Returns uint8 (N, size, size, 3).

    Every class is invariant under horizontal flips (so flip augmentation keeps labels true): vertical
    stripes, horizontal stripes, diagonal cross-hatch, checkerboard and concentric rings, each wide or fine.
    """
    n = len(labels)
    yy, xx = np.meshgrid(np.arange(size, dtype=np.float32), np.arange(size, dtype=np.float32), indexing="ij")
    yy, xx = yy[None], xx[None]

    def col(v):
        return np.asarray(v, dtype=np.float32)[:, None, None]

    def wave(theta, freq, phase, cy=None, cx=None):
        u = np.cos(theta)[:, None, None] * xx + np.sin(theta)[:, None, None] * yy
        return np.sin(2 * np.pi * col(freq) * u + col(phase))

    kind, fine = labels // 2, labels % 2
    freq = np.where(fine == 1, rng.uniform(0.24, 0.30, n), rng.uniform(0.09, 0.13, n)).astype(np.float32)
    jitter = rng.normal(0, 0.05, n)
    cy, cx = rng.uniform(10, 22, n), rng.uniform(10, 22, n)
    p1, p2 = rng.uniform(0, 2 * np.pi, n), rng.uniform(0, 2 * np.pi, n)
    vert = wave(jitter, freq, p1)
    horiz = wave(np.pi / 2 + jitter, freq, p1)
    hatch = 0.5 * (wave(np.pi / 4 + jitter, freq, p1) + wave(-np.pi / 4 + jitter, freq, p2))
    checker = 2 * wave(jitter, freq / 1.4, p1) * wave(np.pi / 2 + jitter, freq / 1.4, p2)
    r = np.sqrt((yy - col(cy)) ** 2 + (xx - col(cx)) ** 2)
    rings = np.sin(2 * np.pi * col(freq) * r + col(p1))
    k = kind[:, None, None]
    signal = np.select([k == 0, k == 1, k == 2, k == 3], [vert, horiz, hatch, checker], rings).clip(-1, 1)

    def blob(cy, cx, rad):
        return np.exp(-((yy - col(cy)) ** 2 + (xx - col(cx)) ** 2) / (2 * col(rad) ** 2))

    mask = blob(cy, cx, rng.uniform(8, 12, n))
    # Distractor: a weaker plain grating of random orientation and frequency at another random place.
    d_sig = wave(rng.uniform(0, np.pi, n), rng.uniform(0.08, 0.32, n), rng.uniform(0, 2 * np.pi, n))
    d_mask = 0.3 * blob(rng.uniform(4, 28, n), rng.uniform(4, 28, n), rng.uniform(4, 7, n))

    fg = rng.uniform(0, 1, (n, 1, 1, 3)).astype(np.float32)
    fg2 = rng.uniform(0, 1, (n, 1, 1, 3)).astype(np.float32)
    bg = rng.uniform(0.2, 0.8, (n, 1, 1, 3)).astype(np.float32)
    contrast = rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    tex = (signal[..., None] * 0.5 + 0.5) * fg + (0.5 - signal[..., None] * 0.5) * fg2
    img = bg + contrast * mask[..., None] * (tex - bg)
    img = img + d_mask[..., None] * (d_sig[..., None] * 0.5)
    img = img + rng.normal(0, 0.06, img.shape).astype(np.float32)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def synthetic_cifar(n_train: int = 50_000, n_test: int = 10_000, seed: int = 0, cache: bool = True) -> ImageData:
    """The course's synthetic CIFAR-shaped dataset (10 classes, 32x32 RGB uint8), cached as .npz.

    Deterministic in (n_train, n_test, seed): the same arguments give the same bytes on every machine.
    """
    if n_train < 1 or n_test < 1:
        raise LabkitError(f"synthetic_cifar needs n_train >= 1 and n_test >= 1 (got {n_train}, {n_test})")
    path = cache_dir() / f"synthetic-cifar-{n_train}-{n_test}-s{seed}-v2.npz"
    if cache and path.exists():
        try:
            with np.load(path) as z:
                return ImageData(z["x_train"], z["y_train"], z["x_test"], z["y_test"], CLASSES, "synthetic")
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # a corrupt cache is regenerated, never trusted
    rng = np.random.default_rng(seed)
    y = np.concatenate([np.arange(n_train + n_test) % 10])
    rng.shuffle(y)
    chunks = [_render(y[i:i + 4096], rng) for i in range(0, len(y), 4096)]
    x = np.concatenate(chunks)
    data = ImageData(x[:n_train], y[:n_train].astype(np.int64), x[n_train:], y[n_train:].astype(np.int64),
                     CLASSES, "synthetic")
    if cache:
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)
        os.replace(tmp, path)
    return data


def digits32(seed: int = 0, test_fraction: float = 0.2) -> ImageData:
    """scikit-learn's 1,797 handwritten digits (8x8, real scans) upscaled to 32x32 RGB uint8; a shipped real set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise LabkitError("the real-data check needs scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    x = torch.nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) * 255 + 0.5).to(torch.uint8).repeat(1, 3, 1, 1).permute(0, 2, 3, 1).numpy()
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * test_fraction)
    te, tr = perm[:n_test], perm[n_test:]
    return ImageData(np.ascontiguousarray(x[tr]), y[tr], np.ascontiguousarray(x[te]), y[te],
                     [str(i) for i in range(10)], "digits")


def cifar10(root: str | os.PathLike | None = None) -> ImageData:
    """CIFAR-10 via torchvision (downloads once into `root`); a clear error when offline."""
    from torchvision.datasets import CIFAR10

    root = Path(root or cache_dir() / "cifar10")
    try:
        tr = CIFAR10(str(root), train=True, download=True)
        te = CIFAR10(str(root), train=False, download=True)
    except Exception as e:  # URLError, socket errors, bad checksums all mean "could not get it"
        raise LabkitError(f"CIFAR-10 could not be downloaded to {root} ({type(e).__name__}); this machine may be "
                          f"offline: use the synthetic dataset (--data synthetic) instead") from e
    return ImageData(tr.data, np.asarray(tr.targets, dtype=np.int64), te.data, np.asarray(te.targets, dtype=np.int64),
                     list(tr.classes), "cifar10")


def load(name: str, n_train: int | None = None, n_test: int | None = None, seed: int = 0) -> ImageData:
    """Dataset by name: 'synthetic', 'digits' or 'cifar10'; n_train/n_test cut it down."""
    if name == "synthetic":
        return synthetic_cifar(n_train or 50_000, n_test or 10_000, seed)
    if name == "digits":
        return digits32(seed).subset(n_train, n_test)
    if name == "cifar10":
        return cifar10().subset(n_train, n_test)
    raise LabkitError(f"unknown dataset {name!r}: choose synthetic, digits or cifar10")


def fingerprint(data: ImageData) -> str:
    """A short content hash of the training split, so cached image folders never go stale."""
    import hashlib

    h = hashlib.sha1(data.x_train[:: max(1, len(data.x_train) // 64)].tobytes())
    h.update(data.y_train.tobytes())
    return h.hexdigest()[:10]


def write_image_folder(data: ImageData, root: str | os.PathLike, split: str = "train", fmt: str = "png") -> Path:
    """Write one split as <root>/<split>/<class index>/<i>.<fmt> image files (skipped if already complete).

    Written to a temporary folder first and renamed, so an interrupted write never looks complete.
    """
    from PIL import Image

    if fmt not in ("png", "jpg", "bmp"):
        raise LabkitError(f"image format must be png, jpg or bmp, not {fmt!r}")
    x, y = (data.x_train, data.y_train) if split == "train" else (data.x_test, data.y_test)
    out = Path(root) / split
    marker = out / f".complete-{len(y)}-{fmt}"
    if marker.exists():
        return out
    tmp = Path(root) / f".{split}.partial{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for c in range(data.num_classes):
        (tmp / str(c)).mkdir(parents=True, exist_ok=True)
    for i in range(len(y)):
        Image.fromarray(x[i]).save(tmp / str(int(y[i])) / f"{i:06d}.{fmt}", quality=95) if fmt == "jpg" else \
            Image.fromarray(x[i]).save(tmp / str(int(y[i])) / f"{i:06d}.{fmt}")
    (tmp / marker.name).touch()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def image_folder_files(root: str | os.PathLike) -> tuple[list[Path], list[int]]:
    """The (path, label) pairs of an image folder written by `write_image_folder`, in index order."""
    root = Path(root)
    if not root.is_dir():
        raise LabkitError(f"dataset folder {root} does not exist: create it with labkit.data.write_image_folder")
    items = []
    for cdir in sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit()):
        items += [(f, int(cdir.name)) for f in cdir.iterdir() if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp")]
    if not items:
        raise LabkitError(f"no image files under {root}/<class>/: is this the right folder?")
    items.sort(key=lambda t: t[0].stem)
    return [p for p, _ in items], [c for _, c in items]


# ------------------------------------------------------------------------------------------- loading paths


class ImageFileDataset(torch.utils.data.Dataset):
    """The naive path: decode one image file with PIL per sample, then per-sample torchvision transforms."""

    def __init__(self, root: str | os.PathLike, augment: bool = True):
        from torchvision import transforms as T

        self.files, self.labels = image_folder_files(root)
        steps = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
        self.transform = T.Compose([*steps, T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(self.files[i]) as im:
                img = im.convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise LabkitError(f"corrupt or unreadable image file {self.files[i]}: delete the folder and let "
                              f"labkit rewrite it (write_image_folder)") from e
        return self.transform(img), self.labels[i]


def to_nchw_uint8(x: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """Packed (N, H, W, 3) uint8 numpy images as a contiguous (N, 3, H, W) uint8 tensor on `device`."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(device).permute(0, 3, 1, 2).contiguous()


def augment_batch(x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding `pad`) and horizontal flip of a uint8 batch (B, C, H, W), on its own device.

    One gather for the whole batch instead of per-sample Python work: this is what makes GPU-side
    augmentation nearly free.
    """
    b, c, h, w = x.shape
    dev = x.device
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=generator)
    flip = torch.rand(b, device=dev, generator=generator) < 0.5
    ar_h = torch.arange(h, device=dev)
    ar_w = torch.arange(w, device=dev)
    cols = ox[:, None] + torch.where(flip[:, None], ar_w.flip(0)[None], ar_w[None])  # flip folded into the gather
    rows = oy[:, None] + ar_h[None]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


_STATS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: torch.tensor(list, device="cuda") is a blocking copy, i.e. a host sync per batch.
    if device not in _STATS:
        _STATS[device] = (torch.tensor(CIFAR_MEAN, dtype=torch.float32).view(1, 3, 1, 1).to(device),
                          torch.tensor(CIFAR_STD, dtype=torch.float32).view(1, 3, 1, 1).to(device))
    return _STATS[device]


def normalize(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 (B, 3, H, W) to normalized floats with the CIFAR mean/std, in `dtype`."""
    # Same arithmetic as torchvision's ToTensor + Normalize, so every loading path gives identical inputs.
    mean, std = _stats(x.device)
    return ((x.float() / 255 - mean) / std).to(dtype)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: identical for every loading path, so their losses can be compared."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


class EpochSampler(torch.utils.data.Sampler):
    """Yields `epoch_order` for the current epoch; call `set_epoch` before each epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        return iter(epoch_order(self.n, self.seed, self.epoch).tolist())

    def __len__(self):
        return self.n

"""Input pipelines for week 4: the configuration, the on-disk image stores, and the loaders that read them.

The same images (a `labkit.data.ImageData` split) stored four ways:

- `folder`: one PNG/JPEG file per image under <class>/<index>.<ext> (`labkit.data.write_image_folder`);
- `packed`: one uint8 array file (N, H, W, 3) plus labels, read through a memory map (`np.load(mmap_mode="r")`);
- `tar`: a WebDataset-layout tar shard (<key>.png / <key>.cls members), written and read with the stdlib tarfile;
- `records`: a single binary file of concatenated encoded images with an (offset, length) index.

`ImageLoader(LoaderConfig, store, device)` reads any of them with any decoder (PIL, torchvision.io on the CPU,
torchvision.io's nvJPEG on a GPU), augments per sample, per batch on the CPU or per batch on the device, and
yields normalized float batches on the device in `labkit.data.epoch_order`. Workers receive whole batches of
indices (one task per batch), and the augmentation of batch b in epoch e is seeded by (seed, e, b), so the
output does not depend on the number of workers. `folder` + `pil` + `per-sample` is exactly the naive path
(`labkit.data.ImageFileDataset` in a DataLoader), the one `labkit.train`'s pil loader uses.

In this file:

- configuration: `LoaderConfig`, `PRESETS` / `preset`, `with_changes`, `resolve_workers`, `check_config`;
- storage: `Store`, `encode_image`, `write_store` (cached under `store_root`), the tar shard index;
- reading: `EpochBatches` (the batch sampler), `BatchReader` (one batch per worker task), `ImageLoader`,
  `to_uint8` (undoes the normalization).

Measuring and reporting loaders is `labkit.loader_bench`: `measure`, `sweep`, `stores`, `format_table`,
`decoder_table`, `model_rates`, the Markdown tables and plots, and the `labkit data` command. It imports this
module, never the other way round.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit import data as D
from labkit.env import LabkitError, pick_device, replace_fields

STORAGES = ("folder", "packed", "tar", "records")
IMAGE_FORMATS = ("png", "jpg")
DECODERS = ("pil", "torchvision", "cuda")
AUGMENTS = ("none", "per-sample", "batched", "on-device")


@dataclass
class LoaderConfig:
    name: str = "custom"                 # label in tables and plots
    storage: str = "packed"              # folder | packed | tar | records (see the module docstring)
    image_format: str = "png"            # encoding inside folder / tar / records: png (lossless) | jpg (quality 95)
    decoder: str = "pil"                 # pil | torchvision (torchvision.io on the CPU) | cuda (nvJPEG on the GPU, jpg only); unused by packed
    augment: str = "batched"             # none | per-sample (torchvision transforms per image) | batched (one gather per batch, in the worker) | on-device (one gather per batch on the training device)
    batch_size: int = 256                # images per batch
    workers: int = 0                     # DataLoader worker processes; -1: one per CPU core, at most 16
    pin_memory: bool = False             # page-locked host batches for asynchronous copies (CUDA only)
    persistent_workers: bool = False     # keep workers alive between epochs (no restart cost per epoch)
    prefetch_factor: int | None = None   # batches each worker prepares ahead (None: torch's default of 2)
    drop_last: bool = False              # drop a final partial batch
    seed: int = 0                        # sample order and augmentation


def with_changes(cfg: LoaderConfig, **changes) -> LoaderConfig:
    """A copy of `cfg` with fields replaced; unknown field names raise a clear error."""
    return replace_fields(cfg, **changes)


PRESETS = {
    "naive": LoaderConfig("naive", storage="folder", decoder="pil", augment="per-sample", batch_size=128, workers=2),
    "naive_tuned": LoaderConfig("naive_tuned", storage="folder", decoder="pil", augment="per-sample",
                                batch_size=128, workers=-1, pin_memory=True, persistent_workers=True,
                                prefetch_factor=4),
    "packed": LoaderConfig("packed", storage="packed", augment="batched", batch_size=256, workers=0),
    "packed_device": LoaderConfig("packed_device", storage="packed", augment="on-device", batch_size=256,
                                  workers=0, pin_memory=True),
    "jpeg_gpu": LoaderConfig("jpeg_gpu", storage="records", image_format="jpg", decoder="cuda",
                             augment="on-device", batch_size=256, workers=2, pin_memory=True,
                             persistent_workers=True),
}


def preset(name: str, **changes) -> LoaderConfig:
    """A named loader configuration (see PRESETS), with optional field overrides."""
    if name not in PRESETS:
        raise LabkitError(f"unknown loader preset {name!r}: choose one of {', '.join(PRESETS)}")
    return with_changes(PRESETS[name], **changes)


def resolve_workers(workers: int) -> int:
    """-1 means one worker per CPU core, at most 16 (as in labkit.train)."""
    return min(16, os.cpu_count() or 1) if workers < 0 else workers


def check_config(cfg: LoaderConfig, device: torch.device) -> None:
    """Reject impossible combinations before anything runs, with the fix in the message."""
    def need(cond, msg):
        if not cond:
            raise LabkitError(f"loader {cfg.name}: {msg}")

    need(cfg.storage in STORAGES, f"storage must be one of {STORAGES}, not {cfg.storage!r}")
    need(cfg.image_format in IMAGE_FORMATS, f"image_format must be one of {IMAGE_FORMATS}, not {cfg.image_format!r}")
    need(cfg.decoder in DECODERS, f"decoder must be one of {DECODERS}, not {cfg.decoder!r}")
    need(cfg.augment in AUGMENTS, f"augment must be one of {AUGMENTS}, not {cfg.augment!r}")
    need(cfg.batch_size >= 1, f"batch_size must be >= 1, not {cfg.batch_size}")
    need(cfg.workers >= -1, f"workers must be >= 0 (or -1 for one per core), not {cfg.workers}")
    need(cfg.prefetch_factor is None or cfg.prefetch_factor >= 1, "prefetch_factor must be >= 1 or None")
    need(cfg.prefetch_factor is None or resolve_workers(cfg.workers) > 0,
         "prefetch_factor needs workers > 0 (the main process does not prefetch): set workers or prefetch_factor=None")
    need(not cfg.persistent_workers or resolve_workers(cfg.workers) > 0,
         "persistent_workers needs workers > 0: set workers or persistent_workers=False")
    if cfg.decoder == "cuda" and cfg.storage != "packed":
        need(device.type == "cuda", "decoder 'cuda' (nvJPEG) needs a CUDA GPU: use decoder='torchvision' on CPU")
        need(cfg.image_format == "jpg", "decoder 'cuda' decodes JPEG only: use image_format='jpg'")
        need(cfg.augment in ("none", "on-device"),
             "decoder 'cuda' leaves images on the GPU: use augment='on-device' (or 'none')")


# ------------------------------------------------------------------------------------------------ storage


@dataclass
class Store:
    """Images of one split in one storage format, on disk."""

    storage: str
    path: Path                           # the folder (folder storage: the split folder of class folders)
    image_format: str | None             # png | jpg, None for packed
    n: int                               # images

    def files(self) -> list[Path]:
        """Every file that holds the data (markers excluded)."""
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not p.name.startswith("."))

    def disk_bytes(self) -> dict:
        """Bytes on disk: `apparent` (file sizes) and `allocated` (filesystem blocks; small files waste most)."""
        files = self.files()
        st = [f.stat() for f in files]
        return {"files": len(files), "apparent": sum(s.st_size for s in st),
                "allocated": sum(getattr(s, "st_blocks", 0) * 512 or s.st_size for s in st)}


def encode_image(img: np.ndarray, image_format: str) -> bytes:
    """Encode one uint8 (H, W, 3) image as PNG or JPEG (quality 95): the same bytes write_image_folder writes."""
    from PIL import Image

    buf = io.BytesIO()
    if image_format == "png":
        Image.fromarray(img).save(buf, format="PNG")
    elif image_format == "jpg":
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
    else:
        raise LabkitError(f"image format must be one of {IMAGE_FORMATS}, not {image_format!r}")
    return buf.getvalue()


def store_root(data: D.ImageData) -> Path:
    """Where `write_store` keeps a dataset's stores: the labkit cache, keyed by the data's content hash."""
    return D.cache_dir() / f"stores-{data.name}-{len(data.y_train)}-{D.fingerprint(data)}"


def _tar_member(tf: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644  # fixed metadata: identical shards everywhere
    tf.addfile(info, io.BytesIO(payload))


def write_store(data: D.ImageData, storage: str, image_format: str = "png",
                root: str | os.PathLike | None = None, progress: bool = False) -> Store:
    """Write the training split of `data` in `storage` format under `root` (skipped if already complete).

    Each format is written to a temporary folder and renamed, so an interrupted write never looks complete.
    """
    if storage not in STORAGES:
        raise LabkitError(f"storage must be one of {STORAGES}, not {storage!r}")
    if image_format not in IMAGE_FORMATS:
        raise LabkitError(f"image format must be one of {IMAGE_FORMATS}, not {image_format!r}")
    root = Path(root) if root is not None else store_root(data)
    x, y = data.x_train, data.y_train
    n = len(y)
    if storage == "folder":
        path = D.write_image_folder(data, root / f"folder-{image_format}", "train", image_format)
        return Store("folder", path, image_format, n)
    fmt = None if storage == "packed" else image_format
    out = root / (storage if fmt is None else f"{storage}-{fmt}")
    marker = out / f".complete-{n}"
    if marker.exists():
        return Store(storage, out, fmt, n)
    tmp = root / f".{out.name}.partial{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from tqdm.auto import tqdm

    items = tqdm(range(n), desc=f"writing {out.name}", disable=None if progress else True, leave=False)
    if storage == "packed":
        arr = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8, shape=x.shape)
        arr[:] = x
        arr.flush()
        del arr
        np.save(tmp / "labels.npy", y.astype(np.int64))
    elif storage == "tar":
        with tarfile.open(tmp / "shard-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in items:
                _tar_member(tf, f"{i:06d}.{fmt}", encode_image(x[i], fmt))
                _tar_member(tf, f"{i:06d}.cls", str(int(y[i])).encode())
    else:  # records
        index = np.zeros((n, 2), dtype=np.int64)
        with open(tmp / "images.rec", "wb") as f:
            for i in items:
                b = encode_image(x[i], fmt)
                index[i] = (f.tell(), len(b))
                f.write(b)
        np.save(tmp / "index.npy", index)
        np.save(tmp / "labels.npy", y.astype(np.int64))
    (tmp / marker.name).touch()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return Store(storage, out, fmt, n)


def _tar_index(path: Path, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(offset, length) of each image member and the labels, from one sequential pass over the shard's headers."""
    spans, labels = {}, {}
    try:
        with tarfile.open(path, "r") as tf:
            for m in tf:
                key, _, ext = m.name.rpartition(".")
                if ext == fmt:
                    spans[key] = (m.offset_data, m.size)
                elif ext == "cls":
                    labels[key] = int(tf.extractfile(m).read())
    except (tarfile.TarError, OSError, ValueError) as e:
        raise LabkitError(f"tar shard {path} is unreadable ({e}): delete its folder and write it again") from e
    keys = sorted(spans)
    if not keys or set(keys) != set(labels):
        raise LabkitError(f"tar shard {path}: {len(keys)} .{fmt} members and {len(labels)} .cls members do not pair "
                          f"up by key: write it again with labkit.loaders.write_store")
    return np.array([spans[k] for k in keys], dtype=np.int64), np.array([labels[k] for k in keys], dtype=np.int64)


# ------------------------------------------------------------------------------------------------ reading


@contextlib.contextmanager
def _torchvision_io():
    """torchvision >= 0.29 marks its image decoders deprecated in favour of TorchCodec (a separate package);
    they still work and are what older torchvision versions offer, so the per-call warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        yield


def _batch_seed(seed: int, epoch: int, batch: int) -> int:
    return ((seed * 1_000_003 + epoch) * 100_003 + batch) % 2**62


class EpochBatches(torch.utils.data.Sampler):
    """Batches of `labkit.data.epoch_order`, as (epoch, batch number, indices) tasks for a batch-level dataset.

    Each iter() is the next epoch (the first is 0); `set_epoch` picks the epoch the next iter() yields.
    """

    def __init__(self, n: int, batch_size: int, seed: int, drop_last: bool = False):
        self.sampler = D.EpochSampler(n, seed)
        self.batch_size, self.drop_last, self._next = batch_size, drop_last, 0

    def set_epoch(self, epoch: int):
        self._next = epoch

    def __iter__(self):
        epoch = self._next
        self._next += 1
        self.sampler.set_epoch(epoch)
        order = list(self.sampler)
        for b, s in enumerate(range(0, len(order), self.batch_size)):
            idx = order[s:s + self.batch_size]
            if len(idx) < self.batch_size and self.drop_last:
                return
            yield epoch, b, idx

    def __len__(self):
        n, bs = self.sampler.n, self.batch_size
        return n // bs if self.drop_last else -(-n // bs)


class BatchReader(torch.utils.data.Dataset):
    """Reads, decodes and (optionally) augments one whole batch per task: the worker's unit of work.

    Returns (images, labels): images uint8 (B, 3, H, W), or for decoder 'cuda' a list of encoded JPEG tensors.
    File handles and memory maps open lazily in each process and are never pickled (workers open their own).
    """

    def __init__(self, store: Store, decoder: str = "pil", augment: str = "none", seed: int = 0):
        self.store, self.decoder, self.augment, self.seed = store, decoder, augment, seed
        self._h = None  # per-process handles: memmap, file descriptor
        if store.storage == "folder":
            self.files, labels = D.image_folder_files(store.path)
            self.labels = np.asarray(labels, dtype=np.int64)
        elif store.storage == "tar":
            self.shard = store.path / "shard-000000.tar"
            self.spans, self.labels = _tar_index(self.shard, store.image_format)
        else:
            self.labels = self._load(store.path / "labels.npy")
            if store.storage == "records":
                self.spans = self._load(store.path / "index.npy")
        if store.storage != "folder" and len(self.labels) != store.n:
            raise LabkitError(f"{store.path}: holds {len(self.labels)} labels, expected {store.n}: write it again")
        if augment == "per-sample":
            from torchvision import transforms as T

            self.per_sample = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])

    @staticmethod
    def _load(path: Path, mmap: bool = False) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r" if mmap else None)
        except (OSError, ValueError) as e:
            raise LabkitError(f"{path} is missing or corrupt ({e}): delete its folder and write it again") from e

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_h"] = None
        return state

    def __len__(self):
        return len(self.labels)

    def _handles(self):
        if self._h is None or self._h[0] != os.getpid():
            if self.store.storage == "packed":
                h = self._load(self.store.path / "images.npy", mmap=True)
            elif self.store.storage in ("tar", "records"):
                h = os.open(self.shard if self.store.storage == "tar" else self.store.path / "images.rec", os.O_RDONLY)
            else:
                h = None
            self._h = (os.getpid(), h)
        return self._h[1]

    def encoded(self, i: int) -> bytes:
        """The encoded bytes of image i (not for packed storage)."""
        if self.store.storage == "folder":
            return self.files[i].read_bytes()
        off, size = self.spans[i]
        b = os.pread(self._handles(), int(size), int(off))  # pread: no shared file offset between threads
        if len(b) != size:
            raise LabkitError(f"{self.store.path}: image {i} is truncated: write the store again")
        return b

    def decode(self, i: int) -> torch.Tensor:
        """Image i as a uint8 (3, H, W) tensor, decoded by this reader's CPU decoder."""
        try:
            if self.decoder == "pil":
                from PIL import Image

                src = self.files[i] if self.store.storage == "folder" else io.BytesIO(self.encoded(i))
                with Image.open(src) as im:
                    arr = np.array(im.convert("RGB"))
                return torch.from_numpy(arr).permute(2, 0, 1)
            from torchvision.io import ImageReadMode, decode_image

            raw = torch.frombuffer(bytearray(self.encoded(i)), dtype=torch.uint8)
            return decode_image(raw, mode=ImageReadMode.RGB)
        except LabkitError:
            raise
        except Exception as e:  # PIL's UnidentifiedImageError, torchvision's RuntimeError: a corrupt image
            raise LabkitError(f"image {i} of {self.store.path} cannot be decoded ({type(e).__name__}): delete the "
                              f"store and write it again") from e

    def __getitem__(self, task):
        epoch, b, idx = task
        y = torch.from_numpy(self.labels[idx])
        if self.store.storage == "packed":
            x = torch.from_numpy(np.ascontiguousarray(self._handles()[idx])).permute(0, 3, 1, 2).contiguous()
        elif self.decoder == "cuda":
            return [torch.frombuffer(bytearray(self.encoded(i)), dtype=torch.uint8) for i in idx], y
        else:
            with _torchvision_io():
                x = torch.stack([self.decode(i) for i in idx])
        seed = _batch_seed(self.seed, epoch, b)
        if self.augment == "batched":
            x = D.augment_batch(x, torch.Generator().manual_seed(seed))
        elif self.augment == "per-sample":
            # torchvision's transforms draw from torch's global RNG: fork it so the caller's stream is untouched.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                x = torch.stack([self.per_sample(img) for img in x])
        return x, y


class ImageLoader:
    """One configured input pipeline; iterating it yields one epoch of (images, labels) on `device`.

    Images are normalized float32 (B, 3, H, W) (CIFAR mean/std), labels int64. Each iter() is the next epoch
    (the first is 0); `set_epoch` picks the one the next iter() yields. `close()` stops persistent workers.
    """

    def __init__(self, cfg: LoaderConfig, store: Store, device: torch.device | str | None = "cpu"):
        self.cfg, self.device = cfg, pick_device(device)
        check_config(cfg, self.device)
        if cfg.storage != store.storage:
            raise LabkitError(f"loader {cfg.name} reads {cfg.storage} storage, but the store given is "
                              f"{store.storage}: pass write_store(data, {cfg.storage!r}, ...)")
        if store.image_format not in (None, cfg.image_format):
            raise LabkitError(f"loader {cfg.name} expects {cfg.image_format} images, the store holds "
                              f"{store.image_format}")
        self.store, self.n = store, store.n
        workers = resolve_workers(cfg.workers)
        # Its own generator: a DataLoader draws a base seed per epoch from it (else from the caller's global RNG).
        kw = dict(num_workers=workers, pin_memory=cfg.pin_memory and self.device.type == "cuda",
                  generator=torch.Generator().manual_seed(cfg.seed))
        if workers > 0:
            kw.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
        # The naive path is labkit.data's own per-sample dataset, batched by the DataLoader.
        self.naive = cfg.storage == "folder" and cfg.decoder == "pil" and cfg.augment in ("none", "per-sample")
        if self.naive:
            self.sampler = D.EpochSampler(self.n, cfg.seed)
            ds = D.ImageFileDataset(store.path, augment=cfg.augment == "per-sample")
            self.loader = torch.utils.data.DataLoader(ds, batch_size=cfg.batch_size, sampler=self.sampler,
                                                      drop_last=cfg.drop_last, **kw)
        else:
            self.sampler = EpochBatches(self.n, cfg.batch_size, cfg.seed, cfg.drop_last)
            cpu_aug = cfg.augment if cfg.augment in ("per-sample", "batched") else "none"
            decoder = cfg.decoder if cfg.storage != "packed" else "pil"
            ds = BatchReader(store, decoder, cpu_aug, cfg.seed)
            self.loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=self.sampler, **kw)
        self._epoch = 0
        self._gen = None

    def set_epoch(self, epoch: int):
        self._epoch = epoch

    def __len__(self):
        return len(self.loader)

    def _device_gen(self, epoch: int, b: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(_batch_seed(self.cfg.seed, epoch, b))
        return g

    def __iter__(self):
        cfg, dev = self.cfg, self.device
        epoch = self._epoch
        self._epoch += 1
        self.sampler.set_epoch(epoch)
        for b, (x, y) in enumerate(self.loader):
            if isinstance(x, list):  # encoded JPEGs: one batched nvJPEG call
                from torchvision.io import ImageReadMode, decode_jpeg

                with _torchvision_io():
                    x = torch.stack(decode_jpeg(x, mode=ImageReadMode.RGB, device=dev))
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            if self.naive:
                yield x, y
                continue
            if cfg.augment == "on-device":
                x = D.augment_batch(x, self._device_gen(epoch, b))
            yield D.normalize(x), y

    def close(self):
        """Stop this loader's worker processes now (persistent workers otherwise live until garbage collection)."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader._iterator = None


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Undo `labkit.data.normalize`: normalized floats back to the uint8 pixels they came from (exact)."""
    mean = torch.tensor(D.CIFAR_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(D.CIFAR_STD, device=x.device).view(1, 3, 1, 1)
    return ((x.float() * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)

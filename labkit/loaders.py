"""Input pipelines for week 4: storage formats, decoders, and loader-only throughput sweeps.

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

`measure`, `sweep`, `format_table` and `decoder_table` time loaders alone (no model), through `labkit.bench`;
`model_rates` measures how fast ResNet-18 consumes images, so a plot can show which side is the bottleneck.
`labkit data` runs the sweeps from the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
SWEEPABLE = ("workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size", "augment",
             "storage", "decoder")


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


# ------------------------------------------------------------------------------------------------ measuring


def _drain(loader) -> int:
    n = 0
    for _x, y in loader:
        n += len(y)
    return n


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run a block with `n` intra-op CPU threads in this process (None: unchanged), then restore the count."""
    saved = torch.get_num_threads()
    try:
        if n is not None:
            torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(saved)


def measure(cfg: LoaderConfig, store: Store, device: torch.device | str | None = "cpu", warmup: int = 1,
            repeats: int = 2, threads: int | None = 1) -> dict:
    """Loader-only throughput: whole epochs through `labkit.bench.time_fn`; samples/s at the median epoch.

    Worker start-up is inside each epoch unless `persistent_workers` keeps them alive (that is its point).
    The main process runs with `threads` intra-op threads (default 1, as DataLoader gives each worker): its
    per-batch work is small, and a thread pool spread over cores the workers are using stalls waiting for them.
    """
    from labkit.bench import time_fn

    dev = pick_device(device)
    loader = ImageLoader(cfg, store, dev)
    counts = []
    try:
        with torch_threads(threads):
            t = time_fn(lambda: counts.append(_drain(loader)), device=dev, warmup=warmup, repeats=repeats)
    finally:
        loader.close()
    if len(set(counts)) != 1:
        raise AssertionError(f"epochs yielded different sample counts {counts}")
    return {"name": cfg.name, "samples_per_s": counts[0] / t.median, "epoch_s": t.median, "epoch_iqr_s": t.iqr,
            "samples": counts[0], "workers": resolve_workers(cfg.workers), "config": dataclasses.asdict(cfg)}


def skip_reason(cfg: LoaderConfig, device: torch.device) -> str | None:
    """Why `cfg` cannot run (or means nothing) on `device`, or None."""
    if device.type != "cuda":
        if cfg.decoder == "cuda" and cfg.storage != "packed":
            return "GPU decoding (nvJPEG) needs a CUDA GPU"
        if cfg.pin_memory:
            return "pinned memory only speeds up copies to a CUDA GPU"
    try:
        check_config(cfg, device)
    except LabkitError as e:
        return str(e)
    return None


def sweep(base: LoaderConfig, field: str, values, store_for, device="cpu", warmup: int = 1, repeats: int = 2,
          progress=None) -> list[dict]:
    """Loader-only samples/s for each value of one LoaderConfig field (others as in `base`).

    `store_for(cfg)` returns the Store a config reads (stores differ by storage and image format). Values that
    cannot run here come back as rows with `skipped` set instead of a rate.
    """
    if field not in SWEEPABLE:
        raise LabkitError(f"cannot sweep {field!r}: choose one of {', '.join(SWEEPABLE)}")
    dev = pick_device(device)
    rows = []
    for v in values:
        cfg = with_changes(base, **{field: v}, name=f"{base.name} {field}={v}")
        if field == "workers" and resolve_workers(v) == 0:
            cfg = with_changes(cfg, persistent_workers=False, prefetch_factor=None)
        why = skip_reason(cfg, dev)
        if why:
            rows.append({"name": cfg.name, field: v, "skipped": why})
        else:
            rows.append({field: v, **measure(cfg, store_for(cfg), dev, warmup, repeats)})
        if progress is not None:
            progress.update(1)
    return rows


def stores(data: D.ImageData, root=None, progress: bool = False):
    """A `store_for(cfg)` function that writes each needed store once (cached on disk) and reuses it."""
    made = {}

    def store_for(cfg: LoaderConfig) -> Store:
        key = (cfg.storage, None if cfg.storage == "packed" else cfg.image_format)
        if key not in made:
            made[key] = write_store(data, cfg.storage, cfg.image_format, root, progress)
        return made[key]

    return store_for


def format_table(data: D.ImageData, device="cpu", image_formats=("png", "jpg"), decoders=("pil", "torchvision"),
                 root=None, warmup: int = 1, repeats: int = 2, batch_size: int = 256, progress=None) -> list[dict]:
    """Every storage x image format x CPU decoder on the same images: bytes on disk and read+decode samples/s.

    One process (no workers), no augmentation: the cost of getting pixels off the disk and decoded.
    """
    dev = pick_device(device)
    store_for = stores(data, root)
    rows = []
    combos = [("packed", "png", "-")] + [(s, f, d) for s in ("folder", "tar", "records") for f in image_formats
                                         for d in decoders]
    for storage, fmt, dec in combos:
        cfg = LoaderConfig(f"{storage}/{fmt}/{dec}" if storage != "packed" else "packed uint8", storage=storage,
                           image_format=fmt, decoder="pil" if dec == "-" else dec, augment="none",
                           batch_size=batch_size)
        store = store_for(cfg)
        disk = store.disk_bytes()
        r = measure(cfg, store, dev, warmup, repeats)
        rows.append({"storage": storage, "image_format": store.image_format or "raw uint8", "decoder": dec,
                     "files": disk["files"], "bytes": disk["apparent"], "bytes_allocated": disk["allocated"],
                     "bytes_per_image": disk["apparent"] / store.n, "samples_per_s": r["samples_per_s"],
                     "epoch_s": r["epoch_s"]})
        if progress is not None:
            progress.update(1)
    return rows


def decoder_table(data: D.ImageData, device="cpu", n: int = 512, repeats: int = 5) -> list[dict]:
    """Decoding alone (bytes already in memory), img/s for each decoder and format; 'cuda' only on a GPU."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    from labkit.bench import time_fn

    dev = pick_device(device)
    n = min(n, len(data.y_train))
    rows = []
    for fmt in IMAGE_FORMATS:
        enc = [encode_image(img, fmt) for img in data.x_train[:n]]
        raw = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in enc]

        def pil(enc=enc):
            for b in enc:
                with Image.open(io.BytesIO(b)) as im:
                    np.asarray(im.convert("RGB"))

        def tv(raw=raw):
            for t in raw:
                decode_image(t, mode=ImageReadMode.RGB)

        runs = [("pil", pil, "cpu"), ("torchvision", tv, "cpu")]
        if fmt == "jpg" and dev.type == "cuda":
            runs.append(("cuda", lambda raw=raw: decode_jpeg(raw, mode=ImageReadMode.RGB, device=dev), dev))
        for name, fn, where in runs:
            with _torchvision_io():
                t = time_fn(fn, device=where, warmup=1, repeats=repeats)
            rows.append({"image_format": fmt, "decoder": name, "img_per_s": n / t.median, "median_s": t.median,
                         "iqr_s": t.iqr, "images": n, "mean_bytes": float(np.mean([len(b) for b in enc]))})
        if fmt == "jpg" and dev.type != "cuda":
            rows.append({"image_format": fmt, "decoder": "cuda", "skipped": "GPU decoding (nvJPEG) needs a CUDA GPU"})
    return rows


def model_rates(device="cpu", quick: bool = True, dataset: D.ImageData | None = None, progress=None,
                n_train: int | None = None) -> dict:
    """How fast ResNet-18 consumes training images (img/s) with data resident on the device (no loader cost).

    'baseline model': the baseline rung's step (fp32 defaults, batch 128, .item() each step). On a GPU also
    'tuned model': bf16, channels_last, batch 1024, fused SGD, cudnn.benchmark. A loader slower than these
    rates is the bottleneck of that training run. Two epochs of `n_train` images (default 256 quick, 16,384
    full); the rate is the second epoch's.
    """
    from labkit import train as T

    dev = pick_device(device)
    base = T.quick_base() if quick else T.TrainConfig()
    base = T.with_changes(base, epochs=2, evaluate=False, n_train=n_train or (256 if quick else 16384))
    cfgs = {"baseline model": T.with_changes(T.preset("baseline", base), loader="resident")}
    if dev.type == "cuda":
        cfgs["tuned model"] = T.with_changes(T.preset("cudnn_benchmark", base), loader="resident")
    ds = dataset or D.load("synthetic", base.n_train, 16)
    out = {}
    for label, cfg in cfgs.items():
        rec = T.train(cfg, dev, dataset=ds)
        out[label] = {"img_per_s": rec["img_per_s"], "preset": cfg.name, "batch_size": cfg.batch_size,
                      "width": cfg.width, "precision": cfg.precision}
        if progress is not None:
            progress.update(1)
    return out


# ------------------------------------------------------------------------------------------------ tables, plots


def rows_table(rows: list[dict], key: str) -> str:
    """A Markdown table of sweep rows: the swept value, samples/s and epoch time (or why it was skipped)."""
    lines = [f"| {key} | samples/s | epoch s |", "|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r[key]} | skipped: {r['skipped']} | |")
        else:
            lines.append(f"| {r[key]} | {r['samples_per_s']:,.0f} | {r['epoch_s']:.3f} |")
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """A Markdown table of `format_table` rows."""
    lines = ["| storage | encoding | decoder | files | MB on disk | MB allocated | bytes/image | samples/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['storage']} | {r['image_format']} | {r['decoder']} | {r['files']:,} | "
                     f"{r['bytes'] / 1e6:.2f} | {r['bytes_allocated'] / 1e6:.2f} | {r['bytes_per_image']:,.0f} | "
                     f"{r['samples_per_s']:,.0f} |")
    return "\n".join(lines)


def plot_workers(series: dict[str, list[dict]], model_rates: dict | None = None, ax=None, title: str | None = None):
    """samples/s against num_workers, one line per loader, with the model's consumption rates as horizontal lines.

    Where a loader's line is below a model line, that training run waits for data.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ticks = set()
    for label, rows in series.items():
        ok = [r for r in rows if "skipped" not in r]
        ax.plot([r["workers"] for r in ok], [r["samples_per_s"] for r in ok], "o-", label=label)
        ticks |= {r["workers"] for r in ok}
    ax.set_xticks(sorted(ticks))
    for i, (label, m) in enumerate((model_rates or {}).items()):
        ax.axhline(m["img_per_s"], ls="--", color=f"C{i + 5}", label=f"{label}: {m['img_per_s']:,.0f} img/s")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s (loader alone)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or "loader throughput vs workers; dashed: what the model consumes")
    return ax


# ------------------------------------------------------------------------------------------------ CLI

CLI_SWEEPS = ("formats", "decoders", "workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size",
              "augment", "padding")


def run_sweeps(which, device="auto", quick: bool = True, n: int | None = None, workers=None,
               out: str | os.PathLike | None = None, model: bool = True, log=print) -> dict:
    """Run the named sweeps (see CLI_SWEEPS) on `device` and return {sweep: rows}; with `out`, save JSON + plot.

    With `model` and the workers sweep, also ResNet-18's consumption rates (`model_rates`), drawn into the plot.
    """
    from tqdm.auto import tqdm

    from labkit.bench import write_json
    from labkit.env import environment

    bad = [w for w in which if w not in CLI_SWEEPS]
    if bad:
        raise LabkitError(f"unknown sweep(s) {bad}: choose from {', '.join(CLI_SWEEPS)}")
    dev = pick_device(device)
    n = n or (1024 if quick else 16384)
    if n < 1:
        raise LabkitError("--n must be >= 1")
    workers = workers or ([0, 1, 2] if quick else [0, 1, 2, 4, 8, 12, 16])
    cores = os.cpu_count() or 1
    log(f"labkit data on {environment(device=dev)['device_name']}: {n} images, {cores} CPU cores"
        + (" (quick mode)" if quick else ""))
    if dev.type != "cuda":
        log("  no CUDA: GPU decoding and pinned-memory copies are skipped; 'on-device' augmentation runs on the CPU")
    result: dict = {"device": str(dev), "images": n, "quick": quick}
    needs_images = [w for w in which if w != "padding"]
    if needs_images:
        data = D.load("synthetic", n_train=n, n_test=16).subset(n)
        store_for = stores(data, progress=True)
        reps = dict(warmup=1, repeats=2)
    naive, packed = preset("naive"), preset("packed")
    for w in which:
        if w == "formats":
            rows = format_table(data, dev, **reps)
            log(format_markdown(rows))
        elif w == "decoders":
            rows = decoder_table(data, dev)
            for r in rows:
                log(f"  {r['image_format']} {r['decoder']:<12} " + (f"skipped: {r['skipped']}" if "skipped" in r
                                                                     else f"{r['img_per_s']:>10,.0f} img/s"))
        elif w == "padding":
            from labkit import bucketing as B

            rows = B.strategy_table(B.synthetic_corpus(**B.corpus_size(quick)), device=dev, quick=quick)
            log(B.strategy_markdown(rows))
        else:
            steady = dict(persistent_workers=True)  # timed epochs after the warm-up: the steady rate
            plan = {"workers": [(with_changes(naive, **steady), workers), (with_changes(packed, **steady), workers)],
                    "pin_memory": [(with_changes(naive, workers=max(workers)), [False, True])],
                    "persistent_workers": [(with_changes(naive, workers=max(workers)), [False, True])],
                    "prefetch_factor": [(with_changes(naive, workers=max(max(workers), 1)), [1, 2, 4])],
                    "batch_size": [(packed, [64, 256, 1024])],
                    "augment": [(packed, list(AUGMENTS))]}[w]
            rows = []
            for base, values in plan:
                with tqdm(total=len(values), desc=f"{w} ({base.name})", leave=False) as bar:
                    part = sweep(base, w, values, store_for, dev, progress=bar, **reps)
                for r in part:
                    r["loader"] = base.name
                rows += part
                log(f"{w}, loader {base.name}:\n" + rows_table(part, w))
            if w == "workers" and model:
                result["model_rates"] = model_rates(dev, quick)
                for k, v in result["model_rates"].items():
                    log(f"{k}: {v['img_per_s']:,.0f} img/s (ResNet-18 width {v['width']}, data resident)")
        result[w] = rows
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise LabkitError(f"--out {out} exists and is not a folder")
        write_json(out / "data.json", {"kind": "data", "env": environment(device=dev), **result})
        if "workers" in result:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt

            series = {name: [r for r in result["workers"] if r["loader"] == name] for name in ("naive", "packed")}
            ax = plot_workers(series, result.get("model_rates"))
            ax.figure.savefig(out / "workers.png", dpi=120, bbox_inches="tight")
            plt.close(ax.figure)
        log(f"wrote {out}/data.json" + (" and workers.png" if "workers" in result else ""))
    return result


def add_cli(sub) -> None:
    p = sub.add_parser("data", help="loader-only throughput: storage formats, decoders, worker sweeps, padding")
    p.add_argument("--sweep", default="formats,workers,augment,padding",
                   help=f"comma-separated sweeps to run, from: {', '.join(CLI_SWEEPS)}; or 'all'")
    p.add_argument("--quick", action="store_true", help="small run (1,024 images, workers 0-2); the default on CPU")
    p.add_argument("--full", action="store_true", help="full size even on CPU (16,384 images, workers up to 16)")
    p.add_argument("--n", type=int, help="training images to load per epoch (default 1,024 quick, 16,384 full)")
    p.add_argument("--workers", help="comma-separated num_workers values for the workers sweep (e.g. 0,2,4,8)")
    p.add_argument("--device", default="auto", help="where batches go: auto, cpu, cuda or cuda:N")
    p.add_argument("--out", help="folder for data.json (and workers.png when the workers sweep runs)")
    p.add_argument("--no-model", action="store_true",
                   help="skip measuring ResNet-18's consumption rate (the dashed line of the workers plot)")
    p.set_defaults(func=_cli_data)


def _cli_data(args) -> int:
    dev = pick_device(args.device)
    quick = args.quick or (dev.type == "cpu" and not args.full)
    which = list(CLI_SWEEPS) if args.sweep.strip() == "all" else [w.strip() for w in args.sweep.split(",") if w.strip()]
    workers = None
    if args.workers:
        try:
            workers = [int(w) for w in args.workers.split(",") if w.strip()]
        except ValueError as e:
            raise LabkitError(f"--workers takes whole numbers separated by commas, got {args.workers!r}") from e
        if not workers or min(workers) < 0:
            raise LabkitError("--workers values must be >= 0")
    run_sweeps(which, dev, quick=quick, n=args.n, workers=workers, out=args.out, model=not args.no_model)
    return 0

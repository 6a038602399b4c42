"""Measuring and reporting input pipelines for week 4: loader-only throughput, tables, plots and `labkit data`.

The pipelines themselves (`LoaderConfig`, the on-disk stores, `ImageLoader`) are in `labkit.loaders`; this
module times them and reports the numbers.

- Measuring: `measure(cfg, store)` times whole epochs of one loader alone (no model) through `labkit.bench`;
  `sweep` does it for each value of one `LoaderConfig` field (values that cannot run here come back as
  skipped rows, see `skip_reason`); `stores(data)` writes each store a sweep needs once; `format_table`
  compares every storage x image format x CPU decoder (bytes on disk, samples/s); `decoder_table` times
  decoding alone; `model_rates` measures how fast ResNet-18 consumes images, so a plot can show which side is
  the bottleneck; `torch_threads` (from `labkit.bench`) pins the main process's intra-op threads for a block.
- Tables and plots: `rows_table`, `format_markdown` (Markdown), `plot_workers` (samples/s against num_workers
  with the model's rates as lines).
- CLI: `labkit data` (`add_cli`) runs the sweeps named in `CLI_SWEEPS` through `run_sweeps`.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import numpy as np
import torch

from labkit import data as D
from labkit.bench import torch_threads  # noqa: F401  (re-exported: the week's measuring API is here)
from labkit.env import LabkitError, pick_device
from labkit.loaders import (
    AUGMENTS,
    IMAGE_FORMATS,
    ImageLoader,
    LoaderConfig,
    Store,
    _torchvision_io,
    check_config,
    encode_image,
    preset,
    resolve_workers,
    with_changes,
    write_store,
)
from labkit.outputs import check_writable, save_figure, write_json
from labkit.progress import Stages, fmt_duration

SWEEPABLE = ("workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size", "augment",
             "storage", "decoder")


# ------------------------------------------------------------------------------------------------ measuring


def _drain(loader) -> int:
    n = 0
    for _x, y in loader:
        n += len(y)
    return n


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


def format_combos(image_formats=("png", "jpg"), decoders=("pil", "torchvision")) -> list[tuple[str, str, str]]:
    """The (storage, image format, decoder) rows of `format_table`: packed uint8 once, then every combination."""
    return [("packed", "png", "-")] + [(s, f, d) for s in ("folder", "tar", "records") for f in image_formats
                                       for d in decoders]


def format_table(data: D.ImageData, device="cpu", image_formats=("png", "jpg"), decoders=("pil", "torchvision"),
                 root=None, warmup: int = 1, repeats: int = 2, batch_size: int = 256, progress=None) -> list[dict]:
    """Every storage x image format x CPU decoder on the same images: bytes on disk and read+decode samples/s.

    One process (no workers), no augmentation: the cost of getting pixels off the disk and decoded.
    """
    dev = pick_device(device)
    store_for = stores(data, root)
    rows = []
    for storage, fmt, dec in format_combos(image_formats, decoders):
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
    'tuned model': the `cudnn_benchmark` rung (bf16, channels_last, batch 512, fused SGD, cudnn.benchmark). A
    loader slower than these rates is the bottleneck of that training run. Two epochs of `n_train` images
    (default 256 quick, 16,384 full); the rate is the second epoch's.
    """
    from labkit import train as T

    dev = pick_device(device)
    cfgs = rate_configs(dev, quick, n_train)
    ds = dataset or D.load("synthetic", next(iter(cfgs.values())).n_train, 16)
    out = {}
    for label, cfg in cfgs.items():
        rec = T.train(cfg, dev, dataset=ds)
        out[label] = {"img_per_s": rec["img_per_s"], "preset": cfg.name, "batch_size": cfg.batch_size,
                      "width": cfg.width, "precision": cfg.precision}
        if progress is not None:
            progress.update(1)
    return out


def rate_configs(device: torch.device, quick: bool, n_train: int | None = None) -> dict:
    """label -> the TrainConfig `model_rates` trains, each rung fitted to `device` as the ladder fits it
    (`train.fit_rung`): quick mode's batch never exceeds its 256 images (the tuned rung's is 512, and a GPU runs
    quick mode too), and a GPU without bf16 tensor cores trains it in fp16."""
    from labkit import train as T

    base = T.quick_base() if quick else T.TrainConfig()
    base = T.with_changes(base, epochs=2, evaluate=False, n_train=n_train or (256 if quick else 16384))
    names = {"baseline model": "baseline"} | ({"tuned model": "cudnn_benchmark"} if device.type == "cuda" else {})
    return {label: T.fit_rung(T.with_changes(T.preset(rung, base), loader="resident"), device, quick)
            for label, rung in names.items()}


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
    """Run the named sweeps (see CLI_SWEEPS) on `device` and return {sweep: rows}.

    With `out` (a folder, checked writable before any work), data.json is rewritten after every sweep, so an
    interrupt keeps the sweeps that finished, and workers.png is drawn once the workers sweep is in. With `model`
    and the workers sweep, also ResNet-18's consumption rates (`model_rates`), drawn into the plot.
    """
    from labkit.env import environment

    bad = [w for w in which if w not in CLI_SWEEPS]
    if bad:
        raise LabkitError(f"unknown sweep(s) {bad}: choose from {', '.join(CLI_SWEEPS)}")
    dev = pick_device(device)
    if n is None:
        n = 1024 if quick else 16384
    if n < 1:
        raise LabkitError(f"--n must be >= 1 (training images per epoch), not {n}")
    workers = workers or ([0, 1, 2] if quick else [0, 1, 2, 4, 8, 12, 16])
    out = None if out is None else check_writable(out, "dir", "--out")
    env = environment(device=dev)
    log(f"labkit data on {env['device_name']}: {n} images, {os.cpu_count() or 1} CPU cores"
        + (" (quick mode)" if quick else ""))
    if dev.type != "cuda":
        log("  no CUDA: GPU decoding and pinned-memory copies are skipped; 'on-device' augmentation runs on the CPU")
    result: dict = {"device": str(dev), "images": n, "quick": quick, "complete": False}
    data = D.load("synthetic", n_train=n, n_test=16).subset(n) if any(w != "padding" for w in which) else None
    store_for = stores(data, progress=True) if data is not None else None
    stages = Stages(len(which), "data", log=log)
    for w in which:
        with stages.stage(w, _sweep_steps(w, dev, workers, model)) as bar:
            result[w] = _run_sweep(w, data, dev, quick, workers, store_for, bar, log)
            if w == "workers" and model:
                result["model_rates"] = model_rates(dev, quick, progress=bar)
                for k, v in result["model_rates"].items():
                    log(f"{k}: {v['img_per_s']:,.0f} img/s (ResNet-18 width {v['width']}, data resident)")
        if out is not None:
            _save_sweeps(out, result, env)
    result["complete"] = True
    if out is not None:
        _save_sweeps(out, result, env)
        log(f"wrote {out}/data.json" + (" and workers.png" if "workers" in result else ""))
    log(f"labkit data finished in {fmt_duration(stages.elapsed())}")
    return result


def _sweep_plan(w: str, workers: list[int]) -> list[tuple[LoaderConfig, list]]:
    """(base config, values) pairs that the loader sweep `w` times."""
    naive, packed = preset("naive"), preset("packed")
    steady = dict(persistent_workers=True)  # timed epochs after the warm-up: the steady rate
    return {"workers": [(with_changes(naive, **steady), workers), (with_changes(packed, **steady), workers)],
            "pin_memory": [(with_changes(naive, workers=max(workers)), [False, True])],
            "persistent_workers": [(with_changes(naive, workers=max(workers)), [False, True])],
            "prefetch_factor": [(with_changes(naive, workers=max(max(workers), 1)), [1, 2, 4])],
            "batch_size": [(packed, [64, 256, 1024])],
            "augment": [(packed, list(AUGMENTS))]}[w]


def _sweep_steps(w: str, dev: torch.device, workers: list[int], model: bool) -> int:
    """How many progress steps sweep `w` reports (configurations timed, model rates measured)."""
    if w in ("decoders", "padding"):
        return 1
    if w == "formats":
        return len(format_combos())
    models = (2 if dev.type == "cuda" else 1) if w == "workers" and model else 0  # see model_rates
    return sum(len(values) for _, values in _sweep_plan(w, workers)) + models


def _run_sweep(w: str, data, dev, quick: bool, workers: list[int], store_for, bar, log) -> list[dict]:
    """The rows of one sweep of `labkit data`, logged as a table."""
    reps = dict(warmup=1, repeats=2)
    if w == "formats":
        rows = format_table(data, dev, progress=bar, **reps)
        log(format_markdown(rows))
    elif w == "decoders":
        rows = decoder_table(data, dev)
        bar.update(1)
        for r in rows:
            log(f"  {r['image_format']} {r['decoder']:<12} " + (f"skipped: {r['skipped']}" if "skipped" in r
                                                                 else f"{r['img_per_s']:>10,.0f} img/s"))
    elif w == "padding":
        from labkit import bucketing as B

        rows = B.strategy_table(B.synthetic_corpus(**B.corpus_size(quick)), device=dev, quick=quick)
        bar.update(1)
        log(B.strategy_markdown(rows))
    else:
        rows = []
        for base, values in _sweep_plan(w, workers):
            part = sweep(base, w, values, store_for, dev, progress=bar, **reps)
            for r in part:
                r["loader"] = base.name
            rows += part
            log(f"{w}, loader {base.name}:\n" + rows_table(part, w))
    return rows


def _save_sweeps(out: Path, result: dict, env: dict) -> None:
    """(Re)write data.json in `out` from the sweeps finished so far, and workers.png once that sweep is in."""
    write_json(out / "data.json", {"kind": "data", "env": env, **result})
    if "workers" in result:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        series = {name: [r for r in result["workers"] if r["loader"] == name] for name in ("naive", "packed")}
        ax = plot_workers(series, result.get("model_rates"))
        save_figure(ax.figure, out / "workers.png", dpi=120, bbox_inches="tight")
        plt.close(ax.figure)


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

"""Our baseline rung vs a PyTorch Lightning bf16-mixed peer vs our top rung, in one process on one device.

    python benchmarks/peers.py [--epochs 3] [--quick] [--device cuda] [--out benchmarks/results]
    python benchmarks/peers.py --time-to-accuracy-run RECORD.json   (one timed peer run, for time_to_accuracy.py)

The peer is what a careful Lightning user writes: the same ResNet-18, PNG files through PIL transforms in a
DataLoader with a worker per core (up to 15), precision="bf16-mixed", SGD. Lightning is optional: without it the
peer is skipped with a message. Saves result `peers` (img/s of each, ratios measured in this run).

--time-to-accuracy-run trains the peer alone for the baseline's epochs in this fresh process, evaluating after every
epoch as `labkit train --set eval_every_epoch=true` does, and writes a record with the same keys that
`benchmarks/time_to_accuracy.py` reads from labkit's (stages_s, accuracy_curve, accuracy, img_per_s), so the peer is
timed to the target in the same call as the rungs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's labkit, run from anywhere

from labkit import data as D  # noqa: E402
from labkit import train as T  # noqa: E402
from labkit.bench import RESULTS_DIR, save_result, synchronize  # noqa: E402
from labkit.env import pick_device, process_age_s, quick_mode  # noqa: E402
from labkit.models import resnet18  # noqa: E402


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            return None
    return pl


def lightning_peer(ds: D.ImageData, device: torch.device, epochs: int, batch_size: int = 256,
                   evaluate_each_epoch: bool = False) -> dict | None:
    """Train with Lightning (bf16-mixed on CUDA, fp32 on CPU); returns img/s per epoch, or None without Lightning.

    With `evaluate_each_epoch` the test accuracy is taken after every epoch (outside the epoch's timer, as labkit's
    `eval_every_epoch` does): the record's `curve` gives each epoch's training seconds so far and accuracy, and
    `before_first_epoch_s` the seconds from this call to the first epoch's start (image files, loader, Trainer)."""
    t_call = time.perf_counter()
    pl = _lightning()
    if pl is None:
        print("peers: Lightning is not installed (pip install lightning): peer skipped")
        return None
    cfg = T.TrainConfig()
    eval_cfg = T.with_changes(cfg, precision="bf16" if device.type == "cuda" else "default")  # as the peer trains
    folder = D.write_image_folder(ds, D.cache_dir() / f"images-{ds.name}-{len(ds.y_train)}-{D.fingerprint(ds)}")
    workers = max(1, min(15, (os.cpu_count() or 2) - 1))
    loader = torch.utils.data.DataLoader(D.ImageFileDataset(folder, augment=True), batch_size=batch_size,
                                         shuffle=True, num_workers=workers, pin_memory=device.type == "cuda",
                                         persistent_workers=True, drop_last=True)
    steps = len(loader) * epochs

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = resnet18(num_classes=ds.num_classes)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.model(x), y, label_smoothing=cfg.label_smoothing)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=cfg.lr * (batch_size / 128) ** 0.5, momentum=0.9,
                                  nesterov=True, weight_decay=cfg.weight_decay)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], total_steps=steps)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    times: list[float] = []
    curve: list[dict] = []
    first_epoch_at: list[float] = []

    class EpochTimer(pl.Callback):
        def on_train_epoch_start(self, *_):
            synchronize(device)
            self.t = time.perf_counter()
            first_epoch_at[:] = first_epoch_at or [self.t]

        def on_train_epoch_end(self, trainer, module):
            synchronize(device)
            times.append(time.perf_counter() - self.t)
            if evaluate_each_epoch:
                curve.append({"epoch": len(times), "steps": len(times) * len(loader), "train_s": sum(times),
                              "accuracy": T.evaluate(module.model, ds, eval_cfg, device)})

    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=epochs,
                         precision="bf16-mixed" if device.type == "cuda" else "32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[EpochTimer()])
    torch.manual_seed(0)
    trainer.fit(Module(), loader)
    imgs = len(loader) * batch_size
    steady = times[1:] or times
    out = {"name": "lightning_bf16_mixed", "img_per_s": imgs * len(steady) / sum(steady), "epoch_s": times,
           "workers": workers, "batch_size": batch_size, "lightning": pl.__version__}
    if evaluate_each_epoch:
        out.update(curve=curve, accuracy=curve[-1]["accuracy"] if curve else None,
                   before_first_epoch_s=first_epoch_at[0] - t_call if first_epoch_at else None)
    return out


def time_to_accuracy_run(path: str, t0: float, device: str = "auto") -> int:
    """One peer run for `benchmarks/time_to_accuracy.py`: the baseline's epochs, an evaluation after each, and a
    record at `path` in the keys that script reads from `labkit train --json` (seconds throughout). 3 without
    Lightning, so that the caller says why rather than timing nothing."""
    from labkit.outputs import check_writable, write_json

    check_writable(path)
    if _lightning() is None:
        print("peers: Lightning is not installed (pip install lightning): no peer run", file=sys.stderr)
        return 3
    dev = pick_device(device)
    t_dev = time.perf_counter()
    cfg = T.TrainConfig()
    ds = D.load("synthetic", cfg.n_train, cfg.n_test, seed=0).subset(cfg.n_train, cfg.n_test)
    data_s = time.perf_counter() - t_dev
    peer = lightning_peer(ds, dev, cfg.epochs, evaluate_each_epoch=True)
    if peer is None or peer["before_first_epoch_s"] is None:
        return 3
    setup_s = data_s + peer.pop("before_first_epoch_s")  # the data, image files, loader and Trainer
    loop = sum(peer["epoch_s"])
    write_json(path, {"kind": "train", "peer": "lightning", "accuracy": peer["accuracy"],
                      "img_per_s": peer["img_per_s"], "accuracy_curve": peer["curve"], "lightning": peer,
                      "config": {"name": "lightning", "epochs": cfg.epochs, "batch_size": peer["batch_size"]},
                      "stages_s": {"process_before_command": process_age_s(t0), "device_and_config": t_dev - t0,
                                   "compile_cache_load": 0.0, "setup": setup_s, "loop": loop,
                                   "final_evaluation": 0.0}})
    return 0


def main(argv=None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per pipeline (the first is excluded from img/s)")
    ap.add_argument("--quick", action="store_true", help="tiny CPU-sized run")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ladder"), help="results folder (default benchmarks/results/ladder)")
    ap.add_argument("--time-to-accuracy-run", metavar="RECORD.json",
                    help="train the Lightning peer alone, evaluating every epoch, and write its timed record here")
    args = ap.parse_args(argv)
    if args.time_to_accuracy_run:
        return time_to_accuracy_run(args.time_to_accuracy_run, t0, args.device)
    dev = pick_device(args.device)
    quick = args.quick or quick_mode()
    base = T.quick_base() if quick else T.TrainConfig()
    base = T.with_changes(base, epochs=args.epochs)
    ds = D.load("synthetic", base.n_train, base.n_test)
    top_name = T.RUNG_NAMES[-1] if dev.type == "cuda" else "resident_data"
    peak = T.peak_matmul_tflops(dev) if dev.type == "cuda" else None
    rows = {}
    rows["baseline"] = T.train(T.preset("baseline", base), dev, dataset=ds, peak_tflops=peak)
    print(f"baseline   {rows['baseline']['img_per_s']:>10,.0f} img/s", flush=True)
    peer = lightning_peer(ds.subset(base.n_train), dev, args.epochs,
                          batch_size=256 if not quick else 64)
    if peer:
        print(f"lightning  {peer['img_per_s']:>10,.0f} img/s", flush=True)
    top_cfg = T.preset(top_name, base)
    if dev.type != "cuda":
        top_cfg = T.with_changes(top_cfg, precision="default", compile=None, batch_size=min(256, top_cfg.batch_size))
    rows["top"] = T.train(top_cfg, dev, dataset=ds, peak_tflops=peak)
    print(f"top ({top_name}) {rows['top']['img_per_s']:>10,.0f} img/s", flush=True)
    ratios = {"top_vs_baseline": rows["top"]["img_per_s"] / rows["baseline"]["img_per_s"]}
    if peer:
        ratios["top_vs_lightning"] = rows["top"]["img_per_s"] / peer["img_per_s"]
        ratios["lightning_vs_baseline"] = peer["img_per_s"] / rows["baseline"]["img_per_s"]
    for k, v in ratios.items():
        print(f"{k:<24} {v:.2f}x")
    for r in rows.values():
        r.pop("losses", None)
    path = save_result("peers" if not quick else "peers_quick", {
        "kind": "peers", "quick": quick, "peak_bf16_tflops": peak, "baseline": rows["baseline"],
        "lightning": peer, "top": rows["top"], "ratios": ratios}, out_dir=args.out, device=dev)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Week 4 benchmark: loader-only throughput, and what a tuned loader does for the ResNet-18 baseline.

    python benchmarks/week4_loaders.py              # on a GPU host: about 3 minutes, saves week4_loaders.json
    python benchmarks/week4_loaders.py --quick      # tiny sizes, runs on CPU in well under a minute
    python benchmarks/week4_loaders.py --cpu-ratio  # packed uint8 vs image-folder PIL on this CPU, interleaved;
                                                    # saves week4_loaders_cpu.json
    python benchmarks/week4_loaders.py --overlap    # only copy-compute overlap (side stream, pinned buffers);
                                                    # on a GPU well under a minute, saves week4_overlap.json

Full run, on the same synthetic CIFAR-shaped images (16,384 by default): storage formats (image folder,
packed uint8 memory map, WebDataset tar shard, record file + index) with PIL and torchvision decoders; decoding
alone (PIL, torchvision.io on the CPU, nvJPEG on the GPU); num_workers sweeps (0-16) of the naive loader
(PNG files + PIL + per-sample transforms) and the packed loader; pin_memory, persistent_workers,
prefetch_factor and batch size sweeps; CPU vs GPU augmentation; the ResNet-18 consumption rates (data resident,
so no loader cost) of the baseline step and a tuned step; the baseline rung trained with its own loader, with
the tuned DataLoader settings and with packed uint8 data; padding strategies for sequences. Loader rates are
batches delivered to the device, normalized, with nothing consuming them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from labkit import bench
from labkit import bucketing as B
from labkit import data as D
from labkit import loader_bench as LB
from labkit import loaders as L
from labkit import overlap as O
from labkit import train as T
from labkit.env import pick_device

NAME = "week4_loaders"
CPU_NAME = "week4_loaders_cpu"
OVERLAP_NAME = "week4_overlap"


def cpu_ratio(n: int, rounds: int, batch_size: int = 256, workers: int = 2, log=print) -> dict:
    """Packed uint8 (memory map + batched augmentation) vs the image-folder PIL path on the CPU, interleaved.

    Both loaders get the same DataLoader settings (workers, persistent workers, batch size) and deliver
    normalized, augmented float batches to the CPU; ratio = time per epoch of the naive path / the packed path.
    """
    data = D.load("synthetic", n_train=n, n_test=16).subset(n)
    store_for = LB.stores(data, progress=True)
    out = {"images": n, "batch_size": batch_size, "cpu_count": os.cpu_count(), "rounds": rounds,
           "load_average_before": os.getloadavg()}
    for label, w in (("workers", workers), ("main_process", 0)):
        common = dict(batch_size=batch_size, workers=w, persistent_workers=w > 0)
        naive, packed = L.preset("naive", **common), L.preset("packed", **common)
        a = L.ImageLoader(naive, store_for(naive))
        b = L.ImageLoader(packed, store_for(packed))
        counts = {"naive": 0, "packed": 0}

        def epoch(loader, key, counts=counts):
            def run():
                for _x, y in loader:
                    counts[key] += len(y)
            return run

        try:
            with LB.torch_threads(1):
                r = bench.compare(epoch(a, "naive"), epoch(b, "packed"), rounds=rounds, warmup=1)
        finally:
            a.close()
            b.close()
        if counts["naive"] != counts["packed"] or counts["naive"] != n * (rounds + 1):
            raise AssertionError(f"the two loaders delivered different sample counts: {counts}")
        out[label] = {"workers": w, "ratio": r.ratio, "ratio_iqr": r.ratio_iqr, "ratio_range": list(r.ratio_range),
                      "naive_samples_per_s": n / r.a.median, "packed_samples_per_s": n / r.b.median,
                      "naive": dataclasses.asdict(naive), "packed": dataclasses.asdict(packed),
                      "timing": r.summary()}
        log(f"  {label:<13} ({w} workers): packed {n / r.b.median:>9,.0f} samples/s, image folder + PIL "
            f"{n / r.a.median:>7,.0f} samples/s: ratio {r.ratio:.1f}x (IQR {r.ratio_iqr:.1f}, "
            f"range {r.ratio_range[0]:.1f}-{r.ratio_range[1]:.1f}, {len(r.ratios)} rounds)")
    out["load_average_after"] = os.getloadavg()
    out["ratio"] = out["workers"]["ratio"]
    return out


def baseline_rung(dev, n: int, quick: bool, progress, image_folder=None) -> list[dict]:
    """The baseline rung trained three ways: its own loader, tuned DataLoader settings, packed uint8 data.

    `image_folder`: an existing PNG folder of the same n training images (saves writing another one).
    """
    base = T.quick_base() if quick else T.TrainConfig()
    base = T.with_changes(T.preset("baseline", base), epochs=2, n_train=n, evaluate=False,
                          data_dir=None if image_folder is None else str(image_folder))
    variants = [("baseline (PNG + PIL, 2 workers)", {}),
                ("baseline + tuned DataLoader (worker per core, pinned, persistent, prefetch 4)",
                 dict(workers=-1, pin_memory=True, persistent_workers=True, prefetch_factor=4)),
                ("baseline + packed uint8 (batched CPU augmentation)", dict(loader="tensor"))]
    ds = D.load("synthetic", n_train=n, n_test=16)
    rows = []
    for label, changes in variants:
        rec = T.train(T.with_changes(base, **changes), dev, dataset=ds)
        rows.append({"variant": label, "img_per_s": rec["img_per_s"], "img_per_s_all": rec["img_per_s_all"],
                     "epoch_s": rec["epoch_s"], "final_loss": rec["final_loss"], "changes": changes})
        progress.update(1)
    return rows


def overlap(dev, quick: bool, out: str) -> int:
    """Copy-compute overlap alone: serial pageable copies vs pinned vs a side stream; saves week4_overlap.json."""
    cfg = O.OverlapConfig(batch_mib=8.0, batches=4, repeats=2) if quick else O.OverlapConfig()
    result = {"quick": quick, **O.copy_compute_overlap(dev, cfg)}
    print(O.overlap_summary(result))
    if not result["same_result"]:
        raise AssertionError("the overlapped pipeline computed different sums: a copy raced the compute")
    path = bench.save_result(OVERLAP_NAME, result, out_dir=out, device=dev)
    print(f"saved {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "notebooks"), help="folder for the result JSON")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--cpu-ratio", action="store_true",
                    help="only the packed-vs-image-folder ratio on this CPU; saves week4_loaders_cpu.json")
    ap.add_argument("--overlap", action="store_true",
                    help="only copy-compute overlap (labkit.overlap); saves week4_overlap.json")
    ap.add_argument("--device", default="auto", help="device (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--n", type=int, help="training images (default 16,384; quick 512; cpu-ratio 8,192)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds for --cpu-ratio (default 7, quick 3)")
    ap.add_argument("--max-workers", type=int, default=16, help="largest num_workers in the sweep")
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    if args.cpu_ratio:
        n = args.n or (1024 if args.quick else 8192)
        rounds = args.rounds or (3 if args.quick else 7)
        print(f"packed uint8 vs image folder + PIL on {os.cpu_count()} CPU cores, {n} images, interleaved")
        result = {"quick": args.quick, **cpu_ratio(n, rounds)}
        path = bench.save_result(CPU_NAME, result, out_dir=args.out, device="cpu")
        print(f"saved {path}")
        return 0

    dev = pick_device(args.device)
    if args.overlap:
        return overlap(dev, args.quick, args.out)
    quick = args.quick
    n = args.n or (256 if quick else 16384)
    if quick and dev.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: a second thread only adds hand-off stalls, worse on a shared machine
    gpu = dev.type == "cuda"
    workers = [0, 1] if quick else [w for w in (0, 1, 2, 4, 8, 12, 16) if w <= args.max_workers]
    wmid = 1 if quick else min(8, max(workers))
    reps = dict(warmup=1, repeats=1 if quick else 2)
    result = {"quick": quick, "device": str(dev), "images": n, "cpu_count": os.cpu_count(), "skipped": [],
              "sections_s": {}}
    if not gpu:
        result["skipped"] += ["GPU decoding (nvJPEG)", "pin_memory (CPU target)",
                              "tuned model rate (bf16/channels_last need a GPU to mean anything)"]
        print("no CUDA: CPU smoke run; GPU decoding and pinned copies skipped", file=sys.stderr)
    t0 = time.perf_counter()

    def section(name):
        result["sections_s"][name] = round(time.perf_counter() - t0 - sum(result["sections_s"].values()), 2)

    data = D.load("synthetic", n_train=n, n_test=16).subset(n)
    store_for = LB.stores(data, progress=True)
    for cfg in (L.LoaderConfig(storage=s, image_format=f) for s in L.STORAGES for f in L.IMAGE_FORMATS):
        store_for(cfg)
    section("write stores")

    fmt_n = min(n, 128 if quick else 2048)
    result["formats"] = LB.format_table(data.subset(fmt_n), dev, **reps)
    result["format_images"] = fmt_n
    print(LB.format_markdown(result["formats"]))
    result["decoders"] = LB.decoder_table(data, dev, n=min(n, 64 if quick else 1024))
    section("formats and decoders")

    naive, packed = L.preset("naive"), L.preset("packed")
    # Workers sweeps keep their workers between epochs: the warm-up epoch pays the start-up, the timed epochs
    # show the steady rate (the persistent_workers sweep shows what a restart per epoch costs).
    steady = dict(persistent_workers=True)
    plan = [("workers", L.with_changes(naive, **steady), workers), ("workers", L.with_changes(packed, **steady), workers),
            ("pin_memory", L.with_changes(naive, workers=wmid), [False, True]),
            ("persistent_workers", L.with_changes(naive, workers=wmid), [False, True]),
            ("prefetch_factor", L.with_changes(naive, workers=wmid), [1, 2, 4] if not quick else [1, 2]),
            ("batch_size", packed, [64, 256, 1024] if not quick else [64, 256]),
            ("augment", packed, list(L.AUGMENTS))]
    if gpu:
        plan.append(("workers", L.preset("jpeg_gpu"), [w for w in workers if w in (0, 2, 8)]))
    total = sum(len(v) for _, _, v in plan)
    with tqdm(total=total, desc="loader sweeps") as bar:
        for field, base, values in plan:
            rows = LB.sweep(base, field, values, store_for, dev, progress=bar, **reps)
            for r in rows:
                r["loader"] = base.name
            result.setdefault(field, []).extend(rows)
            print(f"{field}, loader {base.name}:\n{LB.rows_table(rows, field)}")
    section("loader sweeps")

    with tqdm(total=2 if gpu else 1, desc="model consumption") as bar:
        result["model_rates"] = LB.model_rates(dev, quick=quick, progress=bar, n_train=None if quick else n)
    for k, v in result["model_rates"].items():
        print(f"{k}: {v['img_per_s']:,.0f} img/s (data resident on the device, batch {v['batch_size']})")
    section("model rates")

    with tqdm(total=3, desc="baseline rung") as bar:
        n_rung = 128 if quick else n
        folder = store_for(L.LoaderConfig(storage="folder", image_format="png")).path if n_rung == n else None
        result["baseline_rung"] = baseline_rung(dev, n_rung, quick, bar, folder)
    for r in result["baseline_rung"]:
        print(f"{r['variant']:<80} {r['img_per_s']:>9,.0f} img/s")
    section("baseline rung")

    corpus = B.synthetic_corpus(**B.corpus_size(quick))
    with tqdm(total=len(B.STRATEGIES), desc="padding strategies") as bar:
        result["padding"] = B.strategy_table(corpus, dev, quick=quick, progress=bar, **reps)
    result["corpus"] = {"sequences": len(corpus), "tokens": int(corpus.lengths.sum()),
                        "max_len": int(corpus.lengths.max()), "median_len": float(torch.tensor(
                            corpus.lengths).float().median())}
    print(B.strategy_markdown(result["padding"]))
    section("padding")

    result["total_s"] = round(time.perf_counter() - t0, 1)
    path = bench.save_result(NAME, result, out_dir=args.out, device=dev)
    print(f"\nsections (s): {result['sections_s']}  total {result['total_s']} s\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the top rung's steady step goes: the whole step beside the same step with one part taken away.

    python benchmarks/step_parts.py [--preset muon] [--rounds 5] [--out benchmarks/results] [--name step_parts]

One process builds the rung as `labkit train` does, compiles its forward (the step's own, and a second wrapper for the
parts below that bypass the step, which inductor's cache serves), then times, in alternating rounds, one epoch's
worth of steps (the rung's batches per epoch) of each of:
  rung          labkit's own step (`labkit.train._make_step`) on the epoch's batches: gather, augmentation,
                normalization, forward, loss, backward, optimizer and schedule; the ladder's steady figure
  fixed batch   the same step on one batch made before the clock starts: no data path
  no optimizer  forward, loss and backward on that batch, gradients dropped: no optimizer, no schedule
  model only    forward and backward of a plain sum of the logits: no loss function either
  data only     the epoch's batches alone
  optimizer     the step of an optimizer like the rung's (its own is private to the step) on the same weights,
                with fixed gradients of their shapes
Each part runs as one epoch between two device synchronizations, as the ladder times an epoch, and reports img/s
(median and spread over the rounds) and its share of the rung's time. A profiler then records one epoch of the
rung and splits its GPU time by kernel class (convolutions, inductor's Triton kernels, the optimizer, the rest)
beside the wall time, so time with no kernel running shows as the gap. The result is saved after every round.
Without a CUDA GPU the parts run eager at a tiny size (--quick), which checks the plumbing and measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # top_rung: its kernel classes
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

PARTS = ("rung", "fixed batch", "no optimizer", "model only", "data only", "optimizer")


def setup(preset: str, quick: bool, dev, batch: int | None = None):
    """The rung's config (its batch `batch` images where given), model, step, batches and a fixed batch, as
    `labkit.train.train` builds them."""
    import torch

    from labkit import data as D
    from labkit import train as T

    cfg = T.preset(preset)
    if batch is not None:
        cfg = T.with_changes(cfg, batch_size=batch)
    if quick:
        cfg = T.with_changes(cfg, batch_size=32, width=8, compile=None, n_train=128, n_test=64, precision="fp32",
                             channels_last=False, cudnn_benchmark=False)
    T.check_config(cfg, dev)
    ds = D.load(cfg.data, cfg.n_train, cfg.n_test, seed=0).subset(cfg.n_train, cfg.n_test)
    torch.manual_seed(cfg.seed)
    model, net, _ = T._build_model(cfg, ds.num_classes, dev)
    batches = T._Batches(cfg, ds, dev)
    steps = batches.steps_per_epoch
    step = T._make_step(cfg, model, net, T.peak_lr(cfg), steps * 1000, dev)
    x, y = next(iter(batches.epoch(0)))
    return cfg, model, step, batches, (x.clone(), y.clone()), steps


def part_fns(cfg, model, step, batches, fixed, dev):
    """One epoch of each part, as functions of the round."""
    import torch
    import torch.nn.functional as F

    from labkit import train as T

    x, y = fixed
    fwd = model if not cfg.compile else torch.compile(model, mode=None if cfg.compile == "default" else cfg.compile,
                                                       dynamic=False)
    graphs = cfg.compile in T.GRAPH_MODES
    # the step's optimizer is private to it: an equal one on the same weights, with gradients of their shapes that
    # every other part's zero_grad drops, so they are handed back before each optimizer epoch
    opt = T._make_optimizer(cfg, model, T.peak_lr(cfg))
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]

    def optimizer_epoch(n):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        for _ in range(n):
            opt.step()
        model.zero_grad(set_to_none=True)

    def backward_only(loss_fn):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with T._autocast(cfg, dev):
            out = fwd(x)
            loss = loss_fn(out)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def with_loss(out):
        return F.cross_entropy(out, y, label_smoothing=cfg.label_smoothing)

    def plain(out):
        return out.float().sum()

    n = batches.steps_per_epoch
    return {
        "rung": lambda r: [step(*b) for b in batches.epoch(r)],
        "fixed batch": lambda r: [step(x, y) for _ in range(n)],
        "no optimizer": lambda r: [backward_only(with_loss) for _ in range(n)],
        "model only": lambda r: [backward_only(plain) for _ in range(n)],
        "data only": lambda r: list(batches.epoch(r)),
        "optimizer": lambda r: optimizer_epoch(n),
    }


def kernel_split(step, batches, dev, epoch: int) -> dict:
    """GPU milliseconds per step by kernel class over one profiled epoch of the rung, and the wall ms per step."""
    from top_rung import kernel_times
    from torch.profiler import ProfilerActivity, profile

    from labkit.bench import synchronize

    synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        n = len([step(*b) for b in batches.epoch(epoch)])
        synchronize(dev)
        wall = time.perf_counter() - t0
    times, count = kernel_times(prof, n)
    by: dict[str, float] = {}
    for cls, ms in times.values():
        by[cls] = by.get(cls, 0.0) + ms
    other = sorted(((name, ms) for name, (cls, ms) in times.items() if cls == "other"), key=lambda kv: -kv[1])
    return {"steps": n, "wall_ms_per_step": round(1e3 * wall / n, 3), "kernel_ms_per_step": round(sum(by.values()), 3),
            "kernels_per_step": round(count / n, 1),
            "ms_per_step_by_class": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "other_top_ms_per_step": {k: round(v, 3) for k, v in other[:10]}}


def summarize(res: dict) -> None:
    """Median and spread of each part's img/s, and its median epoch time over the rung's."""
    parts = res["parts"]
    rung = statistics.median(parts["rung"]["epoch_s"]) if parts.get("rung", {}).get("epoch_s") else None
    for p in parts.values():
        if p["epoch_s"]:
            s = statistics.median(p["epoch_s"])
            ips = [res["images_per_epoch"] / t for t in p["epoch_s"]]
            p["img_per_s"] = round(statistics.median(ips), 1)
            p["img_per_s_spread"] = [round(min(ips), 1), round(max(ips), 1)]
            p["share_of_rung"] = round(s / rung, 4) if rung else None


def measure(res: dict, name: str, out: Path, cfg, model, step, batches, fixed, dev) -> None:
    """Warm every part, time them in alternating rounds (saving `res` after each), then profile the rung."""
    from labkit.bench import save_result, synchronize

    fns = part_fns(cfg, model, step, batches, fixed, dev)
    t0 = time.perf_counter()
    for fn in fns.values():  # compile, capture and warm every part before any clock runs
        fn(0)
    synchronize(dev)
    res["warm_up_s"] = round(time.perf_counter() - t0, 2)
    print(f"step_parts: {res['preset']} at batch {cfg.batch_size}, {res['steps_per_epoch']} steps an epoch; warmed "
          f"up in {res['warm_up_s']} s", flush=True)
    for r in range(res["rounds"]):
        for part in PARTS[r % len(PARTS):] + PARTS[:r % len(PARTS)]:
            synchronize(dev)
            t = time.perf_counter()
            fns[part](r + 1)
            synchronize(dev)
            res["parts"][part]["epoch_s"].append(round(time.perf_counter() - t, 5))
        summarize(res)
        save_result(name, res, out_dir=out, device=dev)
        print(f"round {r + 1}: " + ", ".join(f"{p} {res['parts'][p]['img_per_s']:,.0f}" for p in PARTS), flush=True)
    if dev.type == "cuda":
        res["profile"] = kernel_split(step, batches, dev, res["rounds"] + 1)
        print(f"profiled epoch: {res['profile']}")
    else:
        print("step_parts: no kernel profile without a CUDA GPU (skipped)")


def arguments(doc: str, name: str) -> argparse.ArgumentParser:
    """The options every step benchmark takes (preset, rounds, device, quick, out, name); `name`: its program."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="muon", help="the ladder rung to measure (default: muon, the top rung)")
    ap.add_argument("--batch", type=int, default=None, help="images per step instead of the preset's")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of every part (default 5)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny, eager: the plumbing only (the default on a CPU)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/ladder)")
    ap.add_argument("--name", default=name, help=f"result file stem (default {name})")
    return ap


def start(args, name: str):
    """(results folder, device, quick, the rung's setup) for a step benchmark's parsed options: the folder checked
    writable and the preset known before any model is built (LabkitError otherwise). Without a CUDA GPU it runs
    quick and says that it measures nothing."""
    from labkit.env import LabkitError, pick_device
    from labkit.outputs import check_writable
    from labkit.presets import preset

    preset(args.preset)  # an unknown name fails here, before the folder is made
    if args.batch is not None and args.batch < 1:
        raise LabkitError(f"--batch {args.batch}: give a positive number of images per step")
    out = check_writable(args.out or Path(__file__).parent / "results" / "ladder", "dir")
    dev = pick_device(args.device)
    quick = args.quick or dev.type != "cuda"
    if quick and not args.quick:
        print(f"{name}: no CUDA GPU, so the parts run eager at a tiny size: nothing here is a measurement")
    return out, dev, quick, setup(args.preset, quick, dev, None if quick else args.batch)


def main(argv=None) -> int:
    ap = arguments(__doc__, "step_parts")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from labkit.bench import save_result
    from labkit.env import LabkitError

    try:
        out, dev, quick, (cfg, model, step, batches, fixed, steps) = start(args, "step_parts")
    except LabkitError as e:
        print(f"step_parts: {e}", file=sys.stderr)
        return 2
    res = {"kind": "step_parts", "preset": args.preset, "quick": quick, "batch": cfg.batch_size,
           "steps_per_epoch": steps, "images_per_epoch": steps * cfg.batch_size, "rounds": args.rounds,
           "note": "one epoch of each part between device synchronizations, parts alternating per round",
           "parts": {p: {"epoch_s": []} for p in PARTS}}
    from labkit import train as T

    with T._switches(cfg):  # cuDNN's autotuning and inductor's settings, as the rung trains under them
        measure(res, args.name, out, cfg, model, step, batches, fixed, dev)
    path = save_result(args.name, res, out_dir=out, device=dev)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The recorded ladder: every rung on this device, plus the real-data accuracy check; saves result `ladder`.

    python benchmarks/ladder.py [--epochs 5] [--repeats 3] [--quick] [--out benchmarks/results]
    python benchmarks/ladder.py --ablation [--top muon] [--drop bf16,compile] [--quick]

--ablation runs the leave-one-out ablation from the top rung instead (the baseline for the target accuracy,
the top rung, then the top rung without each change) and saves result `ladder_ablation` (quick:
`ladder_ablation_quick`) with ladder_ablation.png; no real-data check.

Each rung runs --repeats times (default 3), in interleaved rounds whose order rotates by one rung per round;
every run is recorded, and the table and chart show the median img/s with its spread (min-max).
Writes <out>/ladder.json (environment, measured matmul peak, every rung's record, the real-data check) and
<out>/ladder.png (the chart the README shows). The real-data check trains the baseline recipe and the top
rung's numerics and optimizer (bf16, channels_last, resident data, Muon at its peak learning rate; batch 128
to suit 1,437 images, no compile) on scikit-learn's handwritten digits, which ship with the package: both must
pass 95% test accuracy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labkit import report
from labkit import train as T
from labkit.bench import RESULTS_DIR, save_result
from labkit.env import native_bf16, pick_device, quick_mode

REAL_DATA_PASS = 0.95


def real_data_check(dev, quick: bool) -> dict:
    """Baseline and top-rung numerics on real digits; 'passed' when both reach REAL_DATA_PASS."""
    base = T.TrainConfig(data="digits", epochs=4 if quick else 20, width=16 if quick else 64, batch_size=128)
    out = {}
    top = T.RUNG_NAMES[-1]
    for name, rung in (("baseline", "baseline"), ("top_numerics", top)):
        # the data is too small for the top rung's batch and compile time; its numerics, optimizer and peak
        # learning rate stay
        cfg = T.preset(rung, base)
        cfg = T.with_changes(cfg, batch_size=128, lr=T.peak_lr(cfg), lr_scaling="sqrt", workers=2, compile=None)
        if dev.type != "cuda":
            cfg = T.with_changes(cfg, precision="default")
        elif cfg.precision == "bf16" and not native_bf16(dev):
            cfg = T.with_changes(cfg, precision="fp16")  # no bf16 tensor cores (a T4): fp16 with loss scaling
        r = T.train(cfg, dev)
        out[name] = {"accuracy": r["accuracy"], "final_loss": r["final_loss"], "epochs": cfg.epochs,
                     "config": r["config"]}
        print(f"real data ({name}): test accuracy {100 * r['accuracy']:.1f}%", flush=True)
    out["threshold"] = REAL_DATA_PASS
    out["passed"] = all(v["accuracy"] >= REAL_DATA_PASS for k, v in out.items() if isinstance(v, dict))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=None, help="epochs per rung (default 5; quick 2)")
    ap.add_argument("--quick", action="store_true", help="CPU-sized run")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--rungs", help="comma-separated subset of rungs")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"runs per rung, interleaved (default {T.REPEATS}; quick {T.QUICK_REPEATS})")
    ap.add_argument("--no-real-data", action="store_true", help="skip the real-data accuracy check")
    ap.add_argument("--ablation", action="store_true", help="leave-one-out from the top rung instead of the ladder")
    ap.add_argument("--top", help="with --ablation: the rung to ablate from (default: the highest that runs here)")
    ap.add_argument("--drop", help="with --ablation: comma-separated changes to leave out (default: every one)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ladder"), help="results folder (default benchmarks/results/ladder)")
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    quick = args.quick or quick_mode()
    names = args.rungs.split(",") if args.rungs else None
    drop = args.drop.split(",") if args.drop else None
    if (args.top or drop) and not args.ablation:
        ap.error("--top and --drop go with --ablation")
    if args.ablation and names:
        ap.error("--rungs and --ablation do not mix: --ablation picks its runs (use --drop)")
    res = T.run_ladder(dev, quick=quick, names=names, epochs=args.epochs, repeats=args.repeats,
                       ablation=args.ablation, top=args.top, drop=drop)
    res["real_data"] = None if args.no_real_data or args.ablation else real_data_check(dev, quick)
    name = ("ladder_ablation" if args.ablation else "ladder") + ("_quick" if quick else "")
    rungs = res.pop("rungs")
    path = save_result(name, {k: v for k, v in res.items() if k != "env"} | {"rungs": rungs}, out_dir=args.out,
                       device=dev)
    env = res["env"]
    report.ladder_chart(rungs, Path(path).with_suffix(".png"), title=f"ResNet-18 ladder on {env['device_name']}",
                        note=report.ladder_chart_note(res))
    print(f"wrote {path} and {Path(path).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

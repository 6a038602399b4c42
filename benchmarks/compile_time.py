"""Cold and warm compile time of the ladder's compiled rungs on one device, each run in its own process.

    python benchmarks/compile_time.py [--steps 10] [--rungs compile,cuda_graphs,muon] [--out benchmarks/results]

The ladder's "first step s" is measured with whatever torch.compile cache the machine already has: on a machine
that compiled the model before, inductor reads its graphs and kernels back from disk in seconds. A student on a
fresh Colab machine waits for the cold compile. This benchmark runs each compiled rung's first `--steps` steps
twice, each time in a new process, against one new cache folder (labkit.bench.compile_cache): first cold (an
empty folder: a fresh machine), then warm (the folder the cold run filled: a restarted kernel). A new process
per run means one-time costs (the compile workers starting, cuDNN choosing its algorithms) land in every run as
they do for a student, not in whichever rung happens to go first. Both runs do the same training work, so the
difference is the compiling that a warm cache saves. CUDA-graph capture happens in the first steps too and is
counted in both. Saves result `compile_time`.

Without a GPU nothing is measured unless rungs are named: a cold compile of ResNet-18 takes minutes on a laptop CPU,
and the CUDA-graph rungs need a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit import data as D
from labkit import train as T
from labkit.bench import RESULTS_DIR, compile_cache, save_result, synchronize
from labkit.env import LabkitError, pick_device

COMPILED = [n for n in T.RUNG_NAMES if T.preset(n).compile]


def first_steps(cfg: T.TrainConfig, dev, ds: D.ImageData, steps: int, warmup=None, precompiled=None) -> dict:
    """Seconds of the first step and of the first `steps` steps (one epoch, no evaluation); `warmup`: a cuDNN
    warm-up the caller started (`labkit.faststart.cudnn_warmup.start`), reported as `cudnn_warmup`; `precompiled`: the
    forward loaded from its file (`labkit.faststart.precompiled.load`) instead of torch.compile."""
    cfg = T.with_changes(cfg, epochs=1, max_steps=steps, evaluate=False)
    synchronize(dev)
    t0 = time.perf_counter()
    r = T.train(cfg, dev, dataset=ds, warmup=warmup, precompiled=precompiled)
    synchronize(dev)
    return {"first_step_s": r["first_step_s"], "steps_s": time.perf_counter() - t0, "steps": r["steps"],
            "cudnn_warmup": r["cudnn_warmup"]}


def measure(cfg: T.TrainConfig, dev, steps: int) -> dict:
    """One rung cold, then warm, each in a new process, against one new cache folder."""
    out = {"batch_size": cfg.batch_size, "compile": cfg.compile, "optimizer": cfg.optimizer}
    with tempfile.TemporaryDirectory(prefix="labkit-compile-") as folder:
        for kind in ("cold", "warm"):
            record = Path(folder) / f"{kind}.json"
            cmd = [sys.executable, __file__, "--child", cfg.name, "--cache", str(Path(folder) / "cache"),
                   "--record", str(record), "--steps", str(steps), "--device", str(dev)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0 or not record.exists():
                tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
                raise LabkitError(f"{cfg.name} ({kind}) failed in its own process: {tail[0]}")
            out[kind] = json.loads(record.read_text())
            print(f"{cfg.name:<14} {kind}: first step {out[kind]['first_step_s']:7.2f} s, "
                  f"first {out[kind]['steps']} steps {out[kind]['steps_s']:7.2f} s", flush=True)
    out["saved_by_warm_cache_s"] = out["cold"]["steps_s"] - out["warm"]["steps_s"]
    return out


def child(name: str, cache: str, record: str, steps: int, device: str) -> int:
    """One run in this process: rung `name`'s first `steps` steps with torch.compile's caches in `cache`."""
    dev = pick_device(device)
    cfg = T.plan_ladder(dev, quick=False, names=[name]).rungs[0]
    ds = D.load("synthetic")
    with compile_cache(cache):
        Path(record).write_text(json.dumps(first_steps(cfg, dev, ds, steps)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per run (default 10)")
    ap.add_argument("--rungs", default=None, help=f"comma-separated compiled rungs (default: {','.join(COMPILED)})")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ladder"), help="results folder (default benchmarks/results/ladder)")
    ap.add_argument("--child", metavar="RUNG", help=argparse.SUPPRESS)  # one run, started by measure()
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.cache, args.record, args.steps, args.device)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    names = args.rungs.split(",") if args.rungs else COMPILED
    for n in names:
        if n not in COMPILED:
            ap.error(f"{n!r} is not a compiled rung: choose from {', '.join(COMPILED)}")
    dev = pick_device(args.device)
    if dev.type != "cuda" and not args.rungs:
        print("compile_time: no GPU, so nothing is measured (skipped): a cold compile of ResNet-18 takes minutes "
              "on a CPU and the CUDA-graph rungs need a GPU; name --rungs compile to measure it anyway")
        return 0
    plan = T.plan_ladder(dev, quick=False, names=names)
    for name, why in plan.skipped:
        print(f"compile_time: skipped {name}: {why}")
    D.load("synthetic")  # generated and cached once, before the runs that read it
    res = {"kind": "compile_time", "steps": args.steps, "rungs": {}}
    for cfg in plan.rungs:
        res["rungs"][cfg.name] = measure(cfg, dev, args.steps)
    path = save_result("compile_time", res, out_dir=args.out, device=dev)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabkitError as e:
        sys.exit(f"compile_time: {e}")

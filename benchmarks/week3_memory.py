"""Week 3's memory anomaly, measured: why the recorded ResNet-18 peaks rose with AMP and with checkpointing.

    python benchmarks/week3_memory.py            # on a CUDA GPU: about 2 minutes on an H100
    python benchmarks/week3_memory.py --quick    # tiny model, batch 8 (still CUDA: it reads CUDA's allocator)

week3_amp.json (before amp.memory_breakdown) recorded ResNet-18 peaks of 1.5 GiB in fp32 and 8.1 GiB in bf16
at batch 128, growing in the order it measured the precisions, while the activations it counted halved. This
script measures the same step two ways and saves week3_memory.json:

- "isolated": each (precision, cudnn.benchmark) in a fresh process, split by amp.memory_breakdown (params,
  grads, optimizer state, activations, workspace, leftovers) after two warm-up steps;
- "in sequence": every precision in one process, in week3_amp's order and with its old procedure (one warm-up
  step, then the absolute torch.cuda.max_memory_allocated of a step), with what was resident before each.

If the sequence's peaks grow while the isolated ones do not, the recorded peaks counted what earlier
configurations left allocated; the isolated workspace column says how much cuDNN's chosen algorithms take.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch

from labkit import amp, bench
from labkit.env import LabkitError, pick_device, torch_switches
from labkit.models import resnet18

NAME = "week3_memory"
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")  # week3_amp.py's measuring order


def _trainer(precision: str, quick: bool, batch: int, dev):
    torch.manual_seed(0)
    tr = amp.AmpTrainer(resnet18(width=8 if quick else 64), precision, device=dev)
    x, y = torch.randn(batch, 3, 32, 32, device=dev), torch.randint(0, 10, (batch,), device=dev)
    return tr, x, y


def isolated(precision: str, cudnn_benchmark: bool, quick: bool, batch: int) -> dict:
    """One configuration's memory_breakdown, in this (fresh) process."""
    dev = pick_device("cuda")
    with torch_switches(cudnn_benchmark=cudnn_benchmark):
        tr, x, y = _trainer(precision, quick, batch, dev)
        return amp.memory_breakdown(tr, x, y, warmup=2)


def in_sequence(quick: bool, batch: int, dev) -> list[dict]:
    """week3_amp.py's old procedure, every precision in one process: absolute peaks and what was resident."""
    rows = []
    with torch_switches(cudnn_benchmark=True):
        for p in PRECISIONS:
            tr, x, y = _trainer(p, quick, batch, dev)
            tr.step(x, y)
            acts = amp.activation_bytes(tr.model, x, p)
            peak = amp.cuda_peak_bytes(lambda tr=tr, x=x, y=y: tr.step(x, y), dev)
            rows.append({"precision": p, "absolute_peak": peak["peak_bytes"], "activations": acts,
                         "resident_before": peak["resident_before_bytes"]})
            del tr, x, y
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "notebooks"), help="folder for week3_memory.json")
    ap.add_argument("--quick", action="store_true", help="width-8 ResNet-18, batch 8")
    ap.add_argument("--one", metavar="PRECISION,BENCHMARK", help=argparse.SUPPRESS)  # the child's job
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("week3_memory: needs a CUDA GPU (it reads CUDA's caching allocator)", file=sys.stderr)
        return 2
    batch = 8 if args.quick else 128
    if args.one:
        p, b = args.one.split(",")
        print(json.dumps(isolated(p, b == "1", args.quick, batch)))
        return 0
    dev = pick_device("cuda")
    result = {"model": "ResNet-18 CIFAR" + (" width 8" if args.quick else ""), "batch": batch, "isolated": []}
    for b in (True, False):
        for p in PRECISIONS:
            cmd = [sys.executable, __file__, "--one", f"{p},{int(b)}"] + (["--quick"] if args.quick else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = {"precision": p, "cudnn_benchmark": b, **json.loads(out)}
            result["isolated"].append(row)
            print(f"isolated {p:<5} benchmark={b!s:<5} peak {row['peak'] / 2**30:.2f} GiB: activations "
                  f"{row['activations'] / 2**30:.2f}, workspace {row['workspace'] / 2**30:.2f}, leftovers "
                  f"{row['other_resident'] / 2**30:.2f}", flush=True)
    result["in_sequence"] = in_sequence(args.quick, batch, dev)
    for r in result["in_sequence"]:
        print(f"in sequence {r['precision']:<5} absolute peak {r['absolute_peak'] / 2**30:.2f} GiB, resident before "
              f"{r['resident_before'] / 2**30:.2f} GiB", flush=True)
    print(f"saved {bench.save_result(NAME, result, out_dir=args.out, device=dev)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabkitError as e:
        print(f"week3_memory: error: {e}", file=sys.stderr)
        sys.exit(2)

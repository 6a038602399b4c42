"""Week 3's memory snapshots: a few ResNet-18 training steps on a CUDA GPU, fp32 against bf16 autocast, recorded
with the allocator's history so that a student without a GPU reads the same memory.

    python benchmarks/week3_snapshot.py --out benchmarks/results/notebooks/week3_snapshot    # on a CUDA GPU, under a minute

For each precision, in a fresh process (so the trace starts from an empty allocator and holds every byte):
`torch.cuda.memory._record_memory_history(max_entries=..., stacks="python")`, labkit's ResNet-18 (CIFAR variant,
width 64) built and trained for `--steps` steps of `amp.AmpTrainer` (Adam; fp32 strict with TF32 off, or bf16
autocast) on random 32x32 images, then `torch.cuda.memory._snapshot()`. It writes into --out:

- resnet18_<precision>.pickle.gz: the snapshot (gzipped pickle; `python -m torch.cuda._memory_viz trace_plot`
  and pytorch.org/memory_viz read it once gunzipped; `labkit.memory_snapshot.load` reads it as it is);
- resnet18_<precision>.html: `torch.cuda._memory_viz.trace_plot` of it (the page loads MemoryViz.js from a CDN);
- week3_snapshot.json: card, torch version, git commit, command, batch, steps, and per precision the peak that
  `torch.cuda.max_memory_allocated` saw, the peak `labkit.memory_snapshot` reads from the trace, the trace length,
  the largest allocations with their line of code, and the artifact sizes.

Each event keeps at most --keep-frames stack frames (innermost first: the line of model code that asked is among
them), and equal frames are pickled once, so the artifacts stay a few MB. cudnn.benchmark stays off, so cuDNN's
autotuning trials do not fill the trace. A machine without CUDA is refused before any work.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

NAME = "week3_snapshot"
PRECISIONS = ("fp32", "bf16")


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the snapshots, HTML pages and week3_snapshot.json")
    ap.add_argument("--batch", type=int, default=128, help="images per step (default 128)")
    ap.add_argument("--steps", type=int, default=3, help="training steps recorded (default 3; Adam's state is "
                                                          "created in the first)")
    ap.add_argument("--max-entries", type=int, default=200_000, help="allocator events kept (a full ring buffer "
                                                                     "is an error: raise it)")
    ap.add_argument("--keep-frames", type=int, default=16, help="stack frames kept per event (innermost first)")
    ap.add_argument("--one", choices=PRECISIONS, help=argparse.SUPPRESS)  # the child process: one precision
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.max_entries < 1000 or args.keep_frames < 1:
        ap.error("--batch, --steps, --keep-frames must be >= 1 and --max-entries >= 1000")
    return args


def _refuse_without_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("week3_snapshot.py records CUDA's caching allocator: this machine has no CUDA GPU "
                 f"(torch {torch.__version__}). Run it on a GPU; on a CPU, read the recorded snapshots in "
                 "benchmarks/results/notebooks/week3_snapshot/ with labkit.memory_snapshot.")


def _trim(snapshot: dict, keep: int) -> dict:
    """The snapshot with every frame list cut to its `keep` innermost frames (sizes and order untouched), and
    equal frames made one shared dict: pickle then writes each distinct frame once and refers to it after."""
    shared: dict = {}

    def frames(fs):
        return [shared.setdefault((f.get("filename"), f.get("line"), f.get("name")), f) for f in fs[:keep]]

    for trace in snapshot["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = frames(e["frames"])
    for seg in snapshot["segments"]:
        seg.pop("frames", None)
        for b in seg.get("blocks", []):
            if "frames" in b:
                b["frames"] = frames(b["frames"])
    return snapshot


def record_one(precision: str, args) -> dict:
    """Record `args.steps` steps of one precision in this process and write its artifacts; returns its row."""
    import torch
    from torch.cuda import _memory_viz

    from labkit import amp, memory_snapshot
    from labkit.env import torch_switches
    from labkit.models import resnet18

    out = Path(args.out)
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    with torch_switches(cudnn_benchmark=False):
        torch.manual_seed(0)
        tr = amp.AmpTrainer(resnet18(width=64), precision, device=dev)
        x = torch.randn(args.batch, 3, 32, 32, device=dev)
        y = torch.randint(0, 10, (args.batch,), device=dev)
        for _ in range(args.steps):
            tr.step(x, y)
        torch.cuda.synchronize(dev)
    allocator_peak = torch.cuda.max_memory_allocated(dev)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = len(snap["device_traces"][dev.index or 0])
    if events >= args.max_entries:
        raise SystemExit(f"{precision}: the trace filled its ring buffer ({events} events): older events were "
                         f"overwritten; run again with --max-entries {4 * args.max_entries}")
    snap = _trim(snap, args.keep_frames)
    pkl = out / f"resnet18_{precision}.pickle.gz"
    with gzip.open(pkl, "wb", compresslevel=9) as f:
        pickle.dump(snap, f)
    html = out / f"resnet18_{precision}.html"
    html.write_text(_memory_viz.trace_plot(snap))
    read = memory_snapshot.peak(snap, dev.index or 0)
    largest = memory_snapshot.largest_allocations(snap, 5, dev.index or 0)
    return {"precision": precision, "allocator_peak_bytes": allocator_peak, "trace_peak_bytes": read["peak_bytes"],
            "trace_baseline_bytes": read["baseline_bytes"], "events": events, "peak_event": read["peak_event"],
            "largest": [{"size": r["size"], "from": memory_snapshot.user_frame(r["frames"])} for r in largest],
            "pickle": pkl.name, "pickle_bytes": pkl.stat().st_size, "html": html.name,
            "html_bytes": html.stat().st_size}


def main(argv=None) -> int:
    args = _parse(argv)
    _refuse_without_cuda()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:  # the child: one precision, its row as the last line of stdout
        print(json.dumps(record_one(args.one, args)))
        return 0
    import torch

    from labkit import bench

    rows = []
    for p in PRECISIONS:  # a fresh process each: the trace starts from an empty allocator
        cmd = [sys.executable, __file__, "--one", p, "--out", str(out), "--batch", str(args.batch), "--steps",
               str(args.steps), "--max-entries", str(args.max_entries), "--keep-frames", str(args.keep_frames)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"recording {p} failed (exit {done.returncode}); its error is above")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{p}: peak {r['allocator_peak_bytes'] / 2**20:,.1f} MiB (allocator) / "
              f"{r['trace_peak_bytes'] / 2**20:,.1f} MiB (read from the trace), {r['events']} events, "
              f"{r['pickle_bytes'] / 2**20:.1f} MiB pickle, {r['html_bytes'] / 2**20:.1f} MiB html")
    data = {"model": "ResNet-18 CIFAR variant (labkit.models.resnet18, width 64)", "batch": args.batch,
            "steps": args.steps, "optimizer": "Adam (labkit.amp.AmpTrainer)", "cudnn_benchmark": False,
            "max_entries": args.max_entries, "keep_frames": args.keep_frames, "card": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "rows": rows}
    path = bench.save_result(NAME, data, out_dir=out, command=" ".join(["python", *sys.argv]), device="cuda")
    print(f"wrote {path} and {2 * len(rows)} artifacts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

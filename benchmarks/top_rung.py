"""Variants of the top rung side by side: where the remaining time goes, and what batch/LR keeps accuracy.

    python benchmarks/top_rung.py [--epochs 5] [--out benchmarks/results]

Part 1 times the compiled model step alone (random data already on the GPU, fused SGD) at several batch
sizes, so the cost of the data pipeline and the Python loop shows as the gap to the full pipeline.
Part 2 trains full pipelines that differ from the cuda_graphs rung in batch size, learning rate or compile
mode, reporting steady img/s and test accuracy after the same number of epochs. Saves result `top_rung`.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from labkit import data as D
from labkit import train as T
from labkit.bench import save_result, time_fn
from labkit.env import pick_device, torch_switches
from labkit.models import resnet18, train_flops_per_image


def model_step_img_per_s(dev, batch: int, mode: str | None, channels_last: bool = True) -> float:
    """img/s of forward + backward + fused SGD on one resident random batch (no data pipeline)."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = resnet18().to(dev).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, fused=True)
    fwd = torch.compile(model, mode=mode) if mode else model
    x = torch.randn(batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step():
        if mode in ("reduce-overhead", "max-autotune"):  # both replay CUDA graphs
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with torch_switches(cudnn_benchmark=True):
        t = time_fn(step, device=dev, warmup=15, repeats=30)
    return batch / t.median


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-model-only", action="store_true")
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    if dev.type != "cuda":
        print("top_rung: this benchmark studies the GPU top rung; on CPU there is nothing to measure (skipped)")
        return 0
    peak = T.peak_matmul_tflops(dev)
    flops = train_flops_per_image(resnet18())
    model_only = {}
    if not args.skip_model_only:
        for batch, mode, cl in [(256, "reduce-overhead", True), (512, "reduce-overhead", True),
                                (1024, "reduce-overhead", True), (512, "max-autotune", True)]:
            v = model_step_img_per_s(dev, batch, mode, cl)
            model_only[f"{batch}-{mode}-{'nhwc' if cl else 'nchw'}"] = v
            print(f"model step only, batch {batch}, compile {mode}, {'NHWC' if cl else 'NCHW'}: {v:,.0f} img/s "
                  f"(MFU {100 * v * flops / peak / 1e12:.1f}%)", flush=True)
    ds = D.load("synthetic")
    base = T.with_changes(T.preset("cuda_graphs"), epochs=args.epochs)
    variants = {
        "rung (batch 512, lr 0.1)": {},
        "batch 256, lr 0.1": dict(batch_size=256),
        "batch 1024, lr 0.05": dict(batch_size=1024, lr=0.05),
    }
    rows = {}
    for label, ch in variants.items():
        r = T.train(T.with_changes(base, **ch), dev, dataset=ds, peak_tflops=peak)
        rows[label] = {k: r[k] for k in ("img_per_s", "img_per_s_all", "first_step_s", "accuracy", "final_loss",
                                         "mfu", "peak_mem_bytes")} | {"changes": ch}
        print(f"{label:<28} {r['img_per_s']:>9,.0f} img/s  acc {100 * r['accuracy']:.1f}%  "
              f"MFU {100 * r['mfu']:.1f}%", flush=True)
    path = save_result("top_rung", {"kind": "top_rung", "epochs": args.epochs, "peak_bf16_tflops": peak,
                                    "model_step_img_per_s": model_only, "variants": rows}, out_dir=args.out,
                       device=dev)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

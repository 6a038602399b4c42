"""Variants of the top rung side by side: where the remaining time goes, and what would make it faster.

    python benchmarks/top_rung.py [--epochs 5] [--out benchmarks/results] [--parts model kernels optimizer train]
    python benchmarks/top_rung.py --parts train --seeds 2 --variant "my recipe:batch_size=2048,optimizer=adamw-fused"

Part `model` times the compiled model step alone (random data already on the GPU, fused SGD) for several
compile settings and batch sizes, each compiled from scratch with static shapes, so the cost of the data
pipeline and the Python loop shows as the gap to the full pipeline.
Part `kernels` profiles that step (compiled without CUDA graphs, so every kernel is visible) and splits the GPU
time per step into convolutions and matmuls (cuDNN/cuBLAS), Triton kernels (inductor's fused BatchNorm, ReLU and
adds), the optimizer and the rest, next to the wall time per step.
Part `optimizer` times the optimizer step alone on ResNet-18's parameters: fused SGD, fused AdamW, and Muon
both eager and replayed as one CUDA graph.
Part `train` trains full pipelines (augmentation included) that differ from the cuda_graphs rung in one
or two settings (TRAIN_VARIANTS, or --variant LABEL:FIELD=VALUE,...), reporting steady img/s and test accuracy
after the same number of epochs, per seed with --seeds;
the max-autotune pipeline runs too when its model step beat the rung's.
The result `top_rung` is saved after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit import data as D
from labkit import train as T
from labkit.bench import RESULTS_DIR, save_result, time_fn
from labkit.diagnosis import load_trace
from labkit.env import LabkitError, pick_device, torch_switches
from labkit.models import resnet18, train_flops_per_image

# label: (batch, torch.compile mode, inductor config patches[, resnet18 keyword arguments])
MODEL_VARIANTS = {
    "512-reduce-overhead": (512, "reduce-overhead", {}),
    "256-reduce-overhead": (256, "reduce-overhead", {}),
    "1024-reduce-overhead": (1024, "reduce-overhead", {}),
    "512-reduce-overhead-coordinate-descent": (512, "reduce-overhead", {"coordinate_descent_tuning": True}),
    "512-max-autotune": (512, "max-autotune", {}),
    "4096-reduce-overhead": (4096, "reduce-overhead", {}),
    "4096-reduce-overhead-matmul-edges": (4096, "reduce-overhead", {}, {"matmul_edges": True}),
    "4096-reduce-overhead-matmul-edges-coordinate-descent": (4096, "reduce-overhead", {"coordinate_descent_tuning": True},
                                                             {"matmul_edges": True}),
    "4096-max-autotune-matmul-edges": (4096, "max-autotune", {}, {"matmul_edges": True}),
    # inductor's other ways with the memory-bound BatchNorm/ReLU/add kernels (27% of the rung's GPU time)
    "4096-reduce-overhead-cooperative-reductions": (4096, "reduce-overhead", {"triton.cooperative_reductions": True}),
    "4096-reduce-overhead-multi-kernel": (4096, "reduce-overhead", {"triton.multi_kernel": 1}),
    "4096-reduce-overhead-aggressive-fusion": (4096, "reduce-overhead", {"aggressive_fusion": True}),
    "4096-reduce-overhead-benchmark-fusion": (4096, "reduce-overhead", {"benchmark_fusion": True}),
    "4096-reduce-overhead-max-autotune-pointwise": (4096, "reduce-overhead", {"max_autotune_pointwise": True}),
    "4096-eager": (4096, None, {}),
    "4096-eager-matmul-edges": (4096, None, {}, {"matmul_edges": True}),
}
# large-batch aids: blocks start as identities, no weight decay on BatchNorm/biases
RECIPE = dict(zero_init_residual=True, bn_weight_decay=False)
# the best large-batch recipe of top_rung_adamw.json: peak lr 0.004 (1e-3 x sqrt(2048/128)), decoupled decay 0.05
ADAMW_2048 = dict(batch_size=2048, lr=1e-3, optimizer="adamw-fused", weight_decay=0.05, **RECIPE)
# the ladder's muon rung (batch 4096) is the reference Muon recipe; the scans vary it from batch 2048
MUON_4096 = dict(T.LADDER[-1][2])
MUON_2048 = dict(MUON_4096, batch_size=2048)
# label: changes to the cuda_graphs rung for a full-pipeline run
TRAIN_VARIANTS = {
    "rung (batch 512)": {},
    "batch 1024, lr 0.05": dict(batch_size=1024, lr=0.05),
    "batch 1024, lr 0.07": dict(batch_size=1024, lr=0.07),
    "batch 1024, lr 0.035": dict(batch_size=1024, lr=0.035),
    "batch 1024, lr 0.05, warm-up 0.3": dict(batch_size=1024, lr=0.05, warmup_frac=0.3),
    "rung + coordinate-descent tuning": dict(compile_tuning=True),
    "batch 1024, lr 0.05 + tuning": dict(batch_size=1024, lr=0.05, compile_tuning=True),
    "batch 2048, lr 0.05": dict(batch_size=2048, lr=0.05),
    "batch 2048, lr 0.05 + tuning": dict(batch_size=2048, lr=0.05, compile_tuning=True),
    "rung, 10 epochs": dict(epochs=10),
    "batch 1024, lr 0.05, 10 epochs": dict(batch_size=1024, lr=0.05, epochs=10),
    "batch 2048, lr 0.05, 10 epochs": dict(batch_size=2048, lr=0.05, epochs=10),
    "batch 2048, zero-init + no BN decay": dict(batch_size=2048, lr=0.05, **RECIPE),
    "batch 2048, zero-init + no BN decay, lr 0.1": dict(batch_size=2048, lr=0.1, **RECIPE),
    "batch 1024, zero-init + no BN decay": dict(batch_size=1024, lr=0.05, **RECIPE),
    "batch 2048, AdamW": ADAMW_2048,
    "batch 2048, AdamW + tuning": dict(ADAMW_2048, compile_tuning=True),
    "batch 2048, Muon": MUON_2048,
    "batch 2048, Muon, lr 8e-3": dict(MUON_2048, lr=8e-3),
    "batch 2048, Muon + tuning": dict(MUON_2048, compile_tuning=True),
    "batch 4096, Muon": MUON_4096,
    "batch 4096, Muon, lr 8e-3": dict(MUON_4096, lr=8e-3),
    "batch 4096, Muon + tuning": dict(MUON_4096, compile_tuning=True),
    "batch 4096, Muon, matmul edges": dict(MUON_4096, matmul_edges=True),
}
# what a plain run measures (the rest on request): the rung against the best large-batch recipes found so far
DEFAULT_TRAIN_VARIANTS = ("rung (batch 512)", "batch 2048, lr 0.05", "batch 2048, zero-init + no BN decay, lr 0.1",
                          "batch 2048, AdamW", "batch 1024, zero-init + no BN decay")
KERNEL_CLASSES = (  # first match wins; names as the CUDA profiler reports them
    ("conv/matmul (cuDNN, cuBLAS)", ("conv", "xmma", "implicit_gemm", "gemm", "nvjet", "cutlass", "wgrad", "dgrad")),
    ("Triton (fused BN/ReLU/add)", ("triton",)),
    ("optimizer", ("multi_tensor", "sgd", "adam", "foreach")),
)


def kernel_times(prof, steps: int) -> tuple[dict[str, tuple[str, float]], int]:
    """From a finished torch.profiler run over `steps` steps: {kernel name (first 100 characters): (its class in
    KERNEL_CLASSES, or "other"; GPU milliseconds per step)}, and how many kernels ran."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = load_trace(path)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    times: dict[str, tuple[str, float]] = {}
    for e in kernels:
        name = str(e.get("name", ""))
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in name.lower() for k in keys)), "other")
        times[name[:100]] = (cls, times.get(name[:100], (cls, 0.0))[1] + e["dur"] / 1e3 / steps)
    return times, len(kernels)


def _compiled_step(dev, batch: int, mode: str | None, model_kw: dict | None = None):
    torch._dynamo.reset()  # each variant compiles from scratch: no shapes or modes left over from the last
    torch.manual_seed(0)
    model = resnet18(**(model_kw or {})).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, fused=True)
    fwd = torch.compile(model, mode=mode, dynamic=False) if mode else model
    x = torch.randn(batch, 3, 32, 32, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step():
        if mode in T.GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def optimizer_steps(dev) -> dict:
    """Milliseconds per optimizer step alone on ResNet-18's parameters (channels_last, as the rung has them).

    Muon runs eager and as one replayed CUDA graph, next to the fused SGD and AdamW kernels it competes with.
    """
    model = resnet18().to(dev, memory_format=torch.channels_last)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rung = T.preset("cuda_graphs")
    opts = {"sgd-fused": T._make_optimizer(rung, model, 0.1),
            "adamw-fused": T._make_optimizer(T.with_changes(rung, **ADAMW_2048), model, 1e-3)}
    for label, graph in (("muon (eager)", False), ("muon (CUDA graph)", True)):
        opt = T._make_optimizer(T.with_changes(rung, **MUON_2048), model, 1e-3)
        opt.cuda_graph = graph
        opts[label] = opt
    out = {}
    for label, opt in opts.items():
        t = time_fn(opt.step, device=dev, warmup=3, repeats=30)
        out[label] = {"ms": 1e3 * t.median, "iqr_ms": 1e3 * t.iqr}
        print(f"optimizer step alone, {label:<18} {1e3 * t.median:7.3f} ms (IQR {1e3 * t.iqr:.3f})", flush=True)
    out["muon (CUDA graph)"]["captured"] = opts["muon (CUDA graph)"]._graph is not None
    return out


def model_step(dev, batch: int, mode: str | None, inductor: dict, model_kw: dict | None = None) -> dict:
    """img/s of forward + backward + fused SGD on one resident random batch, and the compile seconds."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(inductor) if inductor else contextlib.nullcontext(), \
            torch_switches(cudnn_benchmark=True):
        step = _compiled_step(dev, batch, mode, model_kw)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(dev)
        compile_s = time.perf_counter() - t0
        t = time_fn(step, device=dev, warmup=15, repeats=30)
    return {"img_per_s": batch / t.median, "ms_per_step": 1e3 * t.median, "spread_ms": 1e3 * t.iqr,
            "compile_s": compile_s}


def kernel_breakdown(dev, batch: int = 512, steps: int = 5, model_kw: dict | None = None) -> dict:
    """GPU time per step by kernel class for the compiled step without CUDA graphs (ms), and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    with torch_switches(cudnn_benchmark=True):
        step = _compiled_step(dev, batch, "default", model_kw)
        for _ in range(10):
            step()
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
    times, count = kernel_times(prof, steps)
    by_class: dict[str, float] = {}
    for cls, ms in times.values():
        by_class[cls] = by_class.get(cls, 0.0) + ms
    by_name = {name: ms for name, (_, ms) in times.items()}
    total = sum(by_class.values())
    return {"batch": batch, "wall_ms_per_step": 1e3 * wall / steps, "kernel_ms_per_step": total,
            "kernels_per_step": count / steps,
            "ms_per_step_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "share_by_class": {k: v / total for k, v in by_class.items()} if total else {},
            "top_kernels_ms_per_step": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12])}


def conv_shape_times(dev, batch: int) -> list[dict]:
    """Milliseconds and TFLOP/s of each distinct convolution of the training step at `batch` (bf16, channels_last,
    cuDNN autotuned): forward, input gradient (where training computes it) and weight gradient, each alone, with
    how many times the step runs it.
    """
    from labkit.faststart import cudnn_warmup as CW

    calls = CW.conv_calls(T.with_changes(T.preset("muon"), batch_size=batch))
    rows = []
    with torch_switches(cudnn_benchmark=True):
        for sh in dict.fromkeys(calls):
            passes, macs = _conv_passes(sh, dev)
            row = {"input": list(sh.input), "weight": list(sh.weight), "stride": list(sh.stride),
                   "per_step": calls.count(sh)}
            for name, fn in passes.items():
                t = time_fn(fn, device=dev, warmup=3, repeats=10).median
                row[name] = {"ms": 1e3 * t, "tflops": 2 * macs / t / 1e12}
            rows.append(row)
            print(f"conv {sh.input} x {sh.weight} stride {sh.stride[0]} (x{row['per_step']}): "
                  + ", ".join(f"{n} {row[n]['ms']:.3f} ms ({row[n]['tflops']:.0f} TFLOP/s)" for n in passes), flush=True)
    return rows


def _conv_passes(sh, dev) -> tuple[dict, int]:
    """The passes training runs of convolution `sh` as callables on random bf16 channels_last data, and its MACs."""
    x = torch.randn(sh.input, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(sh.weight, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x, w, None, sh.stride, sh.padding, sh.dilation, sh.groups)
    gy = torch.randn_like(y)
    args = (None, list(sh.stride), list(sh.padding), list(sh.dilation), False, [0, 0], sh.groups)

    def backward(mask):
        return lambda: torch.ops.aten.convolution_backward(gy, x, w, *args, mask)

    passes = {"forward": lambda: F.conv2d(x, w, None, sh.stride, sh.padding, sh.dilation, sh.groups),
              "weight grad": backward([False, True, False])}
    if sh.input_grad:
        passes["input grad"] = backward([True, False, False])
    return passes, y.numel() * w[0].numel()


def train_variant(base, changes: dict, dev, ds, peak: float, seeds: int, label: str) -> dict:
    """Train `base` with `changes` once per seed; img/s and accuracy per seed, their medians and the worst accuracy.

    A run that fails (a diverging learning rate, say) is recorded with its error and the other seeds still run.
    """
    runs = []
    for seed in range(seeds):
        torch._dynamo.reset()
        try:
            r = T.train(T.with_changes(base, seed=seed, **changes), dev, dataset=ds, peak_tflops=peak)
        except Exception as e:  # noqa: BLE001 - one diverging run must not lose the others
            runs.append({"seed": seed, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
            print(f"{label:<44} seed {seed}: FAILED {runs[-1]['error']}", flush=True)
            continue
        runs.append({"seed": seed} | {k: r[k] for k in ("img_per_s", "img_per_s_all", "first_step_s", "accuracy",
                                                         "final_loss", "mfu", "peak_mem_bytes")})
        mfu = f"  MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        print(f"{label:<44} seed {seed}: {r['img_per_s']:>9,.0f} img/s  acc {100 * r['accuracy']:.1f}%{mfu}", flush=True)
    ok = [r for r in runs if "error" not in r]
    out = {"changes": changes, "runs": runs}
    if not ok:
        return out | {"error": runs[-1]["error"]}
    # the first seed's fields stay at the top level, as in single-seed results
    out |= {k: v for k, v in ok[0].items() if k != "seed"}
    if seeds > 1:
        out |= {"img_per_s_median": statistics.median(r["img_per_s"] for r in ok),
                "accuracy_median": statistics.median(r["accuracy"] for r in ok),
                "accuracy_min": min(r["accuracy"] for r in ok) if len(ok) == len(runs) else None}
        print(f"{label:<44} over {len(ok)}/{seeds} seeds: median {out['img_per_s_median']:,.0f} img/s, "
              f"accuracy median {100 * out['accuracy_median']:.1f}%", flush=True)
    return out


def _model_variant(dev, label: str) -> dict:
    batch, mode, patch, *kw = MODEL_VARIANTS[label]
    try:
        return model_step(dev, batch, mode, patch, kw[0] if kw else None)
    except Exception as e:  # one variant failing (an autotune error, say) must not lose the others
        r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        print(f"model step only, {label}: FAILED {r['error']}", flush=True)
        return r


def _print_kernels(k: dict, what: str = "") -> None:
    print(f"kernels at batch {k['batch']}{what} (compiled, no CUDA graphs): {k['kernel_ms_per_step']:.2f} ms of "
          f"kernels in {k['wall_ms_per_step']:.2f} ms per step, {k['kernels_per_step']:.0f} kernels", flush=True)
    for c, ms in k["ms_per_step_by_class"].items():
        print(f"  {c:<30} {ms:6.2f} ms/step ({100 * k['share_by_class'][c]:.0f}%)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS_DIR / "ladder"), help="results folder (default benchmarks/results/ladder)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--parts", nargs="+", default=["model", "kernels", "optimizer", "train"],
                    choices=["convs", "model", "kernels", "optimizer", "train"])
    ap.add_argument("--batch", type=int, default=512, help="batch of the convs and kernels parts (default 512)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the model-step variants this many times, in interleaved rounds (the median is kept)")
    ap.add_argument("--variants", nargs="+", default=list(MODEL_VARIANTS), choices=list(MODEL_VARIANTS),
                    metavar="LABEL", help="model-step variants to time (default: all)")
    ap.add_argument("--train-variants", nargs="+", default=None, choices=list(TRAIN_VARIANTS), metavar="LABEL",
                    help="full-pipeline variants to run (default: DEFAULT_TRAIN_VARIANTS, and max-autotune if its model "
                         "step won)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
                    help="a full-pipeline variant given on the command line (repeatable); runs after the named ones")
    ap.add_argument("--seeds", type=int, default=1,
                    help="train each full-pipeline variant with seeds 0..N-1 (accuracy at few steps varies by seed)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    try:
        extra = {label: T.parse_sets(pairs) for label, pairs in map(T.parse_variant, args.variant)}
    except LabkitError as e:
        ap.error(str(e))
    dev = pick_device(args.device)
    if dev.type != "cuda":
        print("top_rung: this benchmark studies the GPU top rung; on CPU there is nothing to measure (skipped)")
        return 0
    peak = T.peak_matmul_tflops(dev)
    flops = train_flops_per_image(resnet18())
    res = {"kind": "top_rung", "epochs": args.epochs, "peak_bf16_tflops": peak, "model_step": {}, "kernels": None,
           "variants": {}}

    def save():
        return save_result("top_rung", res, out_dir=args.out, device=dev)

    if "convs" in args.parts:
        res["conv_shapes"] = {"batch": args.batch, "rows": conv_shape_times(dev, args.batch)}
        save()
    if "model" in args.parts:
        res["rounds"] = args.rounds
        for rnd in range(args.rounds):
            for label in args.variants:
                r = _model_variant(dev, label)
                if args.rounds > 1:
                    prev = res["model_step"].get(label, {"runs": []})
                    runs = prev["runs"] + [r]
                    ok = [x["img_per_s"] for x in runs if "img_per_s" in x]
                    r = {"runs": runs} | ({"img_per_s": statistics.median(ok), "img_per_s_min": min(ok),
                                          "img_per_s_max": max(ok)} if ok else {})
                res["model_step"][label] = r
                if "img_per_s" in (this := r["runs"][-1] if args.rounds > 1 else r):
                    print(f"model step only, {label} (round {rnd + 1}): {this['img_per_s']:,.0f} img/s (MFU "
                          f"{100 * this['img_per_s'] * flops / peak / 1e12:.1f}%)", flush=True)
                save()
    if "kernels" in args.parts:
        res["kernels"] = k = kernel_breakdown(dev, batch=args.batch)
        _print_kernels(k)
        if any(len(MODEL_VARIANTS[v]) > 3 and MODEL_VARIANTS[v][3].get("matmul_edges") for v in args.variants):
            res["kernels_matmul_edges"] = k = kernel_breakdown(dev, batch=args.batch, model_kw={"matmul_edges": True})
            _print_kernels(k, " with matmul edges")
        save()
    if "optimizer" in args.parts:
        res["optimizer_step_ms"] = optimizer_steps(dev)
        save()
    if "train" in args.parts:
        ds = D.load("synthetic")
        base = T.with_changes(T.preset("cuda_graphs"), epochs=args.epochs)
        named = args.train_variants or ([] if extra else DEFAULT_TRAIN_VARIANTS)
        variants = {k: TRAIN_VARIANTS[k] for k in named} | extra
        ms = res["model_step"]
        ro, ma = ms.get("512-reduce-overhead", {}), ms.get("512-max-autotune", {})
        if not (args.train_variants or extra) and ro.get("img_per_s") and ma.get("img_per_s", 0) > 1.03 * ro["img_per_s"]:
            variants["compile max-autotune"] = dict(compile="max-autotune")
        res["seeds"] = args.seeds
        for label, ch in variants.items():
            res["variants"][label] = train_variant(base, ch, dev, ds, peak, args.seeds, label)
            save()
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

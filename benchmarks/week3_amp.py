"""Week 3 benchmark: mixed precision speed and memory, checkpointing's trade, bytes per parameter, fp16 claims.

    python benchmarks/week3_amp.py            # on an H100: about 2 minutes
    python benchmarks/week3_amp.py --quick    # tiny sizes, runs on CPU in well under a minute

Measures, for the week's model (ResidualMLP, preset 'h100') and ResNet-18 (CIFAR variant, 32x32, random data)
at two batch sizes each: one training step (Adam) in strict fp32, TF32, fp16 autocast + GradScaler and bf16
autocast, timed interleaved against fp32 with labkit.bench.compare, and peak memory per step from
amp.memory_breakdown (two warm-up steps; params, grads, optimizer state, activations, workspace; the peak
above what was resident, so earlier configurations' leftovers do not count). Then activation checkpointing (memory
saved vs time lost), bytes per parameter by the allocator, the .half()-vs-autocast race and the hand-made
scalers vs GradScaler on this device. Saves benchmarks/results/notebooks/week3_amp.json (with the environment record).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from labkit import amp, bench
from labkit.env import LabkitError, pick_device, torch_switches
from labkit.models import resnet18

NAME = "week3_amp"


def model_specs(quick: bool, dev: torch.device) -> list[dict]:
    """What to measure: model factory, input maker, batch sizes, precisions."""
    gpu = dev.type == "cuda"
    mlp_cfg = amp.MLP_PRESETS["tiny" if quick else "h100"]
    # fp16 convolutions on CPU are reference kernels (seconds per step even for a tiny ResNet): GPU only.
    precisions = ["fp32", "tf32", "fp16", "bf16"] if gpu else ["fp32", "fp16", "bf16"]
    return [
        {"model": "mlp", "make": lambda: amp.build_mlp(mlp_cfg),
         "inputs": lambda b: (torch.randn(b, mlp_cfg.in_features), torch.randint(0, mlp_cfg.classes, (b,))),
         "batches": (16, 64) if quick else (1024, 8192), "precisions": precisions,
         "params_note": f"ResidualMLP {mlp_cfg}"},
        {"model": "resnet18", "make": lambda: _seeded(lambda: resnet18(width=4 if quick else 64)),
         "inputs": lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))),
         "batches": (2, 4) if quick else (128, 512), "precisions": precisions if gpu else ["fp32", "bf16"],
         "params_note": "ResNet-18 CIFAR variant" + (" width 4" if quick else "")},
    ]


def _seeded(make, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _free(dev):
    # Only peak-memory numbers need the garbage gone (and a full collection costs ~0.5 s with torch loaded).
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _peak(trainer, x, y, dev) -> dict:
    """One step's memory split (amp.memory_breakdown, CUDA only): "peak_bytes" is the state that lives across
    steps plus the step's peak above what was resident, so leftovers of configurations measured before it (an
    absolute max_memory_allocated counted them: the peaks grew in measuring order) no longer count."""
    if dev.type != "cuda":
        return {"peak_bytes": None}
    m = amp.memory_breakdown(trainer, x, y, warmup=2)
    return {"peak_bytes": m["peak"], "resident_bytes": m["resident"], "memory": m}


def _step_fn(trainer, x, y):
    return lambda: trainer.step(x, y)


def measure_model(spec: dict, dev, rounds: int, warmup: int, progress) -> list[dict]:
    rows = []
    batches, precisions = spec["batches"], spec["precisions"]
    data = {b: tuple(t.to(dev) for t in spec["inputs"](b)) for b in batches}
    # Memory first, one trainer alive at a time, so the peak is that configuration's alone.
    mem = {}
    for p in precisions:
        tr = amp.AmpTrainer(spec["make"](), p, device=dev)
        n_params = sum(q.numel() for q in tr.model.parameters())
        for b in batches:
            x, y = data[b]
            tr.step(x, y)  # warm: Adam state, cuDNN autotune, autocast caches
            acts = amp.activation_bytes(tr.model, x, p)
            mem[p, b] = {**_peak(tr, x, y, dev), "activation_bytes": acts,
                         "state_bytes": amp.measured_bytes_per_param(tr.model, tr.optimizer)["total"] * n_params}
            progress.update(1)
        del tr
        _free(dev)
    # Speed: every precision against strict fp32, interleaved, same weights, same batch.
    trainers = {p: amp.AmpTrainer(spec["make"](), p, device=dev) for p in precisions}
    for b in batches:
        x, y = data[b]
        base = trainers["fp32"]
        for p in precisions:
            row = {"model": spec["model"], "batch": b, "precision": p, "note": amp.PRECISIONS[p].note, **mem[p, b]}
            if p == "fp32":
                t = bench.time_fn(_step_fn(base, x, y), device=dev, warmup=warmup, repeats=rounds)
                row.update(median_s=t.median, iqr_s=t.iqr, samples_per_s=b / t.median, speedup_vs_fp32=1.0,
                           speedup_iqr=0.0)
            else:
                r = bench.compare(_step_fn(base, x, y), _step_fn(trainers[p], x, y), device=dev, rounds=rounds,
                                  warmup=warmup)
                row.update(median_s=r.b.median, iqr_s=r.b.iqr, samples_per_s=b / r.b.median,
                           speedup_vs_fp32=r.ratio, speedup_iqr=r.ratio_iqr, speedup_range=list(r.ratio_range))
            rows.append(row)
            progress.update(1)
    del trainers
    _free(dev)
    return rows


def measure_checkpointing(spec: dict, dev, precision: str, rounds: int, warmup: int) -> dict:
    """Plain vs checkpointed residual blocks at the larger batch: peak memory, saved bytes, time ratio."""
    b = spec["batches"][-1]
    x, y = (t.to(dev) for t in spec["inputs"](b))
    out = {"model": spec["model"], "batch": b, "precision": precision}
    for kind in ("plain", "checkpointed"):
        tr = amp.AmpTrainer(spec["make"](), precision, device=dev)
        if kind == "checkpointed":
            out["blocks_wrapped"] = amp.checkpoint_blocks(tr.model)
        tr.step(x, y)
        out[f"{kind}_peak_bytes"] = _peak(tr, x, y, dev)["peak_bytes"]
        out[f"{kind}_activation_bytes"] = amp.activation_bytes(tr.model, x, precision)
        del tr
        _free(dev)
    plain = amp.AmpTrainer(spec["make"](), precision, device=dev)
    ckpt = amp.AmpTrainer(spec["make"](), precision, device=dev)
    amp.checkpoint_blocks(ckpt.model)
    r = bench.compare(lambda: plain.step(x, y), lambda: ckpt.step(x, y), device=dev, rounds=rounds, warmup=warmup)
    # ratio = time_plain / time_checkpointed: below 1 means checkpointing is slower.
    out.update(plain_median_s=r.a.median, checkpointed_median_s=r.b.median, time_ratio=r.ratio,
               time_ratio_iqr=r.ratio_iqr, slowdown=1 / r.ratio)
    return out


def bytes_per_param_allocator(dev, quick: bool) -> dict:
    """Bytes per parameter from the CUDA allocator after one step (params + grads + optimizer + master)."""
    out = {}
    cfg = amp.MLP_PRESETS["tiny" if quick else "h100"]
    x, y = (t.to(dev) for t in amp.teacher_batch(0, 64, cfg))
    precisions = ("fp32", "fp16", "bf16", "fp16_master", "half")
    # cuBLAS workspaces come from the same allocator and stay: create them before the first "before".
    for p in precisions:
        amp.AmpTrainer(amp.build_mlp("tiny"), p, device=dev).step(*amp.teacher_batch(0, 8, device=dev))
    for p in precisions:
        _free(dev)
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        tr = amp.AmpTrainer(amp.build_mlp(cfg), p, device=dev)
        tr.step(x, y)
        n = sum(q.numel() for q in tr.model.parameters())
        row = {"predicted": amp.predicted_bytes_per_param(p),
               "tensors": amp.measured_bytes_per_param(tr.model, tr.optimizer, tr.master), "params": n}
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            row["allocator"] = (torch.cuda.memory_allocated(dev) - before) / n
        out[p] = row
        del tr
    _free(dev)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "notebooks"), help="folder for week3_amp.json")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (CPU smoke run)")
    ap.add_argument("--device", default="auto", help="device (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per comparison (default 7, quick 3)")
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    dev = pick_device(args.device)
    if dev.type != "cuda" and not args.quick:
        print("week3_amp: no CUDA GPU here; the full sizes are for an H100 (use --quick for a CPU smoke run)",
              file=sys.stderr)
        return 2
    if args.rounds is not None and args.rounds < 1:
        print("week3_amp: --rounds must be at least 1", file=sys.stderr)
        return 2
    rounds = args.rounds or (3 if args.quick else 7)
    warmup = 1 if args.quick else 3
    specs = model_specs(args.quick, dev)
    result = {"quick": args.quick, "device": str(dev), "rounds": rounds,
              "switches": "cudnn.benchmark on for every arm; fp32 = strict (TF32 off), tf32 = TF32 on",
              "models": {s["model"]: s["params_note"] for s in specs}, "skipped": []}
    if dev.type != "cuda":
        result["skipped"] += ["tf32 (CUDA only)", "fp16 for ResNet-18 (CPU fp16 convolutions are reference kernels)",
                              "peak memory (torch.cuda.max_memory_allocated needs CUDA)"]
        print("no CUDA: CPU smoke run; speed ratios are CPU numbers and peak memory is skipped", file=sys.stderr)
    total = sum(len(s["precisions"]) * len(s["batches"]) * 2 for s in specs)
    with torch_switches(cudnn_benchmark=True), tqdm(total=total, desc="week3 speed+memory") as bar:
        result["speed"] = [row for s in specs for row in measure_model(s, dev, rounds, warmup, bar)]
        ck_prec = "bf16"
        result["checkpointing"] = [measure_checkpointing(s, dev, ck_prec, rounds, warmup) for s in specs]
    result["bytes_per_param"] = bytes_per_param_allocator(dev, args.quick)
    steps = 6 if args.quick else 200
    result["race"] = {}
    for w in (1.0, 1e-5):
        race = amp.precision_race(("fp32", "half", "fp16_master", "fp16_noscale", "fp16", "bf16"), steps=steps, loss_weight=w,
                                  batch=16 if args.quick else 256, cfg="tiny" if args.quick else "small", device=dev)
        result["race"][f"{w:g}"] = {"losses": race.losses, "zero_grad_fraction": race.zero_grad_fraction,
                                    "first_nonfinite": {k: race.first_nonfinite(k) for k in race.losses},
                                    "scales": race.scales}
    traces = amp.compare_scalers(dev)
    result["scalers"] = {name: {"identical": t["GradScaler"].scales == t["DynamicLossScaler"].scales
                                and t["GradScaler"].skipped == t["DynamicLossScaler"].skipped
                                and t["GradScaler"].params == t["DynamicLossScaler"].params,
                                "scales": t["GradScaler"].scales, "skipped": t["GradScaler"].skipped}
                         for name, t in traces.items()}
    path = bench.save_result(NAME, result, out_dir=args.out, device=dev)
    print(amp.benchmark_summary(result))
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabkitError as e:
        print(f"week3_amp: error: {e}", file=sys.stderr)
        sys.exit(2)

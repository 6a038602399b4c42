"""Is the top rung's steady step held back by the card's power limit? Clocks and watts beside img/s.

    python benchmarks/step_power.py [--preset muon] [--batch N] [--rounds 5] [--steps 30]
                                    [--out benchmarks/results/ladder]

One process builds the rung as `labkit train` does (`step_parts.setup`) and trains it for one epoch, so that its
weights are those of a run under way. It then times, in alternating rounds of --steps steps each on one fixed batch:
  rung step       labkit's own step (`labkit.train._make_step`): forward, loss, backward, optimizer
  model, trained  forward, cross-entropy and backward through the rung's trained weights, compiled as the rung's
  model, fresh    the same on a newly built model of the same config: zero-initialised residual blocks start with
                  a BatchNorm scale of 0, so every gradient into a block's branch is zero until the first update
  matmul          25 bf16 8192x8192 matrix products a call, the workload a card's Tensor Core peak is quoted for
While each round runs, a thread reads the GPU through NVML every --sample-ms: SM clock (MHz), board power (W) and
the clock-event reasons (`labkit.gpu_power`), the bits the driver sets to say why the clock is below its maximum (power cap, thermal,
...). A part whose samples sit at the power limit with the power-cap reason set is power-bound: its kernels run at
whatever clock the limit leaves, and the same kernels run faster where their operands toggle fewer bits.
Each image-rate part also gets its energy per image, mJ/img = board watts / img/s x 1000, from the same round's
readings (the card's whole board power: what the power cap limits, and what a run pays for). Saved after every
round. Without a CUDA GPU and NVML it runs eager at a tiny size and measures nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_parts: the rung's setup
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

PARTS = ("rung step", "model, trained", "model, fresh", "matmul")


def part_fns(cfg, model, step, fixed, dev):
    """One round of each part, as argument-less functions: (function, images it processes per call)."""
    import torch
    import torch.nn.functional as F

    from labkit import train as T

    x, y = fixed
    graphs = cfg.compile in T.GRAPH_MODES
    torch.manual_seed(cfg.seed)
    fresh, _, _ = T._build_model(cfg, model.fc.out_features, dev)

    def model_step(m):
        f = m if not cfg.compile else torch.compile(m, mode=None if cfg.compile == "default" else cfg.compile,
                                                    dynamic=False)

        def run():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with T._autocast(cfg, dev):
                out = f(x)
            F.cross_entropy(out.float(), y).backward()
            m.zero_grad(set_to_none=True)
        return run

    n = 8192 if dev.type == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return {"rung step": (lambda: step(x, y), len(y)), "model, trained": (model_step(model), len(y)),
            "model, fresh": (model_step(fresh), len(y)), "matmul": (lambda: [a @ a for _ in range(25)], 0)}, 25 * 2 * n ** 3


def measure(res: dict, args, out: Path, cfg, model, step, batches, fixed, dev, sampler) -> None:
    """Train one epoch, warm every part, then time the parts in alternating rounds with the sampler running."""
    from labkit.bench import save_result, synchronize
    from labkit.gpu_power import summary

    t0 = time.perf_counter()
    for b in batches.epoch(0):  # the weights of a run under way: scales off zero, moments in the optimizer
        step(*b)
    fns, matmul_flop = part_fns(cfg, model, step, fixed, dev)
    for fn, _ in fns.values():
        for _ in range(3):
            fn()
    synchronize(dev)
    res["warm_up_s"] = round(time.perf_counter() - t0, 2)
    limit = res["card"].get("power_limit_w", 0.0)
    for r in range(args.rounds):
        for part in PARTS[r % len(PARTS):] + PARTS[:r % len(PARTS)]:
            fn, images = fns[part]
            synchronize(dev)
            with sampler.reading() if sampler is not None else contextlib.nullcontext() as s:
                t = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                synchronize(dev)
                dt = time.perf_counter() - t
            rec = res["parts"][part]
            rec["rate"].append(round(args.steps * images / dt, 1) if images else round(args.steps * matmul_flop / dt / 1e12, 1))
            if s is not None and s.samples:
                rec["rounds"].append(summary(s.samples, limit))
        summarize(res)
        save_result(args.name, res, out_dir=out, device=dev)
        print(f"round {r + 1}: " + "; ".join(f"{p} {res['parts'][p]['rate_median']:,.0f} {res['parts'][p]['unit']}"
                                             + (f" at {res['parts'][p]['sm_clock_mhz']:.0f} MHz, "
                                                f"{res['parts'][p]['power_w']:.0f} W" if res['parts'][p].get('rounds')
                                                else "") for p in PARTS), flush=True)


def summarize(res: dict) -> None:
    """Median and spread of each part's rate, clock and power over the rounds so far."""
    for p in res["parts"].values():
        if p["rate"]:
            p["rate_median"] = statistics.median(p["rate"])
            p["rate_spread"] = [min(p["rate"]), max(p["rate"])]
        if p["rounds"]:
            for k in ("sm_clock_mhz", "power_w", "at_limit"):
                vals = [r[k] for r in p["rounds"]]
                p[k] = statistics.median(vals)
                p[k + "_spread"] = [min(vals), max(vals)]
            p["power_cap_share"] = statistics.median(r["reasons"].get("power cap", 0.0) for r in p["rounds"])
        if p["unit"] == "img/s" and p["rounds"] and len(p["rounds"]) == len(p["rate"]):
            mj = [1000 * r["power_w"] / rate for r, rate in zip(p["rounds"], p["rate"], strict=True) if rate]
            if mj:  # per round, power over that round's rate: a median of ratios, not a ratio of medians
                p["mj_per_image"] = round(statistics.median(mj), 3)
                p["mj_per_image_spread"] = [round(min(mj), 3), round(max(mj), 3)]


def main(argv=None) -> int:
    from step_parts import arguments, start

    ap = arguments(__doc__, "step_power")
    ap.add_argument("--steps", type=int, default=30, help="calls of a part per round (default 30)")
    ap.add_argument("--sample-ms", type=float, default=20.0, help="milliseconds between NVML readings (default 20)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.sample_ms <= 0:
        ap.error("--rounds and --steps must be >= 1 and --sample-ms > 0")
    from labkit.bench import save_result
    from labkit.env import LabkitError
    from labkit.gpu_power import Meter

    try:
        out, dev, quick, (cfg, model, step, batches, fixed, _) = start(args, "step_power")
    except LabkitError as e:
        print(f"step_power: {e}", file=sys.stderr)
        return 2
    sampler = Meter.open(dev, args.sample_ms / 1000)
    card = dict(sampler.card) if sampler is not None else {}
    if sampler is None:
        print("step_power: no NVML readings without a CUDA GPU and pynvml (skipped: clocks, power)")
    res = {"kind": "step_power", "preset": args.preset, "quick": quick, "batch": cfg.batch_size, "steps": args.steps,
           "rounds": args.rounds, "sample_ms": args.sample_ms, "card": card,
           "note": "parts alternating per round on one fixed batch; rates in img/s (matmul: TFLOP/s); NVML readings "
                   "taken while each round ran",
           "parts": {p: {"unit": "TFLOP/s" if p == "matmul" else "img/s", "rate": [], "rounds": []} for p in PARTS}}
    from labkit import train as T

    with T._switches(cfg):  # cuDNN's autotuning and inductor's settings, as the rung trains under them
        measure(res, args, out, cfg, model, step, batches, fixed, dev, sampler)
    path = save_result(args.name, res, out_dir=out, device=dev)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

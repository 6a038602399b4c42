"""Week 2 GPU benchmark: matmul TFLOP/s by dtype and shape, TF32 vs strict fp32, fp8, roofline, kernel names.

    python benchmarks/week2_matmul.py             # on a GPU: about a minute on an H100
    python benchmarks/week2_matmul.py --quick     # tiny sizes; runs on a CPU (CI does this)
    python benchmarks/week2_matmul.py --waves     # only the wave sweep, into week2_waves.json (under a minute)

Saves <out>/week2_matmul.json through labkit.bench.save_result (card, torch, commit and command attached).
What it measures, all with random normal data, warm-up and labkit.bench timing:
  - the dtype grid (strict fp32, tf32, fp16, bf16, fp8 via torch._scaled_mm) at 4096^3 and 8192^3;
  - 8191^3 against 8192^3 for bf16 and fp16, interleaved;
  - TF32 against strict fp32 at 8192^3, interleaved; fp8 against bf16 where fp8 runs;
  - a roofline: measured bf16 peak, measured copy bandwidth, bf16 matmuls of rising arithmetic intensity;
  - the kernels each dtype ran (torch.profiler), with tensor-core kernels flagged from their names;
  - how the tensor cores round fp32 inputs to TF32, and how torch's casts to fp8/fp16/bf16 treat overflow.

--waves saves <out>/week2_waves.json instead: bf16 N x N x N TFLOP/s for N every 64 from 7680 to 8704 plus
8191, 8193 and 8200, beside the tile-and-wave prediction for this GPU's SM count (labkit.waves), the kernels
cuBLAS ran at 8191, 8192 and 8200 with the tile their names state, and the datasheet peak of the card.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from labkit import bench
from labkit import matmul as mm
from labkit import waves as wv
from labkit.bench import save_result
from labkit.env import LabkitError, pick_device
from labkit.floats import torch_overflow_policy

RESULTS_DIR = bench.RESULTS_DIR / "kernels"  # where its records go (benchmarks/results/kernels)

NAME = "week2_matmul"
WAVES_NAME = "week2_waves"
H100_SMS = 132  # the prediction's SM count where there is no GPU to ask (an H100 SXM's)
_TC_FLAG = {True: "tensor cores", False: "no tensor cores", None: "?"}


def run(device, quick: bool, repeats: int) -> dict:
    """All measurements; returns the result payload (without the environment record)."""
    dev = pick_device(device)
    big, mid, odd = (128, 64, 127) if quick else (8192, 4096, 8191)
    rounds = 3 if quick else 9
    print(f"device {dev}, sizes {mid}/{big}/{odd}" + (" (quick)" if quick else ""))

    grid = mm.matmul_grid(tuple(mm.KINDS), [mid, big], dev, repeats=repeats)
    print(mm.grid_table(grid))

    shape_effect = []
    for kind in ("bf16", "fp16"):
        r = mm.compare_matmuls((kind, odd, odd, odd), (kind, big, big, big), dev, rounds=rounds)
        shape_effect.append({"kind": kind, "aligned": big, "misaligned": odd, **r})
        print(f"{kind}: {big}^3 gives {r['throughput_ratio']:.2f}x the TFLOP/s of {odd}^3 "
              f"({r['b']['tflops']:.3g} vs {r['a']['tflops']:.3g} TFLOP/s)")

    tf32_vs_fp32 = mm.compare_matmuls(("fp32", big, big, big), ("tf32", big, big, big), dev, rounds=rounds)
    print(f"TF32 at {big}^3 runs {tf32_vs_fp32['time_ratio']:.2f}x as fast as strict fp32")

    fp8_ok, fp8_why = mm.kind_support("fp8", dev)
    fp8 = {"supported": fp8_ok, "note": fp8_why}
    if fp8_ok:
        fp8["vs_bf16"] = mm.compare_matmuls(("bf16", big, big, big), ("fp8", big, big, big), dev, rounds=rounds)
        fast = mm.make_matmul("fp8", big, device=dev, fast_accum=True)
        t = bench.time_fn(fast, device=dev, warmup=3, repeats=repeats)
        fp8["fast_accum_tflops"] = mm.matmul_flops(big, big, big) / t.median / 1e12
        print(f"fp8 at {big}^3 runs {fp8['vs_bf16']['time_ratio']:.2f}x as fast as bf16; "
              f"{fp8['fast_accum_tflops']:.3g} TFLOP/s with use_fast_accum=True")
    else:
        print(f"fp8 skipped: {fp8_why}")

    if not mm.kind_support("bf16", dev)[0]:
        raise LabkitError("bf16 matmuls do not run on this device; the week-2 benchmark needs bf16 (Ampere or newer)")
    bandwidth = mm.measure_copy_bandwidth(dev, (16 << 20) if quick else (1 << 30), repeats=repeats)
    ks = [16, 32, 64, 128] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    points = mm.roofline_points("bf16", [(big, big, k) for k in ks], dev, repeats=repeats)
    candidates = [] if quick else [(8192, 8192, 16384), (16384, 16384, 8192)]
    peak_rows = [mm.bench_matmul("bf16", m, n, k, dev, repeats=repeats) for m, n, k in candidates]
    bf16_rows = [r for r in grid + points + peak_rows if r["kind"] == "bf16" and r["tflops"]]
    peak = max(bf16_rows, key=lambda r: r["tflops"])
    print(f"copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s, bf16 peak {peak['tflops']:.3g} TFLOP/s at "
          f"{peak['m']}x{peak['n']}x{peak['k']}")

    kernels, kernel_size = {}, mid
    for kind in mm.KINDS:
        ok, why = mm.kind_support(kind, dev)
        kernels[kind] = mm.kernels_ran(mm.make_matmul(kind, kernel_size, device=dev), dev) if ok else []
        names = ", ".join(f"{r['name'][:60]} [{_TC_FLAG[r['tensor_core']]}]" for r in kernels[kind][:2])
        print(f"kernels {kind}: {names or why}")

    casts = {}
    for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            try:
                casts[name] = torch_overflow_policy(dtype, dev)
            except (LabkitError, RuntimeError) as e:
                casts[name] = f"unknown ({str(e).splitlines()[0][:80]})"

    bf16_big = next(r for r in grid if r["kind"] == "bf16" and r["m"] == big)
    checks = {
        "bf16_big_fraction_of_peak": bf16_big["tflops"] / peak["tflops"],
        "bf16_big_within_10pct_of_peak": bf16_big["tflops"] >= 0.9 * peak["tflops"],
        "misaligned_slower": all(s["throughput_ratio"] > 1.0 for s in shape_effect),
        "tf32_faster_than_fp32": tf32_vs_fp32["time_ratio"] > 1.0,
    }
    return {
        "quick": quick,
        "sizes": {"big": big, "mid": mid, "odd": odd},
        "kinds": mm.KINDS,
        "grid": grid,
        "shape_effect": shape_effect,
        "tf32_vs_fp32": tf32_vs_fp32,
        "fp8": fp8,
        "roofline": {"peak_tflops": peak["tflops"], "peak_shape": [peak["m"], peak["n"], peak["k"]],
                     "bandwidth": bandwidth, "points": points, "peak_candidates": peak_rows},
        "kernels": {"size": kernel_size, "by_kind": kernels},
        "tf32_input_rounding": mm.tf32_rounding_probe(dev),
        "cast_overflow": casts,
        "checks": checks,
    }


def run_waves(device, quick: bool, repeats: int) -> dict:
    """The wave sweep; returns the result payload (without the environment record)."""
    dev = pick_device(device)
    sms = wv.sm_count(dev) or H100_SMS
    tile = (16, 16) if quick else (128, 128)
    sizes = wv.wave_sizes(64, 16, 2, extra=(63, 65, 66)) if quick else wv.wave_sizes(8192, 128, 4)
    kind = "bf16"
    if not mm.kind_support(kind, dev)[0]:
        raise LabkitError("bf16 matmuls do not run on this device; the wave sweep needs bf16 (Ampere or newer)")
    print(f"device {dev}, {sms} SMs" + ("" if dev.type == "cuda" else " (an H100's: no GPU here)") +
          f", {len(sizes)} sizes {sizes[0]}..{sizes[-1]}, model tile {tile[0]}x{tile[1]}" +
          (" (quick)" if quick else ""))
    rows = wv.wave_sweep(sizes, kind, dev, sms=sms, tile=tile, repeats=repeats)
    kernels = {}
    for n in ([63, 64, 66] if quick else [8191, 8192, 8200]):
        ks = [k for k in mm.kernels_ran(mm.make_matmul(kind, n, device=dev), dev) if k["tensor_core"] is not None]
        kernels[str(n)] = [{"name": k["name"], "time_us": k["time_us"], "tile": wv.kernel_tile(k["name"])}
                           for k in ks[:2]]
    for r in rows:
        print(f"  N={r['n']:>5}: {r['tflops']:8.4g} TFLOP/s  model: {r['tiles']} tiles, {r['waves']} waves, "
              f"last wave {r['last_wave']:.0%} full, efficiency {r['efficiency']:.3f}")
    for n, ks in kernels.items():
        print(f"  kernels at {n}: " + ", ".join(f"{k['name'][:60]} (tile {k['tile']})" for k in ks))
    best = max(rows, key=lambda r: r["tflops"])
    sheet = wv.datasheet(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    by_n = {r["n"]: r for r in rows}
    a, b, c = (63, 64, 66) if quick else (8191, 8192, 8200)
    return {
        "quick": quick, "kind": kind, "sms": sms, "sms_from_device": dev.type == "cuda", "tile_model": list(tile),
        "sizes": sizes, "rows": rows, "kernels": kernels,
        "best": {"n": best["n"], "tflops": best["tflops"]},
        "datasheet": sheet, "datasheet_tflops": sheet["tflops"][kind] if sheet else None,
        "checks": {"ratio_aligned_over_misaligned": by_n[b]["tflops"] / by_n[a]["tflops"],
                   "ratio_aligned_over_next_tile": by_n[b]["tflops"] / by_n[c]["tflops"]},
    }


def _guard_recorded(out: Path, name: str, quick: bool, explicit_out: bool, force: bool) -> None:
    """Refuse to let a quick run replace a recorded full (GPU) result in the default folder."""
    existing = out / f"{name}.json"
    if quick and not explicit_out and existing.exists() and not force:
        import json

        if not json.loads(existing.read_text()).get("quick", False):
            raise LabkitError(f"{existing} holds a full GPU result; a quick run would replace it: pass "
                              "--out DIR (or --force)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS_DIR})")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU / CI mode)")
    ap.add_argument("--device", default="auto", help="device to measure (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per case (default 20, quick 3)")
    ap.add_argument("--force", action="store_true", help="let a quick run replace a recorded full result")
    ap.add_argument("--waves", action="store_true",
                    help=f"only the tile/wave sweep around N = 8192, saved as {WAVES_NAME}.json")
    args = ap.parse_args(argv)
    try:
        dev = pick_device(args.device)
        quick = args.quick
        if dev.type != "cuda" and not quick:
            print("no CUDA GPU: running the quick CPU version (tensor-core numbers need a GPU)")
            quick = True
        out = args.out or RESULTS_DIR
        name = WAVES_NAME if args.waves else NAME
        _guard_recorded(out, name, quick, args.out is not None, args.force)
        repeats = args.repeats or (3 if quick else 20)
        if repeats < 1:
            raise LabkitError("--repeats must be at least 1")
        payload = (run_waves if args.waves else run)(dev, quick, repeats)
        path = save_result(name, payload, out_dir=out, device=dev)
    except LabkitError as e:
        print(f"week2_matmul: error: {e}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scaling efficiency of the top rung from 1 to N GPUs with DistributedDataParallel (torchrun, NCCL).

    python benchmarks/ddp_scaling.py [--nproc 2] [--epochs 6] [--repeats 2] [--out benchmarks/results]
    python benchmarks/ddp_scaling.py --quick --cpu          # CPU smoke test with gloo
    python benchmarks/ddp_scaling.py --variant "bf16 grads:ddp_bf16_grads=true" --profile   # and a variant
    python benchmarks/ddp_scaling.py --repeats 3 --variant "numa:launch.numa_binding=node" \
        --variant "4 threads:env.OMP_NUM_THREADS=4"       # where the spread comes from: binding, threads
    python benchmarks/ddp_scaling.py --repeats 3 --variant "own BN stats:ddp_broadcast_buffers=false"

Alternates 1-process and N-process runs of one preset (`labkit.ddp.scaling`): weak scaling keeps each GPU's
batch at the rung's 512, strong scaling splits the rung's global batch. If a preset cannot run under DDP on this
machine, the next one in --presets is tried and the failure is recorded. NCCL_NVLS_ENABLE=0 in every launch.
A variant changes TrainConfig fields, the launch's environment (env.NAME=VALUE) or binds each worker to the CPUs
near its GPU (launch.numa_binding=node|socket|exclusive|core-complex). Saves result `ddp_scaling` after every
run ("complete": false until the last): every run's img/s, accuracy and per-rank epoch times, CPU sets and
threads, the efficiencies with each round's own (the spread), and the environment. On GPUs, nvidia-smi samples
every GPU each second through the call (ddp_scaling_gpus.csv beside the result), and every run keeps the busy
samples of its own time window: SM clock, power, temperature and clock-event reasons ("gpus").
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit import ddp  # noqa: E402
from labkit.bench import RESULTS_DIR, save_result  # noqa: E402
from labkit.env import LabkitError, pick_device  # noqa: E402
from labkit.presets import add_set_argument  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--presets", nargs="+", default=["cuda_graphs", "compile", "batch_fused"],
                    help="tried in order until one runs under DDP")
    ap.add_argument("--epochs", type=int, default=6, help="epochs per run (img/s counts those after the first)")
    ap.add_argument("--repeats", type=int, default=2, help="1-vs-N pairs of runs")
    add_set_argument(ap)
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
                    help="more N-process runs with these changes in every round, against the same 1-process runs")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards, profile a few N-process steps of the preset and of each variant (rank 0's trace)")
    ap.add_argument("--quick", action="store_true", help="CPU-sized runs")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ddp"))
    args = ap.parse_args(argv)
    dev = pick_device("cpu" if args.cpu else "auto")
    try:
        variants = dict(ddp.parse_variant(v) for v in args.variant)
    except LabkitError as e:
        ap.error(str(e))
    failures = {}
    gpu_log = None
    if dev.type == "cuda":  # the GPUs' clocks, power and clock-event reasons through the call, for each run's window
        Path(args.out).mkdir(parents=True, exist_ok=True)
        gpu_log = Path(args.out) / "ddp_scaling_gpus.csv"
    sampler = start_gpu_log(gpu_log) if gpu_log else None
    try:
        return measure(args, dev, variants, failures, gpu_log if sampler else None)
    finally:
        if sampler is not None:
            sampler.terminate()


def measure(args, dev, variants: dict, failures: dict, gpu_log: Path | None) -> int:
    """The scaling runs of the first preset that runs under DDP, saved after every run."""
    for preset in args.presets:
        try:
            sets = [f"epochs={args.epochs}", *args.set] + (["max_steps=6", "n_train=1024", "width=8"] if args.quick else [])
            def partial(runs, preset=preset):  # each finished run is on disk before the next starts
                save_result("ddp_scaling", {"kind": "ddp_scaling", "preset": preset, "nproc": args.nproc,
                                            "complete": False, "runs": with_gpu_state(runs, gpu_log),
                                            "failed_presets": failures,
                                            "epochs": args.epochs}, out_dir=args.out, device=dev)

            r = ddp.scaling(preset, args.nproc, repeats=args.repeats, quick=args.quick, sets=sets,
                            variants=variants, cpu=args.cpu, on_run=partial)
            break
        except LabkitError as e:
            failures[preset] = str(e)
            print(f"ddp_scaling: {preset}: {e}; trying the next preset", file=sys.stderr, flush=True)
    else:
        print(f"ddp_scaling: error: no preset ran under DDP: {failures}", file=sys.stderr)
        return 2
    r["failed_presets"] = failures
    r["epochs"] = args.epochs
    r["complete"] = True
    r["runs"] = with_gpu_state(r["runs"], gpu_log)
    path = save_result("ddp_scaling", {"kind": "ddp_scaling", **r}, out_dir=args.out, device=dev)
    ips, n = r["img_per_s"], args.nproc
    print(f"{r['preset']}: 1 process {ips['1']:,.0f} img/s, {n} processes {ips[f'{n} weak']:,.0f} img/s "
          f"(weak scaling efficiency {100 * r['weak_efficiency']:.1f}%)"
          + (f", strong {100 * r['strong_efficiency']:.1f}%" if r["strong_efficiency"] else "")
          + f"\nsaved {path}")
    print(spread_line("weak scaling by round", r["weak_efficiency_rounds"]))
    for run in r["runs"]:
        print(f"  {run['processes']} process(es){', ' + run['variant'] if run.get('variant') else ''}, round "
              f"{run['round']}: {run['img_per_s']:,.0f} img/s; " + ranks_line(run.get("ranks") or []))
    for label, v in r["variants"].items():
        print(f"  {label} ({', '.join(v['changes'])}): " + (v["error"] if "error" in v else
              f"{n} processes {v['img_per_s']:,.0f} img/s, weak scaling efficiency {100 * v['weak_efficiency']:.1f}%; "
              + spread_line("by round", v["weak_efficiency_rounds"])))
    if args.profile:
        sets = [f"batch_size={n * r['per_process_batch']}", *args.set] + (["width=8"] if args.quick else [])
        for label, changes in {"preset": [], **variants}.items():
            rc = ddp.launch(r["preset"], n, quick=args.quick, sets=sets + changes, cpu=args.cpu, timeout_s=600,
                            profile_dir=str(Path(args.out) / "ddp_profile" / label.replace(" ", "_")))
            print(f"profile of {label}: exit {rc}", flush=True)
    return 0


# what nvidia-smi samples through the call; the reasons field has had two names (newer drivers: clocks_event_*)
GPU_FIELDS = ["timestamp", "index", "clocks.sm", "power.draw", "temperature.gpu", "utilization.gpu"]
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def start_gpu_log(path: Path) -> subprocess.Popen | None:
    """nvidia-smi writing one CSV line per GPU every second to `path` until stopped; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    for reasons in REASON_FIELDS:
        out = path.open("w")
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS + [reasons])}",
                                 "--format=csv,noheader,nounits", "-lms", "1000"], stdout=out,
                                stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=2)  # an unknown field ends it at once; a running sampler is what we want
        except subprocess.TimeoutExpired:
            return proc
        finally:
            out.close()  # the sampler keeps its own handle
    return None


def gpu_samples(text: str) -> list[dict]:
    """The sampler's CSV lines as {"t" (Unix seconds), "gpu", "sm_mhz", "power_w", "temp_c", "util", "reasons"};
    lines that do not parse (a truncated last line, "[N/A]") are skipped."""
    out = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # the host's local time
            out.append({"t": t, "gpu": int(f[1]), "sm_mhz": float(f[2]), "power_w": float(f[3]),
                        "temp_c": float(f[4]), "util": float(f[5]), "reasons": int(f[6], 16)})
        except (ValueError, IndexError):
            continue
    return out


def gpu_window(samples: list[dict], t0: float, t1: float, busy: float = 20.0) -> dict:
    """Per GPU, its busy samples (utilization >= `busy` %) between t0 and t1: how many, SM clock (MHz) and power
    (W) as [min, median, max], the hottest reading (°C) and the clock-event reason bits seen (0 = none)."""
    out = {}
    for gpu in sorted({s["gpu"] for s in samples}):
        xs = [s for s in samples if s["gpu"] == gpu and t0 <= s["t"] <= t1 and s["util"] >= busy]
        if xs:
            out[str(gpu)] = {"samples": len(xs), "sm_mhz": _span(xs, "sm_mhz"), "power_w": _span(xs, "power_w"),
                             "temp_c_max": max(x["temp_c"] for x in xs),
                             "reasons": sorted({hex(x["reasons"]) for x in xs if x["reasons"]})}
    return out


def _span(xs: list[dict], key: str) -> list[float]:
    vals = [x[key] for x in xs]
    return [min(vals), statistics.median(vals), max(vals)]


def with_gpu_state(runs: list[dict], log: Path | None) -> list[dict]:
    """Each run with the GPUs' busy samples of its own time window ("gpus"), where a sampler ran."""
    if log is None or not log.exists():
        return runs
    samples = gpu_samples(log.read_text())
    return [{**r, "gpus": gpu_window(samples, r["started"], r["ended"])} if "started" in r else r for r in runs]


def spread_line(what: str, effs: list[float]) -> str:
    """"what: 88.1% 91.0% 90.2% (median 90.2%, spread 88.1-91.0%)" for per-round efficiencies."""
    if not effs:
        return f"{what}: no complete round"
    pct = [f"{100 * e:.1f}%" for e in effs]
    return (f"{what}: {' '.join(pct)} (median {100 * statistics.median(effs):.1f}%, "
            f"spread {100 * min(effs):.1f}-{100 * max(effs):.1f}%)")


def ranks_line(ranks: list[dict]) -> str:
    """Each rank's median epoch (seconds) and its CPU set: a rank that is slower, or shares CPUs, shows here."""
    parts = []
    for k in ranks:
        ep = (k.get("epoch_s") or [])[1:] or (k.get("epoch_s") or [])  # after the first epoch (compile, warm-up)
        parts.append(f"rank {k['rank']} {statistics.median(ep):.2f} s/epoch on CPUs {k['cpus']} "
                     f"({k['torch_threads']} threads)" if ep else f"rank {k['rank']}: no epochs")
    return "; ".join(parts) or "no per-rank record"


if __name__ == "__main__":
    sys.exit(main())

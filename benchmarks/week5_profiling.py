"""Week 5 benchmark: every planted-bottleneck scenario, its fix and every ladder rung, profiled and diagnosed.

    python benchmarks/week5_profiling.py --trace-out tests/data/gpu_sync_slow.pt.trace.json.gz   # H100: ~3-4 min
    python benchmarks/week5_profiling.py --quick      # CPU: tiny sizes, a few rungs, about a minute

For each scenario (labkit.scenarios: data, overhead, sync, compute) the slow and the fixed version run through
labkit.profiling.profile_steps + diagnose, then are timed against each other (labkit.bench.compare,
interleaved). Each ladder rung (labkit.train presets on ResNet-18 at full width, a few steps each) gets a
diagnosis too; the baseline should come out data-loading bound and the top rung GPU compute bound. Also records
where line_profiler puts the time of a step that ends in loss.item() (on a GPU: on the syncing line). Saves
benchmarks/results/notebooks/week5_profiling.json; with --trace-out, one small gzipped GPU trace for tests/data/.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import bench, profiling
from labkit import scenarios as S
from labkit import train as T
from labkit.env import pick_device

NAME = "week5_profiling"
TRACE_LIMIT_BYTES = 2_000_000


def _brief(d: profiling.Diagnosis, expect: str | None = None) -> dict:
    out = {"kind": d.kind, "title": d.title, "reasons": d.reasons, "notes": d.notes, "evidence": d.evidence}
    if expect is not None:
        out["as_planted"] = d.kind == expect
    return out


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run_scenarios(names, dev, quick: bool, rounds: int, trace_from: str | None, trace_out: Path | None,
                  log) -> tuple[dict, Path | None]:
    results, written = {}, None
    for name in tqdm(names, desc="scenarios", leave=False):
        sc = S.SCENARIOS[name]
        entry = {"planted": sc.planted, "fix": sc.fix}
        try:
            results[name], trace = _one_scenario(name, sc, entry, dev, quick, rounds, trace_from, trace_out)
            written = written or trace
            e = results[name]
            log(f"  {name:<9} slow: {e['slow']['title']:<24} fixed: {e['fixed']['title']:<24} "
                f"samples/s x{e['speedup']:.1f}")
        except Exception as e:  # one broken scenario must not cost the whole recording
            results[name] = {**entry, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}
            log(f"  {name:<9} failed: {type(e).__name__}: {e}")
        _free(dev)
    return results, written


def _one_scenario(name, sc, entry, dev, quick, rounds, trace_from, trace_out):
    """Profile and diagnose the slow and the fixed version, then time them against each other."""
    written, wls = None, {}
    for version in ("slow", "fixed"):
        wl = S.workload(name, dev, fixed=version == "fixed", quick=quick)
        prof = profiling.profile_steps(wl, dev)
        expect = name if version == "slow" and (dev.type == "cuda" or sc.cpu_shows_it) else None
        entry[version] = _brief(prof.diagnose(), expect)
        entry[version]["config"] = wl.cfg
        if trace_out is not None and trace_from == f"{name}-{version}":
            # The test that reads this trace back wants the planted kind (slow versions) and today's verdict.
            prof.trace["labkit"].update(scenario=f"{name}-{version}", diagnosed=entry[version]["kind"],
                                        planted=expect)
            written = profiling.save_trace(prof.trace, trace_out)
        wls[version] = wl
    ab = bench.compare(wls["slow"].step, wls["fixed"].step, device=dev, rounds=rounds, warmup=1)
    batch_gain = wls["fixed"].cfg.batch / wls["slow"].cfg.batch
    entry.update(slow_samples_per_s=wls["slow"].cfg.batch / ab.a.median,
                 fixed_samples_per_s=wls["fixed"].cfg.batch / ab.b.median,
                 speedup=ab.ratio * batch_gain, speedup_range=[r * batch_gain for r in ab.ratio_range],
                 step_times=ab.summary())
    return entry, written


def run_rungs(names, dev, quick: bool, log) -> tuple[dict, list]:
    # Full width on a GPU; quick sizes elsewhere. profile_steps sizes the data to the schedule's steps.
    base = T.TrainConfig(width=8, batch_size=32, n_test=64) if quick else T.TrainConfig(n_test=256)
    plan = T.plan_ladder(dev, quick, names, base)
    out = {}
    for cfg in tqdm(plan.rungs, desc="rungs", leave=False):
        try:
            prof = profiling.profile_steps(cfg, dev)
            out[cfg.name] = _brief(prof.diagnose())
            log(f"  {cfg.name:<16} {out[cfg.name]['title']}")
        except Exception as e:  # one broken rung must not cost the whole recording
            out[cfg.name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}
            log(f"  {cfg.name:<16} failed: {type(e).__name__}: {e}")
        _free(dev)
    return out, [{"rung": n, "why": w} for n, w in plan.skipped]


def line_profile_sync(dev, quick: bool, steps: int = 3) -> dict:
    """Where line_profiler puts a step's time when the step ends with loss.item(): rows of the step's lines."""
    cfg = S.with_changes(S.scenario_config("compute", quick=quick), name="compute-item", host_reads="step")
    wl = S.Workload(cfg, dev)
    wl.step()  # warm-up outside the measurement
    bench.synchronize(dev)

    def run():
        for _ in range(steps):
            wl.step()

    rep = profiling.line_profile(run, functions=[S.Workload.step, S.Workload._record])
    rows = [{k: r[k] for k in ("function", "code", "hits", "time_s", "share")} for r in rep.rows[:8]]
    return {"config": cfg, "steps": steps, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes and a few rungs (the default without a GPU)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "notebooks"), help="folder for week5_profiling.json")
    ap.add_argument("--scenarios", help=f"comma-separated scenarios (default: all of {', '.join(S.SCENARIOS)})")
    ap.add_argument("--rungs", help="comma-separated ladder rungs (default: all that run here; quick: baseline and "
                                    "the last rung that runs here)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved slow/fixed rounds per scenario")
    ap.add_argument("--trace-out", metavar="PATH", help="also write one gzipped GPU trace here (for tests/data/)")
    ap.add_argument("--trace-from", default="sync-slow",
                    help="which scenario version goes to --trace-out, e.g. sync-slow, data-fixed (default sync-slow)")
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    quick = args.quick or dev.type != "cuda"
    names = args.scenarios.split(",") if args.scenarios else list(S.SCENARIOS)
    for n in names:
        if n not in S.SCENARIOS:
            ap.error(f"unknown scenario {n!r}: choose from {', '.join(S.SCENARIOS)}")
    if args.rungs:
        rungs = args.rungs.split(",")
    elif quick:
        runnable = [c.name for c in T.plan_ladder(dev, True, None, T.TrainConfig(width=8)).rungs]
        rungs = [runnable[0], runnable[-1]]
    else:
        rungs = None
    if args.trace_out and dev.type != "cuda":
        print("note: --trace-out writes a GPU trace; this run has no GPU, so the trace is a CPU one")
    log = print
    log(f"week 5 profiling on {dev}" + (" (quick)" if quick else ""))
    scen, written = run_scenarios(names, dev, quick, args.rounds, args.trace_from,
                                  Path(args.trace_out) if args.trace_out else None, log)
    rung_res, skipped = run_rungs(rungs, dev, quick, log)
    lp = line_profile_sync(dev, quick)
    order = [n for n in T.RUNG_NAMES if n in rung_res]
    checks = {"scenarios_as_planted": {n: e["slow"].get("as_planted") for n, e in scen.items()}}
    if order:
        checks["first_rung"] = {"rung": order[0], "kind": rung_res[order[0]].get("kind"),
                                "ok": rung_res[order[0]].get("kind") == "data" if dev.type == "cuda" else None}
        checks["top_rung"] = {"rung": order[-1], "kind": rung_res[order[-1]].get("kind"),
                              "ok": rung_res[order[-1]].get("kind") == "compute" if dev.type == "cuda" else None}
    payload = {"quick": quick, "device_type": dev.type, "scenarios": scen, "rungs": rung_res,
               "skipped_rungs": skipped, "line_profiler_item": lp, "checks": checks,
               "trace_out": str(written) if written else None}
    path = bench.save_result(NAME, payload, out_dir=args.out, device=dev)
    log(f"line_profiler, a step ending in loss.item(): top line '{lp['rows'][0]['code']}' "
        f"{100 * lp['rows'][0]['share']:.0f}% of the time")
    log(f"checks: {checks}")
    if written:
        size = written.stat().st_size
        log(f"wrote trace {written} ({size / 1e6:.2f} MB)"
            + ("  WARNING: over 2 MB, too big to commit; try --trace-from overhead-slow" if size > TRACE_LIMIT_BYTES else ""))
    elif args.trace_out:
        log(f"no trace written: --trace-from {args.trace_from} did not run")
    log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

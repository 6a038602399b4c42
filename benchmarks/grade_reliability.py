"""How reliable is a speed grade? Run the harness's speed check on the reference solution N times.

No nbgrader and no Jupyter: the reference module is taken from the source notebook's `%%writefile` cell and the
check runs through `autograder.checks.harness.run_check`, each time in a fresh process, exactly as the grader's trusted
re-run does. A run where the reference loses speed points is a false failure; the spread of the measured
ratio shows how close the thresholds sit to the noise.

    python benchmarks/grade_reliability.py                 # GPU machine: lab4.speed, 10 runs
    python benchmarks/grade_reliability.py --quick         # CPU smoke test: 3 runs of a CPU-gradable check

Saves benchmarks/results/grading/grade_reliability.json (per-run verdicts, false failures, ratio spread, environment).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autograder import rehearsal  # noqa: E402
from autograder.checks import harness, trusted  # noqa: E402
from labkit import bench  # noqa: E402
from labkit.env import LabkitError, pick_device  # noqa: E402


def _source(check: str) -> Path | None:
    aid = harness.ASSIGNMENTS.get(check.split(".")[0])
    nb = ROOT / "assignments" / "source" / f"{aid}" / f"{aid}.ipynb"
    return nb if aid and nb.exists() else None


def pick_check(device: str) -> str:
    """lab4.speed on a CUDA machine, else the CPU-gradable data-loader speed check, else the toy check."""
    for name in (["lab4.speed"] if device.startswith("cuda") else []) + ["lab2.loader_speed", "lab3.speedup"]:
        if name in harness.CHECKS and _source(name):
            return name
    return rehearsal.CHECK


def one_run(check: str, path: Path, device: str, sandbox: str = "auto") -> dict:
    """One fresh-process run of the check: verdict, share of points, ratio and the seconds it took."""
    box = []
    if check == rehearsal.CHECK:
        secs = bench.time_fn(lambda: box.append(rehearsal.run_check(check, str(path))), warmup=0, repeats=1).median
        v = box[0]
        v.setdefault("ok", v.get("passed"))
        v["score"], v["max_score"], v["gradable"] = (1.0 if v.get("passed") else 0.0), 1.0, True
    else:
        secs = bench.time_fn(lambda: box.append(harness.run_check(check, path, device=device, sandbox=sandbox)),
                             warmup=0, repeats=1).median
        v = box[0]
    numbers = dict(v.get("measurements") or {}, **{k: v[k] for k in ("ratio",) if k in v})
    frac = v["score"] / v["max_score"] if v.get("max_score") else 0.0
    return {"ok": bool(v.get("ok")), "gradable": bool(v.get("gradable", True)), "fraction": frac,
            "sandbox": v.get("sandbox"),
            "ratio": trusted.headline(numbers).get("ratio"), "message": v.get("message", ""), "seconds": secs,
            "measurements": {k: val for k, val in numbers.items() if k != "traceback"}}


def summarize(runs: list[dict]) -> dict:
    """False failures (a gradable run that did not earn full points) and the spread of the ratio."""
    gradable = [r for r in runs if r["gradable"]]
    ratios = [r["ratio"] for r in gradable if isinstance(r["ratio"], (int, float))]
    out = {"runs": len(runs), "gradable_runs": len(gradable), "not_gradable_runs": len(runs) - len(gradable),
           "false_failures": sum(1 for r in gradable if r["fraction"] < 1.0),
           "full_marks_runs": sum(1 for r in gradable if r["fraction"] >= 1.0)}
    if ratios:
        med = statistics.median(ratios)
        out.update(ratio_median=med, ratio_min=min(ratios), ratio_max=max(ratios),
                   ratio_iqr=bench.quantile(ratios, 0.75) - bench.quantile(ratios, 0.25),
                   ratio_cv=statistics.pstdev(ratios) / med if med else None,
                   ratio_max_over_min=max(ratios) / min(ratios) if min(ratios) > 0 else None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "grading"), help="folder for grade_reliability.json")
    ap.add_argument("--quick", action="store_true", help="3 runs on the CPU (a smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="how many times to run the check (default 10; --quick 3)")
    ap.add_argument("--check", default="auto",
                    help="harness check to repeat (default: lab4.speed on CUDA, else a CPU-gradable speed check)")
    ap.add_argument("--device", default="auto", help="device to grade on: auto, cpu, cuda, cuda:N (--quick: cpu)")
    ap.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto",
                    help="where the reference runs: bwrap (required), none, or auto (bwrap where it works)")
    args = ap.parse_args(argv)
    try:
        device = "cpu" if args.quick else str(pick_device(args.device))
        runs_n = args.runs or (3 if args.quick else 10)
        if runs_n < 1:
            raise LabkitError("--runs must be at least 1")
        check = pick_check(device) if args.check == "auto" else args.check
        if check != rehearsal.CHECK and check not in harness.CHECKS:
            raise LabkitError(f"unknown check {check!r}: one of {', '.join(harness.CHECKS)} or {rehearsal.CHECK}")
        if check != rehearsal.CHECK and _source(check) is None:
            raise LabkitError(f"{check}: its assignment's source notebook is not in assignments/source/")
        if device == "cpu" and check == "lab4.speed":
            print("note: lab4.speed needs CUDA; on this CPU every run will say 'not gradable'")
        from tqdm.auto import tqdm

        runs = []
        with tempfile.TemporaryDirectory(prefix="reliability-") as d:
            if check == rehearsal.CHECK:
                path = Path(d) / "pipeline.py"
                path.write_text(rehearsal.REFERENCE)
            else:
                path = harness.student_file_from_notebook(_source(check), d)
            for _ in tqdm(range(runs_n), desc=f"{check} x{runs_n}", unit="run"):
                runs.append(one_run(check, path, device, args.sandbox))
                # saved after every run: a run cut short by a time limit still leaves what it measured
                p = bench.save_result("grade_reliability", {"check": check, "device": device, "runs_planned": runs_n,
                                                            "sandbox": sorted({str(r["sandbox"]) for r in runs}),
                                                            "complete": len(runs) == runs_n,
                                                            "summary": summarize(runs), "runs": runs},
                                      out_dir=args.out, device=device)
    except LabkitError as e:
        print(f"grade_reliability: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(runs)
    print(f"{check} on {device} (sandbox: {', '.join(sorted({str(r['sandbox']) for r in runs}))}): {summary['runs']} runs, {summary['false_failures']} false failure(s), "
          f"{summary['not_gradable_runs']} not gradable")
    if "ratio_median" in summary:
        print(f"ratio median {summary['ratio_median']:.2f}x, range {summary['ratio_min']:.2f}-"
              f"{summary['ratio_max']:.2f}x, IQR {summary['ratio_iqr']:.2f}, CV {summary['ratio_cv']:.1%}")
    for r in runs:
        print(f"  {'ok ' if r['fraction'] >= 1 else 'LOST' if r['gradable'] else 'n/g '} "
              f"{r['fraction']:.0%}  ratio {r['ratio'] if r['ratio'] is not None else '-'}  {r['seconds']:.0f} s  "
              f"{r['message'][:90]}")
    print(f"saved {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grade the reference solutions of the graded labs with the trusted harness, without nbgrader or Jupyter.

Extracts each lab's reference module from its source notebook's `%%writefile` cell and runs every check of the
lab (hidden ones included) through `autograder.checks.harness.run_checks`, each lab in a fresh process. On an H100 the
reference solutions of labs 1, 3 and 4 must get full marks, the ResNet-18 speed tiers included; on a CPU the
GPU-only speed check reports "not gradable on this hardware" and the rest must get full marks.

    python benchmarks/grade_reference_gpu.py            # on the GPU machine: all of labs 1, 3, 4
    python benchmarks/grade_reference_gpu.py --quick    # CPU-sized problems on the CPU, whatever the machine

Saves benchmarks/results/grading/grade_reference_gpu.json (verdicts, speed-ups, environment) and exits 1 if a gradable
check lost points.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autograder.checks import harness  # noqa: E402
from labkit import bench  # noqa: E402
from labkit.env import LabkitError, pick_device  # noqa: E402

DEFAULT_LABS = ["lab1", "lab3", "lab4"]


def grade_reference(lab: str, device: str) -> dict:
    """All verdicts of one lab's reference solution, with its total and whether every gradable check is full."""
    aid = harness.ASSIGNMENTS[lab]
    nb = ROOT / "assignments" / "source" / aid / f"{aid}.ipynb"
    with tempfile.TemporaryDirectory(prefix=f"ref-{lab}-") as d:
        path = harness.student_file_from_notebook(nb, d)
        verdicts = harness.run_checks(harness.checks_for(lab), path, device=device)
    gradable = [v for v in verdicts if v["gradable"]]
    return {
        "assignment": aid,
        "verdicts": verdicts,
        "score": sum(v["score"] for v in verdicts),
        "max_score": sum(v["max_score"] for v in verdicts),
        "gradable_max_score": sum(v["max_score"] for v in gradable),
        "not_gradable": [v["check"] for v in verdicts if not v["gradable"]],
        "full_marks_on_gradable": all(v["ok"] and v["score"] == v["max_score"] for v in gradable),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "grading"), help="folder for grade_reference_gpu.json")
    ap.add_argument("--quick", action="store_true", help="grade on the CPU with the small problems (a smoke test)")
    ap.add_argument("--device", default="auto", help="device to grade on: auto, cpu, cuda, cuda:N (--quick: cpu)")
    ap.add_argument("--labs", nargs="+", default=DEFAULT_LABS, choices=sorted(harness.ASSIGNMENTS),
                    help="which labs' reference solutions to grade (default: lab1 lab3 lab4)")
    args = ap.parse_args(argv)
    try:
        device = "cpu" if args.quick else str(pick_device(args.device))
    except LabkitError as e:
        print(f"grade_reference_gpu: {e}", file=sys.stderr)
        return 2
    results = {}
    for lab in args.labs:
        print(f"grading the reference solution of {harness.ASSIGNMENTS[lab]} on {device} ...", flush=True)
        r = results[lab] = grade_reference(lab, device)
        for v in r["verdicts"]:
            state = "PASS" if v["ok"] else ("NOT GRADABLE" if not v["gradable"] else "FAIL")
            speed = v["measurements"].get("speedup")
            print(f"  {v['check']:<28} {state:<13} {v['score']:g}/{v['max_score']:g}"
                  + (f"  speed-up {speed:g}x" if speed is not None else "") + f"  {v['message'][:100]}")
    ok = all(r["full_marks_on_gradable"] for r in results.values())
    hardware = next((v["hardware"] for r in results.values() for v in r["verdicts"] if v.get("hardware")), None)
    path = bench.save_result("grade_reference_gpu", {
        "kind": "grade_reference", "device": device, "hardware": hardware, "quick": args.quick,
        "all_gradable_full_marks": ok, "labs": results,
        "speedups": {v["check"]: v["measurements"]["speedup"] for r in results.values() for v in r["verdicts"]
                     if "speedup" in v.get("measurements", {})},
    }, out_dir=args.out, device=device)
    not_gradable = [c for r in results.values() for c in r["not_gradable"]]
    print(("all gradable checks at full marks" if ok else "SOME GRADABLE CHECKS LOST POINTS")
          + (f"; not gradable here: {', '.join(not_gradable)}" if not_gradable else "") + f"\nsaved {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

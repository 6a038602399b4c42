"""Grade lab 4's speed check for the reference solution and for a borderline submission, and record both verdicts.

The GPU grading record of issue #25: a ratio within its measured spread of a tier boundary is measured again
before it is scored (autograder.checks.remeasure), and every verdict records the card, its clocks, temperature, power
and throttle reasons before and after the timed rounds (autograder.sandbox.gpu_state). One command, a few minutes on
an H100, through the trusted harness without nbgrader (like grade_reference_gpu.py):

  1. the reference solution (from the lab's source notebook) is graded: its ratio and per-step times;
  2. a borderline submission is made from it honestly: after every step the GPU spins (torch.cuda._sleep, on the
     step's stream, no host sync) for a delay calibrated on this card from step 1 so that its expected ratio
     sits on a tier boundary (the highest one below 0.9x the reference's ratio, or --target), jittered per step
     so its rounds have a real spread; it is graded the same way, and once more with a corrected delay if its
     first measurement missed the boundary (--attempts);
  3. benchmarks/results/grading/grade_boundary_<card>.json gets the card, torch, the commit, the command and, per
     verdict: ratio, spread, whether it was re-measured, the pooled result, the GPU state before and after.

    python benchmarks/grade_boundary.py                      # on the GPU machine
    python benchmarks/grade_boundary.py --commit <sha>       # state the commit measured (a copied tree)
    python benchmarks/grade_boundary.py --quick --out /tmp/x # no GPU: synthetic timings, checks the file's shape

Without a CUDA GPU (and without --quick) it says what it skips and exits 2 without writing anything.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECK = "lab4.speed"
JITTER = 0.5  # the per-step delay is drawn uniformly in (1 +- JITTER) x its mean: rounds with a real spread
TARGET_BELOW = 0.9  # the boundary aimed at is the highest one at most this x the reference's ratio
GPU_KEYS = ("name", "sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "power_limit_w", "throttle_reasons")
RECORD_KEYS = ("remeasured", "remeasure_reason", "remeasure_skipped", "first_measurement", "remeasurement", "pooled")

# Appended to the reference solution: the same step, then GPU time spent on purpose (see the module docstring).
BORDERLINE = '''

# Slowed on purpose for the grading record (benchmarks/grade_boundary.py): after every step the GPU spins on the
# step's stream for a delay drawn around DELAY_CYCLES (no host sync; the step itself is the reference's).
import random as _random

import torch as _torch

DELAY_CYCLES = {cycles}
JITTER = {jitter}
_reference_step = build_train_step


def build_train_step(model, **kw):
    step, draw = _reference_step(model, **kw), _random.Random(0)

    def slowed(x, y):
        loss = step(x, y)
        if DELAY_CYCLES > 0 and x.is_cuda:
            _torch.cuda._sleep(int(DELAY_CYCLES * draw.uniform(1 - JITTER, 1 + JITTER)))
        return loss

    return slowed
'''


def git_head() -> str | None:
    """`git rev-parse HEAD` of this checkout now (None outside a git checkout)."""
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def card_tag(name: str | None) -> str:
    """'h100', 'h200', 'a100', ... from a device name, for the result's file name ('gpu' when unknown)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", name or "")
    return m.group(1).lower() if m else "gpu"


def _gpu(reading: dict | None) -> dict | None:
    if not isinstance(reading, dict):
        return None
    return {"error": reading["error"]} if "error" in reading else {k: reading.get(k) for k in GPU_KEYS}


def _state(notes: dict | None) -> dict | None:
    """The GPU before and after one measurement's timed rounds (the chosen keys), or why it was not read."""
    g = (notes or {}).get("gpu_state")
    if not isinstance(g, dict):
        return None
    return {"error": g["error"]} if "error" in g else {"before": _gpu(g.get("start")), "after": _gpu(g.get("end"))}


def verdict_record(label: str, v: dict) -> dict:
    """One verdict as the record keeps it: score, ratio, spread, re-measurement, pooled result, GPU state."""
    from autograder.checks import review

    m = v.get("measurements") or {}
    out = {"submission": label, "check": v.get("check"), "ok": v.get("ok"), "score": v.get("score"),
           "max_score": v.get("max_score"), "gradable": v.get("gradable"), "message": v.get("message"),
           "ratio": m.get("speedup"), "spread_iqr": m.get("speedup_iqr"), "timed_rounds": m.get("timed_rounds"),
           "tiers": m.get("tiers"), "bonus": m.get("bonus"),
           "naive_img_per_s": m.get("naive_img_per_s"), "student_img_per_s": m.get("student_img_per_s"),
           "batch": m.get("batch"), **{k: m[k] for k in RECORD_KEYS if k in m},
           "regrade_recommended": review.near_boundary(m), "gpu_measure_again": m.get("gpu_measure_again"),
           "gpu_state": {"first_measurement": _state(m)}}
    if isinstance(m.get("remeasurement"), dict):
        out["gpu_state"]["remeasurement"] = _state(m["remeasurement"])
    return out


def target_boundary(v: dict, target: float | None) -> float:
    """The tier boundary the borderline submission aims at: `target`, else the highest one below 0.9x the
    reference's ratio."""
    from autograder.checks import review

    m = v["measurements"]
    if target is not None:
        return target
    below = [b for b in review.boundaries(m) if b <= TARGET_BELOW * m["speedup"]]
    if not below:
        raise RuntimeError(f"the reference's {m['speedup']}x is below every tier boundary: nothing to aim at")
    return max(below)


def step_seconds(v: dict) -> tuple[float, float]:
    """(naive, student) seconds per step at the graded batch, from a speed verdict's img/s."""
    m = v["measurements"]
    return m["batch"] / m["naive_img_per_s"], m["batch"] / m["student_img_per_s"]


def sleep_cycles_per_s(device) -> float:
    """How many torch.cuda._sleep cycles this card spins per second (median of 5 timings of 10M cycles)."""
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize(device)
    got = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        got.append(a.elapsed_time(b) / 1e3)
    return 10_000_000 / statistics.median(got)


def grade(path: Path, device: str) -> dict:
    """The trusted harness's lab 4 speed verdict for one file (sandboxed where bubblewrap works)."""
    from autograder.checks import harness

    return harness.run_checks([CHECK], path, device=device)[0]


def borderline(reference: Path, folder: Path, cycles: int) -> Path:
    """The reference solution slowed by `cycles` of GPU spin per step, written as a submission in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / reference.name
    out.write_text(reference.read_text() + BORDERLINE.format(cycles=int(cycles), jitter=JITTER))
    return out


def run_gpu(device: str, attempts: int, target: float | None, deadline_s: float) -> dict:
    """Grade the reference and the borderline submission on this GPU; the record's body."""
    from autograder.checks import harness

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="grade-boundary-") as d:
        nb = ROOT / "assignments" / "source" / "lab4_speedrun" / "lab4_speedrun.ipynb"
        ref = harness.student_file_from_notebook(nb, Path(d))
        print(f"grading the reference solution's {CHECK} on {device} ...", flush=True)
        vref = grade(ref, device)
        verdicts = [verdict_record("reference", vref)]
        if not vref["gradable"] or "student_img_per_s" not in vref["measurements"]:
            raise RuntimeError(f"the reference's speed was not measured: {vref['message']}")
        boundary = target_boundary(vref, target)
        t_naive, t_ref = step_seconds(vref)
        per_s = sleep_cycles_per_s(device)
        delay = max(t_naive / boundary - t_ref, 0.0)
        calib = {"boundary": boundary, "naive_step_s": t_naive, "reference_step_s": t_ref,
                 "sleep_cycles_per_s": round(per_s), "jitter": JITTER, "attempts": []}
        for i in range(attempts):
            cycles = int(delay * per_s)
            print(f"grading a borderline submission (+{1e3 * delay:.3f} ms a step, {cycles} cycles; aiming at "
                  f"{boundary:g}x) ...", flush=True)
            v = grade(borderline(ref, Path(d) / f"borderline{i}", cycles), device)
            rec = verdict_record(f"borderline (attempt {i + 1})", v)
            verdicts.append(rec)
            calib["attempts"].append({"delay_s": delay, "cycles": cycles, "ratio": rec["ratio"]})
            near_first = rec.get("remeasured") or rec.get("remeasure_reason")
            took = time.monotonic() - t0
            one = took / (i + 2)  # seconds of one grading so far (the reference's and each borderline's)
            if near_first or not v["gradable"] or i + 1 == attempts or took + one > deadline_s:
                break
            t_naive_b, t_b = step_seconds(v)  # it missed the boundary: correct the delay by what it measured
            delay = max(delay + t_naive_b / boundary - t_b, 0.0)
    return {"calibration": calib, "verdicts": verdicts}


def summary_lines(verdicts: list[dict]) -> list[str]:
    """One line per verdict for the console."""
    out = []
    for r in verdicts:
        again = ""
        if r.get("remeasured"):
            f, p = r["first_measurement"], r["pooled"]
            again = f"; re-measured: first {f['ratio']}x (IQR {f['iqr']}), pooled {p['ratio']}x over {p['rounds']}"
        flag = "; regrade recommended" if r.get("regrade_recommended") else ""
        out.append(f"  {r['submission']:<24} {r['score']}/{r['max_score']}  {r['ratio']}x (IQR {r['spread_iqr']})"
                   f"{again}{flag}")
    return out


def _command(argv) -> str:
    """The command as run: this script's name and its arguments (those given to main(), else the process's)."""
    return " ".join(["grade_boundary.py", *(sys.argv[1:] if argv is None else argv)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for the record (default benchmarks/results/grading/; --quick: "
                    "required, and never benchmarks/results/grading/)")
    ap.add_argument("--device", default="cuda", help="the GPU to grade on: cuda or cuda:N")
    ap.add_argument("--commit", default=None, help="the commit measured, when this tree is a copy (recorded beside "
                    "`git rev-parse HEAD`)")
    ap.add_argument("--target", type=float, default=None, help="the tier boundary (x naive) to aim the borderline "
                    "submission at (default: the highest below 0.9x the reference's ratio)")
    ap.add_argument("--attempts", type=int, default=2, help="borderline gradings at most, the delay corrected "
                    "after one that missed the boundary (default 2)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="seconds to stay under: no further attempt "
                    "that would pass it (default 220)")
    ap.add_argument("--quick", action="store_true", help="no GPU: synthetic timings through the same record "
                    "code, to check the file's shape (writes only under --out)")
    args = ap.parse_args(argv)
    if args.attempts < 1:
        print("grade_boundary: --attempts must be at least 1", file=sys.stderr)
        return 2
    if args.quick:
        return _quick(args, argv)
    import torch

    if not torch.cuda.is_available():
        print("grade_boundary: no CUDA GPU here: skipping the reference and borderline gradings of lab4.speed "
              "(its tiers need a tensor-core GPU) and the GPU-state record; nothing written. Run it on the GPU "
              "machine, or use --quick --out DIR to check the record's shape.", file=sys.stderr)
        return 2
    from labkit import bench
    from labkit.env import LabkitError, pick_device

    try:
        device = str(pick_device(args.device))
    except LabkitError as e:
        print(f"grade_boundary: {e}", file=sys.stderr)
        return 2
    try:
        body = run_gpu(device, args.attempts, args.target, args.budget_s)
    except RuntimeError as e:  # the reference's speed was not measured, or no boundary lies below it
        print(f"grade_boundary: {e}; nothing written", file=sys.stderr)
        return 1
    card = torch.cuda.get_device_name(torch.device(device))
    head = git_head()
    path = bench.save_result(f"grade_boundary_{card_tag(card)}", {
        "kind": "grade_boundary", "card": card, "torch": torch.__version__, "git_head": head,
        "measured_commit": args.commit or head, "command": _command(argv),
        "device": device, "quick": False, **body}, out_dir=args.out or Path(bench.RESULTS_DIR) / "grading", device=device)
    print("\n".join(summary_lines(body["verdicts"])) + f"\nsaved {path}")
    return 0


def _quick(args, argv=None) -> int:
    """The dry path: two synthetic verdicts (one far from a boundary, one near it) through the same record code."""
    from autograder.checks.harness import Tiers
    from labkit import bench

    if args.out is None or Path(args.out).resolve() in (Path(bench.RESULTS_DIR).resolve(), (Path(bench.RESULTS_DIR) / "grading").resolve()):
        print("grade_boundary: --quick writes synthetic timings: give --out a folder outside benchmarks/results/",
              file=sys.stderr)
        return 2
    tiers = Tiers(((1.5, 0.5), (2.0, 2 / 3), (2.5, 5 / 6), (3.0, 1.0)), bonus=4.0)
    verdicts = [verdict_record(label, _synthetic(tiers, runs)) for label, runs in
                (("reference", [[3.8, 3.81, 3.82]]), ("borderline (attempt 1)", [[2.9, 3.0, 3.1], [3.0, 3.05, 2.95]]))]
    head = git_head()
    body = {"kind": "grade_boundary", "card": "none (--quick: synthetic timings)", "torch": None, "git_head": head,
            "measured_commit": args.commit or head, "command": _command(argv),
            "device": "cpu", "quick": True, "calibration": None, "verdicts": verdicts}
    path = bench.save_result("grade_boundary_quick", body, out_dir=args.out, device="cpu")
    print("\n".join(summary_lines(verdicts)) + f"\nsaved {path} (synthetic, no GPU)")
    return 0


def _synthetic(tiers, runs: list[list[float]]) -> dict:
    """A speed verdict shaped like lab 4's, from per-round ratios handed out one measurement at a time."""
    from autograder.checks import remeasure
    from labkit.bench import ABResult, Timing

    left = list(runs)
    fake_gpu = {"name": "synthetic", "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "temperature_c": 40.0,
                "power_w": 300.0, "power_limit_w": 700.0, "throttle_reasons": []}

    def measure(rounds: int):
        base = left.pop(0) if len(left) > 1 else left[0]
        ratios = [base[i % len(base)] for i in range(rounds)]
        return (ABResult(Timing([0.027] * rounds), Timing([0.027 / r for r in ratios]), ratios),
                {"gpu_state": {"start": fake_gpu, "end": fake_gpu}})

    ab, notes, rec = remeasure.measured(measure, 9, tiers)
    m = {"speedup": round(ab.ratio, 2), "speedup_iqr": round(ab.ratio_iqr, 2), "timed_rounds": len(ab.ratios),
         **rec, "batch": 512, "naive_img_per_s": round(512 / ab.a.median), "student_img_per_s": round(512 / ab.b.median),
         "tiers": tiers.describe(), "bonus": False, **notes}
    frac = tiers.fraction(ab.ratio)
    return {"check": CHECK, "ok": frac > 0, "score": round(6 * frac, 4), "max_score": 6.0, "gradable": True,
            "message": f"{ab.ratio:.2f}x the naive step (synthetic).{remeasure.message(rec)}", "measurements": m}


if __name__ == "__main__":
    sys.exit(main())

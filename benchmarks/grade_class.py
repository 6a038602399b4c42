"""Grade a generated class on CPU, kill the grader mid-run, resume it, and check that nothing was lost.

The class is built from the toy speed assignment (autograder.rehearsal) and the adversarial suite: references,
slow and wrong solutions, edited tests, timer patches, crashes, floods and broken files, cycled up to the class
size. The grader runs as an instructor would run it (`python -m autograder grade ...`), is killed with SIGKILL
once a share of the class is graded, and is started again with the same command. Checked afterwards: every
student has exactly one result with the score its variant deserves, students finished before the kill were
not graded again, and no process or half-written file is left behind.

    python benchmarks/grade_class.py            # 24 students, 2 at a time
    python benchmarks/grade_class.py --quick    # 4 students (a smoke test)

Saves benchmarks/results/grading/grade_class_cpu.json: wall time per submission (median, p95, max), both phases'
wall times, what was lost (nothing, one hopes) and the scores by cause.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autograder import grade, rehearsal, suite  # noqa: E402
from autograder.release.build import generate_release  # noqa: E402
from labkit import bench  # noqa: E402
from labkit.env import LabkitError  # noqa: E402

AID = rehearsal.TOY_ID
# The mix a class is cycled from: mostly honest work, some of everything else (fast enough to grade on CPU).
MIX = ["reference", "slow_correct", "wrong_fast", "release", "cache", "reference", "tests_edited", "stderr_noise",
       "patch_kernel", "kernel_crash", "tests_deleted", "malformed", "output_flood", "no_notebook", "reference",
       "slow_correct"]


def build_class(base: Path, n: int) -> tuple[Path, dict, set]:
    """Course + n hand-ins under base; returns (course, {student id: variant}, speed cells)."""
    course = rehearsal.build_toy_course(base / "course")
    release = generate_release(course, AID, base / "release")
    builder = suite.SuiteBuilder(course / "source" / AID / f"{AID}.ipynb", release, AID, rehearsal.BODIES)
    by_name = {v.name: v for v in builder.variants(flood_lines=20_000)}
    roster = {}
    for i in range(n):
        v = by_name[MIX[i % len(MIX)]]
        roster[f"s{i + 1:03d}_{v.name}"] = v
    subs = base / "subs"
    for sid, v in roster.items():
        (subs / sid).mkdir(parents=True)
        for name, data in v.files.items():
            (subs / sid / name).write_bytes(data)
    return course, roster, builder.speed_cells


def grader_cmd(base: Path, course: Path, jobs: int) -> list[str]:
    return [sys.executable, "-m", "autograder", "grade", AID, "--submissions", str(base / "subs"),
            "--course", str(course), "--out", str(base / "out"), "--work", str(base / "work"), "--preset", "quick",
            "--cell-timeout", "30", "--timeout", "180", "--memory-gb", "3", "--jobs", str(jobs),
            "--harness", "autograder.rehearsal", "--no-progress", "--open-kit"]  # a rehearsal: the public default


def _markers(out: Path) -> dict[str, str]:
    got = {}
    for m in (out / "students").glob("*/result.json"):
        try:
            got[m.parent.name] = json.loads(m.read_text())["finished_at"]
        except (OSError, ValueError, KeyError):
            got[m.parent.name] = "unreadable"
    return got


def interrupted_then_resumed(base: Path, course: Path, jobs: int, kill_after: int) -> dict:
    """Phase 1: grade until `kill_after` students are done, then SIGKILL; phase 2: the same command to the end."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = grader_cmd(base, course, jobs)
    box = {}

    def phase1():
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None and len(_markers(base / "out")) < kill_after:
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        box["killed"] = proc.returncode == -signal.SIGKILL

    def phase2():
        box["phase2"] = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)

    t1 = bench.time_fn(phase1, warmup=0, repeats=1).median
    before = _markers(base / "out")
    t2 = bench.time_fn(phase2, warmup=0, repeats=1).median
    return {"phase1_s": t1, "phase2_s": t2, "killed": box["killed"], "before": before,
            "phase2_rc": box["phase2"].returncode, "phase2_tail": box["phase2"].stdout[-3000:]}


def audit(base: Path, roster: dict, speed_cells: set, before: dict) -> dict:
    """Everything that could have been lost or graded twice, and every score against what it deserves."""
    out = base / "out"
    after = _markers(out)
    results = {sid: grade.load_result(out / "students" / sid / "result.json") for sid in roster}
    import csv

    rows = {r["student_id"]: r for r in csv.DictReader((out / "grades.csv").open())} if (out / "grades.csv").exists() \
        else {}
    wrong = []
    for sid, v in roster.items():
        r = results[sid]
        cells = r.cells if r else []
        wrong += suite.check(v, r, cells, speed_cells)
    leftovers = []
    import psutil

    for p in psutil.process_iter(["pid"]):
        try:  # anything still working inside the class folder: nbgrader, a kernel, a harness worker
            if p.pid != os.getpid() and Path(p.cwd()).is_relative_to(base):
                leftovers.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return {
        "students": len(roster),
        "missing_results": sorted(set(roster) - {s for s, r in results.items() if r is not None}),
        "missing_rows": sorted(set(roster) - set(rows)),
        "regraded_after_kill": sorted(s for s, f in before.items() if f != "unreadable" and after.get(s) != f),
        "half_written": sorted(str(p.relative_to(out)) for p in out.rglob(".*.tmp")),
        "running_markers_left": sorted(p.parent.name for p in out.glob("students/*/running.json")),
        "leftover_processes": leftovers,
        "wrong_scores": wrong,
        "results": {s: r for s, r in results.items() if r is not None},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(bench.RESULTS_DIR / "grading"), help="folder for grade_class_cpu.json")
    ap.add_argument("--quick", action="store_true", help="4 students, killed after 1 (a smoke test)")
    ap.add_argument("--students", type=int, default=None, help="class size (default 24; --quick 4)")
    ap.add_argument("--jobs", type=int, default=2, help="students graded at once (default 2)")
    ap.add_argument("--kill-after", type=int, default=None,
                    help="kill the grader once this many students are done (default: a third of the class)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="build the class here and keep it (default: a temp dir)")
    args = ap.parse_args(argv)
    n = args.students or (4 if args.quick else 24)
    if n < 2 or args.jobs < 1:
        print("grade_class: error: need at least 2 students and 1 job", file=sys.stderr)
        return 2
    kill_after = args.kill_after or max(1, n // 3)
    with tempfile.TemporaryDirectory(prefix="grade-class-") as tmp:
        base = Path(args.keep).resolve() if args.keep else Path(tmp)
        try:
            course, roster, speed_cells = build_class(base, n)
        except LabkitError as e:
            print(f"grade_class: error: {e}", file=sys.stderr)
            return 2
        print(f"grading {n} students ({args.jobs} at a time), killing the grader after {kill_after} ...")
        run = interrupted_then_resumed(base, course, args.jobs, kill_after)
        a = audit(base, roster, speed_cells, run["before"])
    per = sorted(r.wall_s for r in a["results"].values() if r.wall_s)
    causes: dict[str, int] = {}
    for r in a["results"].values():
        causes[r.cause or "none"] = causes.get(r.cause or "none", 0) + 1
    lost = {k: a[k] for k in ("missing_results", "missing_rows", "regraded_after_kill", "half_written",
                              "running_markers_left", "leftover_processes", "wrong_scores")}
    data = {
        "students": n, "jobs": args.jobs, "kill_after": kill_after, "killed": run["killed"],
        "done_before_kill": len(run["before"]), "phase1_s": run["phase1_s"], "phase2_s": run["phase2_s"],
        "total_s": run["phase1_s"] + run["phase2_s"], "phase2_exit_code": run["phase2_rc"],
        "per_submission_s": {"median": statistics.median(per) if per else None,
                             "p95": bench.quantile(per, 0.95) if per else None, "max": max(per) if per else None,
                             "n": len(per)},
        "class_throughput_students_per_min": 60 * n / (run["phase1_s"] + run["phase2_s"]),
        "nothing_lost": not any(lost.values()), "lost": lost, "causes": causes,
        "scores": {s: r.score for s, r in sorted(a["results"].items())},
        "summary_tail": run["phase2_tail"],
    }
    p = bench.save_result("grade_class_cpu", data, out_dir=args.out, device="cpu")
    print(run["phase2_tail"][-1500:])
    print(f"{n} students, {len(run['before'])} done before the kill; phases {run['phase1_s']:.0f} s + "
          f"{run['phase2_s']:.0f} s; per submission median {data['per_submission_s']['median'] or 0:.1f} s, "
          f"max {data['per_submission_s']['max'] or 0:.1f} s")
    print("nothing lost" if data["nothing_lost"] else f"LOST: {json.dumps(lost, indent=1)[:2000]}")
    print(f"saved {p}")
    return 0 if data["nothing_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())

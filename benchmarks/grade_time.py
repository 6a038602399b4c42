"""Grading time per honest student: this checkout's grader against another commit's, side by side.

For each lab, a class of reference hand-ins (the source notebook's solution, with the released files) is graded
by `python -m autograder grade`, once with this checkout's code and once with the other checkout's, in
alternating order, `--repeats` times. A student's time is the grader's own `wall_s` for them (their notebook's
run plus the trusted checks); the run's total wall time is recorded too. Make the other checkout with
`git worktree add /tmp/before <commit>`.

    LABKIT_OPEN_KIT=1 python benchmarks/grade_time.py --against /tmp/before  # toy, lab1, lab2, lab3
    LABKIT_OPEN_KIT=1 python benchmarks/grade_time.py --against /tmp/before --labs lab4_speedrun --repeats 2  # GPU

Saves benchmarks/results/grading/grade_time_<device>.json: per lab and checkout every student's seconds, the medians
and their ratio (this checkout / the other).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labkit.env import environment  # noqa: E402
from labkit.errors import LabkitError  # noqa: E402
from labkit.outputs import write_json  # noqa: E402

TOY = "toy_sum_squares"
CPU_LABS = (TOY, "lab1_loss_scaling", "lab2_data_pipeline", "lab3_profile_fix")

# Run inside the checkout being measured (its own autograder on sys.path): lays out a class of reference hand-ins.
_BUILD = """
import shutil, sys
from pathlib import Path
from autograder.release.build import generate_release
lab, base, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
if lab == "toy_sum_squares":
    from autograder import rehearsal
    course = rehearsal.build_toy_course(base / "course")
else:
    course = base / "course"
    shutil.copytree(Path("assignments"), course, ignore=shutil.ignore_patterns(
        "release", "submitted", "autograded", "feedback", "gradebook.db", "student_*.py", "__pycache__"))
release = generate_release(course, lab, base / "release")
release = release.parent if release.is_file() else release
for i in range(n):
    dest = base / "subs" / f"s{i:02d}"
    shutil.copytree(release, dest)
    shutil.copy(course / "source" / lab / f"{lab}.ipynb", dest / f"{lab}.ipynb")
print(course)
"""


def grade_once(tree: Path, lab: str, students: int, base: Path, timeout_s: float, memory_gb: float | None) -> dict:
    """Build a class of `students` reference hand-ins with `tree`'s code, grade it with `tree`'s grader."""
    keep = ("PATH", "HOME", "LANG", "CUDA_VISIBLE_DEVICES", "TMPDIR", "LABKIT_COURSE_SECRET", "LABKIT_OPEN_KIT")
    env = {k: v for k, v in os.environ.items() if k in keep}  # the course secret, or the open kit said on purpose
    env["PYTHONPATH"] = str(tree)  # that checkout's grader and labkit, nothing else
    built = subprocess.run([sys.executable, "-c", _BUILD, lab, str(base), str(students)], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=600)
    if built.returncode:
        raise LabkitError(f"could not build the {lab} class with {tree}: {built.stderr.strip()[-400:]}")
    course = built.stdout.strip().splitlines()[-1]
    cmd = [sys.executable, "-m", "autograder", "grade", lab, "--submissions", str(base / "subs"), "--course", course,
           "--out", str(base / "out"), "--work", str(base / "work"), "--jobs", "1", "--no-progress", "--force"]
    if lab == TOY:
        cmd += ["--harness", "autograder.rehearsal", "--preset", "quick"]
    if memory_gb:
        cmd += ["--memory-gb", str(memory_gb)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    total = time.monotonic() - t0
    if not all((base / "out" / "students" / f"s{i:02d}" / "result.json").is_file() for i in range(students)):
        raise LabkitError(f"{tree}'s grader recorded no result (exit {r.returncode}): "
                          f"{(r.stdout + r.stderr).strip()[-1500:]}")
    per, notebook, scores = [], [], []
    for i in range(students):
        sdir = base / "out" / "students" / f"s{i:02d}"
        res = json.loads((sdir / "result.json").read_text())
        per.append(round(res["wall_s"], 2))
        notebook.append(_notebook_seconds(sdir / "autograde.log"))
        scores.append(f"{res['score']:g}/{res['max_score']:g}")
        if res["score"] < res["max_score"]:  # a reference that loses points: the time measures something else
            lost = [c for c in res.get("cells", []) if c.get("score", 0) < c.get("max_score", 0)]
            print(f"  {tree.name}/s{i:02d}: {res.get('status')} {res.get('cause')} {res.get('message')}; "
                  f"notes {res.get('notes')}; lost {[c.get('cell', c) for c in lost][:6]}", flush=True)
            print("  " + (sdir / "autograde.log").read_text(errors="replace")[-1500:], flush=True)
    return {"total_s": round(total, 1), "per_student_s": per, "notebook_s": notebook, "scores": scores,
            "exit_code": r.returncode}


def _notebook_seconds(log: Path) -> float | None:
    """The notebook's run (nbgrader autograde) out of a student's time: the log's "# ended: ok, 7.6 s" line."""
    m = re.search(r"^# ended: .*?, ([0-9.]+) s", log.read_text(errors="replace"), re.M) if log.is_file() else None
    return float(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="another checkout of this repository (the grader before)")
    ap.add_argument("--labs", nargs="+", default=list(CPU_LABS), help="assignment ids (toy_sum_squares: the toy)")
    ap.add_argument("--students", type=int, default=2, help="reference hand-ins per class")
    ap.add_argument("--repeats", type=int, default=2, help="classes graded per lab and checkout (alternating)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one class's grading may take")
    ap.add_argument("--memory-gb", type=float, default=None, help="the grader's memory budget per student, GiB "
                    "(the grader before the sandbox counted every process of the kernel: 16 GiB stops lab 4 on a GPU)")
    ap.add_argument("--only", choices=("this", "before"), default=None, help="grade with one checkout only")
    ap.add_argument("--against-commit", default=None, help="the other checkout's commit, where it is no git checkout")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/grading/grade_time_<device>.json)")
    a = ap.parse_args(argv)
    other = Path(a.against).resolve()
    if not (other / "autograder" / "grade.py").is_file():
        raise SystemExit(f"grade_time: {other} is not a checkout of this repository (no autograder/grade.py)")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(a.out or ROOT / "benchmarks" / "results" / "grading" / f"grade_time_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise SystemExit(f"grade_time: cannot write {out}")
    trees = {"this": ROOT, "before": other}
    record = {"name": "grade_time", "env": environment(["grade_time.py", *(argv or sys.argv[1:])]),
              "against": str(other), "against_commit": a.against_commit or _commit(other), "this_commit": _commit(ROOT), "labs": {}}
    for lab in a.labs:
        runs = {"this": [], "before": []}
        for rep in range(a.repeats):
            order = ["this", "before"] if rep % 2 == 0 else ["before", "this"]
            for name in [n for n in order if a.only in (None, n)]:
                with tempfile.TemporaryDirectory(prefix="grade-time-") as tmp:
                    got = grade_once(trees[name], lab, a.students, Path(tmp), a.timeout, a.memory_gb)
                runs[name].append(got)
                print(f"{lab} {name} repeat {rep + 1}: {got['per_student_s']} s per student (notebook "
                      f"{got['notebook_s']} s), scores {got['scores']}", flush=True)
        if a.only:
            record["labs"][lab] = {"runs": runs}
            write_json(out, record)
            continue
        med = {k: statistics.median(s for r in v for s in r["per_student_s"]) for k, v in runs.items()}
        record["labs"][lab] = {"runs": runs, "median_s": med, "ratio": round(med["this"] / med["before"], 2),
                               "range_s": {k: [min(s for r in v for s in r["per_student_s"]),
                                               max(s for r in v for s in r["per_student_s"])]
                                           for k, v in runs.items()}}
        print(f"{lab}: median {med['this']:.1f} s per student, before {med['before']:.1f} s "
              f"({record['labs'][lab]['ratio']}x)", flush=True)
        write_json(out, record)  # after every lab: an interrupted run keeps what it measured
    print(f"saved {out}")
    return 0


def _commit(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())

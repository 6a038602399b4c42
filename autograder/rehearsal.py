"""A toy speed assignment with its own small harness, for rehearsing the grader on any machine in seconds.

`toy_sum_squares` asks for a fast sum of squares of an int64 array. It has the shape of the course's speed
labs: the student's code goes into a `%%writefile pipeline.py` cell, one test cell checks correctness (with a
hidden test), one checks speed by calling `run_check(...)`, which runs the student's file in a fresh process,
checks its answers on fresh inputs, then times it against a slow baseline through labkit.bench.compare
(interleaved, median ratio). It is what the grader's own tests and the class-size benchmark grade on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Test cells import this module inside the kernel: keep it light (no torch, no nbformat at import).
REPO_ROOT = Path(__file__).resolve().parents[1]

TOY_ID = "toy_sum_squares"
CHECK = "toy.speed"
REQUIRED_RATIO = 4.0  # the reference is ~50x faster than the baseline loop on CPU; another loop is ~1x
N_ELEMENTS = 20_000  # elements per call

REFERENCE = "import numpy as np\n\n\ndef total(xs):\n    return int(np.dot(xs, xs))\n"
# Bodies for the adversarial suite: what a student might write.
BODIES = {
    "wrong_fast": "import numpy as np\n\n\ndef total(xs):\n    return int(xs.sum())\n",
    "slow_correct": "def total(xs):\n    s = 0\n    for x in xs.tolist():\n        s += x * x\n    return s\n",
    "cache": ("_seen = {}\n\n\ndef total(xs):\n    key = xs.tobytes()\n    if key not in _seen:\n"
              "        s = 0\n        for x in xs.tolist():\n            s += x * x\n        _seen[key] = s\n"
              "    return _seen[key]\n"),
    "timer_patch": ("import time\n_real = time.perf_counter\n_calls = [0]\n\n\ndef _fake():\n    _calls[0] += 1\n"
                    "    return _real() / 1000.0\n\n\ntime.perf_counter = _fake\n\n\n"
                    "def total(xs):\n    s = 0\n    for x in xs.tolist():\n        s += x * x\n    return s\n"),
}


def _meta(grade_id: str, *, grade: bool, solution: bool, locked: bool, points: float | None = None) -> dict:
    nb = {"grade": grade, "solution": solution, "locked": locked, "grade_id": grade_id, "schema_version": 3}
    if points is not None:
        nb["points"] = points
    return {"nbgrader": nb}


def toy_notebook():
    """The source notebook (with solution and hidden tests) of the toy assignment, as an nbformat node."""
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    solution = "%%writefile pipeline.py\n" + REFERENCE.replace(
        "    return int(np.dot(xs, xs))\n",
        "    ### BEGIN SOLUTION\n    return int(np.dot(xs, xs))\n    ### END SOLUTION\n")
    correct = ("import numpy as np\nfrom pipeline import total\n\nassert total(np.arange(10, dtype=np.int64)) == 285\n"
               "### BEGIN HIDDEN TESTS\nrng = np.random.default_rng(7)\nys = rng.integers(-1000, 1000, size=1000)\n"
               "assert total(ys) == int((ys.astype(np.int64) ** 2).sum())\n### END HIDDEN TESTS\n")
    speed = ("from autograder.rehearsal import run_check\n\n"
             f"r = run_check({CHECK!r}, 'pipeline.py', timeout_s=120)\nprint(r['message'])\n"
             "assert r['passed'], r['message']\n")
    nb = new_notebook(cells=[
        new_markdown_cell("# Toy speed lab\nWrite `total(xs)`: the sum of squares of an int64 array, fast."),
        new_code_cell(solution, metadata=_meta("pipeline", grade=False, solution=True, locked=False)),
        new_code_cell(correct, metadata=_meta("test_correct", grade=True, solution=False, locked=True, points=2)),
        new_code_cell(speed, metadata=_meta("test_speed", grade=True, solution=False, locked=True, points=3)),
    ])
    for i, cell in enumerate(nb.cells):
        cell.id = f"toy-{i}"  # stable ids: the same source must hash the same (finished students stay finished)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def build_toy_course(root: str | Path) -> Path:
    """Write an nbgrader course root with the toy assignment's source; returns the root."""
    import nbformat

    root = Path(root)
    (root / "source" / TOY_ID).mkdir(parents=True, exist_ok=True)
    (root / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'labkit-rehearsal'\n")
    nbformat.write(toy_notebook(), root / "source" / TOY_ID / f"{TOY_ID}.ipynb")
    return root


# ------------------------------------------------------------------------------------------------ toy harness

_WORKER = r"""
import importlib.util, json, os, platform, sys, time
import numpy as np
from labkit.bench import compare

path, n, need = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
clocks = (time.perf_counter, time.monotonic, time.time)

def baseline(xs):
    s = 0
    for x in xs.tolist():
        s += x * x
    return s

def answer(**kw):
    print("@@toy@@" + json.dumps(kw), flush=True)
    sys.exit(0)

common = dict(card=f"CPU ({platform.machine()}, {os.cpu_count()} cores)", hardware="CPU", required_ratio=need)
try:
    spec = importlib.util.spec_from_file_location("student_pipeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = mod.total
except Exception as e:
    answer(passed=False, message=f"your pipeline.py does not import: {type(e).__name__}: {e}", **common)
if (time.perf_counter, time.monotonic, time.time) != clocks:
    answer(passed=False, message="your code replaced a clock; speed cannot be measured", **common)
rng = np.random.default_rng()
for xs in [np.arange(10, dtype=np.int64), rng.integers(-1000, 1000, size=n)]:
    if int(fn(xs)) != baseline(xs):
        answer(passed=False, message="wrong answer, so no speed points", **common)
# Every timed call gets new data: remembering earlier answers does not help.
pool = iter([rng.integers(-1000, 1000, size=n) for _ in range(64)])
outs = []
ab = compare(lambda: baseline(next(pool)), lambda: outs.append(fn(next(pool))), rounds=7, warmup=2)
if (time.perf_counter, time.monotonic, time.time) != clocks:
    answer(passed=False, message="your code replaced a clock; speed cannot be measured", **common)
ok = ab.ratio >= need
answer(passed=bool(ok), ratio=ab.ratio, ratio_iqr=ab.ratio_iqr, baseline_img_s=n / ab.a.median,
       student_img_s=n / ab.b.median,
       message=f"{ab.ratio:.1f}x the baseline ({'enough' if ok else 'need'} {need:g}x)", **common)
"""


def run_check(name: str, student_file: str, timeout_s: float = 120.0) -> dict:
    """Check `student_file` in a fresh process: answers on fresh inputs, then speed against the baseline.

    Returns passed, message, ratio, baseline_img_s / student_img_s (elements per second), card, hardware.
    """
    if name != CHECK:
        return {"passed": False, "message": f"unknown check {name!r} (this harness knows {CHECK!r})"}
    path = Path(student_file).resolve()
    if not path.is_file():
        return {"passed": False, "message": f"{student_file} does not exist: run the cell that writes it"}
    code = f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\n" + _WORKER
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", code, str(path), str(N_ELEMENTS), str(REQUIRED_RATIO)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=path.parent)
    except subprocess.TimeoutExpired:
        return {"passed": False, "message": f"did not finish within {timeout_s:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("@@toy@@"):
            return json.loads(line[len("@@toy@@"):])
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"passed": False, "message": f"the check crashed (exit {proc.returncode}): {last[:200]}"}

"""A toy speed assignment with its own small harness, for rehearsing the grader on any machine in seconds.

`toy_sum_squares` asks for a fast sum of squares of an int64 array. It has the shape of the course's speed
labs: the student's code goes into a `%%writefile pipeline.py` cell, one test cell checks correctness (with a
hidden test), one checks speed by calling `run_check(...)`, which runs the student's file in a fresh process,
checks its answers on fresh inputs, then times it against a slow baseline through labkit.bench.compare
(interleaved, median ratio). It is what the grader's own tests and the class-size benchmark grade on CPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Test cells import this module inside the kernel: keep it light (no torch, no nbformat at import).
REPO_ROOT = Path(__file__).resolve().parents[1]

TOY_ID = "toy_sum_squares"
CHECK = "toy.speed"
REQUIRED_RATIO = 4.0  # the reference is ~20-50x the baseline loop on CPU, timed from outside; another loop ~1x
N_ELEMENTS = 200_000  # elements per call
INNER = 8  # calls per timed request: the fixed cost of a request (a scheduling delay on a busy machine) stays small

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


WRITTEN_ID = "written_why"  # the toy's written answer (with `written=True`): graded by a person
WRITTEN_POINTS = 2


def toy_notebook(written: bool = False):
    """The source notebook (with solution and hidden tests) of the toy assignment, as an nbformat node; with
    `written`, also a written answer (a manually graded markdown cell holding the model answer and rubric)."""
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    solution = "%%writefile pipeline.py\n" + REFERENCE.replace(
        "    return int(np.dot(xs, xs))\n",
        "    ### BEGIN SOLUTION\n    return int(np.dot(xs, xs))\n    ### END SOLUTION\n")
    correct = ("from autograder.rehearsal import run_check\n\n"
               "r = run_check('toy.correct', 'pipeline.py', timeout_s=120)\nprint(r['message'])\n"
               "assert r['passed'], r['message']\n"
               "### BEGIN HIDDEN TESTS\nr = run_check('toy.hidden', 'pipeline.py', timeout_s=120)\n"
               "assert r['passed'], r['message']\n### END HIDDEN TESTS\n")
    speed = ("from autograder.rehearsal import run_check\n\n"
             f"r = run_check({CHECK!r}, 'pipeline.py', timeout_s=120)\nprint(r['message'])\n"
             "assert r['passed'], r['message']\n")
    nb = new_notebook(cells=[
        new_markdown_cell("# Toy speed lab\nWrite `total(xs)`: the sum of squares of an int64 array, fast."),
        new_code_cell(solution, metadata=_meta("pipeline", grade=False, solution=True, locked=False)),
        new_code_cell(correct, metadata=_meta("test_correct", grade=True, solution=False, locked=True, points=2)),
        new_code_cell(speed, metadata=_meta("test_speed", grade=True, solution=False, locked=True, points=3)),
    ])
    if written:
        nb.cells.append(new_markdown_cell(
            "**Why is `np.dot` faster than the loop? Quote your ratio.**\n\n### BEGIN SOLUTION\n"
            "Model answer: one call into compiled code instead of one interpreter step per element.\n\n"
            "Rubric (2 points): 1 for the interpreter overhead per element, 1 for the measured ratio.\n"
            "### END SOLUTION",
            metadata=_meta(WRITTEN_ID, grade=True, solution=True, locked=False, points=WRITTEN_POINTS)))
    for i, cell in enumerate(nb.cells):
        cell.id = f"toy-{i}"  # stable ids: the same source must hash the same (finished students stay finished)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def build_toy_course(root: str | Path, written: bool = False) -> Path:
    """Write an nbgrader course root with the toy assignment's source (`written`: with a written answer);
    returns the root."""
    import nbformat

    root = Path(root)
    (root / "source" / TOY_ID).mkdir(parents=True, exist_ok=True)
    # A test cell runs the harness in fresh processes: more than nbgrader's default 30 s on a busy machine.
    (root / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'labkit-rehearsal'\n"
                                             "c.Execute.timeout = 300\n")
    nbformat.write(toy_notebook(written), root / "source" / TOY_ID / f"{TOY_ID}.ipynb")
    return root


# ------------------------------------------------------------------------------------------------ toy harness
# The toy's checks are ordinary harness checks (autograder.checks.harness.CHECKS "toy.*"): the student's file runs in
# the sandbox (autograder.student.toy), the answers and the clock stay here.


def hidden_params(student: str | None = None, handin: str | None = None) -> dict:
    """The hidden test's inputs, from the course secret and the student or the hand-in (harness.hidden_draws):
    reading this code reveals none of them; they reach the student's process only when graded."""
    from autograder.base import course_secret

    r = course_secret.rng("toy.hidden/inputs", student, handin=handin)
    return {"seed": int(r.integers(2**31)), "count": 3, "n": int(r.integers(800, 1200))}


def _expect_totals(got, xs_list) -> None:
    from autograder.checks.harness import require
    from autograder.student.toy import baseline

    totals = got.get("totals") if isinstance(got, dict) else None
    require(isinstance(totals, list) and len(totals) == len(xs_list), "total(xs) returned the wrong number of answers")
    for v, xs in zip(totals, xs_list, strict=True):
        require(v == baseline(xs), "wrong answer, so no points")


def check_correct(ctx) -> dict:
    import numpy as np

    from autograder.student.toy import arrays

    xs = [np.arange(10, dtype=np.int64), *arrays(int.from_bytes(os.urandom(4), "little"), 2, 1000)]
    _expect_totals(ctx.call("toy.totals", {"arrays": [x.tolist() for x in xs]}), xs)
    return {"message": "right answers on fresh inputs"}


def check_hidden(ctx) -> dict:
    from autograder.checks.harness import hidden_draws
    from autograder.student.toy import arrays

    for draw in hidden_draws(ctx):
        params = hidden_params(**draw)
        _expect_totals(ctx.call("toy.totals", params), arrays(**params))
    return {"message": "right answers on the hidden inputs"}


def check_speed(ctx) -> dict:
    import platform

    import numpy as np

    from autograder.checks import remeasure
    from autograder.checks.harness import CheckFailed
    from autograder.student.toy import pool, windows

    t0 = time.monotonic()
    check_correct(ctx)  # correctness gates speed
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    pool_seed, pool_n = int(rng.integers(1 << 62)), 4 * N_ELEMENTS
    values = pool(pool_seed, pool_n)

    def fresh() -> dict:
        return {"pool_seed": pool_seed, "pool_n": pool_n, "n": N_ELEMENTS,
                "offsets": [int(o) for o in rng.integers(0, pool_n - N_ELEMENTS, size=INNER)]}

    def verify(result, params):  # every timed answer is checked: skipping work when timed earns nothing
        _expect_totals(result, windows(params, values))

    def timed(k: int):  # one measurement on fresh windows (a re-measurement near the boundary gets its own)
        rounds = [fresh() for _ in range(2 + k)]
        return ctx.compare(lambda r: ("toy.baseline", rounds[r]), lambda r: ("toy.totals", rounds[r]), rounds=k,
                           warmup=2, inner=INNER, check_base=verify, check_student=verify)

    ab, notes, record = remeasure.measured(timed, 7, None, required_ratio=REQUIRED_RATIO, time_left=ctx._left,
                                           spent=lambda: time.monotonic() - t0)
    ok = ab.ratio >= REQUIRED_RATIO
    m = {"ratio": ab.ratio, "ratio_iqr": ab.ratio_iqr, "baseline_img_s": N_ELEMENTS / ab.a.median,
         "student_img_s": N_ELEMENTS / ab.b.median, "required_ratio": REQUIRED_RATIO,
         "card": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", **record, **notes}
    msg = f"{ab.ratio:.1f}x the baseline ({'enough' if ok else 'need'} {REQUIRED_RATIO:g}x){remeasure.message(record)}"
    if not ok:
        raise CheckFailed(msg, **m)
    return {"message": msg, "measurements": m}


def run_checks(names: list[str], student_file: str, **kw) -> list[dict]:
    """The harness's verdicts for toy checks (see autograder.checks.harness.run_checks)."""
    from autograder.checks import harness

    return harness.run_checks(names, student_file, **kw)


def run_check(name: str, student_file: str, timeout_s: float = 120.0) -> dict:
    """One toy check in a fresh process (student code sandboxed where bubblewrap works); adds `passed`."""
    from autograder.checks import harness

    if name not in harness.CHECKS or not name.startswith("toy."):
        return {"passed": False, "message": f"unknown check {name!r} (this harness knows the toy.* checks)"}
    v = harness.run_check(name, student_file, timeout_s=timeout_s)
    return {**v, "passed": bool(v["ok"]), **v.get("measurements", {})}

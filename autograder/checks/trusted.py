"""Trusted checks: find the harness calls in an assignment's test cells and run them outside the kernel.

A test cell scores through the harness: `grade("lab2.loader_speed", "student_pipeline.py", points=4)` (the
course's labs) or `run_check("name", "file.py")` (simpler assignments). The harness measures in a fresh
process, but the call itself happens in the student's kernel, after cells the student added: those may have
replaced `grade`, `run_checks`, `subprocess.run` or `json.loads` there, so a cell's result inside the notebook
proves nothing. The grader therefore re-runs every check itself, in a fresh interpreter started in isolated
mode (`python -I`, no student folder on sys.path) in a folder that holds only a copy of the student's file,
under the student's time and memory budget, and the cell's score is recomputed from those verdicts.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autograder.sandbox.limits import LeftFileError, Limits, Outcome, read_left, run_limited
from labkit.env import REPO_ROOT

RESULT_MARK = "@@labkit-trusted-verdicts@@"
_CALLS = ("grade", "run_check")


@dataclass
class HarnessCall:
    """One harness call found in a test cell."""

    notebook: str  # notebook id (file stem)
    cell: str  # nbgrader grade_id of the test cell
    check: str  # harness check name
    student_file: str  # file the student's notebook writes, relative to the assignment folder
    kind: str  # "grade" (verdict carries score/max_score) or "run_check" (pass/fail)


@dataclass
class Verdict:
    """The trusted outcome of one check."""

    check: str  # harness check name
    passed: bool | None  # True / False; None when this hardware cannot grade it
    fraction: float  # share of the cell's points earned (0 unless passed)
    message: str = ""  # one line for the student
    numbers: dict = field(default_factory=dict)  # measurements: throughputs, ratio, tiers, ...
    cause: str | None = None  # timeout / memory / no file / harness error, when the check produced no verdict


def _strip_magics(src: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


def _const(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def find_calls(notebook_path: Path) -> list[HarnessCall]:
    """Every `grade(check, file, ...)` / `run_check(check, file, ...)` with literal arguments in test cells."""
    import nbformat  # here, not at import: the GPU machine's benchmarks use this module without Jupyter

    nb = nbformat.read(notebook_path, as_version=4)
    found = []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        try:
            tree = ast.parse(_strip_magics(cell.source))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name not in _CALLS:
                continue
            kw = {k.arg: _const(k.value) for k in node.keywords if k.arg}
            args = [_const(a) for a in node.args]
            check = args[0] if args else kw.get("check") or kw.get("name")
            sfile = args[1] if len(args) > 1 else kw.get("student_file")
            if check and sfile:
                found.append(HarnessCall(notebook_path.stem, meta["grade_id"], check, sfile, name))
    return found


# Measurement names a check may use for the numbers the summary shows, matched in order.
_RATIO = re.compile(r"^(ratio|speedup|speed_up)$")
_BASE = re.compile(r"^baseline.*(per_s|img_s|ips|throughput)$|^(pil|naive|slow).*(per_s|img_s)$")
_MINE = re.compile(r".*(per_s|img_s|ips|throughput)$")


def headline(numbers: dict) -> dict:
    """ratio, baseline_img_s and student_img_s picked out of a check's measurements (absent if not there)."""
    out = {}
    for k, v in numbers.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if "ratio" not in out and _RATIO.match(k):
            out["ratio"] = v
        elif "baseline_img_s" not in out and _BASE.match(k):
            out["baseline_img_s"] = v
    for k, v in numbers.items():
        if (isinstance(v, (int, float)) and not isinstance(v, bool) and "student_img_s" not in out
                and _MINE.match(k) and not _BASE.match(k)):
            out["student_img_s"] = v
    return out


def interpret(call: HarnessCall, answer: dict) -> Verdict:
    """A verdict from the harness's answer: `ok`/`gradable`/`score`/`max_score`, or a toy harness's `passed`."""
    passed = answer.get("ok", answer.get("passed"))
    passed = None if passed is None else bool(passed)
    if answer.get("gradable") is False:
        passed = None
    fraction = 0.0
    if passed:
        if call.kind == "grade" and answer.get("max_score"):
            fraction = min(max(float(answer.get("score", 0.0)) / float(answer["max_score"]), 0.0), 1.0)
        else:
            fraction = 1.0
    numbers = {k: v for k, v in answer.items() if k not in ("ok", "passed", "message", "measurements", "check")}
    numbers.update(answer.get("measurements") or {})
    numbers.pop("traceback", None)
    return Verdict(call.check, passed, fraction, str(answer.get("message") or "")[:500], numbers)


def run_trusted(calls: list[HarnessCall], assignment_dir: Path, scratch: Path, *, harness_module: str,
                limits: Limits, env: dict[str, str], data_files: dict[str, bytes] | None = None,
                sandbox: str = "bwrap", memory_gb: float | None = None, cache: Path | None = None,
                student: str | None = None, disk_gb: float | None = None, handin: str | None = None,
                ) -> tuple[dict[str, Verdict], list[Outcome]]:
    """Run `calls` from fresh trusted interpreters (one per student file); never raises.

    `student`, the student id, `cache`, `disk_gb` (what the student's processes may write, GiB) and `handin` (the
    hand-in's digest, for which the hidden checks draw their cases) go to a harness whose run_checks takes them
    (lab 3 grades that student's variant).

    Each gets a folder holding the assignment's own files (`data_files`, as nbgrader puts them beside the
    notebook) and a copy of the student's file, nothing else the student wrote. The harness runs the
    student's code in its own sandboxed process (`sandbox`: "bwrap", or "none" for trusted submissions), with
    `cache` (the student's own compile-cache folder, which their notebook's run filled) as its compile cache.
    """
    verdicts, outcomes = {}, []
    by_file: dict[str, list[HarnessCall]] = {}
    for c in calls:
        by_file.setdefault(c.student_file, []).append(c)
    for i, (sfile, group) in enumerate(by_file.items()):
        names = list(dict.fromkeys(c.check for c in group))
        try:  # as data: a link there could point at a classmate's file (read_left refuses links)
            student_code = read_left(assignment_dir, sfile)
        except (FileNotFoundError, LeftFileError) as e:
            missing = isinstance(e, FileNotFoundError)
            for c in group:
                verdicts[c.check] = Verdict(
                    c.check, False, 0.0, f"{sfile} was not written by the notebook, so there is nothing to check"
                    if missing else f"{sfile} is not a file the notebook wrote ({e}): not checked",
                    cause="no file" if missing else "not a file")
            continue
        box = scratch / f"run{i}"
        shutil.rmtree(box, ignore_errors=True)
        for rel, data in (data_files or {}).items():
            (box / rel).parent.mkdir(parents=True, exist_ok=True)
            (box / rel).write_bytes(data)
        (box / sfile).parent.mkdir(parents=True, exist_ok=True)
        (box / sfile).write_bytes(student_code)
        code = (
            "import json, sys\n"
            f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
            f"import {harness_module} as h\n"
            f"names, path = {names!r}, {sfile!r}\n"
            "import inspect\n"
            f"given = {{'student': {student!r}, 'cache': {str(cache) if cache else None!r}, 'disk_gb': {disk_gb!r}, "
            f"'handin': {handin!r}}}\n"
            "params = inspect.signature(h.run_checks).parameters.values() if hasattr(h, 'run_checks') else []\n"
            "takes = lambda k: any(p.name == k or p.kind == p.VAR_KEYWORD for p in params)\n"
            "kw = {k: v for k, v in given.items() if v is not None and takes(k)}\n"
            "if hasattr(h, 'run_checks'):\n"
            f"    out = h.run_checks(names, path, sandbox={sandbox!r}, memory_gb={memory_gb!r}, **kw)\n"
            "else:\n"
            "    out = [h.run_check(n, path) for n in names]\n"
            f"print({RESULT_MARK!r} + json.dumps(out, default=str), flush=True)\n"
        )
        outcome = run_limited([sys.executable, "-I", "-c", code], cwd=box, env=env, limits=limits)
        outcomes.append(outcome)
        answers = _parse(outcome.output)
        for c in group:
            if answers is not None and len(answers) == len(names) and isinstance(answers[names.index(c.check)], dict):
                verdicts[c.check] = interpret(c, answers[names.index(c.check)])
            else:
                cause = outcome.cause() or "no verdict"
                tail = (outcome.output.strip().splitlines() or [""])[-1][:200]
                verdicts[c.check] = Verdict(c.check, False, 0.0, f"the check did not finish ({cause}): {tail}",
                                            cause=cause)
    return verdicts, outcomes


def _parse(text: str) -> list | None:
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                out = json.loads(line[len(RESULT_MARK):])
            except json.JSONDecodeError:
                return None
            return out if isinstance(out, list) else None
    return None


def cell_scores(calls: list[HarnessCall], verdicts: dict[str, Verdict], cells: list[dict]) -> list[str]:
    """Rescore every cell that calls the harness from the trusted verdicts (in place); returns flags.

    What the cell scored inside the notebook is kept as `kernel_score` for the record only: in the sandbox the
    test cells run nothing (the harness there is a stand-in), and a student's cell could fake it anyway.
    """
    by_cell: dict[tuple, list[HarnessCall]] = {}
    for c in calls:
        by_cell.setdefault((c.notebook, c.cell), []).append(c)
    for cell in cells:
        group = by_cell.get((cell["notebook"], cell["cell"]))
        if not group:
            continue
        vs = [verdicts[c.check] for c in group if c.check in verdicts]
        frac = min((v.fraction for v in vs), default=0.0)
        cell["kernel_score"] = cell["score"]
        cell["score"] = round(cell["max_score"] * frac, 2)
        cell["source"] = "trusted"
    unverified = [c["cell"] for c in cells if (c["notebook"], c["cell"]) not in by_cell and not c.get("manual")]
    return [f"{', '.join(unverified)}: scored inside the notebook (no harness check): a student's code could "
            "have faked it"] if unverified else []

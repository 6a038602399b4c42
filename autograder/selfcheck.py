"""The student release's checks: each lab's public checks, run on the student's own machine.

    python -m autograder.selfcheck lab1 student_scaler.py        (or one check: lab1.static_scaler)

In the student release this module is what `autograder.harness.grade(...)` runs, so a lab notebook's test cells
work there as they do in the instructor's course. It holds no reference solution, no answer key and no hidden
case: the student's file runs in a fresh process through the same public probes the grader uses
(`autograder.student.labN`) and is compared with public references only: torch's own GradScaler (lab 1), the
decoded images (lab 2), the student's own handed-out slow_train.py beside their file (lab 3), the naive step
(lab 4) and torch's F.cross_entropy (lab 5). A file that uses a labkit module its lab bans fails at once, with the grader's message
(`autograder.labkit_answers`, shipped in the release). Speed is timed here in
one process, alternating with the baseline. The course's grader checks more (other seeds and inputs, hidden
tests, speed in a sandbox): a pass here is a good sign, not a grade.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from autograder.selfcheck_core import Failed, NotHere, alternate, need  # noqa: F401 (the checks' names, here too)

TIMEOUT_S = 900  # one lab's public checks on a slow laptop CPU, seconds

# Public check -> (points, what it checks). The names are the test cells' names in the released notebooks.
PUBLIC = {
    "lab1.static_scaler": (2, "StaticScaler scales, unscales and skips non-finite steps"),
    "lab1.dynamic_scaler": (3, "DynamicScaler follows GradScaler's backoff/growth schedule"),
    "lab1.fp16_training": (3, "fp16 autocast training with your scaler follows GradScaler's and converges"),
    "lab1.host_syncs": (2, "at most one host sync per training step"),
    "lab2.packed_roundtrip": (2, "packed storage returns exactly the decoded images, each once per epoch"),
    "lab2.batched_augment": (2, "every augmented image is a padded crop (+ optional flip) of its source"),
    "lab2.bucket_sampler": (2, "length bucketing: every index once, far less padding than random batches"),
    "lab2.loader_speed": (4, "packed loader vs the PIL image-file loader, samples/s ratio"),
    "lab2.data_wait": (2, "share of a training step spent waiting for the packed loader"),
    "lab3.same_result": (2, "the fixed training computes the slow script's losses and accuracy"),
    "lab3.no_host_sync": (2, "the fixed training loop does not sync the host every step"),
    "lab3.speedup": (4, "fixed vs slow training, interleaved: ratio"),
    "lab4.correctness": (4, "first losses and updates match the naive step within AMP rounding"),
    "lab4.no_host_sync": (2, "no host sync inside the training step"),
    "lab4.speed": (6, "your ResNet-18 step vs the naive step (needs a CUDA GPU)"),
    "lab5.forward": (3, "your fused loss matches F.cross_entropy(label_smoothing=0.1), contiguous fp32"),
    "lab5.backward": (3, "your fused gradient of the logits matches autograd's, contiguous fp32"),
    "lab5.layouts": (2, "loss and gradient on strided views and fp16/bf16 logits"),
    "lab5.speed": (4, "your fused forward + backward vs the eager composition (needs a CUDA GPU)"),
}


def names_for(what: str) -> list[str]:
    """The public checks of one lab ('lab1') or the one check named; a clear error for anything else."""
    if what in PUBLIC:
        return [what]
    names = [n for n in PUBLIC if n.split(".")[0] == what]
    if not names:
        raise _error(f"{what!r} is not a public check of the student release (these are: {', '.join(PUBLIC)}); "
                     "other tests run only when the course grades your notebook")
    return names


def _error(msg: str) -> Exception:
    try:
        from labkit.errors import LabkitError
    except ImportError:
        return ValueError(msg)
    return LabkitError(msg)


# ---------------------------------------------------------------------------------- the parent side


def run_checks(names: list[str], student_file: str | os.PathLike, *, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run public checks on `student_file` in one fresh process; one verdict dict per name, in order."""
    for n in names:
        names_for(n)
    path = Path(student_file).resolve()
    if not path.is_file():
        return [_verdict(n, False, f"{path.name} not found in {path.parent}: run the %%writefile cell first")
                for n in names]
    got = _banned(names, path)
    todo = [n for n in names if n not in got]
    if todo:
        got.update(_spawn(todo, path, timeout_s))
    return [got[n] for n in names]


def _banned(names: list[str], path: Path) -> dict[str, dict]:
    """Failed verdicts, before anything runs, for the checks whose lab bans a labkit module the file uses: the
    grader's own test and message (autograder.labkit_answers)."""
    from autograder import labkit_answers

    text = path.read_bytes()  # decoded by its own coding declaration, as Python imports it
    out = {}
    for n in names:
        uses = labkit_answers.banned_uses(text, n)
        if uses:
            out[n] = _verdict(n, False, labkit_answers.message(n.split(".")[0], uses),
                              measurements={"labkit_modules": uses})
    return out


def _spawn(names: list[str], path: Path, timeout_s: float) -> dict[str, dict]:
    """Verdicts of `names` on `path` from one fresh worker process (a failed one for each it did not report)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore", MPLBACKEND="Agg")
    # The worker imports these same checks: from the installed release, or from a checkout that is not installed
    # (its folder is then not on the worker's path, since the worker runs in a scratch folder).
    home = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([home, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "autograder.selfcheck", "--worker", str(path), *names]
    # A scratch folder as the working directory: the probes write their data files (lab 2's images) there.
    with tempfile.TemporaryDirectory(prefix="selfcheck-") as cwd:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
            text, err = out.stdout, out.stderr
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {timeout_s:.0f} s"
    got = {}
    for line in text.splitlines():
        if line.startswith("SELFCHECK "):
            v = json.loads(line[len("SELFCHECK "):])
            got[v["check"]] = v
    tail = " | ".join(ln for ln in err.strip().splitlines()[-2:] if ln.strip())[-400:]
    return {n: got.get(n) or _verdict(n, False, f"the check's process ended without a verdict ({tail or 'no output'})")
            for n in names}


def _verdict(name: str, ok: bool, message: str, *, fraction: float = 1.0, gradable: bool = True,
             measurements: dict | None = None) -> dict:
    points = float(PUBLIC[name][0])
    return {"check": name, "ok": ok, "score": round(points * fraction, 4) if ok else 0.0, "max_score": points,
            "gradable": gradable, "message": message, "measurements": measurements or {}, "public": True}


def grade(check: str, student_file: str | os.PathLike, points: float) -> float | None:
    """A released test cell's call: run the public check `check` on `student_file`, print the verdict.

    Fails (AssertionError) with the check's message, returns the points earned here otherwise; None where this
    machine cannot run the check. The course's grader decides the real score, with more cases.
    """
    v = run_checks(names_for(check), student_file)[0]
    print(f"[{check}] {v['message']}")
    for k, val in v["measurements"].items():
        print(f"  {k}: {json.dumps(val, default=str)[:200]}")
    if not v["gradable"]:
        print("  (not checked on this machine: the course grades it on the hardware it needs)")
        return None
    if not v["ok"]:
        raise AssertionError(f"{check}: {v['message']}")
    print("  public check passed; the course's grader also runs other cases when it grades your notebook")
    return round(points * v["score"] / v["max_score"], 2) if v["max_score"] else 0.0


def run_check(name: str, student_file: str | os.PathLike, timeout_s: float = TIMEOUT_S) -> dict:
    """One public check's verdict (a JSON-able dict)."""
    return run_checks([name], student_file, timeout_s=timeout_s)[0]


# ---------------------------------------------------------------------------------- the worker


def _worker(student_file: str, names: list[str]) -> int:
    import warnings

    import torch

    from autograder.student.probes import Probe, StudentError
    from labkit.env import pick_device

    warnings.simplefilter("ignore")
    sys.path.insert(0, str(Path(student_file).parent))  # the student's file may import files beside it
    dev = pick_device("auto")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as the grader does: CPU timings measure the code, not the machine's load
    probe = Probe(student_file, dev, {})
    from autograder import selfcheck_labs

    for name in names:
        torch.manual_seed(0)
        fn = getattr(selfcheck_labs, name.replace(".", "_"))
        try:
            out = fn(probe, dev)
            v = _verdict(name, True, out.get("message", "passed"), fraction=out.get("fraction", 1.0),
                         measurements=out.get("measurements"))
        except NotHere as e:
            v = _verdict(name, False, f"not checked on this machine: {e}", gradable=False)
        except (Failed, StudentError) as e:
            v = _verdict(name, False, str(e))
        except Exception as e:  # the student's code returned something a probe could not read
            v = _verdict(name, False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
        print("SELFCHECK " + json.dumps(v, default=str), flush=True)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m autograder.selfcheck") -> int:
    """The command line; `prog` is the name its help shows (the release's harness passes its own)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], argv[2:])
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("check", nargs="?", help="a lab (lab1) or one public check (lab1.static_scaler)")
    ap.add_argument("student_file", nargs="?", help="the file the lab's %%writefile cell writes")
    ap.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    ap.add_argument("--list", action="store_true", help="list the public checks and exit")
    a = ap.parse_args(argv)
    if a.list or not a.check:
        for n, (pts, doc) in PUBLIC.items():  # `--list lab5`: that lab's alone
            if not a.check or n == a.check or n.startswith(a.check + "."):
                print(f"{n:<24} {pts:>2} pts  {doc}")
        return 0
    if not a.student_file or not a.student_file.endswith(".py"):
        ap.error("give the .py file the lab's %%writefile cell writes (e.g. student_scaler.py)")
    try:
        verdicts = run_checks(names_for(a.check), a.student_file)
    except Exception as e:
        if type(e).__name__ == "LabkitError" or isinstance(e, ValueError):
            print(f"autograder.selfcheck: {e}", file=sys.stderr)
            return 2
        raise
    if a.json:
        print(json.dumps(verdicts, indent=2, default=str))
    for v in verdicts if not a.json else []:
        state = "PASS" if v["ok"] else ("NOT HERE" if not v["gradable"] else "FAIL")
        print(f"{v['check']:<24} {state:<9} {v['message']}")
    return 0 if all(v["ok"] or not v["gradable"] for v in verdicts) else 1


if __name__ == "__main__":
    # Run the copy imported as autograder.selfcheck, so the lab checks and this code share one Failed class.
    sys.exit(importlib.import_module("autograder.selfcheck").main())

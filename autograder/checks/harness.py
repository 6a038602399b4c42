"""The trusted grading harness: checks that drive a sandboxed student process and keep every decision here.

A check (a function in a trusted `labN_checks` module) never imports the student's file. The student's code
runs in a process of its own, inside the sandbox (autograder.sandbox.jail: no view of the course, the checks, the
grader or other students), behind one socket (autograder.student.channel). The check sends a probe request
(`Context.call`), gets back what the student's code produced, computes the reference itself and compares.
Speed is timed by this process's clock around each request, alternating with a baseline that runs in a
process that never held student code, the idle side frozen (`Context.compare`); every timed reply is verified.
Verdicts are JSON dicts:

    {"check", "ok", "score", "max_score", "gradable", "message", "measurements", "hardware", "device", "sandbox"}

Rules every check follows: correctness gates speed (a wrong result earns no speed points); a speed-up is a
ratio against a baseline timed alternately in the same run (median of rounds, after warm-up); thresholds
depend on the hardware class ("tensor_core_gpu", "gpu", "cpu"); a check this machine cannot grade says so
(`gradable: false`, score 0) instead of passing or failing.

What it does not defend against (assignments/README.md, "Threat model"): counts that only the student's
process can observe (host syncs, matmul dtypes, data-wait share) are that process's own report.

Entry points: `run_check(name, student_file)`, `run_checks(names, student_file)`, `grade(...)` for nbgrader
test cells, and `python -m autograder.harness <check-name|labN> <student-file> [--json]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from autograder.base.spool import entry_header
from autograder.sandbox.disk_cap import DISK_BYTES

ROOT = Path(__file__).resolve().parents[2]
HARDWARE_CLASSES = ("tensor_core_gpu", "gpu", "cpu")
_STARTUP_S = 60.0  # python + torch import in the worker, on a slow, busy machine


@dataclasses.dataclass(frozen=True)
class Check:
    """One gradable check: a function in a trusted lab module, run against one student file."""

    name: str  # "labN.what", the id test cells, the CLI and the batch autograder use
    module: str  # trusted module holding the check function
    func: str  # function(student_module, ctx) -> dict(fraction, message, measurements)
    max_score: float  # points of the check in the harness's own scale (test cells rescale to their points)
    timeout_s: float  # wall-clock budget for this check alone, warm-up and torch.compile included
    doc: str  # one line shown by --list
    torch: bool = True  # the check and its probes use torch (the toy's do not: its grading never loads torch)
    baseline: bool = False  # it times a baseline runner too (started early, while the student's code loads)
    hidden: bool = False  # its inputs come from the course secret: it reports pass or fail and nothing else (`withheld`)


CHECKS: dict[str, Check] = {c.name: c for c in [
    Check("lab1.static_scaler", "autograder.checks.lab1_checks", "check_static_scaler", 2, 60,
          "StaticScaler scales, unscales and skips non-finite steps like the reference"),
    Check("lab1.dynamic_scaler", "autograder.checks.lab1_checks", "check_dynamic_scaler", 3, 60,
          "DynamicScaler follows GradScaler's backoff/growth schedule"),
    Check("lab1.fp16_training", "autograder.checks.lab1_checks", "check_fp16_training", 3, 120,
          "fp16 autocast training with the scaler converges and matches the reference losses"),
    Check("lab1.host_syncs", "autograder.checks.lab1_checks", "check_host_syncs", 2, 60,
          "at most one host sync per training step"),
    Check("lab1.scaler_edge_cases", "autograder.checks.lab1_checks", "check_scaler_edge_cases", 2, 60,
          "NaN gradients, unscale_ before step, growth counter reset", hidden=True),
    Check("lab2.packed_roundtrip", "autograder.checks.lab2_checks", "check_packed_roundtrip", 2, 90,
          "packed storage returns exactly the decoded images and labels, each once per epoch"),
    Check("lab2.batched_augment", "autograder.checks.lab2_checks", "check_batched_augment", 2, 90,
          "every augmented image is a padded crop (+ optional flip) of its source, drawn per sample"),
    Check("lab2.bucket_sampler", "autograder.checks.lab2_checks", "check_bucket_sampler", 2, 60,
          "length-bucketing sampler: every index once, less padding than random batches"),
    Check("lab2.loader_speed", "autograder.checks.lab2_checks", "check_loader_speed", 4, 180,
          "packed loader vs the image-file PIL loader: samples/s ratio, tiered", baseline=True),
    Check("lab2.data_wait", "autograder.checks.lab2_checks", "check_data_wait", 2, 180,
          "share of a training step spent waiting for the packed loader", baseline=True),
    Check("lab2.bucket_sampler_hidden", "autograder.checks.lab2_checks", "check_bucket_sampler_hidden", 2, 60,
          "sampler on other lengths, batch sizes and seeds", hidden=True),
    Check("lab3.answers", "autograder.checks.lab3_checks", "check_answers", 4, 30,
          "the planted bottlenecks (site and kind) found in slow_train.py"),
    Check("lab3.same_result", "autograder.checks.lab3_checks", "check_same_result", 2, 120,
          "the fixed training computes the slow script's losses, accuracy, steps and samples"),
    Check("lab3.no_host_sync", "autograder.checks.lab3_checks", "check_no_host_sync", 2, 120,
          "the fixed training loop does not sync the host every step"),
    Check("lab3.speedup", "autograder.checks.lab3_checks", "check_speedup", 4, 240,
          "fixed vs slow training, each in its own process, interleaved: ratio, tiered", baseline=True),
    Check("lab4.correctness", "autograder.checks.lab4_checks", "check_correctness", 4, 600,
          "first K losses and parameter updates match the naive step within AMP tolerance"),
    Check("lab4.no_host_sync", "autograder.checks.lab4_checks", "check_no_host_sync", 2, 600,
          "no host sync inside the training step"),
    Check("lab4.speed", "autograder.checks.lab4_checks", "check_speed", 6, 900,
          "ResNet-18 step vs the naive step: 3x for full marks on a tensor-core GPU (needs CUDA)", baseline=True),
    Check("lab4.correctness_hidden", "autograder.checks.lab4_checks", "check_correctness_hidden", 2, 600,
          "same as correctness, other hyper-parameters and seed", hidden=True),
    Check("lab5.forward", "autograder.checks.lab5_checks", "check_forward", 3, 300,
          "the fused kernel's loss matches F.cross_entropy(label_smoothing=0.1), contiguous fp32"),
    Check("lab5.backward", "autograder.checks.lab5_checks", "check_backward", 3, 300,
          "the fused kernel's gradient of the logits matches autograd's, contiguous fp32"),
    Check("lab5.layouts", "autograder.checks.lab5_checks", "check_layouts", 2, 300,
          "loss and gradient on strided views and fp16/bf16 logits"),
    Check("lab5.speed", "autograder.checks.lab5_checks", "check_speed", 4, 600,
          "fused forward + backward vs the eager composition, interleaved, tiered (needs CUDA)", baseline=True),
    Check("lab5.correctness_hidden", "autograder.checks.lab5_checks", "check_cases_hidden", 2, 300,
          "loss and gradient on other sizes, dtypes, layouts and smoothings", hidden=True),
    # The toy assignment the grader rehearses on (autograder.rehearsal): not part of the course.
    Check("toy.correct", "autograder.rehearsal", "check_correct", 1, 60, "toy: sum of squares on fresh inputs",
          torch=False),
    Check("toy.hidden", "autograder.rehearsal", "check_hidden", 1, 60, "toy: sum of squares on the hidden inputs",
          torch=False, hidden=True),
    Check("toy.speed", "autograder.rehearsal", "check_speed", 1, 120, "toy: 4x the Python loop, interleaved",
          torch=False, baseline=True),
]}


# Lab prefix -> nbgrader assignment id and the module file its %%writefile cell writes next to the notebook.
ASSIGNMENTS = {"lab1": "lab1_loss_scaling", "lab2": "lab2_data_pipeline", "lab3": "lab3_profile_fix",
               "lab4": "lab4_speedrun", "lab5": "lab5_fused_kernel"}
STUDENT_FILES = {"lab1": "student_scaler.py", "lab2": "student_pipeline.py", "lab3": "student_fix.py",
                 "lab4": "student_speedrun.py", "lab5": "student_fused_ce.py"}


def student_file_from_notebook(notebook: str | os.PathLike, dest_dir: str | os.PathLike) -> Path:
    """Write the module a notebook's `%%writefile` cell would write, into dest_dir; returns its path.

    Reads the .ipynb as plain JSON (no Jupyter needed), so a machine without nbgrader can grade a submitted
    notebook or the reference solution (the source notebook, whose solution regions are kept as written).
    """
    cells = json.loads(Path(notebook).read_text())["cells"]
    for c in cells:
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "code" and src.startswith("%%writefile"):
            first, _, body = src.partition("\n")
            name = first.split()[-1]
            if Path(name).name != name or not name.endswith(".py"):
                raise _error(f"{notebook}: the %%writefile cell must write a plain .py file name, got {name!r}")
            out = Path(dest_dir) / name
            out.write_text(body if body.endswith("\n") else body + "\n")
            return out
    raise _error(f"{notebook} has no %%writefile cell: is it one of the course's lab notebooks?")


def checks_for(prefix: str) -> list[str]:
    """Check names of one lab ('lab1') or the single name itself, in registry order."""
    if prefix in CHECKS:
        return [prefix]
    names = [n for n in CHECKS if n.split(".")[0] == prefix]
    if not names:
        raise _error(f"unknown check or lab {prefix!r}: known labs {sorted({n.split('.')[0] for n in CHECKS})}, "
                     f"checks: {', '.join(CHECKS)}")
    return names


def _error(msg: str) -> Exception:
    try:
        from labkit.env import LabkitError
    except ImportError:  # the harness must still report without labkit on the path
        return ValueError(msg)
    return LabkitError(msg)


# ---------------------------------------------------------------------------------- what checks use


@dataclasses.dataclass
class Tiers:
    """Speed-up thresholds for one hardware class: (minimum ratio, share of the points) pairs, ascending."""

    steps: tuple[tuple[float, float], ...]  # e.g. ((1.5, 0.5), (3.0, 1.0)): 1.5x earns half, 3x all
    bonus: float | None = None  # ratio for the bonus tier (reported as extra credit, not in the score)

    def fraction(self, ratio: float) -> float:
        """Share of the points earned by a measured speed-up `ratio` (x baseline)."""
        got = 0.0
        for need, share in self.steps:
            if ratio >= need:
                got = max(got, share)
        return got

    def describe(self) -> str:
        s = ", ".join(f">={need:g}x: {share:.0%}" for need, share in self.steps)
        return s + (f", bonus >={self.bonus:g}x" if self.bonus else "")


class CheckFailed(Exception):
    """Raised by a check: the submission is wrong (score 0); `measurements` go into the verdict."""

    def __init__(self, message: str, **measurements):
        super().__init__(message)
        self.measurements = measurements


WARMUP_EXCESS_S = "warmup_excess_s"  # Context.compare's note: warm-up seconds beyond as many timed rounds


class NotGradable(Exception):
    """Raised by a check this hardware cannot grade (e.g. a GPU speed tier on a CPU)."""

    def __init__(self, message: str, **measurements):
        super().__init__(message)
        self.measurements = measurements


def require(cond: bool, message: str, **measurements) -> None:
    """Fail the check with `message` unless `cond` holds."""
    if not cond:
        raise CheckFailed(message, **measurements)


# ---------------------------------------------------------------------------------- the trusted worker


@dataclasses.dataclass
class Context:
    """What a check knows about where it runs, and its handles on the two sandboxed processes.

    `call` runs a probe in the student's process (started on first use, inside the sandbox, restarted after a
    check killed it); `baseline_call` runs one in a process that never held student code. Both are timed by
    this process's clock; `interleave` times the two alternately with the idle one frozen.
    """

    device: object  # torch.device the check runs on
    hardware: str  # one of HARDWARE_CLASSES
    small: bool  # CPU-sized problems (tiny models and data) instead of full-size ones
    work_dir: Path  # this worker's private folder (trusted), deleted afterwards
    student_file: Path  # the submission (a copy inside the student's sandbox folder)
    sandbox: str = "none"  # "bwrap" (student code in bubblewrap) or "none" (trusted submissions)
    memory_bytes: int | None = None  # resident memory allowed to the student's processes, bytes
    disk_bytes: int | None = DISK_BYTES  # space the files in the student's folders may take, bytes (disk_cap)
    deadline: float = float("inf")  # time.monotonic() when the running check's budget ends
    cache: Path | None = None  # the student's own compile-cache folder (autograder.sandbox.jail.cache_env), if any
    student_id: str | None = None  # whose submission this is (lab 3 grades that student's variant); None: unknown
    hide: tuple[str, ...] = ()  # labkit modules the student's sandbox does not show (autograder.labkit_answers)
    handin: str | None = None  # the hand-in's digest: hidden checks draw a case set for it (hidden_draws)
    _student: object = None
    _baseline: object = None

    def _jail(self, folder: Path, trusted: bool):
        return _jail_for(folder, getattr(self.device, "type", "cpu"), self.sandbox,
                         cache=None if trusted else self.cache, baseline=trusted, hide=() if trusted else self.hide,
                         disk_bytes=self.disk_bytes)

    def student(self):
        """The student's runner process (sandboxed), started on first use (or early, by the worker)."""
        from autograder.sandbox.remote import Remote, RemoteFailed

        if self._student is None or self._student.cause or self._student.proc.poll() is not None:
            try:
                self._student = Remote(work_dir=self.student_file.parent, device=str(self.device),
                                       jail=self._jail(self.student_file.parent, False), student_file=self.student_file,
                                       memory_bytes=self.memory_bytes, startup_s=min(_STARTUP_S, self._left()))
            except RemoteFailed as e:
                raise CheckFailed(f"the submission's process could not start: {e}", cause=e.cause) from None
        return self._student

    def baseline(self):
        """A runner process that never held student code: the baseline's and references' side of timings."""
        from autograder.sandbox.remote import Remote

        if self._baseline is None or self._baseline.cause or self._baseline.proc.poll() is not None:
            folder = self.work_dir / "baseline"
            folder.mkdir(exist_ok=True)
            self._baseline = Remote(work_dir=folder, device=str(self.device), jail=self._jail(folder, True),
                                    startup_s=_STARTUP_S)
        return self._baseline

    def _left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def call(self, probe: str, params: dict | None = None, *, timeout_s: float | None = None):
        """Run `probe` on the student's code; the result, or CheckFailed with the student's own error."""
        from autograder.sandbox.remote import RemoteFailed, StudentFailed

        remote = self.student()
        try:
            result, _ = remote.call(probe, params, timeout_s=min(timeout_s or self._left(), self._left()))
        except StudentFailed as e:
            raise CheckFailed(str(e)) from None
        except RemoteFailed as e:
            raise CheckFailed(f"{e}{_tail_of(remote)}", cause=e.cause) from None
        return result

    def baseline_call(self, probe: str, params: dict | None = None, *, timeout_s: float | None = None):
        from autograder.sandbox.remote import StudentFailed

        try:
            result, _ = self.baseline().call(probe, params, timeout_s=min(timeout_s or self._left(), self._left()))
        except StudentFailed as e:  # the baseline holds no student code: its failure is the grader's
            raise RuntimeError(f"the baseline failed: {e}") from None
        return result

    def interleave(self, base_req, student_req, *, rounds: int, warmup: int = 1, check_base=None, check_student=None,
                   warm: list | None = None):
        """Time baseline and student requests alternately (the idle side frozen): (baseline s, student s) lists;
        the warm-up requests' seconds go into `warm` when given."""
        from autograder.sandbox.remote import RemoteFailed, StudentFailed, interleaved

        student = self.student()
        try:
            return interleaved(self.baseline(), base_req, student, student_req, rounds=rounds, warmup=warmup,
                               timeout_s=self._left(), check_a=check_base, check_b=check_student, warm=warm)
        except StudentFailed as e:
            raise CheckFailed(str(e)) from None
        except RemoteFailed as e:
            raise CheckFailed(f"{e}{_tail_of(student)}", cause=e.cause) from None

    def compare(self, base_req, student_req, *, rounds: int, warmup: int = 1, inner: int = 1, check_base=None,
                check_student=None):
        """Interleaved A/B timing (A: baseline, B: student), per-iteration seconds; returns (ABResult, notes).

        Each request runs `inner` iterations inside its runner. Baseline runs that directly follow a student
        run are compared with those that follow a baseline run: work the student's process left queued (a GPU
        kernel still running after its reply) slows only the former, so those are then dropped from the ratio
        and the slowdown is reported. The GPU's state before and after the rounds goes into the notes
        (autograder.sandbox.gpu_state): a verdict timed on a throttling card is marked to be measured again.
        """
        from autograder.sandbox.gpu_state import Watch
        from labkit.bench import ABResult, Timing

        watch = Watch(self.device)  # the card's clocks, temperature, power, throttling: read here, never by them
        warm: list[float] = []
        ta, tb = self.interleave(base_req, student_req, rounds=rounds, warmup=warmup, check_base=check_base,
                                 check_student=check_student, warm=warm)
        notes = watch.measurements()
        # seconds the warm-up took beyond as many timed rounds: a student can stretch it at no cost to the ratio,
        # so autograder.checks.remeasure does not price a re-measurement by it
        notes[WARMUP_EXCESS_S] = max(0.0, sum(warm) - warmup * (sum(ta) + sum(tb)) / max(len(ta), 1))
        ta, tb = [t / inner for t in ta], [t / inner for t in tb]
        after_student = [t for i, t in enumerate(ta) if (warmup + i) % 2 == 1]
        after_base = [t for i, t in enumerate(ta) if (warmup + i) % 2 == 0]
        if after_student and after_base:
            slow = statistics.median(after_student) / statistics.median(after_base)
            notes["baseline_after_student_slowdown"] = round(slow, 3)
            if slow > 1.25:
                notes["baseline_interference"] = True
                clean = statistics.median(after_base)
                return ABResult(Timing(after_base), Timing(tb), [clean / t for t in tb]), notes
        return ABResult(Timing(ta), Timing(tb), [a / b for a, b in zip(ta, tb, strict=True)]), notes

    def close(self) -> None:
        for r in (self._student, self._baseline):
            if r is not None:
                r.close()
        self._student = self._baseline = None


def _tail_of(remote) -> str:
    lines = [ln for ln in remote.tail().strip().splitlines() if ln.strip()]
    return f" (its last output: {lines[-1][:200]})" if lines else ""


def hardware_class(device) -> str:
    """'tensor_core_gpu' (CUDA, compute capability >= 7.0), 'gpu' (other accelerators) or 'cpu'."""
    import torch

    from labkit.env import gpu_facts

    facts = gpu_facts(device)  # the card's facts, read here in the trusted process, never the student's
    if facts is not None:
        return "tensor_core_gpu" if facts.capability[0] >= 7 else "gpu"
    return "cpu" if torch.device(device).type == "cpu" else "gpu"


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def _verdict(check: Check, *, ok: bool, fraction: float, gradable: bool, message: str, measurements: dict,
             ctx: Context | None) -> dict:
    fraction = min(max(float(fraction), 0.0), 1.0)
    return {
        "check": check.name,
        "ok": bool(ok),
        "score": round(check.max_score * fraction, 4) if ok else 0.0,
        "max_score": float(check.max_score),
        "gradable": bool(gradable),
        "message": message,
        "measurements": measurements,
        "hardware": ctx.hardware if ctx else None,
        "device": str(ctx.device) if ctx else None,
    }


_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError)


def hidden_draws(ctx: Context) -> list[dict]:
    """The keys a hidden check draws its cases for, each case set to be passed: the student's own (the same for
    every hand-in of theirs; the course's where the student is not known) and this hand-in's (new with any change).

    Cases drawn for the hand-in alone let a student re-roll them: a scaler that never reset its growth counter
    passed 118 draws in 2,000, and a blank line changed the draw. Cases for the student alone stay put across
    their hand-ins, so what one hand-in spells out of them (by its run time, say) a later one could hard-code.
    Both together: a re-roll cannot pass the student's set, and a hard-coded answer cannot pass the hand-in's.
    """
    draws = [{"student": ctx.student_id}]
    return draws + ([{"handin": ctx.handin}] if ctx.handin else [])


# What a failed hidden check says: that it failed, and nothing of why. The student's error messages and the check's
# own are built from the hidden inputs (a sampler that raised with its lengths and batch size in the text got them
# back in its feedback), and so is any choice among answers: which case failed, which error type, how long it took
# (a hand-in can pick its error by the inputs, or sleep for them). The inputs are the same for the whole course, so
# each bit a hand-in takes home is one for its classmates too. The instructor sees why by running the check
# (`python -m autograder.harness`) on the hand-in.
WITHHELD = ("failed on the hidden inputs: what went wrong is withheld, since it could show them; test your code on "
            "other sizes, seeds and settings than the public checks use")


def _run_in_worker(check: Check, ctx: Context) -> dict:
    verdict = _run_check(check, ctx)
    if check.hidden and verdict["gradable"]:  # pass or fail, and nothing the inputs shaped
        # No cause either: timeout, memory and disk are choices a hand-in can make, and so is a "grader error" (a
        # tensor of the wrong shape made the trusted comparison raise, on the inputs the hand-in picked).
        message = verdict["message"] if verdict["ok"] else WITHHELD
        verdict = {**verdict, "message": message, "measurements": {}}
    return verdict


def _run_check(check: Check, ctx: Context) -> dict:
    if check.torch:
        import torch

        torch.manual_seed(0)
    ctx.deadline = time.monotonic() + check.timeout_s
    try:
        fn = getattr(importlib.import_module(check.module), check.func)
        out = fn(ctx)
        return _verdict(check, ok=out.get("fraction", 1.0) > 0, fraction=out.get("fraction", 1.0), gradable=True,
                        message=out.get("message", "passed"), measurements=out.get("measurements", {}), ctx=ctx)
    except NotGradable as e:
        return _verdict(check, ok=False, fraction=0, gradable=False,
                        message=f"not gradable on this hardware ({ctx.hardware}): {e}",
                        measurements=e.measurements, ctx=ctx)
    except CheckFailed as e:
        return _verdict(check, ok=False, fraction=0, gradable=True, message=str(e), measurements=e.measurements,
                        ctx=ctx)
    except _MALFORMED as e:  # what the student's process sent is not what the probe sends
        return _verdict(check, ok=False, fraction=0, gradable=True,
                        message=f"the submission's process sent a malformed answer ({type(e).__name__}: "
                                f"{_one_line(e)[:120]})", measurements={"traceback": traceback.format_exc(limit=-3)},
                        ctx=ctx)
    except Exception as e:  # a failure of the grader's own side is still reported, never a crash of the suite
        return _verdict(check, ok=False, fraction=0, gradable=True,
                        message=f"the check failed with {type(e).__name__}: {_one_line(e)}",
                        measurements={"traceback": traceback.format_exc(limit=-4), "cause": "grader error"}, ctx=ctx)


_MAX_COPIED = 64 << 20  # bytes of one file beside the submission copied into its sandbox folder


def _box_files(student_file: Path) -> list[Path]:
    """What the student's sandbox gets a copy of: the plain files beside the submission (100 at most), then it."""
    near = [p for p in sorted(student_file.parent.iterdir()) if p.is_file() and not p.is_symlink()
            and p.stat().st_size <= _MAX_COPIED and p != student_file][:100]
    return [*near, student_file]


def _student_box(student_file: Path, work: Path) -> Path:
    """A folder for the student's sandbox: a copy of the submission and the plain files beside it."""
    box = work / "student"
    box.mkdir()
    for p in _box_files(student_file):
        shutil.copyfile(p, box / p.name)
    return box / student_file.name


def _box_digest(student_file: Path) -> str:
    """sha256 over every file the student's sandbox gets, names and lengths included: a file beside the
    submission is the hand-in too (one read at run time set a hidden check's answer while the submission's own
    digest, and so its hidden cases, stayed the same)."""
    h = hashlib.sha256()
    for p in _box_files(student_file):
        data = p.read_bytes()
        h.update(entry_header(p.name, len(data)) + data)
    return h.hexdigest()


def _jail_for(folder: Path, device_type: str, sandbox: str, *, cache: Path | None, baseline: bool,
              hide: tuple[str, ...] = (), disk_bytes: int | None = DISK_BYTES):
    """The sandbox of one runner: the student's (with their compile cache, without the labkit modules that answer
    their lab) or the baseline's (nothing of theirs; trusted code, sandboxed unless the whole run is unsandboxed)."""
    from autograder.sandbox.jail import Jail, visible_gpu

    gpu = visible_gpu() if device_type != "cpu" else None
    return Jail(writable=[folder], gpu=gpu, trusted=baseline or sandbox == "none", cache=cache, hide=hide,
                disk_bytes=disk_bytes)


def _early_runners(path: Path, device: str, sandbox: str, memory_gb: float | None, cache: Path | None,
                   baseline: bool, hide: tuple[str, ...] = (), disk_bytes: int | None = DISK_BYTES) -> tuple:
    """The student's runner, and the baseline's if a check needs one, started before this process imports torch
    so that the three processes load at once (None where one cannot start here: Context retries and reports)."""
    from autograder.sandbox.remote import Remote

    student = base = None
    with contextlib.suppress(Exception):
        student = Remote(work_dir=path.parent, device=device, student_file=path,
                         jail=_jail_for(path.parent, device, sandbox, cache=cache, baseline=False, hide=hide,
                                        disk_bytes=disk_bytes),
                         memory_bytes=int(memory_gb * 2**30) if memory_gb else None, startup_s=_STARTUP_S)
    if baseline:
        folder = Path.cwd() / "baseline"
        folder.mkdir(exist_ok=True)
        with contextlib.suppress(Exception):
            base = Remote(work_dir=folder, device=device, jail=_jail_for(folder, device, sandbox, cache=None,
                                                                         baseline=True), startup_s=_STARTUP_S)
    return student, base


def _worker(student_file: str, names: list[str], device: str, sandbox: str, memory_gb: float | None,
            cache: str | None = None, student: str | None = None, disk_gb: float | None = None,
            handin: str | None = None) -> int:
    nonce = sys.stdin.readline().strip()  # the parent's marker for verdict lines; no student code runs here
    sys.dont_write_bytecode = True
    os.environ.setdefault("TQDM_DISABLE", "1")
    if sandbox == "auto":
        from autograder.sandbox.jail import probe

        sandbox = "bwrap" if probe() is None else "none"
    from autograder import labkit_answers

    hide = tuple(sorted({m for n in names for m in labkit_answers.sandbox_hides(n)}))
    path = _student_box(Path(student_file), Path.cwd())
    cache_dir = Path(cache) if cache else None
    disk = int(disk_gb * 2**30) if disk_gb else DISK_BYTES
    early = _early_runners(path, device, sandbox, memory_gb, cache_dir, any(CHECKS[n].baseline for n in names),
                           hide, disk)
    memory = int(memory_gb * 2**30) if memory_gb else None
    if any(CHECKS[n].torch for n in names):
        import torch

        from labkit.env import pick_device

        dev = pick_device(device)
        ctx = Context(device=dev, hardware=hardware_class(dev), small=dev.type != "cuda", work_dir=Path.cwd(),
                      student_file=path, sandbox=sandbox, memory_bytes=memory, cache=cache_dir, student_id=student,
                      hide=hide, disk_bytes=disk, handin=handin)
        torch.backends.cudnn.benchmark = False
        if dev.type == "cpu":
            torch.set_num_threads(1)  # as the runners do: CPU timings measure the code, not the machine's load
    else:
        ctx = Context(device="cpu", hardware="cpu", small=True, work_dir=Path.cwd(), student_file=path,
                      sandbox=sandbox, memory_bytes=memory, cache=cache_dir, student_id=student, hide=hide,
                      disk_bytes=disk, handin=handin)
    ctx._student, ctx._baseline = early
    secret = _secret_label()
    try:
        for name in names:
            print(f"{nonce} start {name}", flush=True)
            t0 = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                v = _run_in_worker(CHECKS[name], ctx)
            v["sandbox"], v["secret"] = sandbox, secret
            if not CHECKS[name].hidden:  # a hidden check's time could spell out its inputs (a hand-in sleeps them)
                v["seconds"] = round(time.monotonic() - t0, 2)  # this check's wall time, runners' startup excluded
            print(f"{nonce} verdict {json.dumps(v, default=str)}", flush=True)
    finally:
        ctx.close()
    return 0


def _secret_label() -> str:
    """Which key the hidden values came from, for the verdict ("course secret" or the public open-kit default)."""
    from autograder.base import course_secret

    try:
        return course_secret.load().label
    except Exception as e:  # the checks that need it fail with this message
        return f"none ({_one_line(e)[:80]})"


# ---------------------------------------------------------------------------------- the parent side


def _failed(name: str, message: str, **measurements) -> dict:
    c = CHECKS[name]
    return {"check": name, "ok": False, "score": 0.0, "max_score": float(c.max_score), "gradable": True,
            "message": message, "measurements": measurements, "hardware": None, "device": None}


def run_checks(names: list[str], student_file: str | os.PathLike, *, timeout_s: float | None = None,
               device: str = "auto", sandbox: str = "auto", memory_gb: float | None = None,
               cache: str | os.PathLike | None = None, student: str | None = None,
               disk_gb: float | None = None, handin: str | None = None) -> list[dict]:
    """Run several checks on one student file from one fresh trusted process; one verdict per name, in order.

    The student's code runs in a sandboxed process of its own (`sandbox`: "bwrap" requires bubblewrap, "none"
    trusts the submission, "auto" sandboxes where bubblewrap works), `memory_gb` caps its resident memory and
    `disk_gb` what it may write to its folders (autograder.sandbox.disk_cap; None: the default, 8 GiB).
    `cache` is this student's own compile-cache folder (shared with their notebook's run; never another
    student's, never the baseline's).
    `timeout_s` bounds the whole run (default: the sum of the checks' budgets). If the process runs out of
    time, the check that was running fails with a timeout and the checks after it run again in a new process,
    so every check runs at most once. `student` is the submission's student id (lab 3 grades that student's
    variant of slow_train.py). A submission that uses a labkit module implementing its lab's answer fails every
    check of that lab before any runs (autograder.labkit_answers).
    `handin` is the digest of everything the student handed in (the grader's intake digest); the hidden checks
    draw their cases for it (default: the digest of the student file and every file copied beside it into the
    sandbox). The hidden checks run after the others, so no check that reports what went wrong runs in a student
    process that has seen hidden inputs.
    """
    for n in names:
        if n not in CHECKS:
            raise _error(f"unknown check {n!r}: known checks are {', '.join(CHECKS)}")
    path = Path(student_file).resolve()
    if not path.is_file():
        return [_failed(n, f"{path.name} not found in {path.parent}: run the %%writefile cell that creates it")
                for n in names]
    results = _banned_uses(names, path)
    handin = handin or _box_digest(path)
    remaining = sorted((n for n in names if n not in results), key=lambda n: CHECKS[n].hidden)
    while remaining:
        budget = timeout_s if timeout_s is not None else _STARTUP_S + sum(CHECKS[n].timeout_s for n in remaining)
        started, got, err = _spawn(remaining, path, budget, device, sandbox, memory_gb, cache, student, disk_gb,
                                   handin)
        results.update(got)
        if err is None:
            for n in remaining:
                results.setdefault(n, _failed(n, "the grading process ended without a verdict"))
            break
        culprit = next((n for n in reversed(started) if n not in got), None)
        for n in remaining:
            if n not in got and (n == culprit or culprit is None or timeout_s is not None):
                # a hidden check that took its process down says no more than one that failed (see WITHHELD)
                results[n] = _failed(n, WITHHELD) if CHECKS[n].hidden else _failed(n, err)
        remaining = [n for n in remaining if n not in results]
    return [results[n] for n in names]


def run_check(name: str, student_file: str | os.PathLike, timeout_s: float | None = None,
              device: str = "auto", sandbox: str = "auto", student: str | None = None) -> dict:
    """Run one check on a student file in a fresh process and return its verdict (a JSON-able dict)."""
    return run_checks([name], student_file, timeout_s=timeout_s, device=device, sandbox=sandbox, student=student)[0]


def _banned_uses(names: list[str], path: Path) -> dict[str, dict]:
    """Failed verdicts for the checks whose lab's answer the submission imports from labkit (read, not run)."""
    from autograder import labkit_answers

    text = path.read_bytes()  # decoded as Python would import it, by its own coding declaration
    out = {}
    for n in names:
        uses = labkit_answers.banned_uses(text, n)
        if uses:
            out[n] = _failed(n, labkit_answers.message(n.split(".")[0], uses), labkit_modules=uses,
                             cause="labkit answer")
    return out


def _spawn(names, path: Path, budget: float, device: str, sandbox: str = "auto", memory_gb: float | None = None,
           cache: str | os.PathLike | None = None, student: str | None = None, disk_gb: float | None = None,
           handin: str | None = None):
    """Run the worker; returns (names started, verdicts by name, error text or None if it finished)."""
    nonce = secrets.token_hex(16)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore", MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "autograder.checks.harness", "--worker", "--device", device, "--sandbox", sandbox,
           *(["--memory-gb", str(memory_gb)] if memory_gb else []),
           *(["--disk-gb", str(disk_gb)] if disk_gb else []),
           *(["--cache", str(Path(cache).resolve())] if cache else []),
           *(["--student", student] if student is not None else []),
           *(["--handin", handin] if handin is not None else []), str(path), *names]
    err = None
    with tempfile.TemporaryDirectory(prefix="grade-") as cwd:
        # A session of its own: on a timeout the whole group goes, DataLoader workers and other children included
        # (a surviving child would hold the pipes open and hang the grader).
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=cwd, start_new_session=hasattr(os, "killpg"))
        try:
            out, errtext = p.communicate(nonce + "\n", timeout=budget)
            if p.returncode != 0:
                err = f"the grading process exited with status {p.returncode}: {_tail(errtext)}"
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, _ = p.communicate()
            err = f"timed out after {budget:.0f} s (an endless loop, or far too slow)"
        finally:
            _kill_group(p)
    started, got = [], {}
    for line in out.splitlines():
        if not line.startswith(nonce + " "):
            continue
        kind, _, rest = line[len(nonce) + 1:].partition(" ")
        if kind == "start":
            started.append(rest.strip())
        elif kind == "verdict":
            v = json.loads(rest)
            got[v["check"]] = v
    if err is None and len(got) < len(names):
        err = "the grading process stopped early (did the submission call exit()?)"
    return started, got, err


def _kill_group(p: subprocess.Popen) -> None:
    """Kill the worker and everything it started (its own process group); the worker alone elsewhere."""
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if hasattr(os, "killpg"):
            os.killpg(p.pid, signal.SIGKILL)
        elif p.poll() is None:
            p.kill()


def _tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:] if lines else "(no error output)"


# ---------------------------------------------------------------------------------- nbgrader test cells

_SUITE_CACHE: dict[tuple, dict] = {}


class NotGradableHere(AssertionError):
    """Raised in an autograded test cell whose check this machine cannot grade: the cell scores 0 here."""


def grade(check: str, student_file: str, points: float) -> float | None:
    """Run `check` on `student_file` for an nbgrader test cell worth `points`; the return value is the score.

    Failing check: raises AssertionError with the harness's message (nbgrader gives 0). Passing: returns the
    points earned (nbgrader reads a number below `points` as partial credit). Not gradable on this hardware:
    under `nbgrader autograde` it raises NotGradableHere (0 points: grade this lab on the hardware it needs);
    during `nbgrader validate` or an interactive run it prints the notice and returns None, because nothing
    is wrong with the notebook. Under nbgrader the first call runs all of the lab's checks in one process
    (one torch start-up) and later cells reuse those verdicts while the file is unchanged.
    """
    mode = os.environ.get("NBGRADER_EXECUTION", "")
    path = Path(student_file).resolve()
    if mode == "autograde":  # a graded run: its hidden cases come from the course secret, or it stops here
        from autograder.base import course_secret

        course_secret.load(graded=True)
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode and path.is_file():
            key = (check.split(".")[0], path, hashlib.sha256(path.read_bytes()).hexdigest())
            if (key, check) not in _SUITE_CACHE:
                names = checks_for(key[0])
                sid = _autograded_student(path) if mode == "autograde" else None
                for v in run_checks(names, path, **({"student": sid} if sid else {})):
                    _SUITE_CACHE[(key, v["check"])] = v
            v = _SUITE_CACHE[(key, check)]
        else:
            v = run_check(check, path)
    frac = v["score"] / v["max_score"] if v["max_score"] else 0.0
    print(f"[{check}] {v['message']}")
    for k, val in v.get("measurements", {}).items():
        if k != "traceback":
            print(f"  {k}: {_short(val)}")
    if not v["gradable"]:
        if mode == "autograde":
            raise NotGradableHere(f"{check}: {v['message']}. This cell scores 0 on this machine; "
                                  "the instructor grades it on the hardware it needs.")
        print("  (not graded here: this cell is graded on the hardware it needs)")
        return None
    if not v["ok"]:
        raise AssertionError(f"{check}: {v['message']}")
    earned = round(points * frac, 2)
    if earned < points:
        print(f"  partial credit: {earned} of {points} points")
    return earned


def _autograded_student(path: Path) -> str | None:
    """The student id under `nbgrader autograde`, from its folder layout autograded/<student>/<assignment>/."""
    return path.parent.parent.name if path.parent.parent.parent.name == "autograded" else None


def _short(val) -> str:
    s = json.dumps(val, default=str) if not isinstance(val, str) else val
    return s if len(s) <= 200 else s[:197] + "..."


# ---------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        ap = argparse.ArgumentParser(prog="autograder.harness --worker")
        ap.add_argument("--device", default="auto")
        ap.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto")
        ap.add_argument("--memory-gb", type=float, default=None)
        ap.add_argument("--disk-gb", type=float, default=None)
        ap.add_argument("--cache", default=None)
        ap.add_argument("--student", default=None)
        ap.add_argument("--handin", default=None)
        ap.add_argument("student_file")
        ap.add_argument("names", nargs="+")
        a = ap.parse_args(argv[1:])
        return _worker(a.student_file, a.names, a.device, a.sandbox, a.memory_gb, a.cache, a.student, a.disk_gb,
                       a.handin)
    ap = argparse.ArgumentParser(prog="python -m autograder.harness",
                                 description="Run a trusted check on a student's file in a fresh process.")
    ap.add_argument("check", nargs="?", help="check name (e.g. lab2.loader_speed) or a lab id prefix (e.g. lab2)")
    ap.add_argument("student_file", nargs="?", help="the student's Python file written by the %%writefile cell")
    ap.add_argument("--json", action="store_true", help="print the verdict as JSON (a list for a lab prefix)")
    ap.add_argument("--device", default="auto", help="device to grade on: auto, cpu, cuda, cuda:N")
    ap.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds for the whole run")
    ap.add_argument("--student", default=None, help="the submission's student id (lab 3 grades that student's "
                    "variant of slow_train.py; default: the course's common one)")
    ap.add_argument("--handin", default=None, help="the hand-in's digest from the grader's results (half of its "
                    "hidden cases are drawn for it; default: the digest of the student file and the files beside it)")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    a = ap.parse_args(argv)
    if a.list or not a.check:
        for c in CHECKS.values():  # `--list lab5`: that lab's alone
            if not a.check or c.name == a.check or c.name.startswith(a.check + "."):
                print(f"{c.name:<28} {c.max_score:>4g} pts  {c.doc}")
        return 0
    if not a.student_file:
        ap.error("give the student's file after the check name")
    if not a.student_file.endswith(".py"):
        print(f"autograder.harness: {a.student_file} is not a .py file: give the module the lab's %%writefile "
              "cell writes (e.g. student_scaler.py)", file=sys.stderr)
        return 2
    try:
        names = checks_for(a.check)
        verdicts = run_checks(names, a.student_file, timeout_s=a.timeout, device=a.device, student=a.student,
                              handin=a.handin)
    except Exception as e:
        if type(e).__name__ == "LabkitError":
            print(f"autograder.harness: {e}", file=sys.stderr)
            return 2
        raise
    if a.json:
        print(json.dumps(verdicts[0] if a.check in CHECKS else verdicts, indent=2, default=str))
    else:
        for v in verdicts:
            state = "PASS" if v["ok"] else ("NOT GRADABLE" if not v["gradable"] else "FAIL")
            print(f"{v['check']:<28} {state:<13} {v['score']:g}/{v['max_score']:g}  {v['message']}")
    return 0 if all(v["ok"] for v in verdicts) else 1


if __name__ == "__main__":
    # Run the copy imported as autograder.checks.harness, so the lab modules and this code share one CheckFailed
    # class.
    sys.exit(importlib.import_module("autograder.checks.harness").main())

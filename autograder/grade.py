"""Grade a whole class with nbgrader, unattended: one isolated scratch course per student, then merge.

For each student the grader lays out a private copy of the course (config, gradebook, the assignment's data
files; never the source notebook with its solutions), runs `nbgrader autograde` there as one untrusted
process group under a wall-clock and memory budget, re-runs the test cells' harness checks outside the
kernel (their verdicts set the score), renders nbgrader's HTML feedback with the measured numbers on top, and
records the grade in a done-marker (`students/<id>/result.json`, written atomically). Finished students are
skipped on the next run unless their hand-in or the assignment changed, so an interrupted run resumes where it
stopped. At the end the marks are merged into one gradebook, `grades.csv` and a summary.

Isolation: the generated assignment is held in memory and the hand-ins are spooled where no sandbox sees them
and checked by sha256 when read (autograder.base.spool), every file the grader writes for a student is checked (and
restored) after the others ran, and each student's processes are all dead before the
next student starts. Students graded side by side (--jobs > 1, one per GPU) run as the same user at the same
time; against a deliberately hostile class, grade one at a time or inside a container. Run the grader as an
ordinary user, not root: root can list the scratch folder, and with it the files sealed away from the kernel.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

from autograder import course as courses
from autograder import labkit_answers
from autograder.base import course_secret, faults, shown
from autograder.base.nbstart import nbgrader_command
from autograder.checks import gpu_policy, trusted
from autograder.course import Course
from autograder.gradebook import classbook, feedback, manual, report, summary
from autograder.gradebook.feedback import RENDER_TIMEOUT_S
from autograder.gradebook.results import StudentResult, load_result, result_key, sealed_result
from autograder.intake import lmsnames, shard
from autograder.intake import submissions as intake
from autograder.intake.late import LatePolicy
from autograder.sandbox import jail
from autograder.sandbox.disk_cap import DISK_BYTES, remove_tree
from autograder.sandbox.jail import Jail
from autograder.sandbox.limits import (
    MAX_JSON_VALUES,
    MAX_LEFT_BYTES,
    LeftFileError,
    Limits,
    Outcome,
    kill_token,
    load_left_json,
    run_limited,
    write_log,
)
from labkit.bench import write_json
from labkit.env import LabkitError

log = logging.getLogger("autograder")
HANDIN_RECORD = "handin.json"  # labkit.handin.RECORD: what the hand-in cell says the hand-in was made from
_TMP_PREFIX = "labkit-grade-"
MAX_KEPT_BYTES = 16 * 2**20  # one file kept under autograded/ (the output folder holds them in memory), bytes
# The trusted checks' run holds the grader's worker and the baseline's runner beside the student's runner, which the
# harness caps at memory_gb itself. Under one cap of memory_gb for all three, a runner near its own cap took the
# whole run down, and every check of the file failed alike, the verdicts already reached lost with them.
HARNESS_EXTRA_BYTES = 4 * 2**30


@dataclass
class GradeConfig:
    """How a class is graded."""

    course: str = "assignments"  # nbgrader course root: holds nbgrader_config.py and source/<assignment>/
    out: str | None = None  # grades.csv, feedback/, gradebook.db and the run log; default grading/<assignment>
    work: str | None = None  # scratch courses; default a temporary folder, removed afterwards
    cell_timeout_s: int | None = None  # per-cell limit; None: the course's c.Execute.timeout, else 600 (not 30)
    wall_timeout_s: float = 3600.0  # one student's whole autograde, seconds; its process group is killed past it
    memory_gb: float = 16.0  # resident memory of one student's processes together, GiB
    disk_gb: float = DISK_BYTES / 2**30  # space the files one student's processes leave in their folders may take, GiB
    address_space_limit: bool = False  # also RLIMIT_AS per process, CPU only (torch alone reserves ~3.5 GiB)
    jobs: int | None = None  # students graded at once; None: one per GPU, one without a GPU
    trusted_recheck: bool = True  # re-run the test cells' harness checks outside the kernel; they set the score
    harness_module: str = "autograder.harness"  # module providing run_checks(names, file) or run_check(name, file)
    harness_timeout_s: float = 3600.0  # all trusted checks of one student together, seconds
    feedback: bool = True  # write per-student HTML feedback
    feedback_timeout_s: float = RENDER_TIMEOUT_S  # rendering one student's page, seconds; then the summary alone
    hide_hidden_tests: bool = True  # strip hidden-test source (and its tracebacks) from the feedback
    force: bool = False  # regrade students that already have a result
    only: tuple[str, ...] = ()  # grade only these student ids (others keep their results)
    keep_work: bool = False  # keep each student's scratch course (for debugging a submission)
    lms_regex: str = intake.LMS_REGEX  # student id (and file name) from an LMS download's file names
    roster: str | None = None  # class list (CSV with student_id, or a Canvas export): each hand-in to one listed id
    progress: bool = True  # tqdm bar over students
    trusted_submissions: bool = False  # run students' code without the sandbox (only where bubblewrap is missing)
    shard: str | None = None  # "K/N": grade only slice K of N of the class (autograder.intake.shard); None: everyone
    allow_ungradable: bool = False  # grade a lab whose checks need hardware this machine lacks (they score 0)
    late: LatePolicy | None = None  # due date, grace and penalties applied to the total (autograder.intake.late)
    open_kit: bool = False  # grade without a course secret, on the public open-kit default (rehearsals only)
    manual_scores: str | None = None  # CSV student_id,cell,score: instructor's grades of written answers


PRESETS = {
    # A GPU box grading the speed lab: generous limits, one student per GPU.
    "class": GradeConfig(),
    # Small CPU assignments and CI: short limits so a stuck submission costs minutes, not an hour.
    "quick": GradeConfig(cell_timeout_s=60, wall_timeout_s=300.0, memory_gb=6.0, harness_timeout_s=300.0),
}


@dataclass
class ClassReport:
    """What a grading run produced."""

    results: list[StudentResult]
    out: Path
    junk: list[str]  # skipped input, one line each
    graded_now: int  # students graded in this run (the rest were already done)
    wall_s: float  # seconds this run took
    hardware: list[dict]
    restored: list[str] = field(default_factory=list)  # output files rewritten after something changed them


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Outputs:
    """Writes per-student files under the output folder and remembers them, so that a later submission that
    rewrites them is noticed and undone."""

    def __init__(self, out: Path):
        self.out = out
        self.kept: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def write(self, rel: str, data: bytes) -> str:
        p = self.out / rel
        with self.lock:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
            self.kept[rel] = data
        return _sha(data)

    def adopt(self, rel: str, digest: str | None = None) -> bool:
        """Guard a file an earlier run wrote; False if it is missing or no longer matches `digest`."""
        try:
            data = (self.out / rel).read_bytes()
        except OSError:
            return False
        # A feedback page carries the late box classbook.finish adds after grading: the digest is of the page without it.
        if digest is not None and _sha(data) != digest and _sha(report.without_late_box(data)) != digest:
            return False
        with self.lock:
            self.kept[rel] = data
        return True

    def restore_changed(self, only: list[str] | None = None) -> list[str]:
        """Rewrite every remembered file whose content changed; returns their relative paths."""
        changed = []
        with self.lock:
            items = [(k, self.kept[k]) for k in (only if only is not None else list(self.kept)) if k in self.kept]
        for rel, data in items:
            with self.lock:
                try:
                    same = (self.out / rel).read_bytes() == data
                except OSError:
                    same = False
            if not same:
                self.write(rel, data)
                changed.append(rel)
        return changed


# ------------------------------------------------------------------------------------------------ one student


def _kernel_cause(outcome: Outcome) -> str | None:
    """What nbgrader's log says went wrong with the kernel, if anything."""
    text = outcome.output
    if "Kernel died before replying to kernel_info" in text:  # before any of the student's code ran
        return "kernel did not start"
    if "DeadKernelError" in text or "Kernel died" in text or "kernel died" in text:
        return "kernel died"
    if ("UnresponsiveKernelError" in text or "Kernel didn't respond" in text
            or ("Interrupting kernel" in text and "Timeout waiting for IOPub" in text)):
        return "kernel unresponsive"
    return None


def _notebook_notes(paths: list[Path], cell_timeout_s) -> list[str]:
    """Errors the graded notebooks show that a student should hear about (interrupted cells, memory).

    Read as bounded JSON (`load_left_json`), not through nbformat, whose validation of a rewritten notebook takes
    gigabytes: these are the student's bytes, copied by `take_graded`."""
    notes = []
    for p in paths:
        try:
            cells = list(load_left_json(p.read_bytes(), p.name).get("cells", []))
            for i, cell in enumerate(cells):
                for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
                    if o.get("output_type") != "error":
                        continue
                    ename = str(o.get("ename", ""))[:100]
                    if ename == "CellTimeoutError":
                        notes.append(f"cell {i} hit the per-cell time limit ({cell_timeout_s or 'course'} s) and "
                                     "was interrupted")
                    elif ename == "MemoryError" or "can't allocate memory" in str(o.get("evalue", "")):
                        notes.append(f"cell {i} ran out of memory ({ename})")
        except (LeftFileError, OSError, AttributeError, TypeError):  # unreadable output: nothing more to report
            continue
    return notes[:10]


def _not_graded(sub: intake.Submission, course: Course, cause: str, message: str, hardware: dict) -> StudentResult:
    return StudentResult(sub.student_id, course.assignment, "not graded", 0.0, course.max_score, cause, message,
                         cells=[dict(c, score=0.0, source="none") for c in course.cells], notes=list(sub.notes),
                         flags=list(sub.flags),
                         hardware=hardware, digest=sub.digest, source_digest=course.source_digest)


def _fail(res: StudentResult, course: Course, cause: str, message: str) -> StudentResult:
    res.status, res.cause, res.message, res.score = "not graded", cause, message, 0.0
    res.cells = [dict(c, score=0.0, source="none") for c in course.cells]
    return res


def grade_student(sub: intake.Submission, course: Course, cfg: GradeConfig, slot: dict, out: Outputs,
                  sealed: Path) -> StudentResult:
    """Grade one hand-in in its own scratch course; always returns a result (never raises for the student)."""
    hardware = {"class": slot["class"], "card": slot["card"]}
    sdir = out.out / "students" / sub.student_id
    sdir.mkdir(parents=True, exist_ok=True)
    if sub.problem:
        return _not_graded(sub, course, sub.cause or "bad hand-in", sub.problem, hardware)
    scratch = sealed / os.urandom(8).hex()
    sockets = _kernel_socket_dir()
    try:
        return _grade_in(scratch, sub, course, cfg, slot, out, sealed,
                         kernel_ipc=str(sockets / "k") if sockets else None)
    finally:
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)
        if cfg.keep_work:
            log.info("%s: scratch course kept in %s", sub.student_id, scratch)
        else:
            remove_tree(scratch)


_SOCKET_PREFIX = "lk-sock-"  # + grader pid: folders of a killed grader are swept by the next run


def _socket_root() -> str | None:
    return "/tmp" if os.path.isdir("/tmp") else None  # short: a Unix socket path is limited to about 100 bytes


def _kernel_socket_dir() -> Path | None:
    """A private folder for one kernel's Unix sockets, on a path short enough for them; None: use TCP."""
    if os.name != "posix":
        return None
    try:
        d = Path(tempfile.mkdtemp(prefix=f"{_SOCKET_PREFIX}{os.getpid()}-", dir=_socket_root()))
    except OSError:
        return None
    if len(str(d)) > 80:  # a socket path (this folder + "/k-<n>") must stay under about 100 bytes
        shutil.rmtree(d, ignore_errors=True)
        return None
    return d


def notebook_jail(course: Course, root: Path, cache: Path, gpu_index, gpu_env: dict, cfg: GradeConfig) -> Jail:
    """The sandbox the student's notebook runs in: its scratch course writable, its compile cache, and nothing
    the checks' sandboxes leave out. The cache it writes is the checks' runner's, and a copy of torch's
    grad_scaler.py that a notebook left there was loaded by that runner and scored lab 1 at full marks."""
    hide = tuple(sorted({m for c in course.calls for m in labkit_answers.sandbox_hides(c.check)}))
    return Jail(writable=[root], gpu=gpu_index, env=gpu_env, trusted=cfg.trusted_submissions, cache=cache,
                disk_bytes=int(cfg.disk_gb * 2**30), hide=hide)


def handin_record(files) -> dict:
    """What the hand-in cell wrote about the hand-in (labkit.handin.RECORD: lab, release, variant tag), or {}.

    The student's own bytes: read as data, bounded, and only its plain string fields."""
    try:
        data = files[HANDIN_RECORD] if HANDIN_RECORD in files else b""
        d = json.loads(data.decode("utf-8")) if 0 < len(data) <= 4096 else {}
    except (ValueError, UnicodeDecodeError, OSError, LabkitError):
        return {}
    return {k: v[:100] for k, v in d.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(d, dict) else {}


def check_variants(subs: list[intake.Submission], course: Course, secret, classmates: list[str]) -> None:
    """Lab 3: each hand-in's slow_train.py must carry the variant tag handed out to the id it was read as
    (lab3_variants.tag_verdict). One that carries another (a classmate's, the common one, another course's) is
    not graded: its answers are for another variant, and a person decides; one without a tag is graded, noted."""
    if not any(c.check.startswith("lab3.") for c in course.calls):
        return
    from autograder.checks import lab3_variants

    for sub in subs:
        if sub.problem:
            continue
        tag = None
        if "slow_train.py" in sub.files:
            try:
                tag = lab3_variants.read_tag(sub.files["slow_train.py"][:400].decode("utf-8", "replace"))
            except (OSError, LabkitError):
                tag = None
        tag = tag or (handin_record(sub.files).get("variant_tag") or None)
        if tag is None and getattr(secret, "open_kit", False):
            continue  # the open kit hands everyone the same untagged slow_train.py: there is no variant to check
        if tag is None:
            why = ("its slow_train.py carries none" if "slow_train.py" in sub.files else
                   "no slow_train.py from the hand-in cell")
            sub.notes.append(f"no lab 3 variant tag in the hand-in ({why}): graded against {sub.student_id}'s own "
                             "variant, unchecked")
            continue
        verdict = lab3_variants.tag_verdict(tag, sub.student_id, secret, classmates)
        if verdict is None:
            sub.notes.append(f"lab 3 variant tag checked: the slow_train.py handed out to {sub.student_id}")
            continue
        mine, whose = verdict
        sub.problem = (f"the slow_train.py in this hand-in is {mine}: lab 3's answers are graded against the variant "
                       f"handed out to {sub.student_id}, so this hand-in waits for a person (hand in with your own "
                       "slow_train.py, or the instructor regrades it with --only "
                       f"{sub.student_id} --force once settled)")
        sub.cause = "variant mismatch"
        sub.flags.append(f"variant mismatch: {sub.student_id}'s hand-in carries the tag of {whose}")


def _fill_old_release(submitted: Path, course: Course, sub: intake.Submission) -> list[str]:
    """Put in the test and answer cells a hand-in from an earlier release lacks (course.fill_missing_cells), so
    it is graded on the cells it has; returns the notes saying which cells and from which release."""
    notes = []
    made = handin_record(sub.files).get("release")
    for n in course.notebooks:
        path = submitted / f"{n}.ipynb"
        if n not in course.release or not path.is_file():
            continue
        data, missing = courses.fill_missing_cells(path.read_bytes(), course.release[n])
        if missing:
            path.write_bytes(data)
            where = (f"made from release {made}" if made else
                     "made from an earlier release (its version is not recorded) or had them deleted")
            notes.append(f"{n}.ipynb lacks {len(missing)} cell(s) the course's release {_release_version()} has "
                         f"({where}): {', '.join(missing)}; they were put in from the course's notebook, and the "
                         "hand-in is graded on the cells it has")
    return notes


def _release_version() -> str:
    from autograder.release.build import version

    try:
        return version()
    except (OSError, KeyError, ValueError):
        return "(unknown)"


def nbgrader_failure(output: str) -> str:
    """The real cause of a failed `nbgrader autograde`, from its output: the last exception it raised (type and
    message) and where, never its closing "Please see the above traceback for details"."""
    lines = [ln.rstrip() for ln in output.splitlines()]
    exc = [i for i, ln in enumerate(lines) if re.match(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|"
                                                       r"Exit|Interrupt)(?::|$)", ln)
           and "above traceback" not in ln.lower() and "error log" not in ln.lower()]
    if not exc:
        tail = [ln for ln in lines if ln.strip() and "see the above traceback" not in ln.lower()]
        return (tail[-1].strip() if tail else "no output (see autograde.log)")[:300]
    i = exc[-1]
    where = [m for ln in lines[:i] if (m := re.search(r'File "[^"]*?([\w]+\.py)", line (\d+), in (\w+)', ln))]
    at = f" (in {where[-1].group(3)}, {where[-1].group(1)} line {where[-1].group(2)})" if where else ""
    return (lines[i].strip() + at)[:300]


def _grade_in(scratch: Path, sub: intake.Submission, course: Course, cfg: GradeConfig, slot: dict, out: Outputs,
              sealed: Path, *, kernel_ipc: str | None = None) -> StudentResult:
    sid, aid = sub.student_id, course.assignment
    sdir = out.out / "students" / sid
    root = scratch / "course"
    jailed = not cfg.trusted_submissions
    # In the sandbox the kernel's sockets live in its private /tmp, and nothing outside is there to hide from it.
    submitted = courses.write_scratch(course, root, sid, sub.files, cell_timeout_s=cfg.cell_timeout_s,
                                      hide_hidden_tests=cfg.hide_hidden_tests, vault=None if jailed else sealed,
                                      kernel_ipc="/tmp/kernel" if jailed else kernel_ipc)
    release_notes = _fill_old_release(submitted, course, sub)
    gpu = {"CUDA_VISIBLE_DEVICES": str(slot["index"])} if slot["index"] is not None else {}
    env = courses.py_env(gpu)
    limits = Limits(wall_s=cfg.wall_timeout_s, memory_bytes=int(cfg.memory_gb * 2**30),
                    address_space=cfg.address_space_limit and slot["class"] == "cpu")
    token = os.urandom(16).hex()
    write_json(sdir / "running.json", {"token": token, "started_at": _now()})
    cache = scratch / "compile-cache"  # this student's alone: their notebook fills it, their runner reuses it
    cache.mkdir(parents=True)
    box = notebook_jail(course, root, cache, slot["index"], gpu, cfg)
    outcome = run_limited(nbgrader_command("autograde", aid, "--student", sid, "--force"),
                          cwd=root, env=env, limits=limits, token=token, jail=box)
    write_log(sdir / "autograde.log", f"nbgrader autograde {aid} --student {sid}", outcome)
    res = StudentResult(sid, aid, "graded", 0.0, course.max_score, notes=list(sub.notes) + release_notes,
                        hardware={"class": slot["class"], "card": slot["card"]}, digest=sub.digest,
                        source_digest=course.source_digest, peak_rss_bytes=outcome.peak_rss_bytes,
                        wall_s=outcome.wall_s, sandbox="bwrap" if jailed else "none")
    err = courses.config_error(outcome.output)
    if err:  # nbgrader carries on without a config it cannot load, i.e. without the grader's safeguards
        return _fail(res, course, "grader error", f"nbgrader could not load the scratch config: {err}")
    if outcome.leftovers_killed:
        res.flags.append(f"{outcome.leftovers_killed} process(es) still running after grading were killed")
    if outcome.output_bytes > 10 * 2**20:
        res.notes.append(f"grading printed {outcome.output_bytes / 2**20:.0f} MiB of output (kept head and tail)")
    if outcome.timed_out:
        return _fail(res, course, "timeout", f"grading took longer than {cfg.wall_timeout_s:.0f} s and was stopped")
    if outcome.out_of_memory:
        return _fail(res, course, "memory", f"the notebook used more than {cfg.memory_gb:g} GiB and was stopped")
    if outcome.out_of_disk:
        return _fail(res, course, "disk", f"the notebook {outcome.out_of_disk} and was stopped")
    if outcome.error:
        return _fail(res, course, "grader error", f"could not start nbgrader: {outcome.error}")
    graded_dir = root / "autograded" / sid / aid
    kcause = _kernel_cause(outcome)
    if not outcome.ok or not all((graded_dir / f"{n}.ipynb").exists() for n in course.notebooks):
        why = {"kernel died": "the kernel died while running the notebook (os._exit, a crash, or memory)",
               "kernel unresponsive": "the kernel stopped answering (it ignores interrupts?) and was abandoned",
               "kernel did not start": "the notebook's kernel exited before running any cell (a file in the hand-in "
                                       "shadowing a module the kernel imports, or the machine; see autograde.log): "
                                       f"regrade with --only {sid} --force"}
        return _fail(res, course, kcause or "nbgrader error",
                     why.get(kcause, f"nbgrader autograde failed: {nbgrader_failure(outcome.output)}"))

    try:  # from here on the grader reads only this copy: nothing under root is loaded, run or followed
        graded_dir = courses.take_graded(root, scratch / "graded", course, sid, cell_timeout_s=cfg.cell_timeout_s,
                                         hide_hidden_tests=cfg.hide_hidden_tests)
    except (LeftFileError, FileNotFoundError) as e:
        return _fail(res, course, "tampered files", "the notebook left something other than its own files where "
                                                    f"the grader reads them back ({e})")
    taken = graded_dir.parents[2]  # the copy's course folder
    for n in course.notebooks:  # the ones take_graded left out: honest print-outs can be this large too
        if not (graded_dir / f"{n}.ipynb").exists():
            res.notes.append(f"{n}.ipynb as graded is too large to read (over {MAX_LEFT_BYTES // 2**20} MiB or "
                             f"{MAX_JSON_VALUES:,} JSON values: print less): scored from the gradebook and the "
                             "checks, with no feedback page or formgrader copy; its written answers wait for a person")
    res.notes += _notebook_notes([graded_dir / f"{n}.ipynb" for n in course.notebooks], cfg.cell_timeout_s)
    db = taken / "gradebook.db"
    try:
        report.check_integrity(db, course.structure, aid, master=course.gradebook)
        cells, extra = report.course_cells(report.read_grades(db, aid, sid), course.cells)
        res.flags += extra
        res.flags += manual.seal(cells, course.cells, {n: graded_dir / f"{n}.ipynb" for n in course.notebooks},
                                 course.structure)
    except report.TamperedError as e:
        res.flags.append(str(e))
        return _fail(res, course, "tampered gradebook", "the gradebook was changed while the notebook ran")
    except Exception as e:  # a gradebook the student's code managed to corrupt
        return _fail(res, course, "gradebook unreadable", f"{type(e).__name__}: {str(e)[:200]}")

    if course.calls:
        verdicts, outs = trusted.run_trusted(course.calls, graded_dir, scratch / "trusted",
                                             harness_module=cfg.harness_module, env=env,
                                             limits=replace(limits, wall_s=cfg.harness_timeout_s,
                                                            memory_bytes=limits.memory_bytes + HARNESS_EXTRA_BYTES),
                                             data_files=course.source_files,
                                             sandbox="none" if cfg.trusted_submissions else "bwrap",
                                             memory_gb=cfg.memory_gb, cache=cache, student=sid,
                                             disk_gb=cfg.disk_gb, handin=sub.digest or None)
        for o in outs:
            res.peak_rss_bytes = max(res.peak_rss_bytes, o.peak_rss_bytes)
            res.wall_s += o.wall_s
        res.flags += trusted.cell_scores(course.calls, verdicts, cells)
        for v in verdicts.values():
            res.checks.append({"check": v.check, "passed": v.passed, "fraction": v.fraction, "message": v.message,
                               "cause": v.cause, **trusted.headline(v.numbers), "measurements": v.numbers})
            if v.passed is None and v.cause is None:
                res.notes.append(f"{v.check}: not gradable on {slot['class']}; regrade on the hardware it needs")
        stuck = [v.cause for v in verdicts.values() if v.cause in ("timeout", "memory")]
        kcause = kcause or (f"check {stuck[0]}" if stuck else None)
    report.write_scores(db, aid, sid, cells)
    res.cells, res.cause = cells, kcause
    res.score = round(sum(c["score"] for c in cells), 4)
    res.message = f"{res.score:g} / {res.max_score:g} points"
    if manual.pending_points(res):
        res.message += f" (provisional: {manual.pending_points(res):g} points of written answers need manual grading)"

    # The notebook as handed in (from intake's bytes, before any of the student's code ran): written answers are
    # marked against the outputs the student saw, not the grader's re-run. The renderer makes its plain copy.
    handed = taken / "submitted" / sid / aid
    for n in course.notebooks:
        if f"{n}.ipynb" in sub.files:
            handed.mkdir(parents=True, exist_ok=True)
            (handed / f"{n}.ipynb").write_bytes(sub.files[f"{n}.ipynb"])
    pages, flog, stopped = feedback.RENDERER.render(taken, aid, sid, pages=cfg.feedback,
                                                    timeout_s=cfg.feedback_timeout_s)
    (sdir / "feedback.log").write_text(flog, errors="replace")
    if stopped:
        res.notes.append(f"{stopped}; the summary alone is sent" if cfg.feedback else stopped)
    if cfg.feedback:
        for nb in course.notebooks:
            if nb not in pages and not stopped:
                res.notes.append(f"nbgrader wrote no feedback page for {nb}; the summary alone is sent")
            res.outputs[report.feedback_path(res, nb)] = out.write(report.feedback_path(res, nb),
                                                                   report.feedback_page(res, pages.get(nb)))
    # For the record and for formgrader: the checked files as graded, and each graded notebook as the child rebuilt
    # it from plain parts (formgrader shows it in the instructor's session without sanitizing).
    kept = {f"{n}.ipynb": taken / "formgrader" / f"{n}.ipynb" for n in course.notebooks}
    kept.update({p.relative_to(graded_dir).as_posix(): p for p in sorted(graded_dir.rglob("*"))
                 if p.is_file() and p.suffix != ".ipynb"})
    for rel, p in kept.items():
        size = p.stat().st_size if p.is_file() else None
        if size is None or size > MAX_KEPT_BYTES:
            res.notes.append(f"{rel} is not kept for formgrader ({'too large' if size else 'not written'}; "
                             "see feedback.log)")
            continue
        res.outputs[f"autograded/{sid}/{aid}/{rel}"] = out.write(f"autograded/{sid}/{aid}/{rel}", p.read_bytes())
    keep_handed_in(res, out, taken / "formgrader" / feedback.HANDED_IN, sid, course.notebooks)
    return res


def keep_handed_in(res, out, copies: Path, sid: str, notebooks) -> None:
    """Keep each notebook's plain copy as handed in (`copies`/<name>.ipynb) beside the result, at
    students/<sid>/as_handed_in/, where no nbgrader tool looks for notebooks to grade; a copy not written or
    over MAX_KEPT_BYTES gets a note instead, since the marker reading written answers must know it is missing."""
    for n in notebooks:
        p = copies / f"{n}.ipynb"
        rel = f"students/{sid}/{feedback.HANDED_IN}/{n}.ipynb"
        size = p.stat().st_size if p.is_file() else None
        if size is None or size > MAX_KEPT_BYTES:
            res.notes.append(f"{rel} is not kept ({'too large' if size else 'not written'}; see feedback.log)")
            continue
        res.outputs[rel] = out.write(rel, p.read_bytes())


# ------------------------------------------------------------------------------------------------ the class


def default_out(assignment: str) -> Path:
    return Path("grading") / assignment


def grader_digest() -> str:
    """sha256 of the grader's own code (autograder/ and labkit/) and of a fingerprint of the course secret: a
    result made by other code, or under another secret (other hidden cases and variants), is regraded."""
    h = hashlib.sha256(course_secret.derive("grader-digest"))
    root = Path(__file__).resolve().parents[1]
    for p in grader_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def grader_files(root: Path) -> list[Path]:
    """The code a result depends on: every Python file of autograder/ and labkit/, subpackages included (labkit's
    fast start is one; when only labkit's top level counted, a change there regraded nobody)."""
    return sorted([*root.glob("autograder/**/*.py"), *root.glob("labkit/**/*.py")])


def _setup_logging(out: Path) -> logging.Handler:
    out.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(out / "grade_log.txt", encoding="utf-8")
    h.setFormatter(shown.LogFormatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return h


def _remove_sealed(sealed: Path) -> None:
    if sealed.exists():
        remove_tree(sealed)


def _remove_stale_temps() -> None:
    """Scratch folders of runs that were killed (their pid is gone)."""
    import psutil

    for d in Path(tempfile.gettempdir()).glob(_TMP_PREFIX + "*"):
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):
            continue
        if not psutil.pid_exists(pid):
            _remove_sealed(d / "sealed")
            shutil.rmtree(d, ignore_errors=True)


def _remove_stale_sockets() -> None:
    """Kernel socket folders of graders that were killed (the pid in their name is gone)."""
    import psutil

    for d in Path(_socket_root() or tempfile.gettempdir()).glob(_SOCKET_PREFIX + "*"):
        try:
            pid = int(d.name[len(_SOCKET_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            shutil.rmtree(d, ignore_errors=True)


def grade_class(assignment: str, submissions: str | Path, cfg: GradeConfig | None = None) -> ClassReport:
    """Grade every hand-in under `submissions`; returns the report after writing grades.csv, feedback and logs.

    Raises LabkitError (after logging it) only for problems with the whole run: an unknown assignment, a
    missing submissions folder, a broken course. Anything one student does is caught and recorded.
    """
    cfg = cfg or GradeConfig()
    out = Path(cfg.out or default_out(assignment)).resolve()
    handler = _setup_logging(out)
    t0 = time.monotonic()
    tmp = work = None
    try:
        log.info("=== grading %s from %s into %s", assignment, submissions, out)
        if not Path(submissions).exists():
            raise LabkitError(f"submissions folder {submissions} does not exist: pass the folder (or .zip) you "
                              "downloaded with --submissions")
        for name, value in (("memory_gb", cfg.memory_gb), ("disk_gb", cfg.disk_gb)):
            if not value > 0:
                raise LabkitError(f"--{name.replace('_', '-')} must be positive, not {value}")
        secret = course_secret.for_grading(cfg.open_kit)
        log.info("hidden cases and variants from the %s", secret.label)
        _remove_stale_sockets()
        if not cfg.trusted_submissions:
            why = jail.probe()
            if why:
                raise LabkitError(f"cannot sandbox the students' code: {why}. Install bubblewrap, or pass "
                                  "--trusted-submissions if you trust every hand-in (their code then runs "
                                  "unconfined, as you)")
        if not cfg.trusted_recheck and not cfg.trusted_submissions:
            raise LabkitError("scores from inside the students' notebooks can be faked: the checks are re-run "
                              "outside them unless the submissions are trusted (--trusted-submissions)")
        if cfg.work:
            work = Path(cfg.work).resolve()
        else:
            _remove_stale_temps()
            tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX)
            work = Path(tmp)
            (work / "pid").write_text(str(os.getpid()))
        if out == work or out in work.parents:
            raise LabkitError(f"the scratch folder {work} must not be inside the output folder {out}")
        sealed = work / "sealed"
        _remove_sealed(sealed)  # what an interrupted run left
        sealed.mkdir(parents=True)
        os.chmod(sealed, 0o300)  # not listable (for users other than root): scratch courses get random names
        course = courses.prepare_course(assignment, cfg.course, sealed, out, cell_timeout_s=cfg.cell_timeout_s,
                                        hide_hidden_tests=cfg.hide_hidden_tests, find_calls=cfg.trusted_recheck)
        if course.calls:
            courses.check_harness(cfg.harness_module)
        scores = manual.collect(out, assignment, course.cells, cfg.manual_scores)  # bad CSV: stop before grading
        hardware = [dict(h) for h in courses.detect_hardware()]
        log.info("hardware: %s", "; ".join(f"{h['card']} ({h['class']})" for h in hardware))
        gpu_policy.refuse_ungradable(assignment, [c.check for c in course.calls], hardware, cfg.allow_ungradable)
        roster = lmsnames.load_roster(cfg.roster)  # a bad class list stops the run here, before any grading
        found = intake.collect(submissions, assignment, scratch=work / "intake", lms_regex=cfg.lms_regex,
                               roster=roster)
        for line in found.junk:
            log.warning("intake: %s", line)
        if found.unmatched:
            raise LabkitError(f"{len(found.unmatched)} hand-in(s) name no single student, so nobody is graded yet "
                              f"(a misread id grades a student against another's variant): "
                              + "; ".join(found.unmatched[:5]) + ("; ..." if len(found.unmatched) > 5 else "")
                              + ("" if roster else "; pass the class list with --roster (the CSV `make student "
                                                   "ROSTER=` reads, or the LMS's gradebook export)")
                              + " and grade again")
        check_variants(found.submissions, course, secret, list(roster.ids) if roster else
                       [s.student_id for s in found.submissions])
        if cfg.late is not None and cfg.roster and cfg.late.roster is None:
            cfg = replace(cfg, late=replace(cfg.late, roster=cfg.roster))
        if not found.submissions:
            raise LabkitError(f"no student hand-ins found in {submissions}: expected one folder per student "
                              f"(holding {assignment}.ipynb) or LMS-named .ipynb/.zip files"
                              + (f"; skipped: {found.junk[0]}" if found.junk else ""))
        everyone = {s.student_id for s in found.submissions}  # before slicing: the whole class that handed in
        if cfg.shard:
            found.submissions = shard.select(found.submissions, cfg.shard)
            log.info("slice %s: %d hand-ins", cfg.shard, len(found.submissions))
        outputs = Outputs(out)
        results, todo, changed = _plan(found.submissions, course, cfg, outputs)
        if todo:
            feedback.RENDERER.start()  # its imports overlap the first student's grading
        graded_now = _run_all(todo, course, cfg, outputs, hardware, results, sealed)
        ordered = manual.apply([results[s.student_id] for s in found.submissions if s.student_id in results], scores,
                               known=everyone if cfg.shard else None)
        restored = outputs.restore_changed()
        for rel in restored:
            log.warning("output %s was changed after it was written (by a submission's code?); restored", rel)
        junk = list(found.junk) + changed
        classbook.finish(out, classbook.info_from_course(course), ordered, hardware=hardware, junk=junk,
                         write=outputs.write, shard=cfg.shard, policy=cfg.late, submissions=submissions,
                         lms_regex=cfg.lms_regex)
        rep = ClassReport(ordered, out, junk, graded_now, time.monotonic() - t0, hardware, restored)
        log.info("done: %d students (%d graded now) in %.0f s", len(ordered), graded_now, rep.wall_s)
        return rep
    except LabkitError as e:
        log.error("run stopped: %s", e)
        summary.note_stopped(out, e)
        raise
    finally:
        log.removeHandler(handler)
        handler.close()
        if work is not None:
            if cfg.keep_work:
                with contextlib.suppress(OSError):
                    os.chmod(work / "sealed", 0o700)
            else:
                _remove_sealed(work / "sealed")
                shutil.rmtree(work / "intake", ignore_errors=True)  # the spooled hand-ins
                if tmp:
                    shutil.rmtree(tmp, ignore_errors=True)


def _plan(subs: list[intake.Submission], course: Course, cfg: GradeConfig, outputs: Outputs):
    """Who needs grading; finished students keep their result and their files are guarded from here on.

    A result is kept only if its MAC verifies under the output folder's key and it was made by this grader's
    code, from this hand-in and this assignment."""
    key, grader = result_key(outputs.out), grader_digest()
    results: dict[str, StudentResult] = {}
    todo, changed = [], []
    for sub in subs:
        sdir = outputs.out / "students" / sub.student_id
        stale = sdir / "running.json"
        if stale.exists():  # a previous run was killed while grading this student: end what it left running
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                n = kill_token(json.loads(stale.read_text())["token"])
                if n:
                    log.warning("%s: killed %d process(es) left by an interrupted run", sub.student_id, n)
            stale.unlink(missing_ok=True)
        done = load_result(sdir / "result.json", key, sub.student_id)
        fresh = done is not None and done.digest == sub.digest and done.source_digest == course.source_digest \
            and done.grader == grader and faults.kept(done)  # the grader's own failure is graded again
        if done is not None and done.grader != grader and not cfg.only:
            log.info("%s: graded by another version of the grader; regrading", sub.student_id)
        keep = done is not None and ((cfg.only and sub.student_id not in cfg.only) or (fresh and not cfg.force))
        if keep:
            results[sub.student_id] = done
            outputs.adopt(f"students/{sub.student_id}/result.json")
            bad = [rel for rel, dg in done.outputs.items() if not outputs.adopt(rel, dg)]
            if bad:
                changed.append(f"{sub.student_id}: {bad[0]} changed since it was graded; regrade with --only "
                               f"{sub.student_id} --force")
                log.warning(changed[-1])
        elif not (cfg.only and sub.student_id not in cfg.only):
            todo.append(sub)
    log.info("%d hand-ins: %d to grade, %d already graded", len(subs), len(todo), len(results))
    return results, todo, changed


def _run_all(todo, course: Course, cfg: GradeConfig, outputs: Outputs, hardware, results, sealed: Path) -> int:
    from autograder.base.progress import bar as tqdm  # one line per student when the log is not a terminal

    gpus = [h for h in hardware if h["index"] is not None]
    if gpus:
        jobs = min(cfg.jobs or len(gpus), len(gpus))
        if cfg.jobs and cfg.jobs > len(gpus):
            log.warning("--jobs %d lowered to %d: one student per GPU at a time", cfg.jobs, len(gpus))
        slots = gpus[:jobs]
    else:
        jobs = max(1, cfg.jobs or 1)
        slots = [hardware[0]] * jobs
    free = list(range(jobs))
    markers = [rel for rel in outputs.kept if rel.endswith("/result.json")]
    key, grader = result_key(outputs.out), grader_digest()

    def one(sub, slot_i):
        try:
            res = grade_student(sub, course, cfg, slots[slot_i], outputs, sealed)
        except Exception as e:  # a grader bug must not stop the class
            log.exception("%s: grader error", sub.student_id)
            res = _not_graded(sub, course, "grader error", f"{type(e).__name__}: {e}",
                              {"class": slots[slot_i]["class"], "card": slots[slot_i]["card"]})
        res = faults.classify(res)  # a full disk or the grader's memory: the machine's fault, retried on resume
        res.finished_at = _now()
        res.grader = grader
        rel = f"students/{sub.student_id}/result.json"
        outputs.write(rel, sealed_result(res, key))
        (outputs.out / "students" / sub.student_id / "running.json").unlink(missing_ok=True)
        return res, rel

    bar = tqdm(total=len(todo), desc=f"grading {course.assignment}", unit="student", disable=not cfg.progress)
    done = 0
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            pending, queue = {}, list(todo)
            while queue or pending:
                while queue and free:
                    s, i = queue.pop(0), free.pop(0)
                    pending[pool.submit(one, s, i)] = (s, i)
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    sub, i = pending.pop(f)
                    free.append(i)
                    res, rel = f.result()
                    results[sub.student_id] = res
                    markers.append(rel)
                    for bad in outputs.restore_changed(markers):  # done-markers are what a resume trusts
                        log.warning("%s was changed behind the grader's back; restored", bad)
                    done += 1
                    log.info("%s: %s%s (%.0f s)", sub.student_id, res.message or res.status,
                             f" [{res.cause}]" if res.cause else "", res.wall_s)
                    bar.set_postfix_str(f"{sub.student_id}: {res.score:g}/{res.max_score:g}")
                    bar.update(1)
    finally:
        bar.close()
    return done

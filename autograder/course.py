"""The course side of grading: generate an assignment once, build scratch courses, render feedback, find GPUs.

`prepare_course` runs `nbgrader generate_assignment` on a private copy of the instructor's course and keeps what
every student's scratch course needs in memory (the generated gradebook, the assignment's data files, the
structure of its grade cells); the copy is then deleted, so no solution or hidden test is left on disk where a
submission's code could look. `write_scratch` lays out one student's private course from that, with an
nbgrader_config.py that loads the course's own settings and then adds the grader's (see nbhooks).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autograder.base.nbstart import nbgrader_command, py_env
from autograder.checks import trusted
from autograder.gradebook import manual, report
from autograder.gradebook.feedback import GRADE_ID
from autograder.sandbox.limits import (
    LeftFileError,
    Limits,
    TooLarge,
    load_left_json,
    read_left,
    run_limited,
    write_log,
)
from labkit.env import REPO_ROOT, LabkitError

log = logging.getLogger("autograder")
MAX_SOURCE_BYTES = 1 << 30  # an assignment's data files are kept in memory; beyond this, refuse
CONFIG_ERROR = "Exception while loading config file"


@dataclass
class Course:
    """One assignment, generated once: everything a scratch course is built from."""

    assignment: str
    root: Path  # the instructor's course root
    config_text: str  # the course's nbgrader_config.py
    source_files: dict[str, bytes]  # the assignment's non-notebook files (data, helpers), by relative path
    gradebook: bytes  # the gradebook right after generate_assignment
    structure: dict  # grade cells, points and checksums, to spot a gradebook rewritten by student code
    notebooks: list[str]  # notebook ids of the assignment
    max_score: float  # points available
    cells: list[dict]  # notebook, cell, max_score of every grade cell
    calls: list[trusted.HarnessCall]  # harness calls in the test cells, re-run by the grader
    source_digest: str  # changes when the assignment or the course config changes (then everyone is regraded)
    release: dict = field(default_factory=dict)  # notebook id -> the released notebook's bytes (no solutions)


def known_assignments(course: Path) -> list[str]:
    """Assignment ids with a source notebook under `course`/source."""
    src = course / "source"
    return sorted(p.name for p in src.iterdir() if (p / f"{p.name}.ipynb").exists()) if src.is_dir() else []


def config_error(text: str) -> str | None:
    """The error nbgrader logged (and then ignored) when a config file failed to load, or None."""
    if CONFIG_ERROR not in text:
        return None
    block = text[text.index(CONFIG_ERROR):].splitlines()
    errs = [ln.strip() for ln in block[1:60] if re.match(r"\s*[\w.]+(Error|Exception)\b", ln)]
    return (errs[-1] if errs else block[0])[:300]


def scratch_config(root: Path, *, cell_timeout_s: int | None, hide_hidden_tests: bool, vault: Path | None,
                   kernel_ipc: str | None = None) -> str:
    """nbgrader_config.py for a scratch course: the course's own settings, then the grader's.

    With `kernel_ipc` (a path prefix in a private folder), the kernel talks over Unix sockets there instead of
    TCP ports on localhost.
    """
    lines = [
        "# Written by the grader: the course's settings, then the grader's own.",
        "from nbgrader.converters.autograde import Autograde",
        "from nbgrader.converters.generate_feedback import GenerateFeedback",
        "from nbgrader.preprocessors import Execute, SaveAutoGrades",
        "from autograder.nbhooks import HideHiddenTests, SealKernel, StderrIsNotFailure, UnsealAfterKernel",
        "c = get_config()",
        "load_subconfig('course_nbgrader_config.py')",
        f"c.CourseDirectory.root = {str(root)!r}",
        f"c.CourseDirectory.db_url = {'sqlite:///' + str(root / 'gradebook.db')!r}",
        # nbgrader's own default is 30 s per cell; a course that sets its own limit keeps it.
        f"c.Execute.timeout = {cell_timeout_s!r} if {cell_timeout_s is not None!r} "
        "else c.Execute.get('timeout', 600)",
        "c.OverwriteCells.add_missing_cells = True",
        "_pp = list(Autograde.class_traits()['autograde_preprocessors'].default())",
        "_pp.insert(_pp.index(SaveAutoGrades), StderrIsNotFailure)",
        "_pp.insert(_pp.index(Execute) + 1, UnsealAfterKernel)",
        "_pp.insert(_pp.index(Execute), SealKernel)",
        "c.Autograde.autograde_preprocessors = _pp",
        f"c.SealKernel.vault = {str(vault or '')!r}",
        "_fb = list(GenerateFeedback.class_traits()['preprocessors'].default())",
    ]
    if hide_hidden_tests:
        lines += ["_fb.insert(0, HideHiddenTests)",
                  "c.HideHiddenTests.begin = c.ClearHiddenTests.get('begin_test_delimeter', 'BEGIN HIDDEN TESTS')",
                  "c.HideHiddenTests.end = c.ClearHiddenTests.get('end_test_delimeter', 'END HIDDEN TESTS')"]
    lines.append("c.GenerateFeedback.preprocessors = _fb")
    if kernel_ipc:
        # TCP ports are picked free by nbgrader and bound later by the kernel: two students graded side by side
        # can race for the same port, and the loser's kernel dies before running a line ("Address already in
        # use"). Sockets in a folder of this student's own cannot collide (and other kernels cannot reach them).
        lines += ["c.KernelManager.transport = 'ipc'", f"c.KernelManager.ip = {kernel_ipc!r}"]
    return "\n".join(lines) + "\n"


def _read_source(src: Path, *, with_notebooks: bool) -> dict[str, bytes]:
    files, total = {}, 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if not p.is_file() or ".ipynb_checkpoints" in rel.parts or (p.suffix == ".ipynb" and not with_notebooks):
            continue
        total += p.stat().st_size
        if total > MAX_SOURCE_BYTES:
            raise LabkitError(f"{src} holds more than {MAX_SOURCE_BYTES >> 20} MiB: keep large data out of the "
                              "assignment folder (generate it in the notebook instead)")
        files[rel.as_posix()] = p.read_bytes()
    return files


def _write_files(dest: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def prepare_course(assignment: str, course: str | Path, work: Path, log_dir: Path, *, cell_timeout_s: int | None,
                   hide_hidden_tests: bool, find_calls: bool) -> Course:
    """Check the course and assignment, generate it once in `work`, keep what is needed, delete the copy.

    Raises LabkitError when the course, the assignment or its generation is unusable.
    """
    root = Path(course).resolve()
    if not (root / "nbgrader_config.py").is_file():
        raise LabkitError(f"{root} is not an nbgrader course (no nbgrader_config.py): pass the course root with "
                          "--course")
    src_nb = root / "source" / assignment / f"{assignment}.ipynb"
    if not src_nb.is_file():
        names = ", ".join(known_assignments(root)) or "none"
        raise LabkitError(f"unknown assignment {assignment!r}: no source/{assignment}/{assignment}.ipynb in {root} "
                          f"(assignments there: {names})")
    config_text = (root / "nbgrader_config.py").read_text()
    source = _read_source(root / "source" / assignment, with_notebooks=True)
    digest = hashlib.sha256(config_text.encode())
    for rel in sorted(source):
        digest.update(rel.encode() + b"\0" + source[rel] + b"\0")
    master = work / f"master-{os.urandom(8).hex()}"
    try:
        (master / "source" / assignment).mkdir(parents=True)
        (master / "course_nbgrader_config.py").write_text(config_text)
        (master / "nbgrader_config.py").write_text(scratch_config(
            master, cell_timeout_s=cell_timeout_s, hide_hidden_tests=hide_hidden_tests, vault=None))
        _write_files(master / "source" / assignment, source)
        out = run_limited(nbgrader_command("generate_assignment", assignment, "--force"),
                          cwd=master, env=py_env(), limits=Limits(wall_s=600, memory_bytes=None))
        write_log(log_dir / "generate_assignment.log", f"nbgrader generate_assignment {assignment}", out)
        err = config_error(out.output)
        if err:
            raise LabkitError(f"nbgrader could not load {root / 'nbgrader_config.py'}: {err}")
        db = master / "gradebook.db"
        if not out.ok or not db.exists():
            tail = " | ".join(out.output.strip().splitlines()[-3:])
            raise LabkitError(f"nbgrader generate_assignment {assignment} failed ({out.cause()}): {tail[-400:]}")
        cells, notebooks = report.gradebook_cells(db, assignment)
        manual.mark(cells, manual.manual_ids(db, assignment))  # written answers: graded by a person, later
        calls = trusted.find_calls(master / "source" / assignment / f"{assignment}.ipynb") if find_calls else []
        released = {n: (master / "release" / assignment / f"{n}.ipynb").read_bytes() for n in notebooks
                    if (master / "release" / assignment / f"{n}.ipynb").is_file()}
        return Course(assignment, root, config_text,
                      {k: v for k, v in source.items() if not k.endswith(".ipynb")}, db.read_bytes(),
                      report.structure(db, assignment), notebooks, sum(c["max_score"] for c in cells), cells, calls,
                      digest.hexdigest(), released)
    finally:
        shutil.rmtree(master, ignore_errors=True)


def write_scratch(course: Course, root: Path, student: str, files: dict[str, bytes], *, cell_timeout_s: int | None,
                  hide_hidden_tests: bool, vault: Path | None, kernel_ipc: str | None = None) -> Path:
    """Lay out one student's private course under `root`; returns the submitted folder."""
    aid = course.assignment
    root.mkdir(parents=True)
    (root / "course_nbgrader_config.py").write_text(course.config_text)
    (root / "nbgrader_config.py").write_text(scratch_config(
        root, cell_timeout_s=cell_timeout_s, hide_hidden_tests=hide_hidden_tests, vault=vault, kernel_ipc=kernel_ipc))
    (root / "gradebook.db").write_bytes(course.gradebook)
    (root / "source" / aid).mkdir(parents=True)
    _write_files(root / "source" / aid, course.source_files)
    submitted = root / "submitted" / student / aid
    submitted.mkdir(parents=True)
    _write_files(submitted, files)
    return submitted


def _nbgrader_id(cell) -> str | None:
    """The grade_id of a test, answer or task cell (the cells nbgrader grades or a person does) or of a locked
    text cell (a written answer's question), else None. Locked code cells (setup, hand-in) are never put in."""
    meta = ((cell.get("metadata") or {}).get("nbgrader") or {}) if isinstance(cell, dict) else {}
    text = isinstance(meta, dict) and meta.get("locked") and cell.get("cell_type") == "markdown"
    if not isinstance(meta, dict) or not (meta.get("grade") or meta.get("solution") or meta.get("task") or text):
        return None
    gid = meta.get("grade_id")
    return gid if isinstance(gid, str) else None


def fill_missing_cells(handed_in: bytes, released: bytes) -> tuple[bytes, list[str]]:
    """The hand-in notebook with the test, answer and task cells (and locked questions) it lacks put in from the
    course's released notebook, each after the cell it follows there; returns (notebook bytes, grade_ids
    inserted, in order).

    A hand-in made from an earlier release lacks the cells a later one added. nbgrader's own insertion
    (OverwriteCells.add_missing_cells) looks up each missing cell's predecessor among the hand-in's test and
    answer cells and raises KeyError when it is not one (lab 1's written answer follows its locked question) or
    is missing too, so the whole hand-in failed. Here the cells come from the
    release, in its order, and nbgrader then finds every cell in place (it still overwrites each test cell's source
    with the gradebook's). A hand-in that is not a readable notebook is returned unchanged: intake reports it."""
    try:
        nb, rel = json.loads(handed_in), json.loads(released)
        cells, source = nb["cells"], rel["cells"]
        have = {_nbgrader_id(c): i for i, c in enumerate(cells) if _nbgrader_id(c)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return handed_in, []
    ids = {c.get("id") for c in cells if isinstance(c, dict)}
    missing, at = [], 0
    for cell in source:
        gid = _nbgrader_id(cell)
        if gid is None:
            continue
        if gid in have:
            at = next(i for i, c in enumerate(cells) if _nbgrader_id(c) == gid) + 1
            continue
        new = dict(cell, outputs=[], execution_count=None) if cell.get("cell_type") == "code" else dict(cell)
        new["id"] = next(f"{gid[:50]}-added{k}" for k in range(len(cells) + 2) if f"{gid[:50]}-added{k}" not in ids)
        ids.add(new["id"])
        cells.insert(at, new)
        at += 1
        missing.append(gid)
    if not missing:
        return handed_in, []
    return json.dumps(nb, indent=1, ensure_ascii=False).encode(), missing


def take_graded(root: Path, dest: Path, course: Course, student: str, *, cell_timeout_s: int | None,
                hide_hidden_tests: bool) -> Path:
    """What the grader reads back from a student's scratch course (`root`, after its sandbox ended), copied into
    `dest`, a course laid out the same way that no student process ever saw; returns its graded folder.

    The student's code could write anywhere under `root`: its config files (which nbgrader executes), the
    gradebook, the graded notebooks, and links in place of any of them, pointing at a classmate's files or the
    grader's. So nothing under `root` is loaded, executed or followed after this: the gradebook, the graded
    notebooks and the files the checks run (`course.calls`) are read as data (`read_left`: no links, regular
    files, bounded), and the config files are written again from the grader's own text. A graded notebook larger
    than the grader reads (sandbox.TooLarge: over MAX_LEFT_BYTES, or MAX_JSON_VALUES; outputs printed by the
    million, or a rewrite) is not copied. Raises sandbox.LeftFileError, or FileNotFoundError where a graded
    notebook is missing.
    """
    rel = Path("autograded") / student / course.assignment
    graded = dest / rel
    graded.mkdir(parents=True)
    (dest / "course_nbgrader_config.py").write_text(course.config_text)
    (dest / "nbgrader_config.py").write_text(scratch_config(dest, cell_timeout_s=cell_timeout_s,
                                                            hide_hidden_tests=hide_hidden_tests, vault=None))
    (dest / "gradebook.db").write_bytes(read_left(root, "gradebook.db"))
    for n in course.notebooks:
        try:
            data = read_left(root, rel / f"{n}.ipynb")
            _check_grade_ids(data, rel / f"{n}.ipynb")
        except TooLarge:  # left out: scored from the gradebook and the checks, with no page (grade.py says so)
            continue
        (graded / f"{n}.ipynb").write_bytes(data)
    for name in dict.fromkeys(c.student_file for c in course.calls):
        try:
            data = read_left(root, rel / name)
        except FileNotFoundError:  # the notebook never wrote it: its checks say so
            continue
        (graded / name).parent.mkdir(parents=True, exist_ok=True)
        (graded / name).write_bytes(data)
    return graded


def _check_grade_ids(data: bytes, rel: Path) -> None:
    """LeftFileError unless every nbgrader cell id in a graded notebook is one nbgrader accepts. nbgrader's
    feedback page prints the ids unescaped, and the student's code can rewrite the graded notebook after nbgrader
    wrote it (a helper of theirs lives until nbgrader exits): an id holding markup would run in whoever opens the
    page."""
    nb = load_left_json(data, str(rel))  # parsed here only within MAX_JSON_VALUES: the grader's own memory
    try:
        ids = [((c.get("metadata") or {}).get("nbgrader") or {}).get("grade_id") for c in nb.get("cells", [])]
    except (AttributeError, TypeError):
        raise LeftFileError(f"{rel}: not a notebook") from None
    bad = [i for i in ids if i is not None and not (isinstance(i, str) and GRADE_ID.fullmatch(i))]
    if bad:
        raise LeftFileError(f"{rel}: a cell's grade_id is not one nbgrader makes (letters, digits, _ and - only)")


def check_harness(module: str) -> None:
    """LabkitError unless the harness module imports in a fresh isolated interpreter."""
    code = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import {module}"
    out = run_limited([sys.executable, "-I", "-c", code], cwd=REPO_ROOT, env=py_env(),
                      limits=Limits(wall_s=120, memory_bytes=None))
    if not out.ok:
        tail = (out.output.strip().splitlines() or ["no output"])[-1]
        raise LabkitError(f"the assignment's test cells call the harness but {module} cannot be imported "
                          f"({tail[:200]}): fix it, or pass --harness MODULE")


@functools.cache
def detect_hardware() -> tuple[dict, ...]:
    """One entry per GPU torch can see (index, card, class), or one CPU entry; runs torch in a subprocess once.

    Classes are the harness's: "tensor_core_gpu" (compute capability >= 7), "gpu", "cpu".
    """
    code = (
        "import json, platform, os, torch\n"
        "rows = []\n"
        "for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):\n"
        "    p = torch.cuda.get_device_properties(i)\n"
        "    rows.append({'index': i, 'card': p.name, 'capability': f'{p.major}.{p.minor}',\n"
        "                 'class': 'tensor_core_gpu' if p.major >= 7 else 'gpu'})\n"
        "if not rows:\n"
        "    rows.append({'index': None, 'card': f'CPU ({platform.machine()}, {os.cpu_count()} cores)',\n"
        "                 'capability': None, 'class': 'cpu'})\n"
        "print(json.dumps(rows))\n"
    )
    out = run_limited([sys.executable, "-c", code], cwd=REPO_ROOT, env=py_env(),
                      limits=Limits(wall_s=180, memory_bytes=None))
    try:
        return tuple(json.loads(out.output.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        log.warning("could not detect the hardware (%s); grading as CPU", out.cause())
        return ({"index": None, "card": "unknown", "capability": None, "class": "cpu"},)

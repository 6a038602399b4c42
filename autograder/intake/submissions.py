"""Find each student's submission in whatever an instructor downloaded, and say clearly what is wrong with it.

Three layouts are understood, mixed freely in one folder (or inside one .zip of it):
  - a folder per student: `DIR/<student>/<assignment>.ipynb`, or nbgrader's `DIR/<student>/<assignment>/...`;
  - LMS downloads: flat files `DIR/<LMS's part><the student's file>.ipynb|.zip|.py`, the student id read from
    the LMS's part by that LMS's documented pattern (autograder.intake.lmsnames: Canvas, Moodle, Blackboard, D2L, the
    kit's plain `<student>_<anything>`, or the instructor's --lms-regex), and Gradescope's export folders;
  - a single archive of either of the above.
With the class list (--roster) every hand-in is matched to exactly one listed id, the longest the name starts
with; a name that matches none or several, or (without a list) an id that may hold a separator, is not graded
and named with its candidates (`Intake.unmatched`: the grader stops on it). Anything else is reported as junk
and skipped. A student's notebook is `<assignment>.ipynb`, or the only
notebook they handed in under another name (LMS downloads rename files). Archives are unpacked with caps on
size and file count and refuse paths that leave their folder or name one file twice. Every hand-in is copied here into the grader's
scratch folder (autograder.base.spool), its sha256 taken on the way and checked whenever it is read, so what gets graded
is what was handed in, even if a submission graded earlier rewrites files on disk, and a class of large hand-ins
is never held in memory at once.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from autograder.base.notebook_limits import MAX_CELLS, MAX_OUTPUTS
from autograder.base.shown import name as shown  # noqa: F401 (also intake.shown, for callers)
from autograder.base.spool import Spool, TooLarge
from autograder.intake import lmsnames
from autograder.intake.lmsnames import safe_id  # noqa: F401 (also intake.safe_id, for callers)
from autograder.sandbox.limits import MAX_JSON_VALUES, json_values
from labkit.env import LabkitError

# The default --lms-regex: it stands for "each LMS's own documented pattern" (autograder.intake.lmsnames); another
# regular expression given replaces them.
LMS_REGEX = r"^(?P<student_id>[A-Za-z0-9.\-]+)_(?P<file>.+)$"
MAX_NOTEBOOK_BYTES = 50 * 2**20  # a notebook larger than this is refused (outputs committed by mistake)
MAX_HANDIN_BYTES = 200 * 2**20  # all files of one hand-in together
MAX_ARCHIVE_BYTES = 500 * 2**20  # total unpacked size of one archive
MAX_ARCHIVE_FILES = 2000  # files in one archive
_SKIP = {".ipynb_checkpoints", "__pycache__", "__MACOSX", ".DS_Store"}


@dataclass
class Submission:
    """One student's hand-in, ready to be copied into a scratch course."""

    student_id: str  # id used in grades.csv and nbgrader's gradebook
    notebook: str | None = None  # key in `files` of the notebook to grade, None when there is none
    files: Spool | dict[str, bytes] = field(default_factory=dict)  # name in the assignment folder -> content ({}: none)
    problem: str | None = None  # why it cannot be graded (then it scores 0 with this cause)
    cause: str | None = None  # short category of `problem`, for the summary
    notes: list[str] = field(default_factory=list)  # things worth telling the instructor, not fatal
    flags: list[str] = field(default_factory=list)  # for the instructor to look at before the grade counts
    digest: str = ""  # sha256 of every file's name and bytes: a changed hand-in is graded again
    origin: str = ""  # the folder or file names under the submissions folder this hand-in came from

    def compute_digest(self) -> str:
        """sha256 of every file's name and bytes (Spool.digest): a changed hand-in is graded again."""
        self.digest = self.files.digest()
        return self.digest


@dataclass
class Intake:
    """Everything found under a submissions folder."""

    submissions: list[Submission]
    junk: list[str]  # one line per skipped thing
    unmatched: list[str] = field(default_factory=list)  # hand-ins whose name gives no single student id, and why


def extract_zip(archive: Path, dest: Path) -> list[str]:
    """Unpack `archive` into `dest` with size, count and path checks; returns problems found (empty if fine)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = [i for i in zf.infolist() if not i.is_dir()]
            if len(infos) > MAX_ARCHIVE_FILES:
                return [f"{archive.name}: {len(infos)} files (limit {MAX_ARCHIVE_FILES})"]
            if sum(i.file_size for i in infos) > MAX_ARCHIVE_BYTES:
                return [f"{archive.name}: unpacks to more than {MAX_ARCHIVE_BYTES // 2**20} MiB"]
            dest.mkdir(parents=True, exist_ok=True)
            root = dest.resolve()
            seen: set[Path] = set()
            for info in infos:
                target = (dest / info.filename).resolve()
                if root not in target.parents:
                    return [f"{archive.name}: entry {info.filename!r} points outside the archive"]
                if target in seen:  # which copy is graded must not depend on the unpacker: refuse both
                    return [f"{archive.name}: two entries unpack to {target.relative_to(root).as_posix()!r}; "
                            "hand in an archive holding each file once"]
                seen.add(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError) as e:
        return [f"{archive.name}: not a readable zip archive ({type(e).__name__}: {e})"]
    return []


def _validate(raw: dict) -> None:
    """Validate the parsed notebook `raw` (nbformat 4) by fastjsonschema alone, in place; nbformat.ValidationError.

    nbformat.validate words a failure again with jsonschema, whose check that a cell's tags are distinct compares
    every pair when they cannot be sorted: 12,000 tags of mixed types (92 KB) held intake, in the grader's process,
    for 107 s. fastjsonschema's verdict takes milliseconds, with a plainer message naming the place. The parsed
    JSON itself is validated: nbformat's own copy of it (NotebookNode) would double what a hand-in costs."""
    from nbformat.validator import _normalize, get_validator

    if raw.get("nbformat") != 4:
        raise nbformat.ValidationError(f"nbformat {str(raw.get('nbformat'))[:20]}: only nbformat 4 notebooks are read")
    minor = raw.get("nbformat_minor", 0)
    with warnings.catch_warnings():  # missing or repeated cell ids are given new ones, as nbformat.reads does
        warnings.simplefilter("ignore")
        _normalize(raw, 4, minor if isinstance(minor, int) else 0, True, False, False)
    check = get_validator(4, minor if isinstance(minor, int) else None, name="fastjsonschema")
    error = next(iter(check.iter_errors(raw)), None) if check else None
    if error is not None:
        raise nbformat.ValidationError(error.message)


def check_notebook(data: bytes, name: str) -> str | None:
    """None if `data` is a readable Jupyter notebook, else one line (naming file `name`) saying what is wrong."""
    if len(data) > MAX_NOTEBOOK_BYTES:
        return f"{name} is {len(data) / 2**20:.0f} MiB (limit {MAX_NOTEBOOK_BYTES // 2**20} MiB): clear its outputs"
    # parsing and validating take memory per value, not per byte: bounded here, in the grader, before either runs
    if json_values(data) > MAX_JSON_VALUES:
        return f"{name} holds more than {MAX_JSON_VALUES:,} JSON values (commas and brackets): clear its outputs"
    try:
        raw = json.loads(data.decode("utf-8"))  # decoded and parsed once: a text can take 4 bytes a character
        if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list) or "nbformat" not in raw:
            return f"{name} is not a notebook: JSON without the notebook fields (cells, nbformat)"
        if len(raw["cells"]) > MAX_CELLS:  # validation's time and memory grow with the cells it rejects
            return f"{name} has {len(raw['cells']):,} cells (limit {MAX_CELLS:,})"
        outputs = sum(len(c.get("outputs") or ()) for c in raw["cells"] if isinstance(c, dict))
        if outputs > MAX_OUTPUTS:
            return f"{name} has {outputs:,} outputs (limit {MAX_OUTPUTS:,}): clear its outputs"
        _validate(raw)
    except json.JSONDecodeError as e:
        return f"{name} is not a notebook: invalid JSON ({e.msg} at line {e.lineno})"
    except UnicodeDecodeError:
        return f"{name} is not a notebook: not UTF-8 text"
    except nbformat.ValidationError as e:
        return f"{name} is not a valid notebook: {str(e.message)[:200]}"
    except Exception as e:  # nbformat raises several types for broken files; all mean the same here
        return f"{name} is not a valid notebook: {type(e).__name__}: {str(e)[:200]}"
    if not any(c.get("cell_type") == "code" for c in raw["cells"]):
        return f"{name} has no code cells"
    return None


def _collect_folder(sid: str, folder: Path, assignment: str, spool: Spool) -> Submission:
    sub = Submission(student_id=sid, files=spool)
    base = folder / assignment if (folder / assignment).is_dir() else folder
    if base != folder:
        stray = [p.name for p in folder.iterdir() if p.name != assignment and p.name not in _SKIP]
        if stray:
            sub.notes.append(f"ignored files beside the {assignment}/ folder: "
                             f"{', '.join(shown(n) for n in sorted(stray)[:5])}")
    paths = {}
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base)
        if p.is_file() and not p.is_symlink() and not any(part in _SKIP or part.startswith(".") for part in rel.parts):
            paths[rel.as_posix()] = p
    _read(sub, paths)
    if not sub.problem:
        _pick_notebook(sub, assignment)
    return sub


def _read(sub: Submission, paths: dict[str, Path]) -> None:
    total = 0
    for name, p in paths.items():
        try:
            total += sub.files.store(name, p, MAX_HANDIN_BYTES - total)
        except TooLarge:
            sub.problem = f"hand-in is larger than {MAX_HANDIN_BYTES // 2**20} MiB"
            sub.cause = "hand-in too large"
            sub.files.clear()
            return
        except OSError as e:
            sub.notes.append(f"could not read {shown(name)}: {e.strerror}")


def _pick_notebook(sub: Submission, assignment: str) -> None:
    want = f"{assignment}.ipynb"
    if want in sub.files:
        sub.notebook = want
    else:
        nbs = [n for n in sub.files if n.endswith(".ipynb")]
        top = [n for n in nbs if "/" not in n]
        if len(top) == 1:
            sub.notes.append(f"graded {top[0]!r} as {want} (the only notebook handed in)")
            sub.files.rename(top[0], want)
            sub.notebook = want
        elif not nbs:
            sub.problem, sub.cause = f"no notebook handed in (expected {want})", "no notebook"
            return
        else:
            sub.problem = f"several notebooks and none named {want}: {', '.join(shown(n) for n in sorted(nbs)[:5])}"
            sub.cause = "no notebook"
            return
    bad = check_notebook(sub.files[sub.notebook], sub.notebook)
    if bad:
        sub.problem, sub.cause = bad, "invalid notebook"


def collect(submissions: str | Path, assignment: str, *, scratch: Path, lms_regex: str = LMS_REGEX,
            roster=None) -> Intake:
    """Find every student's hand-in under `submissions` (a folder or a .zip). `scratch` receives unpacked archives,
    removed again here, and the hand-ins' files (scratch/spool), which the Submissions read from while they are used.
    `roster`: the class list (a path or an lmsnames.Roster) every hand-in is matched to; None: ids from the names
    alone, where an id that may hold a separator is reported in `unmatched`, not cut.

    Raises LabkitError only when `submissions` itself is unusable; anything wrong with one student is recorded
    on that student's Submission.
    """
    src = Path(submissions)
    if not src.exists():
        raise LabkitError(f"submissions folder {src} does not exist: pass the folder (or .zip) you downloaded "
                          "with --submissions")
    try:
        rx = re.compile(lms_regex)
    except re.error as e:
        raise LabkitError(f"--lms-regex {lms_regex!r} is not a regular expression: {e}") from e
    if "student_id" not in rx.groupindex:
        raise LabkitError("--lms-regex needs a named group (?P<student_id>...)")
    roster = lmsnames.load_roster(roster)
    custom = None if lms_regex == LMS_REGEX else lms_regex
    junk: list[str] = []
    unmatched: list[str] = []
    unpacked = None
    if src.is_file():
        if src.suffix.lower() != ".zip":
            raise LabkitError(f"{src} is a file but not a .zip archive: pass a folder or a .zip of submissions")
        unpacked = scratch / "_archive"
        shutil.rmtree(unpacked, ignore_errors=True)
        problems = extract_zip(src, unpacked)
        if problems:
            raise LabkitError(f"cannot unpack {src}: {problems[0]}")
        entries = [p for p in unpacked.iterdir() if p.name not in _SKIP]
        # An archive holding one folder (e.g. "submissions/") is that folder.
        src = entries[0] if len(entries) == 1 and entries[0].is_dir() and not _looks_like_student(entries[0], assignment) else unpacked
    if not src.is_dir():
        raise LabkitError(f"{src} is not a folder")

    spools = scratch / "spool"
    shutil.rmtree(spools, ignore_errors=True)  # what an earlier run left
    count = itertools.count(1)

    def spool() -> Spool:
        return Spool(spools / str(next(count)))

    by_id: dict[str, Submission] = {}
    lms_files: dict[str, list[tuple[str, Path]]] = {}
    meta = lmsnames.gradescope_metadata(src)

    def unread(problem: str) -> None:
        unmatched.append(problem)
        junk.append(f"NOT GRADED: {problem}")

    for entry in sorted(src.iterdir()):
        if entry.name in _SKIP or entry.name.startswith(".") or (meta and entry.name == lmsnames.GRADESCOPE_META):
            continue
        if entry.is_dir():
            got = lmsnames.read_gradescope(entry.name, meta, roster) or lmsnames.read_folder(entry.name, roster)
            if got.problem:
                unread(got.problem)
                continue
            sid = got.student_id
            sub = _collect_folder(sid, entry, assignment, spool())
            sub.origin = entry.name
            if sid != entry.name:
                sub.notes.append(f"folder {shown(entry.name)!r} graded as student id {sid!r}")
            _add(by_id, sub, junk)
            continue
        suffix = entry.suffix.lower()
        got = lmsnames.read_name(entry.name, assignment, roster, custom) if suffix in (".ipynb", ".zip", ".py") \
            else None
        if got is None:
            junk.append(f"skipped {shown(entry.name)}: not a student folder, and not an LMS-named .ipynb/.zip/.py file")
            continue
        if got.problem:
            unread(got.problem)
            continue
        sid, name = got.student_id, got.file or entry.name
        if suffix == ".zip":
            dest = scratch / "_unzipped" / sid / entry.stem
            shutil.rmtree(dest, ignore_errors=True)
            problems = extract_zip(entry, dest)
            if problems:
                _add(by_id, Submission(sid, problem=problems[0], cause="bad archive", origin=entry.name), junk)
                continue
            inner = [p for p in dest.iterdir() if p.name not in _SKIP]
            folder = inner[0] if len(inner) == 1 and inner[0].is_dir() else dest
            sub = _collect_folder(sid, folder, assignment, spool())
            sub.origin = entry.name
            shutil.rmtree(dest, ignore_errors=True)  # copied into the spool: the unpacked files are not read again
            _add(by_id, sub, junk)
        else:
            lms_files.setdefault(sid, []).append((name, entry))
    for sid, files in lms_files.items():
        sub = Submission(sid, files=spool(), origin=" and ".join(sorted(p.name for _, p in files)))
        _read(sub, dict(files))
        if not sub.problem:
            _pick_notebook(sub, assignment)
        _add(by_id, sub, junk)
    if unpacked is not None:
        shutil.rmtree(unpacked, ignore_errors=True)  # every hand-in in it is spooled by now
    subs = sorted(by_id.values(), key=lambda s: s.student_id)
    for s in subs:
        if s.files:
            s.compute_digest()
    return Intake(subs, junk, unmatched)


def _looks_like_student(folder: Path, assignment: str) -> bool:
    return (folder / f"{assignment}.ipynb").exists() or (folder / assignment).is_dir()


def _add(by_id: dict[str, Submission], sub: Submission, junk: list[str]) -> None:
    """Record a hand-in; two that map to one id are an error naming both (a folder like '-n07_alice' must not
    shadow 'n07_alice'), so that student is not graded until the instructor says which one is theirs."""
    old = by_id.get(sub.student_id)
    if old is None:
        by_id[sub.student_id] = sub
        return
    names = [n for n in (old.origin or "?").split(" + ") + [sub.origin or "?"]]
    msg = (f"{len(names)} hand-ins map to student id {sub.student_id!r}: {', '.join(repr(n) for n in names)}; "
           "keep the student's own one in the submissions folder and grade again")
    junk.append(f"{sub.student_id}: {msg}")
    for s in (old, sub):  # neither is graded: their spooled copies go now
        s.files.clear()
    by_id[sub.student_id] = Submission(sub.student_id, problem=msg, cause="ambiguous hand-in",
                                       origin=" + ".join(names))

"""The adversarial submission suite: hand-ins built from an assignment's source and release notebooks.

Each variant is one thing a real class produces (the reference, the untouched release, wrong-but-fast,
slow-but-correct, edited or deleted tests, patched timers, caching, infinite loops, kernel crashes, memory
hogs, output floods, stderr noise, hidden-test snooping, vandalism, broken files) together with the score it
deserves, so a grading run over the suite checks the grader, the assignment and the harness at once.
Assignment-specific variants need solution bodies (`bodies`: wrong_fast, slow_correct, cache, timer_patch,
each the text after the `%%writefile` line); variants whose body is missing are left out.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from autograder.checks.trusted import find_calls


@dataclass
class Expect:
    """The score a variant deserves, and how its grading should read."""

    correct: bool | None  # correctness test cells pass (None: not checked)
    speed: bool | None  # speed test cells pass (None: not checked)
    status: str = "graded"  # "graded" or "not graded"
    causes: tuple = (None,)  # acceptable values of StudentResult.cause ("*": any)
    flagged: bool = False  # the result must carry a flag for the instructor
    note: str | None = None  # a substring the notes must contain


@dataclass
class Variant:
    """One fixture hand-in."""

    name: str  # also the student id
    what: str  # the behaviour it stands for
    files: dict[str, bytes]  # the student's folder: file name -> content
    expect: Expect
    extra: dict = field(default_factory=dict)


def _code_cell(src: str) -> dict:
    return {"cell_type": "code", "id": os.urandom(4).hex(), "metadata": {}, "source": src, "outputs": [],
            "execution_count": None}


def _nbg(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _is_test(cell) -> bool:
    return bool(_nbg(cell).get("grade")) and not _nbg(cell).get("solution") and cell["cell_type"] == "code"


SPEED_CHECK = re.compile(r"speed|wait")  # check names that measure time rather than answers
_MARK = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$\n?", re.M)


def _writefile(src: str) -> tuple[str | None, str]:
    first, _, rest = src.partition("\n")
    m = re.match(r"^%%writefile\s+(?:-a\s+)?(\S+)", first.strip())
    return (m.group(1), rest) if m else (None, src)


class SuiteBuilder:
    """Builds variant notebooks from the source (solutions, hidden tests) and release notebooks."""

    def __init__(self, source_nb: Path, release_nb: Path, assignment: str, bodies: dict[str, str] | None = None):
        self.assignment = assignment
        self.source = json.loads(Path(source_nb).read_text())
        self.release = json.loads(Path(release_nb).read_text())
        self.bodies = dict(bodies or {})
        by_id = {_nbg(c).get("grade_id"): c for c in self.source["cells"] if _nbg(c).get("grade_id")}
        self.reference = {gid: _MARK.sub("", "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
                          for gid, c in by_id.items() if _nbg(c).get("solution")}
        self.target = None  # (grade_id, file) of the %%writefile solution cell the speed checks measure
        for gid, src in self.reference.items():
            fname, _ = _writefile(src)
            if fname:
                self.target = (gid, fname)
                break
        self.calls = find_calls(Path(source_nb))
        # Speed cells are those whose checks time something; the other test cells check correctness.
        self.speed_cells = {c.cell for c in self.calls if SPEED_CHECK.search(c.check)}
        self.harness_modules = sorted(set(re.findall(r"from\s+([\w.]+)\s+import\s+[^\n]*\b(?:run_check|grade)\b",
                                                     "\n".join(_src(c) for c in self.source["cells"]))))

    # -------------------------------------------------------------------------------------------- building

    def notebook(self, body: str | None = None, *, reference: bool = True, before_tests: str | None = None,
                 tests: str = "keep") -> dict:
        """The release with solutions filled in (reference, or `body` for the measured file), optionally an
        extra cell before the first test cell, and test cells kept, edited ("edit") or deleted ("delete")."""
        nb = copy.deepcopy(self.release)
        for cell in nb["cells"]:
            gid = _nbg(cell).get("grade_id")
            if not _nbg(cell).get("solution") or gid not in self.reference:
                continue
            if body is not None and self.target and gid == self.target[0]:
                cell["source"] = f"%%writefile {self.target[1]}\n{body}"
            elif reference:
                cell["source"] = self.reference[gid]
        if before_tests is not None:
            at = next((i for i, c in enumerate(nb["cells"]) if _is_test(c)), len(nb["cells"]))
            nb["cells"].insert(at, _code_cell(before_tests))
        if tests == "edit":
            for c in nb["cells"]:
                if _is_test(c):
                    c["source"] = "pass  # the tests were in the way\n"
        elif tests == "delete":
            nb["cells"] = [c for c in nb["cells"] if not _is_test(c)]
        return nb

    def _files(self, nb: dict, name: str | None = None) -> dict[str, bytes]:
        return {name or f"{self.assignment}.ipynb": json.dumps(nb, indent=1).encode()}

    def variants(self, *, address_space_limit: bool = False, release_expect: Expect | None = None,
                 flood_lines: int = 100_000, vandal_root: Path | None = None,
                 canary: Path | None = None) -> list[Variant]:
        """Every variant this assignment supports, with the score each deserves.

        `vandal_root` (a folder you own holding the course, hand-ins and output) adds a submission that
        overwrites every result, gradebook, notebook and feedback page in it; without it there is none.
        `canary` (a file outside the class that only the grader should see) adds the attacks of a hostile
        class (see `_attacks`): they try to read and rewrite it, among much else.
        """
        b, full, v = self.bodies, Expect(True, True), []
        slow = b.get("slow_correct")
        rel = release_expect or Expect(False, False)

        def add(name, what, files, expect, **extra):
            v.append(Variant(name, what, files, expect, extra))

        add("reference", "the reference solution", self._files(self.notebook()), full)
        add("renamed", "the reference, handed in under an LMS-mangled file name",
            self._files(self.notebook(), "Lab submission (1).ipynb"), Expect(True, True, note="graded"))
        add("release", "the release, untouched", self._files(copy.deepcopy(self.release)), rel)
        if b.get("wrong_fast"):
            add("wrong_fast", "a wrong but fast solution", self._files(self.notebook(b["wrong_fast"])),
                Expect(False, False))
            add("tests_edited", "wrong solution, test cells replaced by `pass`",
                self._files(self.notebook(b["wrong_fast"], tests="edit")), Expect(False, False))
        if slow:
            add("slow_correct", "a correct but slow solution", self._files(self.notebook(slow)), Expect(True, False))
            add("tests_deleted", "slow solution, test cells deleted (the grader restores them)",
                self._files(self.notebook(slow, tests="delete")), Expect(True, False))
            add("patch_kernel", "slow solution plus a cell that patches timers, CUDA events and run_check",
                self._files(self.notebook(slow, before_tests=self._patch_cell())), Expect(True, False))
        if b.get("timer_patch"):
            add("patch_in_file", "slow solution whose file replaces time.perf_counter when imported",
                self._files(self.notebook(b["timer_patch"])), Expect(True, False))
        if b.get("cache"):
            add("cache", "slow solution that remembers answers between calls", self._files(self.notebook(b["cache"])),
                Expect(True, False))
        add("infinite_loop", "the reference plus a cell that never ends (interrupted by the cell time limit)",
            self._files(self.notebook(before_tests="import time\nwhile True:\n    time.sleep(0.5)\n")),
            Expect(True, True, note="time limit"))
        add("deaf_loop", "an endless cell that ignores interrupts",
            self._files(self.notebook(before_tests="import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                                   "while True:\n    time.sleep(0.5)\n")),
            Expect(None, None, status="not graded", causes=("kernel unresponsive", "timeout")))
        add("kernel_crash", "the reference plus a cell calling os._exit",
            self._files(self.notebook(before_tests="import os\nos._exit(3)\n")),
            Expect(None, None, status="not graded", causes=("kernel died",)))
        hog = "def _eat():\n    held = []\n    while True:\n        held.append(bytearray(1 << 27))\n\n_eat()\n"
        add("memory_hog", "the reference plus a cell that allocates until something stops it",
            self._files(self.notebook(before_tests=hog)),
            Expect(True, True, note="memory") if address_space_limit
            else Expect(None, None, status="not graded", causes=("memory",)))
        add("output_flood", "the reference plus a cell printing a flood of lines",
            self._files(self.notebook(before_tests=f"for i in range({flood_lines}):\n    print('spam ' * 20, i)\n")),
            full)
        noise = ("import sys, warnings\nsys.stderr.write('loading the pipeline...\\n')\n"
                 "warnings.warn('this is deprecated')\n")
        if self.target:
            ref_body = _writefile(self.reference[self.target[0]])[1]
            add("stderr_noise", "the reference writing to stderr and warning in its module and in a cell",
                self._files(self.notebook(noise + ref_body, before_tests=noise)), full)
        add("snoop", "the release plus a cell that looks for the solutions and hidden tests on disk",
            self._files(self.notebook(reference=False, before_tests=self._snoop_cell())), rel)
        if vandal_root is not None:
            add("vandal", "the reference plus a cell that overwrites every gradebook, result, notebook and "
                "feedback file under the class folder", self._files(self.notebook(
                    before_tests=_VANDAL.replace("@ROOT@", repr(str(vandal_root))))), full)
        self._attacks(add, rel, canary, vandal_root)
        self._self_graded(add)
        add("malformed", "a notebook file that is not JSON", {f"{self.assignment}.ipynb": b'{"cells": [ oops'},
            Expect(None, None, status="not graded", causes=("invalid notebook",)))
        add("no_notebook", "a folder with no notebook in it", {"README.txt": b"I could not get it to work"},
            Expect(None, None, status="not graded", causes=("no notebook",)))
        return v

    def _self_graded(self, add) -> None:
        """Written answers graded by their own author: points written into the gradebook from a cell, or the
        answer cell's metadata turned into a passing test. Either way they stay pending for a person."""
        written = [c for c in self.release["cells"] if _nbg(c).get("grade") and _nbg(c).get("solution")
                   and c["cell_type"] == "markdown"]
        if not written:
            return
        add("self_graded_gradebook", "the reference plus a cell that writes full manual scores into every "
            "gradebook it can reach", self._files(self.notebook(before_tests=_SELF_GRADE)),
            Expect(True, True, flagged=True))
        nb = self.notebook()
        for c in nb["cells"]:
            if _nbg(c).get("grade_id") in {_nbg(w)["grade_id"] for w in written}:
                # a code cell's last value is its score in nbgrader: a written answer that "scores" itself
                c.update(cell_type="code", source="100.0\n", outputs=[], execution_count=None)
                c["metadata"]["nbgrader"].update(points=100, locked=True)
        add("self_graded_metadata", "the reference with each written answer turned into a code cell worth 100 "
            "points that returns its own score", self._files(nb), Expect(True, True))
        nb = self.notebook(before_tests=_SCRIPT_OUTPUT)
        for c in nb["cells"]:
            if _nbg(c).get("grade_id") in {_nbg(w)["grade_id"] for w in written}:
                c["source"] = _SCRIPT_ANSWER
        add("script_in_answer", "the reference with script in its written answer and in a cell's HTML output: "
            "the feedback page an instructor opens must run none of it", self._files(nb), Expect(True, True))

    def _attacks(self, add, rel: Expect, canary: Path | None, root: Path | None) -> None:
        """A hostile class: forge verdicts, reach the checks and the course, signal or outlive the grader."""
        if canary is None or root is None:
            return
        slow, target = self.bodies.get("slow_correct"), self.target[1] if self.target else "pipeline.py"
        ref = _writefile(self.reference[self.target[0]])[1] if self.target else ""
        paths = {"@CANARY@": repr(str(canary)), "@ROOT@": repr(str(root)), "@REPO@": repr(str(_REPO))}

        def fill(code: str) -> str:
            for k, v in paths.items():
                code = code.replace(k, v)
            return code

        add("forge_verdict", "the release plus a cell that prints passing verdicts in every format the grader "
            "has used and writes a perfect result.json wherever it can", self._files(self.notebook(
                reference=False, before_tests=fill(_FORGE))), rel)
        add("reach_files", "the release plus a cell that reads the checks, the course and a file only the grader "
            "may read, and rewrites what it can", self._files(self.notebook(
                reference=False, before_tests=fill(_REACH))), rel)
        add("kill_all", "the reference plus a cell that SIGKILLs every process it can see, its own grader first",
            self._files(self.notebook(before_tests=_KILL_ALL)),
            Expect(None, None, status="not graded", causes=("*",)))
        add("daemon", "the reference plus a cell that leaves a detached daemon behind to rewrite the grades later",
            self._files(self.notebook(before_tests=fill(_DAEMON))), Expect(True, True))
        add("fork_flood", "the reference plus a cell that starts processes until something stops it",
            self._files(self.notebook(before_tests=_FORK_FLOOD)),
            Expect(None, None, status="not graded", causes=("processes", "memory", "kernel died", "timeout")))
        # Run the class with a disk cap under 1 GiB (GradeConfig.disk_gb): these write up to 1 GiB each.
        add("disk_fill", "the reference plus a cell that writes one file until something stops it",
            self._files(self.notebook(before_tests=_DISK_FILL)), Expect(None, None, status="not graded",
                                                                        causes=("disk",)))
        add("disk_hidden", "the reference plus a cell that writes files it has deleted, which no folder listing "
            "shows, and holds them open", self._files(self.notebook(before_tests=_DISK_HIDDEN)),
            Expect(None, None, status="not graded", causes=("disk",)))
        if slow:
            steal = ("try:\n    from autograder.rehearsal import REFERENCE as _R\n    exec(_R)\nexcept Exception:\n"
                     "    pass\n")
            add("import_reference", "slow solution whose file imports the grader's reference and answer key",
                self._files(self.notebook(slow + "\n" + steal + _IMPORT_TRUSTED)), Expect(True, False))
            add("spinner", "slow solution whose import starts detached processes that spin while the baseline is "
                "timed", self._files(self.notebook(slow + "\n" + _SPINNER)), Expect(True, False))
            add("disk_checks", "slow solution whose import, in the checks' process only, writes a file until "
                "something stops it and carries on", self._files(self.notebook(slow + "\n" + _DISK_CHECKS)),
                Expect(False, False))
            add("in_kernel", "slow solution whose import starts a process that works inside long system calls, "
                "where a stop signal waits for it, while the baseline is timed",
                self._files(self.notebook(slow + "\n" + _IN_KERNEL)), Expect(True, False))
            for tag in ("a", "b"):  # two of them: whichever is graded second would find the first one's plant
                add(f"cache_share_{tag}", "slow solution that plants the fast answer in its compile caches and "
                    "runs any answer another student planted there", self._files(self.notebook(
                        slow + "\n" + _CACHE_TAKE.replace("@TAG@", tag), before_tests=_cache_plant(tag, ref))),
                    Expect(True, False))
        _ = target

    def _patch_cell(self) -> str:
        mods = self.harness_modules or ["autograder.harness"]
        return (
            "import time, importlib\n_real = time.perf_counter\n"
            "time.perf_counter = lambda: _real() / 1000.0\ntime.monotonic = lambda: _real() / 1000.0\n"
            "try:\n    import torch\n    torch.cuda.synchronize = lambda *a, **k: None\n"
            "    class _Event:\n        def __init__(self, *a, **k): pass\n        def record(self, *a, **k): pass\n"
            "        def synchronize(self): pass\n        def elapsed_time(self, other): return 0.001\n"
            "    torch.cuda.Event = _Event\nexcept ImportError:\n    pass\n"
            f"for _m in {mods!r}:\n    try:\n        _mod = importlib.import_module(_m)\n"
            "    except ImportError:\n        continue\n"
            "    _ok = {'passed': True, 'ok': True, 'gradable': True, 'score': 1.0, 'max_score': 1.0,\n"
            "           'message': 'blazing', 'ratio': 99.0}\n"
            "    _mod.run_check = lambda *a, **k: dict(_ok)\n"
            "    _mod.run_checks = lambda names, *a, **k: [dict(_ok, check=n) for n in names]\n"
            "    _mod.grade = lambda check, student_file, points=1, **k: points\n"
        )

    def _snoop_cell(self) -> str:
        target = self.target[1] if self.target else "pipeline.py"
        return _SNOOP.replace("@TARGET@", target)


def _src(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


# Looks where nbgrader usually keeps things: the notebook beside the kernel, the gradebook three folders up,
# `source/` beside `autograded/` in any parent, and where the grader spools the class's hand-ins
# (`intake/spool/` in its work folder). Steals the reference solution if it finds one.
_SNOOP = r'''
import glob, json, os, re, sqlite3
found, p = [], os.path.abspath(".")
for _ in range(8):
    for path in glob.glob(os.path.join(p, "*.ipynb")) + glob.glob(os.path.join(p, "source", "*", "*.ipynb")):
        try:
            cells = json.load(open(path))["cells"]
        except (OSError, ValueError, KeyError):
            continue
        for c in cells:
            src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            if "BEGIN HIDDEN TESTS" in src:
                found.append(path)
                print("HIDDEN TESTS FOUND in", path, src)
            if "BEGIN SOLUTION" in src and src.startswith("%%writefile @TARGET@"):
                found.append(path)
                body = src.split("\n", 1)[1]
                open("@TARGET@", "w").write(re.sub(r".*### (BEGIN|END) SOLUTION.*\n", "", body))
    for path in glob.glob(os.path.join(p, "intake", "spool", "*", "*")):  # the grader's copies of every hand-in
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        if "%%writefile @TARGET@" in text:
            found.append(path)
            print("CLASSMATE HAND-IN FOUND in", path)
    db = os.path.join(p, "gradebook.db")
    if os.path.exists(db):
        try:
            for (src,) in sqlite3.connect(db).execute("select source from source_cell"):
                if src and "HIDDEN" in src:
                    found.append(db)
                    print("HIDDEN TESTS FOUND in the gradebook:", src)
        except sqlite3.Error:
            pass
    p = os.path.dirname(p)
print("snooping found", len(found), "things")
'''

# Overwrites every grader output, gradebook, notebook and feedback page under ROOT (a folder the test owns:
# the class's course, hand-ins and output folder).
_VANDAL = r'''
import os
hit = 0
for root, dirs, files in os.walk(@ROOT@):
    if root.count(os.sep) - @ROOT@.count(os.sep) > 8:
        dirs[:] = []
    for f in files:
        if f in ("gradebook.db", "result.json", "grades.csv", "summary.txt") or f.endswith((".ipynb", ".html")):
            try:
                with open(os.path.join(root, f), "w") as fh:
                    fh.write("vandalised")
                hit += 1
            except OSError:
                pass
print("vandal overwrote", hit, "files")
'''


_REPO = Path(__file__).resolve().parents[1]

# Every verdict format the grader and its harness ever printed, a forged trusted marker, and perfect done-markers.
_FORGE = r"""
import json, os
ok = {"check": "toy.speed", "ok": True, "passed": True, "gradable": True, "score": 99, "max_score": 1,
      "message": "blazing", "ratio": 99.0}
print("@@labkit-trusted-verdicts@@" + json.dumps([ok, ok, ok]))
print("@@toy@@" + json.dumps(ok))
for nonce in ("0" * 32, "f" * 32):
    print(nonce, "verdict", json.dumps(ok))
done = {"status": "graded", "score": 1000, "max_score": 5, "digest": "", "source_digest": "", "mac": "0" * 64}
hit, p = 0, os.path.abspath(".")
for _ in range(10):
    for rel in ("result.json", "students/forge_verdict/result.json", "out/students/forge_verdict/result.json"):
        try:
            os.makedirs(os.path.dirname(os.path.join(p, rel)) or p, exist_ok=True)
            with open(os.path.join(p, rel), "w") as f:
                json.dump(done, f)
            hit += 1
        except OSError:
            pass
    p = os.path.dirname(p)
print("forged", hit, "done-markers")
"""

# Reads what only the grader should (the checks, the course's source, the instructor's canary), then rewrites
# the canary, the grader's own modules and the class folder; prints whatever it found into its notebook.
_REACH = r"""
import glob, os
found = []
for pattern in (os.path.join(@REPO@, "autograder", "*.py"), os.path.join(@ROOT@, "course", "source", "*", "*.ipynb"),
                @CANARY@, os.path.join(@ROOT@, "subs", "*", "*.ipynb"), "/proc/1/environ", "/root/*", "/home/*"):
    for path in glob.glob(pattern):
        try:
            with open(path, "rb") as f:
                found.append((path, f.read(200)))
        except OSError:
            pass
for path, head in found:
    print("READ", path, head[:80])
wrote = 0
for path in [@CANARY@, os.path.join(@REPO@, "autograder", "rehearsal.py"), os.path.join(@REPO@, "autograder", "harness.py"),
             os.path.join(@REPO@, "autograder", "checks", "harness.py"),
             *glob.glob(os.path.join(@ROOT@, "subs", "*", "*.ipynb"))]:
    try:
        with open(path, "a") as f:
            f.write("\n# tampered\n")
        wrote += 1
    except OSError:
        pass
print("reach found", len(found), "files and rewrote", wrote)
"""

# Kills every process it can see: in the sandbox that is its own nbgrader and kernel, never the grader.
_KILL_ALL = r"""
import os, signal
me = os.getpid()
pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != me]
for pid in [os.getppid()] + pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""

# A double-forked daemon in its own session, without the grader's variables, that waits for the run to end
# and then rewrites the grades and the canary.
_DAEMON = r"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for k in list(os.environ):
            os.environ.pop(k, None)
        time.sleep(25)
        for path in [os.path.join(@ROOT@, "out", "grades.csv"), @CANARY@]:
            try:
                with open(path, "w") as f:
                    f.write("daemon was here")
            except OSError:
                pass
        os._exit(0)
    os._exit(0)
os.wait()
print("daemon started")
"""

_FORK_FLOOD = r"""
import os, time
kids = 0
for _ in range(3000):
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    kids += 1
print("started", kids)
"""

# Writes 1 GiB into one file in the scratch folder, 8 MiB at a time; Python ignores SIGXFSZ, so a write past the
# file-size limit fails (EFBIG) and the cell errs.
_DISK_FILL = r"""
chunk = b"\0" * (8 << 20)
with open("fill.bin", "wb") as f:
    for _ in range(128):
        f.write(chunk)
        f.flush()
"""

# 512 MiB in eight files deleted as soon as they are opened: only the open descriptors show them.
_DISK_HIDDEN = r"""
import os, time
held = []
for i in range(8):
    f = open(f"hidden{i}.bin", "wb")
    os.unlink(f"hidden{i}.bin")
    f.write(b"\0" * (64 << 20))
    f.flush()
    held.append(f)
time.sleep(60)
"""

# Outside the notebook's kernel (in the checks' process), writes 1 GiB beside the module, swallows the error at the
# limit and carries on; waits for the watch to look, as a long import would.
_DISK_CHECKS = r"""
import sys as _sys
if "ipykernel" not in _sys.modules:
    import time as _time
    try:
        with open("fill.bin", "wb") as _f:
            for _ in range(128):
                _f.write(b"\0" * (8 << 20))
    except OSError:
        pass
    _time.sleep(3)
"""

# Imports the grader's trusted modules at import time (in the sandbox they do not exist).
_IMPORT_TRUSTED = r"""
import importlib
for _m in ("autograder.rehearsal", "autograder.checks.lab1_checks", "autograder.checks.lab3_checks",
           "autograder.checks.harness", "autograder.harness"):
    try:
        _mod = importlib.import_module(_m)
        for _name in ("check_speed", "run_checks", "REQUIRED_RATIO", "ANSWER_KEY"):
            if hasattr(_mod, _name):
                setattr(_mod, _name, (lambda *a, **k: [{"ok": True, "passed": True}]) if _name != "REQUIRED_RATIO" else 0.0)
    except Exception:
        pass
"""

# A student's compile caches (the folder torch.compile and Triton write) are theirs alone: shared between their
# notebook and their runner, never with another student or the baseline. These plant an answer there and take
# any answer another student planted (their own is theirs to use).
_CACHE_ROOTS = "('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR')"
_CACHE_TAKE = r"""
import glob as _glob, os as _os
for _v in @ROOTS@:
    for _f in _glob.glob(_os.path.join(_os.environ.get(_v) or '/nonexistent', '**', 'answer-*.py'), recursive=True):
        if not _f.endswith('answer-@TAG@.py'):
            exec(open(_f).read())
""".replace("@ROOTS@", _CACHE_ROOTS)


def _cache_plant(tag: str, answer: str) -> str:
    return (f"import os\nfor _v in {_CACHE_ROOTS}:\n    _d = os.environ.get(_v)\n    if _d:\n"
            "        os.makedirs(_d, exist_ok=True)\n"
            f"        open(os.path.join(_d, 'answer-{tag}.py'), 'w').write({answer!r})\n")


# Detached processes that spin on the CPU from import on: they would slow a baseline timed beside them.
_SPINNER = r"""
import os
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
"""

# Each call faults in 256 MiB before it returns to the process, and SIGSTOP takes effect only on that return.
_IN_KERNEL = r"""
import mmap, os
if os.fork() == 0:
    os.setsid()
    _flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    while True:
        mmap.mmap(-1, 256 << 20, flags=_flags).close()
"""


# Markup that runs script when a page renders it as HTML: a tag, an event handler, a javascript: link.
_SCRIPT_MARKUP = ("<script>document.title = 'labkit-pwned'</script>"
                  "<img src='x' onerror=\"document.title = 'labkit-pwned'\">"
                  "<a href=\"javascript:document.title = 'labkit-pwned'\">my answer</a>")
_SCRIPT_ANSWER = "Because the loader was the bottleneck.\n\n" + _SCRIPT_MARKUP + "\n"
_SCRIPT_OUTPUT = ("from IPython.display import HTML, Javascript, display\n"
                  f"display(HTML({_SCRIPT_MARKUP!r}))\n"
                  "display(Javascript(\"document.title = 'labkit-pwned'\"))\n")

# A written answer graded by the student: nbgrader keeps a manual score it finds in the gradebook.
_SELF_GRADE = """import glob, os, sqlite3
_hits = []
for _p in sorted({os.path.abspath(p) for d in ('..', '../..', '../../..', '../../../..')
                  for p in glob.glob(os.path.join(d, 'gradebook.db'))}):
    try:
        _c = sqlite3.connect(_p, timeout=5)
        _c.execute('UPDATE grade SET manual_score = 100, auto_score = 100, needs_manual_grade = 0')
        _c.commit()
        _c.close()
        _hits.append(_p)
    except Exception as _e:
        print('could not write', _p, type(_e).__name__)
print('self-graded in', _hits)
"""


def write_submissions(variants: list[Variant], dest: Path) -> Path:
    """One folder per variant (named after it) under `dest`; returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for v in variants:
        d = dest / v.name
        d.mkdir(exist_ok=True)
        for name, data in v.files.items():
            (d / name).write_bytes(data)
    return dest


def expected_score(expect: Expect, cells: list[dict], speed_cells: set[str]) -> float | None:
    """Points the expectation implies, or None when it leaves the score open."""
    if expect.status != "graded":
        return 0.0
    if expect.correct is None or expect.speed is None:
        return None
    # written answers are a person's to grade, never the grader's: they stay pending (0) here
    return sum(c["max_score"] for c in cells if not c.get("manual")
               and ((c["cell"] in speed_cells and expect.speed) or (c["cell"] not in speed_cells and expect.correct)))


def check(variant: Variant, result, cells: list[dict], speed_cells: set[str]) -> list[str]:
    """What is wrong with a variant's grading result (empty list: it got what it deserves)."""
    e, problems = variant.expect, []
    if result is None:
        return [f"{variant.name}: no result"]
    if result.status != e.status:
        problems.append(f"{variant.name}: status {result.status!r}, expected {e.status!r} ({result.message})")
    if result.cause not in e.causes and "*" not in e.causes:
        problems.append(f"{variant.name}: cause {result.cause!r}, expected one of {e.causes} ({result.message})")
    want = expected_score(e, cells, speed_cells)
    if want is not None and abs(result.score - want) > 1e-6:
        problems.append(f"{variant.name}: score {result.score:g}, deserves {want:g} "
                        f"(cells {[(c['cell'], c['score']) for c in result.cells]}; checks {result.checks})")
    if e.flagged and not result.flags:
        problems.append(f"{variant.name}: expected a flag for the instructor")
    if e.note and not any(e.note in n for n in result.notes):
        problems.append(f"{variant.name}: expected a note containing {e.note!r}, notes: {result.notes}")
    return problems

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

from autograder.trusted import find_calls


@dataclass
class Expect:
    """The score a variant deserves, and how its grading should read."""

    correct: bool | None  # correctness test cells pass (None: not checked)
    speed: bool | None  # speed test cells pass (None: not checked)
    status: str = "graded"  # "graded" or "not graded"
    causes: tuple = (None,)  # acceptable values of StudentResult.cause
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
                 flood_lines: int = 100_000, vandal_root: Path | None = None) -> list[Variant]:
        """Every variant this assignment supports, with the score each deserves.

        `vandal_root` (a folder you own holding the course, hand-ins and output) adds a submission that
        overwrites every result, gradebook, notebook and feedback page in it; without it there is none.
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
            add("tests_deleted", "slow solution, test cells deleted (nbgrader restores them)",
                self._files(self.notebook(slow, tests="delete")), Expect(True, False))
            add("patch_kernel", "slow solution plus a cell that patches timers, CUDA events and run_check",
                self._files(self.notebook(slow, before_tests=self._patch_cell())), Expect(True, False, flagged=True))
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
        add("malformed", "a notebook file that is not JSON", {f"{self.assignment}.ipynb": b'{"cells": [ oops'},
            Expect(None, None, status="not graded", causes=("invalid notebook",)))
        add("no_notebook", "a folder with no notebook in it", {"README.txt": b"I could not get it to work"},
            Expect(None, None, status="not graded", causes=("no notebook",)))
        return v

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
# `source/` beside `autograded/` in any parent. Steals the reference solution if it finds one.
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
    return sum(c["max_score"] for c in cells
               if (c["cell"] in speed_cells and expect.speed) or (c["cell"] not in speed_cells and expect.correct))


def check(variant: Variant, result, cells: list[dict], speed_cells: set[str]) -> list[str]:
    """What is wrong with a variant's grading result (empty list: it got what it deserves)."""
    e, problems = variant.expect, []
    if result is None:
        return [f"{variant.name}: no result"]
    if result.status != e.status:
        problems.append(f"{variant.name}: status {result.status!r}, expected {e.status!r} ({result.message})")
    if result.cause not in e.causes:
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

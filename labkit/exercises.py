"""The weekly notebooks' exercises: the student writes the code, the self-check cell right below checks it.

A notebook's exercise is two cells. The first (tagged `exercise`) is where the student writes real PyTorch,
usually a function; the instructor's copy holds a worked answer between nbgrader's solution markers
(`SOLUTION_BEGIN`, `SOLUTION_END`, each alone on its line), which the student release replaces by
`raise NotImplementedError()` (`blank_solutions`).
The second (tagged `self-check`) calls `check`:

    from labkit import exercises as ex
    def round_to(x, fmt): ...              # the student's cell
    ex.check("1.1", round_to)              # the self-check: one line when right, a clear error when not

`check` raises `NotDone` while the answer is still the blank (so a notebook run top to bottom stops loudly at
the first exercise not done) and `Wrong` with what differed. `ex.reference("1.1")` hands back labkit's own
version of the same function, for a student who wants to move on: `round_to = ex.reference("1.1")` makes the
later cells run. The references are built on labkit's public modules (the ones the notebooks measure with);
the worked answers in the notebooks' solution regions are the instructor's and never ship.

Each week's checks and references live in `labkit/week<N>_exercises.py`, registered with `@exercise`; this
module imports none of them until an exercise of that week is asked for.
"""

from __future__ import annotations

import importlib
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from labkit.errors import LabkitError

# Spelt in two parts so that this file, which ships, never holds the markers the release scan looks for.
SOLUTION_BEGIN = "### BEGIN " + "SOLUTION"
SOLUTION_END = "### END " + "SOLUTION"
BLANK = "# YOUR CODE HERE\nraise NotImplementedError()"
EXERCISE_TAG = "exercise"
CHECK_TAG = "self-check"
ID_RE = re.compile(r"^([1-9])\.(\d+)$")


class NotDone(LabkitError):
    """The exercise's cell still raises NotImplementedError: write it (or take the reference) and re-run."""


class Wrong(LabkitError):
    """The student's code runs but gives a wrong result; the message says what differed."""


@dataclass(frozen=True)
class Exercise:
    id: str  # "3.1": week 3, first exercise
    title: str  # one line, as the notebook's heading names it
    check: Callable  # check(answer) -> str: raises Wrong (or AssertionError) with what differed, returns a verdict
    reference: Callable  # reference() -> an object of the shape the exercise asks for (labkit's own version)


_REGISTRY: dict[str, Exercise] = {}


def exercise(id: str, title: str, reference: Callable):
    """Register `check` as exercise `id`'s self-check, with `reference` giving labkit's version (decorator)."""
    if not ID_RE.match(id):
        raise ValueError(f"exercise ids look like '3.1', not {id!r}")

    def wrap(fn):
        _REGISTRY[id] = Exercise(id, title, fn, reference)
        return fn

    return wrap


def _week(id: str) -> int:
    m = ID_RE.match(str(id))
    if not m:
        raise LabkitError(f"exercise ids look like '3.1' (week 3, first exercise), not {id!r}")
    return int(m.group(1))


def get(id: str) -> Exercise:
    """The registered exercise `id`, importing its week's module on first use."""
    week = _week(id)
    if id not in _REGISTRY:
        try:
            importlib.import_module(f"labkit.week{week}_exercises")
        except ModuleNotFoundError as e:
            if e.name != f"labkit.week{week}_exercises":
                raise
    if id not in _REGISTRY:
        known = ", ".join(sorted(k for k in _REGISTRY if _week(k) == week)) or "none"
        raise LabkitError(f"no exercise {id!r} in week {week} (its exercises: {known})")
    return _REGISTRY[id]


def ids(week: int) -> list[str]:
    """Every registered exercise id of `week`, in order."""
    try:
        importlib.import_module(f"labkit.week{week}_exercises")
    except ModuleNotFoundError:
        return []
    return sorted((k for k in _REGISTRY if _week(k) == week), key=lambda k: int(k.split(".")[1]))


def _not_implemented(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, NotImplementedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def check(id: str, answer=None, *, quiet: bool = False) -> str:
    """Check the student's `answer` to exercise `id`; print and return one verdict line when it is right.

    Raises NotDone while the answer is missing or still raises NotImplementedError, and Wrong with what differed
    (an AssertionError from the check is reported as Wrong, with its message)."""
    ex = get(id)
    head = f"Exercise {id} ({ex.title})"
    fix = (f"write it in the cell above and re-run both cells, or take labkit's version to move on: "
           f"`... = ex.reference({id!r})`")
    if answer is None:
        raise NotDone(f"{head}: not done yet - {fix}")
    try:
        verdict = ex.check(answer)
    except (NotDone, Wrong):
        raise
    except AssertionError as e:
        raise Wrong(f"{head}: not yet right - {e or 'a check failed'}") from None
    except Exception as e:  # noqa: BLE001 - the student's code failed inside the check: say where
        if _not_implemented(e):
            raise NotDone(f"{head}: not done yet (the cell still raises NotImplementedError) - {fix}") from None
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise Wrong(f"{head}: your code raised {type(e).__name__}: {e} "
                    f"(at line {where.lineno} of {where.name}); fix it and re-run") from e
    line = f"{head}: right. {verdict or ''}".rstrip()
    if not quiet:
        print(line)
    return line


def reference(id: str):
    """labkit's own version of what exercise `id` asks for, so that the cells after it run."""
    ex = get(id)
    print(f"Exercise {id}: using labkit's version; come back and write your own.")
    return ex.reference()


def blank_solutions(source: str) -> str:
    """A cell's source with every solution region (SOLUTION_BEGIN ... SOLUTION_END) replaced by the blank.

    The blank keeps the region's indentation, so a function whose body was the solution stays a function that
    raises NotImplementedError. An unclosed region is an error (a release must never ship half an answer)."""
    out, lines, i = [], source.split("\n"), 0
    while i < len(lines):
        ln = lines[i]
        if ln.strip() == SOLUTION_BEGIN:
            indent = ln[: len(ln) - len(ln.lstrip())]
            j = i + 1
            while j < len(lines) and lines[j].strip() != SOLUTION_END:
                j += 1
            if j == len(lines):
                raise LabkitError(f"a solution region opened at line {i + 1} is never closed ({SOLUTION_END})")
            out += [indent + b for b in BLANK.split("\n")]
            i = j + 1
            continue
        if ln.strip() == SOLUTION_END:
            raise LabkitError(f"line {i + 1}: {SOLUTION_END} without a {SOLUTION_BEGIN} before it")
        out.append(ln)
        i += 1
    return "\n".join(out)


def blank_notebook(nb: dict) -> dict:
    """A notebook (as JSON) with every code cell's solution regions blanked: the student's copy."""
    import copy

    nb = copy.deepcopy(nb)
    for c in nb["cells"]:
        lines = c["source"] if isinstance(c["source"], list) else None
        text = "".join(lines) if lines is not None else c["source"]
        if c["cell_type"] == "code" and SOLUTION_BEGIN in text:
            new = blank_solutions(text)
            c["source"] = new.splitlines(keepends=True) if lines is not None else new
    return nb

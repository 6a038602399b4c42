"""The weekly notebooks' exercises: the student writes the code, the cell below checks it.

Three promises, each tested here:
* every week has at least MIN_PER_WEEK exercise cells holding a worked answer, each followed by its self-check;
* the student's copy (answers blanked, as the release ships it) stops loudly at its first self-check;
* every exercise's reference passes its own check (test_notebooks.py runs the instructor's copies, answers in).
"""

import json
import os
import re

import pytest

from labkit import exercises as ex
from labkit import notebooks

MIN_PER_WEEK = 3
WEEKS = {int(p.name[:2]): p for p in notebooks.notebook_paths() if re.match(r"0\d_", p.name) and "research" not in p.name}
CHECK_CALL = re.compile(r"\bex\.check\(\s*[\"'](\d\.\d+)[\"']")


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def exercise_pairs(path):
    """[(exercise cell index, self-check cell index, exercise id)] of one notebook."""
    cells, out = _cells(path), []
    for i, c in enumerate(cells):
        if c["cell_type"] == "code" and ex.EXERCISE_TAG in _tags(c):
            nxt = next((j for j in range(i + 1, len(cells)) if cells[j]["cell_type"] == "code"), None)
            m = CHECK_CALL.search(_src(cells[nxt])) if nxt is not None else None
            out.append((i, nxt, m.group(1) if m else None))
    return out


def test_blank_solutions_keeps_the_indent_and_refuses_half_an_answer():
    src = f"def f(x):\n    {ex.SOLUTION_BEGIN}\n    return x + 1\n    {ex.SOLUTION_END}\nprint(1)"
    out = ex.blank_solutions(src)
    assert "return x + 1" not in out and "    raise NotImplementedError()" in out and out.endswith("print(1)")
    ns = {}
    exec(out, ns)  # noqa: S102 - our own test string
    with pytest.raises(NotImplementedError):
        ns["f"](1)
    with pytest.raises(ex.LabkitError, match="never closed"):
        ex.blank_solutions(f"{ex.SOLUTION_BEGIN}\nx = 1\n")
    with pytest.raises(ex.LabkitError, match="without"):
        ex.blank_solutions(f"x = 1\n{ex.SOLUTION_END}\n")


def test_check_says_not_done_wrong_and_right(capsys):
    with pytest.raises(ex.LabkitError, match="look like"):
        ex.get("three")

    @ex.exercise("9.1", "add one", reference=lambda: (lambda x: x + 1))
    def _check(fn):
        assert fn(1) == 2, f"f(1) should be 2, got {fn(1)}"
        return "f(1) == 2"

    def blank(x):
        raise NotImplementedError()

    with pytest.raises(ex.NotDone, match="not done yet"):
        ex.check("9.1", blank)
    with pytest.raises(ex.NotDone):
        ex.check("9.1", None)
    with pytest.raises(ex.Wrong, match="should be 2, got 1"):
        ex.check("9.1", lambda x: x)
    with pytest.raises(ex.Wrong, match="ZeroDivisionError"):
        ex.check("9.1", lambda x: x / 0)
    assert "right" in ex.check("9.1", ex.reference("9.1"))
    assert "Exercise 9.1 (add one): right." in capsys.readouterr().out


@pytest.mark.parametrize("week", sorted(WEEKS))
def test_each_week_has_exercises_with_answers_and_self_checks(week):
    path = WEEKS[week]
    pairs = exercise_pairs(path)
    assert len(pairs) >= MIN_PER_WEEK, f"{path.name}: {len(pairs)} exercise cells, want {MIN_PER_WEEK}+"
    cells = _cells(path)
    for i, j, eid in pairs:
        assert ex.SOLUTION_BEGIN in _src(cells[i]), f"{path.name} cell {i}: an exercise cell with no worked answer"
        assert j is not None and ex.CHECK_TAG in _tags(cells[j]), f"{path.name} cell {i}: no self-check cell below"
        assert eid and eid.startswith(f"{week}."), f"{path.name} cell {j}: the self-check must call ex.check('{week}.N', ...)"
        ex.get(eid)  # registered
    assert len({e for *_, e in pairs}) == len(pairs), f"{path.name}: an exercise id is checked twice"


@pytest.mark.parametrize("week", sorted(WEEKS))
def test_every_reference_passes_its_own_check(week):
    for eid in ex.ids(week):
        ex.check(eid, ex.reference(eid), quiet=True)


@pytest.mark.parametrize("week", sorted(WEEKS))
def test_the_students_copy_stops_at_its_first_self_check(week, tmp_path):
    """Run as the release ships it (answers blanked), the notebook fails at its first self-check, saying so."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = WEEKS[week]
    pairs = exercise_pairs(path)
    assert pairs, f"{path.name}: no exercises"
    # read as nbformat reads a file: it joins the source lists that nbclient cannot run
    nb = nbformat.reads(json.dumps(ex.blank_notebook(json.loads(path.read_text()))), as_version=4)
    env_backup = dict(os.environ)
    os.environ.update(LABKIT_QUICK="1", MPLBACKEND="Agg", TQDM_DISABLE="1")
    try:
        with pytest.raises(CellExecutionError) as err:
            NotebookClient(nb, timeout=600, kernel_name="python3",
                           resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    failed = [k for k, c in enumerate(nb.cells) if c.cell_type == "code"
              and any(o.output_type == "error" for o in c.get("outputs", []))]
    first_check = pairs[0][1]
    assert failed == [first_check], f"{path.name}: failed at cell {failed}, want the first self-check ({first_check})"
    assert "NotDone" in str(err.value) and f"Exercise {pairs[0][2]}" in str(err.value)

"""Hostile hand-ins against what the grader reads back from a student's scratch course after the notebook ran.

The notebook's code may write anywhere in its scratch course: the nbgrader config files that nbgrader executes,
the gradebook, the graded folder, and links in place of any of them. Two attacks a cheating-student pass found
on the real grading path, each beside the honest hand-ins they would have changed, in one toy class:
- a cell appending Python to the scratch `nbgrader_config.py` (and the course config it loads), which the grader
  used to execute in its own process to render feedback: full marks for a wrong answer, a classmate's zero;
- a cell replacing the student's module with a link that, seen from the grader, points at someone else's
  answer (here a reference solution outside the sandbox): the trusted checks used to grade that file;
- and a link planted where nbgrader writes the feedback page, pointing at a file of the grader's.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from autograder import grade, jail, rehearsal

pytestmark = pytest.mark.skipif(jail.probe() is not None, reason="needs the bubblewrap sandbox")

AID = rehearsal.TOY_ID
TOKEN = "GRADER-ONLY-7f3a"  # in a file of the grader's that no hand-in may read

# Runs in the sandboxed kernel, whose working folder is <scratch course>/autograded/<id>/<lab>.
CONFIG_ATTACK = r'''
import os, pathlib
code = """
open({marker!r}, "w").write("ran in the grader")
try:
    import gc
    from autograder import grade as _g
    for _r in [o for o in gc.get_objects() if isinstance(o, _g.StudentResult)]:
        for _c in _r.cells:
            _c["score"] = _c["max_score"] if _r.student_id == "mallory" else 0.0
        _r.score = sum(_c["score"] for _c in _r.cells)
except Exception:
    pass
"""
root = pathlib.Path("../../..")
for name in ("nbgrader_config.py", "course_nbgrader_config.py"):
    (root / name).write_text((root / name).read_text() + code)
page = root / "feedback" / "mallory" / {aid!r}
page.mkdir(parents=True, exist_ok=True)
os.symlink({secret!r}, page / ({aid!r} + ".html"))
'''

# nbgrader's own chmod of the graded folder runs inside the sandbox, where /proc/self/cwd is the scratch course:
# a decoy there keeps it from failing. On the host, /proc/self/cwd is the grader's working folder.
LINK_ATTACK = r'''
import os, pathlib
decoy = pathlib.Path("../../..") / "answer" / "pipeline.py"
decoy.parent.mkdir(parents=True, exist_ok=True)
decoy.write_text("# decoy\n")
os.remove("pipeline.py")
os.symlink("/proc/self/cwd/answer/pipeline.py", "pipeline.py")
'''


def _hand_in(body: str | None, extra: str | None = None) -> bytes:
    nb = rehearsal.toy_notebook()
    if body is not None:
        nb.cells[1].source = "%%writefile pipeline.py\n" + body
    if extra is not None:
        nb.cells.append(nbformat.v4.new_code_cell(extra))
    return nbformat.writes(nb).encode()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("scratch_attacks")
    rehearsal.build_toy_course(base / "course")
    reference = rehearsal.toy_notebook().cells[1].source.split("\n", 1)[1]
    (base / "answer").mkdir()
    (base / "answer" / "pipeline.py").write_text(reference)  # the grader's: seen from it as answer/pipeline.py
    (base / "secret.txt").write_text(TOKEN)
    marker = base / "config-ran"
    wrong = rehearsal.BODIES["wrong_fast"]
    hands = {"alice": _hand_in(None),  # the reference
             "bob": _hand_in(wrong),   # wrong, nothing else: what the attackers' code earns
             "mallory": _hand_in(wrong, CONFIG_ATTACK.format(marker=str(marker), aid=AID,
                                                             secret=str(base / "secret.txt"))),
             "trudy": _hand_in(wrong, LINK_ATTACK)}
    for sid, data in hands.items():
        (base / "subs" / sid).mkdir(parents=True)
        (base / "subs" / sid / f"{AID}.ipynb").write_bytes(data)
    cfg = grade.GradeConfig(course=str(base / "course"), out=str(base / "out"), work=str(base / "work"),
                            cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=1,
                            harness_module="autograder.rehearsal", progress=False)
    cwd = Path.cwd()
    try:
        import os
        os.chdir(base)  # the grader's working folder: where the link attack's /proc/self/cwd lands
        results = {r.student_id: r for r in grade.grade_class(AID, base / "subs", cfg).results}
    finally:
        os.chdir(cwd)
    return {"base": base, "results": results, "marker": marker}


def test_the_scratch_config_a_notebook_rewrote_never_runs_in_the_grader(graded):
    r = graded["results"]
    assert not graded["marker"].exists()
    assert r["alice"].score == r["alice"].max_score > 0  # the classmate keeps her marks
    assert r["mallory"].score == r["bob"].score < r["alice"].score
    assert r["mallory"].status == "graded"


def test_a_link_left_in_place_of_the_students_module_is_not_followed(graded):
    r = graded["results"]
    assert r["trudy"].score == 0 < r["alice"].score
    assert r["trudy"].cause == "tampered files" and "pipeline.py" in r["trudy"].message


def test_a_link_planted_where_feedback_is_written_does_not_put_the_graders_file_in_it(graded):
    out = graded["base"] / "out"
    pages = [p for p in out.rglob("*") if p.is_file() and "mallory" in p.as_posix()]
    assert any(p.suffix == ".html" for p in pages)  # feedback was written, from the grader's own copy
    assert not any(TOKEN in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    assert json.loads((out / "students" / "mallory" / "result.json").read_text())["score"] == graded["results"]["bob"].score

"""Hostile hand-ins against what the grader reads back from a student's scratch course after the notebook ran.

The notebook's code may write anywhere in its scratch course: the nbgrader config files that nbgrader executes,
the gradebook, the graded folder, and links in place of any of them. Two attacks a cheating-student pass found
on the real grading path, each beside the honest hand-ins they would have changed, in one toy class:
- a cell appending Python to the scratch `nbgrader_config.py` (and the course config it loads), which the grader
  used to execute in its own process to render feedback: full marks for a wrong answer, a classmate's zero;
- a cell replacing the student's module with a link that, seen from the grader, points at someone else's
  answer (here a reference solution outside the sandbox): the trusted checks used to grade that file;
- and a link planted where nbgrader writes the feedback page, pointing at a file of the grader's.
A second pass found what the copied gradebook and notebooks could still say:
- a task cell named like a graded cell, with points of its own (the grader took its cells from that gradebook);
- a view in place of a table that the grader's own read of the gradebook never finished;
- rows in the same schema, tens of thousands, that made the grader's read of the gradebook quadratic;
- a table's pages rewritten to point at one another, which SQLite walked as trillions of rows;
- markup in a cell id, written into the graded notebook by a helper after nbgrader wrote it, which nbgrader's
  feedback page prints unescaped.
And what a graded notebook is made of, no code needed: a markdown cell that takes nbconvert minutes to render (the
grader used to render it in its own process, holding the class), outputs that would run script in formgrader,
which shows the kept notebook in the instructor's session without sanitizing it, an image whose display
options nbconvert wrote into the feedback page's markup, and outputs holding more JSON values than the grader
parses (it used to parse, and validate, whatever a graded notebook held, in its own memory).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from conftest import active_markup

from autograder import grade, rehearsal
from autograder.sandbox import jail

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


# A task cell named like the graded test cell, worth 3 more points, with a grade row for this student: the grader
# used to take its list of cells and their points from this gradebook (a second pass found it).
PHANTOM_ATTACK = r'''
import sqlite3, uuid
db = sqlite3.connect("../../../gradebook.db")
nb_id, = db.execute("select id from notebook where name=?", ({aid!r},)).fetchone()
cid = uuid.uuid4().hex
db.execute("insert into base_cell(id, name, notebook_id, type) values (?, 'test_correct', ?, 'TaskCell')", (cid, nb_id))
db.execute("insert into task_cells(id, max_score, cell_type) values (?, 3.0, 'code')", (cid,))
for (snb,) in db.execute("select id from submitted_notebook where notebook_id=?", (nb_id,)).fetchall():
    db.execute("insert into grade(id, notebook_id, cell_id, auto_score, needs_manual_grade) values (?, ?, ?, 0, 0)",
               (uuid.uuid4().hex, snb, cid))
db.commit()
'''

# nbgrader reads source_cell before the kernel runs; the grader read it after, in its own process: a view whose
# recursive query never ends held the whole class.
VIEW_ATTACK = r'''
import sqlite3
db = sqlite3.connect("../../../gradebook.db")
db.executescript("""
PRAGMA foreign_keys=OFF;
DROP TABLE source_cell;
CREATE VIEW source_cell(id, name, cell_type, locked, source, checksum, notebook_id) AS
  WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r)
  SELECT 'x' || i, 'x' || i, 'code', 1, '', '', 'nb' || i FROM r WHERE i < 0;
""")
db.commit()
'''

# Rows in the same schema, many: nbgrader's reads look up each notebook's cells without an index, so the grader's
# integrity check went quadratic (200,000 crafted rows held the class 8 minutes and 950 MB before they were refused).
BLOAT_ATTACK = r'''
import sqlite3
db = sqlite3.connect("../../../gradebook.db")
aid, = db.execute("select id from assignment").fetchone()
db.executemany("insert into notebook(id, name, assignment_id) values (?, ?, ?)", ((f"n{k}", f"{k}", aid) for k in range(2000)))
db.executemany("insert into base_cell(id, name, notebook_id, type) values (?, ?, 'n0', 'GradeCell')",
               ((f"c{k}", f"c{k}") for k in range(40000)))
db.executemany("insert into grade_cells(id, max_score, cell_type) values (?, 1.0, 'code')", ((f"c{k}",) for k in range(40000)))
db.commit()
'''

# Pages, not rows: one table (alembic_version, which nbgrader never reads again) rewritten so that each level of its
# b-tree points every entry at the same page below. A few pages that SQLite walks as 584**5 rows, inside single
# instructions where no step budget reaches: the grader's row count never came back, and the class waited.
DAG_ATTACK = r'''
import sqlite3, struct
db = "../../../gradebook.db"
con = sqlite3.connect(db)
root, = con.execute("select rootpage from sqlite_master where name = 'alembic_version'").fetchone()
con.close()
d = bytearray(open(db, "rb").read())
ps = struct.unpack(">H", d[16:18])[0]
ps = 65536 if ps == 1 else ps
n, k = len(d) // ps, (ps - 12) // 7


def interior(child):
    p, top = bytearray(ps), ps - 5 * k
    p[0] = 5
    struct.pack_into(">HHHB", p, 1, 0, k, top, 0)
    struct.pack_into(">I", p, 8, child)
    for i in range(k):
        struct.pack_into(">H", p, 12 + 2 * i, top + 5 * i)
        struct.pack_into(">IB", p, top + 5 * i, child, 1)
    return bytes(p)


pages, child = [bytes(d[(root - 1) * ps:root * ps])], n + 1  # the table's leaf, copied to the end
for level in range(4):
    pages.append(interior(child))
    child = n + 2 + level
d[(root - 1) * ps:root * ps] = interior(child)
d += b"".join(pages)
count = struct.unpack(">I", d[24:28])[0] + 7  # a new change counter: nbgrader's open connection reads it again
struct.pack_into(">II", d, 24, count, len(d) // ps)
struct.pack_into(">I", d, 92, count)
open(db, "r+b").write(bytes(d))
'''

# A helper in a session of its own lives until nbgrader exits: it rewrites the graded notebook nbgrader just wrote,
# adding a cell whose grade_id carries markup, which nbgrader's feedback page prints unescaped.
MARKUP = '"><img src=x onerror="alert(1)"><a x="'
XSS_ATTACK = r'''
import os, subprocess, sys
HELPER = """
import json, os, time
nb_path, payload = {nb!r}, {markup!r}
start = os.stat(nb_path).st_mtime_ns if os.path.exists(nb_path) else 0
deadline = time.time() + 120
while time.time() < deadline:
    try:
        if os.stat(nb_path).st_mtime_ns != start:
            nb = json.load(open(nb_path))
            if not any(payload == c.get("metadata", {{}}).get("nbgrader", {{}}).get("grade_id") for c in nb["cells"]):
                nb["cells"].append({{"cell_type": "markdown", "id": "x-1", "source": "Thanks!", "metadata": {{
                    "nbgrader": {{"schema_version": 3, "grade": False, "solution": False, "locked": False,
                                 "grade_id": payload, "comment": "x"}}}}}})
                json.dump(nb, open(nb_path + ".t", "w"))
                os.replace(nb_path + ".t", nb_path)
            start = os.stat(nb_path).st_mtime_ns
    except (OSError, ValueError):
        pass
    time.sleep(0.002)
"""
subprocess.Popen([sys.executable, "-c", HELPER], env={{"PATH": os.environ.get("PATH", "/usr/bin:/bin")}},
                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, close_fds=True)
'''


# 256 KiB of "[" took 318 s to render on a 2-core machine; the grader stops the page at FEEDBACK_S.
SLOW_MARKDOWN = "[" * 2**18
FEEDBACK_S = 10
# The image's display options: nbconvert wrote width and height into the feedback page's <img> tag unquoted.
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
IMAGE_OPTIONS = (
    "from IPython.display import publish_display_data\n"
    f"publish_display_data(data={{'image/png': {PNG!r}, 'text/plain': 'my loss curve'}},\n"
    "    metadata={'image/png': {'width': '1 onload=alert(1)', 'height': '1 onerror=alert(2)'}})\n")
# Output the grader cannot parse in bounded memory: 2.2 million JSON values (commas and brackets) printed, which an
# honest hand-in can do as well as a helper rewriting the graded notebook can.
VERBOSE = 'print("[," * 1_100_000)\n'
SHOW_SCRIPT = (
    "from IPython.display import HTML, SVG, Javascript, display\n"
    "display(HTML('<script>alert(1)</script>'), SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" onload=\"alert(2)\"/>'),"
    " Javascript('alert(3)'))\nprint('plain words stay')\n")


def _hand_in(body: str | None, extra: str | None = None, markdown: str | None = None) -> bytes:
    nb = rehearsal.toy_notebook()
    if body is not None:
        nb.cells[1].source = "%%writefile pipeline.py\n" + body
    if extra is not None:
        nb.cells.append(nbformat.v4.new_code_cell(extra))
    if markdown is not None:
        nb.cells.append(nbformat.v4.new_markdown_cell(markdown))
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
    wrong, slow = rehearsal.BODIES["wrong_fast"], rehearsal.BODIES["slow_correct"]
    hands = {"alice": _hand_in(None),  # the reference
             "bob": _hand_in(wrong),   # wrong, nothing else: what the attackers' code earns
             "mallory": _hand_in(wrong, CONFIG_ATTACK.format(marker=str(marker), aid=AID,
                                                             secret=str(base / "secret.txt"))),
             "trudy": _hand_in(wrong, LINK_ATTACK),
             "carol": _hand_in(slow),  # correct but slow: what the phantom cell's author earns
             "pat": _hand_in(slow, PHANTOM_ATTACK.format(aid=AID)),
             "vic": _hand_in(wrong, VIEW_ATTACK),
             "bea": _hand_in(wrong, BLOAT_ATTACK),
             "dag": _hand_in(wrong, DAG_ATTACK),
             "xena": _hand_in(wrong, XSS_ATTACK.format(nb=f"{AID}.ipynb", markup=MARKUP)),
             "amos": _hand_in(wrong, SHOW_SCRIPT, SLOW_MARKDOWN),  # graded before bob: his page comes after
             "ivy": _hand_in(wrong, IMAGE_OPTIONS),
             "zed": _hand_in(None, VERBOSE)}  # the reference, printing more than the grader parses
    for sid, data in hands.items():
        (base / "subs" / sid).mkdir(parents=True)
        (base / "subs" / sid / f"{AID}.ipynb").write_bytes(data)
    cfg = grade.GradeConfig(course=str(base / "course"), out=str(base / "out"), work=str(base / "work"),
                            cell_timeout_s=60, wall_timeout_s=300, memory_gb=2.5, jobs=2, feedback_timeout_s=FEEDBACK_S,
                            harness_module="autograder.rehearsal", progress=False)
    cwd = Path.cwd()
    faulthandler.dump_traceback_later(900, exit=True)  # a grader held by a hand-in fails here, not CI's clock
    try:
        os.chdir(base)  # the grader's working folder: where the link attack's /proc/self/cwd lands
        results = {r.student_id: r for r in grade.grade_class(AID, base / "subs", cfg).results}
    finally:
        os.chdir(cwd)
        faulthandler.cancel_dump_traceback_later()
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


def test_a_task_cell_the_notebook_added_to_the_gradebook_earns_nothing(graded):
    r = graded["results"]
    assert 0 < r["carol"].score < r["carol"].max_score
    assert r["pat"].score <= r["carol"].score and r["pat"].score <= r["pat"].max_score
    assert r["pat"].cause == "tampered gradebook"


def test_a_gradebook_view_that_never_ends_fails_that_hand_in_and_the_class_goes_on(graded):
    r = graded["results"]
    assert r["vic"].cause == "tampered gradebook" and r["vic"].score == 0
    assert all(s in r for s in ("alice", "bob", "carol", "mallory", "pat", "trudy", "vic", "xena", "amos", "ivy"))


def test_a_gradebook_bloated_with_rows_is_refused_by_counting_them_first(graded):
    r = graded["results"]
    assert r["bea"].cause == "tampered gradebook" and r["bea"].score == 0
    assert any(re.search(r"holds more than [\d,]+ rows, more than grading one hand-in writes", f)
               for f in r["bea"].flags), r["bea"].flags


def test_a_gradebook_whose_pages_loop_is_refused_before_anything_walks_it(graded):
    r = graded["results"]
    assert r["dag"].cause == "tampered gradebook" and r["dag"].score == 0
    assert any("the scratch gradebook's file is malformed (On tree page" in f for f in r["dag"].flags), r["dag"].flags


def test_markup_in_a_cell_id_never_reaches_a_feedback_page(graded):
    out = graded["base"] / "out"
    assert not any("<img src=x" in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    x = graded["results"]["xena"]
    assert x.score == 0 and x.cause in (None, "tampered files")  # whether or not the helper won its race


def test_a_page_that_takes_minutes_to_render_is_stopped_and_the_next_student_gets_theirs(graded):
    r, out = graded["results"], graded["base"] / "out"
    amos = r["amos"]
    assert amos.status == "graded" and amos.score == r["bob"].score
    assert f"rendering the feedback took longer than {FEEDBACK_S} s and was stopped; the summary alone is sent" \
        in amos.notes
    page = (out / "feedback" / "amos" / AID / f"{AID}.html").read_text()
    assert f"{amos.score:g} / {amos.max_score:g} points" in page and "[[[[" not in page  # the summary box alone
    bob = (out / "feedback" / "bob" / AID / f"{AID}.html").read_text()  # rendered by the next child
    assert "labkit-grade-summary" in bob and "pipeline.py" in bob and not r["bob"].notes


def test_the_notebook_kept_for_formgrader_carries_no_script(graded):
    kept = graded["base"] / "out" / "autograded" / "amos" / AID / f"{AID}.ipynb"
    nb = nbformat.read(kept, as_version=4)
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("plain words stay" in o.get("text", "") for o in shown)
    assert {m for o in shown for m in o.get("data", {})} <= {"text/plain", "image/png", "image/jpeg", "image/gif"}
    assert any("not shown by the grader" in o.get("data", {}).get("text/plain", "") for o in shown)
    assert not [o for o in shown if "alert(" in json.dumps(o)]  # the script shown, as code, in its cell alone
    assert SLOW_MARKDOWN in nb.cells[-1].source  # the answer itself is all there, as written


def test_an_images_display_options_run_nothing_in_its_feedback_page(graded):
    page = (graded["base"] / "out" / "feedback" / "ivy" / AID / f"{AID}.html").read_text()
    assert PNG in page and active_markup(page) == []  # the image is shown, its options are not
    assert graded["results"]["ivy"].score == graded["results"]["bob"].score


def test_a_notebook_printed_past_what_the_grader_parses_is_scored_without_it(graded):
    """zed's graded notebook holds more JSON values than the grader reads (sandbox.MAX_JSON_VALUES): it is left
    unread, and the score comes from the gradebook and the trusted checks, as for alice; no page is rendered from it
    and formgrader gets no copy, and the summary says so."""
    r, out = graded["results"], graded["base"] / "out"
    zed = r["zed"]
    assert zed.status == "graded" and zed.cause is None and zed.score == r["alice"].score == zed.max_score, zed
    assert any("as graded is too large to read (over 64 MiB or 2,000,000 JSON values" in n for n in zed.notes), \
        zed.notes
    page = (out / "feedback" / "zed" / AID / f"{AID}.html").read_text()
    assert f"{zed.score:g} / {zed.max_score:g} points" in page and "[,[," not in page  # the summary box alone
    assert not (out / "autograded" / "zed" / AID / f"{AID}.ipynb").exists()

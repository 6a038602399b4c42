"""A cheating student (and an honest one) against the grader's newest review features: the "too noisy" rule of
the speed re-measurement (autograder.checks.remeasure), the copy as handed in for markers (autograder.gradebook.feedback), the
manual scores on feedback pages (autograder.gradebook.manual, autograder.gradebook.report) and the class tools reading names against
a class list (autograder.merge, autograder.gradebook.similarity).

Most attacks use stand-ins (a fake measurement, a result object); the one that needs the real sandboxed runner
uses the toy assignment at a tenth of its work (autograder.rehearsal), as tests/test_hostile_remeasure.py does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from autograder import rehearsal
from autograder.checks import remeasure, review
from autograder.checks.harness import CheckFailed, Context, NotGradable, Tiers
from autograder.gradebook import summary
from autograder.sandbox import jail
from labkit.bench import ABResult, Timing

SANDBOX = "bwrap" if jail.probe() is None else "none"
TIERS = Tiers(((1.5, 0.5), (2.0, 2 / 3), (2.5, 5 / 6), (3.0, 1.0)), bonus=4.0)

# ------------------------------------------------------------------------------------------------ too noisy


def _ab(ratios: list[float], base: list[float]) -> ABResult:
    """Rounds with the baseline's seconds `base` (cycled) and the student's set by each round's ratio."""
    a = [base[i % len(base)] for i in range(len(ratios))]
    return ABResult(Timing(a), Timing([x / r for x, r in zip(a, ratios, strict=True)]), list(ratios))


class Fake:
    """A measurement handing out the same per-round ratios and baseline seconds on every call."""

    def __init__(self, ratios: list[float], base: list[float]):
        self.ratios, self.base, self.calls = ratios, base, 0

    def __call__(self, rounds: int):
        self.calls += 1
        return _ab([self.ratios[i % len(self.ratios)] for i in range(rounds)], self.base), {}


# A slow hand-in (about the baseline's speed: below every tier) that sleeps through most of its timed requests:
# its rounds alternate ~0.1x and ~1x, so their IQR exceeds the ratio and, before, the check was "not gradable"
# on any machine, the quietest included: a 0 turned into "not graded yet" for good.
JITTER = [0.1, 1.0, 0.12, 1.05, 0.1, 0.95, 0.11, 1.0, 0.1]
STEADY = [1.0, 1.01, 0.99, 1.02, 1.0]  # the baseline's seconds on a quiet machine


def test_a_hand_ins_own_jitter_on_a_quiet_machine_is_scored_as_measured():
    ab, _, rec = remeasure.measured(Fake(JITTER, STEADY), 9, TIERS)
    assert ab.ratio_iqr > ab.ratio and TIERS.fraction(ab.ratio) == 0  # scored: below the first tier, 0 points
    assert rec["own_spread"]["baseline_iqr_share"] < remeasure.POLICY.quiet_baseline
    line = remeasure.message(rec)
    assert "your code's own" in line and line.count("\n") == 0

    class Res:
        checks = [{"check": "lab3.speed", "measurements": {"speedup": round(ab.ratio, 2),
                                                           "speedup_iqr": round(ab.ratio_iqr, 2), **rec}}]

    kinds = {f["kind"]: f["why"] for f in review.flags(Res())}
    assert "baseline held steady" in kinds[review.OWN_SPREAD]  # the instructor sees it in the summary too
    assert any(ln.startswith("SCORED DESPITE ITS OWN SPREAD")
               for ln in summary.review_sections([{"student_id": "sly", "review": review.flags(Res())}]))


def test_a_busy_machine_still_leaves_a_wild_ratio_not_gradable():
    """The machine's noise shows in the baseline's own rounds too: then nobody is scored on a coin toss."""
    busy = [1.0, 3.5, 2.6, 1.1, 3.0, 4.0, 1.2, 0.9, 2.8]  # both interleaved halves spread
    with pytest.raises(NotGradable, match="too noisy") as e:
        remeasure.measured(Fake(JITTER, busy), 9, TIERS)
    assert e.value.measurements["baseline_iqr_share"] > remeasure.POLICY.quiet_baseline


def test_baseline_rounds_slowed_by_the_hand_ins_queued_work_do_not_make_the_machine_look_busy():
    """The baseline rounds that follow a student round (every other one) can carry work the student left queued
    (a GPU kernel still running); the rounds after a baseline round cannot. The machine is judged by the
    steadier half, so a hand-in jittering both its own rounds and those baseline rounds is still scored."""
    dirty = [1.0, 2.5, 1.01, 0.4, 0.99, 3.0, 1.0, 0.5, 1.02]  # odd rounds: whatever the student's leftovers made
    ab, _, rec = remeasure.measured(Fake(JITTER, dirty), 9, TIERS)
    assert "own_spread" in rec and TIERS.fraction(ab.ratio) == 0


def test_a_hand_in_seen_slowing_the_baseline_cannot_pass_its_jitter_off_as_a_busy_machine():
    """GPU work a hand-in leaves queued after its reply runs while the baseline is timed; queued long and at random
    it spreads both halves of the baseline's rounds. Once the harness saw the hand-in slow the baseline
    (baseline_interference), the baseline's spread is no witness for the machine: scored as measured."""
    busy = [1.0, 3.5, 2.6, 1.1, 3.0, 4.0, 1.2, 0.9, 2.8]

    def measure(rounds: int):
        return _ab([JITTER[i % len(JITTER)] for i in range(rounds)], busy), {"baseline_interference": True}

    ab, notes, rec = remeasure.measured(measure, 9, TIERS)
    assert rec["own_spread"]["baseline_interference"] is True and notes["baseline_interference"] is True
    assert "slowed the baseline" in remeasure.message(rec) and TIERS.fraction(ab.ratio) == 0


def test_a_few_fast_rounds_do_not_buy_full_marks_through_a_wide_spread():
    """A wide spread is scored on a busy machine only when the middle half of the rounds lies above every tier
    (remeasure.above_every_boundary). A slow hand-in that answers a third of its timed requests from a cache
    (100x) is not lifted by it: its first quartile is its slow self, so a busy machine still leaves it ungraded,
    and a quiet one scores its median, 0 points."""
    busy = [1.0, 3.5, 2.6, 1.1, 3.0, 4.0, 1.2, 0.9, 2.8]
    lucky = [1.0, 100.0, 0.9, 1.1, 100.0, 1.0, 0.95, 100.0, 1.05]
    assert not remeasure.above_every_boundary(lucky, [1.5, 2.0, 2.5, 3.0, 4.0])
    with pytest.raises(NotGradable, match="too noisy"):
        remeasure.measured(Fake(lucky, busy), 9, TIERS)
    ab, _, rec = remeasure.measured(Fake(lucky, STEADY), 9, TIERS)
    assert "own_spread" in rec and TIERS.fraction(ab.ratio) == 0


# What the toy's jittery student does in its real sandbox: the slow loop (about 1x the baseline), and a sleep
# of ten times its work in every other request, starting with the first (8 calls of total() per request; 3 calls
# before them for the correctness probe): 4 of the 7 timed rounds are slow, so the median is one of them.
JITTERY_SLOW = rehearsal.BODIES["slow_correct"] + '''
import time as _time

_slow, _calls = total, [0]


def total(xs):
    _calls[0] += 1
    t = _time.perf_counter()
    out = _slow(xs)
    if _calls[0] > 3 and ((_calls[0] - 4) // 8) % 2 == 0:
        _time.sleep(10 * (_time.perf_counter() - t))
    return out
'''


def test_a_slow_hand_in_jittering_on_purpose_in_its_sandbox_fails_instead_of_going_ungraded(tmp_path, monkeypatch):
    monkeypatch.setattr(rehearsal, "N_ELEMENTS", 20_000)  # a tenth of the work: a few seconds
    box, work = tmp_path / "box", tmp_path / "work"
    box.mkdir()
    work.mkdir()
    f = box / "pipeline.py"
    f.write_text(JITTERY_SLOW)
    ctx = Context(device="cpu", hardware="cpu", small=True, work_dir=work, student_file=f, sandbox=SANDBOX)
    try:
        ctx.baseline().wait_ready()
        ctx.student().wait_ready()
        ctx.deadline = time.monotonic() + 120
        with pytest.raises(CheckFailed) as e:  # before: NotGradable ("too noisy"), on any machine
            rehearsal.check_speed(ctx)
    finally:
        ctx.close()
    m = e.value.measurements
    assert m["ratio_iqr"] > m["ratio"] and "own_spread" in m, m
    assert "your code's own" in str(e.value)


# ------------------------------------------------------------------------------------------------ class lists

CANVAS_ROSTER = ('Student,ID,SIS User ID,SIS Login ID,Section\n    Points Possible,,,,\n'
                 '"Doe, Jane",101,,jane_doe,A\n"Roe, Rick",102,,rick,A\n')


def test_merge_reads_a_canvas_gradebook_roster_as_grading_does(tmp_path):
    """grade --roster takes the course's Canvas gradebook export; merge --roster read its first column instead, so
    every student's display name (and Canvas's 'Points Possible' row) was listed as MISSING, and nobody who was
    really missing could be told from them."""
    from autograder import merge

    roster = tmp_path / "canvas.csv"
    roster.write_text(CANVAS_ROSTER)
    assert merge.expected_students(None, roster, assignment=rehearsal.TOY_ID) == {"jane_doe", "rick"}
    plain = tmp_path / "plain.csv"  # a bare list, one id a line under any heading, still names who is missing
    plain.write_text("id\nalice\nbob_2\n")
    assert merge.expected_students(None, plain, assignment=rehearsal.TOY_ID) == {"alice", "bob_2"}


# ------------------------------------------------------------------------------------------------ similarity


def test_the_similarity_report_shows_a_hand_ins_lines_without_running_its_escapes():
    """similarity.txt quotes the matching lines of both files for a person to read (in a terminal, or an editor):
    a copy whose comments hold ANSI escapes (clear the screen, home the cursor) and a bidi override reached the
    file raw, so the instructor's `cat` cleared the screen and the quoted lines read other than they are. Comments
    change no fingerprint: the pair is still flagged."""
    import sys

    from autograder.gradebook import similarity

    sys.path.insert(0, str(Path(__file__).parent / "data"))
    import similarity_class

    evil = "\n".join(ln + "  # \x1b[2J\x1b[H\u202eok\u202c" if ln.strip() else ln
                     for ln in similarity_class.COPY.splitlines()) + "\n"
    files = dict(similarity_class.SOLUTIONS, zed=evil)
    pairs, stats = similarity.compare(files, similarity_class.STARTER)
    assert [(p.a, p.b) for p in pairs if p.flagged] == [("ana", "zed")]
    text = similarity.report_text("lab1_loss_scaling", pairs, stats, ["zed: line one\nFLAGGED: 0 pair(s)"], files)
    assert all(ln.isprintable() for ln in text.splitlines()), [ln for ln in text.splitlines() if not ln.isprintable()]
    assert "\\x1b[2J" in text and "\\u202e" in text  # shown, as escapes
    assert not any(ln.startswith("FLAGGED: 0") for ln in text.splitlines())  # a note cannot forge a line


# ------------------------------------------------------------------------------------------------ as handed in


def _handed_in(tmp_path: Path, nb, student: str = "eve") -> tuple[str, str]:
    """feedback.show's plain copy of `nb` as handed in by `student`: (the copy's text, the child's log)."""
    import nbformat

    from autograder.gradebook import feedback

    handed = tmp_path / "submitted" / student / rehearsal.TOY_ID
    handed.mkdir(parents=True)
    (handed / f"{rehearsal.TOY_ID}.ipynb").write_text(nbformat.writes(nb))
    log = feedback.show(tmp_path, rehearsal.TOY_ID, student, pages=False)
    copy = tmp_path / "formgrader" / feedback.HANDED_IN / f"{rehearsal.TOY_ID}.ipynb"
    return (copy.read_text() if copy.is_file() else ""), log


def test_a_notebook_whose_copy_would_outgrow_what_the_grader_keeps_is_cut_not_lost(tmp_path):
    """Intake takes notebooks up to 50 MiB; the grader keeps a file of at most 16 MiB (grade.MAX_KEPT_BYTES) and
    left out a larger copy as handed in without a word, so the marker had no copy at all. Printed output can get
    there honestly, and a text of emoji grows threefold as escaped JSON. The copy keeps every cell, the written
    answers whole and each output's head and tail, and says what it cut."""
    import json

    import nbformat

    from autograder import grade
    from autograder.gradebook import feedback

    assert feedback.MAX_PLAIN_BYTES <= grade.MAX_KEPT_BYTES
    nb = nbformat.v4.new_notebook()
    loud = nbformat.v4.new_code_cell("for i in range(10**6): print(i, '\U0001F600' * 3)")
    loud.outputs = [nbformat.v4.new_output("stream", name="stdout", text="step 0: loss 2.31\n" + "\U0001F600" * 2_000_000
                                           + "\nlast step: loss 0.12\n")]
    answer = nbformat.v4.new_markdown_cell("My answer: the loss fell from 2.31 to 0.12.")
    nb.cells = [loud, answer]
    copy, log = _handed_in(tmp_path, nb)
    assert copy and len(copy.encode()) <= feedback.MAX_PLAIN_BYTES, (len(copy), log)
    cells = json.loads(copy)["cells"]
    text = cells[0]["outputs"][0]["text"]
    assert text.startswith("step 0: loss 2.31") and text.endswith("last step: loss 0.12\n") and "cut by the grader" in text
    assert "the loss fell from 2.31 to 0.12" in cells[1]["source"]


def test_the_copy_as_handed_in_carries_escapes_markup_and_odd_names_as_inert_text(tmp_path):
    """ANSI escapes (an OSC 8 hyperlink, a screen clear), bidi overrides, markup and a notebook named like a tag:
    the copy a marker opens (or cats) is plain ASCII JSON, with the bidi controls shown as escapes and the markdown
    fenced as written (held before; kept so)."""
    import json
    import zipfile

    import nbformat

    from autograder.gradebook import feedback
    from autograder.intake import submissions as intake

    esc = "\x1b]8;;javascript:steal()\x1b\\\\click\x1b]8;;\x1b\\\\ \x1b[2J \u202eevil\u202c <script>steal()</script>"
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell(f"print({esc!r})")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text=esc),
                    nbformat.v4.new_output("error", ename=esc, evalue=esc, traceback=[esc])]
    nb.cells = [code, nbformat.v4.new_markdown_cell(esc)]
    copy, log = _handed_in(tmp_path, nb)
    assert copy.isascii() and all(ln.isprintable() for ln in copy.splitlines()), log
    def strings(v):
        if isinstance(v, str):
            yield v
        for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            yield from strings(x)

    assert not [t for t in strings(json.loads(copy)) if "\u202e" in t]  # before: the traceback kept the override
    page = json.loads(feedback._page_safe(nbformat.writes(nb)))  # and the feedback page's error output
    assert not [t for t in strings(page) if "\u202e" in t]
    md = json.loads(copy)["cells"][1]
    assert md["cell_type"] == "markdown" and md["source"].startswith("```")
    subs = tmp_path / "subs"  # a zipped symlink standing for the notebook, and a notebook named like markup
    subs.mkdir()
    link = zipfile.ZipInfo(f"{rehearsal.TOY_ID}.ipynb")
    link.external_attr = (0o120777) << 16
    with zipfile.ZipFile(subs / f"mal_{rehearsal.TOY_ID}.zip", "w") as z:
        z.writestr(link, "../../course/source/answers.ipynb")
    with zipfile.ZipFile(subs / f"odd_{rehearsal.TOY_ID}.zip", "w") as z:
        z.writestr("<img src=x onerror=steal()>.ipynb", nbformat.writes(nb))
    got = {s.student_id: s for s in intake.collect(subs, rehearsal.TOY_ID, scratch=tmp_path / "scratch").submissions}
    assert "not a notebook" in got["mal"].problem  # the link's target, as text: nothing is followed
    assert got["odd"].notebook == f"{rehearsal.TOY_ID}.ipynb" and not got["odd"].problem


# ------------------------------------------------------------------------------------------------ manual scores

WID = rehearsal.WRITTEN_ID
CELLS = [{"notebook": rehearsal.TOY_ID, "cell": WID, "max_score": 2.0, "manual": True}]


def _csv(tmp_path: Path, rows: str) -> Path:
    p = tmp_path / "scores.csv"
    p.write_text("student_id,cell,score\n" + rows)
    return p


@pytest.mark.parametrize("score", ["nan", "inf", "-inf", "-0.5", "2.01", "1e400"])
def test_a_manual_score_outside_its_cell_is_refused_before_grading(tmp_path, score):
    """NaN compares false with everything, so a range check written the other way round would let it through and
    make the total NaN (held: 0 <= v <= max is false for NaN)."""
    from autograder.gradebook import manual
    from labkit.env import LabkitError

    p = _csv(tmp_path, f"ann,{WID},{score}\n")
    with pytest.raises(LabkitError, match="outside 0..2"):
        manual.check_csv(manual.read_csv(p), CELLS, p)


def test_two_scores_for_one_answer_are_refused_not_the_last_one_silently_kept(tmp_path):
    """Two rows for one student's answer (a second marker's line pasted in): before, the later row won and
    nobody was told which grade counted."""
    from autograder.gradebook import manual
    from labkit.env import LabkitError

    p = _csv(tmp_path, f"ann,{WID},2\nbob,{WID},1\nann,{WID},0\n")
    with pytest.raises(LabkitError, match=r"line 4: ann/written_why is scored twice \(line 2 too\)"):
        manual.read_csv(p)
    p = _csv(tmp_path, "ann\n")  # a short row: before, an AttributeError from inside the reader
    with pytest.raises(LabkitError, match="line 2: student_id and cell must not be empty"):
        manual.read_csv(p)


def test_scores_for_a_student_this_run_did_not_grade_are_named(tmp_path, caplog):
    """A row for an id no result has (a typo, 'jane' for 'jane_doe', a student of another slice) changed nothing
    and said nothing: the answer stayed pending with no word of why. Now the run names those ids."""
    import logging

    from autograder import grade
    from autograder.gradebook import manual

    ann = grade.StudentResult(student_id="ann", assignment=rehearsal.TOY_ID, status="graded", max_score=7.0,
                              cells=[dict(CELLS[0], score=0.0, needs_manual=True, source="pending")])
    with caplog.at_level(logging.WARNING, logger="autograder"):
        out = manual.apply([ann], {("ann", WID): 7.0, ("jane", WID): 1.0})
    assert out[0].cells[0]["score"] == 2.0 and out[0].score == 2.0  # over the cell's points: its points, no more
    assert "jane" in caplog.text and "no student of this run" in caplog.text
    caplog.clear()  # one slice of a class: the other slices' students are no typo, and are not named
    with caplog.at_level(logging.WARNING, logger="autograder"):
        manual.apply([ann], {("ann", WID): 7.0, ("bob", WID): 1.0, ("jane", WID): 1.0}, known={"ann", "bob"})
    assert "jane" in caplog.text and "bob" not in caplog.text and "no student of this class" in caplog.text


# ------------------------------------------------------------------------------------------------ honest students


def test_a_lab_3_variant_mix_up_through_an_lms_zip_is_a_verdict_for_a_person(tmp_path, monkeypatch):
    """End to end through an LMS-named zip and the class list: jane_doe handed in the slow_train.py handed out to
    her classmate jane (a shared folder, say). Not graded, nothing of hers run; her page says it waits for a
    person without naming the classmate; the summary flags whose variant it carries."""
    import json
    import zipfile

    from autograder import grade
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    secret = course_secret.Secret(b"a course secret for these tests", course_secret.COURSE_LABEL)
    monkeypatch.setenv(course_secret.ENV, secret.key.decode())
    lab = "lab3_profile_fix"
    root = Path(__file__).resolve().parents[1]
    subs = tmp_path / "subs"
    subs.mkdir()
    with zipfile.ZipFile(subs / f"jane_doe_{lab}_handin.zip", "w") as z:
        z.writestr(f"{lab}.ipynb", (root / "assignments" / "source" / lab / f"{lab}.ipynb").read_text())
        z.writestr("slow_train.py", lab3_variants.handout("jane", secret))
        z.writestr("handin.json", json.dumps({"lab": lab, "release": "0.1.0", "variant_tag": ""}))
    roster = tmp_path / "roster.csv"
    roster.write_text("student_id\njane\njane_doe\n")
    cfg = grade.GradeConfig(course=str(root / "assignments"), out=str(tmp_path / "out"), work=str(tmp_path / "work"),
                            progress=False, roster=str(roster), allow_ungradable=True, jobs=1)
    rep = grade.grade_class(lab, subs, cfg)
    (r,) = rep.results
    assert (r.student_id, r.status, r.cause) == ("jane_doe", "not graded", "variant mismatch"), (r.message, r.cause)
    assert "waits for a person" in r.message and "jane's" not in r.message.replace("jane_doe's", "")
    assert any("carries the tag of jane's variant" in f for f in r.flags), r.flags
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "variant mismatch" in summary and "FLAGGED" in summary


def test_one_huge_module_does_not_hold_up_the_class_similarity_report(tmp_path):
    """Intake takes a 50 MiB notebook; fingerprinting took ~6 s and ~500,000 tokens a MiB of module (measured on
    the 2-core test machine), so one hand-in writing 40 MiB of code held the tool for minutes, twice (the class,
    then the known answers), and took GiBs. A module far larger than any course module is named, not compared."""
    import nbformat

    from autograder.gradebook import similarity

    subs = tmp_path / "subs"
    for sid, body in (("ann", "def total(xs):\n    return sum(x * x for x in xs)\n"),
                      ("huge", "x = y + 1\n" * (similarity.MAX_MODULE_BYTES // 10 + 1))):
        (subs / sid).mkdir(parents=True)
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"%%writefile pipeline.py\n{body}")])
        nbformat.write(nb, subs / sid / f"{rehearsal.TOY_ID}.ipynb")
    t0 = time.monotonic()
    files, notes = similarity.class_files(subs, rehearsal.TOY_ID, tmp_path / "scratch")
    assert set(files) == {"ann"} and any(n.startswith("huge: its module is") and "not compared" in n for n in notes)
    assert time.monotonic() - t0 < 30


def test_settling_a_page_rewrites_the_grader_s_box_never_the_students_own_text():
    """The LMS bundle brings a page written while answers were pending up to date. It rewrote the cell lines and
    cut the provisional note wherever they occurred, the student's own notebook included: a student quoting
    either (or writing <b>Provisional:</b> in an answer) had their text rewritten or cut. Only the box is."""
    from autograder import grade
    from autograder.gradebook import manual, report

    cell = dict(CELLS[0], score=0.0, needs_manual=True, source="pending")
    res = grade.StudentResult(student_id="ann", assignment=rehearsal.TOY_ID, status="graded", max_score=7.0,
                              score=5.0, cells=[cell], hardware={"class": "cpu", "card": "CPU"})
    mine = (f"<p>I quoted my box: {WID}: needs manual grading (a written answer worth 2 points)</p>"
            "<p><b>Provisional:</b> my own heading, kept</p>")
    page = report.feedback_page(res, f"<html><body><div class='cell'>{mine}</div></body></html>").decode()
    assert "Provisional:</b> 2 points" in page
    done = manual.settle_page(page, res, {"manual_scores": {WID: 1.5}, "provisional": False})
    assert mine in done  # the student's own text, as written
    box = done[:done.index("<div class='cell'>")]
    assert f"{WID}: 1.5 of 2, graded by an instructor" in box and "Provisional:" not in box


def test_the_course_readme_states_these_defences_with_the_codes_own_numbers():
    from autograder import grade
    from autograder.gradebook import feedback, similarity

    text = " ".join((Path(__file__).resolve().parents[1] / "assignments" / "README.md").read_text().split())
    assert remeasure.POLICY.quiet_baseline == 0.25 and "spread by more than a quarter of their median" in text
    assert "scored despite its own spread" in text and review.OWN_SPREAD == "scored despite its own spread"
    assert grade.MAX_KEPT_BYTES == 16 * 2**20 and "16 MiB the grader keeps of a file" in text
    assert feedback.MAX_PLAIN_BYTES < grade.MAX_KEPT_BYTES
    assert similarity.MAX_MODULE_BYTES == 2**20 and "a module over 1 MiB" in text


def test_a_copy_as_handed_in_left_out_is_named_in_the_students_notes(tmp_path, monkeypatch):
    """A copy as handed in that was not written (the plain copy failed) or is still over what the grader keeps
    was left out without a word: the marker reading written answers had no copy and no reason."""
    from types import SimpleNamespace

    from autograder import grade

    copies = tmp_path / "copies"
    copies.mkdir()
    (copies / "a.ipynb").write_text("{}")
    (copies / "big.ipynb").write_bytes(b"x" * 64)
    monkeypatch.setattr(grade, "MAX_KEPT_BYTES", 32)
    written = {}
    out = SimpleNamespace(write=lambda rel, data: written.setdefault(rel, data) and rel)
    res = SimpleNamespace(notes=[], outputs={})
    grade.keep_handed_in(res, out, copies, "eve", ["a", "big", "gone"])
    assert list(written) == ["students/eve/as_handed_in/a.ipynb"]
    assert res.notes == ["students/eve/as_handed_in/big.ipynb is not kept (too large; see feedback.log)",
                         "students/eve/as_handed_in/gone.ipynb is not kept (not written; see feedback.log)"]

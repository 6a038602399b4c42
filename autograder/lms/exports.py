"""LMS in and out: Canvas gradebook CSV, Gradescope results.json, per-student feedback bundles to upload.

The exports read a grading output folder (a single run or a merge): the sealed done-markers (verified under
the folder's key) and `final.json` (the total after extra credit and the late policy, autograder.gradebook.classbook).

Canvas: the gradebook import CSV takes the columns Student, ID, SIS User ID, SIS Login ID, Section and one
column per assignment, named "<title>" or "<title> (<Canvas assignment id>)"; an optional second row
"Points Possible" gives the assignment's points. A student is matched by ID (the Canvas user id, also the
number after the name in Canvas download names `name_12345_678_file`), SIS User ID or SIS Login ID: pass the
course's own gradebook export as --roster to fill them in.

Gradescope: `results.json` of its autograder specification: top-level score, output, tests[] with name, score,
max_score, output (and visibility, extra_data); no execution_time, which a hand-in could stretch by its hidden
inputs. `run_gradescope` is what the `run_autograder` entry point (autograder/deploy/gradescope/) calls for labs
1-3, which need no GPU.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from autograder.base import shown
from autograder.checks import gpu_policy
from autograder.gradebook import classbook, manual
from autograder.gradebook.results import load_result
from autograder.intake import late, lmsnames
from autograder.intake import submissions as intake
from labkit.bench import write_json
from labkit.env import LabkitError

CANVAS_ID_COLUMNS = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
GRADESCOPE_TEST_KEYS = ("name", "score", "max_score", "output")
CANVAS_NAME = late.CANVAS_NAME  # Canvas download names: <name>[_LATE]_<user id>_<submission id>_<file>


# ------------------------------------------------------------------------------------------------ reading


def load_class(out: str | Path) -> tuple[list, dict[str, dict], dict]:
    """(StudentResults verified under the folder's key, final rows by student, final.json) of an output folder."""
    out = Path(out)
    try:
        final = json.loads((out / classbook.FINAL).read_text())
    except (OSError, ValueError) as e:
        raise LabkitError(f"{out} has no readable {classbook.FINAL}: grade (or merge) into it first") from e
    key = (out / ".grader-key").read_bytes() if (out / ".grader-key").exists() else None
    if key is None:
        raise LabkitError(f"{out} has no grader key: is it a grading output folder?")
    rows = {r["student_id"]: r for r in final["students"]}
    results = []
    for sid in rows:
        res = load_result(out / "students" / sid / "result.json", key, sid)
        if res is None:
            raise LabkitError(f"{sid}: done-marker in {out} missing or not the grader's own; regrade before exporting")
        results.append(res)
    return results, rows, final


def lms_names(submissions: str | Path | None, lms_regex: str = intake.LMS_REGEX, roster=None) -> dict[str, dict]:
    """student id -> {"canvas_id", "prefix"} from Canvas download names in the submissions folder, the ids read
    as intake reads them (autograder.intake.lmsnames; `roster`: the class list, a path or a Roster)."""
    out: dict[str, dict] = {}
    if submissions is None or not Path(submissions).is_dir():
        return out
    roster = lmsnames.load_roster(roster)
    custom = None if lms_regex == intake.LMS_REGEX else lms_regex
    for p in sorted(Path(submissions).iterdir()):
        got = lmsnames.read_name(p.name, "", roster, custom) if p.is_file() else None
        c = CANVAS_NAME.match(p.name)
        if got is not None and got.student_id and c:
            out.setdefault(got.student_id, {"canvas_id": c.group("user_id"), "prefix": c.group(0)})
    return out


# ------------------------------------------------------------------------------------------------ Canvas


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _roster_match(roster: list[dict], sid: str, canvas_id: str | None) -> dict | None:
    for r in roster:
        if canvas_id and r.get("ID", "").strip() == canvas_id:
            return r
    for col in ("SIS Login ID", "SIS User ID", "ID"):
        for r in roster:
            if r.get(col, "").strip() and intake.safe_id(r[col]) == sid:
                return r
    for r in roster:  # Canvas download names use the name lower-cased without spaces: "Smith, Jo" -> smithjo
        if _norm(r.get("Student", "")) == _norm(sid):
            return r
    return None


def read_roster(path: str | Path) -> list[dict]:
    """Rows of a Canvas gradebook export (the "Points Possible" and muted/test-student rows dropped)."""
    with Path(path).open(newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"Student", "ID"} <= set(rows[0]):
        raise LabkitError(f"{path} is not a Canvas gradebook export (columns Student, ID, SIS User ID, ...)")
    return [r for r in rows if r["Student"].strip() and "Points Possible" not in r["Student"]
            and r["Student"].strip() != "Student, Test"]


def canvas_csv(results: list, rows: dict[str, dict], *, title: str, points: float,
               roster: list[dict] | None = None, names: dict[str, dict] | None = None) -> tuple[str, list[str]]:
    """The Canvas gradebook import CSV (text) and the students it could not identify for Canvas."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*CANVAS_ID_COLUMNS, title])
    w.writerow(["    Points Possible", "", "", "", "", f"{points:g}"])
    unmatched = []
    for r in sorted(results, key=lambda x: x.student_id):
        total = rows.get(r.student_id, {}).get("total", r.score)
        cid = (names or {}).get(r.student_id, {}).get("canvas_id")
        hit = _roster_match(roster, r.student_id, cid) if roster else None
        if hit:
            w.writerow(shown.csv_row([hit.get(c, "") for c in CANVAS_ID_COLUMNS] + [f"{total:g}"]))
            continue
        if roster or not cid:
            unmatched.append(r.student_id)
        w.writerow(shown.csv_row([r.student_id, cid or "", "", r.student_id, "", f"{total:g}"]))
    return buf.getvalue(), unmatched


# ------------------------------------------------------------------------------------------------ Gradescope


def _check_output(c: dict) -> str:
    m = {k: v for k, v in (c.get("measurements") or {}).items() if isinstance(v, (int, float, str, bool))}
    nums = "; ".join(f"{k}: {v}" for k, v in list(m.items())[:12])
    # a person reads it on Gradescope: each piece on one line, so the student's words cannot forge another
    return shown.line(c.get("message") or "") + (f"\n{shown.line(nums)}" if nums else "")


def gradescope_results(res, row: dict | None = None, calls: list[dict] | None = None) -> dict:
    """results.json (Gradescope autograder spec) for one graded student: one test per grade cell, its output
    the messages and measurements of the checks that cell calls (`calls`: class.json's cell/check pairs)."""
    row = row or {}
    by_check = {c["check"]: c for c in res.checks}
    tests = []
    given = row.get("manual_scores") or {}  # the done-marker predates the instructor's grades of written answers
    for i, cell in enumerate(res.cells, 1):
        if cell["cell"] in given:
            cell = dict(cell, score=given[cell["cell"]], needs_manual=False, source=manual.SOURCE)
        names = [c["check"] for c in calls or [] if c["cell"] == cell["cell"]]
        out = "\n".join(_check_output(by_check[n]) for n in names if n in by_check) or manual.cell_note(cell)
        tests.append({"name": cell["cell"], "number": str(i), "score": float(cell["score"]),
                      "max_score": float(cell["max_score"]), "output": out, "visibility": "visible"})
    if row.get("extra_credit"):
        tests.append({"name": "extra credit (bonus tier)", "score": float(row["extra_credit"]), "max_score": 0.0,
                      "output": ", ".join(b["check"] for b in row.get("extra_credit_from", [])),
                      "visibility": "visible"})
    if row.get("late_penalty"):
        tests.append({"name": "late penalty", "score": -float(row["late_penalty"]), "max_score": 0.0,
                      "output": shown.line(row.get("late_note", "")), "visibility": "visible"})
    output = [res.message or f"{res.score:g} / {res.max_score:g} points"]
    if res.status != "graded":
        output.append(f"not graded: {res.cause}")
    output += [n for n in res.notes] + ([row["late_note"]] if row.get("late_note") else [])
    if row.get("provisional"):
        output.append(_provisional(row))
    # No execution_time: the run's wall time includes the hidden checks', which a hand-in can stretch by its inputs
    return {"score": float(row.get("total", res.score)),
            "output": "\n".join(map(shown.line, output)), "visibility": "visible", "stdout_visibility": "hidden",
            "tests": tests, "extra_data": {"checks": res.checks, "hardware": res.hardware,
                                           "provisional": bool(row.get("provisional")),
                                           "pending_manual_points": row.get("pending_manual_points", 0.0)}}


def _provisional(row: dict) -> str:
    return (f"provisional total: {row['pending_manual_points']:g} points of written answers need manual grading "
            "and are not counted yet")


def _cell_points(source_nb: Path) -> dict[str, float]:
    cells = json.loads(source_nb.read_text())["cells"]
    return {c["metadata"]["nbgrader"]["grade_id"]: float(c["metadata"]["nbgrader"].get("points", 0))
            for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")}


def _written_cells(source_nb: Path) -> dict[str, float]:
    """grade_id -> points of the manually graded answer cells (grade and solution) of a source notebook."""
    cells = json.loads(source_nb.read_text())["cells"]
    meta = [c.get("metadata", {}).get("nbgrader", {}) for c in cells]
    return {m["grade_id"]: float(m.get("points", 0)) for m, c in zip(meta, cells, strict=True)
            if m.get("grade") and m.get("solution") and c["cell_type"] == "markdown"}


GRADESCOPE_LABS = ("lab1", "lab2", "lab3")  # gradable without a GPU; lab 4's and lab 5's speed tiers need one


def run_gradescope(lab: str, submission: str | Path, results_path: str | Path, *, course: str | Path | None = None,
                   sandbox: str = "auto", run_checks=None, open_kit: bool = False) -> dict:
    """Grade one Gradescope submission (a folder holding the lab's notebook or its student_*.py) with the
    trusted harness and write results.json; returns it. One test per test cell, scaled to the cell's points.
    A graded run: without a course secret it refuses unless `open_kit` (autograder.base.course_secret). Lab 3 is
    graded against the course's common variant (hand that one out: `python -m autograder variant lab3`)."""
    from autograder.base import course_secret
    from autograder.checks import harness, trusted

    if lab not in GRADESCOPE_LABS:
        raise LabkitError(f"{lab}: Gradescope runs labs {', '.join(GRADESCOPE_LABS)} (no GPU there; the speed "
                          "tiers of labs 4 and 5 need one: grade it with `python -m autograder grade` on a GPU machine)")
    course_secret.for_grading(open_kit)
    sandbox = gradescope_sandbox(sandbox)
    aid = harness.ASSIGNMENTS[lab]
    source_nb = Path(course or harness.ROOT / "assignments") / "source" / aid / f"{aid}.ipynb"
    calls = trusted.find_calls(source_nb)
    points = _cell_points(source_nb)
    sub = Path(submission)
    with tempfile.TemporaryDirectory(prefix="labkit-gs-") as tmp:
        student = _gradescope_student_file(sub, lab, aid, Path(tmp))
        verdicts = {}
        if student is not None:
            run = run_checks or harness.run_checks
            names = list(dict.fromkeys(c.check for c in calls))
            verdicts = dict(zip(names, run(names, student, sandbox=sandbox, device="cpu"), strict=True))
    tests, total = [], 0.0
    for i, call in enumerate(calls, 1):
        v = verdicts.get(call.check)
        pts = points.get(call.cell, 0.0)
        if v is None:
            score, out = 0.0, f"no {harness.STUDENT_FILES[lab]} found in the submission (hand in {aid}.ipynb)"
        else:
            frac = float(v.get("score", 0)) / float(v["max_score"]) if v.get("ok") and v.get("max_score") else 0.0
            score, out = round(pts * frac, 4), _check_output(v)
        total += score
        tests.append({"name": f"{call.cell} ({call.check})", "number": str(i), "score": score, "max_score": pts,
                      "output": out, "visibility": "after_due_date" if "hidden" in call.cell else "visible"})
    pending = _written_cells(source_nb)
    for cell, pts in pending.items():  # graded by a person in Gradescope (a manually graded question)
        tests.append({"name": f"{cell} (written answer)", "number": str(len(tests) + 1), "score": 0.0,
                      "max_score": pts, "output": manual.cell_note({"manual": True, "needs_manual": True,
                                                                    "max_score": pts}), "visibility": "visible"})
    note = (f"; provisional: {sum(pending.values()):g} points of written answers need manual grading"
            if pending else "") + (_gradescope_variant(sub) if lab == "lab3" else "")
    boxed = "in a sandbox (bubblewrap)" if sandbox == "bwrap" else "UNSANDBOXED (--sandbox none: submissions trusted)"
    result = {"score": round(total, 4), "output": f"{aid}: {total:g} / {sum(t['max_score'] for t in tests):g} "
                                                  f"points from the grader's own run of the checks, the student's "
                                                  f"code {boxed}" + note,
              "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}
    write_json(results_path, result)
    return result


def _gradescope_variant(sub: Path) -> str:
    """Gradescope grades lab 3 against the common variant: a hand-in whose slow_train.py carries another tag
    (a student's own handout, another course's) is said to be so, for a person, not graded silently."""
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    root = sub.resolve()
    slow = next((p for p in sorted(sub.rglob("slow_train.py")) if p.is_file() and root in p.resolve().parents), None)
    if slow is None:
        return ""
    with slow.open("rb") as f:
        tag = lab3_variants.read_tag(f.read(400).decode("utf-8", "replace"))
    if tag is None or tag == lab3_variants.variant_tag(None, course_secret.load(graded=False)):
        return ""
    return ("; VARIANT MISMATCH: the hand-in's slow_train.py is not the course's common variant, which Gradescope "
            "grades lab 3 against (a per-student handout or another course's): ask your instructor")


def gradescope_sandbox(sandbox: str) -> str:
    """The sandbox a Gradescope run grades in: "bwrap", or "none" only when asked for by name.

    "auto" used to fall back to no sandbox where bubblewrap could not start (a container without user namespaces):
    a submission then ran as the grader, beside the course secret and the trusted checks, and could outlive the
    run to rewrite results.json. Now that stops the run before any student code runs, with the fix in the
    message; Gradescope then reports that its autograder failed, not a grade."""
    from autograder.sandbox.jail import probe

    if sandbox not in ("auto", "bwrap", "none"):
        raise LabkitError(f"--sandbox {sandbox!r}: choose auto, bwrap or none")
    if sandbox == "none":
        return sandbox
    why = probe()
    if why:
        raise LabkitError(f"cannot sandbox the submission here: {why}. Install bubblewrap in the autograder image "
                          "(apt-get install bubblewrap) on a machine that allows user namespaces, or pass "
                          "--sandbox none if you trust every submission (its code then runs unconfined, as the "
                          "grader, where it can read the course secret and the checks)")
    return "bwrap"


def _gradescope_student_file(sub: Path, lab: str, aid: str, tmp: Path) -> Path | None:
    from autograder.checks import harness

    want = harness.STUDENT_FILES[lab]
    root = sub.resolve()
    # only files that are inside the submission: a symlink in the upload could name the course's own source
    # notebook (its solutions) or any other file of the grading machine
    mine = [p for p in sorted(sub.rglob("*")) if p.is_file() and root in p.resolve().parents]
    nbs = [p for p in mine if p.suffix == ".ipynb"]
    nb = next((p for p in nbs if p.name == f"{aid}.ipynb"), nbs[0] if len(nbs) == 1 else None)
    if nb is not None:
        try:
            return harness.student_file_from_notebook(nb, tmp)
        except Exception:  # a notebook without the cell: fall back to a handed-in file below
            pass
    direct = next((p for p in mine if p.name == want), None)
    if direct is not None:
        return Path(shutil.copy(direct, tmp / want))
    return None


# ------------------------------------------------------------------------------------------------ bundles


def _bundle_box(res, row: dict) -> str:
    e = shown.html
    items = [f"<li>autograded score: {res.score:g} / {res.max_score:g}</li>"]
    if row.get("extra_credit"):
        items.append(f"<li>extra credit (bonus tier): +{row['extra_credit']:g}</li>")
    if row.get("late_note"):
        items.append(f"<li>{e(row['late_note'])}</li>")
    if row.get("provisional"):
        items.append(f"<li><b>{e(_provisional(row))}</b></li>")
    elif row.get("manual_points") is not None and any(c.get("manual") for c in res.cells):
        items.append(f"<li>written answers, graded by an instructor: {row['manual_points']:g} points</li>")
    if row.get("not_gradable_here"):  # a GPU check on a CPU grader, or a timing the busy machine made too noisy
        where = [f"{c} (to be regraded on a GPU)" if c in gpu_policy.NEEDS_GPU else
                 f"{c} (to be timed again on a quiet machine)" for c in row["not_gradable_here"]]
        items.append(f"<li>not gradable on the grading machine: {e(', '.join(where))}</li>")
    return (f"<div id='labkit-final' style='border:2px solid #274;padding:10px;margin:10px;font-family:sans-serif'>"
            f"<h2>{e(res.assignment)}: total {row.get('total', res.score):g} points</h2><ul>{''.join(items)}</ul></div>")


def feedback_bundles(out: str | Path, dest: str | Path, *, submissions: str | Path | None = None,
                     lms_regex: str = intake.LMS_REGEX) -> Path:
    """Per student: `<dest>/<id>/<prefix>feedback.html` (the feedback page with the total, extra credit and late
    note on top) and `<prefix>measurements.json`; plus `<dest>/feedback_bundles.zip` of all of them. `prefix`
    is the student's Canvas download prefix (`name_12345_678_`) when known, so Canvas's "Re-Upload
    Submissions" attaches each file to its student; else `<id>_<assignment>_`. Returns the zip's path."""
    out, dest = Path(out), Path(dest)
    results, rows, _ = load_class(out)
    names = lms_names(submissions, lms_regex)
    dest.mkdir(parents=True, exist_ok=True)
    zpath = dest / "feedback_bundles.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as zf:
        for res in results:
            row = rows.get(res.student_id, {})
            prefix = names.get(res.student_id, {}).get("prefix") or f"{res.student_id}_{res.assignment}_"
            sdir = dest / res.student_id
            sdir.mkdir(parents=True, exist_ok=True)
            pages = sorted((out / "feedback" / res.student_id).rglob("*.html"))
            body = manual.settle_page("".join(p.read_text(encoding="utf-8", errors="replace") for p in pages[:1]),
                                      res, row)
            page = _bundle_box(res, row)
            m = re.search(r"<body[^>]*>", body)
            page = body[:m.end()] + page + body[m.end():] if m else \
                f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{page}{body}</body></html>"
            meas = {"student_id": res.student_id, "assignment": res.assignment, "status": res.status,
                    "score": res.score, "max_score": res.max_score, "total": row.get("total", res.score),
                    "extra_credit": row.get("extra_credit", 0), "provisional": bool(row.get("provisional")),
                    "pending_manual_points": row.get("pending_manual_points", 0.0), "late": {k: row.get(k) for k in (
                        "submitted_at", "time_source", "days_late", "late_penalty", "late_note")},
                    "hardware": res.hardware, "checks": res.checks, "notes": res.notes}
            for name, data in ((f"{prefix}feedback.html", page.encode("utf-8")),
                               (f"{prefix}measurements.json", (json.dumps(meas, indent=2, default=str) + "\n").encode())):
                (sdir / name).write_bytes(data)
                zf.writestr(name, data)
    return zpath


def export(out: str | Path, to: str, dest: str | Path, *, title: str | None = None, roster: str | None = None,
           submissions: str | Path | None = None, lms_regex: str = intake.LMS_REGEX) -> list[str]:
    """Write one export of a graded class into `dest`; returns lines for the instructor."""
    results, rows, final = load_class(out)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if to == "canvas":
        text, unmatched = canvas_csv(results, rows, title=title or final["assignment"], points=final["max_score"],
                                     roster=read_roster(roster) if roster else None,
                                     names=lms_names(submissions, lms_regex, roster))
        (dest / "canvas_grades.csv").write_text(text, encoding="utf-8")
        lines = [f"wrote {dest / 'canvas_grades.csv'}: {len(results)} students (Canvas: Grades > Import)"]
        provisional = [r.student_id for r in results if rows.get(r.student_id, {}).get("provisional")]
        if provisional:
            lines.append(f"PROVISIONAL totals (written answers not graded yet; re-export after grading them): "
                         f"{', '.join(provisional)}")
        ungradable = [r.student_id for r in results if rows.get(r.student_id, {}).get("not_gradable_here")]
        if ungradable:  # --allow-ungradable on the wrong machine: those checks' 0 is not the student's
            lines.append("NOT GRADABLE ON THIS HARDWARE: checks scored 0 here until regraded where they can run "
                         "(grade --only ID... --force on a GPU machine, then export again): "
                         f"{', '.join(shown.name(i) for i in ungradable)}")
        if unmatched:
            lines.append(f"not identified for Canvas (no roster row / Canvas id): {', '.join(unmatched)}")
        return lines
    if to == "gradescope":
        calls = json.loads((Path(out) / classbook.MANIFEST).read_text()).get("calls", [])
        for res in results:
            write_json(dest / res.student_id / "results.json",
                       gradescope_results(res, rows.get(res.student_id), calls))
        return [f"wrote {len(results)} results.json files under {dest}/<student>/"]
    if to == "feedback":
        z = feedback_bundles(out, dest, submissions=submissions, lms_regex=lms_regex)
        return [f"wrote feedback bundles for {len(results)} students under {dest}/<student>/ and {z}"]
    raise LabkitError(f"unknown export {to!r}: canvas, gradescope or feedback")

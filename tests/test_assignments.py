"""The nbgrader course, tested the way nbgrader tests itself: for every lab, generate the release, then autograde
two submissions (the reference solution and the untouched release) and check every cell's score: the source
passes every test, the release none. (`nbgrader validate` says the same from one run each; the toy course in
tests/test_autograder.py checks that command.) All of it in a copy of assignments/ under a temporary folder, so
no gradebook, release or autograded folder ever appears in the repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
LABS = ["lab1_loss_scaling", "lab2_data_pipeline", "lab3_profile_fix", "lab4_speedrun", "lab5_fused_kernel"]
# Cells whose check needs hardware this machine may lack: on a CPU they score 0 with a clear message.
NEEDS_CUDA = {"test_lab4_speed", "test_lab5_speed"}
NBGRADER = str(Path(sys.executable).with_name("nbgrader"))


def _cells(nb_path: Path):
    return nbformat.read(nb_path, as_version=4).cells


def _grade_cells(nb_path: Path) -> dict[str, dict]:
    """The test cells (graded code); written answers (graded markdown solutions) are `_written_cells`."""
    return {c.metadata["nbgrader"]["grade_id"]: c for c in _cells(nb_path)
            if c.metadata.get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution")}


def _written_cells(nb_path: Path) -> dict[str, dict]:
    return {c.metadata["nbgrader"]["grade_id"]: c for c in _cells(nb_path) if c.cell_type == "markdown"
            and c.metadata.get("nbgrader", {}).get("grade") and c.metadata["nbgrader"].get("solution")}


def _run(args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TQDM_DISABLE="1", LABKIT_QUICK="1", MPLBACKEND="Agg")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([NBGRADER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("course") / "assignments"
    shutil.copytree(COURSE, dest, ignore=shutil.ignore_patterns("release", "autograded", "submitted", "feedback",
                                                                "gradebook.db", "student_*.py", "__pycache__"))
    return dest


def test_source_notebooks_follow_the_conventions():
    from autograder.checks.harness import ASSIGNMENTS, CHECKS, STUDENT_FILES

    assert sorted(ASSIGNMENTS.values()) == LABS
    used = set()
    for prefix, lab in ASSIGNMENTS.items():
        nb_path = COURSE / "source" / lab / f"{lab}.ipynb"
        cells = _cells(nb_path)
        assert all(not c.get("outputs") and not c.get("execution_count") for c in cells if c.cell_type == "code")
        writefile = [c for c in cells if c.source.startswith("%%writefile")]
        assert len(writefile) == 1 and writefile[0].source.splitlines()[0] == f"%%writefile {STUDENT_FILES[prefix]}"
        assert writefile[0].metadata["nbgrader"]["solution"] and "### BEGIN SOLUTION" in writefile[0].source
        for gid, cell in _grade_cells(nb_path).items():
            calls = re.findall(r'grade\("([\w.]+)", "([\w.]+)", points=(\d+(?:\.\d+)?)\)', cell.source)
            assert len(calls) == 1, f"{lab}/{gid}: one harness call per test cell"
            check, student_file, points = calls[0]
            assert check in CHECKS and check.startswith(prefix + ".") and student_file == STUDENT_FILES[prefix]
            # The partial credit grade() returns is in the cell's points: they must agree.
            assert float(points) == cell.metadata["nbgrader"]["points"], f"{lab}/{gid}"
            assert cell.metadata["nbgrader"]["locked"]
            used.add(check)
    course = {c for c in CHECKS if not c.startswith("toy.")}  # toy.*: the grader's rehearsal, not the course
    assert used == course, f"checks no notebook uses: {course - used}"


def test_lab3_hands_out_the_open_kit_variant_of_the_slow_script():
    from autograder.checks import lab3_variants

    assert (COURSE / "source" / "lab3_profile_fix" / "slow_train.py").read_text() == \
        lab3_variants.render(lab3_variants.CLASSIC)


def test_course_config_sets_the_policies():
    cfg = (COURSE / "nbgrader_config.py").read_text()
    for needle in ("c.Execute.timeout", "add_missing_cells = True", "ClearSolutions.code_stub", "TQDM_DISABLE"):
        assert needle in cfg
    ignored = (COURSE / ".gitignore").read_text()
    for needle in ("gradebook.db", "release/", "autograded/", "submitted/", "student_*.py"):
        assert needle in ignored


@pytest.mark.parametrize("lab", LABS)
def test_generate_and_autograde(course, lab):
    from autograder.checks.harness import STUDENT_FILES

    src = course / "source" / lab / f"{lab}.ipynb"
    # What running the source leaves beside it (its %%writefile cell): the reference module, never to be released.
    (src.parent / STUDENT_FILES[lab.split("_")[0]]).write_text("# the reference solution\n")

    gen = _run(["generate_assignment", lab, "--force"], course)
    assert gen.returncode == 0, gen.stderr[-2000:]
    release = course / "release" / lab / f"{lab}.ipynb"
    assert release.exists()
    released = release.read_text()
    assert "BEGIN SOLUTION" not in released and "BEGIN HIDDEN TESTS" not in released
    assert "raise NotImplementedError()" in released
    assert not list(release.parent.glob("student_*.py")), "the reference module must not travel with the release"

    # Two submissions: the reference solution and the release as handed out (with its data files).
    for student, nb in [("reference", src), ("untouched", release)]:
        dest = course / "submitted" / student / lab
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(release.parent, dest)
        shutil.copy(nb, dest / f"{lab}.ipynb")
    auto = _run(["autograde", lab, "--force"], course)
    assert auto.returncode == 0, auto.stderr[-3000:]

    from nbgrader.api import Gradebook

    cuda = torch.cuda.is_available()
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        ref = gb.find_submission_notebook(lab, lab, "reference")
        blank = gb.find_submission_notebook(lab, lab, "untouched")
        ref_scores = {g.name: (g.score, g.max_score) for g in ref.grades}
        blank_scores = {g.name: g.score for g in blank.grades}
        pending = {g.name for g in ref.grades if g.needs_manual_grade}
    assert ref_scores and set(ref_scores) == set(blank_scores)
    written = set(_written_cells(src))
    assert written and written <= pending, f"{lab}: the written answers {written} are not left for manual grading"
    for name, (score, max_score) in ref_scores.items():
        if name in written:  # graded by a person: nbgrader leaves it for manual grading
            assert score is None or score == 0, f"{lab}/{name}: a written answer scored by the autograder"
        elif name in NEEDS_CUDA and not cuda:
            assert score == 0, f"{lab}/{name}: an ungradable check must not earn points"
        else:
            assert score == max_score, f"{lab}/{name}: reference got {score} of {max_score}"
    assert all(v == 0 for v in blank_scores.values()), blank_scores

    graded = course / "autograded" / "reference" / lab / f"{lab}.ipynb"
    if not cuda:
        for gid, cell in _grade_cells(graded).items():
            if gid in NEEDS_CUDA:
                assert "not gradable on this hardware" in json.dumps(cell.outputs), f"{lab}/{gid}"
    # No test cell of the reference wrote to stderr (that alone would score 0).
    for gid, cell in _grade_cells(graded).items():
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], f"{lab}/{gid} wrote to stderr"


def _notebook_text(lab: str) -> str:
    return "\n".join(c.source for c in _cells(COURSE / "source" / lab / f"{lab}.ipynb"))


def test_lab1_states_where_fp16_rounds_to_zero_as_torch_rounds():
    """fp16 rounds to nearest even: values above 2^-25 round up to the smallest subnormal 2^-24, not to 0."""
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0**-10
    assert tiny == 2.0**-24
    mid = torch.tensor(2.0**-25)
    above = torch.nextafter(mid, torch.tensor(1.0))
    assert torch.stack([mid, above, torch.tensor(3e-8)]).half().tolist() == [0.0, tiny, tiny]
    text = _notebook_text("lab1_loss_scaling")
    flat = " ".join(text.split())
    # The wrong claim, in the words it was made in: everything below the smallest subnormal becomes 0.
    assert not re.search(r"(below|under|smaller than)[^.]{0,40}(6e-8|2\^-24)[^.]{0,25}(to zero|to 0)", flat), flat
    assert "flushes" not in flat
    assert "2^-25" in flat and "rounds up to 2^-24" in flat
    # ... and the notebook computes both thresholds rather than typing them.
    assert "torch.finfo(torch.float16).smallest_normal" in text and "torch.nextafter" in text


def _handin_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _tiny_lab(folder: Path, lab: str) -> Path:
    """A lab-shaped notebook with no outputs: its %%writefile cell, one printing cell, the released hand-in cell."""
    from labkit.notebooks import handin_source

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%%writefile student_scaler.py\nx = 1"),
                nbformat.v4.new_code_cell("print('my measurement: 1.23 ms')"),
                nbformat.v4.new_code_cell(handin_source(lab))]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{lab}.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_hand_in_refuses_a_saved_notebook_without_outputs_and_says_how_to_hand_in(tmp_path, monkeypatch, capsys):
    from labkit import handin

    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    lab = "lab1_loss_scaling"
    path = _tiny_lab(tmp_path, lab)
    assert handin.save(lab, tmp_path) is None and not (tmp_path / f"{lab}_handin.zip").exists()
    err = " ".join(capsys.readouterr().err.split())
    assert "NO HAND-IN WRITTEN" in err and "no outputs" in err and "Ctrl+S" in err
    assert f"jupyter nbconvert --to notebook --execute --inplace --allow-errors {lab}.ipynb" in err
    assert f"python -m labkit.handin {lab}" in err
    # Once saved with outputs, the same call writes the zip, outputs included.
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="my measurement: 1.23 ms\n")]
    nbformat.write(nb, path)
    out = handin.save(lab, tmp_path)
    with zipfile.ZipFile(out) as z:
        assert "my measurement" in z.read(f"{lab}.ipynb").decode()


def test_a_headless_run_hands_in_its_outputs_by_the_steps_the_hand_in_cell_gives(tmp_path):
    """`nbconvert --execute --inplace`: the hand-in cell, run before the outputs are saved, names the next step
    without the alarm a forgotten save gets (the line is in the handed-in notebook); the command line it names
    then zips the executed notebook, outputs included."""
    lab = "lab1_loss_scaling"
    _tiny_lab(tmp_path, lab)
    nbconvert = str(Path(sys.executable).with_name("jupyter-nbconvert"))
    run = subprocess.run([nbconvert, "--to", "notebook", "--execute", "--inplace", f"{lab}.ipynb"], cwd=tmp_path,
                         env=_handin_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]  # the refusal never stops the run that saves the outputs
    executed = nbformat.read(tmp_path / f"{lab}.ipynb", as_version=4)
    said = json.dumps(executed.cells[-1].outputs)
    assert "Headless run" in said and f"python -m labkit.handin {lab}" in said and "NO HAND-IN" not in said
    assert not (tmp_path / f"{lab}_handin.zip").exists()
    cli = subprocess.run([sys.executable, "-m", "labkit.handin", lab], cwd=tmp_path, env=_handin_env(),
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    with zipfile.ZipFile(tmp_path / f"{lab}_handin.zip") as z:
        assert "my measurement: 1.23 ms" in z.read(f"{lab}.ipynb").decode()


def _lab3_cell(cell_id: str) -> str:
    return next(c.source for c in _cells(COURSE / "source" / "lab3_profile_fix" / "lab3_profile_fix.ipynb")
                if c.get("id") == cell_id)


def test_lab3_tells_one_timing_story_in_the_notebook_and_the_public_check():
    """The Try-it cell and the release's speed check make the same call and print the same line, and the notebook
    describes that timing in the words the check prints (lab3.TIMING)."""
    import inspect

    from autograder import selfcheck_labs
    from autograder.student import lab3

    flat = " ".join(_notebook_text("lab3_profile_fix").split())
    assert " ".join(lab3.TIMING.split()).replace("both loops", "time both loops") in flat
    try_it = _lab3_cell("4b59557c")
    assert "lab3_public.compare_speed(slow_train.train, student_fix.train)" in try_it
    assert "describe_speed(ab)" in try_it and "bench.compare" not in try_it
    check = inspect.getsource(selfcheck_labs.lab3_speedup)
    assert "lab3.compare_speed(" in check and "lab3.describe_speed(" in check and "lab3.TIMING" in check
    assert "alternate(" not in check
    # The notebook says where the grader's timing differs (a process each), not that the public check does that.
    assert "each in its own process, interleaved (CPU" not in flat


def test_lab3_public_timing_runs_on_one_thread_and_restores_the_count():
    from autograder.checks import lab3_variants
    from autograder.student import lab3

    slow = lab3_variants.load(lab3_variants.CLASSIC).train
    seen = []

    def fixed(*a, **k):
        seen.append(torch.get_num_threads())
        return slow(*a, **k)

    before = torch.get_num_threads()
    ab = lab3.compare_speed(slow, fixed, rounds=3, steps=1)
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert len(ab.ratios) == 3 and ab.ratio > 0 and ab.ratio_iqr >= 0
    line = lab3.describe_speed(ab)
    assert line.startswith(f"{ab.ratio:.2f}x the slow script (IQR ") and "ms per step" in line
    with pytest.raises(ValueError, match="rounds >= 3"):
        lab3.compare_speed(slow, fixed, rounds=1)


def test_lab3s_profile_cell_lists_every_marked_site(tmp_path):
    """The profile cell's line-by-line listing has a row for each of the nine marked sites of slow_train.py."""
    shutil.copy(COURSE / "source" / "lab3_profile_fix" / "slow_train.py", tmp_path / "slow_train.py")
    (tmp_path / "cell.py").write_text(_lab3_cell("f33a351c"))
    env = dict(os.environ, LABKIT_QUICK="1", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "cell.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    listing = out.stdout.split("site  line")[-1]
    sites = re.findall(r"^\s+([A-I])\s+\d+\s+\d+", listing, flags=re.M)
    assert sorted(sites) == list("ABCDEFGHI"), listing
    assert "gpuGetDeviceCount" not in out.stderr  # the profiler's CUDA probe is silenced on a CPU


def test_lab3_says_what_is_expected_of_the_per_batch_copy_as_the_answer_key_scores_it(monkeypatch):
    """`x.to(device)` is a host sync on a GPU (a blocking copy synchronizes the stream): the notebook says so, and
    says how bottlenecks() scores it, which must be what the checks do: named "sync" or "data" it neither counts
    nor costs (an honest GPU profile shows it), named anything else it is a false alarm."""
    from autograder.checks import lab3_variants

    assert "to_device" in lab3_variants.DECOYS and "to_device" not in lab3_variants.FORMS
    key = lab3_variants.answer_key(lab3_variants.CLASSIC)
    slow = (COURSE / "source" / "lab3_profile_fix" / "slow_train.py").read_text()
    copy_site = re.search(r"x\.to\(device\), y\.to\(device\)  # \[([A-I])\]", slow).group(1)
    assert copy_site not in key
    flat = " ".join(_notebook_text("lab3_profile_fix").split())
    assert "synchronizes the stream" in flat and 'set_sync_debug_mode("warn")' in flat
    assert "naming the copy's marked line as `\"sync\"` or `\"data\"` neither earns nor costs a point" in flat
    assert lab3_variants.neutral_sites(lab3_variants.CLASSIC) == {copy_site: ("sync", "data")}
    from types import SimpleNamespace

    from autograder.checks import lab3_checks

    monkeypatch.setattr(lab3_checks, "variant", lambda _ctx: (lab3_variants.CLASSIC,))

    def graded(answers):
        ctx = SimpleNamespace(call=lambda *_: {"type": "dict", "pairs": [list(p) for p in answers.items()]})
        return lab3_checks.check_answers(ctx)

    full = {k: v[0] for k, v in key.items()}
    assert graded(full)["fraction"] == 1.0
    assert graded({**full, copy_site: "sync"})["fraction"] == 1.0
    assert graded({**full, copy_site: "sync"})["measurements"]["neutral"] == [copy_site]
    assert graded({**full, copy_site: "compute"})["fraction"] == 0.75

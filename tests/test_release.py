"""The student release: built once into a temporary folder under a course secret, with a roster, scanned for every
kind of leak (and the scan shown to catch planted ones, the secret itself among them), then installed alone in a
fresh virtual environment where each lab's public checks run. Lab 3's public checks compare with the student's
own slow_train.py, and a banned labkit import fails there with the grader's words."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from autograder import labkit_answers, selfcheck
from autograder.base import course_secret
from autograder.checks import harness, lab3_variants
from autograder.checks.harness import CHECKS, STUDENT_FILES, student_file_from_notebook
from autograder.release import build as release
from autograder.selfcheck import PUBLIC
from labkit import notebooks
from labkit.errors import LabkitError

ROOT = release.ROOT
SECRET = "the release tests' course secret, 0123456789"  # as an instructor would export it
ROSTER = ["alice", "bob"]
PREFIX = {v: k for k, v in {"lab1": "lab1_loss_scaling", "lab2": "lab2_data_pipeline", "lab3": "lab3_profile_fix",
                            "lab4": "lab4_speedrun", "lab5": "lab5_fused_kernel"}.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(folder, archive) of a release built as a graded course's instructor builds it: secret set, with a roster."""
    out = tmp_path_factory.mktemp("dist")
    roster = out.parent / "roster.csv"
    roster.write_text("student_id,name\n" + "".join(f"{s},{s.title()}\n" for s in ROSTER))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(course_secret.ENV, SECRET)
        folder, archive = release.build(out, roster=roster)
    return folder, archive


@pytest.fixture
def secret_set(monkeypatch):
    """The course secret of the build, for the tests that compute its needles."""
    monkeypatch.setenv(course_secret.ENV, SECRET)


def _hidden_calls() -> set[str]:
    """The checks the source notebooks call inside nbgrader's hidden-test regions (how hidden tests are marked)."""
    found = set()
    for lab in release.LABS:
        for c in json.loads((ROOT / "assignments" / "source" / lab / f"{lab}.ipynb").read_text())["cells"]:
            for region in re.findall(r"BEGIN HIDDEN TESTS(.*?)END HIDDEN TESTS", "".join(c["source"]), flags=re.S):
                found |= set(re.findall(r'grade\("([\w.]+)"', region))
    return found


def test_release_holds_the_course_for_students(built):
    folder, archive = built
    files = {f["path"] for f in json.loads((folder / "MANIFEST.json").read_text())["files"]}
    assert {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")} <= files
    assert len([f for f in files if f.startswith("notebooks/")]) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    for lab in release.LABS:
        assert f"labs/{lab}/{lab}.ipynb" in files
    assert "labs/lab3_profile_fix/slow_train.py" in files and "labkit/results/ladder.json" in files
    assert {"autograder/harness.py", "autograder/selfcheck.py", "pyproject.toml", "README.md"} <= files
    assert not [f for f in files if Path(f).name.startswith("student_") or re.search(r"lab\d_checks", f)]
    assert not [f for f in files if f.startswith("autograder/") and Path(f).name in ("runner.py", "jail.py", "grade.py")]
    assert not [f for f in files if Path(f).name in {Path(n).name for n in release.INSTRUCTOR_ONLY}]  # the generator, the secret's module
    assert "autograder/labkit_answers.py" in files  # the public checks' ban, in the grader's words
    with tarfile.open(archive) as tf:
        names = {m.name for m in tf.getmembers() if m.isfile()}
    top = f"labkit-student-{release.version()}"
    assert names == {f"{top}/{f}" for f in files | {"MANIFEST.json"}}


def test_release_ships_the_weeks_with_blank_answers_and_the_recorded_artifacts_they_read(built):
    """A CPU student reads week 3's snapshots and week 5's traces; no weekly notebook holds a worked answer."""
    from labkit import exercises as ex
    from labkit.bench import result_path

    folder, _ = built
    for d in release.ARTIFACT_DIRS:
        src = sorted(p.name for p in result_path(d, results_dir=ROOT / "benchmarks" / "results").iterdir() if p.is_file())
        assert src and sorted(p.name for p in (folder / "labkit" / "results" / d).iterdir()) == src
        assert f'"results/{d}/*"' in (folder / "pyproject.toml").read_text()  # installed with the package
    for nb in (folder / "notebooks").glob("*.ipynb"):
        text = nb.read_text()
        assert ex.SOLUTION_BEGIN not in text and "BEGIN SOLUTION" not in text, nb.name
        if ex.SOLUTION_BEGIN in (ROOT / "notebooks" / nb.name).read_text():
            assert "raise NotImplementedError()" in text, nb.name


def test_every_hidden_check_is_a_needle_and_none_is_public():
    hidden = _hidden_calls()
    assert hidden, "the source notebooks mark hidden tests with BEGIN HIDDEN TESTS"
    assert hidden <= set(release._hidden_checks(ROOT)) and not hidden & set(PUBLIC)
    assert set(PUBLIC) | set(release._hidden_checks(ROOT)) == {n for n in CHECKS if n.startswith("lab")}
    needles = release.needles()
    for name in release._hidden_checks(ROOT):
        assert name in needles and CHECKS[name].func in needles
    assert "ANSWER_KEY" in needles and "RefStaticScaler" in needles and "BEGIN SOLUTION" in needles
    assert any("hidden probe value" in why for why in needles.values())


def test_scan_finds_no_leak_in_the_folder_or_the_archive(built, secret_set):
    folder, archive = built
    assert release.scan(folder) == []
    assert release.scan(archive.parent) == []


def test_scan_catches_each_kind_of_leak(built, tmp_path, secret_set):
    folder, _ = built
    needles = release.needles()
    value = next(k for k, why in needles.items() if "hidden probe value" in why)
    line = next(k for k, why in needles.items() if "line of the trusted lab1_checks.py" in why)
    generator = next(k for k, why in needles.items() if "variant generator" in why)
    derived = next(k for k, why in needles.items() if "derived from the course secret" in why)
    key = {k: v[0] for k, v in lab3_variants.answer_key(lab3_variants.spec_for(None)).items()}
    solution = "\n".join(sorted(release.solution_lines())[:release.SOLUTION_BLOCK])
    plants = {"### BEGIN SOLUTION": "solution region", solution: "solution code", "lab1.scaler_edge_cases": "hidden check",
              "ANSWER_KEY = {}": "answer key", line: "trusted module", value: "hidden probe value",
              "kw, cases = hidden_edge_cases()": "hidden function", f"KEY = {SECRET!r}": "course secret",
              'course_secret.rng("lab1.hidden/edge_cases")': "HMAC label", derived: "derived value",
              generator: "variant generator", f"x = {key!r}": "common variant answer key"}
    for text, kind in plants.items():
        copy = tmp_path / kind.replace(" ", "_")
        shutil.copytree(folder / "labs", copy)
        nb = copy / "lab1_loss_scaling" / "lab1_loss_scaling.ipynb"
        cells = json.loads(nb.read_text())
        cells["cells"][-1]["source"] = text.splitlines(keepends=True)  # as notebook JSON stores it
        nb.write_text(json.dumps(cells, indent=1))
        assert release.scan(copy), f"a planted {kind} went unnoticed"
    assert "test_lab1_hidden_edge_cases" in (folder / "labs" / "lab1_loss_scaling" / "lab1_loss_scaling.ipynb"
                                             ).read_text()  # a public cell id holds a hidden name: no leak


def test_the_release_embeds_no_secret_and_ships_the_courses_common_lab3(built, secret_set):
    folder, archive = built
    assert release.needles()[SECRET] == "the course secret itself"
    assert not [rel for rel, data in release._files(archive.parent) if SECRET.encode() in data]
    common = lab3_variants.render(lab3_variants.spec_for(None))
    assert (folder / release.LAB3_SLOW).read_text() == common != lab3_variants.render(lab3_variants.CLASSIC)
    for s in ROSTER:  # each student's own, beside the release and outside it
        assert (folder.parent / "lab3_handouts" / s / "slow_train.py").read_text() == lab3_variants.handout(s)
    with tarfile.open(archive) as tf:
        assert not [m.name for m in tf.getmembers() if "lab3_handouts" in m.name]
    assert not list(folder.rglob("lab3_handouts"))
    # On Colab the lab 3 setup cell fetches the release's own copy (from the published student release).
    url = notebooks.lab_file_url("lab3_profile_fix", "slow_train.py")
    assert url.endswith(f"{notebooks.student_repo()[0]}/{notebooks.student_repo()[1]}/{release.LAB3_SLOW}")
    assert url in notebooks.lab_setup_source("lab3_profile_fix")


def test_a_roster_needs_the_course_secret_and_is_read_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(release, "assemble", lambda *a, **k: pytest.fail("work started"))
    roster = tmp_path / "roster.csv"
    roster.write_text("student_id\nalice\n")
    with pytest.raises(LabkitError, match="need the course secret") as stop:
        release.build(tmp_path / "dist", roster=roster)
    assert f"export {course_secret.ENV}=" in str(stop.value) and "without --roster" in str(stop.value)
    monkeypatch.setenv(course_secret.ENV, SECRET)
    one = release.handouts(tmp_path / "handouts", roster)  # a class list of one: still <out>/<id>/slow_train.py
    assert one == [tmp_path / "handouts" / "alice" / "slow_train.py"] and one[0].read_text() == \
        lab3_variants.handout("alice")
    (tmp_path / "bad.csv").write_text("name\nalice\n")
    with pytest.raises(LabkitError, match="student_id"):
        release.build(tmp_path / "dist", roster=tmp_path / "bad.csv")


# ---------------------------------------------------------------------------------- the public checks themselves


def test_lab3_public_checks_compare_with_the_students_own_slow_train(tmp_path, secret_set):
    """A variant's reference fix passes the public check run against that variant's slow_train.py; the check reads
    the file beside the student's (a changed one changes the verdict), and says what to do when it is missing."""
    ref = student_file_from_notebook(ROOT / "assignments" / "source" / "lab3_profile_fix" / "lab3_profile_fix.ipynb",
                                     tmp_path).read_text()
    alice = lab3_variants.spec_for("alice")
    work = tmp_path / "alice"
    lab3_variants.write(work, ["alice"])
    fix = work / "student_fix.py"
    fix.write_text(lab3_variants.reference_fix(ref, alice))
    assert selfcheck.run_check("lab3.same_result", fix)["ok"]
    slow = work / "slow_train.py"
    slow.write_text(slow.read_text().replace("seed + epoch)", "seed + epoch + 1)"))  # another batch order
    v = selfcheck.run_check("lab3.same_result", fix)
    assert not v["ok"] and "the slow script gives" in v["message"], v
    slow.unlink()
    v = selfcheck.run_check("lab3.same_result", fix)
    assert not v["ok"] and "slow_train.py not found beside student_fix.py" in v["message"], v


def test_a_banned_labkit_import_fails_the_public_check_with_the_graders_words(tmp_path):
    f = tmp_path / "student_scaler.py"
    f.write_text("from labkit.loss_scaling import DynamicScaler, StaticScaler  # noqa\n")
    want = labkit_answers.message("lab1", ["loss_scaling"])
    public = selfcheck.run_checks(["lab1.static_scaler", "lab1.host_syncs"], f, timeout_s=5)
    graded = harness.run_checks(["lab1.static_scaler"], f, timeout_s=5)
    assert [v["message"] for v in public] == [want, want] == [want, graded[0]["message"]]
    assert not any(v["ok"] for v in public)


def test_build_refuses_an_unusable_out_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(release, "assemble", lambda *a, **k: pytest.fail("work started"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(LabkitError, match="not a folder"):
        release.build(blocker)
    with pytest.raises(LabkitError, match="is a file"):
        release.build(blocker / "dist")


# ---------------------------------------------------------------------------------- alone in a fresh venv


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv whose only view of the host is its third-party site-packages (torch, numpy, ...): not the
    repository and not the host's editable labkit (a plain path in a .pth file runs no other .pth)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    site = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = [p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
            if Path(p).is_dir() and not (Path(p) / "labkit" / "__init__.py").exists()]
    assert host and not any(Path(p).resolve() == ROOT for p in host)
    (Path(site) / "_host_packages.pth").write_text("\n".join(host) + "\n")
    return vpy


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PYTHONNOUSERSITE": "1", "TQDM_DISABLE": "1"}


def test_release_alone_in_a_fresh_venv_runs_each_labs_public_checks(built, tmp_path):
    folder, _ = built
    vpy = _fresh_venv(tmp_path)
    inst = subprocess.run([str(vpy), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                           str(folder)], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert inst.returncode == 0, inst.stderr[-2000:]
    where = subprocess.run([str(vpy), "-c", "import labkit, autograder, autograder.harness as h; "
                            "print(labkit.__file__, autograder.__file__, h.grade.__module__)"],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    paths = where.stdout.split()
    assert where.returncode == 0 and len(paths) == 3, where.stderr[-1500:]
    assert all(str(tmp_path / "venv") in p for p in paths[:2]) and paths[2] == "autograder.selfcheck", paths
    for mod in ("lab1_checks", "lab3_variants", "course_secret"):
        gone = subprocess.run([str(vpy), "-c", f"import autograder.{mod}"], capture_output=True, text=True,
                              env=_env(), cwd=tmp_path, timeout=120)
        assert "ModuleNotFoundError" in gone.stderr, mod
    (tmp_path / "banned.py").write_text("import labkit.amp\n")
    out = subprocess.run([str(vpy), "-m", "autograder.harness", "lab1", "banned.py", "--json"], capture_output=True,
                         text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert {v["message"] for v in json.loads(out.stdout)} == {labkit_answers.message("lab1", ["amp"])}
    for lab in release.LABS:
        prefix = PREFIX[lab]
        for kind, nb in [("reference", ROOT / "assignments" / "source" / lab / f"{lab}.ipynb"),
                         ("blank", folder / "labs" / lab / f"{lab}.ipynb")]:
            work = tmp_path / kind / lab
            shutil.copytree(folder / "labs" / lab, work)
            student = student_file_from_notebook(nb, work)
            assert student.name == STUDENT_FILES[prefix]
            # The README's command, in the lab's folder (lab 3's: beside the release's slow_train.py).
            out = subprocess.run([str(vpy), "-m", "autograder.harness", prefix, student.name, "--json"],
                                 capture_output=True, text=True, env=_env(), cwd=work, timeout=600)
            verdicts = json.loads(out.stdout)
            assert [v["check"] for v in verdicts] == [n for n in PUBLIC if n.startswith(prefix + ".")]
            if kind == "reference":
                assert out.returncode == 0 and all(v["ok"] or not v["gradable"] for v in verdicts), verdicts
            else:
                assert out.returncode == 1 and not any(v["ok"] for v in verdicts), verdicts


def test_student_facing_docs_point_at_the_release_never_at_the_solutions():
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                                                   *(ROOT / "notebooks").glob("*.ipynb")]}
    texts["release README"] = release._readme(release.version(), "owner/name-student")
    assert not [name for name, text in texts.items() if "assignments/source" in text]
    # A notebook's "graded lab N" names the lab's folder in the release; the repository's `assignments/` is not there.
    notebooks = {name: text for name, text in texts.items() if name.startswith("notebooks/")}
    assert not [name for name, text in notebooks.items() if "`assignments/" in text]
    for number, lab in enumerate(release.LABS, 1):
        pointers = [name for name, text in notebooks.items() if f"raded lab {number}" in text]
        assert pointers and all(f"labs/{lab}" in notebooks[name] for name in pointers), (lab, pointers)
    readme = (ROOT / "README.md").read_text()
    assert "make student" in readme and "assignments/README.md#running-a-course" in readme
    command = "python -m autograder.harness lab1 student_scaler.py"  # run as written by the fresh-venv test
    assert command in readme and command in texts["release README"] and "lab3_handouts" in readme
    guide = (ROOT / "assignments" / "README.md").read_text()
    for needle in ("## Running a course", "Fork privately", "course secret", "make student", "_handin.zip",
                   "instructor only", "MANIFEST.json", "ROSTER=roster.csv", "lab3_handouts", "lab3_variants.py"):
        assert needle in guide


def test_the_student_readme_says_how_to_install_the_cpu_only_torch_first():
    """The default torch wheel on Linux pulls in the CUDA libraries: a CPU-only student installs torch's CPU wheel
    first, then the release (pip then keeps the torch it has: the release asks only torch>=2.3)."""
    text = release._readme("0.0.0", "owner/name-student")
    cpu = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in text
    assert text.index(cpu) < text.index("`pip install .`.", text.index(cpu)), "CPU torch first, then the release"


def test_the_released_weekly_notebooks_open_the_student_release_in_colab(built):
    """The instructor's repository may be a private fork: a student's badge opens the published release's copy."""
    folder, _ = built
    repo, branch = release.student_repo()
    for p in sorted((folder / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(p.read_text())["cells"][0]["source"])
        assert f"colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{p.name}" in first, p.name
        assert notebooks.badge_markdown(f"notebooks/{p.name}") not in first, p.name


def test_the_released_harness_names_itself_in_its_help(built):
    import subprocess
    import sys

    folder, _ = built
    r = subprocess.run([sys.executable, "-m", "autograder.harness", "--help"], cwd=folder, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(folder)})
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m autograder.harness"), r.stdout[:200]

"""Colab: the README's badge comes from the one configured slug, and the setup cell does nothing outside Colab."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from labkit import notebooks

ROOT = notebooks.REPO_ROOT

# Runs one cell's source in a fresh interpreter under an audit hook that records (and blocks) anything that
# starts a process, changes directory or writes a file; prints what happened as JSON.
PROBE = r"""
import json, os, sys, types
src = open(sys.argv[1]).read()
if sys.argv[2] == "colab":
    sys.modules["google"] = types.ModuleType("google")
    sys.modules["google.colab"] = types.ModuleType("google.colab")
events = []
WATCH = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.chdir",
         "os.mkdir", "os.remove", "os.rename", "shutil.rmtree", "urllib.Request", "socket.connect")
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT

def hook(event, args):
    writes = event == "open" and ((isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
                                  or (args[1] is None and isinstance(args[2], int) and args[2] & WRITE))
    if event in WATCH or writes:
        events.append([event, [str(a) for a in args[:2]]])
        if event != "open":
            raise PermissionError("blocked by the test")

path, cwd = list(sys.path), os.getcwd()
sys.addaudithook(hook)
error = None
try:
    exec(compile(src, "<setup cell>", "exec"), {"__name__": "__main__"})
except PermissionError as e:
    error = str(e)
print(json.dumps({"events": events, "sys_path_changed": sys.path != path, "cwd_changed": os.getcwd() != cwd,
                  "error": error}))
"""


def probe(tmp_path: Path, source: str, where: str) -> dict:
    cell = tmp_path / "cell.py"
    cell.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLAB")}
    out = subprocess.run([sys.executable, "-c", PROBE, str(cell), where], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_setup_cell_is_a_no_op_outside_colab(tmp_path):
    got = probe(tmp_path, notebooks.setup_source(), "here")
    assert got == {"events": [], "sys_path_changed": False, "cwd_changed": False, "error": None}


@pytest.mark.parametrize("path", notebooks.notebook_paths(), ids=lambda p: p.name)
def test_each_notebooks_setup_cell_is_a_no_op_outside_colab(tmp_path, path):
    got = probe(tmp_path, first_code_cell(path), "here")
    assert got == {"events": [], "sys_path_changed": False, "cwd_changed": False, "error": None}


def _installs_the_release(got: dict) -> None:
    """The first thing the cell does inside Colab is pip install the student release, nothing of this repository."""
    assert got["error"] == "blocked by the test"
    event, args = got["events"][0]
    assert event == "subprocess.Popen"
    assert all(s in args[1] for s in ("'pip'", "'install'", f"'{notebooks.release_url()}'")), args
    repo, _ = notebooks.colab_repo()
    assert "'-e'" not in args[1] and "clone" not in args[1] and f"github.com/{repo}/" not in args[1], args


def test_setup_cell_inside_colab_installs_the_student_release(tmp_path):
    """The control for the test above: with google.colab present the same cell installs the student release."""
    got = probe(tmp_path, notebooks.setup_source(), "colab")
    _installs_the_release(got)
    assert len(got["events"]) == 1
    repo, branch = notebooks.student_repo()
    assert notebooks.release_url() == f"https://github.com/{repo}/archive/refs/heads/{branch}.tar.gz"
    assert repo == notebooks.colab_repo()[0] + "-student"


def _cell(path: Path, index: int) -> str:
    return "".join(json.loads(path.read_text())["cells"][index]["source"])


@pytest.mark.parametrize("path", notebooks.lab_paths(), ids=lambda p: p.stem)
def test_each_labs_badge_setup_and_handin_cells(tmp_path, path):
    """A lab's badge opens its released notebook in the student release; its setup cell's Colab part starts no
    process and writes nothing outside Colab, and inside Colab installs the student release first."""
    assert notebooks.lab_problems(path) == []
    cells = json.loads(path.read_text())["cells"]
    repo, branch = notebooks.student_repo()
    assert f"github/{repo}/blob/{branch}/labs/{path.stem}/{path.stem}.ipynb" in "".join(cells[0]["source"])
    assert "assignments/source" not in "".join(cells[0]["source"])
    setup = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    # Outside Colab only the part before the harness import runs here (importing torch writes caches).
    head = _cell(path, setup).split("\ntry:  # an instructor's checkout")[0]
    assert "from autograder" not in head and "import torch" not in head
    here = probe(tmp_path, head, "here")
    assert here["events"] == [] and not here["cwd_changed"] and here["error"] is None, here
    _installs_the_release(probe(tmp_path, _cell(path, setup), "colab"))
    assert "handin.save(" in _cell(path, -1) and cells[-1]["metadata"]["nbgrader"]["locked"]


def test_handin_cell_writes_a_zip_the_graders_intake_reads(tmp_path):
    from autograder.intake import submissions as intake
    from labkit import handin

    lab = "lab1_loss_scaling"
    nb = json.loads((ROOT / "assignments" / "source" / lab / f"{lab}.ipynb").read_text())
    # As a student saves it after a run: the hand-in refuses a notebook with no outputs (tests/test_assignments.py).
    next(c for c in nb["cells"] if c["cell_type"] == "code")["outputs"] = [
        {"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
    work = tmp_path / "work"
    work.mkdir()
    (work / f"{lab}.ipynb").write_text(json.dumps(nb))
    (work / "student_scaler.py").write_text("x = 1\n")
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    out = subprocess.run([sys.executable, "-c", f"from labkit import handin; handin.save({lab!r})"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(work / f"{lab}_handin.zip", subs / f"alice_{lab}_handin.zip")  # as an LMS download names it
    got = intake.collect(subs, lab, scratch=tmp_path / "scratch")
    (sub,) = got.submissions
    assert sub.student_id == "alice" and sub.problem is None and sub.notebook == f"{lab}.ipynb"
    assert set(sub.files) == {f"{lab}.ipynb", "student_scaler.py", handin.RECORD}  # the record: what it was made from
    with pytest.raises(handin.LabkitError, match="not the lab1_loss_scaling notebook"):
        handin.save(lab, work, notebook={"cells": []})


def test_readme_badge_comes_from_the_configured_slug():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["labkit"]
    badge = notebooks.readme_badge()
    assert badge.endswith(f"(https://colab.research.google.com/github/{cfg['colab_repo']}/blob/{cfg['colab_branch']})")
    assert notebooks.readme_problems() == []
    head = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    assert badge in head.splitlines()[:4], "the badge sits right under the title"


def _copy_project(tmp_path: Path) -> Path:
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "notebooks").mkdir()
    return tmp_path


def test_readme_check_catches_a_changed_slug_and_fix_restamps(tmp_path):
    root = _copy_project(tmp_path)
    py = root / "pyproject.toml"
    py.write_text(py.read_text().replace('colab_repo = "', 'colab_repo = "someone-else/fork-of-'))
    assert notebooks.readme_problems(root) and "someone-else/fork-of-" in notebooks.readme_problems(root)[0]
    notebooks.fix_readme(root)
    assert notebooks.readme_problems(root) == []
    assert "github/someone-else/fork-of-" in (root / "README.md").read_text()


def test_readme_check_wants_exactly_one_badge_and_fix_adds_a_missing_one(tmp_path):
    root = _copy_project(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    readme.write_text(text + "\n" + notebooks.readme_badge(root) + "\n")
    assert notebooks.readme_problems(root)
    notebooks.fix_readme(root)
    assert notebooks.readme_problems(root) == [] and readme.read_text().count("Open In Colab") == 1
    readme.write_text(text.replace(notebooks.readme_badge(root), ""))
    assert notebooks.readme_problems(root)
    notebooks.fix_readme(root)
    assert notebooks.readme_problems(root) == []
    assert readme.read_text().splitlines()[2] == notebooks.readme_badge(root)

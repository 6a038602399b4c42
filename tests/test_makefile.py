"""The Makefile refuses an old Python before creating .venv, rebuilds a .venv made by another Python, cleans it.

Each case runs `make -n` (print, do not run) on a copy of the Makefile in a temporary folder, with PYTHON pointing
at a stand-in that answers the Makefile's version question as the named Python would.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def fake_python(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n# a stand-in Python: answers every question with its version\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def course(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def make(course, *args):
    return subprocess.run(["make", "-n", *args], cwd=course, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("goal", ["setup", "demo", "test", "lab"])
def test_an_old_python_is_refused_in_one_line_before_any_venv(course, goal):
    r = make(course, goal, f"PYTHON={fake_python(course / 'py39', '3.9')}")
    assert r.returncode != 0
    assert "labkit needs Python 3.11 or newer" in r.stderr and "is 3.9" in r.stderr and "make PYTHON=" in r.stderr
    assert "venv" not in r.stdout and not (course / ".venv").exists()


def test_a_missing_python_is_named(course):
    r = make(course, "setup", "PYTHON=/no/such/python3")
    assert r.returncode != 0 and "not a working Python" in r.stderr


def test_a_venv_from_another_python_is_rebuilt_and_a_matching_one_reused(course):
    py = fake_python(course / "py312", "3.12")
    fake_python(course / ".venv" / "bin" / "python", "3.9")
    (course / ".venv" / ".labkit-installed").touch()
    r = make(course, "setup", f"PYTHON={py}")
    assert r.returncode == 0, r.stderr
    assert "was made by Python 3.9; rebuilding it" in r.stdout and "rm -rf .venv" in r.stdout
    assert f"{py} -m venv .venv" in r.stdout
    fake_python(course / ".venv" / "bin" / "python", "3.12")
    (course / ".venv" / ".labkit-installed").touch()
    r = make(course, "setup", f"PYTHON={py}")
    assert r.returncode == 0 and "rm -rf" not in r.stdout and "Nothing to be done" in r.stdout


def test_clean_all_removes_the_venv_whatever_the_python(course):
    r = make(course, "clean-all", f"PYTHON={fake_python(course / 'py39', '3.9')}")
    assert r.returncode == 0 and "rm -rf .venv" in r.stdout


def test_lab_takes_a_port(course):
    py = fake_python(course / "py312", "3.12")
    fake_python(course / ".venv" / "bin" / "python", "3.12")
    (course / ".venv" / ".labkit-installed").touch()
    with_port = make(course, "-s", "lab", "PORT=8899", f"PYTHON={py}").stdout.strip()
    assert with_port.endswith(" --port=8899 notebooks/") and " lab " in with_port
    assert "--port" not in make(course, "-s", "lab", f"PYTHON={py}").stdout


def test_student_builds_the_release_with_the_course_tools(course):
    r = make(course, "student", f"PYTHON={fake_python(course / 'py312', '3.12')}")
    assert r.returncode == 0, r.stderr
    assert '-e ".[course,dev]"' in r.stdout, "setup keeps installing JupyterLab and nbgrader"
    assert "-m autograder.release --out dist" in r.stdout
    assert "--out /elsewhere" in make(course, "student", "OUT=/elsewhere",
                                      f"PYTHON={course / 'py312'}").stdout

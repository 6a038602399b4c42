"""The fast tier: `make check` runs every test that tests/slow_tests.txt does not name; the list names real tests."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("slow_tier", ROOT / "tests" / "slow_tier.py")
tier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tier)


def test_every_listed_id_names_a_test_that_exists():
    for i in tier.listed():
        path, _, rest = i.partition("::")
        assert (ROOT / path).is_file(), f"slow_tests.txt names {path}, which is gone: remake the list"
        name = rest.split("[")[0]
        if name:
            assert re.search(rf"^\s*def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), \
                f"slow_tests.txt names {i}, which is gone: remake the list"


def test_a_listed_id_covers_its_parameters_and_nothing_else():
    ids = ["tests/test_a.py", "tests/test_b.py::test_x"]
    assert tier.is_listed("tests/test_a.py::test_anything[1]", ids)
    assert tier.is_listed("tests/test_b.py::test_x[cpu-2]", ids) and tier.is_listed("tests/test_b.py::test_x", ids)
    assert not tier.is_listed("tests/test_b.py::test_xy", ids)
    assert not tier.is_listed("tests/test_ab.py::test_x", ids)


def test_the_list_is_chosen_from_measured_times(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_nb" name="test_run[01]" time="60"/>'
        '<testcase classname="tests.test_nb" name="test_run[02]" time="50"/>'
        '<testcase classname="tests.test_nb" name="test_style" time="0.1"/>'
        '<testcase classname="tests.test_mix" name="test_slow[a]" time="9"/>'
        '<testcase classname="tests.test_mix" name="test_fast" time="0.2"/>'
        '<testcase classname="tests.test_mix" name="test_fast2" time="0.3"/>'
        '<testcase classname="tests.test_mix" name="test_fast3" time="2.5"><skipped/></testcase>'
        '<testcase classname="tests.test_quick" name="test_q" time="0.5"/>'
        '</testsuite></testsuites>')
    ids = tier.choose(tier._durations(junit))
    assert ids == ["tests/test_mix.py::test_slow", "tests/test_nb.py"]


def test_a_fast_tier_run_adds_what_was_slow_there_and_keeps_the_list(tmp_path):
    """A fixture a whole run charged to a slow test is paid by a fast one when the fast tier runs alone."""
    junit, lst = tmp_path / "fast.xml", tmp_path / "slow_tests.txt"
    lst.write_text("# made from a whole run\ntests/test_nb.py\n")
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_course" name="test_first[a]" time="40"/>'
        '<testcase classname="tests.test_course" name="test_second" time="0.4"/>'
        '<testcase classname="tests.test_nb" name="test_run" time="60"/>'
        '</testsuite></testsuites>')
    assert tier.add(junit, lst) == ["tests/test_course.py::test_first"]
    assert tier.listed(lst) == ["tests/test_nb.py", "tests/test_course.py::test_first"]
    assert tier.add(junit, lst) == [] and tier.listed(lst)[-1] == "tests/test_course.py::test_first"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_check_lints_and_leaves_out_the_slow_tier(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    py = tmp_path / "py312"  # a stand-in Python: the Makefile only asks its version
    py.write_text("#!/bin/sh\necho 3.12\n")
    py.chmod(0o755)
    r = subprocess.run(["make", "-n", "check", f"PYTHON={py}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ruff check" in r.stdout and '-m pytest -q -m "not slow"' in r.stdout

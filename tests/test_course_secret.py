"""The course secret, the hidden values derived from it, lab 3's per-student variants and the labkit modules a
lab's submission may not use: all without running a check, in a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import labkit_answers
from autograder.base import course_secret
from autograder.base.course_secret import Secret
from autograder.checks import lab3_variants
from autograder.sandbox import jail
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
COURSE = Secret(b"a course secret for the tests, 0123456789", course_secret.COURSE_LABEL)
OTHER = Secret(b"another course's secret, 9876543210", course_secret.COURSE_LABEL)


# ------------------------------------------------------------------------------------------------ the secret


def test_graded_runs_refuse_without_a_secret_and_say_how(monkeypatch):
    monkeypatch.delenv(course_secret.OPEN_KIT_ENV, raising=False)
    with pytest.raises(LabkitError, match="LABKIT_COURSE_SECRET.*--open-kit"):
        course_secret.for_grading()
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(LabkitError, match="no course secret"):
        course_secret.load()
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")  # not graded: the labelled public default
    assert course_secret.load().open_kit and course_secret.load().label == course_secret.OPEN_KIT_LABEL
    assert course_secret.for_grading(open_kit=True).open_kit
    monkeypatch.setenv(course_secret.ENV, "short")
    with pytest.raises(LabkitError, match="at least 16"):
        course_secret.load()
    monkeypatch.setenv(course_secret.ENV, "x" * 20)
    assert course_secret.for_grading().label == course_secret.COURSE_LABEL


def test_hidden_values_come_from_the_secret(monkeypatch):
    from autograder import rehearsal
    from autograder.checks import lab1_checks, lab2_checks, lab4_checks

    def values():
        return (rehearsal.hidden_params(), lab1_checks.hidden_edge_cases(), lab2_checks._hidden_cases(),
                lab4_checks.hidden_case())

    open_kit = values()
    assert values() == open_kit  # deterministic: a regrade draws the same cases
    monkeypatch.setenv(course_secret.ENV, COURSE.key.decode())
    course = values()
    assert all(a != b for a, b in zip(open_kit, course, strict=True))
    hyper, _ = course[3]
    from autograder.student.lab4 import HYPER

    assert all(hyper[k] != HYPER[k] for k in HYPER)  # never the public case
    assert course_secret.seed("x", "alice", COURSE) != course_secret.seed("x", "bob", COURSE)
    # No hidden constant is left in the trusted modules for a reader to find.
    for mod in ("rehearsal", "checks/lab1_checks", "checks/lab2_checks", "checks/lab4_checks"):
        text = (ROOT / "autograder" / f"{mod}.py").read_text()
        assert "HIDDEN_SEED" not in text and "HIDDEN_HYPER" not in text and "HIDDEN_CASES_SEED" not in text


# ------------------------------------------------------------------------------------------------ lab 3 variants


def test_the_open_kit_variant_is_the_repositorys_slow_train():
    committed = (ROOT / "assignments" / "source" / "lab3_profile_fix" / "slow_train.py").read_text()
    assert lab3_variants.render(lab3_variants.spec_for("anyone", course_secret.load())) == committed
    assert lab3_variants.answer_key(lab3_variants.CLASSIC) == {
        "B": ("data",), "C": ("overhead", "sync"), "H": ("sync",), "I": ("sync", "overhead")}


def test_two_students_get_different_variants_with_their_own_answers():
    ids = [f"s{i:03d}" for i in range(40)]
    specs = {s: lab3_variants.spec_for(s, COURSE) for s in ids}
    keys = {s: lab3_variants.answer_key(p) for s, p in specs.items()}
    assert lab3_variants.render(specs["s000"]) != lab3_variants.render(specs["s001"])
    assert keys["s000"] != keys["s001"]
    assert len({json.dumps(k, sort_keys=True) for k in keys.values()}) >= 20  # many answers, not a handful
    assert lab3_variants.spec_for("s000", OTHER) != specs["s000"]  # another course, another variant
    assert all(p != lab3_variants.CLASSIC for p in specs.values())
    for s, spec in specs.items():
        text = lab3_variants.render(spec)
        marks = [ln.rsplit("# [", 1)[1][0] for ln in text.splitlines() if "  # [" in ln]
        assert marks == list("ABCDEFGHI"), (s, marks)
        assert len(keys[s]) == lab3_variants.PLANTED and max(map(len, text.splitlines())) <= 120


def test_every_variant_computes_the_same_run(one_thread):
    import torch

    from autograder.student import lab3 as scen

    params = {"n": 256, "steps": 6, "batch_size": 64, "data_seed": 1, "init_seed": 2, "seed": 3}
    ref = scen.train_run(lab3_variants.load(lab3_variants.CLASSIC).train, "cpu", params)
    forms = {slot: list(f) for slot, f in lab3_variants.FORMS.items()}
    seen = set()
    for i in range(30):  # every form of every slot, in some variant
        spec = lab3_variants.spec_for(f"s{i}", COURSE)
        if all(f in seen for f in spec.forms.items()):
            continue
        seen |= set(spec.forms.items())
        got = scen.train_run(lab3_variants.load(spec).train, "cpu", params)
        assert torch.allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6), spec
        assert got["correct"] == ref["correct"] and got["steps"] == ref["steps"] == 6
    assert seen == {(s, f) for s, fs in forms.items() for f in fs}


def test_variant_command_writes_one_file_per_student(tmp_path, monkeypatch):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), course_secret.ENV: COURSE.key.decode()}
    out = subprocess.run([sys.executable, "-m", "autograder", "variant", "lab3", "--student", "alice", "--student",
                          "bob", "--out", str(tmp_path / "v")], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    monkeypatch.setenv(course_secret.ENV, COURSE.key.decode())
    for s in ("alice", "bob"):
        assert (tmp_path / "v" / s / "slow_train.py").read_text() == lab3_variants.handout(s)  # tagged
    assert "key" not in out.stdout  # answers only with --show-key
    env.pop(course_secret.ENV)
    bad = subprocess.run([sys.executable, "-m", "autograder", "variant", "lab3", "--out", str(tmp_path / "w")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "no course secret" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------ labkit answers

HOSTILE_STATIC = [
    "import labkit.loss_scaling as ls",
    "from labkit import loss_scaling",
    "from labkit.amp import DynamicLossScaler",
    "import importlib\nm = importlib.import_module('labkit.loss_scaling')",
    "m = __import__('labkit.loss_scaling', fromlist=['x'])",
    "exec('from labkit.loss_scaling import *')",
    "import sys, labkit\nm = sys.modules['labkit.loss_scaling']",
    "import labkit\nm = getattr(labkit, 'amp')",
    "import labkit\nexec(open(labkit.__path__[0] + '/loss_scaling.py').read())",
]


@pytest.mark.parametrize("src", HOSTILE_STATIC)
def test_the_reader_names_a_banned_module_however_it_is_asked_for(src):
    assert labkit_answers.banned_uses(src, "lab1.static_scaler"), src


def test_the_reader_leaves_honest_code_alone():
    honest = ("import torch\nfrom labkit.env import pick_device\nloss_scaling = 2.0 ** 10  # a variable\n"
              "def amp(x):\n    return x\n")
    assert labkit_answers.banned_uses("modes = {'amp': True}", "lab1") == []  # a word, in a file without labkit
    assert labkit_answers.banned_uses(honest, "lab1") == []
    assert labkit_answers.banned_uses("import labkit.loss_scaling", "lab3") == []  # not lab 3's answer
    assert labkit_answers.banned_uses("def broken(:", "lab1") == []


def test_a_banned_import_fails_every_check_of_the_lab_before_any_runs(tmp_path):
    from autograder.checks import harness

    f = tmp_path / "student_scaler.py"
    f.write_text("from labkit.loss_scaling import StaticLossScaler as StaticScaler  # noqa\n")
    vs = harness.run_checks(harness.checks_for("lab1"), f, device="cpu", timeout_s=5)
    assert all(not v["ok"] and v["score"] == 0 and "labkit.loss_scaling" in v["message"]
               and "implements this lab's answer" in v["message"] for v in vs), vs


def test_the_lab_instructions_list_the_banned_modules():
    from autograder.checks.harness import ASSIGNMENTS

    for lab, aid in ASSIGNMENTS.items():
        nb = json.loads((ROOT / "assignments" / "source" / aid / f"{aid}.ipynb").read_text())
        intro = "".join(nb["cells"][0]["source"])
        for name in labkit_answers.banned(lab):
            assert f"`labkit.{name}`" in intro, (lab, name)
        for full in set(labkit_answers.TORCH_BANNED.get(lab, {}).values()):
            assert f"`{full}`" in " ".join(intro.split()), (lab, full)
        if not labkit_answers.banned(lab):
            assert "labkit" in intro, lab


def test_no_check_or_probe_compares_against_a_banned_module():
    """The references are torch or instructor-only code: no grader module imports a lab's answer from labkit."""
    import ast

    every = {m for mods in labkit_answers.BANNED.values() for m in mods}
    for p in sorted((ROOT / "autograder").rglob("*.py")):
        used = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                used |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                used |= {a.name.split(".")[1] for a in node.names if a.name.startswith("labkit.")}
        assert not used & every, (p, used & every)


def test_the_sandbox_view_of_labkit_leaves_the_answer_out():
    args = jail.Jail(writable=[], hide=labkit_answers.banned("lab1")).command(["true"], bwrap="bwrap")
    views = [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind" and args[i + 2].startswith(jail.VIEW)]
    names = {Path(v).name for v in views}
    assert "env.py" in names and "bench.py" in names
    assert not [n for n in names if n.split(".")[0] in ("loss_scaling", "amp")], names
    whole = jail.Jail(writable=[]).command(["true"], bwrap="bwrap")
    assert f"{jail.VIEW}/labkit" in whole  # without a lab's list, labkit is bound whole as before


def test_lab4s_ban_covers_the_fast_start_package_whole():
    """When the fast start moved into the labkit/faststart package, lab 4's ban still named `warmstart`: the
    sandbox binds labkit's top level by name, so `from labkit.faststart import warmstart` reached the answer's
    cold start there, and the reader saw only "faststart". The package is banned whole."""
    for src in ("from labkit.faststart import warmstart", "import labkit.faststart.tiered as t",
                "from labkit import faststart"):
        assert labkit_answers.banned_uses(src, "lab4.speed") == ["faststart"], src
    args = jail.Jail(writable=[], hide=labkit_answers.sandbox_hides("lab4.speed")).command(["true"], bwrap="bwrap")
    views = [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind" and args[i + 2].startswith(jail.VIEW)]
    assert views and not [v for v in views if "faststart" in v or Path(v).stem in ("train", "warmstart")], views


def test_every_course_gets_hidden_sampler_cases_the_reference_passes(monkeypatch):
    """Hidden cases drawn from a secret must be fair for every secret and hand-in: the lab 2 reference sampler
    passes the hidden sampler check for 40 courses (600 were measured when the case ranges were chosen)."""
    import tempfile

    from autograder.checks import harness, lab2_checks
    from autograder.student import lab2 as pub
    from autograder.student.probes import Probe

    nb = ROOT / "assignments" / "source" / "lab2_data_pipeline" / "lab2_data_pipeline.ipynb"
    p = Probe(str(harness.student_file_from_notebook(nb, tempfile.mkdtemp())), lambda: "cpu", {})

    class Ctx:
        student_id, handin = "a student", "a hand-in"  # each draws its own cases, as each course does

        def call(self, name, params):
            return pub.probe_sampler(p, params)

    for i in range(40):
        monkeypatch.setenv(course_secret.ENV, f"a course secret for the tests {i:04d}")
        lab2_checks.check_bucket_sampler_hidden(Ctx())


def test_every_check_that_runs_on_the_course_secrets_inputs_is_hidden():
    """lab1.scaler_edge_cases draws its cases from the secret but was not named like a hidden check, so its failures
    handed the hidden scaler settings back. A check calling a helper of its module that draws from the secret
    must say pass or fail only (harness.Check.hidden)."""
    import importlib
    import inspect

    from autograder.checks import harness

    flagged = set()
    for check in harness.CHECKS.values():
        mod = importlib.import_module(check.module)
        drawing = {n for n, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__
                   and "course_secret.rng(" in inspect.getsource(f)}
        src = inspect.getsource(getattr(mod, check.func))
        if any(f"{n}(" in src for n in drawing) or "course_secret.rng(" in src:
            flagged.add(check.name)
            assert check.hidden, check.name
    assert {"lab1.scaler_edge_cases", "lab2.bucket_sampler_hidden", "lab4.correctness_hidden", "toy.hidden"} <= flagged

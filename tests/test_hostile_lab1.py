"""Hostile lab 1 submissions: taking the answer from labkit (labkit.loss_scaling, labkit.amp) in every way a
student might, past the static reader. The sandbox's labkit does not hold those modules, so nothing is found."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from autograder import labkit_answers
from autograder.checks import harness
from autograder.checks.harness import run_check, run_checks
from autograder.sandbox import jail

pytestmark = pytest.mark.skipif(jail.probe() is not None, reason="needs the bubblewrap sandbox")

# Every way to reach the module's code, with its name built at run time (so the static reader does not see it).
ATTACK = r'''
import glob, importlib, importlib.util, json, os, sys
NAME = "loss" + "_scal" + "ing"
MOD = "labkit." + NAME
tries = {}


def attempt(label, fn):
    try:
        m = fn()
        tries[label] = "GOT" if hasattr(m, "DynamicLossScaler") else f"nothing ({type(m).__name__})"
        return m
    except BaseException as e:  # noqa: BLE001
        tries[label] = type(e).__name__
        return None


def from_file():
    import labkit
    roots = [*labkit.__path__, *sys.path, "/opt", os.getcwd()]
    hits = [p for r in roots for p in glob.glob(os.path.join(r, "**", NAME + ".py"), recursive=True)]
    m = sys.modules["stolen"] = type(sys)("stolen")
    exec(compile(open(hits[0]).read(), hits[0], "exec"), m.__dict__)
    return m


def from_bytecode():
    import labkit
    hits = [p for r in labkit.__path__ for p in glob.glob(os.path.join(r, "__pycache__", NAME + ".*.pyc"))]
    loader = importlib.machinery.SourcelessFileLoader("stolen_pyc", hits[0])
    spec = importlib.util.spec_from_loader("stolen_pyc", loader)
    m = importlib.util.module_from_spec(spec)
    loader.exec_module(m)
    return m


def through_amp():
    return importlib.import_module("labkit." + "a" + "mp")


attempt("importlib", lambda: importlib.import_module(MOD))
attempt("__import__", lambda: __import__(MOD, fromlist=["x"]))
attempt("exec", lambda: (exec("import " + MOD), sys.modules[MOD])[1])
attempt("sys.modules", lambda: sys.modules[MOD])
attempt("file", from_file)
attempt("bytecode", from_bytecode)
attempt("through-a-m-p", through_amp)
'''


def _run(tmp_path: Path, hide: tuple[str, ...]) -> dict:
    box = tmp_path / ("hidden" if hide else "whole")
    box.mkdir()
    (box / "attack.py").write_text(ATTACK + "print('TRIES ' + json.dumps(tries))\n")
    cmd = jail.Jail(writable=[box], hide=hide).command([sys.executable, "attack.py"])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=jail.Jail(writable=[box]).host_env({}))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TRIES ")), None)
    assert line, out.stderr[-2000:]
    return json.loads(line[6:])


def test_the_answer_is_nowhere_in_the_sandbox_however_it_is_asked_for(tmp_path):
    whole = _run(tmp_path, ())
    hidden = _run(tmp_path, labkit_answers.banned("lab1"))
    # Where labkit is whole, each way reaches the answer (the attacks are real; bytecode only once compiled) ...
    assert all(v == "GOT" for k, v in whole.items() if k != "bytecode"), whole
    # ... and with lab 1's list left out, none does.
    assert not [k for k, v in hidden.items() if v == "GOT"], hidden


def test_an_obfuscated_import_of_the_answer_scores_nothing(tmp_path):
    f = tmp_path / "student_scaler.py"
    f.write_text(ATTACK + "_m = attempt('final', lambda: importlib.import_module(MOD))\n"
                 "StaticScaler = _m.StaticLossScaler\nDynamicScaler = _m.DynamicLossScaler\n")
    assert labkit_answers.banned_uses(f.read_text(), "lab1") == []  # past the reader: the sandbox decides
    v = run_check("lab1.static_scaler", f, device="cpu")
    assert v["sandbox"] == "bwrap" and not v["ok"] and v["score"] == 0 and v["gradable"], v
    assert "NoneType" in v["message"] or "StaticLossScaler" in v["message"], v["message"]


GRADSCALER_WRAPPER = '''
import torch
from torch.amp import GradScaler


class StaticScaler:  # every operation handed to torch's own scaler, never growing: lab 1 says "without GradScaler"
    def __init__(self, scale=2.0 ** 16):
        self._s = GradScaler("cpu", init_scale=scale, growth_interval=2 ** 30)
        self.skipped = 0

    def __getattr__(self, name):
        return getattr(self._s, name)


class DynamicScaler(StaticScaler):
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._s = GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval)
        self.skipped = 0
'''


def test_scalers_that_wrap_torchs_gradscaler_score_nothing(tmp_path):
    """A submission delegating every scaler operation to torch.amp.GradScaler passed the static, dynamic, fp16 and
    hidden checks (10 of 12 points; only the host-sync check failed). The lab asks for the scalers "without
    torch.amp.GradScaler"; naming it in code now fails every check before any runs, as a banned labkit module does."""
    f = tmp_path / "student_scaler.py"
    f.write_text(GRADSCALER_WRAPPER)
    names = harness.checks_for("lab1")
    for v in run_checks(names, f, device="cpu"):
        assert not v["ok"] and v["score"] == 0, v
        assert "uses torch.amp.GradScaler, which implements this lab's answer" in v["message"], v["message"]
    # a second pass reached it by a dotted path in a string (pydoc.locate: now the sandbox's stub answers that one,
    # test_a_gradscaler_reached_by_a_name_built_at_run_time_is_not_in_the_sandbox), or through torch's modules
    for src in ("from torch.amp.grad_scaler import OptState\n", "import torch.cuda.amp as a\nG = a.GradScaler\n"):
        assert labkit_answers.banned_uses(src, "lab1") == ["torch.amp.GradScaler"], src
    prose = 'def f():\n    """Like GradScaler\'s schedule."""\n    return "unlike GradScaler"\n'
    assert labkit_answers.banned_uses(prose, "lab1") == []
    # a third pass spelt the name in UTF-7 under a coding declaration (Python decodes it; a UTF-8 reader saw a
    # syntax error and let the file through, 10 of 12 points), or kept it in bytes, a pickle's or decoded
    utf7 = b"# -*- coding: utf-7 -*-\nfrom torch.amp import +AEcAcgBhAGQAUwBjAGEAbABlAHI- as _S\n"
    for src in (utf7, b'import pickle\nS = pickle.loads(b"ctorch.amp\\nGradScaler\\n.")\n'):
        assert labkit_answers.banned_uses(src, "lab1") == ["torch.amp.GradScaler"], src
    # and GradScaler's two kernels make a scaler of their own (12 of 12): named anywhere, they count
    for src, op in (("import torch\ntorch._amp_update_scale_(s, g, f, 2.0, 0.5, 2000)\n", "_amp_update_scale_"),
                    ("import torch as t\nk = getattr(t, '_amp_foreach_non_finite_check_and_unscale_')\n",
                     "_amp_foreach_non_finite_check_and_unscale_"),
                    # their out-of-place forms, without the underscore, scored 12 of 12 too, and so did names in
                    # strings that are no dotted path (pkgutil.resolve_name, torch._C._jit_get_operation)
                    ("import torch\nk = torch.ops.aten._amp_update_scale\n", "_amp_update_scale_"),
                    ("import pkgutil\nk = pkgutil.resolve_name('torch:_amp_foreach_non_finite_check_and_unscale_')\n",
                     "_amp_foreach_non_finite_check_and_unscale_"),
                    ("import torch\nk = torch._C._jit_get_operation('aten::_amp_update_scale_')[0]\n",
                     "_amp_update_scale_"),
                    ("import torch\nk = torch._C._jit_get_operation(' aten::_amp_update_scale_ '.strip())[0]\n",
                     "_amp_update_scale_"),
                    # and off a call or a subscript, where no name of the scaler's own can be meant
                    ("import importlib\nk = importlib.import_module('torch')._amp_update_scale_\n",
                     "_amp_update_scale_"),
                    ("import sys\nk = sys.modules['torch'].ops.aten._amp_foreach_non_finite_check_and_unscale\n",
                     "_amp_foreach_non_finite_check_and_unscale_")):
        assert labkit_answers.banned_uses(src, "lab1") == [f"torch.{op}"], src
    body = GRADSCALER_WRAPPER.replace("+", "+-").replace("GradScaler", "+AEcAcgBhAGQAUwBjAGEAbABlAHI-")
    f.write_bytes(b"# -*- coding: utf-7 -*-\n" + body.encode("ascii"))
    compile(f.read_bytes(), str(f), "exec")  # a program Python runs, with the wrapper in it
    assert b"GradScaler" not in f.read_bytes()
    for v in run_checks(names, f, device="cpu"):
        assert not v["ok"] and "uses torch.amp.GradScaler" in v["message"], v


# A third pass's wrapper, scoring 10 of 12 points with the class from a pickle's bytes; here the name is built at run
# time, which no reader sees.
RUNTIME_WRAPPER = '''
import torch
import torch.nn as nn
_S = getattr(torch.amp, "Grad" + "Scaler")


class _Base:
    def scale(self, loss):
        return self._s.scale(loss)

    def unscale_(self, opt):
        return self._s.unscale_(opt)

    def step(self, opt):
        self._s.step(opt)
        st = self._s._per_optimizer_states[id(opt)]
        ok = sum(float(v.item()) for v in st["found_inf_per_device"].values()) == 0
        self.skipped += not ok
        return ok

    def get_scale(self):
        return self._s.get_scale()


class StaticScaler(_Base):
    def __init__(self, scale=2.0 ** 16):
        self._s = _S("cpu", init_scale=scale, growth_interval=2 ** 30)
        self._v = float(scale)
        self.skipped = 0

    def update(self):
        self._s.update(new_scale=self._v)


class DynamicScaler(_Base):
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._s = _S("cpu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval)
        self.skipped = 0

    def update(self):
        self._s.update()


def fp16_train_step(model, optimizer, scaler, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()
'''


def test_a_gradscaler_reached_by_a_name_built_at_run_time_is_not_in_the_sandbox(tmp_path):
    """No reader sees a name built at run time (getattr(torch.amp, "Grad" + "Scaler")), a pickle held in a str or a
    search of torch.amp's attributes. In lab 1's sandbox a stub stands in for torch's grad-scaler modules (their
    bytecode hidden too), so every route reaches a class that refuses to be built, and the wrapper scores nothing."""
    from autograder.student.no_grad_scaler import MESSAGE

    f = tmp_path / "student_scaler.py"
    f.write_text(RUNTIME_WRAPPER)
    assert labkit_answers.banned_uses(f.read_bytes(), "lab1") == []  # past the reader
    verdicts = run_checks(harness.checks_for("lab1"), f, device="cpu")
    assert sum(v["score"] for v in verdicts) == 0, verdicts
    shown = [v for v in verdicts if not harness.CHECKS[v["check"]].hidden and v["check"] != "lab1.host_syncs"]
    assert len(shown) == 3 and all(MESSAGE in v["message"] for v in shown), shown


def test_an_honest_scaler_with_names_like_torchs_is_not_flagged():
    """The reader is there for the clear message; the sandbox's stub enforces. A third pass found it flagging honest
    files, each a 10-point loss: a variable or key named grad_scaler, an alias GradScaler = DynamicScaler, the word in
    an error message or in bytes; a fourth, a docstring saying which kernel the scaler does not call; a fifth, a
    method of the scaler's own named after a kernel."""
    for src in ("grad_scaler = scaler\n", "state = {'grad_scaler': 1}\n", "class S:\n    def f(self):\n"
                "        return self.grad_scaler\n", "GradScaler = DynamicScaler\n", "raise TypeError('GradScaler')\n",
                "log = b'step 3: grad_scaler skipped'\n", "import torch\nx = torch.amp.autocast\n",
                'def f():\n    """By hand: it does not call torch._amp_update_scale_."""\n',
                "labels = {'torch.amp.GradScaler': 'torch'}\n", "counts = {'_amp_update_scale_calls': 0}\n",
                # a method of its own named after the kernel it mirrors: 0 of 14 for an honest scaler
                "class S:\n    def _amp_update_scale(self):\n        pass\n\n    def update(self):\n"
                "        self._amp_update_scale()\n"):
        assert labkit_answers.banned_uses(src, "lab1") == [], src


TORCH_ATTACK = r'''
import glob, importlib.util, json, os, sys
import torch
tries = {}
src = torch.amp.grad_scaler.__file__
tries["source is the stub"] = "no_grad_scaler" in open(src).read() or "refuses" in open(src).read()
for pyc in glob.glob(os.path.join(os.path.dirname(src), "__pycache__", "grad_scaler.*.pyc")):
    try:
        tries["bytecode bytes"] = len(open(pyc, "rb").read())
    except OSError as e:
        tries["bytecode bytes"] = type(e).__name__
try:
    torch.amp.GradScaler("cpu")
    tries["built"] = True
except RuntimeError as e:
    tries["built"] = str(e)[:40]
import labkit
tries["labkit.amp"] = os.path.exists(os.path.join(os.path.dirname(labkit.__file__), "amp.py"))
print("TRIES " + json.dumps(tries))
'''


def test_the_notebooks_sandbox_leaves_out_what_the_checks_sandbox_does(tmp_path):
    """The notebook's run and the checks' runner share the student's compile cache. A notebook copied torch's
    grad_scaler.py there and the runner loaded it: 12 of 12. The notebook's sandbox now leaves out the same
    labkit modules and shows the same stub (grade.notebook_jail), its bytecode empty."""
    from autograder import grade

    course = types.SimpleNamespace(calls=[types.SimpleNamespace(check=c) for c in harness.checks_for("lab1")])
    box = grade.notebook_jail(course, tmp_path, tmp_path / "cache", None, {}, grade.GradeConfig(course=str(tmp_path)))
    assert set(labkit_answers.sandbox_hides("lab1")) == set(box.hide) and "torch/amp/grad_scaler.py" in box.hide
    (tmp_path / "cache").mkdir()
    (tmp_path / "attack.py").write_text(TORCH_ATTACK)
    out = subprocess.run(box.command([sys.executable, "attack.py"]), capture_output=True, text=True, timeout=300,
                         env=box.host_env({}))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TRIES ")), None)
    assert line, out.stderr[-2000:]
    tries = json.loads(line[6:])
    assert tries["source is the stub"] and tries["built"].startswith("torch's GradScaler is not available"), tries
    assert tries.get("bytecode bytes", 0) in (0, "PermissionError") and tries["labkit.amp"] is False, tries


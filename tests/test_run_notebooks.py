"""benchmarks/run_notebooks.py: notebooks run as plain Python, with their outputs, figures, times and errors recorded."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from labkit import notebooks
from labkit.env import LabkitError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run_notebooks.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _module():
    spec = importlib.util.spec_from_file_location("run_notebooks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rn = _module()


def write_nb(path: Path, *cells: str) -> Path:
    """A notebook whose cells are code, except those starting with '#md ' (markdown)."""
    out = []
    for c in cells:
        if c.startswith("#md "):
            out.append({"cell_type": "markdown", "metadata": {}, "source": c[4:]})
        else:
            out.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                        "source": c.splitlines(True)})
    path.write_text(json.dumps({"cells": out, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def run_script(*args, cwd, timeout=240, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_QUICK"} | env_extra
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


GOOD = [
    "#md # A tiny notebook\nwith *markdown*",
    "import sys, time, warnings\nprint('hello')\nx = 6 * 7",
    "import matplotlib.pyplot as plt\nprint('before')\nplt.plot([1, 2, 3])\nplt.show()\nprint('between')\n"
    "fig, ax = plt.subplots(figsize=(4, 3))\nax.bar([0, 1], [3, 4])\nax",
    "warnings.warn('careful now')\nfor i in range(3):\n    print(f'\\rstep {i}', end='')\nprint()\nx",
    "from IPython.display import Markdown, display\ndisplay(Markdown('**bold words**'))\n{'hidden': 1};",
    "time.sleep(0.3)\nfrom labkit.env import quick_mode\nimport os\nprint('quick', quick_mode(), os.getcwd())",
    "import pickle\nclass Point:\n    def __init__(self, x):\n        self.x = x\n"
    "print('unpickled', pickle.loads(pickle.dumps(Point(5))).x)",
    "import builtins\nbuiltins.LEAKED_FROM_GOOD = True",
]
BAD = ["print('one')", "def f():\n    raise ValueError('boom')\nf()", "print('never' + 'X')"]
# Runs after GOOD: a fresh process per notebook means nothing GOOD did is visible here.
ISOLATED = ["import builtins\nassert not hasattr(builtins, 'LEAKED_FROM_GOOD')\nassert 'x' not in globals()\n"
            "print('isolated')"]
# As on a GPU host without Jupyter: IPython cannot be imported, and IPython.display still works.
NO_IPYTHON = ["import sys\nfrom IPython.display import HTML, Markdown, display\n"
              "display(Markdown('**from markdown**'), HTML('<b>from html</b>'))\n"
              "print('display module:', getattr(sys.modules['IPython.display'], '__file__', 'stand-in'))"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """good + bad in one run, then the isolated one into the same folder with a bundle."""
    d = tmp_path_factory.mktemp("nbrun")
    (d / "nbs").mkdir()
    good = write_nb(d / "nbs" / "good.ipynb", *GOOD)
    bad = write_nb(d / "nbs" / "bad.ipynb", *BAD)
    iso = write_nb(d / "nbs" / "isolated.ipynb", *ISOLATED)
    no_ipython = write_nb(d / "nbs" / "no_ipython.ipynb", *NO_IPYTHON)
    (d / "hide" / "IPython").mkdir(parents=True)
    (d / "hide" / "IPython" / "__init__.py").write_text("raise ImportError('IPython hidden by the test')\n")
    first = run_script(good, bad, "--out", d / "out", "--quick", cwd=d)
    second = run_script(iso, no_ipython, "--out", d / "out", "--quick", "--bundle", d / "all.tar.gz", cwd=d,
                        PYTHONPATH=str(d / "hide"))
    summary = json.loads((d / "out" / "notebook_runs.json").read_text())
    by_name = {Path(e["path"]).name: e for e in summary["notebooks"]}
    return {"dir": d, "first": first, "second": second, "summary": summary, "nb": by_name}


def test_exit_codes_say_which_notebook_failed(runs):
    assert runs["first"].returncode == 1, runs["first"].stderr
    assert "failed: bad.ipynb" in runs["first"].stderr
    assert runs["second"].returncode == 0, runs["second"].stderr


def test_summary_names_card_torch_commit_command_and_cell_times(runs):
    s = runs["summary"]
    for key in ("device_name", "torch", "git_commit", "command"):
        assert s["env"].get(key), key
    assert "--quick" in s["env"]["command"]
    # Both runs are kept: the second run adds to the folder's summary instead of replacing it.
    assert set(runs["nb"]) == {"good.ipynb", "bad.ipynb", "isolated.ipynb", "no_ipython.ipynb"}
    good = runs["nb"]["good.ipynb"]
    assert good["status"] == "ok" and good["quick"] is True and good["env"]["device_name"]
    assert [c["status"] for c in good["cells"]] == ["ok"] * 7
    assert all(isinstance(c["wall_s"], float) and c["wall_s"] >= 0 for c in good["cells"])
    sleepy = good["cells"][4]
    assert 0.3 <= sleepy["wall_s"] < 10, sleepy
    assert good["wall_s"] == pytest.approx(sum(c["wall_s"] for c in good["cells"]))
    assert runs["nb"]["isolated.ipynb"]["status"] == "ok"


def test_ipython_display_works_without_ipython(runs):
    assert runs["nb"]["no_ipython.ipynb"]["status"] == "ok"
    md = (runs["dir"] / "out" / "no_ipython.md").read_text()
    assert "display module: stand-in" in md
    assert "\n**from markdown**\n" in md and "\n<b>from html</b>\n" in md


def test_record_shows_outputs_and_figures_in_order(runs):
    out = runs["dir"] / "out"
    md = (out / "good.md").read_text()
    assert runs["summary"]["env"]["device_name"] in md
    assert "# A tiny notebook" in md and "with *markdown*" in md
    figs = runs["nb"]["good.ipynb"]["cells"][1]["figures"]
    assert figs == ["good_files/cell02_fig1.png", "good_files/cell02_fig2.png"]
    for f in figs:
        assert (out / f).read_bytes()[:8] == PNG_MAGIC
        assert f"]({f})" in md
    # Interleaved as JupyterLab shows them: text, first figure, text, the cell's value, second figure.
    shown = md.split("**Cell 2**")[1].split("**Cell 3**")[0].split("\nax\n```", 1)[1]  # after the source
    order = [shown.index(s) for s in ("before", figs[0], "between", "<Axes", figs[1])]
    assert order == sorted(order), order
    assert "step 2" in md and "step 0" not in md  # a progress line shows its final state only
    assert "UserWarning: careful now" in md
    assert "\n42\n" in md
    assert "**bold words**" in md and "hidden" not in md.split("{'hidden': 1};", 1)[1]
    assert f"quick True {runs['dir'] / 'nbs'}" in md  # quick mode on, and the notebook's folder as cwd
    assert "unpickled 5" in md  # a class defined in a cell pickles, as in Jupyter


def test_error_is_recorded_and_later_cells_do_not_run(runs):
    bad = runs["nb"]["bad.ipynb"]
    assert bad["status"] == "error"
    assert [c["status"] for c in bad["cells"]] == ["ok", "error", "not run"]
    assert bad["cells"][1]["error"] == "ValueError: boom"
    md = (runs["dir"] / "out" / "bad.md").read_text()
    assert "ValueError: boom" in md and '<cell 1>", line 2, in f' in md
    assert "neverX" not in md


def test_bundle_holds_every_output_file(runs):
    out = runs["dir"] / "out"
    with tarfile.open(runs["dir"] / "all.tar.gz") as tar:
        names = set(tar.getnames())
        md = tar.extractfile("out/good.md").read()
    files = {f"out/{p.relative_to(out).as_posix()}" for p in out.rglob("*") if p.is_file()}
    assert names == files
    assert {"out/notebook_runs.json", "out/good.md", "out/bad.md", "out/isolated.md",
            "out/good_files/cell02_fig2.png"} <= names
    assert md == (out / "good.md").read_bytes()


def test_bundle_inside_the_repository_unpacks_in_place(tmp_path):
    out = ROOT / "runs" / f"bundle-test-{os.getpid()}"
    try:
        (out / "x_files").mkdir(parents=True)
        (out / "x_files" / "a.png").write_bytes(PNG_MAGIC)
        (out / "x.md").write_text("x")
        target, arc = rn.bundle(out, tmp_path / "b.tar.gz")
        with tarfile.open(target) as tar:
            names = sorted(tar.getnames())
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    assert arc == f"runs/{out.name}"
    assert names == [f"{arc}/x.md", f"{arc}/x_files/a.png"]


@pytest.mark.parametrize("source, what", [
    ("%timeit sum(range(9))", "`%timeit sum(range(9))`"),
    ("x = 1\n!pip install something", "line 2 `!pip install something`"),
    ("files = !ls", "`files = !ls`"),
    ("%%writefile a.py\nprint(1)", "`%%writefile a.py`"),
    ("len?", "`len?`"),
    ("get_ipython().run_line_magic('time', '1')", "get_ipython()"),
])
def test_ipython_syntax_is_refused_naming_cell_and_line(tmp_path, source, what):
    nb = write_nb(tmp_path / "m.ipynb", "print(1)", source)
    with pytest.raises(LabkitError) as e:
        rn.load_cells(nb)
    assert "cell 1" in str(e.value) and what in str(e.value)


def test_plain_syntax_error_is_not_called_a_magic(tmp_path):
    nb = write_nb(tmp_path / "s.ipynb", "def f(:\n    pass")
    with pytest.raises(LabkitError, match=r"cell 0 line 1: syntax error") as e:
        rn.load_cells(nb)
    assert "IPython" not in str(e.value).split(".")[0]


def test_refusal_happens_before_any_cell_runs(tmp_path):
    ok = write_nb(tmp_path / "first.ipynb", "open('ran_first', 'w').write('x')")
    magic = write_nb(tmp_path / "second.ipynb", "open('ran_second', 'w').write('x')", "%matplotlib inline")
    r = run_script(ok, magic, "--out", tmp_path / "out", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "second.ipynb: cell 1 line 1 `%matplotlib inline`" in r.stderr
    assert not (tmp_path / "ran_first").exists() and not (tmp_path / "ran_second").exists()


def test_timeout_stops_the_notebook_and_what_it_started(tmp_path):
    nb = write_nb(tmp_path / "slow.ipynb", "print('first done')",
                  "import subprocess, time\np = subprocess.Popen(['sleep', '600'])\n"
                  "open('sleep.pid', 'w').write(str(p.pid))\ntime.sleep(600)")
    r = run_script(nb, "--out", tmp_path / "out", "--timeout", 15, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    rec = json.loads((tmp_path / "out" / "notebook_runs.json").read_text())["notebooks"][0]
    assert rec["status"] == "error"
    assert [c["status"] for c in rec["cells"]] == ["ok", "error"]
    assert "timed out after 15 s" in rec["cells"][1]["error"]
    md = (tmp_path / "out" / "slow.md").read_text()
    assert "first done" in md and "timed out" in md
    pid = int((tmp_path / "sleep.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the notebook's own child process {pid} outlived the timeout")


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert rn.main([str(tmp_path / "missing.ipynb"), "--out", str(tmp_path)]) == 2
    assert "no such notebook" in capsys.readouterr().err
    nb = write_nb(tmp_path / "a.ipynb", "1")
    assert rn.main([str(nb), "--quick", "--full", "--out", str(tmp_path)]) == 2
    assert "--quick and --full" in capsys.readouterr().err


def test_cpu_runs_never_default_to_the_recorded_gpu_folder():
    import torch

    if torch.cuda.is_available():
        assert rn.default_out() == ROOT / "benchmarks" / "results" / "notebooks"
    else:
        assert rn.default_out() == ROOT / "runs" / "notebooks"


@pytest.mark.parametrize("path", notebooks.notebook_paths(), ids=lambda p: p.name)
def test_course_notebooks_run_as_plain_python(path):
    """Every course notebook can go through the GPU runner: no IPython-only syntax."""
    assert [c["type"] for c in rn.load_cells(path)]

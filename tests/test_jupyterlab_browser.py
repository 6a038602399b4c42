"""`make lab` in a real browser: JupyterLab runs a notebook on the venv's kernel, and nbgrader's extensions load.

The server is started with the exact command `make lab` runs (plus a port, a token and --no-browser), on a copy
of tiny notebooks made here, and headless Chromium (Debian's `chromium` package) drives it through Playwright.
Without Chromium the browser tests skip, except in CI (CI=true), where .ci/run installs it and they must run.
"""

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
VENV = Path(sys.prefix)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOAD_S = 120  # seconds allowed for JupyterLab to load, a kernel to start and the cells to run, on 2 busy cores


def make_lab_command() -> str:
    """The shell command `make lab` runs for this venv (its setup step taken as done)."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the course's commands need it (apt-get install make)")
    out = subprocess.run(["make", "-s", "-n", "lab", f"VENV={VENV}", "-o", str(VENV / ".labkit-installed")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stdout.splitlines() if " lab " in f"{line} "]
    assert out.returncode == 0 and len(lines) == 1, out.stdout + out.stderr
    return lines[0]


def venv_kernel_name() -> str:
    return json.loads((VENV / "share" / "jupyter" / "kernels" / "python3" / "kernel.json").read_text())["display_name"]


def write_nb(path: Path, *cells: str) -> None:
    path.write_text(json.dumps({
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": src} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5}))


def write_decoy_user_kernel(data_dir: Path) -> None:
    """A user-level "python3" kernel that cannot start: it must never be the one chosen over the venv's."""
    d = data_dir / "kernels" / "python3"
    d.mkdir(parents=True)
    (d / "kernel.json").write_text(json.dumps({"argv": ["/bin/sh", "-c", "exit 3", "{connection_file}"],
                                               "display_name": "Decoy user kernel", "language": "python"}))


# -------------------------------------------------------------------------------- the kernel (no browser)


def test_make_lab_runs_the_venvs_jupyter_preferring_the_venvs_kernels():
    cmd = make_lab_command()
    assert cmd.startswith(f"JUPYTER_PREFER_ENV_PATH=1 {VENV}/bin/jupyter lab "), cmd
    assert cmd.rstrip().endswith(" notebooks/"), cmd


def _resolve_kernel(env_extra: dict) -> dict:
    """How jupyter_client, under the given environment, resolves and would launch the "python3" kernel."""
    script = (
        "import json\n"
        "from jupyter_client.manager import KernelManager\n"
        "km = KernelManager(kernel_name='python3')\n"
        "print(json.dumps({'argv': km.format_kernel_cmd(), 'resource_dir': km.kernel_spec.resource_dir,\n"
        "                  'display_name': km.kernel_spec.display_name}))\n")
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernelspec_resolves_to_the_venv_python_even_with_a_user_kernel(tmp_path):
    write_decoy_user_kernel(tmp_path / "data")
    env = {"JUPYTER_DATA_DIR": str(tmp_path / "data"), "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    # As `make lab` sets it: the venv's kernels come first.
    spec = _resolve_kernel({**env, "JUPYTER_PREFER_ENV_PATH": "1"})
    assert Path(spec["resource_dir"]).is_relative_to(VENV), spec
    python = spec["argv"][0]
    assert Path(python).parent == VENV / "bin", spec  # the venv's python, not a symlink's target elsewhere
    probe = subprocess.run([python, "-c", "import sys, labkit; print(sys.prefix)"], capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0 and Path(probe.stdout.strip()) == VENV, probe.stderr
    if (VENV / ".labkit-installed").exists():  # set up by `make setup`, which names the kernel
        assert spec["display_name"] == "Python 3 (labkit)"
    # Control: preferring the user's kernels picks the decoy, so the setting is what protects `make lab`.
    assert _resolve_kernel({**env, "JUPYTER_PREFER_ENV_PATH": "0"})["display_name"] == "Decoy user kernel"


# -------------------------------------------------------------------------------- JupyterLab in Chromium


def _need_browser():
    if not CHROMIUM.exists():
        if IN_CI:
            pytest.fail(f"CI is set but {CHROMIUM} is missing: .ci/run installs it with apt-get install chromium")
        pytest.skip(f"Chromium not installed ({CHROMIUM}; apt-get install chromium); CI installs it and runs this")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        pytest.fail(f"playwright is missing ({e}): pip install -e '.[course,dev]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, base: str, token: str, root: Path, log: Path):
        self.base, self.token, self.root, self.log = base, token, root, log

    def get(self, path: str):
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab started by `make lab`'s own command on loopback, in a temp folder holding tiny notebooks."""
    _need_browser()
    tmp = tmp_path_factory.mktemp("lab")
    nbs = tmp / "notebooks"
    nbs.mkdir()
    write_nb(nbs / "tiny.ipynb",
             "import sys\nprint('prefix', sys.prefix)",
             "from labkit.bench import Timing\nprint('median', Timing([1.0, 2.0, 9.0]).median)",
             "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()",
             "6 * 7")
    write_nb(nbs / "broken.ipynb", "print('before')", "raise ValueError('boom in the browser')", "print('after')")
    config, data = tmp / "jupyter-config", tmp / "jupyter-data"
    config.mkdir()
    write_decoy_user_kernel(data)
    (tmp / "exchange").mkdir()
    (config / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.course_id = 'labkit'\nc.Exchange.root = {str(tmp / 'exchange')!r}\n")
    settings = tmp / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)  # no "receive Jupyter news?" question: nothing here reaches the internet
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')

    port, token = _free_port(), secrets.token_hex(16)
    extra = ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}", f"--LabApp.user_settings_dir={tmp / 'lab-settings'}",
             f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # a student's shell: inline plots
    env.update(JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(data), JUPYTER_RUNTIME_DIR=str(tmp / "rt"))
    log = tmp / "jupyter.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(f"{make_lab_command()} {shlex.join(extra)}", shell=True, cwd=tmp, env=env,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token, nbs, log)
    try:
        deadline = time.monotonic() + LOAD_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if server.get("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer within {LOAD_S} s:\n{server.log_tail()}")
            time.sleep(0.3)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the shell and the server it started; the server stops its kernels
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 800})
        ctx.set_default_timeout(LOAD_S * 1000)
        try:
            yield ctx
        finally:
            ctx.close()


def open_notebook(browser, lab, name: str):
    """Open one notebook in its own workspace and wait until its kernel is idle."""
    page = browser.new_page()
    page.goto(f"{lab.base}/lab/workspaces/{name.split('.')[0]}/tree/{name}?token={lab.token}")
    page.wait_for_selector(".jp-Notebook .jp-CodeCell")
    page.wait_for_selector("#jp-main-statusbar >> text=Idle")
    return page


def click_menu(page, menu: str, item: str) -> None:
    page.locator("#jp-top-panel .lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(menu)}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def run_all(page) -> dict:
    """Run > Run All Cells, wait until nothing is queued or running, and read the cells back from the page."""
    click_menu(page, "Run", "Run All Cells")
    page.wait_for_function("""() => {
        const p = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);
        return p.some(t => /\\[\\d+\\]/.test(t)) && !p.some(t => t.includes('*'));
    }""")
    page.wait_for_selector("#jp-main-statusbar >> text=Idle")
    return page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].map(c => ({
        prompt: c.querySelector('.jp-InputPrompt').textContent.trim(),
        outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map(o => ({
            mime: o.getAttribute('data-mime-type'), text: o.innerText, images: o.querySelectorAll('img').length})),
    }))""")


def errors_in(cells) -> list[str]:
    """Error and stderr outputs as JupyterLab renders them (both carry the stderr MIME type)."""
    return [o["text"] for c in cells for o in c["outputs"] if o["mime"] == "application/vnd.jupyter.stderr"]


def test_notebook_runs_top_to_bottom_on_the_venv_kernel(browser, lab):
    page = open_notebook(browser, lab, "tiny.ipynb")
    try:
        assert venv_kernel_name() in page.inner_text("#jp-main-statusbar")  # not the decoy user kernel
        cells = run_all(page)
        assert errors_in(cells) == []
        assert [c["prompt"] for c in cells] == ["[1]:", "[2]:", "[3]:", "[4]:"], cells
        texts = ["".join(o["text"] for o in c["outputs"]) for c in cells]
        assert texts[0].strip() == f"prefix {VENV}"
        assert texts[1].strip() == "median 2.0"
        assert sum(o["images"] for o in cells[2]["outputs"]) == 1  # the inline plot
        assert texts[3].strip() == "42"
    finally:
        page.close()


def test_an_error_in_a_cell_is_seen_and_stops_the_run(browser, lab):
    """The checks above can fail: an erroring cell shows up, and the cell after it never runs."""
    page = open_notebook(browser, lab, "broken.ipynb")
    try:
        cells = run_all(page)
        errs = errors_in(cells)
        assert len(errs) == 1 and "ValueError" in errs[0] and "boom in the browser" in errs[0], cells
        assert [c["prompt"] for c in cells] == ["[1]:", "[2]:", "[ ]:"], cells
    finally:
        page.close()


def test_nbgrader_server_extensions_answer(lab):
    import nbgrader

    assert json.loads(lab.get(f"/nbgrader_version?version={nbgrader.__version__}")[1]) == {"success": True}
    assert json.loads(lab.get("/assignments?course_id=labkit")[1]) == {"success": True, "value": []}
    courses = json.loads(lab.get("/formgraders")[1])
    assert courses["success"] and [c["course_id"] for c in courses["value"]] == ["labkit"]
    status, html = lab.get("/formgrader")
    assert status == 200 and "nbgrader" in html


def test_nbgrader_lab_extension_opens_assignment_list_and_formgrader(browser, lab):
    page = open_notebook(browser, lab, "tiny.ipynb")
    try:
        click_menu(page, "Nbgrader", "Assignment List")  # what students use
        page.wait_for_selector(".lm-TabBar-tabLabel >> text=Assignments")
        page.wait_for_selector("text=Released assignments")
        click_menu(page, "Nbgrader", "Formgrader")  # what instructors use
        page.wait_for_selector(".lm-TabBar-tabLabel >> text=Formgrader")
        deadline = time.monotonic() + LOAD_S
        while not [f for f in page.frames if "/formgrader" in f.url]:
            assert time.monotonic() < deadline, [f.url for f in page.frames]
            page.wait_for_timeout(200)
        frame = next(f for f in page.frames if "/formgrader" in f.url)
        frame.wait_for_selector("text=Manage Assignments")
    finally:
        page.close()

"""Run the course notebooks as plain Python and record what they printed and drew, with the card they ran on.

For a GPU machine that has torch and labkit's dependencies but no Jupyter: each notebook's code cells run in order
in one namespace (a fresh process per notebook, so one notebook's switches, memory and compiled code never leak
into the next), with matplotlib's Agg backend. Each cell's stdout, stderr, final value and every figure are
captured the way JupyterLab would show them, and each notebook gets an executed record readable without a GPU:

  <out>/<stem>.md               cell sources, text outputs, figures and errors, headed by card/torch/commit
  <out>/<stem>_files/*.png      its figures
  <out>/<stem>_files/run.json   the raw per-cell record
  <out>/notebook_runs.json      summary: environment (card, torch, commit, command), per-cell wall time, errors

IPython syntax (`%magic`, `!shell`, `get_ipython()`) cannot run as plain Python: a notebook that uses it is
refused before anything runs, naming the cell and line. `--bundle FILE.tar.gz` packs the whole output folder
into one file, so one file is all there is to copy back from a remote machine; unpack it at the repository root.

  python benchmarks/run_notebooks.py                      # every notebook in notebooks/
  python benchmarks/run_notebooks.py --quick notebooks/02_*.ipynb --out /tmp/nb --bundle /tmp/nb.tar.gz
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import io
import json
import linecache
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import traceback
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a plain checkout, without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from labkit.env import LabkitError  # noqa: E402

SUMMARY = "notebook_runs"
_THIS = str(Path(__file__).resolve())
MAX_TEXT = 200_000  # characters of one output kept in the record; the rest is cut with a note
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_MAGIC_LINE = re.compile(r"^\s*(%|!|\w[\w.,\s]*=\s*[!%])|\?\s*$")


# ------------------------------------------------------------------------------------------ reading notebooks


def load_cells(path: Path) -> list[dict]:
    """The notebook's cells as {"type", "source", "cell"}; raises LabkitError if one cannot run as plain Python."""
    try:
        nb = json.loads(path.read_text())
        cells = nb["cells"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise LabkitError(f"{path}: not a readable notebook ({e}); pass .ipynb files") from e
    out, bad = [], []
    for i, c in enumerate(cells):
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else str(src)
        out.append({"type": c.get("cell_type"), "source": src, "cell": i})
        if c.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(src, filename=f"<cell {i}>")
        except SyntaxError as e:
            magic = [(n, line) for n, line in enumerate(src.splitlines(), 1) if _MAGIC_LINE.search(line)]
            if magic:
                n, line = magic[0]
                bad.append(f"cell {i} line {n} `{line.strip()}` is IPython syntax (magic or shell escape)")
            else:
                bad.append(f"cell {i} line {e.lineno}: syntax error ({e.msg})")
            continue
        if any(isinstance(node, ast.Name) and node.id == "get_ipython" for node in ast.walk(tree)):
            bad.append(f"cell {i} calls get_ipython(), which exists only inside IPython")
    if bad:
        raise LabkitError(f"{path}: {'; '.join(bad)}. This runner executes notebooks as plain Python: time with "
                          "labkit.bench, run commands with subprocess, and drop %matplotlib lines")
    return out


# ------------------------------------------------------------------------------------------ running (child)


class _Outputs:
    """One cell's outputs in the order they appeared: stream text, images, rich text, its final value."""

    def __init__(self):
        self.items: list[dict] = []

    def stream(self, name: str, text: str) -> None:
        if self.items and self.items[-1].get("type") == "stream" and self.items[-1]["name"] == name:
            self.items[-1]["text"] += text
        else:
            self.items.append({"type": "stream", "name": name, "text": text})

    def add(self, item: dict) -> None:
        self.items.append(item)

    def finished(self) -> list[dict]:
        for it in self.items:
            if it["type"] == "stream":
                it["text"] = _clean(it["text"])
        return [it for it in self.items if it.get("text", "x")]


class _Stream(io.TextIOBase):
    def __init__(self, outputs: _Outputs, name: str):
        self._outputs, self.name = outputs, name

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):
        return "utf-8"

    def write(self, s) -> int:
        self._outputs.stream(self.name, str(s))
        return len(s)


def _clean(text: str) -> str:
    """Terminal text as it finally looks: colors dropped, progress bars reduced to their last state."""
    text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in _ANSI.sub("", text).split("\n"))
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"\n... [{len(text) - MAX_TEXT} more characters cut]"
    return text


class _Session:
    """Executes one notebook's cells in one namespace, saving figures as it goes."""

    def __init__(self, stem: str, files_dir: Path, dpi: int):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.switch_backend("Agg")  # resolve the backend now: pyplot annotates its own show() when it does
        self.plt, self.stem, self.files_dir, self.dpi = plt, stem, files_dir, dpi
        self.cell = 0
        self.out: _Outputs | None = None
        self.n_fig = 0

        def show(*args, **kwargs):  # like Jupyter's inline backend: draw into the output now, then close
            self._show()

        plt.show = show
        # As in IPython, the namespace is the __main__ module: classes defined in a cell can be pickled.
        main = types.ModuleType("__main__", "the notebook's namespace")
        main.__dict__.update(__builtins__=builtins, display=self.display)
        sys.modules["__main__"] = main
        self.ns = main.__dict__
        _install_ipython_display_shim(self.display)

    def _save(self, fig) -> None:
        self.n_fig += 1
        name = f"cell{self.cell:02d}_fig{self.n_fig}.png"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.files_dir / name, dpi=self.dpi, bbox_inches="tight")
        w, h = (fig.get_size_inches() * self.dpi).round().astype(int).tolist()
        self.out.add({"type": "image", "path": f"{self.files_dir.name}/{name}", "width_px": w, "height_px": h})

    def _show(self, *args, **kwargs) -> None:
        for num in self.plt.get_fignums():
            fig = self.plt.figure(num)
            self._save(fig)
            self.plt.close(fig)

    def display(self, *objs, **kwargs) -> None:
        """Jupyter's display(): figures become images, objects with a rich form keep it, others their repr."""
        for obj in objs:
            self._display_one(obj, kind="display")

    def _display_one(self, obj, kind: str) -> None:
        from matplotlib.figure import Figure

        if isinstance(obj, Figure):
            self._save(obj)
        elif isinstance(png := _rich(obj, "png"), bytes):
            self.n_fig += 1
            name = f"cell{self.cell:02d}_img{self.n_fig}.png"
            self.files_dir.mkdir(parents=True, exist_ok=True)
            (self.files_dir / name).write_bytes(png)
            self.out.add({"type": "image", "path": f"{self.files_dir.name}/{name}"})
        elif (md := _rich(obj, "markdown")) is not None:
            self.out.add({"type": "markdown", "text": str(md)})
        elif (html := _rich(obj, "html")) is not None:
            self.out.add({"type": "html", "text": str(html)})
        else:
            self.out.add({"type": kind, "text": _clean(repr(obj))})

    def run_cell(self, source: str, index: int) -> dict:
        """Run one cell; returns {"status", "outputs", "wall_s", "error"}. Never raises for the cell's own errors."""
        from labkit.bench import synchronize, time_fn

        self.cell, self.out, self.n_fig = index, _Outputs(), 0
        filename = f"<cell {index}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename=filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        last_code = compile(last, filename, "eval") if last is not None else None
        failure: list[BaseException] = []

        def run():
            try:
                with contextlib.redirect_stdout(_Stream(self.out, "stdout")), \
                        contextlib.redirect_stderr(_Stream(self.out, "stderr")):
                    exec(body, self.ns)
                    value = eval(last_code, self.ns) if last_code is not None else None
                    if value is not None:
                        self._display_one(value, kind="result")
                    self._show()  # figures still open at the end of a cell are shown, as inline does
                    synchronize()  # the cell's wall time includes the GPU work it queued
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # the cell's own failure, SystemExit included, is its recorded result
                failure.append(e)

        # A cell runs exactly once: one sample, no warm-up, so this is its wall time in seconds.
        wall = time_fn(run, warmup=0, repeats=1).median
        rec = {"status": "ok", "wall_s": wall, "error": None}
        if failure:
            e = failure[0]
            tb = traceback.TracebackException.from_exception(e)
            tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != _THIS])
            rec.update(status="error", error={"ename": type(e).__name__, "evalue": str(e),
                                              "traceback": _clean("".join(tb.format()))})
            self._show()
        rec["outputs"] = self.out.finished()
        return rec


def _rich(obj, kind: str):
    """obj._repr_<kind>_() as Jupyter would use it (None when obj has no such form)."""
    fn = getattr(obj, f"_repr_{kind}_", None)
    if not callable(fn) or isinstance(obj, type):
        return None
    value = fn()
    return value[0] if isinstance(value, tuple) else value


def _install_ipython_display_shim(display) -> None:
    """`from IPython.display import display, ...` records into the cell's outputs, with or without IPython."""
    try:
        import IPython.core.display_functions as functions
        import IPython.display

        IPython.display.display = functions.display = display
        return
    except ImportError:
        pass

    class _Rich:
        def __init__(self, data=None, filename=None, **kwargs):
            self.data = Path(filename).read_bytes() if filename else data

    class Markdown(_Rich):
        def _repr_markdown_(self):
            return self.data

    class HTML(_Rich):
        def _repr_html_(self):
            return self.data

    class Image(_Rich):
        def _repr_png_(self):
            return self.data

    pkg, mod = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    mod.display, mod.Markdown, mod.HTML, mod.Image = display, Markdown, HTML, Image
    pkg.display = mod
    # matplotlib reads IPython.version_info whenever an "IPython" module is loaded; a recent version makes it
    # skip its GUI-backend fix-ups, which a plain-script run does not need.
    pkg.version_info = (8, 24, 0)
    sys.modules.setdefault("IPython", pkg)
    sys.modules.setdefault("IPython.display", mod)


def run_child(path: Path, out: Path, dpi: int, command: str) -> int:
    """Run one notebook in this process, rewriting <out>/<stem>_files/run.json after every cell.

    The environment (card, torch, commit) is recorded when the notebook is done, so that this process touches
    the GPU no earlier than the notebook itself does.
    """
    from labkit.bench import write_json
    from labkit.env import environment, quick_mode

    cells = load_cells(path)
    files = out / f"{path.stem}_files"
    record = {"path": str(path), "quick": quick_mode(), "cells": []}
    code = [c for c in cells if c["type"] == "code"]
    for c in code:
        record["cells"].append({"cell": c["cell"], "status": "not run", "wall_s": None, "error": None,
                                "outputs": []})
    os.chdir(path.parent)  # as in Jupyter: relative paths are relative to the notebook
    session = _Session(path.stem, files, dpi)
    write_json(files / "run.json", record)
    status = 0
    for k, c in enumerate(code):
        rec = record["cells"][k]
        rec["status"] = "running"
        write_json(files / "run.json", record)  # if the process dies or times out, this cell is the culprit
        rec.update(session.run_cell(c["source"], c["cell"]))
        write_json(files / "run.json", record)
        print(f"  [{path.stem}] cell {c['cell']} ({k + 1}/{len(code)}) {rec['status']} in {rec['wall_s']:.2f} s",
              file=sys.__stderr__, flush=True)
        if rec["status"] != "ok":
            print(f"  [{path.stem}] {rec['error']['ename']}: {rec['error']['evalue']}", file=sys.__stderr__)
            status = 1
            break
    record["env"] = environment(command=command, device="auto")
    write_json(files / "run.json", record)
    return status


# ------------------------------------------------------------------------------------------ driving (parent)


def run_notebook(path: Path, out: Path, *, timeout: float, dpi: int, env: dict, command: str) -> dict:
    """Run one notebook in a fresh process; returns its run record (cells, status, wall time)."""
    files = out / f"{path.stem}_files"
    shutil.rmtree(files, ignore_errors=True)
    (out / f"{path.stem}.md").unlink(missing_ok=True)
    cmd = [sys.executable, _THIS, "--child", command, "--dpi", str(dpi), "--out", str(out), str(path)]
    # Own session, so a timeout also ends DataLoader workers and anything else the notebook started.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    problem = None
    try:
        code = proc.wait(timeout=timeout)
        if code not in (0, 1):
            problem = f"the notebook's process ended with exit code {code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        problem = f"timed out after {timeout:g} s (raise --timeout)"
    try:
        record = json.loads((files / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        record = {"path": str(path), "quick": None, "cells": []}
        problem = problem or "the notebook's process wrote no record"
    for c in record["cells"]:
        if c["status"] == "running":
            c.update(status="error", error={"ename": "Aborted", "evalue": problem or "did not finish",
                                            "traceback": ""})
    if problem and not any(c["status"] == "error" for c in record["cells"]):
        record["error"] = problem
    errors = [c for c in record["cells"] if c["status"] == "error"]
    record["status"] = "error" if errors or record.get("error") else "ok"
    record["wall_s"] = sum(c["wall_s"] or 0.0 for c in record["cells"])
    return record


def _fence(text: str, lang: str = "") -> str:
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def render_markdown(path: Path, cells: list[dict], record: dict, env: dict) -> str:
    """The executed notebook as Markdown: a header naming where it ran, then every cell with its outputs."""
    rel = _rel(path)
    mode = {True: "quick (CPU-sized)", False: "full", None: "?"}[record.get("quick")]
    lines = [
        f"# Executed: `{rel}`", "",
        f"Ran on **{env.get('device_name', '?')}**, torch {env.get('torch', '?')} (CUDA build {env.get('cuda')}), "
        f"commit `{str(env.get('git_commit', '?'))[:12]}`, {env.get('timestamp', '?')}, {mode} mode; "
        f"{record['wall_s']:.1f} s of cell time; status **{record['status']}**.", "",
        f"Command: `{env.get('command', '')}`", "",
    ]
    if record.get("error"):
        lines += [f"**Run problem:** {record['error']}", ""]
    by_cell = {c["cell"]: c for c in record["cells"]}
    for c in cells:
        if c["type"] == "markdown":
            lines += [c["source"].rstrip(), ""]
            continue
        if c["type"] != "code":
            continue
        rec = by_cell.get(c["cell"], {"status": "not run", "outputs": [], "wall_s": None, "error": None})
        took = f", {rec['wall_s']:.2f} s" if rec.get("wall_s") is not None else ""
        lines += [f"**Cell {c['cell']}** ({rec['status']}{took})", "", _fence(c["source"], "python"), ""]
        for o in rec["outputs"]:
            if o["type"] == "stream":
                lines += [("stderr:" if o["name"] == "stderr" else None), _fence(o["text"], "text"), ""]
            elif o["type"] in ("result", "display"):
                lines += [_fence(o["text"], "text"), ""]
            elif o["type"] == "image":
                lines += [f"![{path.stem} cell {c['cell']}]({o['path']})", ""]
            elif o["type"] == "markdown":
                lines += [o["text"].rstrip(), ""]
            elif o["type"] == "html":
                lines += [o["text"].strip(), ""]
        if rec.get("error"):
            e = rec["error"]
            lines += [f"**Error:** `{e['ename']}: {e['evalue']}`", "",
                      _fence(e["traceback"] or f"{e['ename']}: {e['evalue']}", "text"), ""]
    return "\n".join(line for line in lines if line is not None).rstrip() + "\n"


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _summary_cells(record: dict) -> list[dict]:
    out = []
    for c in record["cells"]:
        e = c.get("error")
        out.append({"cell": c["cell"], "status": c["status"], "wall_s": c["wall_s"],
                    "error": f"{e['ename']}: {e['evalue']}" if e else None,
                    "figures": [o["path"] for o in c["outputs"] if o["type"] == "image"]})
    return out


def bundle(out: Path, target: Path) -> tuple[Path, str]:
    """Pack everything under `out` into one .tar.gz; returns it and the folder its members unpack into.

    Members are named from the repository root when `out` is in it (so `tar -xzf` at the root puts them back in
    place), else from `out`'s own name.
    """
    target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        arc = out.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        arc = out.name
    tmp = target.with_name(f".{target.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(out.rglob("*")):
            if p.is_file() and p.resolve() not in (target, tmp.resolve()):
                tar.add(p, arcname=f"{arc}/{p.relative_to(out).as_posix()}", recursive=False)
    os.replace(tmp, target)
    return target, arc


def default_out() -> Path:
    """benchmarks/results/notebooks on a CUDA machine (the recorded runs), runs/notebooks elsewhere, so that a CPU
    run never overwrites the recorded GPU runs."""
    import torch

    if torch.cuda.is_available():
        return REPO_ROOT / "benchmarks" / "results" / "notebooks"
    return REPO_ROOT / "runs" / "notebooks"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to run, in this order (default: every notebook in notebooks/)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: benchmarks/results/notebooks with CUDA, runs/notebooks without)")
    ap.add_argument("--quick", action="store_true", help="CPU-sized settings (sets LABKIT_QUICK=1)")
    ap.add_argument("--full", action="store_true", help="full-size settings even without CUDA (LABKIT_QUICK=0)")
    ap.add_argument("--timeout", type=float, default=1200,
                    help="seconds one notebook may run before it is stopped and recorded as timed out")
    ap.add_argument("--dpi", type=int, default=100, help="resolution of the saved figures, dots per inch")
    ap.add_argument("--bundle", type=Path, metavar="FILE.tar.gz",
                    help="also pack the whole output folder into this one .tar.gz file")
    ap.add_argument("--child", metavar="COMMAND",
                    help="internal: run the one notebook given in this process, recording COMMAND as the command "
                         "(the driver starts one such process per notebook)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    try:
        if args.child is not None:
            if len(args.notebooks) != 1 or args.out is None:
                raise LabkitError("--child runs exactly one notebook and needs --out")
            return run_child(args.notebooks[0].resolve(), args.out.resolve(), args.dpi, args.child)
        return drive(args, argv)
    except LabkitError as e:
        print(f"run_notebooks: {e}", file=sys.stderr)
        return 2


def drive(args, argv: list[str]) -> int:
    """Run each notebook in its own process, write its Markdown record, the summary and the optional bundle."""
    from labkit.bench import load_result, save_result
    from labkit.env import environment
    from labkit.notebooks import notebook_paths

    if args.quick and args.full:
        raise LabkitError("--quick and --full contradict each other: pick one")
    if args.timeout <= 0 or args.dpi < 10:
        raise LabkitError("--timeout must be positive and --dpi at least 10")
    paths = [p.resolve() for p in args.notebooks] or notebook_paths()
    if not paths:
        raise LabkitError("no notebooks given and none found in notebooks/")
    for p in paths:
        if p.suffix != ".ipynb" or not p.is_file():
            raise LabkitError(f"{p}: no such notebook (.ipynb file)")
    stems = [p.stem for p in paths]
    if len(set(stems)) != len(stems):
        raise LabkitError("two notebooks share a file name; their records would collide: run them separately")
    cells = {p: load_cells(p) for p in paths}  # refuse IPython syntax before any cell runs anywhere
    out = (args.out or default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # PYTHONWARNINGS=default: warnings show once per place, as in Jupyter, whatever the caller's filters are.
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", PYTHONWARNINGS="default",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if args.quick or args.full:
        env["LABKIT_QUICK"] = "1" if args.quick else "0"
    command = shlex.join(["python", _rel(Path(__file__)), *argv])
    try:  # runs of other notebooks recorded earlier in this folder stay in the summary
        entries = {e["path"]: e for e in load_result(out / f"{SUMMARY}.json").get("notebooks", [])}
    except (LabkitError, AttributeError, KeyError, TypeError):
        entries = {}
    print(f"running {len(paths)} notebook(s), records in {out}", file=sys.stderr)
    failed = []
    for p in paths:
        record = run_notebook(p, out, timeout=args.timeout, dpi=args.dpi, env=env, command=command)
        run_env = record.get("env") or environment(command=command, device="auto")  # its process died early
        (out / f"{p.stem}.md").write_text(render_markdown(p, cells[p], record, run_env))
        entries[_rel(p)] = {
            "path": _rel(p), "record": f"{p.stem}.md", "status": record["status"], "quick": record["quick"],
            "wall_s": record["wall_s"], "error": record.get("error"), "env": run_env,
            "cells": _summary_cells(record),
        }
        n_err = sum(c["status"] == "error" for c in record["cells"])
        print(f"{p.name}: {record['status']}, {len(record['cells'])} code cells, {record['wall_s']:.1f} s"
              + (f", {n_err} error(s)" if n_err else "") + (f", {record['error']}" if record.get("error") else "")
              + f" -> {out / (p.stem + '.md')}", file=sys.stderr)
        if record["status"] != "ok":
            failed.append(p.name)
    summary = save_result(SUMMARY, {"notebooks": sorted(entries.values(), key=lambda e: e["path"])},
                          out_dir=out, command=command, device="auto")
    print(f"summary: {summary}", file=sys.stderr)
    if args.bundle:
        b, arc = bundle(out, args.bundle)
        size = b.stat().st_size / 2**20
        print(f"bundle: {b} ({size:.1f} MiB); `tar -xzf {b.name}` unpacks it into {arc}/"
              + (" (run it at the repository root)" if (REPO_ROOT / arc).resolve() == out else "")
              + ("; it is large: a lower --dpi makes it smaller" if size > 16 else ""), file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

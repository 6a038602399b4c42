"""nbgrader preprocessors the grader adds to `nbgrader autograde` (they run inside nbgrader, not the kernel).

- StderrIsNotFailure: nbgrader gives a test cell zero points as soon as anything appears on its stderr (a tqdm
  bar, a deprecation warning, a library's log line). Our tests fail by raising, so stderr is kept as output
  but no longer decides the grade.
- SealKernel / UnsealAfterKernel: while the student's code runs, the two files that hold the hidden tests
  (the sanitized notebook nbgrader just wrote beside the kernel, and the gradebook) are moved into an
  unlistable folder under an unguessable name, so `open('lab.ipynb')` or sqlite on `../../../gradebook.db`
  finds nothing to print into the feedback or to rewrite. After the kernel has shut down, every process the
  notebook left behind is killed before the gradebook comes back to receive the grades.
- HideHiddenTests: for feedback, hidden-test regions are removed from test cells, and so are the tracebacks of
  those cells (a traceback quotes the lines around the failure: the hidden tests); the error's name and
  message stay.
This is a barrier against casual and scripted snooping by code running as the same user, not a security
boundary: for a hostile class, run the grader in a container or as a separate user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from nbgrader import utils
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Unicode

TOKEN_VAR = "LABKIT_GRADER_TOKEN"  # same name as autograder.sandbox.limits.TOKEN_VAR (this module must import lightly)


class StderrIsNotFailure(NbGraderPreprocessor):
    """Relabel stderr streams of autograded test cells as stdout, marked, so only errors cost points."""

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "code" and utils.is_grade(cell) and not utils.is_solution(cell):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream" and out.get("name") == "stderr":
                    out["name"] = "stdout"
                    out["text"] = "".join("[stderr] " + line for line in out.get("text", "").splitlines(True))
        return cell, resources


class HideHiddenTests(NbGraderPreprocessor):
    """For feedback: drop hidden-test regions from test cells, and their tracebacks (which quote those lines).

    nbgrader's ClearHiddenTests refuses a notebook where a student's own cell merely mentions the marker; this
    one only touches grade cells and tolerates a missing end marker (it then hides to the end of the cell).
    """

    begin = Unicode("BEGIN HIDDEN TESTS", help="text that opens a hidden-test region").tag(config=True)
    end = Unicode("END HIDDEN TESTS", help="text that closes a hidden-test region").tag(config=True)

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type != "code" or not utils.is_grade(cell) or self.begin not in cell.source:
            return cell, resources
        kept, hiding = [], False
        for line in cell.source.splitlines(True):
            if self.begin in line:
                hiding = True
            elif self.end in line and hiding:
                hiding = False
            elif not hiding:
                kept.append(line)
        cell.source = "".join(kept)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
        return cell, resources


def _db_path(resources) -> str | None:
    url = resources.get("nbgrader", {}).get("db_url", "")
    return url[len("sqlite:///"):] if url.startswith("sqlite:///") else None


class SealKernel(NbGraderPreprocessor):
    """Before Execute: move the gradebook and the on-disk notebook out of the kernel's reach."""

    vault = Unicode("", help="folder without read permission that receives the sealed files").tag(config=True)

    def preprocess(self, nb, resources):
        if not self.vault:
            return nb, resources
        box = tempfile.mkdtemp(dir=self.vault)
        resources["labkit_vault_box"] = box
        resources["labkit_sealed"] = sealed = []
        path = resources.get("metadata", {}).get("path", "")
        name = resources.get("unique_key", "")
        for src in (_db_path(resources), os.path.join(path, f"{name}.ipynb") if name else None):
            if src and os.path.exists(src):
                dst = os.path.join(box, os.urandom(8).hex())
                shutil.move(src, dst)
                sealed.append((src, dst))
        return nb, resources


class UnsealAfterKernel(NbGraderPreprocessor):
    """After Execute: kill whatever the notebook left running, then put the gradebook back."""

    def preprocess(self, nb, resources):
        _kill_others()
        for src, dst in resources.pop("labkit_sealed", []):
            if not src.endswith(".ipynb"):  # the notebook is not needed back: nbgrader writes the graded one
                shutil.move(dst, src)
        box = resources.pop("labkit_vault_box", None)
        if box:
            shutil.rmtree(box, ignore_errors=True)
        return nb, resources


def _kill_others() -> None:
    import psutil

    me, sid, token = os.getpid(), os.getsid(0), os.environ.get(TOKEN_VAR)
    # Never this process's ancestors: in the sandbox the first of them is the PID namespace's init, which no
    # signal from inside can stop, and waiting for it to die cost every hand-in the full 5 s below.
    spare = {me, *(a.pid for a in psutil.Process(me).parents())}
    victims = []
    for p in psutil.process_iter(["pid"]):
        if p.pid in spare:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid or (token and p.environ().get(TOKEN_VAR) == token):
                victims.append(p)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(victims, timeout=5)

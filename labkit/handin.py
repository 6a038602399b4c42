"""A lab's hand-in: one zip in the layout the course's grader reads, from Jupyter or Colab.

The zip holds `<lab>.ipynb` (the notebook as saved) and the `student_*.py` files beside it, at its top level:
an LMS upload renamed to `<student>_<anything>.zip` is one student's hand-in for the grader's intake
(autograder/intake.py). On Colab the notebook is not a file the kernel can read, so it comes from the Colab
front end; the zip is then offered as a download and, with Google Drive mounted, copied to MyDrive too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from labkit.errors import LabkitError

DRIVE = Path("/content/drive/MyDrive")  # where Colab mounts the student's Google Drive


def _colab_notebook() -> dict:
    """The open notebook's JSON from the Colab front end (as saved there, outputs included)."""
    from google.colab import _message  # only exists on Colab

    reply = _message.blocking_request("get_ipynb", request="", timeout_sec=60)
    if not reply or "ipynb" not in reply:
        raise LabkitError("Colab did not hand over the notebook: save it (Ctrl+S) and run this cell again")
    return reply["ipynb"]


def _check(nb: dict, lab: str) -> None:
    cells = nb.get("cells") if isinstance(nb, dict) else None
    code = ["".join(c.get("source", "")) for c in cells or [] if c.get("cell_type") == "code"]
    if not any(s.startswith("%%writefile") for s in code):
        raise LabkitError(f"this is not the {lab} notebook (no %%writefile cell): open the lab's notebook")


def save(lab: str, folder: str | Path = ".", *, notebook: dict | None = None) -> Path | None:
    """Write `<folder>/<lab>_handin.zip` and return its path; on Colab also download it (and copy to Drive).

    `notebook`: the notebook's JSON (default: `<folder>/<lab>.ipynb`, or Colab's copy on Colab). Raises
    LabkitError, before writing anything, when the notebook is missing or is not the lab's.
    """
    if os.environ.get("NBGRADER_EXECUTION"):  # the course is grading this notebook: nothing to hand in
        print("graded run: no hand-in written")
        return None
    folder = Path(folder)
    colab = "google.colab" in sys.modules
    if notebook is None:
        path = folder / f"{lab}.ipynb"
        if colab:
            notebook = _colab_notebook()
        elif path.is_file():
            notebook = json.loads(path.read_text())
        else:
            raise LabkitError(f"{path} not found: run this cell in the folder of the lab's notebook, after saving it")
    _check(notebook, lab)
    out = folder / f"{lab}_handin.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{lab}.ipynb", json.dumps(notebook, indent=1, ensure_ascii=False))
        for p in sorted(folder.glob("student_*.py")):
            zf.write(p, p.name)
    print(f"hand-in written: {out.resolve()} (upload this file where your instructor says)")
    if colab:
        if DRIVE.is_dir():
            shutil.copyfile(out, DRIVE / out.name)
            print(f"copied to Google Drive: {DRIVE / out.name}")
        from google.colab import files

        files.download(str(out))
    return out

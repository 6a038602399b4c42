"""A lab's hand-in: one zip in the layout the course's grader reads, from Jupyter or Colab.

The zip holds `<lab>.ipynb` (the notebook as saved), the `student_*.py` files beside it, the student's own
handed-out `slow_train.py` (lab 3: its first line is the variant tag) and `handin.json` (the lab, the release's
version and that tag: what the hand-in was made from), at its top level:
an LMS upload renamed to `<student>_<anything>.zip` is one student's hand-in for the grader's intake
(autograder/intake/submissions.py). On Colab the notebook is not a file the kernel can read, so it comes from the Colab
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


def headless_steps(lab: str, indent: str = "") -> str:
    """How to hand in a lab from a shell (no Jupyter front end): execute the notebook in place, then zip it.

    `--allow-errors`: a check that fails raises, and without the flag nbconvert stops there and saves nothing, so
    a lab with one part unfinished would be handed in blank."""
    return (f"{indent}jupyter nbconvert --to notebook --execute --inplace --allow-errors {lab}.ipynb\n"
            f"{indent}python -m labkit.handin {lab}")


def _has_outputs(nb: dict) -> bool:
    """Whether any code cell of the notebook's JSON holds an output (the hand-in cell itself aside)."""
    code = [c for c in nb.get("cells") or [] if isinstance(c, dict) and c.get("cell_type") == "code"]
    return any(c.get("outputs") for c in code if not "".join(c.get("source", "")).startswith("# Hand-in"))


def _under_nbconvert() -> bool:
    """Whether this kernel was started by `jupyter nbconvert --execute` (its parent process is nbconvert's)."""
    try:
        import psutil
    except ImportError:
        return False
    try:
        return any("nbconvert" in part for part in psutil.Process(os.getppid()).cmdline())
    except (psutil.Error, OSError):  # not known: the full explanation is printed instead
        return False


def _refuse_without_outputs(nb: dict, lab: str) -> bool:
    """True when the saved notebook holds no output at all: with a loud message on stderr and the fix, or, when
    nbconvert runs this notebook (outputs are saved only after its run), a plain line naming the next step.

    The written answers are graded against the notebook's own outputs, and the zip holds the notebook as saved
    on disk: a notebook that was run but not saved, or run by `jupyter nbconvert --execute` (which writes its
    outputs only when the run ends, after this cell), would be handed in blank. No exception: under
    nbconvert an error here would stop the run before it writes the outputs the student needs.
    """
    if _has_outputs(nb):
        return False
    if _under_nbconvert():  # the expected first step of a headless hand-in: say the next one, without alarm
        print(f"Headless run: {lab}.ipynb's outputs are saved when this run ends, after this cell, so the hand-in "
              f"is the next step. When the run has ended, run, in this folder:\n    python -m labkit.handin {lab}")
        return True
    bar = "!" * 100
    print(f"{bar}\nNO HAND-IN WRITTEN: the saved {lab}.ipynb has no outputs in any code cell, and your written "
          f"answers are\ngraded against those outputs.\n"
          f"- In Jupyter: run every cell, save the notebook (Ctrl+S), then run this cell again.\n"
          f"- Headless (jupyter nbconvert --execute): the outputs are saved only when the run ends, after this "
          f"cell. If this run\n  is `jupyter nbconvert --to notebook --execute --inplace --allow-errors {lab}.ipynb`, let it end, "
          f"then run, in this folder,\n      python -m labkit.handin {lab}\n  Without --inplace the outputs go to a "
          f"copy ({lab}.nbconvert.ipynb) that the hand-in does not read:\n  run both\n"
          f"{headless_steps(lab, '      ')}\n{bar}", file=sys.stderr)
    return True


RECORD = "handin.json"  # what the hand-in was made from: the grader reads it (autograder.grade.handin_record)
MADE_FROM = ("slow_train.py",)  # files handed out to this student that the grader checks the hand-in against
_TAG_PREFIX = "# labkit variant tag: "


def _release_version() -> str:
    """The version of the course release installed here (the labkit package's), or labkit's own."""
    from importlib import metadata

    try:
        return metadata.version("labkit")
    except metadata.PackageNotFoundError:
        from labkit import __version__

        return __version__


def made_from(folder: Path, lab: str) -> dict:
    """What a hand-in was made from: the lab, the release's version, and the variant tag on the first line of the
    handed-out slow_train.py beside the notebook (lab 3; "" when there is none)."""
    tag = ""
    slow = folder / "slow_train.py"
    if slow.is_file():
        first = slow.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
        if first.startswith(_TAG_PREFIX):
            tag = first[len(_TAG_PREFIX):].split(" ", 1)[0][:64]
    return {"lab": lab, "release": _release_version(), "variant_tag": tag}


def _write_record(zf: zipfile.ZipFile, folder: Path, lab: str) -> None:
    """Put the hand-in's record (RECORD) and the student's own handed-out files (MADE_FROM) into the zip."""
    zf.writestr(RECORD, json.dumps(made_from(folder, lab), indent=1) + "\n")
    for name in MADE_FROM:
        if (folder / name).is_file():
            zf.write(folder / name, name)


def save(lab: str, folder: str | Path = ".", *, notebook: dict | None = None) -> Path | None:
    """Write `<folder>/<lab>_handin.zip` and return its path; on Colab also download it (and copy to Drive).

    `notebook`: the notebook's JSON (default: `<folder>/<lab>.ipynb`, or Colab's copy on Colab). Raises
    LabkitError, before writing anything, when the notebook is missing or is not the lab's. Writes nothing and
    returns None, with the fix on stderr, when the saved notebook (the default) has no outputs at all.
    """
    if os.environ.get("NBGRADER_EXECUTION"):  # the course is grading this notebook: nothing to hand in
        print("graded run: nothing to hand in here (this cell writes the zip when you run it yourself)")
        return None
    folder = Path(folder)
    colab = "google.colab" in sys.modules
    saved = notebook is None  # the notebook as saved (on disk or in Colab), not one the caller built
    if notebook is None:
        path = folder / f"{lab}.ipynb"
        if colab:
            notebook = _colab_notebook()
        elif path.is_file():
            notebook = json.loads(path.read_text())
        else:
            raise LabkitError(f"{path} not found: run this cell in the folder of the lab's notebook, after saving it")
    _check(notebook, lab)
    if saved and _refuse_without_outputs(notebook, lab):
        return None
    out = folder / f"{lab}_handin.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{lab}.ipynb", json.dumps(notebook, indent=1, ensure_ascii=False))
        for p in sorted(folder.glob("student_*.py")):
            zf.write(p, p.name)
        _write_record(zf, folder, lab)
    print(f"hand-in written: {out.resolve()} (upload this file where your instructor says)")
    if colab:
        if DRIVE.is_dir():
            shutil.copyfile(out, DRIVE / out.name)
            print(f"copied to Google Drive: {DRIVE / out.name}")
        from google.colab import files

        files.download(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.handin LAB [--folder DIR]`: the hand-in cell's zip, from a shell (after a headless run)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m labkit.handin", description=main.__doc__)
    ap.add_argument("lab", help="the lab's notebook name without .ipynb, e.g. lab3_profile_fix")
    ap.add_argument("--folder", default=".", help="the folder of the lab's notebook (default: here)")
    a = ap.parse_args(argv)
    if a.lab.endswith(".ipynb"):
        a.lab = a.lab[: -len(".ipynb")]
    try:
        out = save(a.lab, a.folder)
    except LabkitError as e:
        print(f"labkit.handin: {e}", file=sys.stderr)
        return 2
    return 0 if out is not None or os.environ.get("NBGRADER_EXECUTION") else 1


if __name__ == "__main__":
    sys.exit(main())

"""Course notebook conventions: Colab badge, Colab-only setup cell, no committed outputs.

`python -m labkit.notebooks` re-stamps every notebook's badge and setup cell, and the README's badge (which opens
Colab's list of the repository's notebooks), from the one repository slug in pyproject.toml ([tool.labkit]
colab_repo), and strips outputs; `--check` only reports (the tests use it). The graded labs get their badge
(the released notebook in the published student release, `<colab_repo>-student`), their locked setup cell and
their hand-in cell the same way; every Colab setup cell installs the student release, never this repository.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

from labkit.env import REPO_ROOT

NOTEBOOK_DIRS = ["notebooks"]
BADGE_RE = re.compile(r"https://colab\.research\.google\.com/github/([^)\s]+?)/blob/([^/)\s]+)/([^)\s]+\.ipynb)")
ANY_BADGE_RE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
SETUP_MARKER = "# labkit-setup: installs labkit inside Colab only; a no-op everywhere else."
LAB_SETUP_MARKER = "# Setup (read-only): on Colab, install the student release; find the grading harness; no warnings."
HANDIN_MARKER = "# Hand-in (read-only): save the notebook first (Ctrl+S); this writes <lab>_handin.zip for upload"
COLAB_MARK = "/content/.labkit-student"  # written after the release is installed, so a re-run skips pip
LAB_DIR = "assignments/source"
# Files a lab's notebook reads beside it: on Colab, fetched from the lab's folder of the published release (the
# course's common copy; a student handed their own replaces it).
LAB_FILES = {"lab3_profile_fix": ("slow_train.py",)}


def colab_repo(root: Path = REPO_ROOT) -> tuple[str, str]:
    """(owner/name, branch) configured in pyproject.toml."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["labkit"]
    return cfg["colab_repo"], cfg.get("colab_branch", "main")


def badge_markdown(rel_path: str, root: Path = REPO_ROOT, *, repo_branch: tuple[str, str] | None = None) -> str:
    """The Colab badge opening `rel_path` in this repository (or in `repo_branch`, e.g. the student release)."""
    repo, branch = repo_branch or colab_repo(root)
    url = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{rel_path}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def readme_badge(root: Path = REPO_ROOT) -> str:
    """The README's badge: it opens Colab's browser on the configured branch, listing every course notebook."""
    repo, branch = colab_repo(root)
    url = f"https://colab.research.google.com/github/{repo}/blob/{branch}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def readme_problems(root: Path = REPO_ROOT) -> list[str]:
    """What is wrong with the README's Colab badge: exactly one, above the first section, from the configured slug."""
    want = readme_badge(root)
    text = (root / "README.md").read_text()
    found = ANY_BADGE_RE.findall(text)
    if found != [want] or want not in text.split("\n## ", 1)[0]:
        return [f"README.md: needs one Colab badge above the first section, {want} "
                f"(run python -m labkit.notebooks); found {found}"]
    return []


def fix_readme(root: Path = REPO_ROOT) -> None:
    """Stamp the README's badge in place: replace the first badge (dropping any other), or add one after the title."""
    want, path = readme_badge(root), root / "README.md"
    text = path.read_text()
    if ANY_BADGE_RE.search(text):
        seen = []

        def first_only(_m):
            seen.append(1)
            return want if len(seen) == 1 else ""

        text = ANY_BADGE_RE.sub(first_only, text)
    else:
        lines = text.split("\n")
        at = 1 if lines and lines[0].startswith("# ") else 0
        lines[at:at] = ["", want] if at else [want, ""]
        text = "\n".join(lines)
    path.write_text(text)


def student_repo(root: Path = REPO_ROOT) -> tuple[str, str]:
    """(owner/name, branch) where the student release is published: the Colab slug's `-student` twin.

    An instructor pushes the built release (`make student`, dist/student/) there; the labs' badges open its
    notebooks and every setup cell installs it, so Colab never sees the instructor's repository.
    """
    repo, branch = colab_repo(root)
    return f"{repo}-student", branch


def release_url(root: Path = REPO_ROOT) -> str:
    """The student release as an archive pip installs: the published repository's branch, from GitHub."""
    repo, branch = student_repo(root)
    return f"https://github.com/{repo}/archive/refs/heads/{branch}.tar.gz"


def lab_file_url(lab: str, name: str, root: Path = REPO_ROOT) -> str:
    """A file of a lab's folder in the published student release, as raw text from GitHub."""
    repo, branch = student_repo(root)
    return f"https://raw.githubusercontent.com/{repo}/{branch}/labs/{lab}/{name}"


def _colab_install(root: Path, indent: str = "") -> list[str]:
    return [
        f'{indent}if "google.colab" in sys.modules and not os.path.exists("{COLAB_MARK}"):',
        f'{indent}    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "{release_url(root)}"], check=True)',
        f'{indent}    open("{COLAB_MARK}", "w").close()',
        f"{indent}    importlib.invalidate_caches()",
    ]


def setup_source(root: Path = REPO_ROOT) -> str:
    """A weekly notebook's first code cell: on Colab, pip install the student release (the light install)."""
    return "\n".join([SETUP_MARKER, "import importlib", "import os", "import subprocess", "import sys",
                      *_colab_install(root)])


def lab_setup_source(lab: str, root: Path = REPO_ROOT) -> str:
    """A lab's locked setup cell: the student release on Colab (and lab 3's slow_train.py beside the notebook),
    the harness found in an instructor's checkout, warnings kept out of the test cells."""
    lines = [LAB_SETUP_MARKER, "import importlib", "import os", "import subprocess", "import sys", "import warnings",
             "from pathlib import Path", "", 'warnings.filterwarnings("ignore")', *_colab_install(root)]
    for name in LAB_FILES.get(lab, ()):
        lines += [f'if "google.colab" in sys.modules and not os.path.exists("{name}"):',
                  "    import urllib.request", "",
                  f'    urllib.request.urlretrieve("{lab_file_url(lab, name, root)}", "{name}")',
                  f'    print("{name}: the course\'s common copy; if you were handed your own, upload it here instead")']
    lines += [
        "try:  # an instructor's checkout: the trusted harness is in a folder above, or where labkit comes from",
        "    from labkit.env import REPO_ROOT as _root",
        "except ImportError:",
        "    _root = Path.cwd()",
        "for _d in [Path.cwd().resolve(), *Path.cwd().resolve().parents, _root]:",
        '    if (_d / "autograder" / "harness.py").is_file():',
        "        if str(_d) not in sys.path:",
        "            sys.path.insert(0, str(_d))",
        "        break",
        "from autograder.harness import grade",
    ]
    return "\n".join(lines)


def handin_source(lab: str) -> str:
    """A lab's last cell: write the hand-in zip (downloaded on Colab)."""
    return "\n".join([HANDIN_MARKER, "# (on Colab it downloads the zip, and copies it to Google Drive when mounted).",
                      "# Headless, from a shell: the outputs are saved only when a run ends, so execute it in place",
                      "# (--allow-errors: on to the end when a check fails, which would otherwise save nothing), then",
                      f"#   jupyter nbconvert --to notebook --execute --inplace --allow-errors {lab}.ipynb && "
                      f"python -m labkit.handin {lab}",
                      "from labkit import handin", "", f'handin.save("{lab}")'])


def lab_badge(lab: str, root: Path = REPO_ROOT) -> str:
    """The lab's badge: its released notebook in the published student release (never the solution)."""
    repo, branch = student_repo(root)
    url = f"https://colab.research.google.com/github/{repo}/blob/{branch}/labs/{lab}/{lab}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def notebook_paths(root: Path = REPO_ROOT) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.ipynb"))


def problems(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """What is wrong with one committed notebook (empty list when it follows the conventions)."""
    rel = path.relative_to(root).as_posix()
    try:
        nb = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"{rel}: unreadable ({e})"]
    cells = nb.get("cells", [])
    out = []
    if not cells or cells[0].get("cell_type") != "markdown":
        out.append(f"{rel}: first cell must be markdown with the Colab badge")
    else:
        urls = BADGE_RE.findall("".join(cells[0]["source"]))
        repo, branch = colab_repo(root)
        if (repo, branch, rel) not in urls:
            out.append(f"{rel}: Colab badge must point at {repo}/blob/{branch}/{rel}, found {urls}")
    code = [c for c in cells if c.get("cell_type") == "code"]
    if not code or "".join(code[0]["source"]).strip() != setup_source(root):
        out.append(f"{rel}: first code cell must be the labkit setup cell (run python -m labkit.notebooks)")
    for i, c in enumerate(code):
        if c.get("outputs") or c.get("execution_count"):
            out.append(f"{rel}: code cell {i} has outputs; commit notebooks without outputs")
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
        ids = [c.get("id") for c in cells]
        if None in ids or len(set(ids)) != len(ids):
            out.append(f"{rel}: nbformat 4.5 needs a unique id on every cell (run python -m labkit.notebooks)")
    return out


def _like(old, text: str):
    """`text` in the form the cell had: a list of lines (nbformat's usual form) or one string."""
    return text.splitlines(keepends=True) if isinstance(old, list) else text


def fix(path: Path, root: Path = REPO_ROOT) -> None:
    """Stamp the badge and setup cell, strip outputs and execution counts, in place."""
    rel = path.relative_to(root).as_posix()
    nb = json.loads(path.read_text())
    cells = nb.setdefault("cells", [])
    badge = badge_markdown(rel, root)
    if cells and cells[0].get("cell_type") == "markdown":
        src = "".join(cells[0]["source"])
        src = re.sub(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)", badge, src) if "Open In Colab" in src \
            else badge + "\n\n" + src
        cells[0]["source"] = _like(cells[0]["source"], src)
    else:
        cells.insert(0, {"cell_type": "markdown", "metadata": {}, "source": badge})
    setup = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": setup_source(root)}
    if nb.get("nbformat", 4) == 4 and nb.get("nbformat_minor", 0) >= 5:
        setup["id"] = "labkit-setup"  # nbformat 4.5 requires cell ids
    first_code = next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"), None)
    if first_code is not None and "".join(cells[first_code]["source"]).startswith(SETUP_MARKER):
        old = cells[first_code]
        old["source"] = _like(old["source"], setup["source"])  # in place: the cell's keys keep their order
    else:
        cells.insert(1, setup)
    for c in cells:
        if c.get("cell_type") == "code":
            c["outputs"], c["execution_count"] = [], None
        if nb.get("nbformat_minor", 0) < 5:
            c.pop("id", None)
    if nb.get("nbformat_minor", 0) >= 5:  # ids: unique, stable across runs (derived from the position)
        seen: set[str] = set()
        for i, c in enumerate(cells):
            if not c.get("id") or c["id"] in seen:
                c["id"] = f"cell-{i}"
            seen.add(c["id"])
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if nb.setdefault("metadata", {}).get("kernelspec") != kernel:
        nb["metadata"]["kernelspec"] = kernel
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def lab_paths(root: Path = REPO_ROOT) -> list[Path]:
    """The graded labs' source notebooks (assignments/source/<lab>/<lab>.ipynb)."""
    return sorted(p for p in (root / LAB_DIR).glob("*/*.ipynb") if p.stem == p.parent.name)


def _setup_index(cells: list) -> int | None:
    return next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"
                 and c.get("metadata", {}).get("nbgrader", {}).get("grade_id", "").endswith("_setup")), None)


def lab_problems(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """What is wrong with a lab notebook's badge, setup cell or hand-in cell (empty when they are current)."""
    lab, rel = path.stem, path.relative_to(root).as_posix()
    cells = json.loads(path.read_text()).get("cells", [])
    out = []
    if not cells or lab_badge(lab, root) not in "".join(cells[0].get("source", "")):
        out.append(f"{rel}: the first cell needs the badge {lab_badge(lab, root)} (run python -m labkit.notebooks)")
    i = _setup_index(cells)
    if i is None or "".join(cells[i]["source"]) != lab_setup_source(lab, root):
        out.append(f"{rel}: the locked setup cell is not current (run python -m labkit.notebooks)")
    if not cells or "".join(cells[-1].get("source", "")) != handin_source(lab):
        out.append(f"{rel}: the last cell must save the hand-in (run python -m labkit.notebooks)")
    if any(c.get("outputs") or c.get("execution_count") for c in cells if c.get("cell_type") == "code"):
        out.append(f"{rel}: commit notebooks without outputs")
    return out


def fix_lab(path: Path, root: Path = REPO_ROOT) -> None:
    """Stamp a lab notebook's badge, setup cell and hand-in cell; strip outputs. Other cells are left alone."""
    lab = path.stem
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    src = ANY_BADGE_RE.sub("", "".join(cells[0]["source"])).lstrip("\n")
    cells[0]["source"] = _like(cells[0]["source"], lab_badge(lab, root) + "\n\n" + src)
    i = _setup_index(cells)
    if i is None:
        raise ValueError(f"{path}: no locked setup cell (nbgrader grade_id ending in _setup)")
    cells[i]["source"] = _like(cells[i]["source"], lab_setup_source(lab, root))
    prefix = cells[i]["metadata"]["nbgrader"]["grade_id"].removesuffix("_setup")
    handin = {"cell_type": "code", "execution_count": None, "id": "handin", "outputs": [],
              "metadata": {"nbgrader": {"grade": False, "grade_id": f"{prefix}_handin", "locked": True,
                                        "schema_version": 3, "solution": False, "task": False}},
              "source": _like([], handin_source(lab))}
    if "".join(cells[-1].get("source", "")).startswith(HANDIN_MARKER):
        cells[-1] = handin
    else:
        cells.append(handin)
    for c in cells:
        if c.get("cell_type") == "code":
            c["outputs"], c["execution_count"] = [], None
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="report problems, change nothing")
    ap.add_argument("paths", nargs="*", type=Path,
                    help="notebooks (default: all course notebooks, and the README's badge)")
    args = ap.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or notebook_paths()
    bad = []
    if not args.paths:
        if not args.check:
            fix_readme()
        bad += readme_problems()
        for p in lab_paths():
            if not args.check:
                fix_lab(p)
            bad += lab_problems(p)
    for p in paths:
        if not args.check:
            fix(p)
        bad += problems(p)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

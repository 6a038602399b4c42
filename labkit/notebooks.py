"""Course notebook conventions: Colab badge, Colab-only setup cell, no committed outputs.

`python -m labkit.notebooks` re-stamps every notebook's badge and setup cell, and the README's badge (which opens
Colab's list of the repository's notebooks), from the one repository slug in pyproject.toml ([tool.labkit]
colab_repo), and strips outputs; `--check` only reports (the tests use it).
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


def colab_repo(root: Path = REPO_ROOT) -> tuple[str, str]:
    """(owner/name, branch) configured in pyproject.toml."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["labkit"]
    return cfg["colab_repo"], cfg.get("colab_branch", "main")


def badge_markdown(rel_path: str, root: Path = REPO_ROOT) -> str:
    repo, branch = colab_repo(root)
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


def setup_source(root: Path = REPO_ROOT) -> str:
    repo, branch = colab_repo(root)
    return "\n".join([
        SETUP_MARKER,
        "import os",
        "import subprocess",
        "import sys",
        'if "google.colab" in sys.modules and not os.path.isdir("/content/labkit"):',
        f'    subprocess.run(["git", "clone", "-q", "--depth", "1", "-b", "{branch}",',
        f'                    "https://github.com/{repo}", "/content/labkit"], check=True)',
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/labkit"], check=True)',
        '    sys.path.insert(0, "/content/labkit")',
        '    os.chdir("/content/labkit/notebooks")',
    ])


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
        cells[0]["source"] = src
    else:
        cells.insert(0, {"cell_type": "markdown", "metadata": {}, "source": badge})
    setup = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": setup_source(root)}
    if nb.get("nbformat", 4) == 4 and nb.get("nbformat_minor", 0) >= 5:
        setup["id"] = "labkit-setup"  # nbformat 4.5 requires cell ids
    first_code = next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"), None)
    if first_code is not None and "".join(cells[first_code]["source"]).startswith(SETUP_MARKER):
        cells[first_code] = setup
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
    nb.setdefault("metadata", {})["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
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
    for p in paths:
        if not args.check:
            fix(p)
        bad += problems(p)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

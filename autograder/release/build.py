"""The student release: what a graded course's students receive, and nothing that holds an answer.

    python -m autograder.release [--out dist] [--course assignments]        (make student)

Builds `<out>/student/` and `<out>/labkit-student-<version>.tar.gz` (one top folder, pip-installable) holding the
seven weekly notebooks, each lab's released notebook (nbgrader generate_assignment output) with its data files,
the public checks (`autograder.selfcheck`, run by the released test cells through a small `autograder.harness`),
the public probes they drive (`autograder/student/`), the `labkit` package with the recorded results the
notebooks show, a light-install pyproject.toml, a README and MANIFEST.json. The trusted checks, references,
answer keys, solution notebooks and hidden tests stay in the instructor's repository. Before anything is
written the output folder must be writable; after the build every file is scanned (`scan`) and a leak fails the
build. assignments/README.md says which parts are instructor-only and how a course is run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[2]
LABS = ["lab1_loss_scaling", "lab2_data_pipeline", "lab3_profile_fix", "lab4_speedrun", "lab5_fused_kernel"]
# The public probes the public checks import (the sandbox-only runner, channel and stubs are not needed).
PUBLIC_PROBES = ["__init__.py", "probes.py", "lab1.py", "lab2.py", "lab3.py", "lab3_slow.py", "lab4.py", "lab5.py"]
# The public checks, and the labkit-answer ban they apply with the grader's own words (labkit_answers holds only the
# per-lab lists the labs' instructions state, and the reader of a submission's imports).
PUBLIC_CHECKS = ["selfcheck.py", "selfcheck_core.py", "selfcheck_labs.py", "labkit_answers.py"]
# New grader modules that never ship: the variant generator knows every variant's answers, and the secret's module
# is how hidden cases are drawn (no student needs either). The scan holds their code as needles too.
INSTRUCTOR_ONLY = ["checks/lab3_variants.py", "base/course_secret.py"]  # under autograder/
# The labels hidden values are derived from (course_secret.seed/rng/derive("label", ...)): trusted code's words.
HMAC_LABEL = re.compile(r"course_secret\.(?:seed|rng|derive)\(\s*f?[\"']([^\"'{]+)")
LAB3_SLOW = "labs/lab3_profile_fix/slow_train.py"
# Folders of recorded artifacts under benchmarks/results that a notebook reads and a CPU student needs whole:
# week 3's memory snapshots, week 5's GPU traces (exercise 5.5) and nsys run.
ARTIFACT_DIRS = ("week3_snapshot", "trace_corpus", "week5_nsys")
SOLUTION_MARKERS = ["BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"]
# Module-level names of the trusted checks whose values are answers or hidden cases.
SECRET_NAME = re.compile(r"HIDDEN|ANSWER|SECRET", re.I)

RELEASE_INIT = '''"""The student release's grader side: public checks only (`selfcheck`), and the public probes they drive.

The course's grader, with its hidden tests and references, is not part of this release.
"""
'''
RELEASE_HARNESS = '''"""What the released lab notebooks' test cells import: the public checks of the student release.

`grade(check, file, points)` runs that public check on your file and prints the verdict; the course's grader
scores your hand-in with more cases. `python -m autograder.harness lab1 student_scaler.py` runs a lab's checks.
"""

import sys

from autograder.selfcheck import NotHere as NotGradableHere  # noqa: F401  (notebooks may name it)
from autograder.selfcheck import grade, main, run_check, run_checks  # noqa: F401

if __name__ == "__main__":
    sys.exit(main(prog="python -m autograder.harness"))
'''


def version(root: Path = ROOT) -> str:
    """The project's version from pyproject.toml."""
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def check_writable(out: Path) -> Path:
    """`out` resolved, or LabkitError when it (or the nearest folder above it that exists) cannot be written."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise LabkitError(f"--out {out}: not a folder; pass a folder to build the student release in")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise LabkitError(f"--out {out}: {probe} is a file, not a folder; pass another --out")
    try:  # a real write, not os.access: root passes access checks on a read-only mount
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise LabkitError(f"--out {out}: cannot write in {probe} ({e.strerror}); pass another --out") from None
    return out


# ---------------------------------------------------------------------------------- what goes in


def _results(root: Path) -> list[Path]:
    """Recorded results the weekly notebooks or labkit name (grading results stay out): JSON records, and the
    folders of recorded artifacts a notebook reads (week 3's memory snapshots), named the same way."""
    text = "".join(p.read_text() for p in [*(root / "notebooks").glob("*.ipynb"), *(root / "labkit").glob("*.py")])
    found = [*sorted((root / "benchmarks" / "results").glob("*/*.json")),  # records sit in topic folders
             *sorted(p for p in (root / "benchmarks" / "results").glob("*/*") if p.is_dir() and p.name in ARTIFACT_DIRS)]
    return [p for p in found
            if not p.stem.startswith("grade") and re.search(rf'\\?["\']{re.escape(p.name if p.is_dir() else p.stem)}\\?["\']', text)]


def _pyproject(root: Path) -> str:
    """The release's pyproject.toml: the light install (the project's own dependencies), both packages."""
    proj = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    deps = ",\n".join(f"    {json.dumps(d)}" for d in proj["dependencies"])
    return f'''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "labkit"
version = "{proj["version"]}"
description = "{proj["description"]} (student release)"
readme = "README.md"
requires-python = "{proj["requires-python"]}"
license = "MIT"
license-files = ["LICENSE"]
dependencies = [
{deps},
]

[project.optional-dependencies]
course = {json.dumps(proj["optional-dependencies"]["course"])}

[project.scripts]
labkit = "{proj["scripts"]["labkit"]}"

[tool.setuptools.packages.find]
include = ["labkit*", "autograder*"]

[tool.setuptools.package-data]
labkit = ["results/*.json", {", ".join(json.dumps(f"results/{d}/*") for d in ARTIFACT_DIRS)}]
'''


def _readme(ver: str, slug: str) -> str:
    return f"""# labkit {ver}: student release

The course's seven weekly notebooks (`notebooks/`), the graded labs (`labs/<lab>/<lab>.ipynb`), the `labkit`
package and the public checks of each lab. No graded lab's answer is here (the weekly notebooks' exercises are
not graded: `ex.reference(...)` hands you labkit's version of one to move on), and the course's grader runs more
tests (hidden cases, other seeds) when it grades your hand-in.

- **Colab**: open a notebook's badge; its first cell installs this release (`pip install` of this folder's
  archive, published at https://github.com/{slug}), nothing else.
- **Your own machine** (Python 3.11+): `pip install .` in this folder (`pip install ".[course]"` adds
  JupyterLab), then `jupyter lab`.
- **A machine without an NVIDIA GPU** (optional, it saves a download): install the CPU-only PyTorch first, then
  this release: `pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu`, then
  `pip install .`. The default torch wheel on Linux carries the CUDA libraries, several GB that a CPU never uses.
  Where download.pytorch.org cannot be reached (a network that allows only PyPI), stop that command and run
  `pip install .` alone: the default wheel works on a CPU too. Every lab's public checks run on a CPU, except
  the speed parts of labs 4 and 5, which need a CUDA GPU (Colab's is one). Lab 5's Triton kernels run on a CPU in
  Triton's interpreter, on Linux only (PyPI has no Triton for macOS or Windows): elsewhere, use Colab.
- **Checks**: a lab's test cells run its public checks on your `student_*.py` (the `%%writefile` cell above
  them writes it from your code: run that cell first); the same from a shell in the
  lab's folder: `python -m autograder.harness lab1 student_scaler.py` (`--list` names them). Lab 3's compare
  with the `slow_train.py` beside your notebook: if your instructor handed you your own, put it there.
- **Hand-in**: the last cell of each lab writes `<lab>_handin.zip` (your notebook and the files beside it);
  upload that file where your instructor says.

`MANIFEST.json` lists every file with its part and sha256.
"""


def student_repo(root: Path = ROOT) -> tuple[str, str]:
    """(owner/name, branch) where the student release is published: the Colab slug's `-student` twin."""
    from labkit.notebooks import colab_repo

    repo, branch = colab_repo(root)
    return f"{repo}-student", branch


def _copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)


def _student_notebook(src: Path, dest: Path, root: Path = ROOT) -> None:
    """A weekly notebook as students get it: every exercise's worked answer replaced by the blank, and its Colab
    badge opening the student release's copy (the instructor's repository may be a private fork)."""
    from labkit.exercises import blank_notebook
    from labkit.notebooks import badge_markdown

    nb = blank_notebook(json.loads(src.read_text()))
    rel = f"notebooks/{src.name}"
    mine, theirs = badge_markdown(rel, root), badge_markdown(rel, root, repo_branch=student_repo(root))
    for c in nb["cells"][:1]:
        text = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        c["source"] = text.replace(mine, theirs)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def common_slow_train() -> str:
    """Lab 3's slow_train.py for the release: the course's common variant under the course secret (the open kit's
    own slow_train.py without one). Per-student variants are handed out beside the release (`handouts`)."""
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    return lab3_variants.render(lab3_variants.spec_for(None, course_secret.load(graded=False)))


def handouts(out: Path, roster: Path) -> list[Path]:
    """Each roster student's own lab 3 slow_train.py, `<out>/<id>/slow_train.py`, from the course secret."""
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    return lab3_variants.write(out, lab3_variants.roster_ids(roster), course_secret.load(graded=False),
                               per_student=True)


def generate_release(course: str | Path, assignment: str, dest: Path) -> Path:
    """Run nbgrader generate_assignment on a copy of the course in `dest`; returns the release notebook's path."""
    from autograder.base.nbstart import nbgrader_command, py_env
    from autograder.sandbox.limits import Limits, run_limited

    course, dest = Path(course), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(course / "nbgrader_config.py", dest / "nbgrader_config.py")
    shutil.copytree(course / "source" / assignment, dest / "source" / assignment, dirs_exist_ok=True)
    out = run_limited(nbgrader_command("generate_assignment", assignment, "--force"),
                      cwd=dest, env=py_env(), limits=Limits(wall_s=600, memory_bytes=None))
    release = dest / "release" / assignment / f"{assignment}.ipynb"
    if not out.ok or not release.exists():
        raise LabkitError(f"nbgrader generate_assignment {assignment} failed: {out.output[-400:]}")
    return release


def _lab_files(root: Path, course: Path, stage: Path, work: Path) -> None:
    for lab in LABS:
        nb = generate_release(course, lab, work / lab)
        for p in sorted(nb.parent.rglob("*")):
            rel = p.relative_to(nb.parent)
            if p.is_file() and not p.name.startswith("student_") and ".ipynb_checkpoints" not in rel.parts:
                _copy(p, stage / "labs" / lab / rel)


def assemble(stage: Path, *, root: Path = ROOT, course: Path | None = None) -> None:
    """Lay out the release's files under `stage` (an empty folder)."""
    course = Path(course or root / "assignments")
    for p in sorted((root / "notebooks").glob("*.ipynb")):
        _student_notebook(p, stage / "notebooks" / p.name, root)
    # labkit/faststart (the top rung's fast start) ships, deliberately: `labkit train` imports it for its cold start
    # (a compiled rung on a GPU starts tiered), `labkit ladder` loads the compile-cache artifact through it and
    # `labkit compile-cache` is its command, so without it neither the student's train nor ladder would run, and the
    # top rung would not start as the recorded results (cold_start_tiered_final) say it does.
    for p in sorted([*(root / "labkit").glob("*.py"), *(root / "labkit" / "faststart").glob("*.py")]):
        _copy(p, stage / p.relative_to(root))
    for p in _results(root):
        if p.is_dir():
            shutil.copytree(p, stage / "labkit" / "results" / p.name)
        else:
            _copy(p, stage / "labkit" / "results" / p.name)
    (stage / "autograder" / "student").mkdir(parents=True)
    (stage / "autograder" / "__init__.py").write_text(RELEASE_INIT)
    (stage / "autograder" / "harness.py").write_text(RELEASE_HARNESS)
    for name in PUBLIC_CHECKS:
        _copy(root / "autograder" / name, stage / "autograder" / name)
    for name in PUBLIC_PROBES:
        _copy(root / "autograder" / "student" / name, stage / "autograder" / "student" / name)
    with tempfile.TemporaryDirectory(prefix="release-gen-") as work:
        _lab_files(root, course, stage, Path(work))
    (stage / LAB3_SLOW).write_text(common_slow_train())
    ver, (slug, _) = version(root), student_repo(root)
    (stage / "pyproject.toml").write_text(_pyproject(root))
    (stage / "README.md").write_text(_readme(ver, slug))
    _copy(root / "LICENSE", stage / "LICENSE")
    (stage / "MANIFEST.json").write_text(json.dumps(manifest(stage, ver), indent=1) + "\n")


def _part(rel: str) -> str:
    if rel.startswith("notebooks/"):
        return "weekly notebook"
    if rel.startswith("labs/"):
        return "released lab (nbgrader generate_assignment)"
    if rel.startswith("autograder/"):
        return "public checks and probes"
    if rel.startswith("labkit/"):
        return "labkit package"
    return "install and documentation"


def manifest(stage: Path, ver: str) -> dict:
    """What the release holds: every file (but the manifest) with its part, size in bytes and sha256."""
    files = []
    for p in sorted(q for q in stage.rglob("*") if q.is_file() and q.name != "MANIFEST.json"):
        rel = p.relative_to(stage).as_posix()
        files.append({"path": rel, "part": _part(rel), "bytes": p.stat().st_size,
                      "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    return {"name": "labkit-student", "version": ver, "instructor_only": "assignments/source (solutions), "
            "autograder/checks/lab*_checks.py (references, answer keys, hidden checks), autograder/checks/lab3_variants.py (the "
            "variant generator), autograder/base/course_secret.py, autograder/checks/harness.py and the rest of the grader, the "
            "course secret and the per-student lab 3 handouts", "files": files}


# ---------------------------------------------------------------------------------- the leak scan


def _hidden_checks(root: Path) -> list[str]:
    """Registered lab checks that are not public checks of the release: the hidden ones."""
    from autograder.checks.harness import CHECKS
    from autograder.selfcheck import PUBLIC

    return sorted(n for n in CHECKS if n.startswith("lab") and n not in PUBLIC)


def _literals(tree: ast.AST, text: str) -> list[str]:
    out = []
    """Source of the literal collections and calls under `tree` that hold a number: the probe values."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict | ast.List | ast.Tuple | ast.Set | ast.Call):
            seg = ast.get_source_segment(text, node) or ""
            numbers = any(isinstance(n, ast.Constant) and type(n.value) in (int, float) for n in ast.walk(node))
            if numbers and len(re.sub(r"\s+", "", seg)) >= 12 and not seg.startswith(("require(", "CheckFailed(")):
                out.append(seg)
    return out


def _public_text(root: Path) -> str:
    """Text that is public by design: the probes, and the lab notebooks' cells that are neither solution nor
    hidden test (a trusted line repeated there, e.g. a docstring, is no leak)."""
    from autograder.checks import lab3_variants

    parts = [p.read_text() for p in sorted((root / "autograder" / "student").glob("*.py"))]
    parts += [lab3_variants.render(lab3_variants.CLASSIC), common_slow_train()]  # handed out: public by design
    for lab in LABS:
        for c in json.loads((root / "assignments" / "source" / lab / f"{lab}.ipynb").read_text())["cells"]:
            src = "".join(c["source"])
            if not c.get("metadata", {}).get("nbgrader", {}).get("solution") and "HIDDEN TESTS" not in src:
                parts.append(src)
    return "\n".join(parts)


def needles(root: Path = ROOT) -> dict[str, str]:
    """What must never appear in the release: {text: why}. Texts are compared with all whitespace removed."""
    from autograder.checks.harness import CHECKS

    out = {m: "an nbgrader solution or hidden-test region" for m in SOLUTION_MARKERS}
    out["ANSWER_KEY"] = "an answer key"
    hidden = _hidden_checks(root)
    for name in hidden:
        c = CHECKS[name]
        out[name] = "the name of a hidden check"
        out[c.func] = f"the function of hidden check {name}"
    for path in sorted((root / "autograder" / "checks").glob("lab*_checks.py")):
        text = path.read_text()
        tree = ast.parse(text)
        funcs = {CHECKS[n].func for n in hidden if CHECKS[n].module.endswith(path.stem)}
        for node in tree.body:
            name = getattr(node, "name", None) or next((t.id for t in getattr(node, "targets", [])
                                                        if isinstance(t, ast.Name)), None)
            if isinstance(node, ast.ClassDef):
                out[node.name] = f"a class of the trusted {path.name} (a reference)"
            if name and (name in funcs or SECRET_NAME.search(name)):
                out[name] = f"a hidden name of {path.name}"
                for seg in _literals(node, text):
                    out[seg] = f"a hidden probe value of {path.name} ({name})"
    out.update(_secret_needles(root))
    public = _public_text(root)
    trusted = [*(root / "autograder" / "checks").glob("lab*_checks.py"), *(root / "autograder" / n for n in INSTRUCTOR_ONLY)]
    for path in [*trusted, root / "autograder" / "checks" / "harness.py"]:
        for line in path.read_text().splitlines():
            s = line.strip()
            if len(s) >= 60 and not s.startswith(("#", '"', "'", "from ", "import ")) and s not in public:
                out[s] = f"a line of the trusted {path.name}"
    out = {k: v for k, v in out.items() if k.strip()}
    return {k: v for k, v in out.items() if "HMAC label" not in v or re.sub(r"\s+", "", k) not in
            re.sub(r"\s+", "", public)}


def _secret_needles(root: Path) -> dict[str, str]:
    """The variant generator's tables, the HMAC labels hidden values are derived from, and, when the course secret
    is set, the secret itself, what it derives for each label and the common lab 3 variant's answer key."""
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    out = {}
    gen = root / "autograder" / "checks" / "lab3_variants.py"
    text = gen.read_text()
    for node in ast.parse(text).body:
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and value is not None and not (
                isinstance(value, ast.Constant) and isinstance(value.value, str)):
            seg = ast.get_source_segment(text, node) or ""
            if len(re.sub(r"\s+", "", seg)) >= 30:
                out[seg] = "the variant generator's tables (lab3_variants.py)"
    # trusted code only: the sandboxed half (autograder/student) holds no label
    grader = [p for p in (root / "autograder").rglob("*.py") if "student" not in p.relative_to(root / "autograder").parts]
    labels = sorted({m for p in grader for m in HMAC_LABEL.findall(p.read_text())})
    out.update({lb: "an HMAC label of the course secret (trusted code)" for lb in labels if len(lb) >= 8})
    secret = course_secret.load(graded=False)
    if not secret.open_kit:
        out[secret.key.decode()] = "the course secret itself"
        out.update({course_secret.derive(lb, secret=secret).hex(): f"a value derived from the course secret ({lb})"
                    for lb in labels})
    key = {k: v[0] for k, v in lab3_variants.answer_key(lab3_variants.spec_for(None, secret)).items()}
    out[json.dumps(key)] = out[repr(key)] = "the answer key of the release's lab 3 variant"
    return out


def solution_lines(root: Path = ROOT) -> set[str]:
    """The reference solutions' code lines (40+ characters) from the solution regions of the labs' source
    notebooks and of the weekly notebooks."""
    out = set()
    sources = [root / "assignments" / "source" / lab / f"{lab}.ipynb" for lab in LABS]
    for nb in [*sources, *sorted((root / "notebooks").glob("*.ipynb"))]:  # the labs' and the weeks' answers
        for c in json.loads(nb.read_text())["cells"]:
            for region in re.findall(r"BEGIN SOLUTION(.*?)END SOLUTION", "".join(c["source"]), flags=re.S):
                out |= {ln.strip() for ln in region.splitlines() if len(ln.strip()) >= 40
                        and not ln.strip().startswith("#")}
    return out


SOLUTION_BLOCK = 3  # solution lines in one file that make a copied solution (one may be a common idiom)


def scan(folder: Path, root: Path = ROOT, extra: dict[str, str] | None = None) -> list[str]:
    """Every leak in the files under `folder` (and inside its .tar.gz archives): one line per find.

    A needle (see `needles`) is a leak wherever it appears; reference solution code is one where a file holds
    SOLUTION_BLOCK or more of its lines."""
    every = {**needles(root), **(extra or {})}
    # A name is a leak as a whole word (a cell id like test_lab1_hidden_edge_cases is no use of hidden_edge_cases);
    # other needles are compared with all whitespace removed.
    names = {k: re.compile(rf"(?<![\w]){re.escape(k)}(?![\w])") for k in every if re.fullmatch(r"[A-Za-z_]\w*", k)}
    wanted = {re.sub(r"\s+", "", k): f"{k[:60]!r} ({v})" for k, v in every.items() if k not in names}
    solution = {re.sub(r"\s+", "", ln) for ln in solution_lines(root)}
    found = []
    for rel, data in _files(Path(folder)):
        raw = data.decode("utf-8", errors="replace").replace("\\n", "\n").replace('\\"', '"')  # notebook JSON
        flat = re.sub(r"\s+", "", raw)
        found += [f"{rel}: {k!r} ({every[k]})" for k, rx in names.items() if rx.search(raw)]
        found += [f"{rel}: {why}" for k, why in wanted.items() if k and k in flat]
        copied = [ln for ln in solution if ln in flat]
        if len(copied) >= SOLUTION_BLOCK:
            found.append(f"{rel}: {len(copied)} lines of a reference solution, e.g. {copied[0][:60]!r}")
    return found


def _files(folder: Path):
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder).as_posix()
        if p.name.endswith(".tar.gz"):
            with tarfile.open(p) as tf:
                for m in tf.getmembers():
                    if m.isfile():
                        yield f"{rel}!{m.name}", tf.extractfile(m).read()
        else:
            yield rel, p.read_bytes()


# ---------------------------------------------------------------------------------- build


def build(out: str | Path, *, root: Path = ROOT, course: Path | None = None,
          roster: str | Path | None = None) -> tuple[Path, Path]:
    """Build the release into `<out>/student/` and its archive; returns (folder, archive). LabkitError on a leak.

    `roster` (a CSV with a student_id column; needs the course secret): also write each student's own lab 3
    slow_train.py to `<out>/lab3_handouts/<id>/`, outside the release, for the instructor to hand out."""
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    out = check_writable(Path(out))
    secret = course_secret.load(graded=False)  # a malformed secret stops here, before any work
    if roster is not None:
        if secret.open_kit:
            raise LabkitError(f"--roster: per-student lab 3 variants need the course secret, and none is set: "
                              f"export {course_secret.ENV}=... (python -m autograder secret prints a new one) and "
                              "build again, or build without --roster (everyone then gets the open kit's "
                              "slow_train.py, which the release already holds); nothing was built")
        lab3_variants.roster_ids(roster)
    out.mkdir(parents=True, exist_ok=True)
    ver = version(root)
    top = f"labkit-student-{ver}"
    stage = Path(tempfile.mkdtemp(prefix=".student-", dir=out))
    try:
        assemble(stage, root=root, course=course)
        leaks = scan(stage, root)
        if leaks:
            raise LabkitError(f"the student release would leak {len(leaks)} thing(s), first: {leaks[0]}")
        folder, archive = out / "student", out / f"{top}.tar.gz"
        shutil.rmtree(folder, ignore_errors=True)
        stage.rename(folder)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            for p in sorted(folder.rglob("*")):
                tf.add(p, arcname=f"{top}/{p.relative_to(folder).as_posix()}", recursive=False)
        archive.write_bytes(buf.getvalue())
        if roster is not None:
            shutil.rmtree(out / "lab3_handouts", ignore_errors=True)
            handouts(out / "lab3_handouts", Path(roster))
        return folder, archive
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autograder.release", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "dist"), help="folder to build in (default: dist/)")
    ap.add_argument("--course", default=str(ROOT / "assignments"), help="the nbgrader course root")
    ap.add_argument("--roster", default=None, metavar="CSV", help="class list (column student_id): also write each "
                    "student's own lab 3 slow_train.py to OUT/lab3_handouts/<id>/ (needs the course secret)")
    a = ap.parse_args(argv)
    try:
        folder, archive = build(a.out, course=Path(a.course), roster=a.roster)
        from autograder.base import course_secret

        open_kit = course_secret.load(graded=False).open_kit
    except LabkitError as e:
        print(f"autograder.release: {e}", file=sys.stderr)
        return 2
    files = json.loads((folder / "MANIFEST.json").read_text())["files"]
    print(f"student release: {folder} ({len(files)} files) and {archive}")
    if a.roster:
        print(f"lab 3 handouts: {folder.parent / 'lab3_handouts'}/<student id>/slow_train.py (one per student: "
              "hand each out privately; the class grader grades lab 3 against it)")
    if open_kit:
        print(f"note: no course secret ({course_secret.ENV}): lab 3's slow_train.py is the open kit's, whose answers "
              "are public; set it before building for a graded course")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Starting nbgrader without jsonschema's IRI checker: about 1.3 s less in each nbgrader process the grader starts.

nbformat imports jsonschema, and jsonschema registers format checkers for the optional modules it finds. One of them,
`rfc3987_syntax` (pulled in by jupyter-events), compiles 38 grammars when it is imported: `python -m nbgrader
--version` takes 2.3-2.7 s with it and 1.0 s without, on a 2-core machine. The grader starts nbgrader for every
student and every course copy, so a class pays it hundreds of times. Nothing here checks the `iri` formats it adds
(no notebook, nbgrader or feedback schema uses them), and jsonschema skips a checker whose module is missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SKIPPED = "rfc3987_syntax"


def skip_iri_checker() -> None:
    """Make `import rfc3987_syntax` fail in this process (before nbformat is imported), unless it is already in."""
    sys.modules.setdefault(SKIPPED, None)


def nbgrader_command(*args: str) -> list[str]:
    """`python -m nbgrader ARGS`, started with `skip_iri_checker` in force."""
    code = (f"import sys; sys.modules.setdefault({SKIPPED!r}, None); "
            "from nbgrader.apps.nbgraderapp import main; main()")
    return [sys.executable, "-c", code, *args]


def py_env(extra: dict | None = None) -> dict[str, str]:
    """Environment for nbgrader and harness processes: this interpreter's tools first on PATH, repo importable."""
    from labkit.env import REPO_ROOT  # here, not at the top: labkit.env imports torch

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONSTARTUP", "PYTHONINSPECT", "JPY_"))}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    # GPU indices in PCI order, the order of the /dev/nvidiaN nodes the sandbox passes through one of
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(extra or {})
    return env

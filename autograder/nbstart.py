"""Starting nbgrader without jsonschema's IRI checker: about 1.3 s less in each nbgrader process the grader starts.

nbformat imports jsonschema, and jsonschema registers format checkers for the optional modules it finds. One of them,
`rfc3987_syntax` (pulled in by jupyter-events), compiles 38 grammars when it is imported: `python -m nbgrader
--version` takes 2.3-2.7 s with it and 1.0 s without, on a 2-core machine. The grader starts nbgrader for every
student and every course copy, so a class pays it hundreds of times. Nothing here checks the `iri` formats it adds
(no notebook, nbgrader or feedback schema uses them), and jsonschema skips a checker whose module is missing.
"""

from __future__ import annotations

import sys

SKIPPED = "rfc3987_syntax"


def skip_iri_checker() -> None:
    """Make `import rfc3987_syntax` fail in this process (before nbformat is imported), unless it is already in."""
    sys.modules.setdefault(SKIPPED, None)


def nbgrader_command(*args: str) -> list[str]:
    """`python -m nbgrader ARGS`, started with `skip_iri_checker` in force."""
    code = (f"import sys; sys.modules.setdefault({SKIPPED!r}, None); "
            "from nbgrader.apps.nbgraderapp import main; main()")
    return [sys.executable, "-c", code, *args]

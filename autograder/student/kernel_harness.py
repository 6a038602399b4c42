"""Stand-in for `autograder.harness` (and the toy's `autograder.rehearsal`) inside the grading sandbox.

While the class is graded, a test cell's call runs nothing: the grader runs every check itself, outside the
notebook, and the cell's score comes from there. The cell only says so, so the student's feedback explains it.
"""

from __future__ import annotations


class NotGradableHere(AssertionError):
    """Kept for notebooks that name it; never raised here."""


def grade(check: str, student_file: str, points: float) -> None:
    """Note that `check` is graded outside the notebook; returns None (the grader sets the score)."""
    print(f"[{check}] graded by the course's grader outside the notebook ({points:g} points): "
          "see the summary at the top of your feedback")
    return None


def run_check(name: str, student_file: str, timeout_s: float | None = None, device: str = "auto") -> dict:
    """Same note as `grade`, in the shape of a verdict; the cell's score is set outside the notebook."""
    msg = "graded by the course's grader outside the notebook: see the summary at the top of your feedback"
    return {"check": name, "ok": True, "passed": True, "message": msg}

"""The course secret: where every hidden probe value and every per-student variant comes from.

Hidden cases used to be constants in the trusted check modules, so anyone who read the grader's code (it is an
open kit) knew them. Now each is derived from a secret the instructor sets, `HMAC-SHA256(secret, label)`, with a
label naming what it is ("lab2.hidden/cases", "lab3.variant" plus the student id): reading a check's code tells
which values are drawn, never which values a course gets.

The instructor sets it in the environment, `LABKIT_COURSE_SECRET` (at least MIN_LENGTH characters; `python -m
autograder secret` prints a fresh one). An environment variable and not a file, because the same grader runs in
a shell, a Slurm job (`--export=ALL`), a Kubernetes Secret or a Gradescope image, and a variable is never
committed to a fork by accident. The sandbox never sees it (bubblewrap starts the student's processes with an
empty environment).

Without it, the kit runs on the *open-kit default*: a public key, labelled as such in every verdict, for
self-learners and the kit's own tests. Its hidden cases are public, and lab 3 hands everyone the repository's
own slow_train.py. A graded run refuses it: `python -m autograder grade` and `gradescope` stop before grading,
and a test cell under `nbgrader autograde` fails with the same message, unless the instructor says
`--open-kit` (or LABKIT_OPEN_KIT=1) on purpose. Grading a class on public hidden cases, or every student's lab 3
against the public variant, is a mistake worth stopping for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

ENV = "LABKIT_COURSE_SECRET"  # the instructor's secret
OPEN_KIT_ENV = "LABKIT_OPEN_KIT"  # "1": a graded run may use the public default (rehearsals, the kit's own tests)
MIN_LENGTH = 16  # characters: a short secret could be found by trying every one against a value seen when graded
OPEN_KIT_KEY = b"labkit open kit: a public key for self-study, never for a graded course"
OPEN_KIT_LABEL = "open-kit default (public)"
COURSE_LABEL = "course secret"


@dataclass(frozen=True)
class Secret:
    """The key hidden values are derived from, and what it is."""

    key: bytes  # HMAC key
    label: str  # COURSE_LABEL or OPEN_KIT_LABEL: verdicts say which one graded them

    @property
    def open_kit(self) -> bool:
        """True for the public default: its hidden cases and variants are known to everyone."""
        return self.key == OPEN_KIT_KEY


def _error(msg: str) -> Exception:
    from labkit.errors import LabkitError

    return LabkitError(msg)


def graded_run() -> bool:
    """True inside `nbgrader autograde` (a cell's grade counts there)."""
    return os.environ.get("NBGRADER_EXECUTION", "") == "autograde"


def open_kit_allowed() -> bool:
    """True when the instructor allowed the public default for graded runs (LABKIT_OPEN_KIT=1)."""
    return os.environ.get(OPEN_KIT_ENV, "") == "1"


MISSING = (f"no course secret: set {ENV} to your course's secret (`python -m autograder secret` makes one; "
           "assignments/README.md, 'Course secret'), or grade with the public open-kit default on purpose "
           f"(--open-kit, or {OPEN_KIT_ENV}=1: practice only, its hidden cases are public)")


def load(*, graded: bool | None = None) -> Secret:
    """The course secret from the environment, else the open-kit default.

    `graded` (default: inside `nbgrader autograde`): the run's grades count, so without a secret it raises
    LabkitError unless LABKIT_OPEN_KIT=1. A secret shorter than MIN_LENGTH always raises.
    """
    value = os.environ.get(ENV, "")
    if value:
        if len(value) < MIN_LENGTH:
            raise _error(f"{ENV} is {len(value)} characters long: use at least {MIN_LENGTH} "
                         "(`python -m autograder secret` makes one)")
        return Secret(value.encode(), COURSE_LABEL)
    if (graded_run() if graded is None else graded) and not open_kit_allowed():
        raise _error(MISSING)
    return Secret(OPEN_KIT_KEY, OPEN_KIT_LABEL)


def for_grading(open_kit: bool = False) -> Secret:
    """The secret a class grading run uses; LabkitError before any work when there is none and `open_kit` is off."""
    return load(graded=not open_kit)


def derive(label: str, student: str | None = None, secret: Secret | None = None, handin: str | None = None) -> bytes:
    """32 bytes only the secret's holder can compute: HMAC-SHA256(key, label [NUL student] [NUL handin])."""
    key = (secret or load()).key
    msg = label.encode() + (b"\0" + student.encode() if student is not None else b"")
    msg += b"\0handin:" + handin.encode() if handin is not None else b""
    return hmac.new(key, msg, hashlib.sha256).digest()


def seed(label: str, student: str | None = None, secret: Secret | None = None, bits: int = 31) -> int:
    """A seed in [0, 2**bits) derived from the secret (bits <= 256)."""
    return int.from_bytes(derive(label, student, secret), "big") >> (256 - bits)


def rng(label: str, student: str | None = None, secret: Secret | None = None, handin: str | None = None):
    """A numpy Generator seeded from the secret: draw a hidden case's values (shapes, lengths, rates) from it.

    `handin`, the digest of what the student handed in, draws a hidden check's cases for that hand-in alone: the
    same bytes regraded draw the same cases, and any change draws new ones. Whatever a hand-in manages to learn of
    its cases (by timing, memory or a crash it picks by them) is then no use to the next hand-in, nor to a
    classmate's: to answer them it would have to change, and changing draws others (autograder.checks.harness.Check).
    """
    import numpy as np

    return np.random.default_rng(int.from_bytes(derive(label, student, secret, handin), "big"))


def new_secret() -> str:
    """A fresh course secret (43 URL-safe characters, 256 bits)."""
    return secrets.token_urlsafe(32)

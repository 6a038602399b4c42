"""A student's result, and its done-marker: sealed under the output folder's key, and read back only when the key
verifies it (grading resumes from it, merges and the LMS exports read it)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("autograder")
_KEY_FILE = ".grader-key"  # in the output folder, which no student process ever sees


@dataclass
class StudentResult:
    """One student's grade and how it was reached (this is the done-marker's content)."""

    student_id: str
    assignment: str
    status: str  # "graded" or "not graded"
    score: float = 0.0  # points, after the trusted re-run of the harness checks
    max_score: float = 0.0  # points available
    cause: str | None = None  # why it is not graded, or what went wrong besides its answers
    message: str = ""  # one line for the instructor and the student
    cells: list[dict] = field(default_factory=list)  # notebook, cell, score, max_score, source
    checks: list[dict] = field(default_factory=list)  # trusted verdicts: check, passed, message, ratio, per-s numbers
    notes: list[str] = field(default_factory=list)  # worth knowing, not fatal (cell timeouts, renamed files, ...)
    flags: list[str] = field(default_factory=list)  # for the instructor to look at (kernel vs trusted disagreement)
    hardware: dict = field(default_factory=dict)  # class and card the student was graded on
    wall_s: float = 0.0  # seconds spent grading this student
    peak_rss_bytes: int = 0  # largest resident memory of the student's processes, bytes
    digest: str = ""  # hand-in digest; a change means regrade
    source_digest: str = ""  # assignment digest; a change means regrade
    outputs: dict = field(default_factory=dict)  # relative path -> sha256 of every file written for this student
    finished_at: str = ""  # UTC time the result was recorded
    sandbox: str = ""  # "bwrap" (the student's code ran in the sandbox) or "none" (trusted submissions)
    grader: str = ""  # digest of the grader's own code that produced this result; another one means regrade


def result_key(out: Path) -> bytes:
    """The output folder's secret for authenticating done-markers (made on first use, readable by the grader only)."""
    path = out / _KEY_FILE
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) == 32:
            return key
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return path.read_bytes()


def _mac(key: bytes, d: dict) -> str:
    body = json.dumps({k: v for k, v in d.items() if k != "mac"}, sort_keys=True, default=str).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sealed_result(res: StudentResult, key: bytes) -> bytes:
    """The done-marker's bytes: the result and its MAC under the output folder's key."""
    d = json.loads(json.dumps(asdict(res), default=str))
    d["mac"] = _mac(key, d)
    return (json.dumps(d, indent=2) + "\n").encode()


def load_result(path: Path, key: bytes | None = None, student_id: str | None = None) -> StudentResult | None:
    """A done-marker, or None if it is missing, unreadable, (with `key`) fails verification, or (with
    `student_id`) is another student's sealed marker moved into this folder: then the student is graded again."""
    try:
        d = json.loads(path.read_text())
        if key is not None and not (isinstance(d, dict) and hmac.compare_digest(str(d.get("mac", "")), _mac(key, d))):
            log.warning("%s failed verification (written by something other than this grader); regrading", path)
            return None
        if student_id is not None and d.get("student_id") != student_id:
            log.warning("%s is %r's done-marker, not %r's; regrading", path, d.get("student_id"), student_id)
            return None
        return StudentResult(**{k: v for k, v in d.items() if k in StudentResult.__dataclass_fields__})
    except (OSError, json.JSONDecodeError, TypeError):
        return None

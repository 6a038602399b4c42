"""Failures the machine caused are the grader's, never a student's result.

A hand-in that hits one of its own caps (memory, disk, processes, time) is stopped with that cause, and that is
its result. A failure of the grader's side is not: its work filesystem full (ENOSPC or a quota, while the
student's own disk watch saw nothing over its cap), the grader's process out of memory, or a bug in it. Such a
result is recorded with the cause GRADER_FAULT (or "grader error") and a message saying so, and a resumed run
grades that student again (`kept` is False for it), so a disk filled beside a classmate, or a grader restarted
after the OOM killer took it, never leaves the classmate with a zero.
"""

from __future__ import annotations

GRADER_FAULT = "grader fault"
RETRIED = (GRADER_FAULT, "grader error")  # causes a resume grades again: the grader's, not the student's
STUDENT_CAPS = ("memory", "disk", "processes", "timeout")  # the student's own caps: their result, kept
_DISK_FULL = ("No space left on device", "Errno 28]", "Disk quota exceeded", "Errno 122]", "ENOSPC", "EDQUOT")
_OUT_OF_MEMORY = ("MemoryError", "Cannot allocate memory", "Errno 12]")


def machine_cause(res) -> str | None:
    """Why `res` (a grade.StudentResult) failed through the machine, or None: a full disk or exhausted memory
    named in a failure of the grader's side ("nbgrader error", "grader error") that none of the student's caps
    explains."""
    if res.status == "graded" or res.cause in STUDENT_CAPS or res.cause not in ("nbgrader error", *RETRIED):
        return None
    text = res.message or ""
    if any(t in text for t in _DISK_FULL):
        return "the grader's disk was full"
    if any(t in text for t in _OUT_OF_MEMORY):
        return "the grader ran out of memory"
    return None


def classify(res):
    """`res` with a machine failure recorded as the grader's fault (cause GRADER_FAULT, no score), else as is."""
    why = machine_cause(res)
    if why is None:
        return res
    res.status, res.cause, res.score = "not graded", GRADER_FAULT, 0.0
    res.message = (f"{why} ({(res.message or '')[:160]}): the machine's failure, not this hand-in's; it is graded "
                   "again when the run is resumed (run the same command again)")
    return res


def kept(done) -> bool:
    """Whether a resumed run may keep this earlier result: not when the grader's side failed."""
    return done.cause not in RETRIED

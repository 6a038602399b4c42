"""GPU verdicts an instructor can defend: refuse a lab this machine cannot grade, list who was not graded on the
right hardware, and carry the bonus tier into the gradebook.

Some checks can only be graded on a GPU (lab 4's ResNet-18 speed tiers exist for GPU classes only): on a CPU
machine they say "not gradable" and score 0. Grading such a lab there by mistake would hand every student a 0
for those points, so the grader refuses it up front unless told to go ahead; then every student whose check
was not gradable is listed in the summary, to regrade on a GPU machine.
"""

from __future__ import annotations

import logging

from labkit.env import LabkitError

log = logging.getLogger("autograder")

# Check name -> the hardware classes (autograder.harness.hardware_class) that can grade it.
# lab4.speed: lab4_checks.SPEED_TIERS has tiers for these classes only (a test ties the two).
NEEDS_GPU: dict[str, tuple[str, ...]] = {"lab4.speed": ("tensor_core_gpu", "gpu")}


def ungradable_checks(checks: list[str], hardware: list[dict]) -> list[str]:
    """The checks among `checks` that none of the machine's devices (course.detect_hardware rows) can grade."""
    classes = {h.get("class") for h in hardware}
    return [c for c in dict.fromkeys(checks) if c in NEEDS_GPU and not classes & set(NEEDS_GPU[c])]


def refuse_ungradable(assignment: str, checks: list[str], hardware: list[dict], allow: bool) -> list[str]:
    """LabkitError if this machine cannot grade some of the assignment's checks, unless `allow`; returns them."""
    bad = ungradable_checks(checks, hardware)
    if not bad:
        return []
    here = "; ".join(f"{h.get('card')} ({h.get('class')})" for h in hardware)
    need = ", ".join(f"{c} needs {' or '.join(NEEDS_GPU[c])}" for c in bad)
    if not allow:
        raise LabkitError(f"{assignment} cannot be fully graded on this machine ({here}): {need}. Grade it on a "
                          "GPU machine, or pass --allow-ungradable to grade the rest here (those checks then score "
                          "0 and every such student is listed in the summary)")
    log.warning("grading %s without the hardware for %s (--allow-ungradable): those checks score 0", assignment, need)
    return bad


def not_gradable(res) -> list[str]:
    """Checks of a StudentResult that said "not gradable on this hardware" (no verdict, no failure cause)."""
    return [c["check"] for c in res.checks if c.get("passed") is None and c.get("cause") is None]


def extra_credit(res, cell_of: dict[str, tuple[str, str]]) -> list[dict]:
    """The bonus tier a student's passed checks measured (`extra_credit` in their measurements), as
    [{check, notebook, cell, points}]; `cell_of` maps a check to the (notebook, cell) whose test calls it."""
    out = []
    for c in res.checks:
        pts = (c.get("measurements") or {}).get("extra_credit")
        if c.get("passed") and isinstance(pts, (int, float)) and not isinstance(pts, bool) and pts > 0:
            nb, cell = cell_of.get(c["check"], (None, None))
            out.append({"check": c["check"], "notebook": nb, "cell": cell, "points": float(pts)})
    return out

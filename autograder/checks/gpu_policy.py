"""GPU verdicts an instructor can defend: refuse a lab this machine cannot grade, list who was not graded on the
right hardware, and carry the bonus tier into the gradebook.

Some checks can only be graded on a GPU (lab 4's ResNet-18 speed tiers exist for GPU classes only): on a CPU
machine they say "not gradable" and score 0. Grading such a lab there by mistake would hand every student a 0
for those points, so the grader refuses it up front unless told to go ahead; then every student whose check
was not gradable is listed in the summary, to regrade on a GPU machine.
"""

from __future__ import annotations

import logging

from autograder.checks.harness import Tiers
from labkit.env import LabkitError

log = logging.getLogger("autograder")

# Lab 4's speed tiers per hardware class. The check times the student's step against the naive fp32 step on the
# same card, so a tier is a ratio, and the ratio a good step reaches depends on the card's 16-bit units.
LAB4_SPEED_TIERS: dict[str, Tiers] = {
    # bf16 tensor cores, compute capability 8.0+ (A100, H100, L4, RTX 30xx and newer). Calibrated on an H100:
    # bf16 + channels_last + torch.compile + a fused optimizer reach ~2.2x, CUDA graphs on top ~3.8x (the reference
    # solution: grade_reference_gpu.json, grade_reliability*.json); 3x earns full marks, the bonus sits above it.
    "bf16_tensor_core_gpu": Tiers(((1.5, 0.5), (2.0, 2 / 3), (2.5, 5 / 6), (3.0, 1.0)), bonus=4.0),
    # The T4 class: fp16 tensor cores only, compute capability 7.x (T4, the free Colab GPU; V100; RTX 20xx). A
    # POLICY, not a calibration: no T4 has run the reference solution yet. Students there use fp16 autocast with
    # GradScaler (bf16 would be emulated, slower than fp32). A T4 step takes several times an H100's, so launch
    # overhead, which CUDA graphs remove (their ~1.7x of the H100's 3.8x), is a small share of it: the tiers ask
    # for what the rest of the recipe gives, 2x for full marks. Calibrate with benchmarks/grade_reference_gpu.py
    # on a T4 and replace these numbers with the measured ones.
    "fp16_tensor_core_gpu": Tiers(((1.3, 0.5), (1.5, 2 / 3), (1.75, 5 / 6), (2.0, 1.0)), bonus=2.6),
    # Other accelerators (CUDA before 7.0, or not CUDA): no 16-bit tensor cores; a policy too.
    "gpu": Tiers(((1.2, 0.5), (1.5, 1.0)), bonus=2.0),
}
LAB4_TIER_BASIS = {"bf16_tensor_core_gpu": "calibrated on an H100",
                   "fp16_tensor_core_gpu": "policy (T4 class, not yet calibrated on a T4)",
                   "gpu": "policy"}


def lab4_speed_class(device, hardware: str) -> str | None:
    """Lab 4's tier class of a device: by compute capability on CUDA (8.0+ native bf16; 7.x the T4 class), "gpu"
    for other accelerators, None where speed is not graded (`hardware`, harness.hardware_class, is "cpu")."""
    if hardware == "cpu":
        return None
    from labkit.env import NATIVE_BF16_CAPABILITY, gpu_facts

    facts = gpu_facts(device)
    if facts is None:
        return "gpu"
    if facts.capability >= NATIVE_BF16_CAPABILITY:
        return "bf16_tensor_core_gpu"
    return "fp16_tensor_core_gpu" if facts.capability[0] >= 7 else "gpu"


def lab4_speed_tiers(device, hardware: str) -> tuple[str, Tiers] | None:
    """(tier class, Tiers) for lab 4's speed check on this device, or None where it is not gradable."""
    klass = lab4_speed_class(device, hardware)
    return None if klass is None else (klass, LAB4_SPEED_TIERS[klass])

# Check name -> the hardware classes (autograder.checks.harness.hardware_class) that can grade it.
# lab4.speed: lab4_checks.SPEED_TIERS has tiers for these classes only (a test ties the two).
# lab5.speed: lab5_checks.SPEED_TIERS likewise (the fused kernel is memory-bound: one tier set for both classes).
NEEDS_GPU: dict[str, tuple[str, ...]] = {"lab4.speed": ("tensor_core_gpu", "gpu"), "lab5.speed": ("tensor_core_gpu", "gpu")}


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

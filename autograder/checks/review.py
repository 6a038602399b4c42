"""Speed verdicts an instructor should look at again before defending them, for the class summary.

Two kinds, neither a failure for the student (the points stand as measured until the instructor regrades):
  - "measure again": the GPU throttled (thermal or power) or its clocks moved during the timed rounds
    (autograder.sandbox.gpu_state, read by the trusted grading process only);
  - "near a boundary: regrade recommended": the measured ratio lies within the check's own measured spread
    (the interquartile range of its per-round ratios) of a tier boundary, so another run could land on the
    other side of it.
A speed verdict that was measured again before it was scored (autograder.checks.remeasure: its first ratio was near a
boundary) is listed too, as "re-measured before scoring" (nothing to do: it was scored on the pooled rounds), and
its "regrade recommended" line, if the pooled ratio is still near, says that it was already re-measured once.
A speed verdict whose rounds disagreed by more than the ratio while the baseline's held steady was scored as
measured (the spread is the hand-in's own, autograder.checks.remeasure.too_wide): listed as "scored despite its own
spread", for a look at what the code does between rounds (it may be sleeping on purpose).
Everything here reads the trusted verdict's measurements; nothing comes from the student's process.
"""

from __future__ import annotations

import re
import statistics

MEASURE_AGAIN = "measure again"
NEAR_BOUNDARY = "near a boundary: regrade recommended"
REMEASURED = "re-measured before scoring"
OWN_SPREAD = "scored despite its own spread"
_TIER = re.compile(r">=\s*([0-9]+(?:\.[0-9]+)?)x")  # harness.Tiers.describe(): ">=1.5x: 50%, ..., bonus >=4x"


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def boundaries(m: dict) -> list[float]:
    """The tier boundaries (x baseline) a check measured against: its `tiers` text and `required_ratio`."""
    found = [float(b) for b in _TIER.findall(str(m.get("tiers") or ""))]
    req = _num(m.get("required_ratio"))
    return sorted(set(found + ([req] if req is not None else [])))


def spread(m: dict) -> float | None:
    """The check's measured spread of the ratio: its IQR (speedup_iqr / ratio_iqr), else that of its `ratios`."""
    for key in ("speedup_iqr", "ratio_iqr"):
        if _num(m.get(key)) is not None:
            return abs(float(m[key]))
    ratios = [float(r) for r in m.get("ratios") or [] if _num(r) is not None]
    if len(ratios) >= 4:
        q = statistics.quantiles(ratios, n=4)
        return q[2] - q[0]
    return None


def near_boundary(m: dict) -> str | None:
    """Why a check's ratio is too close to a tier boundary to call (None when it is not, or is not a ratio)."""
    ratio = next((_num(m.get(k)) for k in ("speedup", "ratio") if _num(m.get(k)) is not None), None)
    iqr = spread(m)
    if ratio is None or iqr is None:
        return None
    close = [b for b in boundaries(m) if abs(ratio - b) <= iqr]
    if not close:
        return None
    b = min(close, key=lambda x: abs(ratio - x))
    return f"{ratio:.2f}x is within its measured spread (IQR {iqr:.2f}) of the {b:g}x boundary"


def flags(res) -> list[dict]:
    """[{check, kind, why}] for a StudentResult's checks: MEASURE_AGAIN and NEAR_BOUNDARY findings."""
    out = []
    for c in res.checks:
        m = c.get("measurements") or {}
        if m.get("gpu_measure_again"):
            out.append({"check": c["check"], "kind": MEASURE_AGAIN, "why": str(m["gpu_measure_again"])})
        why = near_boundary(m)
        if m.get("remeasured") is True:
            first, pooled = m.get("first_measurement") or {}, m.get("pooled") or {}
            out.append({"check": c["check"], "kind": REMEASURED,
                        "why": f"first {first.get('ratio')}x (IQR {first.get('iqr')}, {first.get('rounds')} rounds) "
                               f"was near a boundary; scored on the pooled {pooled.get('rounds')} rounds: "
                               f"{pooled.get('ratio')}x"})
            why = why and f"{why}, after one re-measurement (scored on the pooled rounds)"
        elif why and m.get("remeasure_skipped"):
            why = f"{why}; not re-measured: {m['remeasure_skipped']}"
        if why:
            out.append({"check": c["check"], "kind": NEAR_BOUNDARY, "why": why})
        own = m.get("own_spread")
        if isinstance(own, dict):
            out.append({"check": c["check"], "kind": OWN_SPREAD,
                        "why": f"{own.get('ratio')}x with an IQR of {own.get('iqr')} over {own.get('rounds')} rounds, "
                               + ("while its process slowed the baseline (work left queued)"
                                  if own.get("baseline_interference") else
                                  f"while the baseline held steady (IQR {own.get('baseline_iqr_share')} of its median)")})
    return out

"""Predict, then measure: a prediction printed beside the measurement, with how far apart they are.

The notebooks ask for a prediction (a number, True/False, a word or an ordering) in one cell and measure in the
next; `compare` prints both. An empty prediction (None) is not an error: the cell says to write one first and
the notebook carries on, so it still runs top to bottom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit.errors import LabkitError

CLOSE = 0.25  # a numeric prediction within 25% of the measurement counts as close


def _number(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        try:
            return float(x)
        except (TypeError, ValueError):
            raise LabkitError(f"{what}: the prediction should be a number, got {x!r}") from None
    return float(x)


def _numeric_verdict(p: float, m: float, close: float) -> str:
    if p == m:
        return "exactly right"
    if not (math.isfinite(p) and math.isfinite(m)):
        return "differs"
    if p > 0 and m > 0:
        factor = max(p / m, m / p)
        if factor <= 1 + close:
            off = abs(p / m - 1)
            return (f"close: within {100 * close:.0f}% (" + ("under 1%" if off < 0.005 else f"{100 * off:.0f}%")
                    + f" {'above' if p > m else 'below'} the measurement)")
        return f"off by a factor of {factor:.3g} (too {'high' if p > m else 'low'})"
    diff = abs(p - m) / abs(m) if m else abs(p)
    return (f"close: within {100 * close:.0f}%" if diff <= close else
            f"off by {diff:.3g}x the measurement's size (too {'high' if p > m else 'low'})")


def _same(p, m) -> bool:
    if isinstance(p, str) and isinstance(m, str):
        return p.strip().lower() == m.strip().lower()
    if isinstance(m, Sequence) and not isinstance(m, str):
        return isinstance(p, Sequence) and not isinstance(p, str) and len(p) == len(m) and \
            all(_same(a, b) for a, b in zip(p, m, strict=True))
    return p == m


def compare(prediction, measured, what: str, *, unit: str = "", close: float = CLOSE, show: bool = True) -> dict:
    """Print `what`: the prediction, the measurement and a verdict; returns {"what", "prediction", "measured",
    "verdict"}.

    Numbers: "close" within `close` (a fraction: 0.25 = 25%) of the measurement, else the factor it is off by.
    True/False, words (case and spaces ignored) and sequences (an ordering): "matches" or "differs".
    prediction None: verdict "no prediction" and a reminder to write one first; measured None: "not measured".
    A prediction of the wrong kind (a word where a number is measured) is a LabkitError.
    """
    if prediction is None:
        verdict = "no prediction"
    elif measured is None:
        verdict = "not measured"
    elif isinstance(measured, int | float) and not isinstance(measured, bool):
        verdict = _numeric_verdict(_number(prediction, what), float(measured), close)
    elif isinstance(measured, bool) and not isinstance(prediction, bool):
        raise LabkitError(f"{what}: the prediction should be True or False, got {prediction!r}")
    else:
        verdict = "matches" if _same(prediction, measured) else "differs"
    if show:
        u = f" {unit}" if unit else ""
        fmt = lambda v: f"{v:.4g}{u}" if isinstance(v, float) else f"{v}{u}"  # noqa: E731
        if prediction is None:
            print(f"{what}: write a prediction first (in the cell above), then re-run this cell. "
                  f"Measured: {fmt(measured) if measured is not None else 'nothing yet'}")
        else:
            print(f"{what}\n  your prediction: {fmt(prediction)}\n  measured:        "
                  f"{fmt(measured) if measured is not None else 'nothing to compare with here'}\n  -> {verdict}")
    return {"what": what, "prediction": prediction, "measured": measured, "verdict": verdict}

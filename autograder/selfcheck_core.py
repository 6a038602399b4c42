"""What the student release's public checks share: their two outcomes besides a pass, and alternating timing.

`autograder.selfcheck` runs the checks and `autograder.selfcheck_labs` holds them; both import these from here,
so neither imports the other at its top (selfcheck loads selfcheck_labs only when a check runs).
"""

from __future__ import annotations

import statistics
import time


class Failed(Exception):
    """A public check failed: the message says what to fix."""


class NotHere(Exception):
    """This machine cannot run the check (lab 4's speed needs a CUDA GPU)."""


def need(cond: bool, message: str) -> None:
    """Fail the running check with `message` unless `cond` holds."""
    if not cond:
        raise Failed(message)


def alternate(base, mine, *, rounds: int, warmup: int = 1) -> dict:
    """Time `base()` and `mine()` alternately after warm-up: median seconds of each and the median ratio
    (baseline seconds over yours: above 1, yours is faster)."""
    tb, tm = [], []
    for r in range(warmup + rounds):
        for fn, out in ((base, tb), (mine, tm)) if r % 2 == 0 else ((mine, tm), (base, tb)):
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                out.append(time.perf_counter() - t0)
    return {"baseline_s": statistics.median(tb), "yours_s": statistics.median(tm),
            "ratio": statistics.median(a / b for a, b in zip(tb, tm, strict=True))}

"""Probes of the toy assignment (autograder.rehearsal): the student's `total(xs)` and the slow baseline loop."""

from __future__ import annotations

import numpy as np

from autograder.student.probes import call, require


def baseline(xs) -> int:
    """The slow reference: a Python loop over the elements."""
    s = 0
    for x in xs.tolist():
        s += x * x
    return s


def arrays(seed: int, count: int, n: int) -> list:
    """`count` int64 arrays of `n` elements in [-1000, 1000) from `seed` (the same on both sides).

    Made with one multiply-add per element rather than a random generator, so that making the inputs inside a
    timed request costs far less than the work being timed.
    """
    rng = np.random.default_rng(seed)
    idx = np.arange(n, dtype=np.int64)
    return [(idx * int(a) + int(b)) % 2000 - 1000 for a, b in rng.integers(1, 1 << 20, size=(count, 2))]


def _totals(fn, xs_list) -> list[int]:
    out = []
    for xs in xs_list:
        v = call("total(xs)", fn, xs)
        require(isinstance(v, (int, np.integer)) or (hasattr(v, "item") and not isinstance(v, float)),
                f"total(xs) must return an integer, got {type(v).__name__}")
        out.append(int(v))
    return out


def probe_totals(p, params: dict) -> dict:
    """total() of given arrays (sent as int64 tensors) and of `count` arrays drawn from `seed`."""
    xs = [t.numpy() for t in params.get("arrays", [])]
    if "seed" in params:
        xs += arrays(int(params["seed"]), int(params["count"]), int(params["n"]))
    return {"totals": _totals(p.attr("total"), xs)}


def probe_baseline(p, params: dict) -> dict:
    xs = arrays(int(params["seed"]), int(params["count"]), int(params["n"]))
    return {"totals": [baseline(x) for x in xs]}

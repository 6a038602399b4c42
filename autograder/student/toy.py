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


def pool(seed: int, n: int) -> np.ndarray:
    """A pool of `n` int64 values in [-1000, 1000) from `seed`; timed requests read windows of it."""
    return np.random.default_rng(seed).integers(-1000, 1000, size=n)


def windows(params: dict, the_pool: np.ndarray) -> list:
    """The arrays a timed request stands for: windows of the pool at the request's fresh offsets.

    Making the pool is not timed (it happens on a warm-up request) and reading a window costs nothing, so the
    timing is the work itself; the offsets are new in every request, so remembering answers does not help.
    """
    n = int(params["n"])
    return [the_pool[int(o):int(o) + n] for o in params["offsets"]]


def _pool(p, params: dict) -> np.ndarray:
    key = ("pool", int(params["pool_seed"]), int(params["pool_n"]))
    if key not in p.state:
        p.state.clear()
        p.state[key] = pool(key[1], key[2])
    return p.state[key]


def _totals(fn, xs_list) -> list[int]:
    out = []
    for xs in xs_list:
        v = call("total(xs)", fn, xs)
        require(isinstance(v, (int, np.integer)) or (hasattr(v, "item") and not isinstance(v, float)),
                f"total(xs) must return an integer, got {type(v).__name__}")
        out.append(int(v))
    return out


def probe_totals(p, params: dict) -> dict:
    """total() of given arrays (lists of ints), of `count` arrays from `seed`, and of pool windows at `offsets`."""
    xs = [np.asarray(a, dtype=np.int64) for a in params.get("arrays", [])]
    if "seed" in params:
        xs += arrays(int(params["seed"]), int(params["count"]), int(params["n"]))
    if "offsets" in params:
        xs += windows(params, _pool(p, params))
    return {"totals": _totals(p.attr("total"), xs)}


def probe_baseline(p, params: dict) -> dict:
    return {"totals": [baseline(x) for x in windows(params, _pool(p, params))]}

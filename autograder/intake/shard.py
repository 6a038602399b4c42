"""Which slice of a class one grading job takes: `grade --shard K/N` (K counts from 0, as Slurm array task ids
and Kubernetes completion indexes do).

A student belongs to slice `sha256(student id) mod N`: it depends on nothing but the id and N, so adding or
removing students never moves anyone else, and every job of an array computes the same partition without
talking to the others. `python -m autograder merge` combines the slices' output folders (autograder.merge).
"""

from __future__ import annotations

import hashlib
import re

from labkit.env import LabkitError

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse(spec: str) -> tuple[int, int]:
    """(K, N) from "K/N"; LabkitError unless 0 <= K < N."""
    m = _SPEC.match(str(spec))
    if not m:
        raise LabkitError(f"--shard {spec!r}: expected K/N, e.g. 0/4 (slice K of N, K from 0 to N-1)")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= k < n:
        raise LabkitError(f"--shard {spec!r}: K must be 0..N-1 and N at least 1 (Slurm: --array=0-{max(n, 1) - 1})")
    return k, n


def slice_of(student_id: str, n: int) -> int:
    """The slice (0..n-1) a student id falls in; stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha256(student_id.encode("utf-8")).digest()[:8], "big") % n


def select(submissions: list, spec: str) -> list:
    """The hand-ins (objects with .student_id) that belong to slice `spec` ("K/N"), in their given order."""
    k, n = parse(spec)
    return [s for s in submissions if slice_of(s.student_id, n) == k]

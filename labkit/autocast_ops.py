"""The dtype each op produces under autocast, measured live, and which of autocast's op lists that puts it in.

Autocast keeps three lists per device type: ops that run in the lower precision (matmul-like: their inputs are
cast down to fp16/bf16), ops that run in fp32 (numerically touchy: their inputs are cast up), and ops that
promote mixed inputs to the widest one. Everything else is not listed and runs in whatever dtype it is given.
`op_dtypes` runs a fixed set of ops under `torch.autocast` twice (fp32 inputs, then 16-bit inputs, plus mixed
inputs for two-input ops) and infers the list from what comes out; the lists differ between CPU and CUDA, so
read the table on the device you train on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.env import LabkitError, pick_device

LOWER = "lower precision (inputs cast down)"
FP32 = "fp32 (inputs cast up)"
PROMOTE = "promote (widest input wins)"
UNLISTED = "not listed (keeps its input's dtype)"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ops() -> dict[str, tuple[str, Callable, bool]]:
    """name -> (group, fn(a, b, x4, w4, target), whether it takes two float inputs that can differ in dtype)."""
    return {
        "matmul": ("matmul/conv/linear", lambda a, b, x, w, t: a @ b, True),
        "linear": ("matmul/conv/linear", lambda a, b, x, w, t: F.linear(a, b), True),
        "conv2d": ("matmul/conv/linear", lambda a, b, x, w, t: F.conv2d(x, w, padding=1), True),
        "softmax": ("softmax", lambda a, b, x, w, t: torch.softmax(a, -1), False),
        "log_softmax": ("softmax", lambda a, b, x, w, t: torch.log_softmax(a, -1), False),
        "layer_norm": ("norm", lambda a, b, x, w, t: F.layer_norm(a, a.shape[-1:]), False),
        "batch_norm": ("norm", lambda a, b, x, w, t: F.batch_norm(x, None, None, training=True), False),
        "cross_entropy": ("loss", lambda a, b, x, w, t: F.cross_entropy(a, t), False),
        "mse_loss": ("loss", lambda a, b, x, w, t: F.mse_loss(a, b), True),
        "sum": ("reduction", lambda a, b, x, w, t: a.sum(), False),
        "mean": ("reduction", lambda a, b, x, w, t: a.mean(), False),
        "cumsum": ("reduction", lambda a, b, x, w, t: torch.cumsum(a, -1), False),
        # on the CPU's fp32 list as on CUDA's, unlike sum and cumsum: a product of many terms overflows 16 bits
        "prod": ("reduction", lambda a, b, x, w, t: torch.prod(a, -1), False),
        "exp": ("pointwise", lambda a, b, x, w, t: torch.exp(a), False),
        "relu": ("pointwise", lambda a, b, x, w, t: torch.relu(a), False),
        "add": ("pointwise", lambda a, b, x, w, t: a + b, True),
        "cat": ("pointwise", lambda a, b, x, w, t: torch.cat([a, b]), True),
    }


OPS = tuple(_ops())  # the op names op_dtypes knows, in table order


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(fn: Callable, dtypes: tuple[torch.dtype, torch.dtype], device, low: torch.dtype) -> torch.dtype:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(device, d) for d in dtypes)
    x, w = (torch.randn(s, generator=g).to(device, d) for s, d in (((2, 4, 6, 6), dtypes[0]), ((4, 4, 3, 3), dtypes[1])))
    t = torch.randint(0, 16, (16,), generator=g).to(device)
    with torch.autocast(torch.device(device).type, dtype=low):
        return fn(a, b, x, w, t).dtype


def op_dtypes(device=None, precision: str = "bf16", ops=OPS) -> list[dict]:
    """One row per op: its output dtype under `precision` autocast on `device` for fp32 inputs, for 16-bit inputs
    and (two-input ops) for one 16-bit and one fp32 input, and the autocast list that behaviour implies.

    Rows: {"op", "group", "from_fp32", "from_16bit", "mixed" (None for one-input ops), "list"}. An unknown op or
    precision, or fp16 on a CPU (CPU autocast takes bf16 only in this course), is a LabkitError before any op runs.
    """
    if precision not in _DTYPES:
        raise LabkitError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
    table = _ops()
    bad = [o for o in ops if o not in table]
    if bad:
        raise LabkitError(f"unknown op(s) {bad}; known: {', '.join(OPS)}")
    dev = pick_device(device or "cpu")
    if dev.type == "cpu" and precision == "fp16":
        raise LabkitError("fp16 autocast is a GPU recipe; on a CPU use precision='bf16'")
    low, f32 = _DTYPES[precision], torch.float32
    rows = []
    for name in ops:
        group, fn, two = table[name]
        out32, out16 = _run(fn, (f32, f32), dev, low), _run(fn, (low, low), dev, low)
        mixed = _run(fn, (low, f32), dev, low) if two else None
        if out32 == low:
            kind = LOWER
        elif out16 == f32:
            kind = FP32
        elif mixed == f32:
            kind = PROMOTE
        else:
            kind = UNLISTED
        rows.append({"op": name, "group": group, "from_fp32": _name(out32), "from_16bit": _name(out16),
                     "mixed": None if mixed is None else _name(mixed), "list": kind})
    return rows


def dtype_table(rows: list[dict]) -> str:
    """The rows of `op_dtypes` as a fixed-width text table."""
    head = f"{'op':<14} {'group':<19} {'fp32 in':<9} {'16-bit in':<9} {'mixed in':<9} autocast list"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:<14} {r['group']:<19} {r['from_fp32']:<9} {r['from_16bit']:<9} "
                     f"{r['mixed'] or '-':<9} {r['list']}")
    return "\n".join(lines)

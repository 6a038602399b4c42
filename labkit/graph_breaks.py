"""Graph breaks of torch.compile: where dynamo stops capturing a graph, and why.

A graph break splits the compiled function into several graphs with Python in between: each piece is
optimized alone, and the code between them runs eagerly (often with a host sync: `.item()`, `print(tensor)`,
`if tensor:`). `explain(fn, *args)` runs `torch._dynamo.explain` (no compilation, so it is quick on a CPU) and
returns the count of graphs and breaks with each reason and line; `logging_breaks()` turns on the log that
TORCH_LOGS="graph_breaks" turns on, for code you compile as usual.
"""

from __future__ import annotations

import contextlib


def explain(fn, *args, **kwargs) -> dict:
    """{"graphs", "breaks", "reasons": [{"reason", "where"}], "ops"} for `fn(*args, **kwargs)` under dynamo.

    "reason" is the first line of dynamo's explanation, "where" the file:line of your code that broke the
    graph. Dynamo's caches are reset before and after, so earlier compilations do not hide a break.
    """
    import torch

    from labkit.errors import LabkitError

    if not callable(fn):
        raise LabkitError(f"explain needs a function to trace, got {type(fn).__name__}")
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(fn)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    reasons = []
    for r in ex.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        reasons.append({"reason": str(r.reason).strip().splitlines()[0],
                        "where": f"{frame.filename}:{frame.lineno}" if frame else "?"})
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons, "ops": ex.op_count}


@contextlib.contextmanager
def logging_breaks():
    """Log each graph break as it happens (what `TORCH_LOGS="graph_breaks" python train.py` does), inside the
    block only: torch's logging settings are reset on exit."""
    import torch

    torch._logging.set_logs(graph_breaks=True)
    try:
        yield
    finally:
        torch._logging.set_logs()

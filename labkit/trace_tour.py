"""A guided reading of a torch.profiler trace: the facts you look for in Perfetto, computed from the trace JSON.

Open the trace at https://ui.perfetto.dev and `TOUR` says where to look, step by step; `tour(trace)` finds the
same facts in the file, so a CPU run (or a test) shows them too: the threads and which one runs the steps, the
ProfilerStep ranges, the DataLoader's own annotation and labkit's `data` label (waiting for the next batch),
the GPU's kernel rows (streams) and its idle gaps, and the host operators that take the most time.
Nothing here decides a bottleneck: that is `labkit.diagnosis.diagnose`, which you run after reading.
"""

from __future__ import annotations

import os
from collections import defaultdict

from labkit.diagnosis import DATALOADER_PREFIX, GPU_CATS, _gaps, _length, _union, load_trace
from labkit.errors import LabkitError

# What to look at in Perfetto, in order (the printed tour numbers its facts the same way).
TOUR = (
    "1. Threads: each process is a group of rows, each thread a row. Find the thread whose row holds "
    "ProfilerStep#N ranges: the training loop's host thread. Others: autograd's backward thread, DataLoader "
    "pin-memory threads.",
    "2. Steps: click a ProfilerStep range; its duration (ms) is one step's wall time. Press M to mark it.",
    "3. Data: inside each step, look for enumerate(DataLoader)#..._next__ (torch's own annotation) or labkit's "
    "`data` range: how long the loop waited for its next batch.",
    "4. Kernel rows (GPU only): below the host rows, a row per CUDA stream holds the kernels. Flows (arrows) link "
    "each cudaLaunchKernel on the host to its kernel.",
    "5. Gaps (GPU only): white space in the kernel row while a step runs is the GPU idling. Select the gap and "
    "look straight up: what was the host doing then (a data wait, a cudaStreamSynchronize, Python)?",
    "6. Operators: on the host thread, the widest aten:: ranges are where the host time goes; `Slice` in "
    "Perfetto's bottom panel sums them for a selected area.",
)


def _thread_names(events: list) -> dict:
    out = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            out[(e.get("pid"), e.get("tid"))] = (e.get("args") or {}).get("name")
    return out


def tour(source: dict | str | os.PathLike, top: int = 5) -> dict:
    """The facts of `TOUR`, from a trace (dict or file): times in ms, shares of the step time (0..1).

    Keys: threads (rows with their event counts, the stepping one marked), steps (count, mean_ms), data
    (annotation, count, ms per step, share), kernel_rows (per stream: kernels and busy ms per step; empty on a
    CPU),
    gpu_gaps (count, ms per step, largest_ms, share; None on a CPU), top_ops (name, ms per step).
    """
    trace = load_trace(source) if not isinstance(source, dict) else source
    if not isinstance(trace.get("traceEvents"), list):
        raise LabkitError("not a torch.profiler Chrome trace (no 'traceEvents' list)")
    X = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
         and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]
    steps = sorted((e for e in X if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        raise LabkitError("the trace has no ProfilerStep ranges: record it with a torch.profiler schedule and "
                          "call prof.step() once per training step (labkit.profiling.profile_steps does)")
    main = (steps[0].get("pid"), steps[0].get("tid"))
    steps = [s for s in steps if (s.get("pid"), s.get("tid")) == main]
    lo, hi = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    n, step_us = len(steps), sum(s["dur"] for s in steps)
    names, counts = _thread_names(trace["traceEvents"]), defaultdict(int)
    for e in X:
        counts[(e.get("pid"), e.get("tid"))] += 1
    threads = [{"pid": p, "tid": t, "name": names.get((p, t)), "events": c, "steps_here": (p, t) == main}
               for (p, t), c in sorted(counts.items(), key=lambda kv: -kv[1])]
    on_main = [e for e in X if (e.get("pid"), e.get("tid")) == main and lo <= e["ts"] < hi]
    waits = [e for e in on_main if str(e.get("name", "")).startswith(DATALOADER_PREFIX)]
    label = "DataLoader annotation" if waits else "labkit `data` label"
    waits = waits or [e for e in on_main if e.get("name") == "data"]
    label = label if waits else "no data annotation"
    data_us = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in waits]))
    gpu = [e for e in X if e.get("cat") in GPU_CATS and e["ts"] + e["dur"] > lo and e["ts"] < hi]
    if gpu:  # the GPU runs behind the host: the steps' kernels may finish after the last step's host range
        hi = max(hi, max(e["ts"] + e["dur"] for e in gpu))
    rows = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e.get("cat") == "kernel":
            rows[e.get("tid")][0] += 1
            rows[e.get("tid")][1] += e["dur"]
    gaps = None
    if gpu:
        g = _gaps(_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu]), lo, hi)
        gaps = {"count": len(g), "ms_per_step": _length(g) / n / 1e3,
                "largest_ms": max((b - a for a, b in g), default=0.0) / 1e3, "share": _length(g) / (hi - lo)}
    ops = defaultdict(float)
    for e in on_main:  # operators called from Python directly: the outermost aten:: ranges
        if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::"):
            ops[e["name"]] += e["dur"]
    nested = _outermost(on_main)
    top_ops = sorted(((k, v) for k, v in ops.items() if k in nested), key=lambda kv: -kv[1])[:top]
    return {"threads": threads, "steps": {"count": n, "mean_ms": step_us / n / 1e3},
            "data": {"annotation": label, "count": len(waits), "ms_per_step": data_us / n / 1e3,
                     "share": data_us / step_us},
            "kernel_rows": [{"stream": s, "kernels_per_step": c / n, "busy_ms_per_step": us / n / 1e3}
                            for s, (c, us) in sorted(rows.items())],
            "gpu_gaps": gaps, "top_ops": [{"name": k, "ms_per_step": v / n / 1e3} for k, v in top_ops]}


def _outermost(events: list[dict]) -> set[str]:
    """Names of aten:: operators that run at least once outside any other aten:: operator (called from Python)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::")),
                 key=lambda e: (e["ts"], -e["dur"]))
    out, end = set(), -1.0
    for e in ops:
        if e["ts"] >= end:
            out.add(e["name"])
            end = e["ts"] + e["dur"]
    return out


def print_tour(facts: dict) -> None:
    """Print `tour`'s facts numbered as `TOUR`'s steps."""
    main = next(t for t in facts["threads"] if t["steps_here"])
    print(f"1. {len(facts['threads'])} rows with events; the steps run on pid {main['pid']} tid {main['tid']}"
          + (f" ({main['name']})" if main["name"] else ""))
    s = facts["steps"]
    print(f"2. {s['count']} ProfilerStep ranges, {s['mean_ms']:.1f} ms each on average")
    d = facts["data"]
    print(f"3. {d['annotation']}: {d['count']} ranges, {d['ms_per_step']:.1f} ms per step "
          f"({100 * d['share']:.0f}% of the step)")
    if facts["kernel_rows"]:
        for r in facts["kernel_rows"]:
            print(f"4. stream {r['stream']}: {r['kernels_per_step']:.0f} kernels per step, "
                  f"{r['busy_ms_per_step']:.1f} ms busy per step")
        g = facts["gpu_gaps"]
        print(f"5. GPU idle: {g['count']} gaps, {g['ms_per_step']:.1f} ms per step ({100 * g['share']:.0f}%), "
              f"the largest {g['largest_ms']:.1f} ms")
    else:
        print("4-5. no kernel rows: a CPU trace (on a GPU, the kernels and their gaps show here)")
    print("6. host operators called from Python, by time per step: "
          + ", ".join(f"{o['name']} {o['ms_per_step']:.2f} ms" for o in facts["top_ops"]))

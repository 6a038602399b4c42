"""Where a labkit command's wall time goes, by Python stack samples: imports, compiling, loading caches, exit.

    python benchmarks/stack_samples.py [--name stack_samples] [--out benchmarks/results] -- train --preset muon
    python benchmarks/stack_samples.py --name samples_eager -- train --preset batch_fused --no-compile-cache

Runs `python -m labkit ARGS` in a new process whose main thread a second thread samples every 10 ms, from the
start of the command to the last atexit handler, so the exit (a compile-worker pool shutting down, say) is seen
too. A stage record says how long a stage took (`labkit train --json` stages_s); the samples say what ran in it:
each interval between two samples goes to the stack of the first. The record keeps the command, its wall time
(seconds, the process's start to its exit), when the command returned and the atexit handlers finished, and
seconds per labkit function (the innermost labkit frame) and per innermost frames outside labkit (where the
time went in torch or Python: importlib, a subprocess wait, a CUDA synchronize). Python frames only: a stretch
inside one C call (a convolution, an import's native part) is charged to the frame that called it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INTERVAL_S = 0.01  # between samples: fine enough for stages of a second, cheap enough not to slow them
TOP = 20           # rows kept per breakdown


def child(samples_path: str, args: list[str]) -> int:
    """Run the labkit CLI here while a thread samples the main thread's stack; write the samples at the end."""
    t0 = time.perf_counter()
    samples, marks, stop = [], {}, threading.Event()
    main_id = threading.main_thread().ident
    root = str(Path(__file__).resolve().parents[1]) + os.sep

    def where(path: str) -> str:  # labkit/train.py, torch/_inductor/compile_fx.py, <frozen importlib._bootstrap>
        if "site-packages" + os.sep in path:  # before the repository: a .venv may live inside it
            return path.split("site-packages" + os.sep, 1)[1]
        return path[len(root):] if path.startswith(root) else os.path.basename(path)

    def sample():
        while not stop.is_set():
            frame, stack = sys._current_frames().get(main_id), []
            while frame is not None and len(stack) < 300:  # deep import chains: keep the outer labkit frame
                stack.append(f"{where(frame.f_code.co_filename)}:{frame.f_code.co_name}")
                frame = frame.f_back
            samples.append((time.perf_counter() - t0, stack))  # innermost frame first
            time.sleep(INTERVAL_S)

    def dump():
        marks["atexit_done_s"] = time.perf_counter() - t0
        stop.set()
        Path(samples_path).write_text(json.dumps({"marks": marks, "samples": samples}))

    atexit.register(dump)  # registered first, so it runs after every handler torch registers later
    threading.Thread(target=sample, daemon=True).start()
    from labkit.cli import main as labkit_main

    rc = labkit_main(args)
    marks["command_returned_s"] = time.perf_counter() - t0
    return rc


def summarize(samples: list, marks: dict, top: int = TOP) -> dict:
    """Seconds per innermost labkit frame and per innermost three frames outside labkit, longest first."""
    by_labkit, by_inner = Counter(), Counter()
    ends = [t for t, _ in samples[1:]] + [marks.get("atexit_done_s", samples[-1][0] if samples else 0.0)]
    for (t, stack), end in zip(samples, ends, strict=True):
        dt = max(0.0, end - t)
        mine = next((f for f in stack if f.startswith("labkit/")), None)
        by_labkit[mine or ("after the command" if t >= marks.get("command_returned_s", float("inf"))
                           else "outside labkit")] += dt
        inner = [f for f in stack if "importlib" not in f][:3]
        importing = any("importlib" in f for f in stack)
        by_inner[("import: " if importing else "") + " < ".join(inner)] += dt
    rows = lambda c: {k: round(v, 3) for k, v in c.most_common(top)}  # noqa: E731
    return {"sampled_s": round(sum(by_labkit.values()), 3), "by_labkit_frame_s": rows(by_labkit),
            "by_inner_frames_s": rows(by_inner)}


def measure(args: list[str], timeout_s: float) -> dict:
    """Run the command in a sampled child process; its wall time, marks and the breakdowns."""
    with tempfile.TemporaryDirectory(prefix="labkit-samples-") as d:
        path = Path(d) / "samples.json"
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--child", str(path), "--", *args], capture_output=True,
                           text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        if not path.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"stack_samples: the command left no samples (exit {r.returncode}): {tail[0]}")
        got = json.loads(path.read_text())
    return {"command": ["labkit", *args], "exit_code": r.returncode, "wall_s": round(wall, 3),
            **{k: round(v, 3) for k, v in got["marks"].items()}, **summarize(got["samples"], got["marks"]),
            "said": (r.stdout + r.stderr).strip().splitlines()[-5:]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    mine, sep, args = (argv[:argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else (argv, "", [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="stack_samples", help="result name (default stack_samples)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/diagnosis)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds the command may take (default 600)")
    a = ap.parse_args(mine)
    if not sep or not args:
        ap.error("name the labkit command after --, e.g. -- train --preset muon")
    from labkit.bench import RESULTS_DIR, save_result
    from labkit.env import LabkitError
    from labkit.outputs import check_writable

    try:
        out = check_writable(a.out or RESULTS_DIR / "diagnosis", "dir", "--out")  # before minutes of work, not after
    except LabkitError as e:
        ap.error(str(e))
    rec = measure(args, a.timeout)
    path = save_result(a.name, {"kind": "stack_samples", **rec}, out_dir=out)
    print(f"{' '.join(rec['command'])}: exit {rec['exit_code']}, {rec['wall_s']:.1f} s wall, command returned at "
          f"{rec['command_returned_s']:.1f} s, atexit done at {rec['atexit_done_s']:.1f} s")
    for label, secs in list(rec["by_labkit_frame_s"].items())[:8]:
        print(f"  {secs:7.2f} s  {label}")
    print(f"wrote {path}")
    return 0 if rec["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

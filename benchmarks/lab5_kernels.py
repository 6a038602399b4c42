"""Lab 5's reference kernels alone: fused label-smoothed cross-entropy against the eager composition, one process.

    python benchmarks/lab5_kernels.py --out /tmp/l5       # a CUDA GPU: seconds

The graded speed check (autograder.checks.lab5_checks) times each side in its own process, with fresh inputs drawn inside
every timed pass (autograder.student.lab5.round_draws), so its ratio includes a cost both sides pay. This script
times the two sides without that cost: the reference solution (taken from the instructor's source notebook) and
`eager_cross_entropy`, forward + backward on pre-drawn bf16 logits (rows, 1000), interleaved rounds with CUDA
events (labkit.bench.compare), and, beside them, one pass's input draws alone. Saves <out>/lab5_kernels_<card>.json.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labkit.errors import LabkitError  # noqa: E402
from labkit.outputs import check_writable  # noqa: E402

ROWS = (16384, 65536, 131072)  # the graded shape is lab5_checks.SPEED_SHAPE; the smaller ones show the fixed cost
COLS = 1000


def _reference():
    """The reference solution's fused_cross_entropy, written out of the source notebook's solution regions."""
    from autograder.checks import harness

    aid = harness.ASSIGNMENTS["lab5"]
    d = tempfile.mkdtemp(prefix="lab5-ref-")
    atexit.register(shutil.rmtree, d, True)  # kept until exit: Triton reads a kernel's source file when it compiles
    path = harness.student_file_from_notebook(ROOT / "assignments" / "source" / aid / f"{aid}.ipynb", d)
    spec = importlib.util.spec_from_file_location("lab5_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_cross_entropy


def measure(rows: int, fused, device, rounds: int) -> dict:
    """ms per forward + backward pass of each side on one pre-drawn input, and of one pass's draws alone."""
    import torch

    from autograder.student import lab5
    from labkit import bench

    (x, y, _, _), = lab5.round_draws(1, rows, COLS, device, seed=0)
    x.requires_grad_()

    def run(fn):
        return lambda: torch.autograd.grad(fn(x, y, lab5.SMOOTHING), x)

    ab = bench.compare(run(lab5.eager_cross_entropy), run(fused), device=device, rounds=rounds, warmup=3, inner=5)
    draws = bench.time_fn(lambda: lab5.round_draws(1, rows, COLS, device, seed=1), device=device, repeats=rounds)
    return {"eager_ms": 1e3 * ab.a.median, "fused_ms": 1e3 * ab.b.median, "ratio": ab.ratio,
            "ratio_iqr": ab.ratio_iqr, "rounds": len(ab.ratios), "draws_ms": 1e3 * draws.median}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON record")
    ap.add_argument("--rounds", type=int, default=21, help="interleaved rounds per size")
    args = ap.parse_args(argv)
    try:
        check_writable(args.out, kind="dir")
        import torch

        if not torch.cuda.is_available():
            raise LabkitError("lab5_kernels.py times CUDA kernels: run it on a CUDA GPU")
        from labkit import bench

        device, fused = torch.device("cuda"), _reference()
        rows = {}
        for n in ROWS:
            rows[str(n)] = measure(n, fused, device, args.rounds)
            r = rows[str(n)]
            print(f"rows {n}: eager {r['eager_ms']:.3f} ms, fused {r['fused_ms']:.3f} ms, {r['ratio']:.2f}x "
                  f"(IQR {r['ratio_iqr']:.2f}); one pass's draws {r['draws_ms']:.3f} ms", flush=True)
        card = torch.cuda.get_device_name(device).split()[-1].lower()
        path = bench.save_result(f"lab5_kernels_{card}", {
            "cols": COLS, "dtype": "bfloat16", "rows": rows,
            "note": "forward + backward of lab 5's reference against the eager composition on one pre-drawn input, "
                    "median ms of interleaved rounds (5 passes each, CUDA events); draws_ms: one pass's fresh "
                    "inputs (round_draws), which the graded rounds add to both sides"},
            out_dir=args.out, command=["python", "benchmarks/lab5_kernels.py", *(argv or sys.argv[1:])], device=device)
        print(f"wrote {path}")
    except LabkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Week 7 benchmark: the notebook's Triton kernels beside eager PyTorch and inductor, on a GPU.

    python benchmarks/triton_kernels.py              # on an H200: about a minute, compilation included
    python benchmarks/triton_kernels.py --reference  # labkit's own kernels instead of the worked answers

Takes the worked answers of exercises 7.1-7.3 from the instructor's notebook (notebooks/07_triton_kernels.ipynb,
the exercise cells with their solution regions; `--reference` or a notebook without answers takes labkit's
kernels from labkit.week7_exercises), checks each against the PyTorch composition, then times it against that
composition run eagerly and compiled by torch.compile, in interleaved rounds (labkit.kernels_bench.side_by_side):
the data path (uint8 -> crop + flip + normalize, float32 out) on a batch of 4096 CIFAR images, and BatchNorm-apply
+ residual + ReLU forward and backward on the first stage's activation at batch 512 (512 x 64 x 32 x 32), in
float32 and bf16. Each contender gets its median seconds per call, the interquartile range, and the GB/s its
bytes (labkit.week7_exercises.bytes_moved) give; the card's copy bandwidth is measured in the same run for the
roofline. Saves benchmarks/results/kernels/triton_kernels_<card>.json (triton_kernels_h200.json on an H200).
On a machine without a CUDA GPU it refuses: Triton's interpreter gives right answers and meaningless times.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "07_triton_kernels.ipynb"
EXERCISES = ("7.1", "7.2", "7.3")
HEADER = "import torch\nimport torch.nn.functional as F\nimport triton\nimport triton.language as tl\n\n"
NO_GPU = ("triton_kernels.py times Triton kernels on a CUDA GPU, and this machine has none: Triton's interpreter "
          "(TRITON_INTERPRET=1) gives right answers and meaningless times. Run the notebook's self-checks here "
          "instead, or this script on a GPU.")


def _src(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def worked_answers(path: Path = NOTEBOOK) -> str | None:
    """The source of the notebook's exercise cells for 7.1-7.3, answers in, as one module; None without answers."""
    from labkit import exercises as ex

    cells = json.loads(Path(path).read_text())["cells"]
    picked = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "code" or ex.EXERCISE_TAG not in c.get("metadata", {}).get("tags", []):
            continue
        check = next((_src(d) for d in cells[i + 1:] if d["cell_type"] == "code"), "")
        m = re.search(r"\bex\.check\(\s*[\"'](\d\.\d+)[\"']", check)
        if m and m.group(1) in EXERCISES:
            picked.append(_src(c))
    if len(picked) != len(EXERCISES) or not all(ex.SOLUTION_BEGIN in s for s in picked):
        return None  # a student's copy (answers blanked) or a notebook laid out differently
    return HEADER + "\n\n".join(picked) + "\n"


def load_answers(source: str, folder: Path):
    """Import the answers' source as a module from a file (triton.jit reads a kernel's source from its file)."""
    path = Path(folder) / "w7_worked_answers.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("w7_worked_answers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernels(reference: bool, folder: Path) -> tuple[dict, str]:
    """{"augment_normalize", "bn_relu", "bn_relu_backward"} callables and where they came from."""
    from labkit import week7_exercises as w7

    source = None if reference else worked_answers()
    if source is None:
        why = "--reference" if reference else f"{NOTEBOOK.name} holds no worked answers"
        return ({"augment_normalize": w7._ref_augment(), "bn_relu": w7._ref_bn_relu(),
                 "bn_relu_backward": w7._bn_relu_backward}, f"labkit.week7_exercises' kernels ({why})")
    mod = load_answers(source, folder)
    return ({n: getattr(mod, n) for n in ("augment_normalize", "bn_relu", "bn_relu_backward")},
            f"the worked answers of {NOTEBOOK.relative_to(REPO).as_posix()} (exercise cells of 7.1-7.3)")


def torch_bn_relu_backward(g, x, scale, shift, res):
    """The backward of relu(x * scale + shift + res) in PyTorch ops: (grad x, grad scale, grad shift, grad res)."""
    c = x.shape[1]
    s, t = scale.to(x.dtype).view(1, c, 1, 1), shift.to(x.dtype).view(1, c, 1, 1)
    gz = g * (x * s + t + res > 0)
    return gz * s, (gz * x).float().sum((0, 2, 3)), gz.float().sum((0, 2, 3)), gz


def cases(dev, b: int, n: int) -> list[dict]:
    """What to time: kernel name, dtype, the composition, its arguments, elements, with a residual; a batch of
    `b` images for the data path, `n` for BatchNorm + ReLU (64 channels of 32 x 32)."""
    import torch

    from labkit import data as D
    from labkit import week7_exercises as w7

    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randint(0, 256, (b, 3, 32, 32), dtype=torch.uint8, device=dev, generator=g)
    off = torch.randint(0, 9, (2, b), device=dev, generator=g)
    flip = torch.rand(b, device=dev, generator=g) < 0.5
    stats = (torch.tensor(D.CIFAR_MEAN, device=dev), torch.tensor(D.CIFAR_STD, device=dev))
    out = [dict(kernel="augment_normalize", dtype=torch.float32, ref=w7.torch_augment_normalize,
                args=(x, off[0], off[1], flip, *stats, 4), numel=x.numel(), residual=False)]
    for dtype in (torch.float32, torch.bfloat16):
        act = [torch.randn(n, 64, 32, 32, device=dev, generator=g).to(dtype) for _ in range(3)]
        s, t = torch.randn(64, device=dev, generator=g), torch.randn(64, device=dev, generator=g)
        out += [dict(kernel="bn_relu", dtype=dtype, ref=w7.torch_bn_relu, args=(act[0], s, t, act[1]),
                     numel=act[0].numel(), residual=True),
                dict(kernel="bn_relu_backward", dtype=dtype, ref=torch_bn_relu_backward,
                     args=(act[2], act[0], s, t, act[1]), numel=act[0].numel(), residual=True)]
    return out


TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}  # a bf16 output keeps 8 bits of the float32 result


def measure(case: dict, mine, dev, rounds: int) -> dict:
    """Check one kernel against its composition, then time it beside eager and inductor."""
    from labkit import kernels_bench as kb
    from labkit import week7_exercises as w7

    dtype = str(case["dtype"]).removeprefix("torch.")
    row = {"kernel": case["kernel"], "dtype": dtype, "shape": list(case["args"][0].shape),
           "residual": case["residual"]}
    itemsize = case["args"][0].element_size() if case["kernel"] != "augment_normalize" else 4
    nbytes = w7.bytes_moved(case["kernel"], case["numel"], itemsize, case["residual"])
    flop = w7.flops(case["kernel"], case["numel"], case["residual"])
    row |= {"bytes": nbytes, "flop": flop}
    # the reference in float32 from the same inputs: the kernels compute in float32 and round their outputs once
    up = [a.float() if hasattr(a, "is_floating_point") and a.is_floating_point() else a for a in case["args"]]
    try:
        row |= w7.agreement(mine(*case["args"]), case["ref"](*up), TOLERANCE[dtype])
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run is recorded, the rest still run
        row["skipped"] = f"the kernel failed: {type(e).__name__}: {str(e)[:500]}"
        return row
    if row["share_off"] > w7.MAX_SHARE:
        row["skipped"] = (f"{row['share_off']:.3g} of the elements differ from the PyTorch composition by more "
                          f"than {TOLERANCE[dtype]:g}: not timed")
        return row
    fns = {"triton": lambda: mine(*case["args"]), **kb.eager_and_inductor(case["ref"], *case["args"])}
    try:
        fns["inductor"]()  # compiles here, so that a compiler failure costs only its own column
    except Exception as e:  # noqa: BLE001
        row["inductor_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        del fns["inductor"]
    rows = kb.summarize(kb.side_by_side(fns, device=dev, rounds=rounds), nbytes, flop)
    row["contenders"] = rows
    for other in ("eager", "inductor"):
        if other in rows:
            row[f"speedup_vs_{other}"] = rows[other]["median_s"] / rows["triton"]["median_s"]
    return row


def card_name(device_name: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,3}|L4|T4)\b", device_name.upper())
    return m.group(1).lower() if m else "gpu"


SIZES = {"full": (4096, 512), "quick": (256, 64)}  # (data-path batch, BatchNorm batch)


def run(reference: bool, quick: bool, rounds: int, dev=None, sizes: tuple[int, int] | None = None) -> dict:
    """Every case checked and timed on `dev` (default the GPU); the record's payload."""
    import torch
    import triton

    from labkit import matmul, waves

    dev = torch.device(dev or "cuda")
    with tempfile.TemporaryDirectory(prefix="w7-answers-") as folder:
        fns, source = kernels(reference, Path(folder))
        rows = []
        for case in cases(dev, *(sizes or SIZES["quick" if quick else "full"])):
            rows.append(measure(case, fns[case["kernel"]], dev, rounds))
            r = rows[-1]
            print(f"{r['kernel']:<18} {r['dtype']:<9} " + (r.get("skipped") or ", ".join(
                f"{k} {c['median_s'] * 1e6:.1f} us ({c['gb_per_s']:.0f} GB/s)" for k, c in r["contenders"].items())),
                flush=True)
    bw = matmul.measure_copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"quick": quick, "rounds": rounds, "triton": triton.__version__, "kernels_from": source,
            "copy_bandwidth": bw, "datasheet_tflops": (waves.datasheet(name) or {}).get("tflops"),
            "kernels": rows, "note": "median seconds per call over interleaved rounds (kernels_bench.side_by_side), "
            "iqr_s their interquartile range; gb_per_s: bytes_moved over the median; inductor: torch.compile of "
            "the same PyTorch composition as eager, timed after its compilation"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/kernels)")
    ap.add_argument("--reference", action="store_true", help="time labkit's kernels, not the notebook's answers")
    ap.add_argument("--quick", action="store_true", help="small tensors and 5 rounds (a smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per kernel (default 15)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"triton_kernels: {NO_GPU}", file=sys.stderr)
        return 2
    from labkit.bench import RESULTS_DIR, save_result
    from labkit.env import LabkitError

    rounds = args.rounds or (5 if args.quick else 15)
    try:
        if rounds < 1:
            raise LabkitError("--rounds must be at least 1")
        payload = run(args.reference, args.quick, rounds)
        stem = f"triton_kernels_{card_name(torch.cuda.get_device_name())}" + ("_quick" if args.quick else "")
        path = save_result(stem, payload, out_dir=args.out or RESULTS_DIR / "kernels", device="cuda")
    except LabkitError as e:
        print(f"triton_kernels: error: {e}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

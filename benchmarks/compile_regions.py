"""The top rung's model compiled as K regions, each in its own process at the same time: how soon all are
compiled, and what the cuts cost the compiled step once it runs.

    python benchmarks/compile_regions.py [--splits 1,2,4] [--repeats 2] [--out benchmarks/results]

A cold torch.compile of ResNet-18's forward and backward takes about 20 s in one process, mostly Python in dynamo,
AOTAutograd and inductor, which runs on one core while the others wait for the few Triton kernels it hands them.
Cut at stage boundaries, the model is K regions whose compiles share nothing, so K new processes can compile
them at once:
  compile   for each K, K processes start together with empty compile caches (a fresh machine's); each builds
            the model, compiles its region (static shapes, the rung's mode) and runs 3 forward and backward steps
            on an input of the shape, dtype and layout its region sees in the whole model. Each records its
            setup (interpreter, imports, CUDA, the model), its first step (the compile), and its age at the end;
            the group's wall time runs from starting the processes to the last one's exit.
  speed     one process compiles the model whole and as K regions chained, then times the model step (forward,
            loss and backward at the rung's batch, bf16, channels_last, no optimizer) for each, in alternating
            rounds: what the cuts cost once everything is compiled.
K=1 is the whole model: the baseline of both parts, in the same call. The groups alternate over --repeats rounds,
and the record is saved after each, so a call cut short keeps what it measured. A probe: labkit compiles the
whole model (tiered start compiles it beside the run, labkit.tiered). Every process finds torch's bytecode as an
install leaves it (cold_start.py's --bytecode installed). On a machine without a CUDA GPU nothing is measured.
"""

from __future__ import annotations

import time

T_IMPORT = time.perf_counter()  # before torch: a compile child's setup starts here

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cold_start import fresh_env, installed_bytecode  # noqa: E402

from labkit.bench import save_result  # noqa: E402
from labkit.env import LabkitError, pick_device, process_age_s  # noqa: E402

# The model as 10 pieces (stem, 8 residual blocks, pooling and classifier); a split cuts it between pieces, at
# stage boundaries, so each region's input has one fixed shape.
CUTS = {1: [0, 10], 2: [0, 5, 10], 3: [0, 3, 7, 10], 4: [0, 3, 5, 7, 10]}
# (channels, side) of the activation entering piece c, at width 64 and 32x32 images
ENTERING = {0: (3, 32), 3: (64, 32), 5: (128, 16), 7: (256, 8)}
BATCH = 4096   # the top rung's batch
MODE = "reduce-overhead"  # the top rung's torch.compile mode (CUDA graphs)


def pieces(model):
    """The model's 10 pieces, in order, each a module (stem and head wrapped)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = model.conv1, model.bn1

        def forward(self, x):
            return F.relu(self.bn1(self.conv1(x)))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = model.fc

        def forward(self, x):
            return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    return [Stem(), *model.layers, Head()]


def regions(model, k: int) -> list:
    """The model as k nn.Sequential regions (CUTS), sharing its parameters."""
    import torch.nn as nn
    p, cuts = pieces(model), CUTS[k]
    return [nn.Sequential(*p[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def build(dev):
    """The rung's model on `dev`: ResNet-18, zero-initialised residual blocks, channels_last; cuDNN autotuning on."""
    import torch

    from labkit.models import resnet18
    torch.backends.cudnn.benchmark = True
    return resnet18(zero_init_residual=True).to(dev, memory_format=torch.channels_last)


def region_loss(out, y):
    """The loss a region's step backpropagates: the rung's cross-entropy at the head, else a stand-in that sends
    a gradient of the output's shape and dtype back through the region."""
    import torch.nn.functional as F
    return F.cross_entropy(out.float(), y) if out.dim() == 2 else out.float().square().mean()


def child_compile(k: int, i: int, record: str) -> int:
    """One region of a k-way split, compiled cold in this process: setup, first step, then 2 more, seconds."""
    import torch
    dev = torch.device("cuda")
    model = build(dev)
    region = regions(model, k)[i]
    c, side = ENTERING[CUTS[k][i]]
    x = torch.randn(BATCH, c, side, side, device=dev, dtype=torch.float32 if i == 0 else torch.bfloat16)
    x = x.to(memory_format=torch.channels_last).requires_grad_(i > 0)
    y = torch.randint(0, 10, (BATCH,), device=dev)
    fn = torch.compile(region, mode=MODE, dynamic=False)
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), []
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", torch.bfloat16):
            out = fn(x)
        region_loss(out, y).backward()
        model.zero_grad(set_to_none=True)  # a CUDA graph's outputs are overwritten by its next replay
        x.grad = None
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    Path(record).write_text(json.dumps({
        "k": k, "region": i, "setup_s": round(t0 - T_IMPORT + (process_age_s(T_IMPORT) or 0.0), 3),
        "first_step_s": round(steps[0], 3), "steps_s": [round(s, 3) for s in steps],
        "process_s": round(process_age_s() or 0.0, 3)}))
    return 0


def child_speed(splits: list[int], rounds: int, steps: int, record: str) -> int:
    """The model step compiled whole and as each split, timed in alternating rounds in this process (img/s)."""
    import torch
    dev = torch.device("cuda")
    model = build(dev)
    x = torch.randn(BATCH, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (BATCH,), device=dev)
    fns = {k: [torch.compile(r, mode=MODE, dynamic=False) for r in regions(model, k)] for k in splits}

    def step(k):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", torch.bfloat16):
            h = x
            for f in fns[k]:
                h = f(h)
        region_loss(h, y).backward()
        model.zero_grad(set_to_none=True)

    out = {k: {"compile_s": 0.0, "img_per_s": []} for k in splits}
    for k in splits:  # compile and capture, one after the other in this process
        t0 = time.perf_counter()
        for _ in range(5):
            step(k)
        torch.cuda.synchronize()
        out[k]["compile_s"] = round(time.perf_counter() - t0, 3)
    for r in range(rounds):
        for k in splits[r % len(splits):] + splits[:r % len(splits)]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            torch.cuda.synchronize()
            out[k]["img_per_s"].append(round(steps * BATCH / (time.perf_counter() - t0), 1))
    Path(record).write_text(json.dumps({str(k): v for k, v in out.items()}))
    return 0


def compile_group(k: int, timeout_s: float) -> dict:
    """k compile children started together, each with its own empty caches; their records and the wall time."""
    with tempfile.TemporaryDirectory(prefix="labkit-regions-") as d:
        procs, records = [], []
        t0 = time.perf_counter()
        for i in range(k):
            rec = Path(d) / f"region{i}.json"
            env = fresh_env(Path(d) / f"caches{i}", None)
            procs.append(subprocess.Popen([sys.executable, __file__, "--child-compile", str(k), str(i), str(rec)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            records.append(rec)
        tails = []
        for p in procs:
            try:
                said, _ = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                said, _ = p.communicate()
            tails.append((said or "").strip().splitlines()[-1:] or ["no output"])
        wall = time.perf_counter() - t0
        runs = [json.loads(r.read_text()) if r.exists() else {"error": f"exit {p.returncode}: {t[0]}"}
                for r, p, t in zip(records, procs, tails, strict=True)]
    return {"k": k, "wall_s": round(wall, 3), "regions": runs}


def summarize(res: dict) -> dict:
    """Per split: the group wall times, the slowest region's first step, and steady img/s, each as a spread."""
    out = {}
    for k in res["splits"]:
        groups = [g for g in res["compile"] if g["k"] == k and all("error" not in r for r in g["regions"])]
        speed = res["speed"].get(str(k), {}).get("img_per_s", [])
        spread = lambda v: [min(v), max(v)] if v else None  # noqa: E731
        out[str(k)] = {
            "group_wall_s": spread([g["wall_s"] for g in groups]),
            "slowest_first_step_s": spread([max(r["first_step_s"] for r in g["regions"]) for g in groups]),
            "img_per_s_median": statistics.median(speed) if speed else None, "img_per_s": spread(speed)}
    return out


def run_child(args: list[str], timeout_s: float) -> dict:
    """The speed part in a new process; its record, or the error it ended with."""
    with tempfile.TemporaryDirectory(prefix="labkit-regions-") as d:
        rec = Path(d) / "speed.json"
        r = subprocess.run([sys.executable, __file__, *args, str(rec)], capture_output=True, text=True,
                           timeout=timeout_s, env=fresh_env(Path(d) / "caches", None))
        if r.returncode != 0 or not rec.exists():
            return {"error": f"exit {r.returncode}: {((r.stderr or r.stdout).strip().splitlines() or ['?'])[-1]}"}
        return json.loads(rec.read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child-compile"]:
        return child_compile(int(argv[1]), int(argv[2]), argv[3])
    if argv[:1] == ["--child-speed"]:
        return child_speed([int(k) for k in argv[1].split(",")], int(argv[2]), int(argv[3]), argv[4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="1,2,4", help=f"regions per split, from {sorted(CUTS)} (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the compile groups (default 2)")
    ap.add_argument("--parts", default="compile,speed", help="compile, speed or both (default both)")
    ap.add_argument("--steps", type=int, default=30, help="model steps per timed round of the speed part (default 30)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a group or the speed part may take")
    ap.add_argument("--bytecode", choices=("installed", "as-found"), default="installed",
                    help="torch's bytecode as an install leaves it (default), or the machine as it is")
    ap.add_argument("--device", default="auto", help="auto or cuda[:N]")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    try:
        splits = [int(k) for k in args.splits.split(",")]
    except ValueError:
        splits = [0]
    parts = set(args.parts.split(","))
    if not set(splits) <= set(CUTS) or 1 not in splits:
        ap.error(f"--splits {args.splits!r}: numbers from {sorted(CUTS)}, with 1 (the whole model) among them")
    if not parts or not parts <= {"compile", "speed"} or min(args.repeats, args.steps) < 1:
        ap.error("--parts: compile, speed or both; --repeats and --steps >= 1")
    dev = pick_device(args.device)
    if dev.type != "cuda":
        print(f"compile_regions: needs a CUDA GPU (the rung's mode replays CUDA graphs); on {dev.type} nothing is "
              f"measured (skipped)")
        return 0
    command = ["compile_regions.py", *argv]
    res = {"kind": "compile_regions", "splits": splits, "batch": BATCH, "mode": MODE, "cuts": CUTS,
           "repeats": args.repeats, "compile": [], "speed": {}, "note": ""}
    with tempfile.TemporaryDirectory(prefix="labkit-pycache-") as pyc:
        res["bytecode"] = installed_bytecode(args.bytecode, pyc)
        if "speed" in parts:
            print("speed: the model step whole and split, in one process", flush=True)
            res["speed"] = run_child(["--child-speed", ",".join(map(str, splits)), str(2 * args.repeats + 1),
                                      str(args.steps)], args.timeout)
            res["summary"] = summarize(res)
            save_result("compile_regions", res, out_dir=args.out, command=command, device=dev)
        for r in range(args.repeats if "compile" in parts else 0):
            for k in splits[r % len(splits):] + splits[:r % len(splits)]:
                res["compile"].append(compile_group(k, args.timeout))
                g = res["compile"][-1]
                print(f"round {r + 1}: {k} region(s) in {g['wall_s']:.1f} s", flush=True)
                res["summary"] = summarize(res)
                save_result("compile_regions", res, out_dir=args.out, command=command, device=dev)
    print(json.dumps(res.get("summary", {}), indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabkitError as e:
        sys.exit(f"compile_regions: {e}")

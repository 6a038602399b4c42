"""The top rung's model compiled as K regions, each in its own process at the same time: how soon all are
compiled, and what the cuts cost the compiled step once it runs.

    python benchmarks/compile_regions.py [--splits 1,2,4] [--repeats 2] [--out benchmarks/results]
    python benchmarks/compile_regions.py --parts compile,saved --splits 1,4 --repeats 3 --name compile_regions_saved

A cold torch.compile of ResNet-18's forward and backward takes about 20 s in one process, mostly Python in dynamo,
AOTAutograd and inductor, which runs on one core while the others wait for the few Triton kernels it hands them.
Cut at stage boundaries, the model is K regions whose compiles share nothing, so K new processes can compile
them at once:
  compile   for each K, K processes start together with empty compile caches (a fresh machine's); each builds
            the model, compiles its region (static shapes, the rung's mode) and runs 3 forward and backward steps
            on an input of the shape, dtype and layout its region sees in the whole model. Each records its
            setup (interpreter, imports, CUDA, the model), its first step (the compile), and its age at the end;
            the group's wall time runs from starting the processes to the last one's exit.
  saved     a new process starts K builders first thing, each compiling one region ahead of time and saving it
            (torch's aot_compile, as labkit.faststart.precompiled saves the whole forward); meanwhile it sets up the model
            and data and imports dynamo, then loads the K files and takes 3 steps through them: what a run
            compiling its forward in K children would wait for. Its first step counts from its setup's end, as
            `labkit train`'s does; every mark is the process's age. (--parts compile,saved)
  cached    as saved, but the builders only compile their regions with torch.compile, into one compile cache they
            share (inductor's FX graph and AOTAutograd caches, Triton's kernels), and leave; the run then compiles
            the K regions itself, finding every graph in that cache, and takes 3 steps. While it waits it takes
            one eager step, so cuDNN has timed every convolution before the compiled steps, as a tiered run's
            eager steps do. It records the cache hits. Each builder gets its share of the cores as compile
            workers and leaves cuDNN's autotuning off: its timed choices would stay in its own process.
            (--parts cached)
  speed     one process compiles the model whole and as K regions chained, then times the model step (forward,
            loss and backward at the rung's batch, bf16, channels_last, no optimizer) for each, in alternating
            rounds: what the cuts cost once everything is compiled.
K=1 is the whole model: the baseline of every part, in the same call. The groups alternate over --repeats rounds,
and the record is saved after each, so a call cut short keeps what it measured. A probe: labkit compiles the
whole model (tiered start compiles it beside the run, labkit.faststart.tiered). Every process finds torch's bytecode as an
install leaves it (cold_start.py's --bytecode installed). On a machine without a CUDA GPU nothing is measured.
"""

from __future__ import annotations

import time

T_IMPORT = time.perf_counter()  # before torch: a compile child's setup starts here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
# labkit and torch are imported inside the functions: the `saved` part's child starts its builders before it
# imports torch, as a run would that starts them first thing.

BATCH = 4096   # the top rung's batch
MODE = "reduce-overhead"  # the top rung's torch.compile mode (CUDA graphs)
# the cuts (model_regions.CUTS, imported with torch): 1 is the whole model
SPLITS = (1, 2, 3, 4, 5, 10)


def regions(model, k: int) -> list:
    import model_regions
    return model_regions.regions(model, k)


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


def region_input(k: int, i: int, dev, batch: int):
    """An input of the shape, dtype and layout region i of a k-way split sees in the whole model (the images for
    the first, bf16 activations that need their gradient for the others)."""
    import torch
    from model_regions import CUTS, ENTERING
    c, side = ENTERING[CUTS[k][i]]
    x = torch.randn(batch, c, side, side, device=dev, dtype=torch.float32 if i == 0 else torch.bfloat16)
    return x.to(memory_format=torch.channels_last).requires_grad_(i > 0)


def child_compile(k: int, i: int, batch: int, device: str, record: str) -> int:
    """One region of a k-way split, compiled cold in this process: setup, first step, then 2 more, seconds."""
    import torch

    from labkit.bench import synchronize
    from labkit.env import process_age_s
    dev = torch.device(device)
    model = build(dev)
    region = regions(model, k)[i]
    x = region_input(k, i, dev, batch)
    y = torch.randint(0, 10, (batch,), device=dev)
    fn = torch.compile(region, mode=MODE, dynamic=False)
    synchronize(dev)
    t0, steps = time.perf_counter(), []
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, torch.bfloat16):
            out = fn(x)
        region_loss(out, y).backward()
        model.zero_grad(set_to_none=True)  # a CUDA graph's outputs are overwritten by its next replay
        x.grad = None
        synchronize(dev)
        steps.append(time.perf_counter() - t0)
    Path(record).write_text(json.dumps({
        "k": k, "region": i, "setup_s": round(t0 - T_IMPORT + (process_age_s(T_IMPORT) or 0.0), 3),
        "first_step_s": round(steps[0], 3), "steps_s": [round(s, 3) for s in steps],
        "process_s": round(process_age_s() or 0.0, 3)}))
    return 0


def child_build(k: int, i: int, batch: int, device: str, path: str, record: str) -> int:
    """Region i of a k-way split compiled ahead of time and saved to `path`, as `labkit.faststart.precompiled` builds the
    whole forward (torch's aot_compile, the rung's autocast inside); leaves at once once saved."""
    import torch
    import torch._dynamo.config as dynamo_config

    from labkit.env import process_age_s
    from labkit.faststart import precompiled as P
    dev = torch.device(device)
    model = build(dev)
    region, x = regions(model, k)[i], region_input(k, i, dev, batch)
    t0 = time.perf_counter()
    with dynamo_config.patch(enable_aot_compile=True):
        compiled = torch.compile(P.FORWARDS[(dev.type, "bf16")], fullgraph=True, dynamic=False, mode=MODE)
        saved = compiled.aot_compile(((region, x), {}))
    saved.save_compiled_function(path)
    Path(record).write_text(json.dumps({
        "region": i, "setup_s": round(t0 - T_IMPORT + (process_age_s(T_IMPORT) or 0.0), 3),
        "compile_s": round(time.perf_counter() - t0, 3), "process_s": round(process_age_s() or 0.0, 3)}))
    sys.stdout.flush()
    os._exit(0)  # not the seconds inductor's compile workers take to shut down: the file is what counts


def _run_setup(k: int, batch: int, device: str, t_start: float):
    """A run's setup once its builders are started: (dev, model, its k regions, a batch x, y, age), where age(t)
    turns a perf_counter reading into this process's age, seconds."""
    import torch

    from labkit.bench import synchronize
    from labkit.env import process_age_s
    base = (process_age_s(t_start) or 0.0) - t_start
    dev = torch.device(device)
    model = build(dev)
    regs = regions(model, k)
    x = torch.randn(batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=dev)
    synchronize(dev)
    return dev, model, regs, x, y, lambda t: round(base + t, 3)


def _builder_records(folder: Path, codes: list[int]) -> list[dict]:
    """The builders' records, in order; SystemExit naming the first that failed, with its log's last line."""
    out = []
    for i, code in enumerate(codes):
        rec = folder / f"r{i}.json"
        if code != 0 or not rec.exists():
            tail = (folder / f"b{i}.log").read_text().strip().splitlines()[-1:] or [f"exit {code}"]
            raise SystemExit(f"builder {i} failed: {tail[0]}")
        out.append(json.loads(rec.read_text()))
    return out


def child_saved(k: int, batch: int, device: str, record: str) -> int:
    """A run that starts k builders (`child_build`) first thing, sets up the model and data meanwhile, then loads
    the k saved regions and takes 3 steps through them. Every mark is this process's age, seconds."""
    t_start = time.perf_counter()
    folder = Path(record).parent / "saved"
    folder.mkdir()
    builders = []
    for i in range(k):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / f"b{i}" / "inductor"),
                   TRITON_CACHE_DIR=str(folder / f"b{i}" / "triton"))
        builders.append(subprocess.Popen(
            [sys.executable, __file__, "--child-build", str(k), str(i), str(batch), device, str(folder / f"r{i}.fn"),
             str(folder / f"r{i}.json")], env=env, stdout=subprocess.DEVNULL, stderr=open(folder / f"b{i}.log", "w")))
    t_spawned = time.perf_counter()
    import torch
    import torch.nn.functional as F

    from labkit.bench import synchronize
    dev, model, regs, x, y, age = _run_setup(k, batch, device, t_start)
    t_setup = time.perf_counter()
    import torch._dynamo  # noqa: F401  (what a run's loading thread imports while the builders work)
    t_dynamo = time.perf_counter()
    codes = [b.wait() for b in builders]
    t_built = time.perf_counter()
    out = {"k": k, "spawned_s": age(t_spawned), "setup_s": age(t_setup), "dynamo_s": age(t_dynamo),
           "built_s": age(t_built), "builders": _builder_records(folder, codes)}
    from labkit import train as T
    from labkit.faststart import precompiled as P
    cfg = T.preset("muon")
    fns = []
    for i in range(k):
        f = folder / f"r{i}.fn"
        fn = P.load_found(cfg, f, f.read_bytes(), say=print)
        if fn is None:
            raise SystemExit(f"region {i} could not be loaded")
        fns.append(fn)
    t_loaded = time.perf_counter()
    steps, losses = [], []
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        h = x
        for fn, r in zip(fns, regs, strict=True):
            h = fn(r, h)  # outside autocast: the saved function holds its own
        loss = F.cross_entropy(h.float(), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        synchronize(dev)
        steps.append(time.perf_counter())
        losses.append(round(loss.item(), 4))
    with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16):  # the same loss, eager: the regions are the model
        eager = F.cross_entropy(model(x).float(), y).item()
    out.update(loaded_s=age(t_loaded), first_step_end_s=age(steps[0]),
               first_step_s=round(steps[0] - t_setup, 3), steps_s=[round(t - t_setup, 3) for t in steps],
               losses=losses, eager_loss=round(eager, 4))
    Path(record).write_text(json.dumps(out))
    return 0


def child_speed(splits: list[int], rounds: int, steps: int, batch: int, device: str, record: str) -> int:
    """The model step compiled whole and as each split, timed in alternating rounds in this process (img/s)."""
    import torch

    from labkit.bench import synchronize
    dev = torch.device(device)
    model = build(dev)
    x = torch.randn(batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=dev)
    fns = {k: [torch.compile(r, mode=MODE, dynamic=False) for r in regions(model, k)] for k in splits}

    def step(k):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, torch.bfloat16):
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
        synchronize(dev)
        out[k]["compile_s"] = round(time.perf_counter() - t0, 3)
    for r in range(rounds):
        for k in splits[r % len(splits):] + splits[:r % len(splits)]:
            synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            synchronize(dev)
            out[k]["img_per_s"].append(round(steps * batch / (time.perf_counter() - t0), 1))
    Path(record).write_text(json.dumps({str(k): v for k, v in out.items()}))
    return 0


def child_warm(k: int, i: int, batch: int, device: str, record: str) -> int:
    """Region i of a k-way split compiled with torch.compile, forward and backward, into the compile cache this
    process shares with the run that started it; leaves at once once compiled."""
    import torch

    from labkit.env import process_age_s
    dev = torch.device(device)
    model = build(dev)
    torch.backends.cudnn.benchmark = False  # timing cuDNN here would hand the run nothing: its choices stay here
    region, x = regions(model, k)[i], region_input(k, i, dev, batch)
    y = torch.randint(0, 10, (batch,), device=dev)
    t0 = time.perf_counter()
    fn = torch.compile(region, mode=MODE, dynamic=False)
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(dev.type, torch.bfloat16):
        out = fn(x)
    region_loss(out, y).backward()  # the backward graph compiles at its first call
    torch.cuda.synchronize(dev)
    Path(record).write_text(json.dumps({
        "region": i, "setup_s": round(t0 - T_IMPORT + (process_age_s(T_IMPORT) or 0.0), 3),
        "compile_s": round(time.perf_counter() - t0, 3), "process_s": round(process_age_s() or 0.0, 3)}))
    sys.stdout.flush()
    os._exit(0)  # not the seconds inductor's compile workers take to shut down: the cache is what counts


def child_cached(k: int, batch: int, device: str, record: str) -> int:
    """A run that starts k builders (`child_warm`) first thing, sharing its compile cache; sets up the model and
    data meanwhile and takes one eager step; then compiles the k regions from the cache and takes 3 steps through
    them. Every mark is this process's age, seconds."""
    t_start = time.perf_counter()
    folder = Path(record).parent / "cached"
    folder.mkdir()
    # the machine's cores shared out: k builders each starting a compile worker per core would start k times as many
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 1) // k)))
    builders = [subprocess.Popen([sys.executable, __file__, "--child-warm", str(k), str(i), str(batch), device,
                                  str(folder / f"r{i}.json")], env=env, stdout=subprocess.DEVNULL,
                                 stderr=open(folder / f"b{i}.log", "w")) for i in range(k)]
    t_spawned = time.perf_counter()
    import torch
    import torch.nn.functional as F

    from labkit.bench import synchronize
    dev, model, regs, x, y, age = _run_setup(k, batch, device, t_start)
    t_setup = time.perf_counter()
    with torch.autocast(dev.type, torch.bfloat16):  # cuDNN times each convolution here, as a tiered run's eager steps
        F.cross_entropy(model(x).float(), y).backward()
    model.zero_grad(set_to_none=True)
    synchronize(dev)
    t_eager = time.perf_counter()
    import torch._dynamo  # noqa: F401  (what a run's loading thread imports while the builders work)
    from torch._dynamo.utils import counters
    codes = [b.wait() for b in builders]
    t_built = time.perf_counter()
    out = {"k": k, "spawned_s": age(t_spawned), "setup_s": age(t_setup), "eager_step_s": round(t_eager - t_setup, 3),
           "built_s": age(t_built), "builders": _builder_records(folder, codes)}
    fns = [torch.compile(r, mode=MODE, dynamic=False) for r in regs]
    steps, losses = [], []
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, torch.bfloat16):
            h = x
            for fn in fns:
                h = fn(h)
        loss = F.cross_entropy(h.float(), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        synchronize(dev)
        steps.append(time.perf_counter())
        losses.append(round(loss.item(), 4))
    with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16):  # the same loss, eager: the regions are the model
        eager = F.cross_entropy(model(x).float(), y).item()
    hits = {f"{group}.{name}": n for group in ("inductor", "aot_autograd") for name, n in counters[group].items()
            if "cache" in name}
    out.update(first_step_end_s=age(steps[0]), first_step_s=round(steps[0] - t_setup, 3),
               first_call_s=round(steps[0] - t_built, 3), steps_s=[round(t - t_setup, 3) for t in steps],
               losses=losses, eager_loss=round(eager, 4), cache=hits)
    Path(record).write_text(json.dumps(out))
    return 0


def compile_group(k: int, tail: list[str], timeout_s: float) -> dict:
    """k compile children started together, each with its own empty caches; their records and the wall time."""
    from cold_start import fresh_env
    with tempfile.TemporaryDirectory(prefix="labkit-regions-") as d:
        procs, records = [], []
        t0 = time.perf_counter()
        for i in range(k):
            rec = Path(d) / f"region{i}.json"
            env = fresh_env(Path(d) / f"caches{i}", None)
            procs.append(subprocess.Popen([sys.executable, __file__, "--child-compile", str(k), str(i), *tail, str(rec)],
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


def spread(values: list) -> list | None:
    return [min(values), max(values)] if values else None


def summarize(res: dict) -> dict:
    """Per split, each as a spread: the compile groups' wall times and slowest first step, the saved runs' first
    step (from their setup) and its end (process age), and steady img/s with its median."""
    out = {}
    for k in res["splits"]:
        groups = [g for g in res["compile"] if g["k"] == k and all("error" not in r for r in g["regions"])]
        saved = [r for r in res.get("saved", []) if r.get("k") == k and "error" not in r]
        cached = [r for r in res.get("cached", []) if r.get("k") == k and "error" not in r]
        speed = res["speed"].get(str(k), {}).get("img_per_s", [])
        out[str(k)] = {
            "group_wall_s": spread([g["wall_s"] for g in groups]),
            "slowest_first_step_s": spread([max(r["first_step_s"] for r in g["regions"]) for g in groups]),
            "saved_first_step_s": spread([r["first_step_s"] for r in saved]),
            "saved_first_step_end_s": spread([r["first_step_end_s"] for r in saved]),
            "saved_load_s": spread([round(r["loaded_s"] - r["built_s"], 3) for r in saved]),
            "cached_first_step_s": spread([r["first_step_s"] for r in cached]),
            "cached_built_s": spread([r["built_s"] for r in cached]),
            "cached_first_call_s": spread([r["first_call_s"] for r in cached]),
            "img_per_s_median": statistics.median(speed) if speed else None, "img_per_s": spread(speed)}
    return out


def run_child(args: list[str], timeout_s: float) -> dict:
    """A child part (speed, saved) in a new process with empty caches; its record, or the error it ended with."""
    from cold_start import fresh_env
    with tempfile.TemporaryDirectory(prefix="labkit-regions-") as d:
        rec = Path(d) / "record.json"
        try:
            r = subprocess.run([sys.executable, __file__, *args, str(rec)], capture_output=True, text=True,
                               timeout=timeout_s, env=fresh_env(Path(d) / "caches", None))
        except subprocess.TimeoutExpired:
            return {"error": f"took longer than {timeout_s:.0f} s"}
        if r.returncode != 0 or not rec.exists():
            return {"error": f"exit {r.returncode}: {((r.stderr or r.stdout).strip().splitlines() or ['?'])[-1]}"}
        return json.loads(rec.read_text())


# each child's arguments: its own, then the batch and the device, then where it writes its record
CHILDREN = {"--child-compile": lambda a: child_compile(int(a[0]), int(a[1]), int(a[2]), a[3], a[4]),
            "--child-build": lambda a: child_build(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], a[5]),
            "--child-saved": lambda a: child_saved(int(a[0]), int(a[1]), a[2], a[3]),
            "--child-warm": lambda a: child_warm(int(a[0]), int(a[1]), int(a[2]), a[3], a[4]),
            "--child-cached": lambda a: child_cached(int(a[0]), int(a[1]), a[2], a[3]),
            "--child-speed": lambda a: child_speed([int(k) for k in a[0].split(",")], int(a[1]), int(a[2]),
                                                   int(a[3]), a[4], a[5])}
PARTS = ("compile", "saved", "cached", "speed")


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="1,2,4", help=f"regions per split, from {SPLITS} (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the compile groups and saved runs (default 2)")
    ap.add_argument("--parts", default="compile,speed", help=f"some of {', '.join(PARTS)} (default compile,speed)")
    ap.add_argument("--steps", type=int, default=30, help="model steps per timed round of the speed part (default 30)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a group, a saved run or the speed part may take")
    ap.add_argument("--bytecode", choices=("installed", "as-found"), default="installed",
                    help="torch's bytecode as an install leaves it (default), or the machine as it is")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"images per step (default {BATCH}, the rung's)")
    ap.add_argument("--name", default="compile_regions", help="result name (default compile_regions)")
    ap.add_argument("--device", default="auto", help="auto or cuda[:N]")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ladder"),
                    help="results folder (default benchmarks/results/ladder)")
    args = ap.parse_args(argv)
    try:
        args.splits = [int(k) for k in args.splits.split(",")]
    except ValueError:
        args.splits = [0]
    args.parts = set(args.parts.split(","))
    if not set(args.splits) <= set(SPLITS) or 1 not in args.splits:
        ap.error(f"--splits: numbers from {SPLITS}, with 1 (the whole model) among them")
    if not args.parts or not args.parts <= set(PARTS) or min(args.repeats, args.steps, args.batch) < 1:
        ap.error(f"--parts: some of {', '.join(PARTS)}; --repeats and --steps >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in CHILDREN:
        return CHILDREN[argv[0]](argv[1:])
    args = parse(argv)
    from cold_start import installed_bytecode

    from labkit.bench import save_result
    from labkit.env import LabkitError, pick_device
    try:
        dev = pick_device(args.device)
    except LabkitError as e:
        raise SystemExit(f"compile_regions: {e}") from None
    if dev.type != "cuda":
        print(f"compile_regions: needs a CUDA GPU (the rung's mode replays CUDA graphs); on {dev.type} nothing is "
              f"measured (skipped)")
        return 0
    command, splits, tail = ["compile_regions.py", *argv], args.splits, [str(args.batch), str(dev)]
    import model_regions
    res = {"kind": "compile_regions", "splits": splits, "batch": args.batch, "mode": MODE, "cuts": model_regions.CUTS,
           "repeats": args.repeats, "compile": [], "saved": [], "cached": [], "speed": {}, "note": ""}

    def save():
        res["summary"] = summarize(res)
        save_result(args.name, res, out_dir=args.out, command=command, device=dev)

    with tempfile.TemporaryDirectory(prefix="labkit-pycache-") as pyc:
        res["bytecode"] = installed_bytecode(args.bytecode, pyc)
        if "speed" in args.parts:
            print("speed: the model step whole and split, in one process", flush=True)
            res["speed"] = run_child(["--child-speed", ",".join(map(str, splits)), str(2 * args.repeats + 1),
                                      str(args.steps), *tail], args.timeout)
            save()
        for r in range(args.repeats):
            for k in splits[r % len(splits):] + splits[:r % len(splits)]:
                if "compile" in args.parts:
                    res["compile"].append(compile_group(k, tail, args.timeout))
                    print(f"round {r + 1}: {k} region(s) compiled in {res['compile'][-1]['wall_s']:.1f} s", flush=True)
                    save()
                for part in ("saved", "cached"):
                    if part in args.parts:
                        res[part].append({"k": k, **run_child([f"--child-{part}", str(k), *tail], args.timeout)})
                        got = res[part][-1]
                        print(f"round {r + 1}: {k} {part} region(s): first step "
                              f"{got.get('first_step_s', got.get('error'))}", flush=True)
                        save()
    print(json.dumps(res.get("summary", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

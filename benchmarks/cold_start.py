"""Cold start of the top rung: what a student on a fresh machine waits for, every run in a new process.

    python benchmarks/cold_start.py [--repeats 2] [--out benchmarks/results]
    python benchmarks/cold_start.py --variants                  # also try ways to compile faster, each cold
    python benchmarks/cold_start.py --variant "16 threads:env.TORCHINDUCTOR_COMPILE_THREADS=16"
    python benchmarks/cold_start.py --parts warm --repeats 4 --variant "pool:env.TORCHINDUCTOR_COMPILE_THREADS=16"
                                                                # whole runs with the artifact only: no cold compiles

Each run starts a new Python process with empty torch.compile caches (a new inductor and Triton folder), as on
a new Colab machine, and the runs alternate within one call so drift on the machine hits all of them:
  first step, cold          the top rung's first steps with nothing cached (the compile included)
  first step, artifact      the same after loading the project's artifact (labkit compile-cache), built once
                            at the start of the call in its own process, for this card and torch version
  whole run, cold/artifact  `labkit train --preset TOP` from starting the process to its result (interpreter,
                            imports, data, compile, all epochs, test accuracy): the student's wait. It starts
                            tiered (`labkit.faststart.tiered`: eager steps until the compiled forward is loaded or, cold,
                            compiled beside the run); `--variant "waiting:env.LABKIT_TIERED=0"` waits for it
  whole run, eager rungs    the same command for the fastest eager rungs (default batch_fused, cudnn_benchmark)
With --variants (or --variant LABEL:KEY=VALUE,...) each variant times the cold first step with one thing
about compiling changed: env.NAME=VALUE (environment, e.g. TORCHINDUCTOR_COMPILE_THREADS),
inductor.KEY=VALUE / dynamo.KEY=VALUE (torch._inductor.config / torch._dynamo.config), warm_pool=true
(start inductor's compile workers before the data and model are set up, so they start while those load), or
set.FIELD=VALUE (a TrainConfig field, e.g. set.cudnn_benchmark=false: no cuDNN autotuning in the first step);
artifact=true times the variant's first step with the artifact loaded instead of cold. A variant of TrainConfig
fields or environment variables alone also runs whole with `run` in --parts, cold and with the artifact (its own
if it changes TrainConfig fields: another top rung). Whole runs record where their wall time went (the train
record's stages, and what the process took after its result).
With the artifact, a run takes the rung's forward saved whole (`labkit.faststart.precompiled`, written by the artifact's
build) as `labkit train` does; `--variant "artifact path:env.LABKIT_PRECOMPILED=0"` runs torch.compile on the
artifact beside it.
Cold means no torch.compile caches, not no Python bytecode: every process finds torch's .pyc as an install leaves
it, even where this machine's torch has none (--bytecode installed, the default; the record keeps the import times
both ways); --bytecode as-found runs the machine as it is.
Every first-step run also records how much dynamo compiled (frames, graphs, graph breaks, cache hits) and
where compile time went (torch._dynamo's timed phases, seconds).

The result `cold_start` is saved after every run, so a call cut short keeps what it measured. On a machine
without a CUDA GPU nothing is measured: the top rung needs CUDA graphs. Sized by the cold first steps recorded
in compile_time.json, the default call (two rounds) fits in a 10-minute GPU call on an H100, and so do the
variants on their own (`--variants --parts first --repeats 1`), not both together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_time as CT  # noqa: E402  (its first_steps: the same timed first steps)

from labkit import data as D  # noqa: E402
from labkit import train as T  # noqa: E402
from labkit.bench import RESULTS_DIR, save_result  # noqa: E402
from labkit.env import LabkitError, bytecode_status, pick_device  # noqa: E402
from labkit.faststart import compile_artifacts as CA  # noqa: E402
from labkit.faststart import cudnn_warmup as CW  # noqa: E402
from labkit.faststart import precompiled as P  # noqa: E402
from labkit.presets import add_set_argument  # noqa: E402

EAGER = ["batch_fused", "cudnn_benchmark"]
# Directions of issue 26 for a faster cold compile, each a change the child applies before compiling.
VARIANTS = {
    "1 compile thread": ["env.TORCHINDUCTOR_COMPILE_THREADS=1"],
    "compile workers started early": ["warm_pool=true"],
    "compile workers forked": ["env.TORCHINDUCTOR_WORKER_START=fork"],
    "no pointwise autotuning": ["inductor.triton.autotune_pointwise=false"],
    "no pattern matcher": ["inductor.pattern_matcher=false"],
    "combo kernels": ["inductor.combo_kernels=true"],
    # the ablation measured the top rung without cudnn.benchmark within 1% (ladder_ablation.json): if its
    # autotuning is much of the first step, the top rung could do without it
    "no cuDNN autotuning": ["set.cudnn_benchmark=false"],
    "artifact, no cuDNN autotuning": ["artifact=true", "set.cudnn_benchmark=false"],
    # torch.compile starts inductor's compile workers (one process per core) at its first call, also when every
    # graph and kernel comes from the artifact and none is compiled: with TORCH_WARM_POOL=0 they start only when a
    # compile job is submitted
    "artifact, no worker warm-up": ["artifact=true", "env.TORCH_WARM_POOL=0"],
}
GOALS = {"first_step_cold_s": 12.0, "first_step_artifact_s": 3.0}  # issue 26, H100


def parse_variant(text: str) -> tuple[str, dict]:
    """LABEL:KEY=VALUE[,KEY=VALUE] as (label, {"env": {}, "inductor": {}, "dynamo": {}, "warm_pool": bool,
    "sets": [FIELD=VALUE], "artifact": bool})."""
    label, sep, rest = text.partition(":")
    if not sep or not label.strip() or not rest:
        raise LabkitError(f"variant {text!r}: write LABEL:KEY=VALUE[,KEY=VALUE]")
    return label.strip(), changes(rest.split(","))


def changes(pairs: list[str]) -> dict:
    """Validated variant changes; unknown config keys fail here, before any run."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    out = {"env": {}, "inductor": {}, "dynamo": {}, "warm_pool": False, "sets": [], "artifact": False}
    known = {"inductor": inductor_config.get_config_copy(), "dynamo": dynamo_config.get_config_copy()}
    flags = ("warm_pool", "artifact")  # KEY=VALUE; the rest are KIND.NAME=VALUE
    for p in pairs:
        key, sep, value = p.partition("=")
        where, _, name = key.partition(".")
        if not sep or not (key in flags or (where in ("env", "inductor", "dynamo", "set") and name)):
            raise LabkitError(f"variant change {p!r}: write env.NAME=V, inductor.KEY=V, dynamo.KEY=V, set.FIELD=V, "
                              f"warm_pool=true or artifact=true")
        if where == "env":
            out["env"][name] = value
        elif where == "set":
            T.parse_sets([f"{name}={value}"])  # an unknown TrainConfig field fails here
            out["sets"].append(f"{name}={value}")
        elif where in flags:
            out[where] = value.lower() in ("1", "true", "yes", "on")
        else:
            if name not in known[where]:
                raise LabkitError(f"variant change {p!r}: torch._{where}.config has no {name!r}")
            out[where][name] = _typed(value, known[where][name])
    return out


def _typed(value: str, like):
    if isinstance(like, bool):
        return value.lower() in ("1", "true", "yes", "on")
    for t in (int, float):
        if isinstance(like, t):
            return t(value)
    return None if value.lower() == "none" else value


# ------------------------------------------------------------------------------------------------ one process


def child(spec: dict) -> int:
    """One first-steps run in this fresh process; its caches are the ones its environment names."""
    ready_s = time.time() - spec["t0"]
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    if spec["warm_pool"]:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
    dev = pick_device(spec["device"])
    cfg = T.with_changes(T.plan_ladder(dev, quick=False, names=[spec["rung"]]).rungs[0], **T.parse_sets(spec["sets"]))
    warmup = CW.start(cfg, dev)  # as `labkit train` does: cuDNN's timing overlaps loading the data and the artifact
    ds = D.load(cfg.data)
    # as `labkit train` does: the saved forward where the artifact folder has one for this graph, else the artifact
    t_load, pre, loaded = time.perf_counter(), None, None
    if spec["artifacts"]:
        pre = P.load(cfg, dev, T.graph_key(cfg), spec["artifacts"])
        loaded = None if pre else CA.load(dev, spec["artifacts"], graphs=[T.graph_key(cfg)])
    load_s = time.perf_counter() - t_load
    with inductor_config.patch(spec["inductor"]), dynamo_config.patch(spec["dynamo"]):
        rec = CT.first_steps(cfg, dev, ds, spec["steps"], warmup=warmup, precompiled=pre)
    compiled = {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
                "graph_breaks": sum(counters["graph_break"].values()),
                **{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
                **{k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}}
    Path(spec["record"]).write_text(json.dumps({**rec, "ready_s": ready_s, "result_s": time.time() - spec["t0"],
                                                "compiled": compiled, "loaded": loaded, "load_s": load_s,
                                                "precompiled": pre is not None,
                                                "compile_phases_s": compile_phases()}))
    return 0


def compile_phases(top: int = 12) -> dict[str, float]:
    """The longest of torch._dynamo's timed compile phases in this process, seconds each (phases nest, so they
    overlap: read them as where the time went, not as parts of a sum)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    total = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items() if v}
    return dict(sorted(total.items(), key=lambda kv: -kv[1])[:top])


IMPORT_PROBE = ("import time; t = time.perf_counter(); import torch; a = time.perf_counter(); "
                "import torch._dynamo, torch._inductor.compile_fx; print(a - t, time.perf_counter() - a)")


def import_seconds() -> dict:
    """Seconds a new process takes to import torch, then torch.compile's modules (dynamo, inductor)."""
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    torch_s, compiler_s = map(float, r.stdout.split())
    return {"torch_s": round(torch_s, 3), "compiler_s": round(compiler_s, 3)}


def installed_bytecode(mode: str, folder: str) -> dict:
    """Give every process of the call torch's bytecode as pip or conda leave it installed (mode "installed").

    A cold start here means no torch.compile caches, as on a new Colab machine, whose torch has its .pyc from
    the install. An install without them (`pip --no-compile` into a folder Python may not write) recompiles
    torch's sources in every process, seconds that no student's machine spends. Then the processes share a
    bytecode folder (PYTHONPYCACHEPREFIX), filled by a first import before anything is timed. Mode "as-found"
    changes nothing. Either way the record keeps what was found and the import times.
    """
    info = {"mode": mode, "found": bytecode_status()}
    if mode == "installed" and not info["found"]["cached"]:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = folder  # read by every process this call starts (fresh_env copies it)
        info["prefix"] = folder
        info["import_s_without"] = import_seconds()  # compiles and writes the bytecode as it goes
    info["import_s"] = import_seconds()
    return info


def fresh_env(folder: Path, artifacts: str | None, extra: dict | None = None) -> dict:
    """The environment of a new process with empty compile caches in `folder` (a fresh machine's)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TRITON_CACHE_DIR=str(folder / "triton"),
               LABKIT_COMPILE_CACHE=artifacts or str(folder / "no-artifacts"), **(extra or {}))
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    return env


def run_process(cmd: list[str], env: dict, record: Path, timeout_s: float) -> dict:
    """Run `cmd`, return its record plus wall_s (start of the process to its exit, seconds)."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"took longer than {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not record.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {r.returncode}: {tail[0]}", "wall_s": wall}
    return {**json.loads(record.read_text()), "wall_s": wall, "said": _cache_lines(r.stderr)}


def _cache_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "compile cache" in line or "tiered start" in line]


def first_steps_job(rung: str, dev, steps: int, artifacts: str | None, variant: dict, timeout_s: float,
                    sets: list[str]) -> dict:
    """The first `steps` steps of `rung` in a new process with empty caches (and `artifacts` loaded, if given)."""
    with tempfile.TemporaryDirectory(prefix="labkit-cold-") as d:
        record = Path(d) / "record.json"
        spec = {"rung": rung, "device": str(dev), "steps": steps, "artifacts": artifacts, "record": str(record),
                "sets": sets + variant.get("sets", []),
                "warm_pool": variant.get("warm_pool", False), "inductor": variant.get("inductor", {}),
                "dynamo": variant.get("dynamo", {}), "t0": time.time()}
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
        return run_process(cmd, fresh_env(Path(d), artifacts, variant.get("env")), record, timeout_s)


def whole_run_job(rung: str, dev, epochs: int, artifacts: str | None, timeout_s: float, sets: list[str],
                  env: dict | None = None) -> dict:
    """`labkit train --preset RUNG` in a new process with empty caches (and `env` set): the wall time a student
    waits."""
    with tempfile.TemporaryDirectory(prefix="labkit-cold-") as d:
        record = Path(d) / "train.json"
        # cold: the compile-cache folder is empty (fresh_env), as on a new machine
        cmd = [sys.executable, "-m", "labkit", "train", "--preset", rung, "--device", str(dev),
               "--set", f"epochs={epochs}", *sets, "--json", str(record)]
        rec = run_process(cmd, fresh_env(Path(d), artifacts, env), record, timeout_s)
    kept = ("wall_s", "error", "said", "first_step_s", "epoch_s", "img_per_s", "img_per_s_all", "accuracy",
            "final_loss", "compile_cache", "stages_s", "cudnn_warmup", "tiered")
    return {k: rec[k] for k in kept if k in rec}


# ------------------------------------------------------------------------------------------------ the call


def build_artifact(rung: str, dev, folder: str, steps: int, timeout_s: float, sets: list[str]) -> dict:
    """Build the project's artifact for `rung` in its own process, as `labkit compile-cache --build` does."""
    cmd = [sys.executable, "-m", "labkit", "compile-cache", "--build", "--rungs", rung, "--device", str(dev),
           "--steps", str(steps), "--dir", folder, "--set", *sets]
    with tempfile.TemporaryDirectory(prefix="labkit-cold-") as d:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=fresh_env(Path(d), folder), capture_output=True, text=True, timeout=timeout_s)
    path = CA.artifact_path(dev, folder)
    if r.returncode != 0 or not path.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LabkitError(f"building the compile-cache artifact failed (exit {r.returncode}): {tail[0]}")
    return {"build_s": time.perf_counter() - t0, "file": path.name, "bytes": path.stat().st_size,
            "command": " ".join(cmd[1:])}


def plan_jobs(rung: str, eager: list[str], variants: dict, parts: list[str]) -> list[tuple[str, str, dict]]:
    """One round: (label, kind, settings) for every run, the top rung's cold baseline first. With `run`, a variant
    of TrainConfig fields or environment variables alone (`runs_whole`) also runs whole, cold and with the
    artifact (its own where TrainConfig fields change: `measure` builds it); `warm` runs only the artifact's."""
    jobs = []
    if "first" in parts:
        jobs += [("first step, cold", "first", {}), ("first step, artifact", "first", {"artifact": True})]
        jobs += [(f"first step, {'artifact' if c.get('artifact') else 'cold'}, {v}", "first",
                  {"variant": v, **({"artifact": True} if c.get("artifact") else {})}) for v, c in variants.items()]
    if "run" in parts or "warm" in parts:
        cold = "run" in parts  # warm: the compiled rung's whole runs with the artifact only
        jobs += [(f"whole run {rung}, cold", "run", {"rung": rung})] * cold
        jobs += [(f"whole run {rung}, artifact", "run", {"rung": rung, "artifact": True})]
        for v, c in variants.items():
            if runs_whole(c):
                jobs += [(f"whole run {rung}, cold, {v}", "run", {"rung": rung, "variant": v})] * cold
                jobs += [(f"whole run {rung}, artifact, {v}", "run", {"rung": rung, "variant": v, "artifact": True})]
        jobs += [(f"whole run {e}", "run", {"rung": e}) for e in eager]
    return jobs


def changes_graph(rung: str, sets: list[str], more: list[str]) -> bool:
    """Whether TrainConfig changes `more` (on top of `sets`) change what `rung` compiles."""
    base = T.with_changes(T.preset(rung), **T.parse_sets(sets))
    return T.graph_key(T.with_changes(base, **T.parse_sets(more))) != T.graph_key(base)


def runs_whole(change: dict) -> bool:
    """Whether `labkit train` can run a variant whole: TrainConfig fields and the environment, nothing patched
    inside the process."""
    return bool(change.get("sets") or change.get("env")) and not any(
        change.get(k) for k in ("inductor", "dynamo", "warm_pool"))


def summarize(res: dict, rung: str, eager: list[str]) -> dict:
    """Medians of the runs that finished, and the issue's goals next to them."""
    def med(label, key):
        xs = [r[key] for r in res["jobs"].get(label, {}).get("runs", []) if key in r and "error" not in r]
        return statistics.median(xs) if xs else None

    def stages(label):  # medians of the record's stages, and the process's wall time beyond them (exit included)
        rs = [r for r in res["jobs"].get(label, {}).get("runs", []) if r.get("stages_s") and "wall_s" in r]
        if not rs:
            return None
        out = {k: statistics.median(r["stages_s"][k] or 0.0 for r in rs) for k in rs[0]["stages_s"]}
        out["after_result"] = statistics.median(r["wall_s"] - sum(v or 0.0 for v in r["stages_s"].values()) for r in rs)
        return out

    def run_walls(label):
        return [r["wall_s"] for r in res["jobs"][label]["runs"] if "wall_s" in r and "error" not in r]

    s = {"first_step_cold_s": med("first step, cold", "first_step_s"),
         "first_step_artifact_s": med("first step, artifact", "first_step_s"),
         "run_cold_wall_s": med(f"whole run {rung}, cold", "wall_s"),
         "run_artifact_wall_s": med(f"whole run {rung}, artifact", "wall_s"),
         "run_img_per_s": med(f"whole run {rung}, artifact", "img_per_s"),
         "run_accuracy": med(f"whole run {rung}, artifact", "accuracy"),
         "run_artifact_stages_s": stages(f"whole run {rung}, artifact"),
         "eager_wall_s": {e: med(f"whole run {e}", "wall_s") for e in eager},
         "variants_first_step_s": {k.split(", ", 2)[2]: med(k, "first_step_s") for k in res["jobs"]
                                   if k.startswith(("first step, cold, ", "first step, artifact, "))},
         "variants_whole_run": {}}
    for v, c in res.get("variants", {}).items():
        if runs_whole(c) and any(f"whole run {rung}, {how}, {v}" in res["jobs"] for how in ("cold", "artifact")):
            s["variants_whole_run"][v] = {
                "first_step_cold_s": med(f"whole run {rung}, cold, {v}", "first_step_s"),
                "first_step_artifact_s": med(f"whole run {rung}, artifact, {v}", "first_step_s"),
                "cold_wall_s": med(f"whole run {rung}, cold, {v}", "wall_s"),
                "artifact_wall_s": med(f"whole run {rung}, artifact, {v}", "wall_s"),
                "img_per_s": med(f"whole run {rung}, artifact, {v}", "img_per_s"),
                "accuracy": med(f"whole run {rung}, artifact, {v}", "accuracy"),
                "artifact_stages_s": stages(f"whole run {rung}, artifact, {v}")}
    walls = {e: w for e, w in s["eager_wall_s"].items() if w is not None}
    if walls:
        s["fastest_eager"] = min(walls, key=walls.get)
        if s["run_artifact_wall_s"] is not None:
            s["top_with_artifact_finishes_first"] = s["run_artifact_wall_s"] < walls[s["fastest_eager"]]
            # outside the noise only if the slowest artifact run beats the fastest eager run
            s["top_with_artifact_finishes_first_every_run"] = (max(run_walls(f"whole run {rung}, artifact"))
                                                               < min(run_walls(f"whole run {s['fastest_eager']}")))
        for w in s["variants_whole_run"].values():
            if w["artifact_wall_s"] is not None:
                w["finishes_first_with_artifact"] = w["artifact_wall_s"] < walls[s["fastest_eager"]]
    s["goals"] = {k: {"goal": g, "met": s[k] <= g} for k, g in GOALS.items() if s[k] is not None}
    return s


def measure(args, dev, variants: dict, bytecode: dict | None = None) -> dict:
    parts = args.parts.split(",")
    res = {"kind": "cold_start", "rung": args.rung, "eager": args.eager, "steps": args.steps, "epochs": args.epochs,
           "repeats": args.repeats, "sets": args.set, "variants": variants, "bytecode": bytecode, "jobs": {},
           "variant_artifacts": {}}
    jobs = plan_jobs(args.rung, args.eager, variants, parts)
    with tempfile.TemporaryDirectory(prefix="labkit-artifact-") as root:
        # the artifact holds compiled graphs for one config: a variant whose TrainConfig changes reach the graph
        # (T.GRAPH_FIELDS) needs its own
        folders = {None: str(Path(root) / "base")}
        folders.update({v: str(Path(root) / f"v{i}") for i, (v, c) in enumerate(variants.items())
                        if changes_graph(args.rung, args.set, c.get("sets", []))
                        and any(h.get("variant") == v and h.get("artifact") for _, _, h in jobs)})
        for v, folder in folders.items():
            sets = args.set + (variants[v]["sets"] if v else [])
            built = build_artifact(args.rung, dev, folder, args.steps, args.timeout, sets)
            if v is None:
                res["artifact"] = built
            else:
                res["variant_artifacts"][v] = built
            print(f"artifact for {args.rung}{', ' + v if v else ''}: {built['bytes'] / 1e6:.1f} MB, built in "
                  f"{built['build_s']:.1f} s", flush=True)
        for r in range(args.repeats):
            for label, kind, how in (jobs if r % 2 == 0 else jobs[::-1]):  # alternate: drift hits every job
                v = how.get("variant")
                art = folders.get(v, folders[None]) if how.get("artifact") else None
                if kind == "first":
                    rec = first_steps_job(args.rung, dev, args.steps, art, variants[v] if v else {}, args.timeout,
                                          args.set)
                else:
                    rec = whole_run_job(how["rung"], dev, args.epochs, art, args.timeout,
                                        args.set + (variants[v]["sets"] if v else []), variants[v]["env"] if v else None)
                res["jobs"].setdefault(label, {"kind": kind, **how, "runs": []})["runs"].append(rec)
                shown = rec.get("error") or (f"first step {rec['first_step_s']:6.2f} s, " if "first_step_s" in rec
                                             else "") + f"wall {rec.get('wall_s', 0):6.1f} s"
                print(f"round {r + 1}: {label:<44} {shown}", flush=True)
                res["summary"] = summarize(res, args.rung, args.eager)
                save_result("cold_start", res, out_dir=args.out, device=dev)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rung", default=T.RUNG_NAMES[-1], help=f"compiled rung to start cold (default {T.RUNG_NAMES[-1]})")
    ap.add_argument("--eager", default=",".join(EAGER), help=f"eager rungs to run whole (default {','.join(EAGER)})")
    ap.add_argument("--parts", default="first,run",
                    help="first (first steps), run (whole runs) or both; warm: whole runs with the artifact only")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every run (default 2; medians reported)")
    ap.add_argument("--steps", type=int, default=3, help="steps timed by a first-step run (default 3)")
    ap.add_argument("--epochs", type=int, default=5, help="epochs of a whole run (default 5)")
    ap.add_argument("--variants", action="store_true", help="also time the cold first step of each of VARIANTS")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="a variant of your own (env.NAME=V, inductor.KEY=V, dynamo.KEY=V, warm_pool=true)")
    add_set_argument(ap, "TrainConfig changes for every run and the artifact (e.g. batch_size=1024)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    ap.add_argument("--bytecode", choices=("installed", "as-found"), default="installed",
                    help="installed (default): every process finds torch's .pyc, as after pip or conda install, "
                         "even where this install has none; as-found: as this Python finds it")
    ap.add_argument("--device", default="auto", help="auto or cuda[:N]")
    ap.add_argument("--out", default=str(RESULTS_DIR / "coldstart"), help="results folder (default benchmarks/results/coldstart)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one first-steps run, started by first_steps_job
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    args.eager = [e.strip() for e in args.eager.split(",") if e.strip()]
    try:
        variants = dict(parse_variant(v) for v in args.variant)
        if args.variants:
            variants = {**{k: changes(v) for k, v in VARIANTS.items()}, **variants}
        check_args(args)
    except LabkitError as e:
        ap.error(str(e))
    dev = pick_device(args.device)
    if dev.type != "cuda":
        print(f"cold_start: needs a CUDA GPU ({args.rung} replays CUDA graphs); on {dev.type} nothing is measured "
              f"(skipped)")
        return 0
    T.plan_ladder(dev, quick=False, names=[args.rung, *args.eager])  # a rung this GPU cannot run fails here
    D.load("synthetic")  # generated and cached once, before the runs that read it
    with tempfile.TemporaryDirectory(prefix="labkit-pycache-") as pyc:
        code = installed_bytecode(args.bytecode, pyc)
        print(f"bytecode: {args.bytecode}; import torch {code['import_s'].get('torch_s')} s, torch.compile's "
              f"modules {code['import_s'].get('compiler_s')} s" + (
                  f" (without it: {code['import_s_without'].get('torch_s')} s and "
                  f"{code['import_s_without'].get('compiler_s')} s)" if "import_s_without" in code else ""), flush=True)
        res = measure(args, dev, variants, code)
    print(json.dumps(res["summary"], indent=2))
    return 0


def check_args(args) -> None:
    """Bad rungs, parts or counts fail before any run."""
    compiled = [n for n in T.RUNG_NAMES if T.preset(n).compile]
    if args.rung not in compiled:
        raise LabkitError(f"--rung {args.rung!r} does not compile: choose from {', '.join(compiled)}")
    for e in args.eager:
        if e not in T.RUNG_NAMES or T.preset(e).compile:
            raise LabkitError(f"--eager {e!r} is not an eager rung: choose from "
                              f"{', '.join(n for n in T.RUNG_NAMES if not T.preset(n).compile)}")
    if not set(args.parts.split(",")) <= {"first", "run", "warm"}:
        raise LabkitError(f"--parts {args.parts!r}: first, run or warm, or several with commas")
    T.parse_sets(args.set)
    if min(args.repeats, args.steps, args.epochs) < 1:
        raise LabkitError("--repeats, --steps and --epochs must be >= 1")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabkitError as e:
        sys.exit(f"cold_start: {e}")

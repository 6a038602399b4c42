"""Data-parallel training of a ladder rung with DistributedDataParallel, launched through torchrun.

    labkit ddp --preset cuda_graphs --nproc 2          # one process per GPU, NCCL
    labkit ddp --preset resident_data --nproc 2 --quick  # on CPU: gloo, the same code path
    labkit ddp --preset cuda_graphs --nproc 2 --scaling  # scaling efficiency: 1 and 2 GPUs, alternating
    labkit ddp --preset cuda_graphs --nproc 8 --nnodes 2 --rdzv-endpoint node0:29400   # on each of 2 machines

`labkit ddp` starts `torchrun --standalone --nproc_per_node N -m labkit.ddp --worker ...`; each worker joins
the process group, runs the same `labkit.train.train` engine (which shards the resident data per rank and seeds
augmentation per rank) and rank 0 writes the result record. The global batch stays `batch_size`: each of N
processes takes batch_size / N images per step, so the optimization is the one a single process would run.
NVLink multicast stays off in NCCL (NCCL_NVLS_ENABLE=0) in every launch.

Past one machine, one `labkit ddp` per machine starts its torchrun, and the torchruns meet through torchrun's own
rendezvous (`Nodes`): c10d (ranks in order of arrival) or static (`--node-rank` fixes each machine's ranks).
The global batch is still split by global rank, so each rank trains the shard it would on one machine with
as many processes. docs/multinode.md has a Slurm script that starts one launcher per node.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from labkit.env import LabkitError, environment, pick_device
from labkit.presets import add_set_argument


def _worker(args) -> int:
    import torch.distributed as dist

    from labkit import train as T
    from labkit.bench import write_json

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        dev = torch.device("cuda", local) if cuda else torch.device("cpu")
        base = T.quick_base() if args.quick else T.TrainConfig()
        cfg = T.with_changes(T.preset(args.preset, base), **T.parse_sets(args.set))
        if not cuda:
            cfg = T.with_changes(cfg, precision="default" if cfg.precision == "bf16" else cfg.precision)
        if args.profile:  # every rank runs the profiled steps (they all-reduce together); rank 0 keeps its trace
            _profile_worker(cfg, dev, args.profile)
        else:
            rec = T.train(cfg, dev)
            if args.rank_facts:  # a file per rank, no extra collective: a slow or badly bound rank shows up there
                write_json(os.path.join(args.rank_facts, f"rank{dist.get_rank()}.json"), _rank_facts(rec, dev))
            if dist.get_rank() == 0:
                print(f"{cfg.name} on {dist.get_world_size()} processes: {rec['img_per_s']:,.0f} img/s, "
                      f"final loss {rec['final_loss']:.3f}, accuracy {rec['accuracy']}", flush=True)
                if args.json:
                    write_json(args.json, {"kind": "ddp", "env": environment(device=dev), **rec})
        # Ranks leave together: a rank that tears its process group down while rank 0 is still writing (a trace
        # export takes seconds) has been seen to abort at exit with gloo.
        dist.barrier()
    except LabkitError as e:
        print(f"labkit ddp: error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] as "0-2,5" (how taskset and numactl write CPU sets)."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def _rank_facts(rec: dict, dev: torch.device) -> dict:
    """What one rank saw of its own run: its epoch times (seconds), the CPUs it may run on, its threads."""
    import torch.distributed as dist

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {"rank": dist.get_rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "device": str(dev),
            "epoch_s": rec.get("epoch_s"), "cpus": _cpu_ranges(cpus), "cpu_count": len(cpus),
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _profile_worker(cfg, dev, out: str) -> None:
    import torch.distributed as dist

    from labkit import profiling as P
    from labkit.bench import write_json

    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"{cfg.name}-ddp{world}"
    prof = P.profile_steps(cfg, dev, out=out if rank == 0 else None, name=name)
    if rank == 0:
        d = prof.diagnose()
        write_json(os.path.join(out, f"{name}.diagnosis.json"), {"env": environment(device=dev), **d.to_dict()})
        # the diagnosis notes NCCL all-reduce time itself; gloo's runs on the CPU, outside the GPU trace
        gloo = "comm_ms_per_step" not in d.evidence
        print(f"{name}:" + (" no all-reduce kernels in the trace (gloo all-reduces on the CPU)" if gloo else "")
              + f"\n{d}\nwrote {prof.trace_path}", flush=True)


RDZV_BACKENDS = ("c10d", "static")


@dataclass
class Nodes:
    """Where the processes of one run live: this machine alone, or several machines meeting through torchrun."""

    nnodes: int = 1                      # machines in the run, each starting `labkit ddp` with the same settings
    node_rank: int | None = None         # this machine's index, 0..nnodes-1 (static rendezvous); None: c10d assigns it
    rdzv_endpoint: str | None = None     # HOST:PORT that every machine reaches (node 0 / the store's host); None: one machine
    rdzv_backend: str | None = None      # c10d | static; None: static when node_rank is given, else c10d
    rdzv_id: str | None = None           # job id, the same on every machine (e.g. $SLURM_JOB_ID); None: "labkit"

    @property
    def standalone(self) -> bool:
        """One machine with a private rendezvous (torchrun --standalone)."""
        return self.nnodes == 1 and self.rdzv_endpoint is None


def torchrun_args(nodes: Nodes) -> list[str]:
    """torchrun's rendezvous flags for `nodes`; bad combinations raise a one-line LabkitError before any work."""
    if nodes.nnodes < 1:
        raise LabkitError(f"--nnodes must be >= 1, not {nodes.nnodes}")
    if nodes.node_rank is not None and not 0 <= nodes.node_rank < nodes.nnodes:
        raise LabkitError(f"--node-rank {nodes.node_rank} is outside 0..{nodes.nnodes - 1} (--nnodes {nodes.nnodes})")
    if nodes.standalone:
        if nodes.rdzv_backend is not None or nodes.rdzv_id is not None or nodes.node_rank:
            raise LabkitError("--rdzv-backend, --rdzv-id and --node-rank need --rdzv-endpoint HOST:PORT "
                              "(one machine alone needs none of them)")
        return ["--standalone"]
    if nodes.rdzv_endpoint is None:
        raise LabkitError(f"--nnodes {nodes.nnodes} needs --rdzv-endpoint HOST:PORT, an address every machine "
                          f"reaches (node 0's, e.g. the first host of the Slurm job)")
    host, sep, port = nodes.rdzv_endpoint.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise LabkitError(f"--rdzv-endpoint {nodes.rdzv_endpoint!r}: write HOST:PORT, e.g. node0:29400")
    backend = nodes.rdzv_backend or ("static" if nodes.node_rank is not None else "c10d")
    if backend not in RDZV_BACKENDS:
        raise LabkitError(f"--rdzv-backend {backend!r}: choose {' or '.join(RDZV_BACKENDS)}")
    if backend == "static" and nodes.node_rank is None:
        raise LabkitError("static rendezvous needs --node-rank (0 on the machine at --rdzv-endpoint)")
    if backend == "c10d" and nodes.node_rank is not None:
        raise LabkitError("c10d rendezvous numbers the machines itself: drop --node-rank, "
                          "or keep it with --rdzv-backend static")
    run_id = nodes.rdzv_id if nodes.rdzv_id is not None else "labkit"
    if not run_id or any(c.isspace() for c in run_id):
        raise LabkitError(f"--rdzv-id {run_id!r}: one word, the same on every machine (e.g. the Slurm job id)")
    args = [f"--nnodes={nodes.nnodes}", f"--rdzv-backend={backend}", f"--rdzv-endpoint={nodes.rdzv_endpoint}",
            f"--rdzv-id={run_id}"]
    return args + ([f"--node-rank={nodes.node_rank}"] if backend == "static" else [])


NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")  # torchrun --numa-binding's modes
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def split_changes(changes: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """A variant's changes as (TrainConfig FIELD=VALUE sets, environment for the launch, torchrun flags).

    Besides TrainConfig fields, a change may be env.NAME=VALUE (an environment variable of every process, e.g.
    env.OMP_NUM_THREADS=4 or env.NCCL_ALGO=Ring) or launch.numa_binding=MODE (torchrun binds each worker to
    the CPUs near its GPU). Bad names fail here with one line, before any process starts.
    """
    from labkit import train as T

    sets, env, flags = [], {}, []
    for c in changes:
        key, sep, value = c.partition("=")
        where, dot, name = key.partition(".")
        if not sep:
            raise LabkitError(f"change {c!r}: write FIELD=VALUE, env.NAME=VALUE or launch.numa_binding=MODE")
        if dot and where == "env":
            if not _ENV_NAME.fullmatch(name):
                raise LabkitError(f"change {c!r}: an environment variable name is upper case, e.g. env.OMP_NUM_THREADS=4")
            env[name] = value
        elif dot and where == "launch":
            if name != "numa_binding" or value not in NUMA_BINDINGS:
                raise LabkitError(f"change {c!r}: the launcher takes launch.numa_binding="
                                  f"{' | '.join(NUMA_BINDINGS)}")
            flags.append(f"--numa-binding={value}")
        else:
            sets.append(c)
    T.parse_sets(sets)  # a typo in a TrainConfig field fails here too
    return sets, env, flags


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"LABEL:CHANGE[,CHANGE]" (each CHANGE as `split_changes` reads it) as (label, [CHANGE, ...])."""
    from labkit import train as T

    return T.parse_variant(text, check=split_changes)


def launch(preset: str, nproc: int, *, quick: bool = False, sets: list[str] | None = None,
           json_path: str | None = None, cpu: bool = False, timeout_s: float | None = None,
           profile_dir: str | None = None, nodes: Nodes | None = None, env: dict[str, str] | None = None,
           torchrun_flags: list[str] | None = None, rank_facts_dir: str | None = None) -> int:
    """Run `preset` on `nproc` processes through torchrun; returns torchrun's exit code.
    With `profile_dir`, profile a few steps instead (rank 0 writes its trace and diagnosis there).
    With `nodes`, this machine is one of several: `nproc` processes here, the run's rank 0 writes `json_path`
    on whichever machine holds it (node 0 under static rendezvous). `env` adds environment variables to every
    process; `torchrun_flags` adds launcher flags (e.g. --numa-binding=node). With `rank_facts_dir`, every rank
    on this machine writes rank<N>.json there (`_rank_facts`: its epoch times, CPU set and threads)."""
    from labkit import train as T

    if nproc < 1:
        raise LabkitError("--nproc must be >= 1")
    rdzv = torchrun_args(nodes or Nodes())
    T.preset(preset)  # unknown names fail here, before any process starts
    T.parse_sets(sets or [])
    use_cuda = torch.cuda.is_available() and not cpu
    if use_cuda and nproc > torch.cuda.device_count():
        raise LabkitError(f"--nproc {nproc} but this machine has {torch.cuda.device_count()} GPU(s)")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, *(torchrun_flags or []), f"--nproc_per_node={nproc}",
           "-m", "labkit.ddp", "--worker", "--preset", preset]
    cmd += ["--quick"] if quick else []
    cmd += ["--cpu"] if cpu else []
    cmd += ["--json", json_path] if json_path else []
    cmd += ["--profile", profile_dir] if profile_dir else []
    cmd += ["--rank-facts", rank_facts_dir] if rank_facts_dir else []
    cmd += ["--set", *sets] if sets else []
    run_env = dict(os.environ, **(env or {}), NCCL_NVLS_ENABLE="0")
    if not use_cuda:
        run_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        return subprocess.run(cmd, env=run_env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired as e:
        raise LabkitError(f"the {nproc}-process run took longer than {timeout_s:.0f} s") from e
    # (a machine whose peers never join waits in torchrun's rendezvous until torchrun gives up, then exits non-zero)


def scaling(preset: str = "cuda_graphs", nproc: int = 2, *, repeats: int = 2, strong: bool = True,
            quick: bool = False, sets: list[str] | None = None, variants: dict[str, list[str]] | None = None,
            cpu: bool = False, timeout_s: float | None = 600, on_run=None) -> dict:
    """Scaling efficiency from 1 to `nproc` processes, measured by alternating runs in this one call.

    Weak scaling keeps each process's batch at the preset's `batch_size` (the global batch grows N-fold):
    efficiency = img/s on N / (N x img/s on 1), the usual yardstick (1.0 is linear). Strong scaling keeps the
    global batch and splits it, so each GPU gets less work per step and the all-reduce weighs more.
    Runs alternate 1, N, 1, N, ... so drift on the machine hits both sides; medians are reported.
    `variants` ({label: FIELD=VALUE changes}) adds N-process runs with other DDP settings to every round
    (1, N, N variant a, N variant b, 1, N, ...), each compared with the same 1-process runs.
    A variant's changes may also set the launch's environment or bind workers to CPUs (`split_changes`).
    Returns {"runs": [...], "weak_efficiency", "weak_efficiency_rounds", "strong_efficiency", "img_per_s": {...},
    "variants": {...}} (img/s: steady state; the headline numbers are the runs without variant changes;
    "weak_efficiency_rounds" pairs each round's N-process run with that round's 1-process run, for the spread).
    Each run's record keeps every rank's epoch times, CPU set and threads ("ranks"). `on_run(runs)` is called
    after every finished run, so a caller can save what was measured before a call is cut short.
    """
    import json
    import statistics
    import tempfile
    from pathlib import Path

    from labkit import train as T

    base = T.with_changes(T.preset(preset, T.quick_base() if quick else T.TrainConfig()), **T.parse_sets(sets or []))
    sets = list(sets or [])
    variants = dict(variants or {})
    split = {v: split_changes(c) for v, c in variants.items()}  # bad names fail here, before any process starts
    for v, (v_sets, _, flags) in split.items():
        T.with_changes(base, **T.parse_sets(v_sets))
        if flags and (cpu or not torch.cuda.is_available()):
            raise LabkitError(f"variant {v!r}: launch.numa_binding binds each worker to its GPU's CPUs, so it needs "
                              f"GPUs; drop it for a CPU run")
    rnd = [(1, base.batch_size, "weak", None), (nproc, nproc * base.batch_size, "weak", None)]
    rnd += [(nproc, nproc * base.batch_size, "weak", v) for v in variants]
    plan = rnd * repeats + ([(nproc, base.batch_size, "strong", None)] if strong else [])
    from tqdm.auto import tqdm

    runs, failed = [], {}
    with tempfile.TemporaryDirectory(prefix="labkit-ddp-") as d:
        for i, (n, batch, kind, v) in enumerate(tqdm(plan, desc=f"{preset}: 1 vs {nproc} processes", unit="run")):
            if v in failed:
                continue
            out, facts = Path(d) / f"run{i}.json", Path(d) / f"ranks{i}"
            facts.mkdir()
            extra, env, flags = split[v] if v else ([], {}, [])
            started = time.time()
            for attempt in range(2):  # once more after a failure: a launch that failed once on a busy machine has been seen
                rc = launch(preset, n, quick=quick, sets=sets + extra + [f"batch_size={batch}"],
                            json_path=str(out), cpu=cpu, timeout_s=timeout_s, env=env, torchrun_flags=flags,
                            rank_facts_dir=str(facts))
                if rc == 0 and out.exists():
                    break
                print(f"the {n}-process run{' (' + v + ')' if v else ''} failed (exit {rc})"
                      + ("; trying it once more" if attempt == 0 else ""), file=sys.stderr, flush=True)
            if rc != 0 or not out.exists():
                msg = (f"the {n}-process run of {preset} (global batch {batch}{', ' + v if v else ''}) failed "
                       f"(exit {rc}); its error is printed above")
                if not v:
                    raise LabkitError(msg)
                failed[v] = msg  # a variant that cannot run is reported; the measurement goes on without it
                continue
            rec = json.loads(out.read_text())
            kept = ("img_per_s", "steps", "images", "epoch_s", "first_step_s", "accuracy", "final_loss", "device")
            runs.append({"processes": n, "global_batch": batch, "scaling": kind, **({"variant": v} if v else {}),
                         "round": i // len(rnd) if kind == "weak" else None, **{k: rec[k] for k in kept},
                         "started": started, "ended": time.time(),  # Unix seconds: the launch, retries included
                         "ranks": [json.loads(f.read_text()) for f in sorted(facts.glob("rank*.json"),
                                                                            key=lambda f: int(f.stem[4:]))]})
            if on_run is not None:
                on_run(runs)

    def med(n, kind, v=None):
        x = [r["img_per_s"] for r in runs if r["processes"] == n and r["scaling"] == kind and r.get("variant") == v]
        return statistics.median(x) if x else None

    one, weak, strong_v = med(1, "weak"), med(nproc, "weak"), med(nproc, "strong")
    return {"preset": preset, "nproc": nproc, "per_process_batch": base.batch_size, "runs": runs,
            "img_per_s": {"1": one, f"{nproc} weak": weak, f"{nproc} strong": strong_v},
            "weak_efficiency": weak / (nproc * one), "weak_efficiency_rounds": round_efficiencies(runs, nproc),
            "strong_efficiency": strong_v / (nproc * one) if strong_v else None,
            "variants": {v: {"changes": c, "error": failed[v]} if v in failed else
                         {"changes": c, "img_per_s": med(nproc, "weak", v),
                          "weak_efficiency": med(nproc, "weak", v) / (nproc * one),
                          "weak_efficiency_rounds": round_efficiencies(runs, nproc, v)} for v, c in variants.items()}}


def round_efficiencies(runs: list[dict], nproc: int, variant: str | None = None) -> list[float]:
    """Weak-scaling efficiency of each round: its N-process run (of `variant`) against its own 1-process run."""
    out = []
    for r in sorted({x["round"] for x in runs if x.get("round") is not None}):
        one = [x["img_per_s"] for x in runs if x["round"] == r and x["processes"] == 1]
        many = [x["img_per_s"] for x in runs if x["round"] == r and x["processes"] == nproc
                and x["scaling"] == "weak" and x.get("variant") == variant]
        if one and many:
            out.append(many[0] / (nproc * one[0]))
    return out


def add_cli(sub) -> None:
    p = sub.add_parser("ddp", help="train a ladder rung on several processes with DistributedDataParallel")
    p.add_argument("--preset", default="cuda_graphs", help="ladder rung (its loader must be resident)")
    p.add_argument("--nproc", type=int, default=2, help="processes: one per GPU, or CPU processes with gloo")
    p.add_argument("--quick", action="store_true", help="small CPU-sized run")
    p.add_argument("--cpu", action="store_true", help="use gloo on the CPU even where GPUs exist")
    add_set_argument(p)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the result record here (with --scaling: the summary)")
    m = p.add_argument_group("several machines (run the same command on each; see docs/multinode.md)")
    m.add_argument("--nnodes", type=int, default=1, help="machines in the run (default 1)")
    m.add_argument("--node-rank", type=int, help="this machine's index 0..NNODES-1 (static rendezvous)")
    m.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address every machine reaches")
    m.add_argument("--rdzv-backend", choices=RDZV_BACKENDS,
                   help="c10d (machines numbered on arrival) or static (needs --node-rank); default: static "
                        "with --node-rank, else c10d")
    m.add_argument("--rdzv-id", help="job id, the same on every machine (default: labkit)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--scaling", action="store_true",
                     help="measure scaling efficiency: alternate 1 and NPROC processes, same per-process batch")
    how.add_argument("--profile", metavar="DIR",
                     help="profile a few steps; rank 0 writes its trace and diagnosis (all-reduce time) to DIR")
    p.set_defaults(func=_cli)


def _cli(a) -> int:
    nodes = Nodes(a.nnodes, a.node_rank, a.rdzv_endpoint, a.rdzv_backend, a.rdzv_id)
    if not a.scaling:
        return launch(a.preset, a.nproc, quick=a.quick, sets=a.set, json_path=a.json, cpu=a.cpu,
                      profile_dir=a.profile, nodes=nodes)
    if nodes != Nodes():
        raise LabkitError("--scaling compares 1 and NPROC processes on this one machine: drop --nnodes, "
                          "--node-rank and --rdzv-* (or run it on each machine alone)")
    from labkit.bench import write_json

    r = scaling(a.preset, a.nproc, quick=a.quick, sets=a.set, cpu=a.cpu)
    b, n, ips = r["per_process_batch"], a.nproc, r["img_per_s"]
    print(f"1 process, batch {b}: {ips['1']:,.0f} img/s")
    print(f"{n} processes, batch {b} each (global {n * b}): {ips[f'{n} weak']:,.0f} img/s")
    if ips[f"{n} strong"]:
        print(f"{n} processes, global batch {b} ({b // n} each): {ips[f'{n} strong']:,.0f} img/s")
    print(f"scaling efficiency 1 -> {n}: weak {100 * r['weak_efficiency']:.1f}% (batch {b} per process)"
          + (f", strong {100 * r['strong_efficiency']:.1f}% (global batch {b})" if r["strong_efficiency"] else ""))
    if a.json:
        write_json(a.json, {"kind": "ddp_scaling", "env": environment(device=pick_device("cpu" if a.cpu else "auto")),
                            **r})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="run as one torchrun worker (set by `labkit ddp`)")
    ap.add_argument("--preset", default="cuda_graphs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--profile")
    ap.add_argument("--rank-facts")
    add_set_argument(ap)
    args = ap.parse_args(argv)
    if not args.worker:
        ap.error("run through `labkit ddp`, which starts torchrun")
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())

"""Warm starts: compile the ladder's compiled rungs once and save that work as this card's artifact.

`labkit compile-cache --build` runs the first steps of each compiled rung from an empty cache folder, so every
graph and kernel is compiled and recorded, and saves them with `labkit.faststart.compile_artifacts` (the file format,
loading and its fallbacks live there); `labkit ladder` and `labkit train` load the artifact before training.
Beside it goes each rung's forward saved whole (`labkit.faststart.precompiled`), which `labkit train` runs instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from labkit.bench import compile_cache, unwritable
from labkit.env import LabkitError, pick_device
from labkit.faststart import compile_artifacts as CA
from labkit.faststart import precompiled as P
from labkit.presets import add_set_argument


def build(device=None, names: list[str] | None = None, *, quick: bool = False, steps: int = 3,
          folder: str | os.PathLike | None = None, sets: list[str] | None = None, log=print) -> Path | None:
    """Compile the first `steps` steps of each compiled ladder rung that runs on `device`, from an empty cache
    folder (so every graph and kernel is compiled and recorded), and save them as this card's artifact.

    The rungs are sized as `labkit ladder` (and `labkit train --preset`) sizes them, `quick` as with --quick:
    a compiled graph is only found again for the same model, batch and settings, so `sets` (FIELD=VALUE) must
    be the changes the training command will make. Returns the artifact's path.
    """
    from labkit import data as D
    from labkit import train as T

    dev = pick_device(device)
    compiled = [n for n in T.RUNG_NAMES if T.preset(n).compile]
    for n in names or []:
        if n not in compiled:
            raise LabkitError(f"{n!r} is not a compiled rung: choose from {', '.join(compiled)}")
    if steps < 1:
        raise LabkitError("--steps must be >= 1")
    changes = T.parse_sets(sets or [])
    plan = T.plan_ladder(dev, quick, names or compiled)
    path = CA.artifact_path(dev, folder)
    bad = unwritable(path.parent)
    if bad:  # minutes of compiling would be lost
        raise LabkitError(f"{path.parent} cannot be written ({bad}): choose another folder with --dir")
    for name, why in plan.skipped:
        log(f"compile cache: skipped {name}: {why}")
    ds = D.load(changes.get("data", plan.base.data))  # train() takes its subset
    with compile_cache() as kernels_in:
        for cfg in plan.rungs:
            t0 = time.perf_counter()
            T.train(T.with_changes(cfg, **{**changes, "epochs": 1, "max_steps": steps, "evaluate": False}), dev,
                    dataset=ds)
            log(f"compile cache: compiled {cfg.name} ({steps} steps) in {time.perf_counter() - t0:.1f} s")
        note = {"rungs": [c.name for c in plan.rungs], "quick": quick, "steps": steps, "sets": sets or [],
                "graphs": [T.graph_key(T.with_changes(c, **changes)) for c in plan.rungs],
                "kernels_in": kernels_in}  # cached kernels keep this path: see CA.place_autotune_results
        saved = CA.save(dev, folder, note=note, say=log)
        if saved:
            log(f"compile cache: wrote {saved} ({saved.stat().st_size / 1e6:.1f} MB)")
            _precompile([T.with_changes(c, **changes) for c in plan.rungs], dev, ds, folder, log)
    return saved


def precompile(cfg, dev, dataset, folder=None, say=print):
    """Compile `cfg`'s forward (and backward) for its micro-batch on `dev` and save it whole for later runs
    (`labkit.faststart.precompiled`); returns the file, or None with one line saying why. Compiles nothing else.
    `dataset` (a `labkit.data.ImageData`) gives the image shape and classes; the model is the one `train()` builds,
    under its switches."""
    import torch

    from labkit import data as D
    from labkit import train as T

    model, _, _ = T._build_model(cfg, dataset.num_classes, dev)
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    image = D.to_nchw_uint8(dataset.x_train[:1], dev).shape[1:]  # the step's input: normalized float32, this shape
    x = torch.zeros((T.micro_batch(cfg, T.world()[1]), *image), device=dev).contiguous(memory_format=fmt)
    with T._switches(cfg):
        return P.build(cfg, model.train(), x, T.graph_key(cfg), folder, say=say)


def _precompile(configs, dev, ds, folder, log) -> None:
    """Save each rung's compiled forward whole beside the artifact (`labkit.faststart.precompiled`), where it applies."""
    for cfg in configs:
        if not P.applies(cfg, dev):
            continue
        t0 = time.perf_counter()
        path = precompile(cfg, dev, ds, folder, say=log)
        if path:
            log(f"compile cache: wrote {path.name} for {cfg.name} in {time.perf_counter() - t0:.1f} s "
                f"({path.stat().st_size / 1e6:.1f} MB)")


def add_cli(sub) -> None:
    p = sub.add_parser("compile-cache", help="save torch.compile's work once per card and torch version, "
                                             "or show whether this machine has it")
    p.add_argument("--build", action="store_true", help="compile the compiled rungs' first steps and save them")
    p.add_argument("--rungs", help="comma-separated compiled rungs to build (default: all that run here)")
    p.add_argument("--quick", action="store_true", help="build for --quick runs (the CPU-sized model)")
    p.add_argument("--steps", type=int, default=3, help="steps compiled per rung (default 3)")
    add_set_argument(p, "TrainConfig changes the training command will make (batch, width...)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dir", help="artifact folder (default: $LABKIT_COMPILE_CACHE, else ~/.cache/labkit/compile-cache)")
    p.set_defaults(func=_cli)


def _cli(a) -> int:
    dev = pick_device(a.device)
    if a.build:
        names = [n.strip() for n in a.rungs.split(",") if n.strip()] if a.rungs else None
        return 0 if build(dev, names, quick=a.quick, steps=a.steps, folder=a.dir, sets=a.set) else 1
    state, why, header = CA.check(dev, a.dir)
    print(f"{CA.artifact_path(dev, a.dir)}: {state}" + (f" ({why})" if why else ""))
    if header and state == "ok":
        rungs = ", ".join(header.get("note", {}).get("rungs", [])) or "?"
        print(f"  {header['bytes'] / 1e6:.1f} MB, built {header.get('built')} at commit "
              f"{str(header.get('git_commit'))[:12]} for rungs {rungs}")
        saved = sorted(CA.artifact_path(dev, a.dir).parent.glob(f"{CA.artifact_stem(dev)}.*{P.SUFFIX}"))
        print(f"  {len(saved)} precompiled forward(s) beside it (labkit.faststart.precompiled)"
              + ("" if P.loadable() else ": this torch cannot load them"))
    return 0 if state == "ok" else 1


def build_forward(spec: dict) -> int:
    """`python -m labkit.faststart.warmstart SPEC`, the tiered start's child (`labkit.faststart.tiered`): compile
    the forward of SPEC's config and save it in SPEC's folder, with the artifact's graphs if there are any. Exit 0
    when saved."""
    import torch

    from labkit import data as D
    from labkit import train as T

    os.nice(10)  # the training process beside it comes first
    cfg, dev = T.TrainConfig(**spec["config"]), torch.device(spec["device"])
    CA.load(dev, spec["artifact_folder"], graphs=[spec["graph"]], say=lambda m: None)
    ds = D.load(cfg.data, 64, 64, seed=0)  # only its image shape and classes are read
    return 0 if precompile(cfg, dev, ds, spec["folder"]) else 1


if __name__ == "__main__":
    sys.exit(build_forward(json.loads(sys.argv[1])))

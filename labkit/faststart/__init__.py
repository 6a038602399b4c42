"""The top rung's fast start: what shortens a compiled run's first seconds, kept apart from the course's loop.

A compiled rung's first step waits for torch.compile: tens of seconds on a machine with nothing cached, most of a
short run. The course's modules teach what makes each step fast; this package is the research that made the
start fast too, measured in `benchmarks/cold_start.py` and written up in docs/results/ (coldstart.md, log.md):

- `compile_artifacts`: torch.compile's graphs and kernels saved once per card and torch version (the compile-cache
  artifact), loaded before compiling again;
- `precompiled`: the compiled forward saved whole, dynamo's trace included, loaded instead of traced;
- `tiered`: eager steps while that forward loads (or compiles in a child process) beside the run, then the switch;
- `cudnn_warmup`: cuDNN's backward convolution algorithms timed in a thread while the process loads;
- `warmstart`: `labkit compile-cache`, which builds the artifact and the saved forwards, and the tiered start's
  compiling child (`python -m labkit.faststart.warmstart`).

The one rule: labkit's course modules reach this package only through `labkit.train`, and train only through
the names in `__all__`: `start` (a training command's cold start, one call, whose result `train()` takes),
`add_flag` (the commands' --no-compile-cache) and `load_artifact` (the ladder loads the artifact before its
runs). The modules here may import labkit's core (env, bench, presets, models, data, train); the core never
imports them. `labkit.cli` names `warmstart` as the module of `labkit compile-cache`, by name, and imports it
only when that command runs. tests/test_imports.py checks all of it.

`labkit.gpu_power` is not here, though it came with this work: it is a measurement a student reads (week 2's
notebook reads the card's clock, power and their limits with it; `labkit.profiling` records them and
`labkit.diagnosis` reports them with its diagnosis), and `train()` reads it through the steady epochs of
every rung, not only at the top rung's start. It stays in the core, flat beside profiling.

Importing this package starts nothing (no thread, no process, no file read): `start` does, when called.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from labkit.faststart import compile_artifacts as CA
from labkit.faststart import cudnn_warmup as CW
from labkit.faststart import precompiled as P
from labkit.faststart import tiered as TI
from labkit.presets import TrainConfig, with_changes

__all__ = ["ColdStart", "add_flag", "load_artifact", "start"]


@dataclass
class ColdStart:
    """What `start` readied for one run: `train(cold.cfg, device, **cold.train_args())` takes it, and `close()`
    ends it when the run ends (also when it fails)."""

    cfg: TrainConfig                 # the run's config, its cudnn_warmup decided (None: on where it starts tiered)
    warmup: CW.Warmup | None         # cuDNN timing backward convolutions beside the loading, or None
    precompiled: object | None       # the saved forward loaded (`precompiled.load`), run instead of torch.compile
    tier: TI.Tier | None             # the compiled forward on its way, the steps eager until it is ready
    compile_cache: dict | None       # what loading the compile-cache artifact reported, or None (not loaded)
    loading_began: float             # time.perf_counter() when the loading began (after the warm-up started)

    def train_args(self) -> dict:
        """The keyword arguments of `labkit.train.train` that hand it this start."""
        return {"warmup": self.warmup, "precompiled": self.precompiled, "tier": self.tier}

    def close(self) -> dict | None:
        """Stop a compile still running beside the run; the tiered start's report (the record's `tiered`), or
        None where the run did not start tiered."""
        return self.tier.close() if self.tier is not None else None


def start(cfg: TrainConfig, device, graph: dict, args=None, *, world_size: int = 1) -> ColdStart:
    """Ready a run of `cfg` on `device` (a torch.device) to start fast; `graph`: `labkit.train.graph_key(cfg)`.

    `args`: a training command's options (`--no-compile-cache`, `add_flag`). With them, the command's cold start:
    where the run starts tiered (`tiered.applies`: a compiled rung on a GPU) the compiled forward loads or
    compiles beside it and the cuDNN warm-up is on unless `cfg` says otherwise; elsewhere the saved forward is
    loaded, else the compile-cache artifact. Without them (`train()` called with nothing readied) only the cuDNN
    warm-up starts, where `cfg.cudnn_warmup` asks for it. `world_size`: processes training together (a saved
    forward and the tiered start are single-process only).
    """
    if args is None:
        return ColdStart(cfg, CW.start(cfg, device, world_size), None, None, None, time.perf_counter())
    tiered = not args.no_compile_cache and TI.applies(cfg, device, world_size)
    if cfg.cudnn_warmup is None:  # it shortened the tiered top rung's whole run; elsewhere it was within noise
        cfg = with_changes(cfg, cudnn_warmup=tiered)
    warmup = CW.start(cfg, device, world_size)  # cuDNN times backward convolutions while the rest loads
    began = time.perf_counter()
    tier = TI.start(cfg, device, graph, world_size=world_size) if tiered else None
    pre = loaded = None
    if tier is None:  # the saved forward needs no artifact: nothing else in the run compiles
        pre = None if args.no_compile_cache else P.load(cfg, device, graph, world_size=world_size)
        loaded = None if pre else CA.load_for_cli(args, device, [graph] if cfg.compile else [])
    return ColdStart(cfg, warmup, pre, tier, loaded, began)


def add_flag(parser) -> None:
    """The --no-compile-cache switch of the commands that load torch.compile's saved work before training."""
    CA.add_flag(parser)


def load_artifact(args, device, graphs: list[dict]) -> dict | None:
    """Load the compile-cache artifact before a command's runs (`graphs`: `labkit.train.graph_key` of each
    compiled config it runs), unless --no-compile-cache or nothing compiles; what the load reported, or None."""
    return CA.load_for_cli(args, device, graphs)

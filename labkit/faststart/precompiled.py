"""The compiled rung's forward saved whole, dynamo's trace included, and loaded instead of compiled.

    labkit compile-cache --build        # also writes <card>-torch<version>.<graph>.forward per compiled rung
    labkit train --preset muon          # runs the rung's forward from that file when one fits

The compile-cache artifact (`labkit.faststart.compile_artifacts`) holds inductor's graphs and kernels, but torch.compile
still traces the model with dynamo in the first step to find them: it runs the model's Python symbolically, builds
guards and looks the graph up, 2.4-2.7 s of the top rung's first step (cold_start_bytecode.json).
`torch.compile(fn, fullgraph=True).aot_compile(example)` does all of that once and returns a callable, forward and
backward, that `save_compiled_function` writes and `torch.compiler.load_compiled_function` reads back in a new
process with no trace and no cache lookup. torch 2.11 has it behind `torch._dynamo.config.enable_aot_compile`.

The saved function is `forward(model, x)` with the rung's autocast inside it, so it is called outside autocast and
its guards (checked at every call) see the tensors as they were at the build. A file is used only where it was
built for this card, torch version, graph (`labkit.train.graph_key`) and model code (`code_version`), in a single
process (DDP wraps the model), without checkpointing, and not with `compile_tuning`: a loaded function's kernels
ran their coordinate-descent tuning again at the first call, 133 s of one run, and another such run crashed
(cold_start_tuned_edges_h200.json, cold_start_tuned_artifact_h200.json), so that config compiles as usual.
A missing file means the artifact path, silently; a stale, corrupt or unloadable one the same, with one line saying
why. `LABKIT_PRECOMPILED=0` turns the file off (to measure the artifact path beside it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from labkit.env import error_line, git_commit
from labkit.faststart import compile_artifacts as CA
from labkit.presets import GRAPH_MODES, TrainConfig

MAGIC = b"labkit precompiled forward v1\n"  # then one line of JSON (the header), then torch's saved function
SUFFIX = ".forward"


# One module-level function per autocast: the saved function refers to its code and globals by name, so it must
# be importable in the loading process (no closures).
def forward(model, x):
    return model(x)


def forward_cuda_bf16(model, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(x)


def forward_cuda_fp16(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x)


def forward_cpu_bf16(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


FORWARDS = {("cuda", "bf16"): forward_cuda_bf16, ("cuda", "fp16"): forward_cuda_fp16,
            ("cpu", "bf16"): forward_cpu_bf16}


def forward_for(cfg: TrainConfig, device: torch.device):
    """The function to compile for `cfg` on `device`: the model's forward under the config's autocast."""
    if cfg.precision in ("bf16", "fp16"):
        return FORWARDS.get((device.type, cfg.precision))
    return forward


def code_version() -> str:
    """A hash of the code the saved function was traced from (the model's module and this one). Loading skips the
    trace, so a file built before that code changed would run the old model: it is stale instead."""
    from labkit import models

    blob = b"".join(Path(m.__file__).read_bytes() for m in (models, sys.modules[__name__]))
    return hashlib.sha256(blob).hexdigest()[:16]


def supported() -> bool:
    """Whether this torch can save and load a compiled function (torch 2.11+)."""
    import torch._dynamo.config as dynamo_config

    return hasattr(dynamo_config, "enable_aot_compile") and loadable()


def loadable() -> bool:
    """Whether this torch can load a saved compiled function: asked without importing dynamo (seconds), which
    a run that loads one imports beside its training (`labkit.faststart.tiered`)."""
    return hasattr(torch.compiler, "load_compiled_function")


def applies(cfg: TrainConfig, device: torch.device, world_size: int = 1) -> bool:
    """Whether a run of `cfg` can take its forward from a file (see the module's docstring)."""
    return (bool(cfg.compile) and world_size == 1 and not cfg.checkpointing and not cfg.compile_tuning
            and forward_for(cfg, device) is not None and os.environ.get("LABKIT_PRECOMPILED", "1") != "0"
            and loadable())


def path_for(device: torch.device, graph: dict, folder: str | os.PathLike | None = None) -> Path:
    """The file of the compiled forward for `graph` (a `labkit.train.graph_key`) on this card and torch version."""
    digest = hashlib.sha256(json.dumps(graph, sort_keys=True).encode()).hexdigest()[:12]
    return CA.artifact_path(device, folder).with_name(f"{CA.artifact_stem(device)}.{digest}{SUFFIX}")


def build(cfg: TrainConfig, model: torch.nn.Module, x: torch.Tensor, graph: dict,
          folder: str | os.PathLike | None = None, *, say=CA._say) -> Path | None:
    """Compile `forward_for(cfg)` on (model, x) and save it for `graph`; the caller holds the config's switches
    (inductor settings, cuDNN). Returns the file, or None with one line saying why."""
    import torch._dynamo.config as dynamo_config

    fn = forward_for(cfg, x.device)
    if fn is None or not supported():
        why = f"no {cfg.precision} autocast on {x.device.type}" if fn is None else "this torch cannot save it"
        say(f"precompiled forward: not built ({why})")
        return None
    t0 = time.perf_counter()
    try:  # the artifact is saved already: a forward that cannot be saved whole costs only this line
        with dynamo_config.patch(enable_aot_compile=True):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                     mode=None if cfg.compile == "default" else cfg.compile)
            saved = compiled.aot_compile(((model, x), {}))
        with tempfile.TemporaryDirectory(prefix="labkit-precompiled-") as tmp:
            saved.save_compiled_function(os.path.join(tmp, "forward"))
            payload = Path(tmp, "forward").read_bytes()
    except Exception as e:  # noqa: BLE001 - torch's experimental API: any failure means no file, said once
        say(f"precompiled forward: not built ({error_line(e)})")
        return None
    header = {"card": CA.card(x.device), "torch": torch.__version__, "graph": graph, "code": code_version(),
              "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
              "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
              "compile_s": round(time.perf_counter() - t0, 2)}
    return CA._write(path_for(x.device, graph, folder), MAGIC, header, payload, say)


INSTEAD = "compiling with the artifact instead"  # what a run does when the file is unusable


def find(cfg: TrainConfig, device: torch.device, graph: dict, folder: str | os.PathLike | None = None, *,
         world_size: int = 1, say=CA._say, then: str = INSTEAD) -> tuple[Path, bytes] | None:
    """The saved forward's file for `graph` and its payload, checked without loading it, or None: where it does
    not apply, no file (silent), or a file that is unreadable, corrupt or stale (one line each, ending `then`:
    what the caller does instead)."""
    if not applies(cfg, device, world_size):
        return None
    path = path_for(device, graph, folder)
    if not path.exists():
        return None
    try:
        header, payload = CA._unpack(path.read_bytes(), MAGIC)
    except (OSError, ValueError) as e:
        say(f"precompiled forward {path} is unusable ({error_line(e)}): {then}")
        return None
    want = {"card": CA.card(device), "torch": torch.__version__, "graph": graph, "code": code_version()}
    wrong = [{"code": "model code"}.get(k, k) for k, v in want.items() if header.get(k) != v]
    if wrong:
        say(f"precompiled forward {path} is stale (built for another {' and '.join(wrong)}): {then}")
        return None
    return path, payload


def load_found(cfg: TrainConfig, path: Path, payload: bytes, *, say=CA._say, then: str = INSTEAD):
    """Load a payload `find` returned as a callable f(model, x), or None with one line (torch cannot load it)."""
    import torch._inductor.config as inductor_config

    threads = inductor_config.compile_threads
    # nothing will compile: no pool of compile workers to start for the loaded kernels and to wait for at exit
    CA._keep_compile_workers()
    # the loaded graph takes CUDA graphs from inductor's global switch, not from the compile mode it was built with
    try:
        with inductor_config.patch({"triton.cudagraphs": cfg.compile in GRAPH_MODES}), CA._quiet("torch._dynamo"):
            fn = torch.compiler.load_compiled_function(io.BytesIO(payload))
    except Exception as e:  # noqa: BLE001 - whatever torch's loader raises means: compile instead
        inductor_config.compile_threads = threads  # the artifact path decides its workers itself
        say(f"precompiled forward {path} could not be loaded ({error_line(e)}): {then}")
        return None
    say(f"precompiled forward: loaded {path.name} (the first step traces nothing)")
    return fn


def load(cfg: TrainConfig, device: torch.device, graph: dict, folder: str | os.PathLike | None = None, *,
         world_size: int = 1, say=CA._say):
    """The saved forward for `graph` as a callable f(model, x), or None: where it does not apply, no file
    (silent), or a file that is unreadable, corrupt, stale or that torch cannot load (one line each)."""
    found = find(cfg, device, graph, folder, world_size=world_size, say=say)
    return None if found is None else load_found(cfg, *found, say=say)

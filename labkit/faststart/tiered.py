"""Train eager while the compiled forward loads or compiles beside the run, then switch to it.

    labkit train --preset muon            # eager steps until the rung's compiled forward is ready, then it
    LABKIT_TIERED=0 labkit train ...      # load or compile before the first step instead, as the ladder does

A compiled rung's first step waits for its compiled forward: seconds to load the saved one (`labkit.faststart.precompiled`:
torch's compiler modules, the graph, its kernels) and tens of seconds to compile it on a machine with nothing
cached. The model, its optimizer and the data are the same whichever forward runs, and the compiled forward
computes what the eager one does (to rounding), so the steps before it is ready run eager and the run switches
at the next step after. A student's command then trains from its first second, and the record's `tiered` says
how many steps ran each way, when the forward was ready and what the step that switched cost.

Where the forward comes from:
- its saved file (`labkit.faststart.precompiled.find`), loaded in a thread of this process;
- no usable file, on a GPU: a child process (`python -m labkit.faststart.warmstart`, at low priority) compiles it, with the
  compile-cache artifact if there is one, and saves it in the compile-cache folder, where this run's thread
  loads it and every later run finds it. A run that ends first stops the child, with one line saying so.
On a CPU the training has no cores to spare for either: the run loads or compiles before its first step, as before.
Anything that goes wrong on the way costs one line, and the run goes on eager.

Only the forward (and its backward) changes hands, between steps, on the training thread: the loading thread
hands over one callable. The loading thread also imports torch's compiler (dynamo, inductor, Triton), which is
most of a load: the training thread meets those modules only when it builds its optimizer (torch's optimizers
import dynamo), outside any import of its own, so it waits for them there rather than importing them half made.
Inductor's CUDA graph trees keep state per thread, set up by torch 2.11 only in the thread that imported them:
`graph_trees_here` sets it up in the training thread at the handover.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from labkit.bench import unwritable
from labkit.env import error_line
from labkit.faststart import compile_artifacts as CA
from labkit.faststart import precompiled as P
from labkit.presets import GRAPH_MODES, TrainConfig

ENV = "LABKIT_TIERED"  # "0": no eager start (load or compile before the first step)
STOP_WAIT_S = 10.0     # how long a stopped child gets to exit before it is killed
# the compiling child's command (`labkit.faststart.warmstart.build_forward`), its spec (JSON) appended
CHILD = [sys.executable, "-m", "labkit.faststart.warmstart"]


class Tier:
    """A compiled forward on its way (from `start`): `forward()` hands it over once ready, `close()` ends it."""

    def __init__(self, cfg: TrainConfig, device: torch.device, say):
        self.cfg, self.device, self.say = cfg, device, say
        self.t0 = time.perf_counter()
        self.source: str | None = None    # the forward in use: "saved forward" (a file), "compiled beside the run"
        self.ready_s: float | None = None  # seconds from `start` to the forward being ready
        self.import_s: float | None = None  # of which importing torch's compiler modules (dynamo)
        self.load_s: float | None = None   # and loading the saved file (`labkit.faststart.precompiled.load_found`)
        self.eager_steps = 0
        self.compiled_steps = 0
        self.switch_step_s: float | None = None  # the first compiled step's seconds (CUDA graph capture, ...)
        self.stopped = False               # the run ended before the child compiled
        self._fn = None
        self._ready = threading.Event()
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()      # between close() and the thread starting the child
        self._tmp: str | None = None       # where the child writes when the compile-cache folder cannot be written
        self._thread: threading.Thread | None = None
        self._closing = False
        self._handed = False               # forward() has given the training thread the forward

    def forward(self):
        """The loaded forward f(model, x) once it is ready, else None (this step runs eager); never waits.
        Called on the training thread, which the forward's CUDA graphs then belong to."""
        if not self._ready.is_set() or self._fn is None:
            return None
        if not self._handed and self.cfg.compile in GRAPH_MODES:
            graph_trees_here()
        self._handed = True
        return self._fn

    def reject(self, why: str) -> None:
        """The handed-over forward does not fit the run (its guards said so at the switch): one line, eager on."""
        self._fn = None
        self.source = None
        self.say(f"tiered start: {why}; the run goes on eager")

    def count(self, compiled: bool, step_s: float | None = None) -> None:
        """Note a step taken eager or compiled; `step_s`: the seconds of the first compiled one."""
        if compiled:
            self.compiled_steps += 1
            if step_s is not None:
                self.switch_step_s = step_s
        else:
            self.eager_steps += 1

    def report(self) -> dict:
        """The record's `tiered`: where the forward came from, when it was ready, the steps each way."""
        return {"source": self.source, "ready_s": self.ready_s, "import_s": self.import_s, "load_s": self.load_s,
                "eager_steps": self.eager_steps, "compiled_steps": self.compiled_steps,
                "switch_step_s": self.switch_step_s, "stopped_compiling": self.stopped}

    def close(self) -> dict:
        """Stop a compile still running (one line), wait for the loading thread; returns `report()`."""
        with self._lock:
            child, self._closing = self._child, True
        if child is not None and child.poll() is None:
            self.stopped = True
            _stop(child)
            self.say("tiered start: the run ended before its compiled forward was ready: stopped compiling it "
                     "(`labkit compile-cache --build` compiles it once for every later run)")
        if self._thread is not None:
            self._thread.join()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        return self.report()

    def _run(self, found, graph: dict, folder) -> None:
        try:
            import torch._dynamo  # noqa: F401  (first: the training thread's optimizer waits for this one)

            self.import_s = round(time.perf_counter() - self.t0, 3)
            source = "saved forward" if found is not None else "compiled beside the run"
            if found is None:
                found = self._compile(graph, folder)
            if found is not None:
                t = time.perf_counter()
                fn = P.load_found(self.cfg, *found, say=self.say, then="the run stays eager")
                self.load_s = round(time.perf_counter() - t, 3)
                if fn is not None:
                    self._fn, self.source = fn, source
                    self.ready_s = round(time.perf_counter() - self.t0, 3)
        except Exception as e:  # noqa: BLE001 - the run goes on eager whatever went wrong here
            self.say(f"tiered start: the compiled forward could not be readied ({error_line(e)}): the run stays eager")
        finally:
            self._ready.set()

    def _compile(self, graph: dict, folder) -> tuple[Path, bytes] | None:
        """Compile and save the forward in a child process; the saved file's (path, payload), or None."""
        target = Path(folder) if folder else CA.default_folder()
        bad = unwritable(target)
        if bad:  # this run can still use it: compile into a folder of its own
            self._tmp = tempfile.mkdtemp(prefix="labkit-tiered-")
            self.say(f"tiered start: {target} cannot be written ({bad}): the compiled forward goes to {self._tmp}, "
                     f"for this run only")
            target = Path(self._tmp)
        spec = {"config": asdict(self.cfg), "device": str(self.device), "graph": graph, "folder": str(target),
                "artifact_folder": str(folder) if folder else None}
        with tempfile.TemporaryFile() as log:
            with self._lock:
                if self._closing:
                    return None
                self._child = subprocess.Popen([*CHILD, json.dumps(spec)],
                                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)  # its compile workers stop with it
            self.say(f"tiered start: compiling {self.cfg.name}'s forward beside the run (pid {self._child.pid}); "
                     f"training eager meanwhile")
            code = self._child.wait()
            if self.stopped:
                return None
            if code != 0:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or [f"exit {code}"]
                self.say(f"tiered start: compiling the forward failed ({tail[0]}): the run stays eager")
                return None
        return P.find(self.cfg, self.device, graph, target, say=self.say, then="the run stays eager")


def graph_trees_here() -> None:
    """Set up inductor's CUDA graph trees for the calling thread. torch 2.11 sets them up only in the thread that
    imported them (and the autograd threads it starts), newer torch in any thread that asks; here the loading
    thread imported them, and the training thread replays the graphs."""
    from torch._inductor import cudagraph_trees as ct

    if hasattr(ct.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    init = getattr(ct, "_initialize_tls", None)  # newer torch's own
    if init is not None:
        init(ct.local)
        return
    ct.local.tree_manager_containers = {}
    ct.local.tree_manager_locks = collections.defaultdict(threading.Lock)
    for name in ("tree_manager_containers", "tree_manager_locks"):  # autograd's threads copy these from ours
        torch._C._stash_obj_in_tls(name, getattr(ct.local, name))


def _stop(child: subprocess.Popen) -> None:
    """End `child` and its compile workers (its process group): politely, then for sure."""
    for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def applies(cfg: TrainConfig, device: torch.device, world_size: int = 1) -> bool:
    """Whether a run of `cfg` starts eager: a compiled forward that can be saved (`labkit.faststart.precompiled.applies`),
    on a GPU (a CPU's training has no cores to spare for loading or compiling beside it: measured there, the
    eager steps and the load slowed each other so that the run took as long as waiting), LABKIT_TIERED not 0."""
    return os.environ.get(ENV, "1") != "0" and device.type == "cuda" and P.applies(cfg, device, world_size)


def start(cfg: TrainConfig, device: torch.device, graph: dict, folder=None, *, world_size: int = 1,
          say=CA._say) -> Tier | None:
    """Start readying `cfg`'s compiled forward beside the run (its saved file, else a child that compiles it),
    or None where that does not apply (`applies`). Call `close()` on what it returns when the run ends, also
    when it fails."""
    if not applies(cfg, device, world_size):
        return None
    found = P.find(cfg, device, graph, folder, world_size=world_size, say=say, then="compiling it beside the run")
    tier = Tier(cfg, device, say)
    tier._thread = threading.Thread(target=tier._run, args=(found, graph, folder), daemon=True,
                                    name="labkit-tiered")
    tier._thread.start()
    return tier

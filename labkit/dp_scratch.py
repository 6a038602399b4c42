"""Data parallelism written by hand, checked against DistributedDataParallel: the machinery of week 6's 6.6-6.9.

`run_ranks(fn)` forks `world` processes on this machine, joins them in a gloo process group over 127.0.0.1 and
returns each rank's `fn(rank, world)`. Fork, not spawn, so that a function defined in a notebook runs in the
children as it is (spawn would have to import it by name). A rank that raises sends its error back; a rank that
hangs (waiting on a collective the other rank never starts) is killed after `timeout_s` and named.

`train_side_by_side` runs one recipe on a small MLP twice in each rank, from the same weights on the same data
shard: once with the student's gradient synchronization, once under DistributedDataParallel, and reports how far
apart the parameters and gradients end up. `time_side_by_side` times the two in interleaved rounds.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WORLD = 2


@dataclass(frozen=True)
class Recipe:
    """A tiny data-parallel training run: the same on every rank except the data shard."""

    sizes: tuple[int, ...] = (64, 256, 256, 256, 10)  # MLP widths: ~0.15 M parameters, ~0.6 MB of fp32 gradients
    batch: int = 32               # global batch, split evenly over the ranks
    steps: int = 3                # optimizer steps compared against DDP
    lr: float = 0.05
    momentum: float = 0.9         # SGD's momentum (the Adam recipe ignores it)
    seed: int = 0
    rounds: int = 11              # timing rounds (each: `timed_steps` of yours and of DDP's, order alternating)
    timed_steps: int = 12


def preload() -> None:
    """Import in this process what DistributedDataParallel's constructor imports (torch._dynamo): forked
    children then inherit it instead of each importing it again (seconds apiece on a small CPU)."""
    import torch._dynamo  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401


def mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    """Linear layers with ReLU between them: no BatchNorm, so DDP's buffer broadcast changes nothing."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def shard(recipe: Recipe, rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice (rank::world) of global batch `step`: every rank draws the same global batch."""
    g = torch.Generator().manual_seed(1000 * recipe.seed + step)
    x = torch.randn(recipe.batch, recipe.sizes[0], generator=g)
    y = torch.randint(0, recipe.sizes[-1], (recipe.batch,), generator=g)
    return x[rank::world], y[rank::world]


def can_fork() -> bool:
    """Fork exists and is safe here: Linux. macOS has fork, but its system libraries are not fork-safe."""
    return "fork" in mp.get_all_start_methods() and sys.platform.startswith("linux")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(Exception):
    """A rank raised: `kind` is the exception's class name, `where` the last frame of its traceback."""

    def __init__(self, rank: int, kind: str, message: str, where: str, not_implemented: bool):
        super().__init__(f"rank {rank} raised {kind}: {message} ({where})")
        self.rank, self.kind, self.message, self.where, self.not_implemented = rank, kind, message, where, not_implemented


def _child(fn, rank: int, world: int, port: int, timeout_s: float, out) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes on shared cores: one thread each, or they fight over the cores
    _forget_the_gpu()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            out.put((rank, "ok", _portable(fn(rank, world))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which names it
        tb = traceback.extract_tb(e.__traceback__)
        where = f"line {tb[-1].lineno} of {tb[-1].name}" if tb else "?"
        ni = isinstance(e, NotImplementedError) or isinstance(e.__cause__ or e.__context__, NotImplementedError)
        out.put((rank, "error", (type(e).__name__, str(e)[:500], where, ni)))


def _forget_the_gpu() -> None:
    """In a child forked from a process that had started CUDA, tell torch there is no accelerator.

    CUDA does not survive a fork: the child cannot use its parent's context, yet Adam's step asks the accelerator
    whether a graph capture is under way, and that call fails there. The child runs on the CPU alone, so it
    answers for torch instead. Only this process sees the change, and it exits when its rank is done."""
    if not getattr(torch._C, "_cuda_isInBadFork", lambda: False)():
        return
    torch.cuda.is_available = lambda: False
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = lambda check_available=False: None
        torch.accelerator.is_available = lambda: False


def _portable(value, back: bool = False):
    """Tensors as numpy arrays (and back): torch pickles a tensor through shared memory that dies with the child."""
    if isinstance(value, dict):
        return {k: _portable(v, back) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_portable(v, back) for v in value)
    if not back and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if back and type(value).__module__ == "numpy" and hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0:
        return torch.from_numpy(value)
    return value


def run_ranks(fn: Callable[[int, int], object], world: int = WORLD, timeout_s: float = 30.0) -> list:
    """[fn(0, world), ..., fn(world-1, world)], each in its own forked process in one gloo group (seconds: timeout_s).

    Raises RankFailed for the first rank that raised, TimeoutError when a rank neither answers nor fails in time
    (the ranks left are killed), RuntimeError where this platform cannot fork (see can_fork)."""
    if not can_fork():
        raise RuntimeError(f"{sys.platform} cannot fork safely: the 2-process checks need Linux (or Colab)")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    # gloo's own timeout a little under ours: a rank stuck in a collective fails with a message, then we kill
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, max(timeout_s - 3, 1.0), out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=0.2)
            except queue.Empty:
                _raise_if_gone(procs, results, out, deadline, timeout_s)
                continue
            if status == "error":
                raise RankFailed(rank, *value)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        out.close()
    return [_portable(results[r], back=True) for r in range(world)]


def _raise_if_gone(procs, results: dict, out, deadline: float, timeout_s: float) -> None:
    """Raise when a rank died without an answer, or when time is up; return while there is hope."""
    missing = [r for r in range(len(procs)) if r not in results]
    dead = [r for r in missing if procs[r].exitcode is not None]
    if dead:
        time.sleep(0.5)  # a rank that answered and exited may still be flushing its answer into the queue
        if out.empty():
            r = dead[0]
            raise RankFailed(r, "exit", f"the process ended with exit code {procs[r].exitcode} and no answer "
                             f"(killed by a signal when negative)", "?", False)
    elif time.monotonic() > deadline:
        raise TimeoutError(f"rank(s) {missing} gave no answer in {timeout_s:.0f} s: a rank waits in a "
                           f"collective that another rank never started (the same calls, in the same "
                           f"order and sizes, must run on every rank)")


# ------------------------------------------------------------------------------ counting the collectives


@dataclass
class Call:
    name: str          # all_reduce, reduce_scatter, all_gather
    numel: int
    async_op: bool
    in_backward: bool  # launched while autograd's engine ran (from a hook), not after backward returned
    step: int = -1     # the training step that made it; -1 while the answer set itself up
    waited: bool = False  # async_op only: its Work was waited on (wait(), or get_future() to wait through)


class _WatchedWork:
    """An async collective's Work as the answer sees it: the same Work, noting on its Call that it was waited on."""

    def __init__(self, work, call: Call):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        self._call.waited = True
        return self._work.wait(*args, **kwargs)

    def get_future(self, *args, **kwargs):
        self._call.waited = True
        return self._work.get_future(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def watch_collectives(calls: list[Call], backward_flag: list[bool], step: list[int] | None = None):
    """Record every collective the code inside makes (in this process only), then restore torch.distributed.

    `step`: a one-element list holding the current step, stamped on each call. A function looked up from
    torch.distributed inside the block (say by getattr, once, at set-up) stays a recording one after it."""
    import torch.distributed as dist

    names = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
             "reduce_scatter_single": "reduce_scatter", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(name, real):
        import inspect

        sig = inspect.signature(real)
        data = list(sig.parameters)[0 if name == "all_reduce" else 1]  # the tensor that is sent

        def f(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs).arguments
            t = bound.get(data)
            numel = t.numel() if isinstance(t, torch.Tensor) else sum(x.numel() for x in t or [])
            call = Call(names[name], numel, bool(bound.get("async_op", False)), backward_flag[0],
                        step[0] if step else -1)
            calls.append(call)
            work = real(*args, **kwargs)
            return _WatchedWork(work, call) if call.async_op and work is not None else work

        return f

    for n, real in saved.items():
        setattr(dist, n, wrap(n, real))
    try:
        yield
    finally:
        for n, real in saved.items():
            setattr(dist, n, real)


# -------------------------------------------------------------------------------- yours against DDP


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def train_side_by_side(rank: int, world: int, recipe: Recipe, make_sync: Callable, *, adam: bool = False) -> dict:
    """One rank's run of `recipe` with the student's synchronization and under DDP, from the same weights.

    `make_sync(model, optimizer_factory) -> (optimizer_like, after_backward)`: the exercise's adapter; each step
    is zero_grad, forward, backward, after_backward(), optimizer_like.step(). Returns this rank's findings: the
    parameters after the last step and gradients of the first (flat tensors) of both runs, and the collectives the
    student's side made in its last step ("calls"; the first may set things up) and in its first."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(recipe.seed)
    model = mlp(recipe.sizes)
    twin = copy.deepcopy(model)

    def make_opt(params):
        if adam:
            return torch.optim.Adam(params, lr=recipe.lr / 50)
        return torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum)

    loss_fn = nn.CrossEntropyLoss()
    calls: list[Call] = []
    in_backward, at_step = [False], [-1]
    # watched from the set-up on: an answer that looks a collective up once, there, is counted too
    with watch_collectives(calls, in_backward, at_step):
        opt, after_backward = make_sync(model, make_opt)
    # this rank's own first-step gradients, for the hints, from a copy without the answer's hooks
    probe = mlp(recipe.sizes)
    probe.load_state_dict(model.state_dict())
    loss_fn(probe(shard(recipe, rank, world, 0)[0]), shard(recipe, rank, world, 0)[1]).backward()
    local_grads = [p.grad for p in probe.parameters()]
    with watch_collectives(calls, in_backward, at_step):
        for step in range(recipe.steps):
            at_step[0] = step
            x, y = shard(recipe, rank, world, step)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            in_backward[0] = True
            loss.backward()
            in_backward[0] = False
            after_backward()
            if step == 0:  # the first step starts from DDP's weights: its gradients compare exactly
                grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for p in model.parameters()]
            opt.step()  # inside the watch: ZeRO-1's collectives run in its step

    ddp = DistributedDataParallel(twin)
    twin_opt = make_opt(ddp.parameters())
    for step in range(recipe.steps):
        x, y = shard(recipe, rank, world, step)
        twin_opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        if step == 0:
            twin_grads = [p.grad.detach().clone() for p in twin.parameters()]
        twin_opt.step()
    dist.barrier()
    return {"params": _flat(model.parameters()), "grads": _flat(grads), "local_grads": _flat(local_grads),
            "ddp_params": _flat(twin.parameters()), "ddp_grads": _flat(twin_grads),
            "names": [n for n, _ in model.named_parameters()],
            "numels": [p.numel() for p in model.parameters()],
            "start": _flat(mlp_at_seed(recipe)), "calls": [c for c in calls if c.step == recipe.steps - 1],
            "first_step_calls": [c for c in calls if c.step == 0],
            "state_bytes": state_bytes(opt), "ddp_state_bytes": state_bytes(twin_opt)}


def mlp_at_seed(recipe: Recipe):
    """The parameters every run of `recipe` starts from (the same seed, the same MLP)."""
    torch.manual_seed(recipe.seed)
    return mlp(recipe.sizes).parameters()


def state_bytes(opt) -> int:
    """Bytes of every tensor an optimizer keeps in its state (momentum buffers, Adam's moments and step)."""
    inner = getattr(opt, "optimizer", opt)  # an object that wraps a torch optimizer as .optimizer
    state = getattr(inner, "state", {})
    return sum(t.nbytes for s in state.values() for t in s.values() if isinstance(t, torch.Tensor))


def time_side_by_side(rank: int, world: int, recipe: Recipe, make_sync: Callable, *, adam: bool = False) -> list:
    """Seconds per step of yours and of DDP's in each of `recipe.rounds` interleaved rounds: [(yours, ddp), ...]."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(recipe.seed)
    model = mlp(recipe.sizes)
    ddp = DistributedDataParallel(copy.deepcopy(model))

    def make_opt(params):
        return torch.optim.Adam(params, lr=1e-4) if adam else torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    opt, after_backward = make_sync(model, make_opt)
    ddp_opt = make_opt(ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    batches = [shard(recipe, rank, world, s) for s in range(recipe.timed_steps)]

    def mine():
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            after_backward()
            opt.step()

    def theirs():
        for x, y in batches:
            ddp_opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            ddp_opt.step()

    def one(f):
        dist.barrier()  # both ranks start together: a step's time includes waiting for the slower rank
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) / recipe.timed_steps

    mine()
    theirs()  # warm-up: first-call allocations, DDP's bucket rebuild after its first step
    out = []
    for r in range(recipe.rounds):
        if r % 2 == 0:
            a = one(mine)
            b = one(theirs)
        else:
            b = one(theirs)
            a = one(mine)
        out.append((a, b))
    return out


def ratios(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of your step's time over DDP's, round by round."""
    from labkit.bench import quantile

    r = [a / b for a, b in pairs]
    return statistics.median(r), quantile(r, 0.25), quantile(r, 0.75)


def faster(pairs: list[tuple[float, float]]) -> str:
    """"yours", "DDP", or "neither" when the middle half of the rounds' ratios straddles 1 (within noise)."""
    _, q1, q3 = ratios(pairs)
    return "yours" if q3 < 1 else "DDP" if q1 > 1 else "neither"


def ratio_summary(pairs: list[tuple[float, float]]) -> str:
    """One line: the median ratio of your step's time over DDP's, its IQR, the rounds, DDP's step in ms."""
    med, q1, q3 = ratios(pairs)
    ms = 1e3 * statistics.median(b for _, b in pairs)
    verdict = {"yours": "yours is faster", "DDP": "DDP is faster", "neither": "within noise"}[faster(pairs)]
    return (f"your step takes {med:.2f}x DDP's (median; IQR {q3 - q1:.2f} over {len(pairs)} interleaved rounds, "
            f"{verdict}; DDP's step {ms:.2f} ms on {_cores()} CPU cores here)")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

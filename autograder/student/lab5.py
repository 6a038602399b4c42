"""Lab 5 probes: drive the student's fused label-smoothed cross-entropy on inputs the trusted side names.

The student's file defines `fused_cross_entropy(logits, target, label_smoothing=0.1) -> loss`: the mean over
rows of the label-smoothed cross-entropy of logits (N, C) (float32, float16 or bfloat16, any strides) against
int64 targets (N,), as a 0-d float32 tensor whose backward gives d loss / d logits in the logits' dtype, both
computed by the student's own Triton kernels. The baseline is the eager composition below (`eager_cross_entropy`:
log_softmax, gather, mean; public, like lab 4's naive step). A probe builds the case from the request's seed,
runs forward and backward, and reports what came back: the loss, the gradient, how many Triton kernels ran in
each pass and which of torch's softmax-family operators ran (seen at the dispatcher, so a renamed route to
them is seen too), and how many elements of the logits, or of what a kernel wrote from them, torch read outside
the launches (Watch: the math is the kernels'). The count and the operators are the student process's own report
(see autograder.student.probes); the values are checked by the trusted side against its own reference.

On a machine without CUDA this module sets TRITON_INTERPRET=1 before the student's file is imported, so the
student's kernels run in Triton's interpreter (NumPy on the CPU: right answers, meaningless times).
"""

from __future__ import annotations

import contextlib
import os

import torch

from autograder.student.probes import call, require, synchronize
from labkit.kernels_bench import count_launches  # the one launch counter, week 7's checks use it too

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOOTHING = 0.1  # labkit.presets.TrainConfig.label_smoothing: the course's ResNet trains with this
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYOUTS = ("contiguous", "sliced", "transposed", "rows")
# torch's operators that compute (part of) the answer: the student's file writes them as Triton kernels instead
TORCH_OPS = ("_softmax", "_log_softmax", "softmax", "log_softmax", "_softmax_backward_data",
             "_log_softmax_backward_data", "nll_loss", "nll_loss_forward", "nll_loss_backward", "nll_loss_nd",
             "nll_loss2d_forward", "cross_entropy_loss", "logsumexp", "special_logsumexp", "_safe_softmax")


def eager_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = SMOOTHING):
    """The baseline: label-smoothed cross-entropy as the eager composition of torch ops (fp32 math), mean over rows.

    loss_i = (1 - eps) * (-log p_i[y_i]) + eps * mean_c(-log p_i[c]), p_i = softmax(logits_i).
    """
    logp = logits.float().log_softmax(dim=-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    smooth = -logp.mean(dim=-1)
    return ((1 - label_smoothing) * nll + label_smoothing * smooth).mean()


def make_case(spec: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits (a leaf that requires grad, in the spec's dtype and layout, on `device`) and targets of a case.

    Drawn on the CPU from spec["seed"] (the same values on every device): logits ~ N(0, spec["scale"]^2).
    Layouts: contiguous; "sliced" x[:, :C] of a wider tensor; "transposed" the .t() of a (C, N) tensor;
    "rows" every other row of a (2N, C) tensor.
    """
    n, c, layout = int(spec["n"]), int(spec["c"]), str(spec.get("layout", "contiguous"))
    require(n >= 1 and c >= 2 and layout in LAYOUTS and spec.get("dtype", "float32") in DTYPES, f"bad case {spec}")
    dtype, scale = DTYPES[spec.get("dtype", "float32")], float(spec.get("scale", 3.0))
    g = torch.Generator().manual_seed(int(spec["seed"]))
    shape = {"contiguous": (n, c), "sliced": (n, c + 7), "transposed": (c, n), "rows": (2 * n, c)}[layout]
    base = (torch.randn(shape, generator=g) * scale).to(dtype).to(device)  # the view is taken on the device
    x = {"contiguous": base, "sliced": base[:, :c], "transposed": base.t(), "rows": base[::2]}[layout]
    y = torch.randint(0, c, (n,), generator=g).to(device)
    return x.detach().requires_grad_(), y


# Operators that only read a tensor's shape, dtype and device (an output buffer shaped like the logits), not its data
META_OPS = ("empty_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "zeros_like",
            "ones_like", "full_like", "detach", "alias", "lift_fresh")
# What Triton's interpreter runs on a launch's tensors (host copies of device memory, and back): data movement only
LAUNCH_OPS = ("set_", "empty", "empty_strided", "new_empty", "new_empty_strided", "copy_", "_to_copy", "view",
              "as_strided", "detach", "alias", "_unsafe_view", "clone", "contiguous")
# Ways to switch a dispatcher mode off from inside the student's function; each is reported if called during a pass
_SWITCHES = ("_pop_torch_dispatch_stack", "_pop_mode", "_pop_mode_temporarily", "_set_dispatch_mode",
             "_unset_dispatch_mode", "_DisableTorchDispatch", "_disabled_torch_dispatch_impl")
_HOST_READS = ("numpy", "tolist", "__dlpack__", "__array__")  # a tensor's data read by Python, past the dispatcher
_WATCHES: list = []  # the watch of the pass running now (at most one)


class Watch:
    """What touches the logits' data in one case: torch operators outside the student's Triton launches.

    The logits' storage is tainted, and so is every tensor a torch operator computes from a tainted one and every
    tensor handed to a launch together with one (a kernel's outputs, which may be copies). `reads[phase]` counts the
    elements of tainted tensors that torch operators outside launches read (shape-only operators and views aside),
    and the host reads (.numpy(), .tolist()) of them; `ops` names them. The honest kernel's glue (`loss.mean()` of
    its per-row losses) reads N of the N x C elements; torch doing the math reads at least all of them once.
    `switched` names the calls that turn a dispatcher mode off, made while the pass ran, and launch arguments
    that pose as tensors (an object with a data_ptr method runs its own code inside the launch). Inside a launch,
    only data movement (LAUNCH_OPS: Triton's interpreter copies its tensors to the host and back) is left out."""

    def __init__(self, x: torch.Tensor):
        self.keep, self.keys, self.ops, self.switched = [], set(), set(), set()
        self.reads, self.phase, self.in_launch, self.closing = [0, 0], 0, 0, False
        self.taint(x)

    def taint(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            if s.data_ptr() not in self.keys:
                self.keys.add(s.data_ptr())
                self.keep.append(s)  # held, so that no later allocation reuses the address

    def tainted(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() > 0 and t.untyped_storage().data_ptr() in self.keys

    def read(self, name: str, tensors) -> bool:
        """Count the tainted tensors among `tensors` that `name` reads; whether there were any."""
        hit = [t for t in tensors if self.tainted(t)]
        if hit:
            self.reads[self.phase] += sum(t.numel() for t in hit)
            self.ops.add(name)
        return bool(hit)


def _tensors(tree) -> list:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _install_guards() -> None:
    """Once per process, before the student's file is imported: report the mode switches and the host reads."""
    import torch.utils._python_dispatch as pd

    if getattr(_install_guards, "done", False):
        return
    _install_guards.done = True

    def switch(name, orig):
        def guarded(*args, **kwargs):
            for w in _WATCHES:
                if not w.closing:
                    w.switched.add(name)
            return orig(*args, **kwargs)
        return guarded

    for mod in (torch._C, pd):
        for name in _SWITCHES:
            if hasattr(mod, name):
                setattr(mod, name, switch(name, getattr(mod, name)))

    def host(name, orig):
        def guarded(self, *args, **kwargs):
            for w in _WATCHES:
                if not w.in_launch:
                    w.read("Tensor." + name, [self])
            return orig(self, *args, **kwargs)
        return guarded

    for name in _HOST_READS:
        setattr(torch.Tensor, name, host(name, getattr(torch.Tensor, name)))


@contextlib.contextmanager
def watching(w: Watch):
    """Inside the block: the TORCH_OPS that run (yielded, a set), and `w` told what reads the logits (see Watch)."""
    import triton.runtime.jit as jit
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in TORCH_OPS:
                seen.add(name)
            out = func(*args, **(kwargs or {}))
            if name in META_OPS or func.is_view or (w.in_launch and name in LAUNCH_OPS):
                return out
            if w.read(f"aten.{name}", _tensors((args, kwargs))):
                for t in _tensors(out):
                    w.taint(t)
            return out

    classes = [jit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    saved = {cls: cls.run for cls in classes}

    def launched(orig):
        def run(self, *args, **kwargs):
            tensors = _tensors((args, kwargs))
            for a in [*args, *kwargs.values()]:  # an object posing as a pointer runs its own code inside the launch
                if hasattr(a, "data_ptr") and not isinstance(a, torch.Tensor) \
                        and not type(a).__module__.startswith("triton"):
                    w.switched.add(f"a launch argument of type {type(a).__name__}, not a tensor")
            w.in_launch += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                w.in_launch -= 1
                if any(w.tainted(t) for t in tensors):  # what the kernel wrote may be a copy of the logits
                    for t in tensors:
                        w.taint(t)
        return run

    for cls, orig in saved.items():
        cls.run = launched(orig)
    _WATCHES.append(w)
    mode = _Seen()
    try:
        with mode:
            try:
                yield seen
            finally:
                w.closing = True
        w.closing = False
    finally:
        _WATCHES.remove(w)
        for cls, orig in saved.items():
            cls.run = orig


@contextlib.contextmanager
def torch_ops_seen():
    """The TORCH_OPS that run inside the block (at the dispatcher: however they were reached): yields a set."""
    with watching(Watch(torch.empty(0))) as seen:
        yield seen


def run_case(fn, spec: dict, device) -> dict:
    """Forward and backward of `fn` on one case: what came back, and what ran in each pass.

    The backward is torch.autograd.grad's (the gradient as the student's backward returned it: no copy into the
    leaf's layout by autograd, which would read it outside the student's kernels)."""
    x, y = make_case(spec, device)
    smoothing, g = float(spec.get("smoothing", SMOOTHING)), float(spec.get("grad", 1.0))
    w = Watch(x)
    with count_launches() as fwd, watching(w) as ops:
        loss = fn(x, y, smoothing)
    require(isinstance(loss, torch.Tensor), f"fused_cross_entropy must return a tensor, got {type(loss).__name__}")
    require(loss.numel() == 1, f"fused_cross_entropy must return the mean loss (one value), got shape "
            f"{tuple(loss.shape)}")
    require(loss.requires_grad, "the loss does not require grad: fused_cross_entropy must be differentiable "
            "(return the output of your torch.autograd.Function's apply)")
    incoming = torch.full_like(loss, g)
    w.phase = 1
    with count_launches() as bwd, watching(w) as bops:
        grads = call("the backward of fused_cross_entropy", torch.autograd.grad, loss, x, incoming,
                     allow_unused=True)
    synchronize(device)
    grad = grads[0]
    require(grad is not None, "backward gave no gradient for the logits")
    return {"loss": loss.detach().float().reshape(()).cpu(), "loss_dtype": str(loss.dtype).replace("torch.", ""),
            "grad": grad.detach().contiguous().cpu(), "grad_dtype": str(grad.dtype).replace("torch.", ""),
            "launches": [fwd[0], bwd[0]], "torch_ops": sorted(ops | bops), "logit_reads": list(w.reads),
            "logit_ops": sorted(w.ops), "switched": sorted(w.switched)}


def student_fn(p):
    """The submission's fused_cross_entropy, its failures reported in one line."""
    _install_guards()  # before the student's file is imported (p.attr imports it)
    fn = p.attr("fused_cross_entropy")
    require(callable(fn), "fused_cross_entropy must be a function")
    return lambda x, y, eps: call("fused_cross_entropy(logits, target, label_smoothing)", fn, x, y, eps)


def probe_case(p, params: dict) -> dict:
    """One correctness case (see make_case) through the student's fused_cross_entropy."""
    return run_case(student_fn(p), params, p.device)


def round_draws(n: int, rows: int, cols: int, device, seed: int) -> list:
    """A timed round's n inputs, drawn on `device` from `seed`, in this order: bf16 logits (rows, cols) ~ N(0, 9),
    int64 targets, then a commitment's 64 row indices and float64 weights (64, cols). Drawn inside the timed
    request, on both sides, so the inputs are unknown to the student's process until its clock runs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.bfloat16) * 3
        y = torch.randint(0, cols, (rows,), generator=gen, device=device)
        idx = torch.randint(0, rows, (64,), generator=gen, device=device)
        w = torch.randn(64, cols, generator=gen, device=device, dtype=torch.float64)
        out.append((x, y, idx, w))
    return out


def timed_round(fn, device, params: dict, watch: bool = False) -> dict:
    """n forward + backward passes of `fn` on fresh inputs (round_draws); the losses and a commitment to each
    gradient (the sum of 64 drawn rows times their weights, float64). The device is synchronized before returning.
    With `watch` (an untimed round), each pass runs under the correctness cases' watch (see Watch, run_case) and
    "watched" holds what it saw per pass."""
    n, rows, cols = int(params["n"]), int(params["rows"]), int(params["cols"])
    out = torch.empty(2 * n, device=device, dtype=torch.float64)
    seen = []
    for j, (x, y, idx, w) in enumerate(round_draws(n, rows, cols, device, int(params["seed"]))):
        x.requires_grad_()
        if watch:
            gx, loss, seen_j = _watched_pass(fn, x, y)
            seen.append(seen_j)
        else:
            loss = fn(x, y, SMOOTHING)
            (gx,) = torch.autograd.grad(loss, x)
        out[j] = loss.detach().double().reshape(-1)[0]
        out[n + j] = (gx[idx].double() * w).sum()
    out = out.cpu()  # one transfer, which waits for the work
    synchronize(device)
    return {"losses": out[:n], "commits": out[n:], **({"watched": seen} if watch else {})}


def _watched_pass(fn, x, y):
    """One pass of timed_round under the watch: the gradient, the loss, and what the watch saw."""
    w = Watch(x)
    with count_launches() as fwd, watching(w) as ops:
        loss = fn(x, y, SMOOTHING)
    w.phase = 1
    with count_launches() as bwd, watching(w) as bops:
        (gx,) = torch.autograd.grad(loss, x)
    return gx, loss, {"launches": [fwd[0], bwd[0]], "torch_ops": sorted(ops | bops), "logit_reads": list(w.reads),
                      "logit_ops": sorted(w.ops), "switched": sorted(w.switched)}


def probe_warm_student(p, params: dict) -> dict:
    """Untimed: the student's function on the timed rounds' shape, so Triton compiles before the clock starts;
    watched as the correctness cases are (a path taken at this size alone is held to the same rule)."""
    return timed_round(student_fn(p), p.device, params, watch=True)


def probe_timed_student(p, params: dict) -> dict:
    """One timed round of the student's fused_cross_entropy (see timed_round)."""
    return timed_round(student_fn(p), p.device, params)


def probe_timed_eager(p, params: dict) -> dict:
    """One timed round of the baseline, the eager composition (never touches the student's code)."""
    return timed_round(eager_cross_entropy, p.device, params)


def readers(ops: list[str]) -> str:
    """The torch operators to blame for reading the logits, for a message: the mean of per-row results is allowed,
    so it is named only when nothing else ran."""
    return ", ".join([o for o in ops if o != "aten.mean"] or ops)


def copy_hint(ops: list[str], phase: str) -> str:
    """What the usual culprits among `ops` are, for a student who did not call them by those names ("" if none)."""
    hints = []
    if "aten.clone" in ops:
        hints.append("aten.clone is a .contiguous() copy: pass the strides to your kernel instead")
    if "aten._to_copy" in ops:
        hints.append("aten._to_copy is a .float() or .to() copy: load the logits in their dtype inside the kernel"
                     + (" and write the gradient in the logits' dtype from your kernel" if phase == "backward" else ""))
    return f". {'; '.join(hints)}" if hints else ""

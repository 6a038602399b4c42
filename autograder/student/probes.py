"""What every probe uses: calling the student's code with clear failures, and in-process instruments.

A probe runs inside the sandbox next to the student's code, so anything it measures there (host syncs, the
dtypes of matrix multiplies) is the student process's own report: the trusted side uses such reports only for
the few points that cannot be observed from outside, says so in the threat model, and flags a submission that
touches the instruments.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path


class StudentError(Exception):
    """The student's code failed or is missing something: the message is shown to the student."""


class Probe:
    """What a probe function gets: the student's module (imported on first use), the device, kept state."""

    def __init__(self, student_file: str | None, device, state: dict):
        """`device`: a torch.device, or a function returning one on first use (so torch loads only if needed)."""
        self.student_file, self._device, self.state = student_file, device, state
        self._mod = None

    @property
    def device(self):
        if callable(self._device):
            self._device = self._device()
        return self._device

    @property
    def student(self):
        if self._mod is None:
            if not self.student_file:
                raise StudentError("no student file in this process")
            self._mod = import_student(Path(self.student_file))
        return self._mod

    def attr(self, name: str):
        """A required name from the submission, with a clear failure when it is missing."""
        mod = self.student
        if not hasattr(mod, name):
            raise StudentError(f"{Path(self.student_file).name} must define {name}")
        return getattr(mod, name)


def import_student(path: Path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("student_submission", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except NotImplementedError:
        raise StudentError(f"{path.name} is not implemented yet (it raised NotImplementedError at import)") from None
    except SyntaxError as e:
        raise StudentError(f"{path.name} has a syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:  # anything at import is the submission's fault
        raise StudentError(f"importing {path.name} raised {type(e).__name__}: {one_line(e)}{student_frame(e)}") \
            from None
    return mod


def call(what: str, fn: Callable, *args, **kwargs):
    """Call student code; any exception becomes a one-line StudentError naming the function."""
    try:
        return fn(*args, **kwargs)
    except StudentError:
        raise
    except NotImplementedError:
        raise StudentError(f"{what} is not implemented yet (it raised NotImplementedError)") from None
    except Exception as e:  # whatever student code raises is a failed check, with its last line shown
        raise StudentError(f"{what} raised {type(e).__name__}: {one_line(e)}{student_frame(e)}") from None


def require(cond: bool, message: str) -> None:
    """Stop the probe with `message` for the student unless `cond` holds (shape or type of what came back)."""
    if not cond:
        raise StudentError(message)


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def student_frame(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).name.startswith("student")]
    return f" (at {Path(frames[-1].filename).name} line {frames[-1].lineno})" if frames else ""


def host_sync_sites(fn: Callable[[], object], device) -> list[str]:
    """Where `fn()` makes the host wait for a tensor value: one "file:line" per sync, in order.

    On CUDA this sees every synchronizing CUDA call (torch's sync debug mode, works for compiled code too);
    on CPU, where nothing really waits, it sees the calls that would sync on a GPU: `.item()`, `bool(t)`,
    `float(t)` and `nonzero` (at the dispatcher, so eager code only). The site is the innermost Python line
    outside torch and the grader, so students see which of their lines syncs.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        prev = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default"}
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    sites: list[str] = []

    class _Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in syncing:
                frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip)]
                sites.append(f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?")
            return func(*args, **(kwargs or {}))

    with _Sites():
        fn()
    return sites


def gemm_dtypes(fn: Callable[[], object]) -> dict[str, int]:
    """Count of matrix-multiply and convolution calls by input dtype while `fn()` runs (eager code).

    16-bit inputs are what tensor cores need; this is checked at the dispatcher, so it holds on any hardware.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    gemms = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.",
             "aten.convolution_backward.", "aten._convolution.")
    counts: dict[str, int] = {}

    class _Gemm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith(gemms):
                t = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if t is not None:
                    key = str(t.dtype).replace("torch.", "")
                    counts[key] = counts.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    with _Gemm():
        fn()
    return counts


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

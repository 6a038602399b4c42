"""Where results go: output paths checked before any work, files written whole, earlier runs kept.

Every command that writes goes through here, so they all behave alike:
- `check_writable(path, kind)` fails in one line, before any work, when a file ("file") or a folder ("dir")
  cannot be written at `path`; it leaves nothing behind.
- `prepare_output(path, kind, overwrite)` does that check and picks where this run goes: `path` itself, or, when
  an earlier run is already there and `overwrite` is off, a timestamped name next to it (`runs/ladder` ->
  `runs/ladder-20260101-120000`), so a re-run never replaces earlier results unasked.
- `write_json`, `write_text` and `save_figure` write a temporary file and rename it, so an interrupted run never
  leaves half a file; results get the mode an ordinary file would (0644 under the usual umask).
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from labkit.errors import LabkitError

KINDS = ("file", "dir")


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def check_writable(path: str | os.PathLike, kind: str = "file", what: str = "output") -> Path:
    """`path` as a Path if a `kind` ("file" or "dir") can be written there; else a one-line LabkitError.

    Tries for real: makes the missing folders and a probe file in the deepest one, then removes them all, so
    read-only file systems, /proc, a file where a folder should be and missing permissions are all caught.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    p = Path(path)
    if not str(path):
        raise LabkitError(f"{what}: empty path")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise LabkitError(f"{what} {p}: exists and is not a folder")
    if kind == "file" and p.is_dir():
        raise LabkitError(f"{what} {p}: is a folder, not a file name")
    folder = p if kind == "dir" else (p.parent if str(p.parent) else Path("."))
    made = []
    try:
        for d in reversed([folder, *folder.parents]):  # each missing folder, outermost first
            if not d.exists():
                d.mkdir()
                made.append(d)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".labkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LabkitError(f"{what} {p}: cannot write there ({_reason(e)}): choose another path") from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
    return p


def _holds_a_run(p: Path, kind: str) -> bool:
    if kind == "file":
        return p.exists()
    return p.is_dir() and any(p.iterdir())


def fresh_path(path: str | os.PathLike, kind: str = "file", now: _dt.datetime | None = None) -> Path:
    """`path` if nothing is there yet; else a timestamped sibling that is free (`name-YYYYmmdd-HHMMSS[-N]`).

    A folder counts as taken when it holds anything, a file when it exists.
    """
    p = Path(path)
    if not _holds_a_run(p, kind):
        return p
    if p.name in ("", ".", ".."):
        p = p.resolve()
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    stem, suffix = (p.name, "") if kind == "dir" else (p.stem, p.suffix)
    for i in range(1, 1000):
        q = p.with_name(f"{stem}-{stamp}{'' if i == 1 else f'-{i}'}{suffix}")
        if not q.exists():
            return q
    raise LabkitError(f"{p}: no free timestamped name next to it: pass --overwrite or another path")


def prepare_output(path: str | os.PathLike, kind: str = "file", overwrite: bool = False, what: str = "output",
                   log: Callable[[str], None] | None = None) -> Path:
    """Where this run writes: checked writable (see `check_writable`) before any work starts.

    With an earlier run at `path` and `overwrite` off, a timestamped sibling (see `fresh_path`), said in one
    line through `log`; with `overwrite`, `path` itself.
    """
    p = Path(path)
    target = p if overwrite else fresh_path(p, kind)
    if target != p and log is not None:
        log(f"{what} {p} holds an earlier run: this one goes to {target} (--overwrite replaces it instead)")
    return check_writable(target, kind, what)


# ---------------------------------------------------------------------------------------------- writing


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Run `write(tmp_path)`, then rename the temporary file onto `path` with an ordinary file's mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix + ".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are shared like any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_default(o):
    if callable(getattr(o, "summary", None)):  # labkit.bench's Timing and ABResult
        return o.summary()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    package = type(o).__module__.split(".")[0]
    if package == "torch" and callable(getattr(o, "numel", None)):  # a tensor: only a single number fits
        if o.numel() == 1:
            return o.item()
    elif package == "torch":  # torch.device, torch.dtype
        return str(o)
    elif package == "numpy" and getattr(o, "size", None) == 1:
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write `payload` as indented JSON, whole or not at all (temporary file, then rename); returns the path."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=_json_default)
            f.write("\n")

    return _atomic(path, write)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text`, whole or not at all; returns the path."""
    return _atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_figure(fig, path: str | os.PathLike, **savefig_kw) -> Path:
    """`fig.savefig(path)`, whole or not at all (the format follows `path`'s suffix); returns the path."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return _atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_kw))

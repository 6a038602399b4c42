"""A hand-in's files kept on disk in the grader's scratch folder, each checked against its sha256 when read.

Intake used to hold every hand-in in memory until the whole class was graded. A hand-in may be up to
intake.MAX_HANDIN_BYTES (200 MiB), and a student who hands in the dataset beside the notebook gets close, so a
class of a hundred such could hold the grader's process at gigabytes, or kill it. Now intake copies each file
here once, in chunks, taking its sha256 on the way; grading reads one student's files at a time and refuses a
file whose bytes no longer match (`HandinChanged`): what gets graded is what was handed in, even if something
rewrote the copy on disk. The sandboxes never see this folder (they see only their own scratch course), so that
refusal is a last line, not the first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from labkit.env import LabkitError

CHUNK = 1 << 20  # bytes copied or hashed at a time


class HandinChanged(LabkitError):
    """A spooled file no longer holds the bytes intake stored."""


class TooLarge(Exception):
    """A file being stored went past the budget it was given."""


def _grader_side(op, folder: Path):
    """Run `op`, an operation on the grader's own copy: its OSError (a full disk) stops the run, since blaming it on
    the hand-in would grade the student without a file they handed in."""
    try:
        return op()
    except OSError as e:
        raise LabkitError(f"cannot copy the hand-ins into {folder}: {e.strerror}; free some space there") from e


def entry_header(name: str, size: int) -> bytes:
    """What goes before a file's bytes in a hand-in digest: its name and its size, each behind its length, so that
    no two different sets of files give the same stream (also autograder.checks.harness._box_digest)."""
    raw = name.encode()
    return len(raw).to_bytes(8, "big") + raw + size.to_bytes(8, "big")


class Spool(MutableMapping):
    """name inside the assignment folder -> bytes, stored in `folder` (created here, private to the grader).

    Reading a name returns its bytes after checking their sha256; names map to numbered files, so a hand-in's
    names (nested, odd characters) never become paths here."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        _grader_side(lambda: self.folder.mkdir(parents=True, exist_ok=True, mode=0o700), self.folder)
        self._entries: dict[str, tuple[Path, str, int]] = {}  # name -> (file, sha256 hex, size in bytes)
        self._next = 0

    def _new_path(self) -> Path:
        self._next += 1
        return self.folder / str(self._next)

    def store(self, name: str, src: Path, budget: int) -> int:
        """Copy file `src` in as `name`; returns its size in bytes. Raises TooLarge (nothing kept) past `budget`
        bytes, counted as read: a file growing under the copy cannot pass a size taken before it."""
        dest, h, size = self._new_path(), hashlib.sha256(), 0
        with open(src, "rb") as f:  # an OSError reading is the hand-in's: the caller notes it
            try:
                out = _grader_side(lambda: open(dest, "xb"), self.folder)
                with out:
                    while chunk := f.read(CHUNK):
                        size += len(chunk)
                        if size > budget:
                            raise TooLarge(name)
                        h.update(chunk)
                        _grader_side(lambda: out.write(chunk), self.folder)
                    _grader_side(out.flush, self.folder)  # so that closing has nothing left to fail on
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        self._drop(name)
        self._entries[name] = (dest, h.hexdigest(), size)
        return size

    def __setitem__(self, name: str, data: bytes) -> None:
        dest = self._new_path()
        dest.write_bytes(data)
        self._drop(name)
        self._entries[name] = (dest, hashlib.sha256(data).hexdigest(), len(data))

    def __getitem__(self, name: str) -> bytes:
        path, digest, size = self._entries[name]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise HandinChanged(f"the grader's copy of {name!r} could not be read: {e.strerror}") from e
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise HandinChanged(f"the grader's copy of {name!r} changed after intake read it; grade again")
        return data

    def __delitem__(self, name: str) -> None:
        if name not in self._entries:
            raise KeyError(name)
        self._drop(name)

    def _drop(self, name: str) -> None:
        old = self._entries.pop(name, None)
        if old:
            old[0].unlink(missing_ok=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        for name in list(self._entries):
            self._drop(name)

    def rename(self, old: str, new: str) -> None:
        """Keep the file stored as `old` under the name `new`, without reading it."""
        self._drop(new)
        self._entries[new] = self._entries.pop(old)

    def digest(self) -> str:
        """sha256 over every name and its bytes, in name order, each preceded by its length. Each file is checked
        against its own sha256 on the way.

        The lengths make it one hand-in's alone: names and bytes joined by NUL bytes gave the same digest to a file
        holding "\\0k1\\0" and to two files split there, so a changed hand-in kept its earlier grade, and its hidden
        cases (drawn for the digest, autograder.base.course_secret.rng)."""
        h = hashlib.sha256()
        for name in sorted(self._entries):
            path, digest, size = self._entries[name]
            h.update(entry_header(name, size))
            own, seen = hashlib.sha256(), 0
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    own.update(chunk)
                    seen += len(chunk)
            if seen != size or own.hexdigest() != digest:
                raise HandinChanged(f"the grader's copy of {name!r} changed after intake read it; grade again")
        return h.hexdigest()


"""Progress for long commands: a tqdm bar on a terminal, one plain line per step in a log (Slurm, Kubernetes).

A bar redrawn with carriage returns turns a batch job's log into one enormous line; off a terminal each
update is printed as its own line instead, with the count and what just finished.
"""

from __future__ import annotations

import sys
import time


class LineBar:
    """The part of tqdm's interface the grader uses, printing one line per update to stderr."""

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "it", stream=None):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.postfix = ""
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def update(self, n: int = 1) -> None:
        self.n += n
        of = f"/{self.total}" if self.total is not None else ""
        tail = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}{tail} [{time.monotonic() - self.t0:.0f} s]",
              file=self.stream, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | None = None, desc: str = "", unit: str = "it", disable: bool = False, **kw):
    """A progress bar: tqdm on a terminal, LineBar otherwise, a silent tqdm when `disable`."""
    from tqdm.auto import tqdm

    if disable or sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, disable=disable, **kw)
    return LineBar(total, desc, unit)


def stage(message: str, enabled: bool = True) -> None:
    """One line naming a stage of a long command (stderr), so a batch log shows where a run is."""
    if enabled:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def table(rows: list[list], header: list[str]) -> str:
    """A plain text table, columns padded to their widest cell."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"

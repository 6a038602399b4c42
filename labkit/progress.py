"""Progress for runs made of stages (ladder rungs, data sweeps), readable in a terminal and in a log file alike.

In a terminal each stage gets a tqdm bar. Anywhere else (output piped, redirected to a file, CI), where a bar
would draw nothing useful, each stage prints a line when it starts and when it ends, and a line every
`every_s` seconds in between, each with the time spent and an estimate of the time left.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable


def fmt_duration(s: float) -> str:
    """Seconds as '42 s', '3.5 min' or '1.2 h'."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class _Lines:
    """A tqdm-like counter that prints a line every `every_s` seconds instead of drawing a bar."""

    def __init__(self, name: str, total: int, log: Callable[[str], None], every_s: float, clock):
        self.name, self.total, self.log, self.every_s, self.clock = name, total, log, every_s, clock
        self.n = 0
        self.t0 = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            spent = now - self.t0
            left = spent * (self.total - self.n) / self.n
            self.log(f"    {self.name}: {self.n}/{self.total} steps, {fmt_duration(spent)}, "
                     f"about {fmt_duration(left)} left")


class _Off:
    def update(self, n: int = 1) -> None:
        pass


def _bars_work() -> bool:
    """True where a tqdm bar is seen: a terminal on stderr, or a Jupyter kernel (tqdm.auto draws a widget)."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


MODES = ("auto", "bar", "lines", "off")


class Stages:
    """Progress over `n` named stages, each counted in steps: `with stages.stage(name, steps) as bar: bar.update()`.

    `mode`: "bar" (tqdm), "lines" (plain lines through `log`), "off", or "auto": a bar where one is seen (see
    `_bars_work`), lines everywhere else.
    """

    def __init__(self, n: int, what: str = "run", log: Callable[[str], None] = print, mode: str = "auto",
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.n, self.what, self.log, self.every_s, self.clock = n, what, log, every_s, clock
        self.mode = ("bar" if _bars_work() else "lines") if mode == "auto" else mode
        self.done = 0
        self.t0 = clock()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return self.clock() - self.t0

    @contextlib.contextmanager
    def stage(self, name: str, steps: int):
        """A counter for one stage of `steps` steps: a tqdm bar, or start, heartbeat and end lines."""
        i = self.done + 1
        if self.mode == "off":
            yield _Off()
        elif self.mode == "bar":
            from tqdm.auto import tqdm

            with tqdm(total=steps, desc=f"[{i}/{self.n}] {name}", leave=False) as bar:
                yield bar
        else:
            self.log(f"  [{i}/{self.n}] {name}: {steps} steps, started at {fmt_duration(self.elapsed())}")
            t0 = self.clock()
            yield _Lines(name, steps, self.log, self.every_s, self.clock)
            spent, total = self.clock() - t0, self.elapsed()
            left = total / i * (self.n - i)
            self.log(f"  [{i}/{self.n}] {name}: done in {fmt_duration(spent)}; {self.what} {fmt_duration(total)} "
                     "so far" + (f", about {fmt_duration(left)} left" if i < self.n else ""))
        self.done = i

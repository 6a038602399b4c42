"""The GPU's SM clock and board power while work runs, read through NVML, and whether the power limit held it back.

A busy GPU runs below its maximum clock when it reaches its power limit: the driver lowers the clock until the board
draws no more than the limit, and sets the "power cap" clock-event reason while it does. Kernels that spend more
energy (more bits switched, more bytes moved) then run at a lower clock, so the same step can be faster on other
data or weights (`benchmarks/results/ladder/step_power_h200.json`). A record that says its clock and power says whether
its speed was the card's or the limit's.

    meter = Meter.open(device)          # None without a CUDA GPU or NVML
    with meter.reading():               # a thread reads the GPU every 20 ms while the block runs
        ...
    meter.report()                      # medians over every reading so far (MHz, W) and reason shares
"""

from __future__ import annotations

import statistics
import threading
import time

# NVML's clock-event reason bits (nvml.h, nvmlClocksEventReason*). Idle and the applications-clock setting are left
# out: neither slows a busy card below the clock it was set to.
REASONS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)", 0x40: "thermal (hardware)",
           0x80: "power brake", 0x10: "sync boost"}
AT_LIMIT = 0.97  # a reading at or above this share of the power limit counts as at the limit (the driver's margin)


def summary(samples: list, limit_w: float | None) -> dict:
    """Medians of (seconds, SM MHz, board W, reason bits) readings, the share of them at the power limit, and the
    share with each slowing reason set; {} for no readings."""
    if not samples:
        return {}
    out = {"samples": len(samples), "sm_clock_mhz": statistics.median(s[1] for s in samples),
           "power_w": round(statistics.median(s[2] for s in samples), 1),
           "at_limit": round(sum(s[2] >= AT_LIMIT * limit_w for s in samples) / len(samples), 3) if limit_w else None}
    out["reasons"] = {name: round(sum(bool(s[3] & bit) for s in samples) / len(samples), 3)
                      for bit, name in REASONS.items() if any(s[3] & bit for s in samples)}
    return out


class Meter:
    """NVML readings of one GPU, taken on a thread while a `reading()` block runs."""

    def __init__(self, nvml, handle, every_s: float):
        self.nv, self.handle, self.every = nvml, handle, every_s
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        self.samples: list = []
        self.card = {"power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000,
                     "max_sm_clock_mhz": nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)}

    @classmethod
    def open(cls, device, every_s: float = 0.02) -> Meter | None:
        """A meter for `device` (a torch.device), or None where there is nothing to read: not a CUDA GPU, no
        pynvml, or NVML not answering (a container without the driver's library)."""
        if getattr(device, "type", None) != "cuda":
            return None
        try:
            import pynvml
            pynvml.nvmlInit()
            return cls(pynvml, _handle(pynvml, device.index or 0), every_s)
        except Exception:  # pynvml missing or NVML failing: the run goes on without readings
            return None

    def read(self) -> tuple:
        """One reading: (seconds, SM clock MHz, board power W, clock-event reason bits)."""
        nv, h = self.nv, self.handle
        return (time.perf_counter(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                nv.nvmlDeviceGetPowerUsage(h) / 1000, self._reasons(h))

    def reading(self):
        """A context manager: readings every `every_s` seconds while the block runs, added to `samples`."""
        return _Reading(self)

    def report(self, samples: list | None = None) -> dict:
        """The card's limits and the summary of `samples` (default: every reading so far)."""
        return {**self.card, **summary(self.samples if samples is None else samples, self.card["power_limit_w"])}


def _handle(nvml, index: int):
    """NVML's handle for CUDA device `index`: NVML numbers every GPU of the machine, CUDA only those that
    CUDA_VISIBLE_DEVICES lists (by number or UUID), in its order."""
    import os
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        if visible[index].isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(visible[index]))
        return nvml.nvmlDeviceGetHandleByUUID(visible[index])
    return nvml.nvmlDeviceGetHandleByIndex(index)


class _Reading:
    def __init__(self, meter: Meter):
        self.meter, self._stop, self._thread = meter, threading.Event(), None
        self.samples: list = []

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="labkit-gpu-power", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        try:
            while not self._stop.wait(self.meter.every):
                self.samples.append(self.meter.read())
        except Exception:  # NVML went away mid-run: keep what was read
            pass

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.meter.samples += self.samples
        return False


def describe(report: dict | None) -> str:
    """A report in a few words for a result line, e.g. '1,680/1,980 MHz, 693/700 W, power cap 100%'; '' for none."""
    if not report or not report.get("samples"):
        return ""
    text = (f"{report['sm_clock_mhz']:,.0f}/{report['max_sm_clock_mhz']:,} MHz, "
            f"{report['power_w']:,.0f}/{report['power_limit_w']:,.0f} W")
    cap = report.get("reasons", {}).get("power cap")
    return text + (f", power cap {100 * cap:.0f}%" if cap else "")

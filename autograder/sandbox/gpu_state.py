"""The GPU's state around a speed verdict: SM and memory clocks, temperature, power and throttle reasons.

A speed-up measured while the card throttled (too hot, at its power cap) or while its clocks moved is not a
measurement an instructor can defend: `Watch` reads the card before the timed rounds (warm-up included) and
after the last one, `judge` says why such a verdict should be measured again, and the instructor's summary
lists it (autograder.checks.review). It is not a failure for the student: the points stand as measured until the
instructor regrades.

Only the trusted grading process reads the card (nvidia-smi, or NVML through `pynvml` when that imports); the
student's process is never asked. A student cannot fake GPU state: nothing in these readings passes through
their code. Nothing is read on a machine without a GPU; a GPU whose state cannot be read is recorded as such.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

CLOCK_DRIFT = 0.10  # share an SM or memory clock may move between the start and end readings before re-measuring
SMI_TIMEOUT_S = 10.0  # seconds one nvidia-smi call may take (a hung driver must not hang the check)

# NVML's clocks-event (throttle) reason bits, as nvidia-smi's clocks_throttle_reasons.active reports them.
REASON_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
               0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
               0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
# The reasons that slow the card below what it would run at (thermal or power): a timing under them is suspect.
THROTTLING = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")

_FIELDS = ["uuid", "name", "clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "power.limit"]
_REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")  # old name first, then new
_KEYS = ["uuid", "name", "sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "power_limit_w"]


def reasons(mask: int) -> list[str]:
    """Names of the throttle reasons set in an NVML reason bitmask."""
    return [name for bit, name in REASON_BITS.items() if mask & bit]


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _parse_smi(line: str) -> dict:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(_KEYS) + 1:
        raise ValueError(f"nvidia-smi printed {line.strip()[:120]!r}")
    out = {k: (v if k in ("uuid", "name") else _number(v)) for k, v in zip(_KEYS, parts, strict=False)}
    mask = parts[-1]
    out["throttle_reasons"] = reasons(int(mask, 16)) if mask.lower().startswith("0x") else None
    return out


def read_smi(select: str | None = None, *, timeout_s: float = SMI_TIMEOUT_S) -> dict:
    """One reading of the GPU `select` (a UUID or nvidia-smi index; the first GPU when None) by nvidia-smi:
    sm_clock_mhz, mem_clock_mhz, temperature_c, power_w, power_limit_w, throttle_reasons, or {"error": why}."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    why = ""
    for reason_field in _REASON_FIELDS:
        cmd = [exe, f"--query-gpu={','.join([*_FIELDS, reason_field])}", "--format=csv,noheader,nounits",
               *(["-i", select] if select else [])]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            return {"error": f"nvidia-smi failed: {type(e).__name__}: {str(e)[:120]}"}
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        if p.returncode == 0 and lines:
            try:
                return {**_parse_smi(lines[0]), "source": "nvidia-smi"}
            except ValueError as e:
                return {"error": str(e)}
        why = (p.stderr or p.stdout).strip().splitlines()[:1]
        why = f"nvidia-smi exited with status {p.returncode}" + (f": {why[0][:160]}" if why else "")
    return {"error": why}


def read_nvml(select: str | None = None) -> dict | None:
    """The same reading through NVML (`pynvml`, package nvidia-ml-py); None when pynvml does not import."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            if select and select.startswith(("GPU-", "MIG-")):
                h = pynvml.nvmlDeviceGetHandleByUUID(select)
            else:
                h = pynvml.nvmlDeviceGetHandleByIndex(int(select or 0))
            uuid, name = pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h)
            get_mask = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            return {"uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                    "mem_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                    "temperature_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                    "throttle_reasons": reasons(int(get_mask(h))), "source": "nvml"}
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML's errors are its own exception classes; any of them means "no reading"
        return {"error": f"NVML: {type(e).__name__}: {str(e)[:160]}"}


def read(select: str | None = None) -> dict:
    """One reading of a GPU, through NVML where pynvml imports and reads, else nvidia-smi; never raises."""
    got = read_nvml(select)
    if got is None or "error" in got:
        smi = read_smi(select)
        got = smi if "error" not in smi or got is None else {"error": f"{got['error']}; {smi['error']}"}
    got["at"] = round(time.time(), 3)
    return got


def selector(device) -> str | None:
    """How nvidia-smi/NVML name the card behind a torch device: its UUID where torch knows it, else its index
    among all GPUs (CUDA_VISIBLE_DEVICES mapped back); None for a device that is not a CUDA GPU."""
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return None
    import torch

    idx = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[idx] if idx < len(visible) else str(idx)


def judge(start: dict, end: dict, drift: float = CLOCK_DRIFT) -> list[str]:
    """Why a timing between these two readings should be measured again (empty: nothing against it).

    Throttling (thermal or power) at either reading counts; so does an SM or memory clock that moved by more
    than `drift` of its start value, unless the card was idle at a reading (clocks drop between requests when
    idle: that drop is not a change of the card's speed under load)."""
    why = []
    for label, r in (("start", start), ("end", end)):
        bad = [t for t in (r.get("throttle_reasons") or []) if t in THROTTLING]
        if bad:
            why.append(f"GPU throttling at the {label} of the timed rounds ({', '.join(bad)}; "
                       f"{_fmt(r.get('temperature_c'), 'C')}, {_fmt(r.get('power_w'), 'W')})")
    idle = any("gpu_idle" in (r.get("throttle_reasons") or []) for r in (start, end))
    for key, label in (("sm_clock_mhz", "SM clock"), ("mem_clock_mhz", "memory clock")):
        a, b = start.get(key), end.get(key)
        if not idle and isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 \
                and abs(b - a) / a > drift:
            why.append(f"{label} moved {a:g} -> {b:g} MHz during the timed rounds (more than {drift:.0%})")
    return why


def _fmt(x, unit: str) -> str:
    return f"{x:g} {unit}" if isinstance(x, (int, float)) else f"? {unit}"


class Watch:
    """The card's state at the start and end of a verdict's timed rounds, for its measurements.

    Made right before the rounds (it reads the start state then), `measurements()` right after them. On a
    device that is not a CUDA GPU it reads nothing and adds nothing.
    """

    def __init__(self, device, reader=None):
        self.reader = reader or read  # looked up now, so a test can stand in for the card
        try:
            self.select = selector(device)
            self.gpu = getattr(device, "type", str(device).split(":")[0]) == "cuda"
        except Exception:  # a torch that cannot name its card: read the first GPU
            self.select, self.gpu = None, True
        self.start = self.reader(self.select) if self.gpu else None

    def measurements(self) -> dict:
        """{"gpu_state": {"start", "end"}, "gpu_measure_again": "why; why"} (the latter only when there is a
        reason), {"gpu_state": {"error": ...}} when the card could not be read, {} without a GPU."""
        if not self.gpu:
            return {}
        end = self.reader(self.select)
        if "error" in self.start or "error" in end:
            return {"gpu_state": {"error": self.start.get("error") or end.get("error")}}
        out = {"gpu_state": {"start": self.start, "end": end}}
        why = judge(self.start, end)
        if why:
            out["gpu_measure_again"] = "; ".join(why)
        return out

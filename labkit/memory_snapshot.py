"""Reading a CUDA memory snapshot on any machine: the peak, the largest allocations and where they came from.

A snapshot is what `torch.cuda.memory._dump_snapshot(path)` pickles after
`torch.cuda.memory._record_memory_history(max_entries=...)`: plain dicts and lists (see `torch.cuda.memory._snapshot`
for the format). Two keys matter here:

* `device_traces[d]`: every allocator event on device d in order, each a dict with `action` ("alloc",
  "free_requested", "free_completed", "segment_alloc", "segment_free", ...), `addr`, `size` (bytes) and `frames`
  (the stack that asked: dicts with `filename`, `line`, `name`);
* `segments`: the allocator's state when the snapshot was taken: cudaMalloc'd segments split into `blocks`, each
  with `address`, `size` and `state` ("active_allocated", "active_awaiting_free", "inactive").

Memory counts as in use from its "alloc" until its "free_completed" (a free can wait on another stream; that is
also how `torch.cuda._memory_viz` counts it). `segment_*` events are the allocator's own cudaMalloc/cudaFree: they
change what is reserved, not what tensors hold. `load` reads a snapshot pickle (gzipped or not) with an
unpickler that builds nothing but plain containers, so a shipped artifact cannot run code. Nothing here needs CUDA.
"""

from __future__ import annotations

import gzip
import io
import pickle
from pathlib import Path

from labkit.env import LabkitError

IN_USE_STATES = ("active_allocated", "active_awaiting_free")  # blocks still counted until free_completed


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings and numbers only: a snapshot holds nothing else."""

    def find_class(self, module, name):
        raise LabkitError(f"this snapshot asks to build {module}.{name}: a memory snapshot holds only plain "
                          "dicts and lists, so it is refused (is it the pickle from _dump_snapshot?)")


def load(path: str | Path) -> dict:
    """The snapshot dict from a `_dump_snapshot` pickle at `path` (`.gz` files are decompressed)."""
    path = Path(path)
    if not path.is_file():
        raise LabkitError(f"no snapshot file at {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    snap = _PlainUnpickler(io.BytesIO(raw)).load()
    validate(snap)
    return snap


def validate(snapshot) -> None:
    """Raise LabkitError unless `snapshot` has the shape `_snapshot()` returns (segments, device_traces)."""
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot or "segments" not in snapshot:
        got = sorted(snapshot) if isinstance(snapshot, dict) else type(snapshot).__name__
        raise LabkitError(f"a memory snapshot is a dict with 'segments' and 'device_traces', got {got}")
    traces = snapshot["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise LabkitError("snapshot['device_traces'] must be a list (one per device) of lists of events")
    for t in traces:
        for e in t:
            if not isinstance(e, dict) or "action" not in e:
                raise LabkitError(f"a trace event must be a dict with an 'action', got {e!r:.80}")


def _events(snapshot: dict, device: int) -> list[dict]:
    validate(snapshot)
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise LabkitError(f"device {device} not in the snapshot: it has traces for {len(traces)} device(s)")
    return traces[device]


def baseline_bytes(snapshot: dict, device: int = 0) -> int:
    """Bytes already in use when the trace begins (0 when recording started before the first allocation).

    Found from what the trace cannot account for: frees of addresses it never saw allocated, and blocks in use at
    the end whose address it never touched (recording started late, or the ring buffer of `max_entries` wrapped).
    """
    events, seen, base = _events(snapshot, device), set(), 0
    for e in events:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in seen:
            base += e["size"]
            seen.add(e["addr"])
    touched = {e.get("addr") for e in events if e["action"] in ("alloc", "free_requested", "free_completed")}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") in IN_USE_STATES and b.get("address") not in touched:
                base += b["size"]
    return base


def in_use_timeline(snapshot: dict, device: int = 0) -> list[int]:
    """Bytes in use after each event of the trace (starting from `baseline_bytes`)."""
    now, out = baseline_bytes(snapshot, device), []
    for e in _events(snapshot, device):
        if e["action"] == "alloc":
            now += e["size"]
        elif e["action"] == "free_completed":
            now -= e["size"]
        out.append(now)
    return out


def peak(snapshot: dict, device: int = 0) -> dict:
    """{"peak_bytes", "peak_event" (index in the trace), "baseline_bytes", "events"} of one device's trace."""
    line = in_use_timeline(snapshot, device)
    base = baseline_bytes(snapshot, device)
    if not line:
        return {"peak_bytes": base, "peak_event": None, "baseline_bytes": base, "events": 0}
    i = max(range(len(line)), key=line.__getitem__)
    return {"peak_bytes": max(base, line[i]), "peak_event": i, "baseline_bytes": base, "events": len(line)}


def largest_allocations(snapshot: dict, k: int = 5, device: int = 0) -> list[dict]:
    """The `k` largest "alloc" events of the trace, largest first (ties in trace order): size, frames, index."""
    if not (isinstance(k, int) and k >= 1):
        raise LabkitError(f"k must be an integer >= 1, got {k!r}")
    allocs = [(i, e) for i, e in enumerate(_events(snapshot, device)) if e["action"] == "alloc"]
    allocs.sort(key=lambda ie: (-ie[1]["size"], ie[0]))
    return [{"size": e["size"], "frames": e.get("frames", []), "event": i, "addr": e.get("addr")}
            for i, e in allocs[:k]]


def alive_at_peak(snapshot: dict, device: int = 0) -> list[dict]:
    """The allocations made in the trace and still in use at its peak, largest first (what the peak is made of)."""
    where = peak(snapshot, device)["peak_event"]
    live: dict = {}
    for i, e in enumerate(_events(snapshot, device)[: (where or 0) + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = {"size": e["size"], "frames": e.get("frames", []), "event": i, "addr": e["addr"]}
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return sorted(live.values(), key=lambda r: (-r["size"], r["event"]))


def _is_library(filename: str) -> bool:
    """torch's own frames, the standard library's and unnamed ones (labkit's count as user code)."""
    if not filename or filename.startswith(("<", "??")) or "/torch/" in filename:
        return True
    return "/lib/python3" in filename and "labkit" not in filename


def user_frame(frames: list[dict]) -> str:
    """The innermost frame outside torch and the standard library, as "file:line in name" ("?" if none)."""
    for f in frames:
        fn = str(f.get("filename", ""))
        if not _is_library(fn) and not fn.endswith((".cpp", ".h", ".cu")):
            return f"{Path(fn).name}:{f.get('line', '?')} in {f.get('name', '?')}"
    return "?"


def describe(snapshot: dict, k: int = 5, device: int = 0) -> str:
    """Text: the peak, and the `k` largest allocations with the line of user code behind each."""
    p = peak(snapshot, device)
    lines = [f"{p['events']} events; peak in use {p['peak_bytes'] / 2**20:,.1f} MiB at event {p['peak_event']} "
             f"(already in use when recording began: {p['baseline_bytes'] / 2**20:,.1f} MiB)"]
    for r in largest_allocations(snapshot, k, device):
        lines.append(f"  {r['size'] / 2**20:9.2f} MiB  event {r['event']:>6}  from {user_frame(r['frames'])}")
    return "\n".join(lines)


def synthetic_snapshot() -> dict:
    """A small hand-made snapshot in `_snapshot()`'s format, for reading on a machine with no recorded artifact.

    It tells a short training step: weights, a forward pass that saves activations, a backward pass that frees them
    and makes gradients, one free delayed by another stream (free_requested long before free_completed), an
    address reused, and the allocator's own segment events (which hold no tensor)."""
    def frame(line, name, filename="train.py"):
        return [{"filename": filename, "line": line, "name": name},
                {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call"}]

    mib = 2**20
    ev = [("segment_alloc", 0x1000_0000, 64 * mib, frame(10, "build_model")),
          ("alloc", 0x1000_0000, 8 * mib, frame(10, "build_model")),       # weights
          ("alloc", 0x1080_0000, 1 * mib, frame(20, "forward")),           # input batch
          ("alloc", 0x1090_0000, 16 * mib, frame(21, "forward")),          # activation 1
          ("alloc", 0x1190_0000, 12 * mib, frame(22, "forward")),          # activation 2
          ("free_requested", 0x1080_0000, 1 * mib, frame(23, "forward")),  # input freed late: side stream
          ("alloc", 0x1250_0000, 4 * mib, frame(24, "loss")),
          ("free_requested", 0x1250_0000, 4 * mib, frame(24, "loss")),
          ("free_completed", 0x1250_0000, 4 * mib, frame(24, "loss")),
          ("alloc", 0x1250_0000, 8 * mib, frame(30, "backward")),          # gradients, reusing the address
          ("free_requested", 0x1190_0000, 12 * mib, frame(31, "backward")),
          ("free_completed", 0x1190_0000, 12 * mib, frame(31, "backward")),
          ("free_completed", 0x1080_0000, 1 * mib, frame(23, "forward")),
          ("free_requested", 0x1090_0000, 16 * mib, frame(32, "backward")),
          ("free_completed", 0x1090_0000, 16 * mib, frame(32, "backward")),
          ("segment_alloc", 0x2000_0000, 32 * mib, frame(40, "optimizer_step")),
          ("alloc", 0x2000_0000, 16 * mib, frame(40, "optimizer_step")),   # Adam's state
          ("segment_free", 0x3000_0000, 2 * mib, frame(41, "optimizer_step"))]
    trace = [{"action": a, "addr": addr, "size": size, "stream": 0, "frames": fr} for a, addr, size, fr in ev]
    live = {0x1000_0000: 8 * mib, 0x1250_0000: 8 * mib, 0x2000_0000: 16 * mib}
    segments = [{"device": 0, "address": addr, "total_size": 32 * mib, "stream": 0, "segment_type": "large",
                 "allocated_size": size, "active_size": size,
                 "blocks": [{"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                             "frames": []}]} for addr, size in live.items()]
    return {"segments": segments, "device_traces": [trace]}


RECORD_FOLDER = "week3_snapshot"  # under benchmarks/results/notebooks: what benchmarks/week3_snapshot.py wrote on a GPU
PRECISIONS = ("fp32", "bf16")


def recorded_folder() -> Path:
    """Where the recorded GPU snapshots live (benchmarks/results/notebooks/week3_snapshot, or the installed copy)."""
    from labkit.bench import result_path

    return result_path(RECORD_FOLDER, topic="notebooks")


def recorded_snapshots() -> dict[str, Path]:
    """{precision: path} of the recorded ResNet-18 snapshots present here ({} before they are recorded)."""
    folder = recorded_folder()
    out = {}
    for p in PRECISIONS:
        for suffix in (".pickle.gz", ".pickle"):
            path = folder / f"resnet18_{p}{suffix}"
            if path.is_file():
                out[p] = path
                break
    return out


def recorded_record() -> dict | None:
    """The JSON record written beside the recorded snapshots (card, torch, commit, command, peaks), or None."""
    import json

    path = recorded_folder() / "week3_snapshot.json"
    return json.loads(path.read_text()) if path.is_file() else None

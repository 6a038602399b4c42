"""The sandboxed side of a check: import the student's file and answer the trusted side's requests.

    python -m autograder.student.runner --fd N [--student FILE] [--device DEV]

Requests arrive on socket N (see `channel`): {"id", "op": "call", "probe": "labN.name", "params": {...}}.
The probe `labN.name` is the function `probe_name` in `autograder.student.labN`; its return value (JSON values
and tensors) goes back as {"id", "ok": true, "result": ...}, a failure of the student's code as
{"id", "ok": false, "error": "one line"}. A process without --student serves the baseline's probes, so the
baseline is timed in a process that never held student code. Nothing this process says is a verdict.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import socket
import sys
import warnings

from autograder.student import channel
from autograder.student.probes import Probe, StudentError, one_line

_PROBE = re.compile(r"^(lab\d+|toy)\.([a-z_][a-z0-9_]*)$")


def _setup(device: str):
    import torch

    from labkit.env import pick_device

    dev = pick_device(device)
    torch.backends.cudnn.benchmark = False
    threads = os.environ.get("LABKIT_TORCH_THREADS", "")  # autograder.sandbox.pinning: the baseline's and the student's
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # before the student's code loads: both runners start equal
    elif dev.type == "cpu":
        # One intra-op thread: on a small or busy machine extra OpenMP threads spin-wait on each other and make
        # small ops 10-100x slower, so CPU timings would measure the machine's load, not the code.
        torch.set_num_threads(1)
    return dev


def handle(req: dict, probe: Probe) -> dict:
    """One request to one reply; never raises for the student's failures."""
    rid = req.get("id")
    name = req.get("probe", "")
    m = _PROBE.match(name) if isinstance(name, str) else None
    if req.get("op") != "call" or not m:
        return {"id": rid, "ok": False, "error": f"unknown request {str(name)[:80]!r}", "kind": "protocol"}
    try:
        fn = getattr(importlib.import_module(f"autograder.student.{m.group(1)}"), f"probe_{m.group(2)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(probe, req.get("params") or {})
        return {"id": rid, "ok": True, "result": result}
    except StudentError as e:
        return {"id": rid, "ok": False, "error": str(e)[:2000], "kind": "student"}
    except Exception as e:  # a probe's own failure on odd student output: still the student's answer
        return {"id": rid, "ok": False, "error": f"{type(e).__name__}: {one_line(e)}", "kind": "probe"}


def serve(sock: socket.socket, student_file: str | None, device: str) -> int:
    # torch is imported on a probe's first use of the device: the toy assignment's probes never need it
    probe = Probe(student_file, lambda: _setup(device), {})
    channel.send(sock, {"ready": True, "pid": os.getpid()})
    while True:
        try:
            req = channel.recv(sock)
        except (channel.ChannelError, OSError):
            return 0
        if not isinstance(req, dict) or req.get("op") == "bye":
            return 0
        channel.send(sock, handle(req, probe))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autograder.student.runner")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--student", default=None)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    sys.dont_write_bytecode = True
    os.environ.setdefault("TQDM_DISABLE", "1")
    sock = socket.socket(fileno=a.fd)
    return serve(sock, a.student, a.device)


if __name__ == "__main__":
    sys.exit(main())

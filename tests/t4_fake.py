"""A faked Tesla T4 (the free Colab GPU: compute capability 7.5, fp16 tensor cores, bf16 only emulated) on a
CPU-only machine, for tests. The one supported way to fake that card; it lives in tests/ only, so no product code
and no grading run can ever believe it.

Every hardware fact the kit reads (name, compute capability, memory, SM count, bf16 emulation) comes from
`labkit.env.gpu_facts`; `fake_t4()` makes it report a T4 for every device, the CPU included, while
`torch.cuda.is_available()` stays False: `pick_device()` still picks the CPU and tensors compute there. The
decisions (capabilities, amp_precision, waves.sm_count, lab 4's tier class and reference twin) follow the T4;
timings stay CPU timings (`environment()` names the CPU and adds "simulated_gpu"). The torch.cuda property queries
that labkit.train reads directly are faked too, so a plan for torch.device("cuda", 0) (plan_ladder, check_config)
sees the same card. Cells and functions that branch on where tensors live (`DEVICE.type == "cuda"`) keep their
CPU branch: those launch CUDA kernels, which no fake can run.

    with fake_t4():                     # in a test (or the `t4` fixture of tests/test_t4_fake.py)
        assert amp_precision() == "fp16"
    with fake_t4(cuda_device=True):     # "cuda" resolves too: for decisions about a cuda device only
        plan_ladder(torch.device("cuda", 0), quick=False)

    python tests/t4_fake.py SPEC.json OUT.json   # run notebook cells under the fake (see run_cells)
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path
from unittest import mock

T4_NAME = "Tesla T4"
T4_CAPABILITY = (7, 5)
T4_MEMORY_BYTES = 15_655_829_504  # what torch reports for a 16 GB T4 (15 GiB usable plus change), bytes
T4_SMS = 40


def t4_facts():
    """The T4 as labkit.env.GpuFacts, marked simulated."""
    from labkit.env import GpuFacts

    return GpuFacts(name=T4_NAME, capability=T4_CAPABILITY, memory_bytes=T4_MEMORY_BYTES,
                    multiprocessors=T4_SMS, bf16_emulated=True, simulated=True)


@contextlib.contextmanager
def fake_gpu(facts, *, cuda_device: bool = False):
    """Within the block every device reports the card `facts` (a labkit.env.GpuFacts); tensors compute on the CPU.

    cuda_device=True also makes torch.cuda.is_available() say yes, so that decisions about an explicit "cuda"
    device (capabilities("cuda"), pick_device, doctor) can be asked; then nothing may put a tensor there, and
    pick_device() picks "cuda": use it for decisions only, never to run a notebook.
    """
    import torch

    from labkit import env

    props = mock.Mock(major=facts.capability[0], minor=facts.capability[1], total_memory=facts.memory_bytes,
                      multi_processor_count=facts.multiprocessors)
    props.name = facts.name  # Mock(name=...) would name the mock, not set the attribute
    fakes = [("get_device_capability", lambda device=None: facts.capability),
             ("get_device_name", lambda device=None: facts.name),
             ("get_device_properties", lambda device=None: props),
             ("is_bf16_supported", lambda *a, **k: True)]  # what torch answers on every card: it emulates bf16
    if cuda_device:
        fakes += [("is_available", lambda: True), ("device_count", lambda: 1), ("current_device", lambda: 0)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(env, "gpu_facts", lambda device=None: facts))
        for attr, fake in fakes:
            stack.enter_context(mock.patch.object(torch.cuda, attr, fake))
        yield facts


def fake_t4(*, cuda_device: bool = False):
    """`fake_gpu` with a Tesla T4: every device reports the T4's facts; tensors still compute on the CPU."""
    return fake_gpu(t4_facts(), cuda_device=cuda_device)


def run_cells(spec: dict) -> dict:
    """Run notebook cells under the fake: spec {"notebooks": {name: [[cell index, source], ...]}, "cwd": folder}.

    Each notebook gets a fresh namespace, cells run in order; returns {name: {cell index: {"stdout", "error"}}}
    (error is the exception's last traceback line, or None). A notebook stops at its first error.
    """
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.show = lambda *a, **k: plt.close("all")
    os.chdir(spec["cwd"])
    out = {}
    with fake_t4():
        for name, cells in spec["notebooks"].items():
            ns, rec = {"__name__": "__main__", "display": print}, {}
            out[name] = rec
            for index, source in cells:
                buf = io.StringIO()
                error = None
                try:
                    with contextlib.redirect_stdout(buf):
                        exec(compile(source, f"<{name} cell {index}>", "exec"), ns)
                except Exception:  # the test reports it with the cell's output
                    error = traceback.format_exc().strip().splitlines()[-1]
                rec[str(index)] = {"stdout": buf.getvalue(), "error": error}
                plt.close("all")
                if error:
                    break
    return out


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    Path(out_path).write_text(json.dumps(run_cells(json.loads(Path(spec_path).read_text()))))

"""A corpus of GPU traces from plain PyTorch programs, and how well `labkit.diagnosis.diagnose` reads them.

    python benchmarks/trace_corpus.py                 # CUDA GPU: all programs, about 3-5 minutes on an H100
    python benchmarks/trace_corpus.py --only sync_per_sample_metrics,big_matmul
    python benchmarks/trace_corpus.py --rediagnose    # no GPU: diagnose the committed traces again

Each program below is a small training loop written the way people write them, with torch, torchvision and PIL
only (no labkit): a torchvision-style loader with heavy PIL transforms, loops that read `.item()`, tiny
operators, small and big models. Each carries the label(s) it was built to show: one cause, or for a mixed
program the top two causes (either order). Each runs in its own process under a plain torch.profiler schedule
(`prof.step()` once per iteration, a few active steps), and its trace is saved gzipped beside the results.
The runner then diagnoses every trace and writes `trace_corpus.json` (card, torch, git commit, command, per
trace intended vs diagnosed, accuracy) into the same folder, benchmarks/results/diagnosis/trace_corpus/ by default;
tests/test_diagnosis.py re-diagnoses the committed traces on a CPU and fails on any regression.

    python benchmarks/trace_corpus.py --hta          # no GPU: cross-check with Holistic Trace Analysis

`--hta` (pip install 'labkit[hta]'; after recording it runs by itself where HTA is installed) reads every
committed trace with Holistic Trace Analysis (`labkit.hta`) beside `diagnose` and writes hta_crosscheck.json:
per trace ours, theirs (temporal breakdown, idle time split into host wait / kernel wait / other, kernel launch
statistics) and each quantity both measure, agree or not and why not, with HTA's version. HTA has no data or
sync cause (all three look like host wait to it), so the verdicts compare as host-bound vs GPU-bound;
tests/test_diagnosis.py keeps the file in step with the corpus and docs/results/diagnosis.md.

Without a CUDA GPU the runner says so and exits with status 2, writing nothing. `--rediagnose` needs no GPU: it
runs the current `diagnose` over the traces already in the folder and rewrites only the verdicts (`diagnosed`,
`correct`, `accuracy`, `why_missed` per miss, `diagnosed_with`, `disagreements`), keeping how and where they were
recorded.

    python benchmarks/trace_corpus.py --only sync_grad_norm_logging,mixed_loader_and_item --out /tmp/new
    python benchmarks/trace_corpus.py --merge /tmp/new   # no GPU: into benchmarks/results/diagnosis/trace_corpus/

To re-record a few programs, record them into a fresh folder and `--merge` it: each new trace and row replaces the
one of the same name (the row keeps where it was recorded under "recorded"), the HTA cross-check is redone where
HTA is installed (otherwise it says to run `--hta`), and the whole corpus is diagnosed again. Programs in
REMOVABLE are also timed without the profiler as written and with their suspected cause taken out (reads dropped,
an instant loader); the row's "intervention" sets the share of the step that saved beside the share the diagnosis
gives that cause.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "diagnosis" / "trace_corpus"
NAME = "trace_corpus"
TRACE_LIMIT_BYTES = 1_500_000
HTA_NAME = "hta_crosscheck"  # the Holistic Trace Analysis cross-check's results file, beside trace_corpus.json

# ------------------------------------------------------------------------------------------- the programs
# Each program: train(step_done, steps, device) runs `steps` iterations and calls step_done() after each one,
# where a plain script calls prof.step(). Torch is imported inside: the runner itself runs without a GPU.


def _jpeg_bank(n: int = 64, size: int = 320) -> list[bytes]:
    """`n` photo-sized JPEGs in memory (smooth random colour fields, so they compress like photos)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((size, size), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class _JpegFolder:
    """A torchvision-style dataset: decode a JPEG with PIL, then the usual training transforms."""

    def __init__(self, length: int, heavy: bool = True, size: int = 224):
        from torchvision import transforms as T

        self.bank, self.length = _jpeg_bank(), length
        aug = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
        if heavy:
            aug += [T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.RandomRotation(10)]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        from PIL import Image

        img = Image.open(io.BytesIO(self.bank[i % len(self.bank)])).convert("RGB")
        return self.tf(img), i % 10


def _resnet_step(device, batch_size):
    import torch
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss, logits
    return model, step


def pil_transforms_few_workers(step_done, steps, device):
    """ResNet-18 on 224 px JPEGs decoded and augmented by PIL (crop, flip, colour jitter, rotation) in 2
    DataLoader workers: the workers cannot keep up with the GPU."""
    import torch

    loader = torch.utils.data.DataLoader(_JpegFolder(10_000), batch_size=128, shuffle=True, num_workers=2,
                                         pin_memory=True, drop_last=True)
    _, step = _resnet_step(device, 128)
    for i, (x, y) in enumerate(loader):
        step(x.to(device, non_blocking=True).to(memory_format=torch.channels_last), y.to(device, non_blocking=True))
        step_done()
        if i + 1 == steps:
            break


def slow_decode_workers0(step_done, steps, device):
    """A small CNN fed by a DataLoader with num_workers=0 (the default) that decodes PNG files with PIL and
    augments in numpy: the loading runs in the training loop itself."""
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(32):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())

    class PngDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            a = np.asarray(Image.open(io.BytesIO(pngs[i % len(pngs)])).convert("RGB"), dtype=np.float32) / 255
            if rng.random() < 0.5:
                a = a[:, ::-1]
            a = (a - a.mean((0, 1))) / (a.std((0, 1)) + 1e-5)
            return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), i % 10

    loader = torch.utils.data.DataLoader(PngDataset(), batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(32 * 24 * 24, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()
        if i + 1 == steps:
            break


def _mlp(device, width=1024, depth=4, inp=3 * 32 * 32):
    import torch

    layers, d = [], inp
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(d, 10)).to(device)


def sync_per_sample_metrics(step_done, steps, device):
    """An MLP on resident data whose loop then counts correct predictions one sample at a time
    (`if pred[i] == y[i]`) and adds loss.item() to a running total: 257 host syncs per step."""
    import torch

    model = _mlp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 3 * 32 * 32, device=device), torch.randint(0, 10, (256,), device=device)
    running, correct = 0.0, 0
    for _ in range(steps):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
        pred = out.argmax(1)
        for i in range(len(y)):
            if pred[i] == y[i]:
                correct += 1
        step_done()


# Estimate on an H100 (from the committed traces): under the profiler each .item() read costs the host about 65 us
# during which the GPU, with nothing queued, is idle (sync_grad_norm_logging's first recording: 51 reads, 3.3 ms of
# idle after syncs; sync_per_sample_metrics: 57 us per read), and each autograd layer of an MLP about 330 us of host
# time for forward and backward (the same recording: 25 layers in 8.3 ms). Here 12 parameters x 5 statistics + the
# loss = 61 reads = about 4 ms of GPU idle charged to sync per step. The six layers at batch 1024 in fp32 (no TF32
# for matmuls by default) are about 45 GFLOP for forward and backward: about 1 ms at a realistic 45 TFLOP/s of
# CUDA-core fp32, matmul kernels of about 50 us instead of 5; the host needs about 2 ms to launch them, so up to
# 1 ms more idles as launch/Python. Expected: sync about 55-65%, compute and launch/Python 15-25% each.
# Intervention: the same loop without the statistics (remove="reads").
def sync_grad_norm_logging(step_done, steps, device, remove=None):
    """An MLP (3072-1024x4-10, fp32, batch 1024) whose loop logs gradient statistics for every parameter before
    the optimizer step (norm, mean, std, largest magnitude and share of zeros, read with .item() into a dict of
    floats for a logger): 61 host syncs per step, each after a kernel of a few microseconds."""
    import torch

    model = _mlp(device, width=1024, depth=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(1024, 3 * 32 * 32, device=device), torch.randint(0, 10, (1024,), device=device)
    log = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if remove != "reads":
            stats = {"loss": loss.item()}
            for name, p in model.named_parameters():
                g = p.grad
                stats.update({f"{name}/norm": g.norm().item(), f"{name}/mean": g.mean().item(),
                              f"{name}/std": g.std().item(), f"{name}/absmax": g.abs().max().item(),
                              f"{name}/zeros": (g == 0).float().mean().item()})
            log.append(stats)
        opt.step()
        step_done()


def tiny_op_rnn(step_done, steps, device):
    """A hand-written LSTM cell unrolled over 64 time steps in Python, hidden size 64, batch 16: hundreds of
    tiny kernels per step."""
    import torch

    hidden, inp, T = 64, 32, 64
    cell = torch.nn.LSTMCell(inp, hidden).to(device)
    head = torch.nn.Linear(hidden, 1).to(device)
    opt = torch.optim.SGD(list(cell.parameters()) + list(head.parameters()), lr=0.01)
    xs, target = torch.randn(T, 16, inp, device=device), torch.randn(16, 1, device=device)
    for _ in range(steps):
        h = c = torch.zeros(16, hidden, device=device)
        for t in range(T):
            h, c = cell(xs[t], (h, c))
            h = torch.tanh(h) * 0.5 + h * 0.5  # a little custom gating, op by op
        loss = (head(h) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()


def small_batch_mlp(step_done, steps, device):
    """MNIST-sized MLP (784-256-256-10) at batch 32 with Adam, 20 optimizer steps per profiled step: every
    kernel is a few microseconds, so the GPU waits for Python to launch the next one."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    data = [(torch.randn(32, 784, device=device), torch.randint(0, 10, (32,), device=device)) for _ in range(20)]
    for _ in range(steps):
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        step_done()


def big_matmul(step_done, steps, device):
    """A stack of four 8192x8192 linear layers in bf16 autocast, batch 8192: each step is seconds of tensor-core
    matmuls."""
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, bias=False) for _ in range(4)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8192, 8192, device=device)
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_done()


def big_conv(step_done, steps, device):
    """Five 3x3 convolutions of 256 channels at 112 px, batch 64, fp32 (cuDNN's default TF32 on Ampere+)."""
    import torch

    layers = [torch.nn.Conv2d(3, 256, 3, padding=1)] + [torch.nn.Conv2d(256, 256, 3, padding=1) for _ in range(4)]
    model = torch.nn.Sequential(*[m for conv in layers for m in (conv, torch.nn.ReLU())]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 3, 112, 112, device=device)
    for _ in range(steps):
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()


def transformer_block(step_done, steps, device):
    """Six transformer encoder layers (d_model 1024, 16 heads, scaled-dot-product attention), batch 16 x 1024
    tokens, bf16 autocast, fused AdamW."""
    import torch

    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(16, 1024, 1024, device=device)
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_done()


# Estimate on an H100 (from the committed traces): the first recording (ResNet-18 at 224 px, batch 64, 3 workers)
# waited 42 ms of a 62 ms step for data, about 3 ms per sample per worker; at 96 px the crop, ToTensor and
# Normalize shrink, so about 2 ms per sample: 128 samples / 3 workers = about 80 ms per batch. Its per-sample
# reads cost 27 us each (3.4 ms for 128); here 3 reads x 128 samples = 384 reads = about 10-20 ms per step, and the
# small CNN about 2 ms of host launches and under 1 ms of GPU work (ResNet-18 had 10 ms and 7 ms: it outranked
# the reads). Expected: data about 70% (a background loader the step waits on ranks first), sync about 15-20%,
# launch/Python and compute a few % each. Interventions: the reads taken out (remove="reads") and an instant
# loader, one batch already on the GPU (remove="data").
def mixed_loader_and_item(step_done, steps, device, remove=None):
    """A small CNN (three strided 3x3 convs with batch norm) on 96 px JPEGs decoded and cropped by PIL in 3
    DataLoader workers, batch 128, whose loop records each sample's loss and correctness with .item() (3 reads
    per sample) for a per-sample table: waiting for data and host syncs."""
    import torch

    nn = torch.nn
    loader = torch.utils.data.DataLoader(_JpegFolder(10_000, heavy=False, size=96), batch_size=128, shuffle=True,
                                         num_workers=3, pin_memory=True, drop_last=True)
    blocks = [m for cin, cout in ((3, 32), (32, 64), (64, 128))
              for m in (nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = loader
    if remove == "data":
        x0, y0 = next(iter(loader))
        batches = [(x0.to(device), y0.to(device))] * steps
    table = []
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        if remove != "reads":
            pred = logits.argmax(1)
            for j in range(len(y)):
                table.append((losses[j].item(), pred[j].item() == y[j].item()))
        step_done()
        if i + 1 == steps:
            break


def mixed_small_mlp_and_item(step_done, steps, device):
    """The small-batch MLP that prints its loss and gradient norm every micro-step (20 per profiled step):
    launch overhead and host syncs."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    data = [(torch.randn(32, 784, device=device), torch.randint(0, 10, (32,), device=device)) for _ in range(20)]
    for _ in range(steps):
        for k, (x, y) in enumerate(data):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            print(f"micro-step {k}: loss {loss.item():.4f} grad norm {gnorm.item():.3f}")
            if not torch.isfinite(loss):
                break
            opt.step()
        step_done()


def mixed_matmul_and_slow_loader(step_done, steps, device):
    """Two big bf16 linear layers fed by a num_workers=0 DataLoader that builds each sample in Python:
    GPU compute and loading, one after the other."""
    import torch

    class Features(torch.utils.data.Dataset):
        def __len__(self):
            return 1_000_000

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(4096, generator=g).tanh_(), i % 10

    loader = torch.utils.data.DataLoader(Features(), batch_size=2048)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 16384),
                                torch.nn.GELU(), torch.nn.Linear(16384, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_done()
        if i + 1 == steps:
            break


# Estimate on an H100 (from the committed traces): transformer_block (six of these layers at the same 16 x 1024
# tokens, bf16, fused AdamW) ran 30 ms of kernels per step, about 5 ms per layer, with kernels of 71 us on average
# and the GPU busy 97%; four layers here are about 20 ms of compute per step. The reads: 4 activation norms, the
# loss and 48 gradient norms = 53 per step at about 65 us of GPU idle each (sync_grad_norm_logging's first
# recording) = about 3.5 ms charged to sync; after each sync the host must fill the queue again, so some
# launch/Python idle (about 1 ms, transformer_block had 0.8 ms without any sync). Expected: compute about 75-80%,
# sync about 12-15%, launch/Python about 5%. Intervention: the same loop without the reads (remove="reads").
def mixed_transformer_and_sync(step_done, steps, device, remove=None):
    """Four transformer encoder layers (d_model 1024, 16 heads, pre-norm) at batch 16 x 1024 tokens, bf16
    autocast, fused AdamW, whose loop reads every layer's activation norm, the loss (stopping on NaN) and every
    parameter's gradient norm with .item() for its log: GPU compute interrupted by 53 host syncs per step."""
    import math

    import torch

    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(16, 1024, 1024, device=device)
    reads = remove != "reads"
    log = []
    for _ in range(steps):
        h, stats = x, {}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for k, lyr in enumerate(model.layers):
                h = lyr(h)
                if reads:
                    stats[f"act_norm/{k}"] = h.float().norm().item()
            loss = h.float().square().mean()
        if reads:
            stats["loss"] = loss.item()
            if not math.isfinite(stats["loss"]):
                break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if reads:
            stats.update({f"grad_norm/{n}": p.grad.norm().item() for n, p in model.named_parameters()})
        opt.step()
        log.append(stats)
        step_done()


def tiny_ops_elementwise(step_done, steps, device):
    """A custom activation and normalisation written op by op on a (64, 256) tensor, 40 times per step: small
    elementwise kernels, nothing to keep the GPU busy."""
    import torch

    w = torch.randn(256, 256, device=device, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1e-3)
    x = torch.randn(64, 256, device=device)
    for _ in range(steps):
        h = x
        for _ in range(40):
            h = h @ w * 0.05
            mu, var = h.mean(-1, keepdim=True), h.var(-1, keepdim=True)
            h = (h - mu) / torch.sqrt(var + 1e-5)
            h = h * torch.sigmoid(1.702 * h)
        loss = h.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()


# name: (program, intended causes (one, or the top two of a mixed program), wait steps before recording)
PROGRAMS = {
    "pil_transforms_few_workers": (pil_transforms_few_workers, ["data"], 6),
    "slow_decode_workers0": (slow_decode_workers0, ["data"], 2),
    "sync_per_sample_metrics": (sync_per_sample_metrics, ["sync"], 2),
    "sync_grad_norm_logging": (sync_grad_norm_logging, ["sync"], 2),
    "tiny_op_rnn": (tiny_op_rnn, ["overhead"], 2),
    "tiny_ops_elementwise": (tiny_ops_elementwise, ["overhead"], 2),
    "small_batch_mlp": (small_batch_mlp, ["overhead"], 2),
    "big_matmul": (big_matmul, ["compute"], 2),
    "big_conv": (big_conv, ["compute"], 2),
    "transformer_block": (transformer_block, ["compute"], 2),
    "mixed_loader_and_item": (mixed_loader_and_item, ["data", "sync"], 8),
    "mixed_small_mlp_and_item": (mixed_small_mlp_and_item, ["overhead", "sync"], 2),
    "mixed_matmul_and_slow_loader": (mixed_matmul_and_slow_loader, ["compute", "data"], 2),
    "mixed_transformer_and_sync": (mixed_transformer_and_sync, ["compute", "sync"], 2),
}
ACTIVE = 3  # steps recorded per trace: enough to average, few enough to keep traces small
# Programs that can run with their suspected cause taken out (their `remove` argument): the recorder times each
# variant without the profiler, so the label is confirmed by intervention as well as by reading the trace.
REMOVABLE = {"sync_grad_norm_logging": ["reads"], "mixed_loader_and_item": ["reads", "data"],
             "mixed_transformer_and_sync": ["reads"]}
TIMED_STEPS, TIMED_WARMUP = 8, 2  # steps timed per variant, after warm-up steps: a few seconds per program


# ------------------------------------------------------------------------------------ one program, profiled


def record(name: str, trace_path: Path) -> None:
    """Run one program under a plain torch.profiler schedule and write its trace, gzipped."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    program, _, wait = PROGRAMS[name]
    torch.manual_seed(0)
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "trace.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     schedule=schedule(wait=wait, warmup=1, active=ACTIVE, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(raw)) as prof:
            program(prof.step, wait + 1 + ACTIVE, device)
        torch.cuda.synchronize()
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        with open(raw, "rb") as f, gzip.open(trace_path, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
    if name in REMOVABLE:
        intervention_path(trace_path).write_text(json.dumps(intervene(name)))


def intervention_path(trace_path: Path) -> Path:
    """Where the recording process leaves its intervention timings for the runner (beside the trace)."""
    return trace_path.with_name(trace_path.name.replace(".pt.trace.json.gz", ".intervention.json"))


def _step_ms(name: str, remove: str | None) -> float | None:
    """Wall time of one step of program `name` (ms, no profiler), with `remove` taken out; None if it stopped
    early (a NaN loss)."""
    import torch

    program, n, marks = PROGRAMS[name][0], TIMED_WARMUP + TIMED_STEPS, {}

    def done():
        marks["steps"] = marks.get("steps", 0) + 1
        if marks["steps"] in (TIMED_WARMUP, n):
            torch.cuda.synchronize()
            marks[marks["steps"]] = time.perf_counter()

    torch.manual_seed(0)
    program(done, n, torch.device("cuda"), remove=remove)
    return (marks[n] - marks[TIMED_WARMUP]) / TIMED_STEPS * 1e3 if n in marks else None


def intervene(name: str) -> dict:
    """Time program `name` as written and with each removable cause taken out (no profiler): step ms, speed-up
    (x) and the share of the step saved, to set beside the share the diagnosis gives that cause."""
    base = _step_ms(name, None)
    out = {"step_ms": base, "steps_timed": TIMED_STEPS, "profiler": False, "removed": {}}
    for cause in REMOVABLE[name]:
        ms = _step_ms(name, cause)
        out["removed"][cause] = ({"step_ms": ms, "speedup": base / ms, "saved_share": 1 - ms / base}
                                 if ms and base else {"error": "stopped early"})
    return out


# ----------------------------------------------------------------------------------------------- the runner


def _diagnosed(path: Path) -> dict:
    from labkit.diagnosis import diagnose

    d = diagnose(path)
    return {"kind": d.kind, "verdict": d.verdict, "dominant": d.dominant,
            "causes": [{"cause": c["cause"], "share": round(c["share"], 4)} for c in d.causes],
            "reasons": d.reasons, "notes": d.notes,
            "evidence": {k: v for k, v in d.evidence.items() if k not in ("top", "notes")}}


def _correct(intended: list[str], causes: list[str]) -> bool:
    return causes[0] == intended[0] if len(intended) == 1 else set(causes[:2]) == set(intended)


def _accuracy(rows: list[dict]) -> dict:
    done = [r for r in rows if "correct" in r]
    single = [r for r in done if len(r["intended"]) == 1]
    mixed = [r for r in done if len(r["intended"]) > 1]
    return {"all": sum(r["correct"] for r in done) / max(1, len(done)),
            "single_cause": sum(r["correct"] for r in single) / max(1, len(single)),
            "mixed_top_two": sum(r["correct"] for r in mixed) / max(1, len(mixed)),
            "recorded": len(done), "failed": len(rows) - len(done)}


# Why a program missed its intended label, read off its trace (numbers filled in from the current evidence).
# Each is a finding about the program on the card it ran on, not a reason to relabel it.
WHY_MISSED = {
    "sync_grad_norm_logging": (
        "The program does not show a sync-bound step on an H100: its 24-layer, width-512 MLP at batch 128 is launch "
        "bound with or without the reads ({kernels_per_step:.0f} kernels per step averaging {mean_kernel_us:.1f} us, "
        "GPU busy {gpu_busy_share:.0%}). The {host_reads_per_step:.0f} device reads per step hold the host "
        "{read_share:.0%} of the step and wait in syncs {sync_wait_share:.0%} (the GPU has long run dry when each "
        "norm is read); the whole read loop (first to last read) spans {read_span_share:.0%} of the step, and charging every "
        "idle gap inside it to sync gives sync {sync_upper:.0%} against launch/Python {overhead_then:.0%}: forward, "
        "backward and the optimizer, which read nothing, leave the GPU idle most of the step."),
    "mixed_loader_and_item": (
        "Data is right; the second cause is not sync on an H100: the 128 per-sample .item() reads per step read "
        "values that are already computed (syncs wait {sync_wait_share:.0%} of the step) and the whole read loop spans "
        "{read_span_share:.0%} of the step ({read_share:.0%} inside the reads; charging every idle gap inside it to "
        "sync gives at most {sync_upper:.0%}), while ResNet-18 at batch 64 leaves the "
        "GPU idle {idle_overhead:.0%} of the step with the host launching ({kernels_per_step:.0f} kernels, "
        "{mean_kernel_us:.1f} us on average) and busy {gpu_busy_share:.0%}: launch/Python and compute both outweigh "
        "sync {idle_sync:.0%}."),
    "mixed_transformer_and_sync": (
        "The program does not show compute + sync on an H100: two layers of d_model 512 at 8 x 512 tokens keep the "
        "GPU busy only {gpu_busy_share:.0%} ({kernels_per_step:.0f} kernels per step averaging {mean_kernel_us:.1f} us), "
        "so the host launching is the limit; its {host_reads_per_step:.0f} device reads per step find the GPU already "
        "done (syncs wait {sync_wait_share:.0%} of the step, {read_share:.0%} of the step inside the reads): taking them "
        "out would buy a few percent. Compute ranks second, sync last."),
}


def _read_loop(path: Path) -> dict:
    """The read loop of each step (first to last device read): its share of the step, and the sync share if
    every GPU idle gap inside it were charged to sync as well (an upper bound on what taking it out buys)."""
    from labkit import diagnosis as D

    win = D._find_window(D._timed_events(D.load_trace(path)), [])
    sig = D._host_signals(win)
    loops = []
    for s in win.steps:
        mine = [e for e in sig["reads"] if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        if mine:
            loops.append((min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)))
    loops = D._union(loops)
    data_iv, _ = D._data_waits(win, [])
    busy = D._union(D._clip(D._spans(win.gpu), win.w0, win.w1))
    cause, _ = D._idle_causes(D._gaps(busy, win.w0, win.w1), data_iv, D._union(D._spans(sig["syncs"])), [])
    extra = 0.0
    for x0, x1 in D._gaps(busy, win.w0, win.w1):
        near_sync = D._overlap_all(D._union(D._spans(sig["syncs"])), x0 - D.SYNC_TOLERANCE_US,
                                   x0 + D.SYNC_TOLERANCE_US) > 0
        if not near_sync:
            extra += max(0.0, D._overlap_all(loops, x0, x1) - D._overlap_all(data_iv, x0, x1))
    return {"read_span_share": D._length(loops) / win.span, "sync_upper": (cause["sync"] + extra) / win.span,
            "overhead_then": (cause["overhead"] - extra) / win.span}


def _why_missed(name: str, path: Path, diagnosed: dict, how: str | None = None) -> str:
    ev = diagnosed["evidence"]
    # WHY_MISSED explains the programs as first written; a trace of a program since redesigned (its recorded
    # `how` is no longer the program's description) keeps it, a trace of the current program does not.
    if name not in WHY_MISSED or (name in REMOVABLE and how == " ".join(PROGRAMS[name][0].__doc__.split())):
        return "not yet explained: read the trace"
    return WHY_MISSED[name].format(**ev, **_read_loop(path), idle_overhead=ev["idle_by_cause"]["overhead"],
                                   idle_sync=ev["idle_by_cause"]["sync"])


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "labkit", "benchmarks/trace_corpus.py"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _hta_disagreements(out: Path) -> str:
    """One line for trace_corpus.json: where the HTA cross-check is and what it found."""
    path = out / f"{HTA_NAME}.json"
    if not path.exists():
        return ("no Holistic Trace Analysis cross-check in this folder: run `python benchmarks/trace_corpus.py "
                "--hta` where HTA is installed; no agreement or disagreement is claimed")
    return f"see {path.name}: " + json.loads(path.read_text())["summary"]["text"]


def _hta_row(row: dict, trace: Path) -> dict:
    """One trace read by both tools: ours, theirs and the quantity-by-quantity checks."""
    from labkit import hta
    from labkit.diagnosis import diagnose

    d = diagnose(trace)
    ev = d.evidence
    theirs = hta.hta_summary(trace)
    exact = hta.hta_summary(trace, exact=True)
    theirs.pop("version")
    exact.pop("version")
    checks = hta.compare(ev, theirs, exact)
    ours = {"verdict": d.verdict, "causes": [{"cause": c["cause"], "share": round(c["share"], 4)} for c in d.causes],
            **{k: ev[k] for k in ("gpu_idle_share", "idle_by_cause", "mean_kernel_us", "kernels_per_step",
                                  "syncs_per_step", "sync_wait_share", "launch_ms_per_step")}}
    return {"name": row["name"], "file": row["file"], "intended": row["intended"], "ours": ours, "theirs": theirs,
            "theirs_without_rounding": exact, "checks": checks, "agree": all(c["agree"] for c in checks),
            "disagree_on": [c["quantity"] for c in checks if not c["agree"]]}


def _hta_summary(rows: list[dict]) -> dict:
    by_q: dict[str, list[int]] = {}
    for r in rows:
        for c in r["checks"]:
            by_q.setdefault(c["quantity"], [0, 0])
            by_q[c["quantity"]][0] += bool(c["agree"])
            by_q[c["quantity"]][1] += 1
    agree = sum(r["agree"] for r in rows)
    off = {q: [r["name"] for r in rows if q in r["disagree_on"]] for q in by_q if by_q[q][0] < by_q[q][1]}
    text = (f"HTA and labkit agree on every compared quantity on {agree} of {len(rows)} traces; "
            + "; ".join(f"{q}: {by_q[q][0]} of {by_q[q][1]} agree" for q in by_q)
            + (". Disagreements: " + "; ".join(f"{q} on {', '.join(n)}" for q, n in off.items()) if off else ""))
    why = {q: next(c["why"] for r in rows for c in r["checks"] if c["quantity"] == q and not c["agree"])
           for q in off}
    return {"traces": len(rows), "agree_all": agree, "by_quantity": {q: {"agree": a, "of": n}
                                                                    for q, (a, n) in by_q.items()},
            "disagreements": off, "why": why, "text": text}


def hta_crosscheck(out: Path, log=print) -> Path:
    """Read every trace of the corpus in `out` with Holistic Trace Analysis beside labkit's diagnose and write
    hta_crosscheck.json: per trace ours, theirs and each compared quantity (agree or not, and why not), with
    HTA's version. No GPU needed; raises LabkitError where HTA is not installed or the corpus is missing."""
    from labkit import hta
    from labkit.bench import write_json
    from labkit.env import LabkitError

    index = out / f"{NAME}.json"
    if not index.exists():
        raise LabkitError(f"no {index.name} in {out}: record the corpus first on a CUDA GPU")
    version = hta._require()
    rows = []
    for row in json.loads(index.read_text())["traces"]:
        trace = out / row["file"]
        if "error" in row or not trace.exists():
            continue
        rows.append(_hta_row(row, trace))
        log(f"  {row['name']:<30} {'agree' if rows[-1]['agree'] else 'differ on ' + ', '.join(rows[-1]['disagree_on'])}")
    rec = {"name": HTA_NAME, "hta_version": version, "labkit_commit": _git_commit(),
           "how": "python benchmarks/trace_corpus.py --hta: HTA's TraceAnalysis per trace (rank 0, last profiler "
                  "step kept), its temporal breakdown, idle-time breakdown (consecutive_kernel_delay "
                  f"{hta.KERNEL_WAIT_US} us) and CUDA kernel launch stats, against labkit.diagnosis.diagnose; "
                  "`theirs` is HTA as installed, `theirs_without_rounding` the same with HTA_DISABLE_NS_ROUNDING=1",
           "rules": {"idle_agree": hta.IDLE_AGREE, "exact_idle_agree": hta.EXACT_AGREE, "kernel_agree": hta.KERNEL_AGREE,
                     "compute_idle": hta.COMPUTE_IDLE, "launch_bound_delay_us": hta.LAUNCH_BOUND_DELAY_US},
           "summary": _hta_summary(rows), "traces": rows}
    path = out / f"{HTA_NAME}.json"
    write_json(path, rec)
    os.chmod(path, 0o644)
    return path


def rediagnose(out: Path, log=print) -> Path:
    """Diagnose the committed traces in `out` again (no GPU) and rewrite trace_corpus.json's verdicts, keeping
    the recording record (env, how, schedule); returns the path of the JSON (mode 644)."""
    from labkit.bench import write_json
    from labkit.env import LabkitError

    path = out / f"{NAME}.json"
    if not path.exists():
        raise LabkitError(f"no {path.name} in {out}: record the corpus first on a CUDA GPU")
    rec = json.loads(path.read_text())
    for row in rec["traces"]:
        trace = out / row["file"]
        if "error" in row or not trace.exists():
            continue
        row["diagnosed"] = _diagnosed(trace)
        row["correct"] = _correct(row["intended"], [c["cause"] for c in row["diagnosed"]["causes"]])
        row.pop("why_missed", None)
        if not row["correct"]:
            row["why_missed"] = _why_missed(row["name"], trace, row["diagnosed"], row.get("how"))
        log(f"  {row['name']:<30} intended {'+'.join(row['intended']):<16} diagnosed "
            f"{row['diagnosed']['verdict']:<40} {'ok' if row['correct'] else 'WRONG'}")
    rec["accuracy"] = _accuracy(rec["traces"])
    rec["diagnosed_with"] = f"{_git_commit()} (rediagnosed on CPU)"
    rec["disagreements"] = _hta_disagreements(out)
    write_json(path, rec)
    os.chmod(path, 0o644)  # write_json's temporary file is private; a results file is for everyone to read
    return path


def _with_shares(iv: dict, diagnosed: dict) -> dict:
    """The intervention timings with the diagnosed share of each removed cause beside the share it saved
    ("reads" stands for the sync cause)."""
    shares = {c["cause"]: c["share"] for c in diagnosed["causes"]}
    for cause, r in iv["removed"].items():
        r["diagnosed_share"] = shares["sync" if cause == "reads" else cause]
    return iv


def merge(src: Path, out: Path, log=print) -> Path:
    """Move the traces recorded into `src` (`--only ... --out <fresh folder>`) into the corpus in `out`: each
    replaces the row and trace of the same name, keeping where it was recorded under "recorded" (card, torch,
    commit, time, command); then the HTA cross-check is redone where HTA is installed and every trace is
    diagnosed again. No GPU needed; returns the path of trace_corpus.json."""
    from labkit import hta
    from labkit.bench import write_json
    from labkit.env import LabkitError

    src_index, index = src / f"{NAME}.json", out / f"{NAME}.json"
    for p in (src_index, index):
        if not p.exists():
            raise LabkitError(f"no {p.name} in {p.parent}: record there first")
    if src.resolve() == out.resolve():
        raise LabkitError(f"--merge {src} is the corpus folder itself: give the folder --only recorded into")
    new, rec = json.loads(src_index.read_text()), json.loads(index.read_text())
    env = new.get("env", {})
    recorded = {k: env.get(k) for k in ("timestamp", "device_name", "torch", "cuda", "git_commit", "command")}
    rows = {r["name"]: i for i, r in enumerate(rec["traces"])}
    moved = []
    for row in new["traces"]:
        if "error" in row or not (src / row["file"]).exists():
            log(f"  {row['name']:<30} not merged: {row.get('error', 'no trace file')}")
            continue
        shutil.copyfile(src / row["file"], out / row["file"])
        os.chmod(out / row["file"], 0o644)
        merged = {**row, "recorded": recorded}
        if row["name"] in rows:
            rec["traces"][rows[row["name"]]] = merged
        else:
            rec["traces"].append(merged)
        moved.append(row["name"])
    if not moved:
        raise LabkitError(f"nothing to merge from {src_index}: no trace recorded there")
    rec.setdefault("merged", []).append({"names": moved, **recorded})
    write_json(index, rec)
    os.chmod(index, 0o644)
    log(f"merged {', '.join(moved)} from {src}")
    if hta.version() is not None:
        hta_crosscheck(out, log=log)
    elif (out / f"{HTA_NAME}.json").exists():
        log(f"WARNING: {HTA_NAME}.json still reads the earlier traces of {', '.join(moved)}: run "
            f"`python benchmarks/trace_corpus.py --hta` where HTA is installed (pip install 'labkit[hta]')")
    return rediagnose(out, log=log)


def run_corpus(names: list[str], out: Path, log=print) -> dict:
    rows = []
    for name in names:
        program, intended, wait = PROGRAMS[name]
        trace = out / f"{name}.pt.trace.json.gz"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--record", name, "--trace", str(trace)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        row = {"name": name, "file": trace.name, "intended": intended, "how": " ".join(program.__doc__.split()),
               "schedule": {"wait": wait, "warmup": 1, "active": ACTIVE}, "record_s": time.perf_counter() - t0}
        if proc.returncode != 0 or not trace.exists():
            row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            log(f"  {name:<30} failed: {row['error']}")
            rows.append(row)
            continue
        row["bytes"] = trace.stat().st_size
        row["diagnosed"] = _diagnosed(trace)
        side = intervention_path(trace)
        if side.exists():
            row["intervention"] = _with_shares(json.loads(side.read_text()), row["diagnosed"])
            side.unlink()
        got = [c["cause"] for c in row["diagnosed"]["causes"]]
        row["correct"] = _correct(intended, got)
        if not row["correct"]:
            row["why_missed"] = _why_missed(name, trace, row["diagnosed"], row["how"])
        log(f"  {name:<30} intended {'+'.join(intended):<16} diagnosed {row['diagnosed']['verdict']:<40} "
            f"{'ok' if row['correct'] else 'WRONG'}  ({row['bytes'] / 1e3:.0f} kB)")
        rows.append(row)
    return {"traces": rows, "accuracy": _accuracy(rows)}


def _main_hta(out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from labkit.env import LabkitError

    try:
        path = hta_crosscheck(out)
    except LabkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.loads(path.read_text())["summary"]["text"] + f"; saved {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the traces and trace_corpus.json")
    ap.add_argument("--only", help=f"comma-separated programs (default: all of {', '.join(PROGRAMS)})")
    ap.add_argument("--record", metavar="PROGRAM", help=argparse.SUPPRESS)  # one program, in its own process
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--rediagnose", action="store_true",
                    help="no GPU needed: diagnose the traces in --out again and rewrite the verdicts in its JSON")
    ap.add_argument("--hta", action="store_true",
                    help="no GPU needed: cross-check the traces in --out with Holistic Trace Analysis (pip install "
                         "'labkit[hta]') and write hta_crosscheck.json")
    ap.add_argument("--merge", metavar="DIR",
                    help="no GPU needed: move the traces that --only recorded into DIR into the corpus in --out, "
                         "replacing those of the same name, and diagnose the corpus again")
    args = ap.parse_args(argv)
    if args.hta:
        return _main_hta(Path(args.out))
    if args.rediagnose or args.merge:
        sys.path.insert(0, str(ROOT))
        from labkit.env import LabkitError

        try:
            path = merge(Path(args.merge), Path(args.out)) if args.merge else rediagnose(Path(args.out))
        except LabkitError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        acc = json.loads(path.read_text())["accuracy"]
        print(f"accuracy: {100 * acc['all']:.0f}% of {acc['recorded']} traces (single cause "
              f"{100 * acc['single_cause']:.0f}%, mixed top two {100 * acc['mixed_top_two']:.0f}%); saved {path}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("trace_corpus records GPU traces and needs a CUDA GPU; this machine has none, so nothing was "
              "recorded", file=sys.stderr)
        return 2
    if args.record:
        if args.record not in PROGRAMS or not args.trace:
            ap.error("--record needs a program name and --trace PATH")
        sys.stdout = open(os.devnull, "w")  # the programs print the way their authors do; the runner does not
        record(args.record, Path(args.trace))
        return 0
    names = args.only.split(",") if args.only else list(PROGRAMS)
    for n in names:
        if n not in PROGRAMS:
            ap.error(f"unknown program {n!r}: choose from {', '.join(PROGRAMS)}")
    sys.path.insert(0, str(ROOT))
    from labkit import bench

    out = Path(args.out)
    print(f"recording {len(names)} traces on {torch.cuda.get_device_name()} into {out}")
    res = run_corpus(names, out)
    big = [r["name"] for r in res["traces"] if r.get("bytes", 0) > TRACE_LIMIT_BYTES]
    res["too_big_to_commit"] = big
    from labkit import hta

    res["disagreements"] = _hta_disagreements(out)
    path = bench.save_result(NAME, res, out_dir=out, device="cuda")
    if hta.version() is not None:  # the cross-check reads the index just saved, then the index says what it found
        hta_crosscheck(out)
        res["disagreements"] = _hta_disagreements(out)
        path = bench.save_result(NAME, res, out_dir=out, device="cuda")
    acc = res["accuracy"]
    print(f"accuracy: {100 * acc['all']:.0f}% of {acc['recorded']} traces (single cause "
          f"{100 * acc['single_cause']:.0f}%, mixed top two {100 * acc['mixed_top_two']:.0f}%); saved {path}")
    if big:
        print(f"WARNING: over {TRACE_LIMIT_BYTES / 1e6:.1f} MB, too big to commit: {', '.join(big)}")
    if args.only and out.resolve() != DEFAULT_OUT.resolve():
        print(f"to replace these traces in the committed corpus: python benchmarks/trace_corpus.py --merge {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

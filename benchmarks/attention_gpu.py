"""Week 3, section 12 on a GPU: naive attention against scaled_dot_product_attention as L grows.

    PYTHONPATH=. python3 benchmarks/attention_gpu.py                    # on an H200: under a minute
    PYTHONPATH=. python3 benchmarks/attention_gpu.py --device cpu --quick  # a dry run of the logic, tiny sizes

For L = 512 ... 8192 (batch 2, 8 heads, head_dim 64; float32 and bf16 inputs), times labkit's naive attention,
SDPA as PyTorch dispatches it, and SDPA forced onto each backend (flash, memory-efficient, cuDNN, math) that
accepts the inputs: the forward pass and forward + backward (torch.autograd.grad of q, k, v), inputs that require
grad as in training. The contenders run in interleaved rounds (labkit.kernels_bench.side_by_side: CUDA events,
one call per sample), each sample after warm-up; the record keeps the median and interquartile range. Peak memory
is the caching allocator's peak above what was held before the call (labkit.attention.peak_bytes), measured warm;
saved bytes are what autograd keeps for backward (labkit.attention.saved_bytes). Which backend SDPA picked is read
from the aten operator a profile of one call records. A contender that runs out of memory is recorded as skipped,
as are larger L for it. Last, one bf16-autocast training step of the block stack (labkit.attention.build_blocks,
the "small" preset) is profiled with naive attention and with SDPA, and its top operators by device time kept
(labkit.attention.top_ops). Saves benchmarks/results/kernels/attention_<card>.json (attention_h200.json on an H200).

It imports only torch and labkit modules that need nothing else (no matplotlib, tqdm or psutil). Without a CUDA GPU
it refuses, except for the --device cpu --quick dry run, which writes to a temporary folder unless --out is given:
CPU times of this sweep are the notebook's own.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

NO_GPU = ("attention_gpu.py records naive attention and SDPA on a CUDA GPU, and this machine has none. The week 3 "
          "notebook measures the CPU sweep itself; `--device cpu --quick` dry-runs this script's logic at tiny "
          "sizes (its times mean nothing).")
BACKENDS = ("flash", "efficient", "cudnn", "math")  # torch.nn.attention.SDPBackend members, in SDPA's own order
# Fragments of the aten operator each backend runs (the CPU's fused kernel is "_flash_attention_for_cpu").
BACKEND_OPS = (("_flash_attention", "flash"), ("_efficient_attention", "efficient"),
               ("_cudnn_attention", "cudnn"), ("_attention_math", "math"))


@dataclass(frozen=True)
class SweepConfig:
    seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    batch: int = 2
    heads: int = 8
    head_dim: int = 64
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    reps: int = 15     # timed rounds per contender, after warm-up (small L is launch-bound: noisy)
    warmup: int = 3    # untimed calls per contender before the rounds
    profile_seq_len: int = 8192  # the profiled training step's L: the sweep's longest
    profile_preset: str = "small"  # labkit.attention.TINY_PRESETS name for the profiled step
    profile_batch: int = 2

    def check(self) -> None:
        from labkit.attention import TINY_PRESETS
        from labkit.env import LabkitError

        if not self.seq_lens or min(self.seq_lens) < 1 or min(self.batch, self.heads, self.head_dim) < 1:
            raise LabkitError(f"the sweep needs positive sizes, got {self}")
        if self.reps < 5 or self.warmup < 1:
            raise LabkitError(f"need at least 5 timed rounds and 1 warm-up call, got reps={self.reps}, "
                              f"warmup={self.warmup}")
        bad = sorted(set(self.dtypes) - {"float32", "bfloat16", "float16"})
        if bad:
            raise LabkitError(f"unknown dtype(s) {bad}: use float32, bfloat16 or float16")
        if self.profile_preset not in TINY_PRESETS:
            raise LabkitError(f"unknown preset {self.profile_preset!r}: choose from {', '.join(TINY_PRESETS)}")


PRESETS = {
    "full": SweepConfig(),
    "quick": SweepConfig(seq_lens=(64, 128), batch=1, heads=2, head_dim=16, reps=5, warmup=1, profile_seq_len=64,
                         profile_preset="tiny", profile_batch=1),
}


def say(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)


def forced(backend: str):
    """SDPA allowed only `backend` (torch.nn.attention.sdpa_kernel), same signature as labkit.attention.sdpa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from labkit.attention import sdpa

    member = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]

    def attn(q, k, v, causal: bool = False):
        with sdpa_kernel(member):
            return sdpa(q, k, v, causal)

    return attn


def backend_ran(fn, q, k, v) -> dict:
    """Which SDPA backend one forward call ran, read from the aten operators a CPU-side profile records."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # the profiler's notes on its own set-up are not the benchmark's
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(q, k, v)
    keys = sorted({e.key for e in prof.key_averages()})
    for fragment, name in BACKEND_OPS:
        hits = [key for key in keys if fragment in key]
        if hits:
            return {"backend": name, "op": hits[0]}
    return {"backend": "unknown", "op": None}


def trial(call) -> str | None:
    """Run `call` once: None if it ran, else why not (out of memory, or the backend refused the inputs)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except torch.cuda.OutOfMemoryError:
            return "out of memory"
        except RuntimeError as e:
            # a forced backend that cannot take these inputs warns why, then raises "No available kernel"; the
            # other backends' warnings say only that sdpa_kernel disabled them
            lines = [re.sub(r"\s*\(Triggered internally at .*?\)", "", str(w.message)).strip() for w in caught]
            why = "; ".join(dict.fromkeys(x for x in lines if x and "runtime disabled" not in x
                                          and not x.endswith("not used because:")))
            return f"{str(e).splitlines()[0]}{' (' + why + ')' if why else ''}"
    return None


def contenders() -> dict:
    from labkit.attention import naive_attention, sdpa

    out = {"naive": naive_attention, "SDPA": sdpa}
    out.update({f"SDPA {b}": forced(b) for b in BACKENDS})
    return out


def measure_len(cfg: SweepConfig, dtype: str, n: int, dev, dead: dict) -> list[dict]:
    """Every contender at one (dtype, L): forward and forward+backward timings, peaks, saved bytes."""
    import torch

    from labkit import attention
    from labkit.kernels_bench import side_by_side

    q, k, v = attention.random_qkv(cfg.batch, cfg.heads, n, cfg.head_dim, dtype=getattr(torch, dtype), device=dev,
                                   requires_grad=True, seed=n)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(n + 1)).to(dev, q.dtype)
    rows, calls = [], {}
    for name, fn in contenders().items():
        row = {"dtype": dtype, "name": name, "seq_len": n}
        fwd = lambda fn=fn: fn(q, k, v)  # noqa: E731
        both = lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), g)  # noqa: E731
        why = dead.get(name) or trial(both)
        if why:
            if why == "out of memory":
                dead[name] = f"out of memory at L={n} or less"
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.append({**row, "skipped": why})
            continue
        calls[f"{name}|forward"], calls[f"{name}|forward_backward"] = fwd, both
        rows.append(row)
    timings = side_by_side(calls, device=dev, rounds=cfg.reps, warmup=cfg.warmup, inner=1)
    for row in rows:
        if "skipped" in row:
            continue
        fn = contenders()[row["name"]]
        for part in ("forward", "forward_backward"):
            t = timings[f"{row['name']}|{part}"]
            row[part] = {"median_s": t.median, "iqr_s": t.iqr, "n": len(t.samples),
                         "peak_bytes": attention.peak_bytes(calls[f"{row['name']}|{part}"], dev)}
        row["saved_bytes"] = attention.saved_bytes(calls[f"{row['name']}|forward"])
        if row["name"] == "SDPA":
            row |= backend_ran(fn, q, k, v)
    return rows


def profile_step(cfg: SweepConfig, attn_name: str, dev) -> dict:
    """One bf16-autocast training step of the block stack, profiled over 2 steps: its top 10 operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from labkit import attention
    from labkit.bench import time_fn

    blocks_cfg = attention.TINY_PRESETS[cfg.profile_preset]
    model = attention.build_blocks(blocks_cfg, contenders()[attn_name], device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(cfg.profile_batch, cfg.profile_seq_len, blocks_cfg.d_model, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()

    step_time = time_fn(step, device=dev, warmup=2, repeats=cfg.reps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2)) as p:
            for _ in range(4):
                step()
                p.step()
    by = "device" if dev.type == "cuda" else "cpu"
    return {"attention": attn_name, "preset": asdict(blocks_cfg) | {"name": cfg.profile_preset},
            "batch": cfg.profile_batch, "seq_len": cfg.profile_seq_len, "autocast": "bfloat16", "steps": 2,
            "by": by, "step_median_s": step_time.median, "step_iqr_s": step_time.iqr,
            "top_ops": attention.top_ops(p, k=10, by=by)}


def describe(row: dict) -> str:
    if "skipped" in row:
        return f"{row['name']}: skipped ({row['skipped'][:80]})"
    fb = row["forward_backward"]
    extra = f" [{row['backend']}]" if "backend" in row else ""
    return f"{row['name']}{extra} {1e3 * fb['median_s']:.3f} ms, peak {fb['peak_bytes'] / 2**20:.0f} MiB"


def run(cfg: SweepConfig, dev) -> dict:
    """The whole record's payload: the sweep's rows and the two profiled steps."""
    import torch

    cfg.check()
    t0 = time.perf_counter()
    rows = []
    for dtype in cfg.dtypes:
        dead: dict[str, str] = {}
        for n in cfg.seq_lens:
            got = measure_len(cfg, dtype, n, dev, dead)
            rows += got
            say(t0, f"{dtype} L={n} (forward+backward): " + "; ".join(describe(r) for r in got))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    profiles = []
    for name in ("naive", "SDPA"):
        profiles.append(profile_step(cfg, name, dev))
        top = profiles[-1]["top_ops"][0]
        say(t0, f"profiled bf16 step, {name} attention, L={cfg.profile_seq_len}: top op {top['op']} "
                f"({top['self_ms']:.2f} ms self {profiles[-1]['by']} time over 2 steps)")
    return {"config": asdict(cfg), "rows": rows, "profiles": profiles,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "elapsed_s": time.perf_counter() - t0,
            "note": "median_s / iqr_s: seconds per call over interleaved rounds (labkit.kernels_bench.side_by_side, "
                    "one call per sample, after warm-up); forward_backward is torch.autograd.grad of q, k, v after "
                    "the forward; peak_bytes: allocator peak above what was held before the call, measured warm; "
                    "saved_bytes: what autograd keeps for backward after the forward; 'SDPA' is PyTorch's own "
                    "dispatch (backend: the aten operator it ran), 'SDPA <backend>' forced with sdpa_kernel"}


def card_name(device_name: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,3}|L4|T4)\b", device_name.upper())
    return m.group(1).lower() if m else "gpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (only with --quick: a dry run)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of the logic)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default benchmarks/results; a temporary folder for a CPU dry run)")
    args = ap.parse_args(argv)
    import torch

    from labkit.bench import RESULTS_DIR, save_result
    from labkit.env import LabkitError, pick_device

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"attention_gpu: {NO_GPU}", file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.quick:
        print(f"attention_gpu: --device cpu is a dry run and needs --quick. {NO_GPU}", file=sys.stderr)
        return 2
    try:
        dev = pick_device(args.device)
        payload = run(PRESETS["quick" if args.quick else "full"], dev)
        card = card_name(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu"
        out = args.out or (Path(tempfile.mkdtemp(prefix="attention-dry-")) if dev.type == "cpu" else RESULTS_DIR / "kernels")
        path = save_result(f"attention_{card}" + ("_quick" if args.quick else ""), payload, out_dir=out, device=dev)
    except LabkitError as e:
        print(f"attention_gpu: error: {e}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

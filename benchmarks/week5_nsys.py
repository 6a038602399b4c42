"""Week 5's Nsight Systems run: an NVTX-annotated ResNet-18 training loop under `nsys profile`, and its summaries.

    python benchmarks/week5_nsys.py                      # a CUDA GPU with nsys: a few minutes
    python benchmarks/week5_nsys.py --out /tmp/w5nsys    # anywhere else (default: benchmarks/results/notebooks/week5_nsys)

The script runs itself (`--child`) under
`nsys profile --trace=cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop`, so only the
steps between torch.cuda.profiler.start() and stop() are recorded, after warm-up. The child trains ResNet-18
(labkit.models) on CIFAR-shaped batches made on the host each step (a random batch of uint8 images, random
crop and flip, pinned, copied with non_blocking=True, normalized on the GPU), with the NVTX ranges `step` and,
inside it, `data`, `forward`, `backward`, `optimizer`. Then `nsys stats --report cuda_gpu_kern_sum` and
`--report nvtx_sum` (nsys's default column layout) go to cuda_gpu_kern_sum.txt and nvtx_sum.txt, and
labkit.profiling.read_nsys_stats reads them: the dominant kernel and the data range's share of the step.

In --out: week5_nsys.nsys-rep, the two summaries, and week5_nsys.json (status, card, torch, commit, the
commands, the reading). nsys is looked for on PATH and where CUDA and Nsight installers put it
(labkit.profiling.find_nsys). Where nsys leaves only its raw .qdstrm (seen on a lent H200, with the nsys
bundled in Nsight Compute: "Importer error status", importation skipped), QdstrmImporter is tried on it where
one is found. Where there
is no CUDA GPU, nothing is written. Where nsys is missing, fails, or leaves no report, the JSON says so
(status "nsys missing", "nsys failed", "no report" or "stats failed", with nsys's last lines of output) and the
exit code is 1: a failed run is recorded as failed, never as a result.
"""

from __future__ import annotations

import argparse
import glob
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from labkit import bench, profiling
from labkit.env import LabkitError

NAME = "week5_nsys"
DEFAULT_OUT = bench.RESULTS_DIR / "notebooks" / NAME
REPORTS = ("cuda_gpu_kern_sum", "nvtx_sum")
TAIL_LINES = 25


# ------------------------------------------------------------------------------------------------ child


def _host_batch(images: torch.Tensor, labels: torch.Tensor, batch: int, gen: torch.Generator):
    """A random batch made on the host: gather, random crop (pad 4) and flip, pinned for an async copy."""
    from labkit import data as D

    idx = torch.randint(0, len(images), (batch,), generator=gen)
    x = D.augment_batch(images[idx], gen)
    return x.pin_memory(), labels[idx].pin_memory()


def child(steps: int, warmup: int, batch: int, width: int) -> int:
    """The profiled program: warm-up steps, then `steps` NVTX-annotated steps inside the capture range."""
    from labkit import data as D
    from labkit import models

    nvtx = torch.cuda.nvtx
    dev = torch.device("cuda")
    ds = D.synthetic_cifar(max(4096, batch), 1, seed=0)
    images, labels = D.to_nchw_uint8(ds.x_train, "cpu"), torch.from_numpy(ds.y_train).long()
    mean = torch.tensor(D.CIFAR_MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(D.CIFAR_STD, device=dev).view(1, 3, 1, 1)
    model = models.resnet18(num_classes=ds.num_classes, width=width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    gen = torch.Generator().manual_seed(0)

    def step():
        with nvtx.range("step"):
            with nvtx.range("data"):
                xb, yb = _host_batch(images, labels, batch, gen)
                x = (xb.to(dev, non_blocking=True).float() / 255 - mean) / std
                y = yb.to(dev, non_blocking=True)
            with nvtx.range("forward"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with nvtx.range("backward"):
                loss.backward()
            with nvtx.range("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):  # cuDNN's choices, the allocator, lazy CUDA modules: outside the capture
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"child: {steps} steps recorded, last loss {loss.item():.3f}")
    return 0


# ----------------------------------------------------------------------------------------------- parent


def _tail(text: str) -> list[str]:
    return [ln for ln in (text or "").splitlines() if ln.strip()][-TAIL_LINES:]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    print("$ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _record(out: Path, status: str, payload: dict) -> Path:
    path = bench.save_result(NAME, {"status": status, **payload}, out_dir=out, device="cuda")
    print(f"{status}: wrote {path}")
    return path


def _stats(nsys: str, rep: Path, out: Path, timeout: float) -> dict:
    """Run nsys stats for each summary into <out>/<report>.txt; {report: the CompletedProcess}."""
    done = {}
    for report in REPORTS:
        cmd = [nsys, "stats", "--force-export=true", "--report", report, str(rep)]
        done[report] = r = _run(cmd, timeout)
        if r.returncode == 0 and r.stdout.strip():
            (out / f"{report}.txt").write_text(r.stdout)
    return done


IMPORTER_PLACES = ("/opt/nvidia/nsight-systems/*/host-linux-x64/QdstrmImporter",
                   "/opt/nvidia/nsight-compute/*/host/*/QdstrmImporter", "/usr/local/cuda/nsight-systems-*/host-linux-x64/QdstrmImporter",
                   "/usr/local/cuda/bin/QdstrmImporter")


def find_importer(nsys: str) -> str | None:
    """QdstrmImporter, the tool that turns nsys's raw .qdstrm into a .nsys-rep: beside nsys, or where Nsight
    installers put it; None if absent."""
    here = Path(nsys).resolve().parent
    for cand in [here / "QdstrmImporter", here.parent / "host-linux-x64" / "QdstrmImporter"]:
        if cand.is_file():
            return str(cand)
    for pattern in IMPORTER_PLACES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def _import_qdstrm(nsys: str, stem: Path, timeout: float, base: dict) -> Path | None:
    """Where nsys left only a .qdstrm, try QdstrmImporter on it; records what happened in `base`."""
    raw = Path(f"{stem}.qdstrm")
    if not raw.is_file():
        return None
    importer = find_importer(nsys)
    base["importer"] = importer
    if importer is None:
        return None
    cmd = [importer, "--input-file", str(raw)]
    base["commands"].append(shlex.join(cmd))
    try:
        r = _run(cmd, timeout)
    except subprocess.TimeoutExpired:
        base["import_output"] = [f"QdstrmImporter ran past {timeout:.0f} s"]
        return None
    base["import_output"] = _tail(r.stdout + "\n" + r.stderr)
    rep = Path(f"{stem}.nsys-rep")
    return rep if rep.is_file() else None


def parent(args) -> int:
    if not torch.cuda.is_available():
        print("week5_nsys needs a CUDA GPU (Nsight Systems records CUDA kernels and NVTX ranges); nothing written")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nsys = args.nsys or profiling.find_nsys()
    base = {"config": {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "width": args.width,
                       "osrt": args.osrt,
                       "model": "labkit.models.resnet18", "ranges": ["step", "data", "forward", "backward", "optimizer"]},
            "nsys": nsys}
    if nsys is None:
        _record(out, "nsys missing", {**base, "why": "no nsys on PATH nor at " + ", ".join(profiling.NSYS_PLACES)})
        return 1
    version = _run([nsys, "--version"], 60)
    base["nsys_version"] = version.stdout.strip() or version.stderr.strip()
    stem = out / NAME
    for old in glob.glob(f"{stem}.*"):  # a stale report must never pass for this run's
        if not old.endswith(".json"):
            Path(old).unlink()
    child_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--batch", str(args.batch), "--width", str(args.width)]
    prof_cmd = [nsys, "profile", "--trace=cuda,nvtx" + (",osrt" if args.osrt else ""), "--capture-range=cudaProfilerApi",
                "--capture-range-end=stop", "--sample=none", "--cpuctxsw=none", "--force-overwrite=true",
                f"--output={stem}", *child_cmd]
    base["commands"] = [shlex.join(prof_cmd)]
    t0 = time.perf_counter()
    try:
        prof = _run(prof_cmd, args.timeout)
    except subprocess.TimeoutExpired:
        _record(out, "nsys failed", {**base, "why": f"nsys profile ran past {args.timeout:.0f} s"})
        return 1
    base["profile_s"] = time.perf_counter() - t0
    base["profile_output"] = _tail(prof.stdout + "\n" + prof.stderr)
    rep = Path(f"{stem}.nsys-rep")
    if not rep.is_file():
        rep = _import_qdstrm(nsys, stem, args.timeout, base) or rep
    if not rep.is_file():
        left = sorted({Path(p).name for p in glob.glob(f"{stem}*") + glob.glob(str(out / "*.qdstrm"))
                       if not p.endswith(".json")})
        status = "nsys failed" if prof.returncode != 0 else "no report"
        _record(out, status, {**base, "returncode": prof.returncode, "files_left": left,
                              "why": "nsys profile made no .nsys-rep" + (f" (left {left})" if left else "")})
        return 1
    stats = _stats(nsys, rep, out, args.timeout)
    base["commands"] += [shlex.join([nsys, "stats", "--force-export=true", "--report", r, str(rep)]) for r in REPORTS]
    failed = {r: _tail(p.stdout + "\n" + p.stderr) for r, p in stats.items()
              if p.returncode != 0 or not (out / f"{r}.txt").is_file()}
    if failed:
        _record(out, "stats failed", {**base, "report": rep.name, "stats_output": failed})
        return 1
    try:
        reading = profiling.read_nsys_stats(*((out / f"{r}.txt").read_text() for r in REPORTS))
    except LabkitError as e:
        _record(out, "stats failed", {**base, "report": rep.name, "why": str(e)})
        return 1
    _record(out, "ok", {**base, "report": rep.name, "report_bytes": rep.stat().st_size,
                        "summaries": [f"{r}.txt" for r in REPORTS], "reading": reading})
    print(f"dominant kernel ({100 * reading['top_kernel_share']:.0f}% of kernel time): {reading['top_kernel'][:100]}")
    print(f"data range: {100 * reading['data_share']:.0f}% of the step ({reading['data_ms']:.2f} of "
          f"{reading['step_ms']:.2f} ms)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the report, summaries and JSON record")
    ap.add_argument("--steps", type=int, default=20, help="steps recorded inside the capture range")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the capture range")
    ap.add_argument("--batch", type=int, default=256, help="images per step")
    ap.add_argument("--width", type=int, default=64, help="ResNet-18 width (64: the standard one)")
    ap.add_argument("--osrt", action="store_true", help="also trace OS runtime calls (a much larger report)")
    ap.add_argument("--nsys", help="the nsys executable (default: found on PATH or in the usual places)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each nsys command may take")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.width) < 1 or args.warmup < 0:
        ap.error("--steps, --batch and --width must be >= 1, --warmup >= 0")
    if args.child:
        return child(args.steps, args.warmup, args.batch, args.width)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

"""Tile and wave quantization of matmuls, and datasheet peaks to hold measured TFLOP/s against.

A GPU matmul kernel splits the m x n output into tiles (say 128 x 128) and gives each to one SM (streaming
multiprocessor); with more tiles than SMs they run in waves. Two roundings cost throughput:

  tile quantization  ceil(m / 128) x ceil(n / 128) tiles are computed in full, so N = 8200 pays for 8320;
  wave quantization  ceil(tiles / SMs) waves take as long as full ones, so a last wave with few tiles
                     leaves most SMs idle.

`tile_waves` predicts both from the shape, the SM count and a tile size; `wave_sweep` measures TFLOP/s over a
range of N beside the prediction. The model is a model: cuBLAS picks tile shapes per problem (and on Hopper may
split work differently), so the measurement decides. Misalignment (N = 8191: rows not a multiple of 16 bytes)
is a separate effect the model does not include.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from labkit import env
from labkit.env import LabkitError, pick_device
from labkit.matmul import KINDS, bench_matmul

# Dense (no sparsity) TFLOP/s and SM counts, keyed by a pattern of the name CUDA reports: H100 from NVIDIA's H100
# architecture whitepaper (SXM5 and PCIe at boost clock), the others from their product datasheets, whose
# tensor-core rates "with sparsity" are twice these. None: the card has no such math (the T4 has neither TF32
# nor bf16 tensor cores, the A100 no fp8). fp32 is the CUDA-core rate.
DATASHEETS = {
    "H100 PCIe": (r"H100.*PCIE", 114, {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0, "fp8": 1513.0}),
    "H100 SXM": (r"H100(?!.*(PCIE|NVL))", 132,
                 {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9}),
    "H200 SXM": (r"H200(?!.*NVL)", 132, {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1979.0}),
    "A100": (r"A100", 108, {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0, "fp8": None}),
    "L4": (r"\bL4\b", 58, {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0, "fp8": 242.5}),
    "T4": (r"\bT4\b", 40, {"fp32": 8.1, "tf32": None, "fp16": 65.0, "bf16": None, "fp8": None}),
}


def datasheet(device_name: str) -> dict | None:
    """{"card", "sms", "tflops": {kind: dense TFLOP/s or None}} for a GPU name such as torch.cuda.get_device_name()
    reports ("NVIDIA H100 80GB HBM3"), or None for a card not in the table (a CPU included)."""
    for card, (pattern, sms, tflops) in DATASHEETS.items():
        if re.search(pattern, device_name.upper()):
            return {"card": card, "sms": sms, "tflops": dict(tflops)}
    return None


def datasheet_peak(device_name: str, kind: str = "bf16") -> float | None:
    """The datasheet's dense peak in TFLOP/s for `kind` on the named card (None if unknown or unsupported)."""
    if kind not in KINDS:
        raise LabkitError(f"unknown matmul kind {kind!r}: use one of {', '.join(KINDS)}")
    d = datasheet(device_name)
    return None if d is None else d["tflops"].get(kind)


def sm_count(device=None) -> int | None:
    """Streaming multiprocessors of a CUDA device (labkit.env.gpu_facts); None on a CPU."""
    facts = env.gpu_facts(device)  # looked up at call time, so a test's faked card (tests/t4_fake.py) reaches it
    return None if facts is None else facts.multiprocessors


def tile_waves(m: int, n: int, sms: int, tile: tuple[int, int] = (128, 128)) -> dict:
    """The tile-and-wave model of an m x n output on `sms` SMs, one tile per SM at a time.

    Returns tiles, waves = ceil(tiles / sms), last_wave (share of the SMs busy in the last wave),
    tile_efficiency (m * n over the tiles' area), wave_efficiency (tiles / (waves * sms)) and efficiency (their
    product: the predicted fraction of the tile-level peak; the time is predicted proportional to waves * k).
    """
    tm, tn = tile
    if min(m, n, sms, tm, tn) < 1:
        raise LabkitError(f"m, n, the SM count and the tile sides must be positive, got m={m} n={n} sms={sms} "
                          f"tile={tile}")
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / sms)
    tile_eff = m * n / (tiles * tm * tn)
    wave_eff = tiles / (waves * sms)
    return {"m": m, "n": n, "sms": sms, "tile": [tm, tn], "tiles": tiles, "waves": waves,
            "last_wave": (tiles - (waves - 1) * sms) / sms, "tile_efficiency": tile_eff,
            "wave_efficiency": wave_eff, "efficiency": tile_eff * wave_eff}


_TILE_IN_NAME = re.compile(r"tilesize(\d+)x(\d+)|nvjet_\w*?_(\d+)x(\d+)_|_(\d+)x(\d+)_\d+x\d+_|gemm_(\d+)x(\d+)_"
                           r"|gemm_[a-z0-9]+_(\d+)x(\d+)_[nt]{2}_")  # the last: cutlass_75_..._gemm_bf16_256x128_nn_align1


def kernel_tile(name: str) -> tuple[int, int] | None:
    """The output tile (rows, columns) a cuBLAS/CUTLASS kernel name states, or None: "tilesize256x128x8" in
    xmma names, the first "256x128" in nvjet names (the next pair is the k tile and stage count), "64x64_16x6"
    in CUTLASS names, "gemm_bf16_256x128_nn" in CUTLASS's older ones. Evidence from a name, not proof."""
    m = _TILE_IN_NAME.search(name)
    if not m:
        return None
    a, b = next((int(m.group(i)), int(m.group(i + 1))) for i in (1, 3, 5, 7, 9) if m.group(i))
    return a, b


def wave_sizes(center: int = 8192, tile: int = 128, span: int = 4, extra: Sequence[int] = (8191, 8193, 8200)
               ) -> list[int]:
    """Square sizes to sweep: every half tile from center - span tiles to center + span tiles, plus `extra`
    (those inside that range), sorted."""
    if center < 1 or tile < 2 or span < 1 or center - span * tile < 1:
        raise LabkitError(f"need center > span * tile > 0 and tile >= 2, got center={center} tile={tile} "
                          f"span={span}")
    lo, hi = center - span * tile, center + span * tile
    sizes = set(range(lo, hi + 1, tile // 2)) | {e for e in extra if lo <= e <= hi}
    return sorted(sizes)


def wave_sweep(sizes: Sequence[int], kind: str = "bf16", device=None, *, sms: int | None = None,
               tile: tuple[int, int] = (128, 128), measure: bool = True, repeats: int = 10,
               progress: bool = True) -> list[dict]:
    """For each square size N: the tile-and-wave prediction (on `sms` SMs, default: this GPU's count) and, if
    `measure`, the measured N x N x N TFLOP/s of `kind` (labkit.bench timing, median of `repeats`).

    Rows: the `tile_waves` fields plus kind, device, median_s (seconds per matmul) and tflops (None when not
    measured). On a CPU pass `sms` (e.g. an H100's 132) to see the prediction; the CPU itself has no waves.
    """
    if kind not in KINDS:
        raise LabkitError(f"unknown matmul kind {kind!r}: use one of {', '.join(KINDS)}")
    dev = pick_device(device)
    sms = sms or sm_count(dev)
    if sms is None:
        raise LabkitError("no SM count on a CPU: pass sms= (132 for an H100 SXM) to predict for a GPU")
    it = list(sizes)
    if progress and measure:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"wave sweep {kind}", unit="size")
    rows = []
    for n in it:
        row = {**tile_waves(n, n, sms, tile), "kind": kind, "device": str(dev), "median_s": None, "tflops": None}
        if measure:
            r = bench_matmul(kind, n, n, n, dev, repeats=repeats)
            row.update(median_s=r["median_s"], tflops=r["tflops"])
        rows.append(row)
    return rows


def plot_wave_sweep(rows: Sequence[dict], ax=None, title: str | None = None, model: bool = True):
    """Measured TFLOP/s against N beside the tile-and-wave prediction (scaled so its best point meets the best
    measured one; model=False leaves it out); without measurements, the predicted efficiency alone. Dotted
    lines: multiples of the tile."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    ns = [r["n"] for r in rows]
    eff = [r["efficiency"] for r in rows]
    measured = [r for r in rows if r.get("tflops")]
    if measured:
        ref = max(r["tflops"] / r["efficiency"] for r in measured)  # the rate a fully used tile grid would reach
        top = max(r["tflops"] for r in measured)
        ax.plot([r["n"] for r in measured], [r["tflops"] for r in measured], "o-", color="#1f77b4",
                label="measured")
        pred = [e * ref for e in eff]
        if model:
            ax.step(ns, [p * top / max(pred) for p in pred], where="mid", color="#ff7f0e", linewidth=1.5,
                    label="tile-and-wave model (scaled to the best measured)")
        ax.set_ylabel("TFLOP/s")
    else:
        ax.step(ns, eff, where="mid", color="#ff7f0e", linewidth=1.5, label="tile-and-wave model")
        ax.set_ylabel("predicted fraction of peak")
    tm = rows[0]["tile"][0]
    for k in range(math.ceil(min(ns) / tm), max(ns) // tm + 1):
        ax.axvline(k * tm, color="grey", linestyle=":", linewidth=0.8)
    for r in rows:
        if r["n"] % 16:  # misaligned sizes: the model cannot see that cost
            y = r["tflops"] if r.get("tflops") else r["efficiency"]
            ax.annotate(str(r["n"]), (r["n"], y), xytext=(3, -12), textcoords="offset points", fontsize=7,
                        color="#d62728")
    ax.set_xlabel(f"N (N x N x N matmul); dotted lines every {tm}")
    ax.set_title(title or f"Tile and wave quantization: {rows[0]['sms']} SMs, {tm}x{rows[0]['tile'][1]} tiles")
    ax.legend(fontsize=8)
    return ax

"""Tables and charts from training result records (the dicts `labkit.train.train` returns)."""

from __future__ import annotations

from pathlib import Path


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def ladder_rows(records: list[dict]) -> list[dict]:
    """One row per rung: img/s, speedup vs the first rung and vs the previous rung, memory, MFU, loss, accuracy."""
    rows, base, prev = [], None, None
    for r in records:
        base = base or r["img_per_s"]
        rows.append({
            "rung": r["name"],
            "img_per_s": r["img_per_s"],
            "img_per_s_all": r["img_per_s_all"],
            "speedup": r["img_per_s"] / base,
            "step_gain": r["img_per_s"] / prev if prev else 1.0,
            "peak_mem_gib": r["peak_mem_bytes"] / 2**30 if r.get("peak_mem_bytes") else None,
            "mfu": r.get("mfu"),
            "first_step_s": r.get("first_step_s"),
            "final_loss": r["final_loss"],
            "accuracy": r["accuracy"],
        })
        prev = r["img_per_s"]
    return rows


def ladder_table(records: list[dict]) -> str:
    """A Markdown table of the ladder (fits a terminal and a README)."""
    head = ("| rung | img/s (steady) | img/s (all epochs) | speedup | vs previous | peak mem GiB | MFU | "
            "first step s | final loss | test acc |")
    lines = [head, "|" + "---|" * 10]
    for row in ladder_rows(records):
        lines.append(
            f"| {row['rung']} | {row['img_per_s']:,.0f} | {row['img_per_s_all']:,.0f} | {row['speedup']:.2f}x | "
            f"{row['step_gain']:.2f}x | {_fmt(row['peak_mem_gib'], '.2f')} | "
            f"{_fmt(None if row['mfu'] is None else 100 * row['mfu'], '.1f')}{'%' if row['mfu'] else ''} | "
            f"{_fmt(row['first_step_s'], '.2f')} | {row['final_loss']:.3f} | "
            f"{_fmt(None if row['accuracy'] is None else 100 * row['accuracy'], '.1f')}{'%' if row['accuracy'] is not None else ''} |")
    return "\n".join(lines)


def ladder_chart(records: list[dict], path: str | Path, title: str = "ResNet-18 optimization ladder") -> Path:
    """Bar chart of steady img/s per rung with the speedup over the baseline written on each bar (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = ladder_rows(records)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["rung"] for r in rows]
    vals = [r["img_per_s"] for r in rows]
    bars = ax.barh(names[::-1], vals[::-1], color="#3b7dd8")
    for b, r in zip(bars, rows[::-1], strict=True):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {r['img_per_s']:,.0f} ({r['speedup']:.1f}x)",
                va="center", fontsize=8)
    ax.set_xlabel("training images / s (steady state, data loading included)")
    ax.set_xlim(0, max(vals) * 1.35)
    ax.set_title(title)
    for r in records:
        ax2.plot(r["losses"], label=r["name"], lw=0.8)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("training loss")
    ax2.set_title("loss curves")
    ax2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

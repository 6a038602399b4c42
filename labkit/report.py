"""Tables and charts from training result records (the dicts `labkit.train.train` returns)."""

from __future__ import annotations

from pathlib import Path

from labkit.outputs import save_figure
from labkit.presets import preset as rung
from labkit.presets import with_changes
from labkit.progress import fmt_duration

# What each column of `ladder_table` means; written under the table and into ladder.json.
LADDER_COLUMNS = {
    "img/s (steady)": "training images per second over the epochs after the first (the first pays for worker "
                      "start, compilation and autotuning), data loading and augmentation included",
    "img/s (all epochs)": "the same over every epoch, the first included",
    "speedup": "steady img/s over the first rung's",
    "vs previous": "steady img/s over the row above: what this rung's one change gained (after a skipped rung, "
                   "over the last rung that ran)",
    "peak mem GiB": "peak GPU memory allocated (CUDA only)",
    "MFU": "model FLOP/s over the bf16 matmul peak measured in the same run (GPU only)",
    "first step s": "seconds of the first step alone: compilation, CUDA-graph capture, autotuning",
    "final loss": "mean training loss over the last steps",
    "test acc": "top-1 accuracy on the test split after training",
}


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


def ladder_markdown(result: dict) -> str:
    """A ladder result (`labkit.train.run_ladder`) as Markdown: where it ran, its mode, the table, what the columns
    mean, which rungs were skipped and why, and whether the run stopped early."""
    env = result["env"]
    lines = [f"{env['device_name']}, torch {env['torch']}, commit {env['git_commit']}", ""]
    if result.get("mode"):
        lines += [f"Mode: {result['mode']}.", ""]
    if result.get("wall_s"):
        lines += [f"The whole run took {fmt_duration(result['wall_s'])}, data preparation included.", ""]
    lines += [ladder_table(result["rungs"]) if result["rungs"] else "(no rung finished)", ""]
    if not result.get("complete", True):
        done = {r["name"] for r in result["rungs"]}
        left = [n for n in result.get("planned", []) if n not in done]
        why = (f"stopped by {result['stopped']}" if result.get("stopped") else
               "still running, or killed before it could say why")
        lines += [f"Incomplete ({len(result['rungs'])} of {len(result.get('planned', []))} rungs): {why}; "
                  f"not run: {', '.join(left) or '-'}.", ""]
    lines += [f"- {name}: {what}" for name, what in result.get("columns", LADDER_COLUMNS).items()
              if name in ("img/s (steady)", "vs previous", "speedup", "first step s")]
    for s in result.get("skipped", []):
        lines.append(f"- skipped {s['rung']}: {s['why']}")
    return "\n".join(lines)


def ladder_chart_note(result: dict) -> str | None:
    """The line under a ladder chart: quick mode and skipped rungs, or None for a full run that skipped none."""
    parts = []
    if result.get("quick"):
        parts.append("quick mode (CPU demo size)")
    if result.get("skipped"):
        parts.append("skipped: " + ", ".join(s["rung"] for s in result["skipped"]) + " (see ladder.md for why)")
    if not result.get("complete", True):
        parts.append(f"incomplete: {result.get('stopped') or 'still running, or killed'}")
    return "; ".join(parts) or None


def ladder_chart(records: list[dict], path: str | Path, title: str = "ResNet-18 optimization ladder",
                 note: str | None = None) -> Path:
    """Bar chart of steady img/s per rung with the speedup over the baseline written on each bar (PNG).

    `note` (e.g. "quick mode; skipped: ...") is written under the chart.
    """
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
    ax.set_xlabel("training images / s (steady: epochs after the first; data loading included)")
    ax.set_xlim(0, max(vals) * 1.35)
    ax.set_title(title)
    for r in records:
        ax2.plot(r["losses"], label=r["name"], lw=0.8)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("training loss")
    ax2.set_title("loss curves")
    ax2.legend(fontsize=6, ncol=2)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return Path(path)


def steps_and_accuracy(results: list[dict], n_train: int = 50_000, preset: str = "cuda_graphs") -> list[dict]:
    """One point per full-pipeline variant in `top_rung` results: optimizer steps taken, accuracy, img/s.

    Each variant's batch and epochs are its changes applied to `preset` and the result's epochs; steps =
    (n_train // batch) x epochs. Accuracy is the median over seeds where several ran. Variants that failed
    or diverged (accuracy under 50%) get `diverged=True`, so a plot can leave them out and say so.
    """
    points = []
    for res in results:
        for label, v in res.get("variants", {}).items():
            cfg = with_changes(rung(preset), **{"epochs": res.get("epochs", 5), **v.get("changes", {})})
            acc = v.get("accuracy_median", v.get("accuracy"))
            points.append({"label": label, "batch": cfg.batch_size, "epochs": cfg.epochs,
                           "steps": (n_train // cfg.batch_size) * cfg.epochs, "optimizer": cfg.optimizer,
                           "accuracy": acc, "img_per_s": v.get("img_per_s_median", v.get("img_per_s")),
                           "diverged": acc is None or acc < 0.5})
    return points


def accuracy_vs_steps_chart(points: list[dict], ax=None, title: str = "accuracy against optimizer steps"):
    """Scatter of test accuracy against optimizer steps (log scale), a colour per batch, a marker per optimizer.

    Diverged points are left out; the title says how many.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="tight")
    shown = [p for p in points if not p["diverged"]]
    for i, batch in enumerate(sorted({p["batch"] for p in shown})):
        for opt, marker, name in (("sgd", "o", "SGD"), ("adamw", "^", "AdamW"), ("muon", "*", "Muon")):
            pts = [p for p in shown if p["batch"] == batch and p["optimizer"].startswith(opt)]
            if pts:
                ax.scatter([p["steps"] for p in pts], [100 * p["accuracy"] for p in pts], marker=marker,
                           s=70 if opt == "muon" else None, color=f"C{i}", label=f"batch {batch}, {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("optimizer steps in the run")
    ax.set_ylabel("test accuracy (%)")
    left_out = len(points) - len(shown)
    ax.set_title(title + (f" ({left_out} diverged runs not shown)" if left_out else ""), fontsize=9)
    ax.legend(fontsize=7)
    return ax

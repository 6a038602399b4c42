"""Tables and charts from training result records (the dicts `labkit.train.train` returns)."""

from __future__ import annotations

import statistics
from pathlib import Path

from labkit.outputs import save_figure
from labkit.presets import preset as rung
from labkit.presets import with_changes
from labkit.progress import fmt_duration

# What each column of `ladder_table` means; written under the table and into ladder.json.
LADDER_COLUMNS = {
    "img/s (steady)": "training images per second over the epochs after the first (the first pays for worker "
                      "start, compilation and autotuning), data loading and augmentation included; with repeated "
                      "runs, the median over the runs",
    "spread": "the lowest and highest img/s (steady) of the rung's runs",
    "img/s (all epochs)": "the same over every epoch, the first included",
    "speedup": "steady img/s over the first rung's",
    "vs previous": "steady img/s over the row above: what this rung's change gained (after a skipped rung, over "
                   "the last rung that ran); \"within noise\" where the two rungs' spreads overlap, so the runs "
                   "cannot tell the rungs apart",
    "peak mem GiB": "peak GPU memory allocated (CUDA only)",
    "MFU": "model FLOPs utilization as PaLM defines it: model FLOP/s (FLOPs per training image x img/s) over the "
           "card's datasheet dense 16-bit peak (labkit.waves.DATASHEETS; GPU only)",
    "share of measured peak": "the same model FLOP/s over the 16-bit matmul peak measured in the same run, which "
                              "is below the datasheet's: not MFU (GPU only)",
    "to target s": "training seconds until the test accuracy, checked after each epoch, first reached the target: the "
                   "lowest final accuracy among the baseline rung's runs, the first epoch's compilation and warm-up included / excluded (the first "
                   "step counted as a steady one); \"-\" where it never did; median over the runs",
    "first step s": "seconds of the first step alone: compilation, CUDA-graph capture, autotuning; with repeated "
                    "runs, cold / warm: the rung's first run in the process (nothing of it compiled yet; on a fresh "
                    "machine nothing cached on disk either) / the median of its later runs, which reuse what the "
                    "first compiled and cached",
    "final loss": "mean training loss over the last steps",
    "test acc": "top-1 accuracy on the test split after training",
}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _spread(r: dict) -> tuple[float, float] | None:
    """(min, max) img/s of a rung's runs, or None for a single run."""
    if r.get("repeats", 1) > 1 and r.get("img_per_s_min") is not None:
        return r["img_per_s_min"], r["img_per_s_max"]
    return None


def within_noise(a: dict, b: dict) -> bool | None:
    """Whether two rung records cannot be told apart: their img/s spreads (min-max over runs) overlap.

    None when either rung ran once: one run has no spread to compare with.
    """
    sa, sb = _spread(a), _spread(b)
    if sa is None or sb is None:
        return None
    return sa[0] <= sb[1] and sb[0] <= sa[1]


def time_to_target(run: dict, target: float) -> tuple[float, float] | None:
    """(seconds with, seconds without compilation) until `run`'s accuracy curve first reached `target` (a
    fraction), or None if it never did or has no curve (`TrainConfig.eval_every_epoch`).

    "with" is the training time of the epochs up to that check, the first epoch's compile and warm-up included;
    "without" replaces the first step's time by one steady step (batch / steady img/s). Epoch resolution:
    the accuracy is only known at the end of each epoch.
    """
    curve = run.get("accuracy_curve") or []
    hit = next((c for c in curve if c["accuracy"] >= target), None)
    if hit is None:
        return None
    first = run.get("first_step_s") or 0.0
    steady_step = run["config"]["batch_size"] / run["img_per_s"] if run.get("config") else 0.0
    return hit["train_s"], hit["train_s"] - max(0.0, first - steady_step)


def _median_tta(r: dict, target: float | None) -> tuple[float, float] | None:
    """A rung's time to target, the median over its runs (each run's own first step and steady rate)."""
    if target is None:
        return None
    runs = [{**r, **x} for x in r.get("runs", [])] or [r]
    times = [t for t in (time_to_target(x, target) for x in runs) if t is not None]
    if len(times) * 2 <= len(runs):  # most runs never got there
        return None
    times.sort()
    return times[len(times) // 2]


def _warm_first_step(r: dict) -> float | None:
    """The median first step (seconds) of a rung's runs after its first one in the process, or None for one run.
    The first run compiles and fills the caches; the later ones show what a warm start costs."""
    later = sorted(x["first_step_s"] for x in sorted(r.get("runs", []), key=lambda x: x.get("round", 0))[1:]
                   if x.get("first_step_s") is not None)
    return later[len(later) // 2] if later else None


def target_accuracy(result: dict) -> float | None:
    """The accuracy a ladder's or an ablation's time-to-target aims at: the lowest final test accuracy among the
    baseline rung's runs, what the baseline recipe reached every time (its median would be missed by half of the
    baseline's own runs). Falls back to the result's stored "target_accuracy" where no baseline rung ran."""
    base = next((r for r in result.get("rungs", []) if r["name"] == "baseline"), None)
    if base is None:
        return result.get("target_accuracy")
    accs = [x["accuracy"] for x in (base.get("runs") or [base]) if x.get("accuracy") is not None]
    return min(accs) if accs else None


def ladder_rows(records: list[dict], target: float | None = None) -> list[dict]:
    """One row per rung: img/s (median of its runs) and spread, speedup vs the first rung and vs the previous one
    (with whether that step is within noise), memory, MFU (measured and datasheet peak), loss, accuracy, and with
    `target` (an accuracy) the seconds to reach it (`time_to_target`, with and without compilation)."""
    rows, base, prev = [], None, None
    for r in records:
        base = base or r["img_per_s"]
        rows.append({
            "rung": r["name"],
            "img_per_s": r["img_per_s"],
            "spread": _spread(r),
            "repeats": r.get("repeats", 1),
            "img_per_s_all": r["img_per_s_all"],
            "speedup": r["img_per_s"] / base,
            "step_gain": r["img_per_s"] / prev["img_per_s"] if prev else 1.0,
            "within_noise": within_noise(prev, r) if prev else None,
            "peak_mem_gib": r["peak_mem_bytes"] / 2**30 if r.get("peak_mem_bytes") else None,
            "mfu": r.get("mfu"),
            "mfu_datasheet": r.get("mfu_datasheet"),
            "to_target_s": _median_tta(r, target),
            "first_step_s": r.get("first_step_s"),
            "first_step_warm_s": _warm_first_step(r),
            "final_loss": r["final_loss"],
            "accuracy": r["accuracy"],
        })
        prev = r
    return rows


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def ladder_table(records: list[dict], target: float | None = None) -> str:
    """A Markdown table of the ladder (fits a terminal and a README).

    Rungs run more than once get a spread column and "within noise" on steps their spreads cannot resolve;
    a ladder of single runs keeps the one-number table. "MFU" is PaLM's, over the datasheet peak, in records that
    carry one; "share of measured peak" divides by the matmul peak measured in the run (not MFU). A `target`
    accuracy and records with accuracy curves add "to target s" (with / without compilation).
    """
    rows = ladder_rows(records, target)
    spread = any(row["spread"] for row in rows)
    sheet = any(row["mfu_datasheet"] for row in rows)
    tta = target is not None and any(r.get("accuracy_curve") for r in records)
    head = ("| rung | img/s (steady) | " + ("spread | " if spread else "") + "img/s (all epochs) | speedup | "
            "vs previous | peak mem GiB | " + ("MFU | " if sheet else "") + "share of measured peak | first step s | "
            "final loss | "
            "test acc |" + (" to target s |" if tta else ""))
    lines = [head, "|" + "---|" * (10 + spread + sheet + tta)]
    for row in rows:
        cells = [row["rung"], f"{row['img_per_s']:,.0f}"]
        if spread:
            cells.append("-" if row["spread"] is None else f"{row['spread'][0]:,.0f}–{row['spread'][1]:,.0f}")
        gain = f"{row['step_gain']:.2f}x" + (" (within noise)" if row["within_noise"] else "")
        cells += [f"{row['img_per_s_all']:,.0f}", f"{row['speedup']:.2f}x", gain, _fmt(row['peak_mem_gib'], '.2f')]
        cells += [_pct(row["mfu_datasheet"])] if sheet else []
        cells += [_fmt(None if row['mfu'] is None else 100 * row['mfu'], '.1f') + ("%" if row['mfu'] else "")]
        first = _fmt(row['first_step_s'], '.2f')
        if row["first_step_warm_s"] is not None:
            first += f" / {row['first_step_warm_s']:.2f}"
        cells += [first, f"{row['final_loss']:.3f}",
                  _fmt(None if row['accuracy'] is None else 100 * row['accuracy'], '.1f')
                  + ("%" if row['accuracy'] is not None else "")]
        if tta:
            t = row["to_target_s"]
            cells.append("-" if t is None else f"{t[0]:.1f} / {t[1]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
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
    target = target_accuracy(result)
    if result.get("kind") == "ablation":
        lines += ["Leave-one-out from the top rung: each without_X row is the top rung with change X left out; "
                  "\"vs top\" is its img/s over the top rung's.", ""]
        lines += [ablation_table(result["rungs"], target) if result["rungs"] else "(no run finished)", ""]
    else:
        lines += [ladder_table(result["rungs"], target) if result["rungs"] else "(no rung finished)", ""]
    if target is not None:
        lines += [f"Target accuracy (the lowest of the baseline's runs): {100 * target:.2f}%.", ""]
    if not result.get("complete", True):
        done = {r["name"] for r in result["rungs"]}
        left = [n for n in result.get("planned", []) if n not in done]
        why = (f"stopped by {result['stopped']}" if result.get("stopped") else
               "still running, or killed before it could say why")
        lines += [f"Incomplete ({len(result['rungs'])} of {len(result.get('planned', []))} rungs): {why}; "
                  f"not run: {', '.join(left) or '-'}.", ""]
    if result.get("repeats", 1) > 1:
        lines += [f"Each rung ran {result['repeats']} times ({result.get('order', 'interleaved')}).", ""]
    columns = {**result.get("columns", {}), **LADDER_COLUMNS}  # the definitions of the code that draws the table
    lines += [f"- {name}: {what}" for name, what in columns.items()
              if name in ("img/s (steady)", "spread", "vs previous", "speedup", "first step s", "MFU",
                          "share of measured peak", "to target s")
              and (name != "spread" or result.get("repeats", 1) > 1)]
    lines += [f"- note: {n}" for n in result.get("notes", [])]
    for s in result.get("skipped", []):
        lines.append(f"- skipped {s['rung']}: {s['why']}")
    return "\n".join(lines)


def ablation_table(records: list[dict], target: float | None = None) -> str:
    """A Markdown table of a leave-one-out ablation (`labkit.train.plan_ablation`): per variant its img/s and
    spread, img/s over the top rung's ("vs top": below 1 means the left-out change was worth that much), test
    accuracy, seconds to the target accuracy (with / without compilation), MFU (over the datasheet peak) and the
    share of the measured matmul peak. The first record is the baseline, the second the top rung."""
    rows = ladder_rows(records, target)
    top = rows[1]["img_per_s"] if len(rows) > 1 else rows[0]["img_per_s"]
    lines = ["| run | img/s (steady) | spread | vs top | test acc | to target s | MFU | share of measured peak |",
             "|" + "---|" * 8]
    for row in rows:
        sp = "-" if row["spread"] is None else f"{row['spread'][0]:,.0f}–{row['spread'][1]:,.0f}"
        t = row["to_target_s"]
        lines.append(f"| {row['rung']} | {row['img_per_s']:,.0f} | {sp} | {row['img_per_s'] / top:.2f}x | "
                     f"{_pct(row['accuracy'])} | {'-' if t is None else f'{t[0]:.1f} / {t[1]:.1f}'} | "
                     f"{_pct(row['mfu_datasheet'])} | {_pct(row['mfu'])} |")
    return "\n".join(lines)


def ladder_chart_note(result: dict) -> str | None:
    """The line under a ladder chart: quick mode and skipped rungs, or None for a full run that skipped none."""
    parts = []
    if result.get("quick"):
        parts.append("quick mode (CPU demo size)")
    if result.get("repeats", 1) > 1:
        parts.append(f"{result['repeats']} interleaved runs per rung")
    if result.get("notes"):
        parts.append("bf16 rungs ran as fp16" if any(n.startswith("bf16 -> fp16") for n in result["notes"])
                     else "see ladder.md's notes")
    if result.get("skipped"):
        parts.append("skipped: " + ", ".join(s["rung"] for s in result["skipped"]) + " (see ladder.md for why)")
    if not result.get("complete", True):
        parts.append(f"incomplete: {result.get('stopped') or 'still running, or killed'}")
    return "; ".join(parts) or None


def series_colors(n: int) -> list:
    """`n` colours that stay distinct side by side (tab10, then tab20's lighter shades): one per series."""
    import matplotlib

    base = list(matplotlib.colormaps["tab10"].colors)
    extra = [c for i, c in enumerate(matplotlib.colormaps["tab20"].colors) if i % 2 == 1]
    return [(base + extra)[i % 20] for i in range(n)]


def log_axis_if_wide(ax, values, axis: str = "x", ratio: float = 10.0) -> bool:
    """Put `axis` on a log scale when `values` span `ratio` (10x) or more, so small steps stay visible; whether it
    did."""
    vals = [v for v in values if v and v > 0]
    wide = bool(vals) and max(vals) / min(vals) >= ratio
    if wide:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    return wide


def zoom_accuracy(ax, accuracies_pct, axis: str = "y", pad: float = 1.0) -> None:
    """Zoom an accuracy axis (%) to the values shown, `pad` points either side, instead of 0-100: differences of a
    point or two are then visible. The label says the axis does not start at 0."""
    vals = [v for v in accuracies_pct if v is not None]
    if not vals:
        return
    lo, hi = max(0.0, min(vals) - pad), min(100.0, max(vals) + pad)
    (ax.set_ylim if axis == "y" else ax.set_xlim)(lo, hi)
    label = (ax.get_ylabel() if axis == "y" else ax.get_xlabel()) or "test accuracy (%)"
    if "zoomed" not in label:
        (ax.set_ylabel if axis == "y" else ax.set_xlabel)(label + " (zoomed axis)")


def loss_curves(records: list[dict], ax, x: str = "images") -> None:
    """Training loss of each record against images seen (`x="images"`) or training seconds (`x="seconds"`), a
    distinct colour per record: rungs with different batch sizes compare on the same axis, which steps do not."""
    colors = series_colors(len(records))
    for r, c in zip(records, colors, strict=True):
        losses = r.get("losses") or []
        if not losses:
            continue
        batch = (r.get("config") or {}).get("batch_size") or 1
        steps = range(1, len(losses) + 1)
        if x == "seconds" and r.get("img_per_s"):
            xs = [s * batch / r["img_per_s"] for s in steps]
        else:
            xs = [s * batch for s in steps]
        ax.plot(xs, losses, label=r["name"], lw=1.0, color=c)
    ax.set_xlabel("training seconds (at the steady img/s)" if x == "seconds" else "images seen")
    ax.set_ylabel("training loss")


def _run_accuracies(r: dict) -> list[float]:
    """Every run's final test accuracy (%) of a rung record, or its one accuracy."""
    accs = [x.get("accuracy") for x in (r.get("runs") or [r])]
    return [100 * a for a in accs if a is not None]


def accuracy_spread(ax, records: list[dict], min_span: float = 8.0) -> None:
    """Each rung's final test accuracy as dots, one per run, with the band of the baseline rung's runs (lowest to
    highest) shaded across: a rung whose dots sit in the band cannot be told from the baseline by accuracy, one
    below it ends below the baseline. Dots, not bars: the axis starts where the data do (at least `min_span`
    points tall), and a bar on a cut axis would draw a small difference as a large one. The first record is
    taken as the baseline when none is named so."""
    per = [(r["name"], _run_accuracies(r)) for r in records]
    per = [(n, a) for n, a in per if a]
    if not per:
        return
    base = next((a for n, a in per if n == "baseline"), per[0][1])
    lo, hi = min(base), max(base)
    ax.axhspan(lo, hi, color="#bbbbbb", alpha=0.35, lw=0, label=f"baseline's runs here: {lo:.1f}–{hi:.1f}%")
    colors = series_colors(len(per))
    for i, ((_, accs), c) in enumerate(zip(per, colors, strict=True)):
        ax.plot([i] * len(accs), accs, "o", color=c, ms=4, alpha=0.8)
        ax.plot([i - 0.3, i + 0.3], [statistics.median(accs)] * 2, color=c, lw=2)
    ax.set_xticks(range(len(per)), [n for n, _ in per], rotation=60, fontsize=7)
    vals = [v for _, a in per for v in a]
    mid, half = (min(vals) + max(vals)) / 2, max(min_span, max(vals) - min(vals) + 1.0) / 2
    ax.set_ylim(max(0.0, mid - half), min(100.0, mid + half))
    runs = max(len(a) for _, a in per)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"dots: each of {runs} runs, line: median" if runs > 1 else "one run per rung", fontsize=8)
    ax.legend(fontsize=6, loc="lower left")


def ladder_chart(records: list[dict], path: str | Path, title: str = "ResNet-18 optimization ladder",
                 note: str | None = None) -> Path:
    """Bar chart of steady img/s per rung (median of its runs, with the min-max spread as an error bar and the
    speedup over the baseline written on each bar; "within noise" where a step cannot be told from the rung
    before), the final test accuracy of every run beside the baseline's band (`accuracy_spread`: a faster rung
    that ends below the band is not a win by accuracy), and the loss curves against images seen (PNG). A log
    img/s axis when rungs differ 10x or more.

    `note` (e.g. "quick mode; skipped: ...") is written under the chart.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = ladder_rows(records)
    fig, (ax, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.4), gridspec_kw={"width_ratios": [3, 2, 2]})
    names = [r["rung"] for r in rows]
    vals = [r["img_per_s"] for r in rows]
    colors = series_colors(len(rows))
    err = None
    if any(r["spread"] for r in rows):
        err = [[r["img_per_s"] - (r["spread"] or (r["img_per_s"],) * 2)[0] for r in rows[::-1]],
               [(r["spread"] or (r["img_per_s"],) * 2)[1] - r["img_per_s"] for r in rows[::-1]]]
    bars = ax.barh(names[::-1], vals[::-1], color=colors[::-1], xerr=err, capsize=3 if err else 0)
    for b, r in zip(bars, rows[::-1], strict=True):
        tag = ", within noise" if r["within_noise"] else ""
        right = (r["spread"] or (r["img_per_s"],) * 2)[1]
        ax.text(right, b.get_y() + b.get_height() / 2, f" {r['img_per_s']:,.0f} ({r['speedup']:.1f}x{tag})",
                va="center", fontsize=8)
    runs = max((r["repeats"] for r in rows), default=1)
    ax.set_xlabel("training images / s (steady; data loading included)"
                  + (f"; median of {runs} runs, bars: min-max" if runs > 1 else ""))
    if log_axis_if_wide(ax, vals):
        ax.set_xlim(min(vals) / 1.5, max(vals) * 4)
    else:
        ax.set_xlim(0, max(vals) * 1.45)
    ax.set_title(title)
    accuracy_spread(ax3, records)
    loss_curves(records, ax2)
    ax2.set_title("loss curves (first run of each rung)")
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
    zoom_accuracy(ax, [100 * p["accuracy"] for p in shown], pad=2.0)
    left_out = len(points) - len(shown)
    ax.set_title(title + (f" ({left_out} diverged runs not shown)" if left_out else ""), fontsize=9)
    ax.legend(fontsize=7)
    return ax


def _range(vals, fmt: str = ".1f", scale: float = 100.0, unit: str = "%") -> str:
    lo, hi = scale * min(vals), scale * max(vals)
    return f"{lo:{fmt}}–{hi:{fmt}}{unit}" if f"{lo:{fmt}}" != f"{hi:{fmt}}" else f"{lo:{fmt}}{unit}"


def cold_time_to_accuracy(rec: dict, fast: str = "cuda_graphs", top: str = "muon") -> dict:
    """The cold whole-process time to accuracy (benchmarks/time_to_accuracy.py's record), formatted: the target
    (the baseline's median final accuracy), the baseline's and `fast`'s median seconds from spawning the process
    to the first evaluation at the target with their spread, how many runs got there, their ratio of medians,
    and `top`'s final accuracies when it never gets there. Strings and counts."""
    summ, target = rec["summary"], rec["target_accuracy"]
    out = {"tta_target": f"{100 * target:.2f}%", "tta_rounds": rec["rounds"],
           "tta_card": rec["env"]["device_name"], "tta_torch": rec["env"]["torch"]}
    for key, name in (("tta_base", "baseline"), ("tta_fast", fast), ("tta_top", top)):
        v = summ[name]
        t, a = v["to_target_s"], v["accuracy"]
        out |= {f"{key}_reached": f"{v['reached_target']} of {v['runs']}",
                f"{key}_accs": _range([a["min"], a["max"]], fmt=".2f")}
        if t:
            out |= {f"{key}_s": f"{t['median']:.1f} s", f"{key}_spread": _range([t["min"], t["max"]], scale=1.0,
                                                                                  unit=" s")}
    out["tta_sooner"] = f"{summ[fast]['ratio_vs_baseline']:.1f}x"
    out["tta_top_never"] = summ[top]["reached_target"] == 0
    return out


def variant_time_to_accuracy(rec: dict, name: str) -> dict:
    """One variant's cold time to accuracy against the baseline of the same record (benchmarks/time_to_accuracy.py
    with --variant), formatted as `cold_time_to_accuracy` does, with keys prefixed `var_`, plus the variant's steady
    img/s, its cold runs' seconds before their first step (`var_before_loop`: what no faster loop can remove) and,
    where the record has them, its runs with the saved compile artifact (`var_artifact_s`, `var_artifact_sooner`)."""
    out = {k.replace("tta_", "var_", 1): v for k, v in cold_time_to_accuracy(rec, fast=name, top=name).items()}
    summ = rec["summary"]
    out["var_img_per_s"] = f"{summ[name]['img_per_s']['median']:,.0f} img/s"
    cold = [r["before_loop_s"] for r in rec["runs"] if r["label"].startswith(f"{name}-") and r["ok"]]
    out["var_before_loop"] = _range(cold, scale=1.0, unit=" s")
    out["var_tenth_of_base"] = f"{summ['baseline']['to_target_s']['median'] / 10:.1f} s"  # what 10x would leave
    art = summ.get(f"{name}+artifact")
    if art and art["to_target_s"]:
        out |= {"var_artifact_s": f"{art['to_target_s']['median']:.1f} s",
                "var_artifact_sooner": f"{art['ratio_vs_baseline']:.1f}x"}
    return out


def headline(ablation: dict, ladder: dict, cold: dict, fast: str = "without_muon",
             eager_job: str = "whole run batch_fused", top_job: str = "whole run muon, cold") -> dict:
    """The headline's figures as the README, the results page and week 6 print them, from their records: time to
    the baseline's accuracy (the ablation's target: the lowest of its baseline runs) for the baseline, the fastest
    run that reaches it (`fast`) and the top rung; every run's accuracy of the baseline and of the top rung in both
    records; whole cold processes (`cold`, a cold_start record: median seconds, spread, accuracy); throughput and
    MFU (datasheet peak) beside the share of the measured matmul peak, from `ladder`. Strings, formatted."""
    import statistics as st

    from labkit.waves import datasheet_peak

    target = target_accuracy(ablation)
    rows = {r["rung"]: r for r in ladder_rows(ablation["rungs"], target)}
    top_name = ladder["rungs"][-1]["name"]
    (b0, b1), (f0, f1) = rows["baseline"]["to_target_s"], rows[fast]["to_target_s"]
    accs = {n: [x["accuracy"] for rec in (ablation, ladder) for r in rec["rungs"] if r["name"] == n
                for x in (r.get("runs") or [r])] for n in ("baseline", top_name)}
    top, base = ladder["rungs"][-1], ladder["rungs"][0]
    out = {"target": f"{100 * target:.2f}%", "baseline_s": f"{b0:.1f} s", "baseline_s_without": f"{b1:.1f} s",
           "fast_s": f"{f0:.1f} s", "fast_s_without": f"{f1:.1f} s", "sooner": f"{b0 / f0:.1f}x",
           "sooner_without": f"{b1 / f1:.1f}x", "top_reaches": rows[top_name]["to_target_s"] is not None,
           "top_ablation_acc": f"{100 * rows[top_name]['accuracy']:.1f}%", "top_ladder_acc": f"{100 * top['accuracy']:.1f}%",
           "top_accs": _range(accs[top_name]), "baseline_accs": _range(accs["baseline"]),
           "throughput": f"{top['img_per_s'] / base['img_per_s']:.0f}x",
           "throughput_ladder": f"{top['img_per_s'] / base['img_per_s']:.2f}x",
           "throughput_ablation": f"{rows[top_name]['img_per_s'] / rows['baseline']['img_per_s']:.1f}x"}
    for key, job in (("cold_eager", eager_job), ("cold_top", top_job)):
        runs = cold["jobs"][job]["runs"]
        walls, job_accs = [r["wall_s"] for r in runs], [r["accuracy"] for r in runs]
        out |= {f"{key}_s": f"{st.median(walls):.1f} s", f"{key}_spread": _range(walls, scale=1.0, unit=" s"),
                f"{key}_acc": f"{100 * st.median(job_accs):.1f}%", f"{key}_accs": _range(job_accs),
                f"{key}_reaches": st.median(job_accs) >= target, f"{key}_rounds": len(runs)}
    sheet = datasheet_peak(ladder["env"]["device_name"], "bf16")
    out |= {"datasheet": f"{sheet:.0f} TFLOP/s", "datasheet_exact": f"{sheet:.1f} TFLOP/s",
            "mfu": f"{100 * top['mfu_datasheet']:.1f}%", "share_measured": f"{100 * top['mfu']:.1f}%"}
    return out

"""Time to the baseline's accuracy, from a cold process: what a student waits for, rung against rung.

    python benchmarks/time_to_accuracy.py [--rounds 3] [--presets baseline,cuda_graphs,muon] [--artifact]
                                          [--variant LABEL=PRESET:FIELD=VALUE,...] ... [--lightning]
                                          [--out benchmarks/results/ladder] [--name time_to_accuracy_h200]

A --variant is a recipe being tried: a ladder preset with TrainConfig fields changed (`labkit train --set`),
run and summarized under its own label beside the presets, e.g. `--variant muon_e8=muon:epochs=8`. --lightning adds
the PyTorch Lightning bf16-mixed peer (`benchmarks/peers.py --time-to-accuracy-run`: the baseline's recipe and
epochs, PNG files through a worker per core), timed the same way under the label `lightning`; it needs Lightning
installed, which is checked before any training.

Each run is `labkit train --preset P --set eval_every_epoch=true` in a new Python process with empty
torch.compile caches (new inductor, Triton and labkit compile-cache folders), as on a new machine; the presets
alternate within each round, so drift on the machine hits all of them. With --artifact, every compiled preset also
runs once a round with the compile-cache artifact (`labkit compile-cache`, built once at the start in its own
process), its inductor and Triton folders still empty. The synthetic data set is generated once before the
first round (a student's first run pays a few seconds more for it; the record says how long it took).

For each run the record keeps:
  whole_s          the process's wall time from spawn to exit (interpreter, imports, data, compile, every epoch)
  to_target_s      whole-process seconds to the first evaluation at or above the target: the time before the
                   training loop (process start, imports, device, cache load, setup), plus the loop's seconds up to
                   that epoch's evaluation (`stages_s` and `accuracy_curve` of the train record); None if never
  train_to_target_s the training loop's seconds alone to that evaluation
  accuracy         the final test accuracy, and the per-epoch curve
  tiered           the run's tiered-start report (`labkit.faststart.tiered`): how many steps ran eager and how many
                   compiled, and when the compiled forward was ready; None where the run did not start tiered
The target is the baseline's median final accuracy over its runs in this call (the issue's measure: the top rung
must reach the baseline's median, not its worst run). The summary gives each preset's median and min-max, and the
ratio of medians against the baseline. The result is saved after every run, so a call cut short keeps its runs.
Needs a CUDA GPU for the compiled presets; on a CPU it refuses, since the CPU ladder has its own record.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _empty_caches(base: Path, tag: str) -> dict[str, str]:
    d = Path(tempfile.mkdtemp(prefix=f"tta-{tag}-", dir=base))
    return {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TRITON_CACHE_DIR": str(d / "triton"),
            "LABKIT_COMPILE_CACHE": str(d / "compile-cache")}


LIGHTNING = "lightning"  # the peer's label and "preset": not a ladder rung, so it never collides with one


def command(preset: str, sets: tuple[str, ...], out: Path) -> list[str]:
    """The fresh process that trains `preset` (or the Lightning peer) and writes its record to `out`."""
    if preset == LIGHTNING:
        return [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--time-to-accuracy-run", str(out)]
    return [sys.executable, "-m", "labkit", "train", "--preset", preset, "--set", "eval_every_epoch=true", *sets,
            "--json", str(out), "--overwrite"]


def run_once(preset: str, env: dict[str, str], work: Path, label: str, sets: tuple[str, ...] = ()) -> dict:
    """One `labkit train` (or Lightning peer) in a fresh process (TrainConfig fields `sets`, FIELD=VALUE, changed);
    its record plus the spawn-to-exit wall time."""
    out = work / f"{label}.json"
    cmd = command(preset, sets, out)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    whole = time.perf_counter() - t0
    if r.returncode != 0 or not out.exists():
        return {"preset": preset, "sets": list(sets), "label": label, "ok": False, "whole_s": whole,
                "error": (r.stderr or r.stdout)[-2000:]}
    rec = json.loads(out.read_text())
    st = rec.get("stages_s", {})
    before_loop = sum(st.get(k, 0.0) for k in ("process_before_command", "device_and_config",
                                                  "compile_cache_load", "setup"))
    return {"preset": preset, "sets": list(sets), "label": label, "ok": True, "whole_s": whole, "before_loop_s": before_loop,
            "stages_s": st, "setup_parts_s": rec.get("setup_parts_s"), "accuracy": rec.get("accuracy"), "img_per_s": rec.get("img_per_s"),
            "first_step_s": rec.get("first_step_s"), "curve": rec.get("accuracy_curve") or [],
            "epochs": rec.get("config", {}).get("epochs"), "batch_size": rec.get("config", {}).get("batch_size"),
            "tiered": rec.get("tiered"), "precompiled": rec.get("precompiled")}


def score(runs: list[dict], target: float) -> None:
    """Fill each run's time to `target`: whole-process and training-loop seconds to the first epoch at target."""
    for r in runs:
        hit = next((c for c in r.get("curve", []) if c["accuracy"] >= target), None) if r["ok"] else None
        r["train_to_target_s"] = hit["train_s"] if hit else None
        r["to_target_s"] = r["before_loop_s"] + hit["train_s"] if hit else None


def _spread(vals: list[float]) -> dict | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(runs: list[dict], target: float | None) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"].rsplit("-r", 1)[0], []).append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if r["ok"]]
        out[key] = {"runs": len(rs), "failed": len(rs) - len(ok),
                    "reached_target": sum(r.get("to_target_s") is not None for r in ok),
                    "to_target_s": _spread([r.get("to_target_s") for r in ok]),
                    "train_to_target_s": _spread([r.get("train_to_target_s") for r in ok]),
                    "whole_s": _spread([r["whole_s"] for r in ok]),
                    "accuracy": _spread([r["accuracy"] for r in ok]),
                    "img_per_s": _spread([r["img_per_s"] for r in ok])}
    base = out.get("baseline", {}).get("to_target_s")
    for v in out.values():
        t = v["to_target_s"]
        # a ratio of medians only where most runs got there: a median over the few that did would flatter
        v["ratio_vs_baseline"] = (base["median"] / t["median"] if base and t and v["reached_target"] * 2 > v["runs"]
                                  else None)
    return out


def table(summary: dict, target: float | None) -> str:
    lines = [f"target: the baseline's median final accuracy, {target:.4f}" if target else "target: none yet",
             f"{'preset':<24} {'reached':>7} {'to target s (min-max)':>26} {'x baseline':>10} "
             f"{'final acc (min-max)':>22} {'img/s':>9}"]
    for k, v in summary.items():
        t, a, s = v["to_target_s"], v["accuracy"], v["img_per_s"]
        tt = f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})" if t else "-"
        aa = f"{a['median']:.4f} ({a['min']:.4f}-{a['max']:.4f})" if a else "-"
        ratio = f"{v['ratio_vs_baseline']:.1f}x" if v["ratio_vs_baseline"] else "-"
        lines.append(f"{k:<24} {v['reached_target']:>3}/{v['runs']:<3} {tt:>26} {ratio:>10} {aa:>22} "
                     f"{(s['median'] if s else 0):>9,.0f}")
    return "\n".join(lines)


def parse_variant(spec: str) -> tuple[str, str, tuple[str, ...]]:
    """`LABEL=PRESET:FIELD=VALUE,...` -> (label, preset, ("FIELD=VALUE", ...)), checked before any training."""
    from labkit.presets import RUNG_NAMES, TrainConfig

    label, sep, rest = spec.partition("=")
    preset, sep2, fields = rest.partition(":")
    sets = tuple(f.strip() for f in fields.split(",") if f.strip())
    if not (sep and sep2 and label.isidentifier() and sets):
        raise SystemExit(f"--variant {spec!r}: expected LABEL=PRESET:FIELD=VALUE[,FIELD=VALUE...], "
                         "e.g. muon_e8=muon:epochs=8")
    if preset not in RUNG_NAMES:
        raise SystemExit(f"--variant {spec!r}: unknown preset {preset!r} (one of {', '.join(RUNG_NAMES)})")
    known = {f.name for f in __import__("dataclasses").fields(TrainConfig)}
    bad = [f for f in sets if "=" not in f or f.split("=", 1)[0] not in known]
    if bad:
        raise SystemExit(f"--variant {spec!r}: not a TrainConfig FIELD=VALUE: {', '.join(bad)}")
    return label, preset, sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every preset once (default 3)")
    ap.add_argument("--presets", default="baseline,cuda_graphs,muon", help="comma-separated ladder presets")
    ap.add_argument("--artifact", action="store_true", help="also run compiled presets with the artifact")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET:FIELD=VALUE,...",
                    help="also run a preset with TrainConfig fields changed, under its own label (repeatable)")
    ap.add_argument("--lightning", action="store_true",
                    help="also run the PyTorch Lightning bf16-mixed peer under the label lightning (needs Lightning)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ladder"), help="folder for the result JSON")
    ap.add_argument("--name", default="time_to_accuracy_h200", help="result name (file stem)")
    args = ap.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if "baseline" not in presets:
        raise SystemExit("--presets must include baseline: the target is its median accuracy")
    recipes = {p: (p, ()) for p in presets}
    for spec in args.variant:
        label, preset, sets = parse_variant(spec)
        if label in recipes:
            raise SystemExit(f"--variant {spec!r}: the label {label!r} is taken")
        recipes[label] = (preset, sets)
    if args.lightning:
        if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
            raise SystemExit("--lightning: Lightning is not installed here (pip install 'lightning>=2.2', or "
                             "pip install -e '.[peers]')")
        recipes[LIGHTNING] = (LIGHTNING, ())
    import torch

    from labkit.bench import save_result
    from labkit.outputs import check_writable

    if not torch.cuda.is_available():
        raise SystemExit("time_to_accuracy.py needs a CUDA GPU (the compiled rungs need CUDA graphs); "
                         "the CPU ladder's record is made by `labkit ladder --quick`")
    check_writable(Path(args.out) / f"{args.name}.json")  # before an hour of training, not after
    work = Path(tempfile.mkdtemp(prefix="tta-work-"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from labkit import data; data.load('synthetic')"], check=True)
    data_s = time.perf_counter() - t0
    artifact_env = None
    if args.artifact:
        artifact_env = _empty_caches(work, "artifact")
        compiled = ",".join(sorted({p for p, _ in recipes.values() if p not in ("baseline", LIGHTNING)}))
        b = subprocess.run([sys.executable, "-m", "labkit", "compile-cache", "--build", "--rungs", compiled],
                           env={**os.environ, **artifact_env}, capture_output=True, text=True)
        if b.returncode != 0:
            print("artifact build failed; running cold only:", (b.stderr or b.stdout)[-500:], flush=True)
            artifact_env = None
    runs: list[dict] = []
    target = None
    for rnd in range(args.rounds):
        names = list(recipes)
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            p, sets = recipes[name]
            plans = [("cold", _empty_caches(work, name))]
            if artifact_env and p not in ("baseline", LIGHTNING):
                plans.append(("artifact", {**_empty_caches(work, name),
                                           "LABKIT_COMPILE_CACHE": artifact_env["LABKIT_COMPILE_CACHE"]}))
            for how, env in plans:
                label = f"{name}{'' if how == 'cold' else '+artifact'}-r{rnd}"
                r = run_once(p, env, work, label, sets)
                r["round"], r["caches"] = rnd, how
                runs.append(r)
                accs = [x["accuracy"] for x in runs if x["label"].startswith("baseline-r") and x["ok"]]
                target = statistics.median(accs) if accs else None
                if target is not None:
                    score(runs, target)
                print(f"round {rnd} {label}: {'ok' if r['ok'] else 'FAILED'} whole {r['whole_s']:.1f} s, "
                      f"accuracy {r.get('accuracy')}", flush=True)
                summary = summarize(runs, target)
                save_result(args.name, {"kind": "time_to_accuracy", "target_accuracy": target,
                                        "target_rule": "median final test accuracy of the baseline's runs in "
                                                       "this call", "data_generation_s": data_s,
                                        "rounds": args.rounds, "presets": presets,
                                        "peers": [LIGHTNING] if args.lightning else [],
                                        "variants": {k: {"preset": v[0], "sets": list(v[1])}
                                                     for k, v in recipes.items() if v[1]},
                                        "summary": summary,
                                        "runs": runs}, out_dir=args.out)
    print(table(summarize(runs, target), target))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The project's promises about itself: dependency lists agree, CI runs the README's test command, and every GPU
number in the README and on the results pages (docs/results/) is the one in its result file."""

import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from labkit.bench import Records
from labkit.env import LabkitError

ROOT = Path(__file__).resolve().parents[1]
RES = Records(ROOT / "benchmarks" / "results")  # a record by name, in whichever topic folder holds it
RESULTS_PAGES = ROOT / "docs" / "results"  # one page per topic; docs/results.md is their index


def page_text(*names: str) -> str:
    """The results pages `names` (docs/results/<name>.md), one after another."""
    return "\n".join((RESULTS_PAGES / f"{name}.md").read_text() for name in names)


def results_page(*names: str) -> str:
    """The results pages `names` with their line breaks folded into spaces, so a sentence matches across lines."""
    return " ".join(page_text(*names).split())


def _names(reqs):
    return {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_environment_yml_matches_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    yml = (ROOT / "environment.yml").read_text()
    pip_section = yml.split("- pip:", 1)[1]
    pip_lines = re.findall(r"^\s+- ([A-Za-z][\w.\-]*(?:[<>=!~][^\s#]*)?)\s*$", pip_section, flags=re.M)
    yml_names = _names(pip_lines) - {"python", "pip"}
    course = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["course"]
    assert _names(deps) | _names(course) == yml_names  # conda users get the notebook server and nbgrader too
    deps = deps + course
    # Same lower bounds too.
    assert set(deps) <= set(pip_lines)


def test_required_stack_is_declared():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, course = _names(proj["dependencies"]), _names(proj["optional-dependencies"]["course"])
    for pkg in ("torch", "torchvision", "matplotlib", "line-profiler", "memory-profiler"):
        assert pkg in deps
    assert course == {"jupyterlab", "nbgrader"}
    makefile = (ROOT / "Makefile").read_text()
    assert 'pip install --quiet -e ".[course,dev]"' in makefile and "-e .[course,dev]" in (
        ROOT / "environment.yml").read_text(), "make setup and conda keep installing JupyterLab and nbgrader"


SERVER_STACK = {"jupyterlab", "jupyter-server", "notebook", "nbgrader", "jupyterlab-server", "nbclassic"}


def _requires(name: str) -> set[str]:
    """Names a distribution installed here requires, extras left out (what pip would pull for it)."""
    from importlib import metadata

    try:
        reqs = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return set()
    return _names(r for r in reqs if "extra ==" not in r.split(";", 1)[-1])


def test_student_install_is_light_and_leaves_the_notebook_server_alone():
    """The student install (the project's dependencies, as the student release's pyproject declares them) is
    what the notebooks and public checks import, and pulls in no notebook server or nbgrader, even indirectly
    (Colab's own jupyter-server/notebook must stay as they are)."""
    from autograder.release import build as release

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = _names(proj["dependencies"])
    assert deps == {"torch", "torchvision", "numpy", "matplotlib", "line-profiler", "memory-profiler", "tqdm",
                    "psutil", "pillow", "scikit-learn"}
    assert tomllib.loads(release._pyproject(ROOT))["project"]["dependencies"] == proj["dependencies"]
    seen, todo = set(), list(deps)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(_requires(name))
    assert not seen & SERVER_STACK, f"the student install pulls {sorted(seen & SERVER_STACK)}"
    assert "nbgrader" in _names(proj["optional-dependencies"]["course"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[:2] == ["make demo", "make test"], commands[:4]
    run = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert run[-1] == "make test" and not [c for c in run if c.startswith("make ") and c != "make test"], run


def test_the_demo_is_the_doctor_then_the_default_ladder():
    """CI runs `make test` alone; what `make demo` adds to it is these two commands, each run by the suite (the
    doctor in tests/test_env.py, the quick CPU ladder's engine in tests/test_train.py and the week 6 notebook)."""
    if not shutil.which("make"):
        pytest.skip("no make here")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    lines = [ln.strip() for ln in dry.stdout.splitlines()]
    assert dry.returncode == 0 and lines[-2:] == [".venv/bin/labkit doctor", ".venv/bin/labkit ladder --out runs/ladder"], \
        dry.stdout[-500:]


def test_results_files_name_card_torch_commit_command():
    import json

    for p in sorted((ROOT / "benchmarks" / "results").glob("*/*.json")):
        env = json.loads(p.read_text()).get("env", {})
        for key in ("device_name", "torch", "git_commit", "command"):
            assert env.get(key), f"{p.name} lacks env.{key}"


def test_readme_gpu_numbers_come_from_the_committed_ladder():
    import json

    from labkit import report

    ladder = json.loads((RES / "ladder.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert report.ladder_table(ladder["rungs"]) in page_text("ladder")  # the README links the table there
    for text in (readme, page_text("ladder")):
        assert ladder["env"]["device_name"] in text and "benchmarks/results/ladder/ladder.png" in text
    rungs = ladder["rungs"]
    # the headline is time to the baseline's accuracy; the top rung's img/s ratio is said to be throughput alone
    load = lambda name: json.loads((RES / f"{name}.json").read_text())  # noqa: E731
    h = report.headline(load("ladder_ablation"), ladder, load("cold_start_tiered_final"))
    folded = " ".join(readme.split())
    cold = report.cold_time_to_accuracy(load("time_to_accuracy_h200"))
    half = report.variant_time_to_accuracy(load("time_to_accuracy_muon_b2048_h200"), "muon_b2048")
    calls = [report.variant_time_to_accuracy(load(n), "muon_b2048")["var_sooner"] for n in
             ("time_to_accuracy_muon_b2048_h200", "time_to_accuracy_peers_h200", "time_to_accuracy_eager_h200",
              "time_to_accuracy_nowarm_h200")]
    span = f"{min(calls, key=lambda x: float(x[:-1]))[:-1]}–{max(calls, key=lambda x: float(x[:-1]))}"
    assert f"reaches its baseline's accuracy {span} sooner from a cold process on an H200 (four calls)" in folded
    assert not h["top_reaches"] and cold["tta_top_never"] and not half["var_top_never"]
    assert f"the fastest rung as the ladder runs it, {rungs[-1]['img_per_s'] / rungs[0]['img_per_s']:.0f}x the img/s " \
        f"at batch {rungs[-1]['config']['batch_size']}, does not count: it ends below that accuracy" in folded
    assert "docs/results.md" in readme and "assignments/README.md" in readme


def test_results_page_grading_ddp_and_top_rung_numbers_match_their_results():
    import json

    res = RES
    page = results_page("top_rung", "ddp", "grading", "coldstart")
    grade = json.loads((res / "grade_reference_gpu.json").read_text())
    speed = next(v for v in grade["labs"]["lab4"]["verdicts"] if v["check"] == "lab4.speed")["measurements"]
    assert grade["all_gradable_full_marks"]
    assert f"runs {speed['speedup']:.2f}x the naive step ({speed['student_img_per_s']:,} vs {speed['naive_img_per_s']:,}" \
        in page
    rel = json.loads((res / "grade_reliability.json").read_text())["summary"]
    assert rel["runs"] == 10 and f"{rel['false_failures']} false failures, ratio {rel['ratio_min']:.2f}–" \
        f"{rel['ratio_max']:.2f}x" in page
    sc = json.loads((res / "ddp_scaling.json").read_text())
    ips = sc["img_per_s"]
    assert sc["env"]["device_name"] in page
    assert f"{ips['1']:,.0f} img/s on one GPU and {ips['2 weak']:,.0f} img/s on two" in page
    assert f"{100 * sc['weak_efficiency']:.1f}% weak-scaling" in page and f"{100 * sc['strong_efficiency']:.1f}%" in page
    v1, v2 = (json.loads((res / f).read_text()) for f in ("ddp_scaling_variants.json", "ddp_scaling_variants2.json"))
    pct = lambda r: f"{100 * r['weak_efficiency']:.1f}%"  # noqa: E731
    assert f"({pct(v1['variants']['one-graph'])} against {pct(v1)}," in page
    assert f"({pct(v2['variants']['static'])} against {pct(v2)}," in page
    assert f"({pct(v1['variants']['bf16-grads'])} and {pct(v2['variants']['bf16-grads'])})" in page
    assert f"({pct(sc['variants']['bucket100'])})" in page
    simple = json.loads((res / "ddp_scaling_nccl_simple.json").read_text())
    assert "NCCL_PROTO=Simple" in simple["annotation"] and f"Simple protocol ({pct(simple)}," in page
    top = json.loads((res / "top_rung.json").read_text())["variants"]
    big = json.loads((res / "top_rung_batch2048.json").read_text())["variants"]
    assert f"{big['batch 2048, lr 0.05']['img_per_s']:,.0f} img/s, and" in page
    assert f"{100 * big['batch 2048, lr 0.05, 10 epochs']['accuracy']:.1f}% after 10, where the rung reaches " \
        f"{100 * big['rung, 10 epochs']['accuracy']:.1f}%" in page
    ma = json.loads((res / "top_rung_max_autotune.json").read_text())["model_step"]
    assert f"ran it at {ma['512-max-autotune']['img_per_s']:,.0f} img/s, against " \
        f"{ma['512-reduce-overhead']['img_per_s']:,.0f}" in page
    assert f"{max(v['img_per_s'] for v in top.values()):,.0f} img/s" in page
    sgd = json.loads((res / "top_rung_large_batch_sgd.json").read_text())["variants"]
    best = max((v for k, v in sgd.items() if k.startswith("2048 recipe")), key=lambda v: v["accuracy_median"])
    assert f"reaches at best {100 * best['accuracy_median']:.1f}% (peak learning rate 0.4;" in page
    assert best["changes"]["lr"] * 2048 / 128 == pytest.approx(0.4)
    collapsed = [v for k, v in sgd.items() if k.startswith("2048 recipe peak") and k.split()[3] in ("0.8", "1.6")
                 and "augmentation" not in k]  # "from 0.8 up, training collapses": the runs that kept augmentation
    assert len(collapsed) == 4 and all(v["accuracy_min"] < 0.5 for v in collapsed)
    adamw = json.loads((res / "top_rung_adamw.json").read_text())
    av = adamw["variants"]
    assert adamw["seeds"] == 2 and adamw["env"]["device_name"] == "NVIDIA H100 80GB HBM3"
    a4, tuned = av["2048 adamw 4e-3"], av["2048 adamw 4e-3 + tuning"]
    assert f"{100 * a4['accuracy_median']:.1f}% at peak learning rate 0.004 and {a4['img_per_s_median']:,.0f} img/s" \
        f" ({tuned['img_per_s_median']:,.0f} with coordinate-descent tuning)" in page
    knobs = [v["accuracy_median"] for k, v in av.items() if k.startswith("2048 adamw 4e-3") and "zero-init" not in k]
    assert f"stays at {100 * min(knobs):.1f}–{100 * max(knobs):.1f}% whatever" in page
    assert f"against {100 * av['rung (batch 512)']['accuracy_median']:.1f}% for the rung" in page
    ep = json.loads((res / "top_rung_epochs.json").read_text())["variants"]
    rung, a8, a10 = ep["rung (batch 512)"], ep["batch 2048, AdamW, 8 epochs"], ep["batch 2048, AdamW, 10 epochs"]
    assert a8["accuracy_median"] < rung["accuracy_median"] < a10["accuracy_median"]
    assert f"reach the rung's {100 * rung['accuracy_median']:.1f}% ({100 * a8['accuracy_median']:.1f}% after 8, " \
        f"{100 * a10['accuracy_median']:.1f}% after 10)" in page
    secs = lambda v, epochs: epochs * 50_000 / v["img_per_s_median"]  # noqa: E731 - seconds of steady training
    assert f"8 epochs at {a8['img_per_s_median']:,.0f} img/s are {secs(a8, 8):.2f} s of training against " \
        f"{secs(rung, 5):.2f} s for the rung's 5 epochs at {rung['img_per_s_median']:,.0f} img/s" in page
    again = json.loads((res / "ddp_scaling_repeat.json").read_text())
    assert f"gave {pct(again)} (`ddp_scaling_repeat.json`)" in page
    assert f"same {again['img_per_s']['2 weak']:,.0f} img/s, one GPU faster at {again['img_per_s']['1']:,.0f}" in page


def test_results_page_explains_the_compile_rung_with_the_recorded_profile():
    import json

    page = results_page("ladder")
    prof = json.loads((RES / "week5_profiling.json").read_text())
    assert prof["env"]["device_name"] == "NVIDIA H100 80GB HBM3"
    eager, comp, graphs = (prof["rungs"][k]["evidence"] for k in ("cudnn_benchmark", "compile", "cuda_graphs"))
    assert comp["kernel_ms_per_step"] < eager["kernel_ms_per_step"] and comp["gpu_idle_share"] > eager["gpu_idle_share"]
    assert f"kernel time from {eager['kernel_ms_per_step']:.2f} to {comp['kernel_ms_per_step']:.2f} ms per step" in page
    assert f"idle for {100 * comp['gpu_idle_share']:.0f}% of a compiled step against " \
        f"{100 * eager['gpu_idle_share']:.0f}% of an eager one" in page
    assert f"with {graphs['launches_per_step']:.0f} launches instead of {comp['launches_per_step']:.0f}" in page
    assert f"busy {100 * graphs['gpu_busy_share']:.0f}% of the step" in page


def test_results_page_cold_compile_times_and_executed_notebooks_match_their_records():
    import json

    res = RES
    page = results_page("ladder", "notebooks")
    ct = json.loads((res / "compile_time.json").read_text())
    assert ct["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and set(ct["rungs"]) == {"compile", "cuda_graphs", "muon"}
    r = {k: (v["cold"]["first_step_s"], v["warm"]["first_step_s"]) for k, v in ct["rungs"].items()}
    assert all(cold > 2 * warm for cold, warm in r.values())  # what the paragraph says: the cache saves most of it
    assert (f"the first step takes {r['compile'][0]:.1f} s cold and {r['compile'][1]:.1f} s warm for `compile`, "
            f"{r['cuda_graphs'][0]:.1f} s and {r['cuda_graphs'][1]:.1f} s for `cuda_graphs`, {r['muon'][0]:.1f} s and "
            f"{r['muon'][1]:.1f} s for `muon`") in page
    runs = json.loads((res / "notebooks" / "notebook_runs.json").read_text())["notebooks"]
    notebooks = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(n["path"] for n in runs) == notebooks  # every notebook has an executed copy, and all ran clean
    assert all(n["status"] == "ok" and not n["quick"] for n in runs)
    later = {"notebooks/07_triton_kernels.ipynb"}  # written after the weeks' refresh: its own run, on an H200
    assert all(n["env"]["device_name"] == "NVIDIA H200" for n in runs if n["path"] in later)
    runs = [n for n in runs if n["path"] not in later]
    assert all(n["env"]["device_name"] == "NVIDIA H100 80GB HBM3" for n in runs)
    week6 = (res / "notebooks" / "06_resnet_ladder.md").read_text()
    # the live table has a spread column: | rung | img/s | spread | img/s (all epochs) | speedup | ...
    row = re.search(r"^\| muon \| ([\d,]+) \| [\d,–]+ \| [\d,]+ \| ([\d.]+)x \|", week6, re.M)
    assert row and f"gives the `muon` rung {row[1]} img/s, {row[2]}x its baseline" in page
    base = re.search(r"^\| baseline \| ([\d,]+) \| ([\d,]+–[\d,]+) \|", week6, re.M)
    rec = json.loads((res / "ladder.json").read_text())["rungs"]
    spread = "–".join(f"{x:,.0f}" for x in (rec[0]["img_per_s_min"], rec[0]["img_per_s_max"]))
    assert base and (f"({base[1]} img/s, spread {base[2]}, against {rec[0]['img_per_s']:,.0f}, spread {spread})"
                     in page)
    gap = abs(float(row[1].replace(",", "")) / rec[-1]["img_per_s"] - 1)  # the live top rung against the record
    assert f"lands within {math.ceil(1000 * gap) / 10:.1f}% of `ladder.json`'s" in page
    assert all(n["env"]["git_commit"] == runs[0]["env"]["git_commit"] for n in runs)  # one commit, one refresh


def test_results_page_top_rung_peers_and_muon_numbers_match_their_results():
    """The top rung's claims: >= 85k img/s, the accuracy band, the peers ratios, and the Muon records behind them."""
    import json

    res = RES
    page = results_page("top_rung", "ladder", "ddp", "grading")
    load = lambda name: json.loads((res / f"{name}.json").read_text())  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    ladder, peers = load("ladder"), load("peers")
    top = ladder["rungs"][-1]
    assert top["name"] == "muon" and top["config"]["batch_size"] == 4096 and top["config"]["optimizer"] == "muon"
    assert top["img_per_s"] >= 85_000 and top["img_per_s"] / ladder["rungs"][0]["img_per_s"] >= 12
    accs = [r["accuracy"] for r in ladder["rungs"]]
    assert f"same accuracy band ({pct(min(accs))}–{pct(max(accs))};" in page and min(accs) == top["accuracy"]
    rd = ladder["real_data"]
    assert rd["passed"] and rd["top_numerics"]["config"]["optimizer"] == "muon"
    assert f"gives {pct(rd['baseline']['accuracy'])} for the baseline recipe and {pct(rd['top_numerics']['accuracy'])}" \
        in page
    assert peers["top"]["config"]["name"] == "muon" and peers["ratios"]["top_vs_lightning"] >= 4
    assert f"our top rung {peers['top']['img_per_s']:,.0f} img/s — {peers['ratios']['top_vs_baseline']:.1f}x the " \
        f"baseline and {peers['ratios']['top_vs_lightning']:.2f}x the peer" in page
    m, pad = load("top_rung_muon"), load("top_rung_muon_padded")
    for r in (m, pad):
        assert r["seeds"] == 3 and r["env"]["device_name"] == "NVIDIA H100 80GB HBM3"
    mv, pv, mo, po = m["variants"], pad["variants"], m["optimizer_step_ms"], pad["optimizer_step_ms"]
    assert f"at batch 2048 Muon reaches {pct(mv['batch 2048, Muon']['accuracy_median'])} in 5 epochs where AdamW " \
        f"reaches {pct(mv['batch 2048, AdamW']['accuracy_median'])} and the rung " \
        f"{pct(mv['rung (batch 512)']['accuracy_median'])}" in page
    assert f"{mo['muon (eager)']['ms']:.2f} ms eager, {mo['muon (CUDA graph)']['ms']:.2f} ms replayed" in page
    assert po["muon (CUDA graph)"]["captured"] and f"brought it to {po['muon (CUDA graph)']['ms']:.2f} ms" in page
    b4 = pv["batch 4096, Muon"]
    assert all(top["config"][k] == v for k, v in b4["changes"].items())  # the variant measured is the rung
    assert f"batch 4096 to {b4['img_per_s_median']:,.0f} img/s at {pct(b4['accuracy_median'])}" in page
    # "inside the spread the rung shows across the recorded seeds and runs"
    rung_runs = [r["accuracy"] for f in (ROOT / "benchmarks" / "results").glob("*/top_rung_*.json") for k, v in json.loads(f.read_text())
                 .get("variants", {}).items() if k == "rung (batch 512)" for r in v.get("runs", [])]
    assert len(rung_runs) >= 10 and f"runs ({100 * min(rung_runs):.1f}–{100 * max(rung_runs):.1f}%)" in page
    assert min(rung_runs) <= b4["accuracy_median"] <= max(rung_runs)
    dm = load("ddp_muon_h200x2")
    assert dm["processes"] == 2 and dm["config"]["name"] == "muon" and "H200" in dm["env"]["device_name"]
    assert f"trained at {dm['img_per_s']:,.0f} img/s (global batch {dm['config']['batch_size']}, " \
        f"{dm['config']['batch_size'] // 2} per GPU) to {pct(dm['accuracy'])} after {dm['config']['epochs']} epochs" \
        in page


def test_results_page_matmul_edges_figures_match_their_h200_records():
    """The stem and shortcut section: each figure, ratio and spread from the six H200 records it names."""
    import json

    res = RES
    page = results_page("top_rung", "ladder")
    load = lambda name: json.loads((res / f"top_rung_{name}_h200.json").read_text())  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    recs = {n: load(n) for n in ("conv_shapes", "matmul_edges", "matmul_edges_train", "matmul_edges_eager",
                                 "matmul_edges_tuning", "matmul_edges_tuning_train")}
    for r in recs.values():
        assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
        assert r["env"]["git_commit"][:7] in ("64dfa4e", "58649e8") and r["env"]["command"].startswith("top_rung.py")
        assert "commits 64dfa4e and 58649e8" in page
    rows = recs["conv_shapes"]["conv_shapes"]["rows"]
    assert recs["conv_shapes"]["conv_shapes"]["batch"] == 4096 and sum(r["per_step"] for r in rows) == 20
    stem = next(r for r in rows if r["weight"][1] == 3)
    wide = [p["tflops"] for r in rows if r["weight"][2] == 3 and r is not stem for k, p in r.items()
            if isinstance(p, dict)]
    narrow = [p["tflops"] for r in rows if r["weight"][2] == 1 for p in r.values() if isinstance(p, dict)]
    stem_rates = sorted(p["tflops"] for p in stem.values() if isinstance(p, dict))
    assert f"3x3 convolutions run at {min(wide):.0f}–{max(wide):.0f} TFLOP/s" in page
    assert (f"runs at {stem_rates[0]:.0f}–{stem_rates[-1]:.0f} TFLOP/s: {stem['forward']['ms']:.3f} ms forward and "
            f"{stem['weight grad']['ms']:.3f} ms for its weight gradient") in page
    assert f"shortcuts run at {min(narrow):.0f}–{max(narrow):.0f} TFLOP/s" in page and len(narrow) == 9
    m = recs["matmul_edges"]
    k, ke = m["kernels"], m["kernels_matmul_edges"]
    conv, tri = "conv/matmul (cuDNN, cuBLAS)", "Triton (fused BN/ReLU/add)"
    assert k["batch"] == ke["batch"] == 4096
    assert (f"{k['kernel_ms_per_step']:.2f} ms per step in kernels: {k['ms_per_step_by_class'][conv]:.2f} ms in cuDNN "
            f"convolutions and matrix products ({100 * k['share_by_class'][conv]:.0f}%) and "
            f"{k['ms_per_step_by_class'][tri]:.2f} ms in inductor's fused BatchNorm/ReLU/add kernels "
            f"({100 * k['share_by_class'][tri]:.0f}%)") in page
    assert (f"fall to {ke['ms_per_step_by_class'][conv]:.2f} ms per step and the Triton kernels, the gather now among "
            f"them, rise to {ke['ms_per_step_by_class'][tri]:.2f} ms: {ke['kernel_ms_per_step']:.2f} ms in all") in page

    def spread(v):
        return f"{v['img_per_s']:,.0f} img/s ({v['img_per_s_min']:,.0f}–{v['img_per_s_max']:,.0f})"

    for rec, base, edges in ((m, "4096-reduce-overhead", "4096-reduce-overhead-matmul-edges"),
                             (recs["matmul_edges_eager"], "4096-eager", "4096-eager-matmul-edges")):
        a, b = rec["model_step"][base], rec["model_step"][edges]
        assert rec["rounds"] == 3 and len(a["runs"]) == len(b["runs"]) == 3
        assert f"| {spread(a)} | {spread(b)} | {b['img_per_s'] / a['img_per_s']:.2f}x |" in page
        assert a["img_per_s_max"] < b["img_per_s_min"] or b["img_per_s_max"] < a["img_per_s_min"]  # "do not overlap"
    tv = recs["matmul_edges_train"]["variants"]
    a, b = tv["batch 4096, Muon"], tv["batch 4096, Muon, matmul edges"]
    assert recs["matmul_edges_train"]["seeds"] == 2 and b["changes"] == a["changes"] | {"matmul_edges": True}
    accs = lambda v: " / ".join(pct(r["accuracy"]) for r in v["runs"])  # noqa: E731
    assert (f"| {a['img_per_s_median']:,.0f} img/s, {accs(a)} | {b['img_per_s_median']:,.0f} img/s, {accs(b)} | "
            f"{b['img_per_s_median'] / a['img_per_s_median']:.2f}x |") in page
    tu = recs["matmul_edges_tuning"]["model_step"]
    plain, tuned = tu["4096-reduce-overhead-matmul-edges"], tu["4096-reduce-overhead-matmul-edges-coordinate-descent"]
    assert "4096-max-autotune-matmul-edges" not in tu and "470 s limit" in page
    assert (f"from {plain['img_per_s']:,.0f} to {tuned['img_per_s']:,.0f} img/s, one run each, and its compile from "
            f"{plain['compile_s']:.0f} s to {tuned['compile_s']:.0f} s") in page
    t2 = recs["matmul_edges_tuning_train"]["variants"]
    r0, r1, r2 = (t2[k] for k in ("batch 4096, Muon", "batch 4096, Muon, matmul edges",
                                  "batch 4096, Muon, matmul edges + tuning"))
    assert r2["changes"] == r1["changes"] | {"compile_tuning": True}
    assert (f"the rung {r0['img_per_s']:,.0f} img/s, with matmul edges {r1['img_per_s']:,.0f}, with both "
            f"{r2['img_per_s']:,.0f} ({r2['img_per_s'] / r0['img_per_s']:.2f}x the rung), at {pct(r0['accuracy'])}, "
            f"{pct(r1['accuracy'])} and {pct(r2['accuracy'])} test accuracy") in page
    top = json.loads((res / "ladder.json").read_text())["rungs"][-1]
    assert (f"100,000 img/s on an H100 is {100_000 / top['img_per_s']:.2f}x the rung's {top['img_per_s']:,.0f} there; "
            f"the best measured here is {r2['img_per_s'] / r0['img_per_s']:.2f}x") in page


def test_results_page_matmul_edges_and_tuning_from_a_cold_start_match_their_h200_records():
    """'What a 5-epoch run gains from them': the table's spreads, and the tuned runs' figures, from their records."""
    import json

    res = RES
    page = results_page("coldstart", "log")
    load = lambda name: json.loads((res / f"cold_start_{name}_h200.json").read_text())  # noqa: E731
    recs = {n: load(n) for n in ("matmul_edges", "tuned_edges", "tuned_artifact")}
    for r in recs.values():
        assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
        assert r["env"]["git_commit"].startswith("7942c18") and r["env"]["command"].startswith("cold_start.py")

    def span(xs, f):
        lo, hi = f(min(xs)), f(max(xs))
        return lo if lo == hi else f"{lo}–{hi}"

    seconds, count = (lambda x: f"{x:.1f}"), (lambda x: f"{x:,.0f}")  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    jobs = recs["matmul_edges"]["jobs"]
    for label, row in (("whole run muon, artifact", "the rung"),
                       ("whole run muon, artifact, matmul edges", "matmul edges")):
        runs = jobs[label]["runs"]
        tiers = [r["tiered"] for r in runs]
        assert len(runs) == 3 and all(t["source"] == "saved forward" for t in tiers)
        assert (f"| {row} | {span([t['ready_s'] for t in tiers], seconds)} s | "
                f"{span([t['eager_steps'] for t in tiers], count)} of 60 | "
                f"{span([r['wall_s'] for r in runs], seconds)} s | {span([r['img_per_s'] for r in runs], count)} | "
                f"{span([r['accuracy'] for r in runs], pct)}% |") in page
    pairs = zip(jobs["whole run muon, artifact"]["runs"], jobs["whole run muon, artifact, matmul edges"]["runs"], strict=True)
    assert all(e["wall_s"] > r["wall_s"] for r, e in pairs) and "finished later, in all three rounds" in page
    eager = jobs["whole run batch_fused"]["runs"]
    assert (f"| eager `batch_fused` | | | {span([r['wall_s'] for r in eager], seconds)} s | "
            f"{span([r['img_per_s'] for r in eager], count)} | {span([r['accuracy'] for r in eager], pct)}% |") in page
    timed = load("matmul_edges_load")
    assert timed["env"]["git_commit"].startswith("dd5ba25") and timed["env"]["device_name"] == "NVIDIA H200"
    tiers = {k: [r["tiered"] for r in v["runs"]] for k, v in timed["jobs"].items()}
    a, b = tiers["whole run muon, artifact"], tiers["whole run muon, artifact, matmul edges"]
    assert len(a) == len(b) == 2 and "(`cold_start_matmul_edges_load_h200.json`, 2 rounds, commit dd5ba25)" in page
    assert (f"Importing torch's compiler modules took {span([t['import_s'] for t in a + b], seconds)} s either way. "
            f"Loading the saved forward took {span([t['load_s'] for t in b], seconds)} s with the edges, against "
            f"{span([t['load_s'] for t in a], seconds)} s, and the first compiled step "
            f"{span([t['switch_step_s'] for t in b], lambda x: f'{x:.2f}')} s, against "
            f"{span([t['switch_step_s'] for t in a], lambda x: f'{x:.2f}')} s.") in page
    tuned = recs["tuned_edges"]["jobs"]["whole run muon, artifact, matmul edges, tuned"]["runs"][0]
    builds = [recs["tuned_edges"]["variant_artifacts"]["matmul edges, tuned"], recs["tuned_artifact"]["artifact"]]
    assert f"took {span([b['build_s'] for b in builds], lambda x: f'{x:.0f}')} s to build" in page
    assert f"switched to the loaded forward took {tuned['tiered']['switch_step_s']:.1f} s" in page
    jobs = recs["tuned_artifact"]["jobs"]
    assert jobs["whole run muon, artifact"]["runs"][0]["error"].startswith("exit -11") and "exit -11" in page
    path = jobs["whole run muon, artifact, artifact path"]["runs"][0]
    assert f"all {path['compile_cache']['autotune_placed']} autotuning results were put in place" in page
    assert (f"first step took {path['first_step_s']:.1f} s. After that the run trained at {path['img_per_s']:,.0f} "
            f"img/s, at {100 * path['accuracy']:.2f}% accuracy") in page


def test_top_rung_benchmark_skips_on_cpu_and_names_real_default_variants(capsys):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("top_rung", ROOT / "benchmarks" / "top_rung.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    assert set(top.DEFAULT_TRAIN_VARIANTS) <= set(top.TRAIN_VARIANTS)
    from labkit import train as T

    for changes in top.TRAIN_VARIANTS.values():  # every variant names real fields with valid values
        T.check_config(T.with_changes(T.preset("compile"), **changes), torch.device("cpu"))
    if not torch.cuda.is_available():
        assert top.main(["--device", "cpu"]) == 0
        assert "on CPU there is nothing to measure (skipped)" in capsys.readouterr().out


def test_compile_time_benchmark_covers_the_compiled_rungs_and_skips_without_a_gpu(capsys):
    import importlib.util

    import torch

    from labkit import train as T

    spec = importlib.util.spec_from_file_location("compile_time", ROOT / "benchmarks" / "compile_time.py")
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    assert ct.COMPILED == ["compile", "cuda_graphs", "muon"]  # every ladder rung that compiles, in ladder order
    assert all(T.preset(n).compile for n in ct.COMPILED)
    with pytest.raises(SystemExit):
        ct.main(["--rungs", "bf16"])  # not compiled: an argparse error naming the choices
    assert "not a compiled rung" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert ct.main(["--device", "cpu"]) == 0
        assert "nothing is measured (skipped)" in capsys.readouterr().out
        with pytest.raises(LabkitError, match="cuda_graphs: CUDA graphs need a CUDA GPU"):
            ct.main(["--device", "cpu", "--rungs", "cuda_graphs"])


def test_top_rung_train_variants_repeat_seeds_and_survive_a_diverging_run(capsys):
    import importlib.util

    from labkit import data as D
    from labkit import train as T

    spec = importlib.util.spec_from_file_location("top_rung", ROOT / "benchmarks" / "top_rung.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    base = T.with_changes(T.preset("resident_data", T.quick_base()), width=8, n_train=512, n_test=128, epochs=1,
                          batch_size=64, max_steps=4, channels_last=False, precision="default")
    ds = D.load("synthetic", 512, 128)
    ok = top.train_variant(base, {"lr": 0.02}, "cpu", ds, None, 2, "two seeds")
    assert [r["seed"] for r in ok["runs"]] == [0, 1] and ok["accuracy_min"] is not None
    assert ok["runs"][0]["final_loss"] != ok["runs"][1]["final_loss"]  # the seed really changed the run
    assert ok["accuracy"] == ok["runs"][0]["accuracy"] and ok["changes"] == {"lr": 0.02}
    bad = top.train_variant(base, {"lr": 1e9, "label_smoothing": 0.0}, "cpu", ds, None, 2, "diverges")
    assert "error" in bad and all("NaN" in r["error"] for r in bad["runs"])
    assert "FAILED" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        top.main(["--variant", "no colon here"])
    assert "write LABEL:FIELD=VALUE" in capsys.readouterr().err


def test_results_page_sandboxed_grading_numbers_match_their_record():
    import json

    d = json.loads((RES / "grade_reliability_sandbox.json").read_text())
    s, page = d["summary"], results_page("grading", "coldstart")
    runs = d["calls"]["all_steps"]["runs"] + d["calls"]["spot_checked"]["runs"]
    assert len(runs) == s["sandboxed_runs"] and all(r["sandbox"] == "bwrap" for r in runs)
    before = d["calls"]["before_sandbox"]["runs"]
    assert (f"{s['sandboxed_runs']} runs, {s['false_failures']} false failures, ratio {s['ratio_min']:.2f}–"
            f"{s['ratio_max']:.2f}x, against {min(r['ratio'] for r in before):.2f}–"
            f"{max(r['ratio'] for r in before):.2f}x") in page
    assert (f"median {s['seconds_median_sandboxed']:.1f} s, against {min(s['seconds_before_sandbox']):.1f}–"
            f"{max(s['seconds_before_sandbox']):.1f} s before") in page
    assert d["env"]["device_name"] == "NVIDIA H100 80GB HBM3"


def test_results_page_grading_time_per_student_matches_its_records():
    import json

    page = results_page("grading", "coldstart")
    gpu = json.loads((RES / "grade_time_lab4_h100.json").read_text())
    lab = gpu["labs"]["lab4_speedrun"]
    assert all(s.split("/")[0] == s.split("/")[1] for r in lab["runs"].values() for x in r for s in x["scores"])
    (lo, hi), (blo, bhi) = lab["range_s"]["this"], lab["range_s"]["before"]
    assert (f"a median {lab['median_s']['this']:.1f} s, against {lab['median_s']['before']:.1f} s before "
            f"({lab['ratio']:.2f}x; {lo:.1f}–{hi:.1f} s against {blo:.1f}–{bhi:.1f} s)") in page
    assert gpu["env"]["device_name"] == "NVIDIA H100 80GB HBM3"
    cap = json.loads((RES / "grade_time_lab4_h200.json").read_text())
    lab = cap["labs"]["lab4_speedrun"]
    assert all(s == "14/16" for r in lab["runs"].values() for x in r for s in x["scores"])  # 2: written, by hand
    (lo, hi), (blo, bhi) = lab["range_s"]["this"], lab["range_s"]["before"]
    assert (f"a median {lab['median_s']['this']:.1f} s, against {lab['median_s']['before']:.1f} s before "
            f"({lab['ratio']:.2f}x; {lo:.1f}–{hi:.1f} s against {blo:.1f}–{bhi:.1f} s)") in " ".join(page.split())
    assert cap["env"]["device_name"] == "NVIDIA H200" and cap["env"]["git_commit"].startswith("00fb4e2")
    ref = json.loads((RES / "grade_reference_gpu_lab4_h200.json").read_text())
    speed = next(v for v in ref["labs"]["lab4"]["verdicts"] if v["check"] == "lab4.speed")
    assert ref["all_gradable_full_marks"] and all(v["sandbox"] == "bwrap" for v in ref["labs"]["lab4"]["verdicts"])
    assert speed["message"].startswith("3.80x the naive step (77229 vs 20329 img/s") and ref["speedups"]["lab4.speed"] == 3.8
    assert "3.80x the naive step (77,229 vs 20,329 img/s at batch 512)" in " ".join(page.split())
    assert ref["env"]["device_name"] == "NVIDIA H200" and ref["env"]["git_commit"].startswith("fe0c4d1")
    again = json.loads((RES / "grade_reference_gpu_handin_h200.json").read_text())
    assert again["all_gradable_full_marks"] and set(again["labs"]) == {"lab1", "lab4"}
    assert all(v["sandbox"] == "bwrap" and v["device"] == "cuda:0" for lab in again["labs"].values()
               for v in lab["verdicts"])
    speed = next(v for v in again["labs"]["lab4"]["verdicts"] if v["check"] == "lab4.speed")
    assert speed["message"].startswith("3.72x the naive step (77164 vs 20800 img/s")
    assert "lab 4's speed 3.72x the naive step (77,164 vs 20,800 img/s)" in " ".join(page.split())
    assert again["env"]["device_name"] == "NVIDIA H200" and again["env"]["git_commit"].startswith("727b9f9")
    cpu = json.loads((RES / "grade_time_cpu.json").read_text())
    ratios = [v["ratio"] for v in cpu["labs"].values()]
    assert len(ratios) == 4 and f"take {min(ratios):.2f}–{max(ratios):.2f}x the time" in page
    assert cpu["env"]["device_type"] == "cpu"


def test_results_page_cold_start_numbers_match_their_record():
    import json

    d = json.loads((RES / "cold_start.json").read_text())
    cold = [r["first_step_s"] for r in d["jobs"]["first step, cold"]["runs"]]
    art = [r["first_step_s"] for r in d["jobs"]["first step, artifact"]["runs"]]
    assert d["rung"] == "muon" and len(cold) == len(art) == 2
    assert (f"first `muon` step takes {min(art):.1f}–{max(art):.1f} s, against {min(cold):.1f}–{max(cold):.1f} s "
            "with nothing cached") in " ".join(results_page("ladder", "log").split())


def _span(xs, fmt="{:.1f}") -> str:
    return f"{fmt.format(min(xs))}–{fmt.format(max(xs))}"


def test_results_page_cold_start_whole_runs_levers_and_candidates_match_their_records():
    import json
    import statistics

    res = RES
    page = " ".join(results_page("log").split())
    g = json.loads((res / "cold_start.json").read_text())
    runs = lambda d, label: d["jobs"][label]["runs"]  # noqa: E731
    cold, art, eager = (runs(g, f"whole run {k}") for k in ("muon, cold", "muon, artifact", "batch_fused"))
    outside = lambda rs: [r["wall_s"] - sum(r["epoch_s"]) for r in rs]  # noqa: E731 - process time beyond epochs
    assert g["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and g["summary"]["fastest_eager"] == "batch_fused"
    assert (f"takes {_span([r['wall_s'] for r in cold])} s cold and {_span([r['wall_s'] for r in art])} s with the "
            f"compile-cache artifact, against {_span([r['wall_s'] for r in eager])} s for the eager `batch_fused`") in page
    assert (f"({_span([r['img_per_s'] for r in art], '{:,.0f}')} img/s against "
            f"{_span([r['img_per_s'] for r in eager], '{:,.0f}')})") in page
    assert f"spends {_span(outside(art))} s (start," in page and f"against {_span(outside(eager))} s for the eager" in page
    assert f"its first step takes {statistics.median(r['first_step_s'] for r in art):.1f} s even with the artifact" in page
    assert not any(goal["met"] for goal in g["summary"]["goals"].values())
    muon = json.loads((res / "top_rung_muon_padded.json").read_text())
    step_ms = 1e3 * 4096 / muon["variants"]["batch 4096, Muon"]["img_per_s_median"]
    assert (f"takes {muon['optimizer_step_ms']['muon (CUDA graph)']['ms']:.2f} ms of a step of about {step_ms:.0f} ms "
            f"at batch 4096") in page and f"Reaching 100k (a step of {1e3 * 4096 / 100_000:.0f} ms)" in page
    assert g["summary"]["top_with_artifact_finishes_first"] is False

    v = json.loads((res / "cold_start_variants.json").read_text())
    first = {k: r["runs"][0]["first_step_s"] for k, r in v["jobs"].items()}
    for label, text in [("first step, cold", "a cold baseline of {:.1f} s"),
                        ("first step, cold, 1 compile thread", "one compile thread instead of 16, {:.1f} s"),
                        ("first step, cold, compile workers started early", "before the data and model, {:.1f} s"),
                        ("first step, cold, compile workers forked", "or forked, {:.1f} s"),
                        ("first step, cold, no pointwise autotuning", "no pointwise autotuning, {:.1f} s"),
                        ("first step, cold, no pattern matcher", "no pattern matcher, {:.1f} s"),
                        ("first step, cold, combo kernels", "combo kernels, {:.1f} s"),
                        ("first step, cold, no cuDNN autotuning", "no cuDNN autotuning, {:.1f} s"),
                        ("first step, artifact, artifact, no cuDNN autotuning", "and {:.1f} s with the artifact"),
                        ("first step, artifact", "against {:.1f} s. The two")]:
        assert text.format(first[label]) in page, label

    f = json.loads((res / "cold_start_fast.json").read_text())
    assert f["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and f["repeats"] == 2
    col = lambda label, key: [r[key] for r in runs(f, label)]  # noqa: E731
    base, kern, fast = "whole run muon, {}", "whole run muon, {}, fast kernels", "whole run muon, {}, fast start"
    assert (f"cold first step took {_span(col('first step, cold, fast kernels', 'first_step_s'))} s in the first-step "
            f"runs, within noise of the current rung's {_span(col('first step, cold', 'first_step_s'))} s, yet "
            f"{_span(col(kern.format('cold'), 'first_step_s'))} s inside whole cold runs against "
            f"{_span(col(base.format('cold'), 'first_step_s'))} s, which finished in "
            f"{_span(col(kern.format('cold'), 'wall_s'))} s against {_span(col(base.format('cold'), 'wall_s'))} s") in page
    kern_ips, base_ips = col(kern.format('artifact'), 'img_per_s'), col(base.format('artifact'), 'img_per_s')
    assert max(kern_ips) < min(base_ips)  # "outside both spreads"
    assert (f"steady speed was {_span(kern_ips, '{:,.0f}')} img/s against {_span(base_ips, '{:,.0f}')}: "
            f"{100 * (1 - sum(kern_ips) / sum(base_ips)):.1f}% slower") in page
    assert (f"the whole runs took {_span(col(kern.format('artifact'), 'wall_s'))} s against "
            f"{_span(col(base.format('artifact'), 'wall_s'))} s, within noise") in page
    assert (f"artifact to {_span(col(fast.format('artifact'), 'first_step_s'))} s against "
            f"{_span(col(base.format('artifact'), 'first_step_s'))} s") in page
    ratio = f["summary"]["variants_whole_run"]["fast start"]["img_per_s"] / f["summary"]["run_img_per_s"]
    assert (f"fell to {_span(col(fast.format('artifact'), 'img_per_s'), '{:,.0f}')} img/s ({ratio:.2f}x), and the "
            f"whole run with the artifact took as long ({_span(col(fast.format('artifact'), 'wall_s'))} s against "
            f"{_span(col(base.format('artifact'), 'wall_s'))} s)") in page


def test_results_page_stages_of_the_whole_run_and_the_compile_workers_match_their_records():
    import json

    res = RES
    page = " ".join(results_page("log").split())
    runs = lambda d, label: d["jobs"][label]["runs"]  # noqa: E731
    col = lambda d, label, key: [r[key] for r in runs(d, label)]  # noqa: E731
    after = lambda d, label: [r["wall_s"] - sum(v or 0 for v in r["stages_s"].values()) for r in runs(d, label)]  # noqa: E731
    s = json.loads((res / "cold_start_stages.json").read_text())
    assert s["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and s["repeats"] == 2
    art = "whole run muon, artifact"
    assert (f"top rung's run took {_span(col(s, art, 'wall_s'))} s, against "
            f"{_span(col(s, 'whole run batch_fused', 'wall_s'))} s for the eager rung") in page
    st = s["summary"]["run_artifact_stages_s"]
    assert (f"In medians: {st['process_before_command']:.1f} s before the command (interpreter and imports), "
            f"{st['compile_cache_load']:.1f} s loading the artifact, {st['setup']:.1f} s of setup, {st['loop']:.1f} s "
            f"of epochs (the first step {_span(col(s, art, 'first_step_s'))} s), {st['final_evaluation']:.1f} s of "
            f"evaluation, and {st['after_result']:.1f} s after the result") in page
    assert f"(`TORCH_WARM_POOL=0`): {_span(col(s, art + ', no worker warm-up', 'wall_s'))} s" in page
    assert f"(`cudnn_limit=3`): {_span(col(s, art + ', cuDNN times 3', 'wall_s'))} s" in page

    w = json.loads((res / "cold_start_workers.json").read_text())
    assert w["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and w["repeats"] == 4
    assert w["variants"]["worker pool"]["env"] == {"TORCHINDUCTOR_COMPILE_THREADS": "16"}
    assert all(r["compile_cache"]["compile_workers"] is False for r in runs(w, art))
    for label, who in [(art, "no compile workers (now)"), (art + ", worker pool", "16 compile workers (before)")]:
        assert (f"| {who} | {_span(after(w, label))} s | {_span(col(w, label, 'wall_s'))} s | "
                f"{_span(col(w, label, 'first_step_s'))} s |") in page
    assert f"The eager rung took {_span(col(w, 'whole run batch_fused', 'wall_s'))} s in the same call" in page
    assert w["summary"]["top_with_artifact_finishes_first"] is False


def test_results_page_bytecode_autotune_and_evaluation_findings_match_their_records():
    import json
    import statistics

    res = RES
    page = " ".join(results_page("log").split())
    runs = lambda d, label: d["jobs"][label]["runs"]  # noqa: E731
    col = lambda d, label, key: [r[key] for r in runs(d, label)]  # noqa: E731
    b = json.loads((res / "cold_start_bytecode.json").read_text())
    e = json.loads((res / "cold_start_eval.json").read_text())
    assert b["env"]["device_name"] == e["env"]["device_name"] == "NVIDIA H200" and b["repeats"] == e["repeats"] == 3
    code = b["bytecode"]
    assert code["mode"] == "installed" and not code["found"]["cached"] and not code["found"]["writes"]
    assert (f"`import torch` took {code['import_s_without']['torch_s']:.1f} s and torch.compile's modules "
            f"{code['import_s_without']['compiler_s']:.1f} s more, against {code['import_s']['torch_s']:.1f} s and "
            f"{code['import_s']['compiler_s']:.1f} s with bytecode") in page
    art, eager = "whole run muon, artifact", "whole run batch_fused"
    assert {r["compile_cache"]["autotune_placed"] for r in runs(b, art) + runs(e, art)} == {53}
    assert "53 placed in every run of `cold_start_bytecode.json`" in page
    first_art = runs(b, "first step, artifact")
    assert all("CachingAutotuner.benchmark_all_configs" not in r["compile_phases_s"] for r in first_art)
    old = json.loads((res / "cold_start_stages.json").read_text())["jobs"]["first step, artifact"]["runs"]
    assert f"{old[0]['compile_phases_s']['CachingAutotuner.benchmark_all_configs']:.1f} s in a first step" in page
    ev = lambda d: [r["stages_s"]["final_evaluation"] for r in runs(d, art)]  # noqa: E731
    assert f"{_span(ev(e), '{:.2f}')} s of final evaluation against {_span(ev(b), '{:.2f}')} s" in page
    h = json.loads((res / "cold_start_h100.json").read_text())
    assert h["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and h["repeats"] == 2 and h["bytecode"]["mode"] == "installed"
    assert {r["compile_cache"]["autotune_placed"] for r in runs(h, art)} == {53}
    cell = lambda d, label, key, fmt="{:.1f}", unit=" s": _span(col(d, label, key), fmt) + unit  # noqa: E731
    rows = [("first step, cold", "first step, cold", "first_step_s", False),
            ("first step with the artifact", "first step, artifact", "first_step_s", False),
            ("whole run, cold", "whole run muon, cold", "wall_s", False),
            ("whole run with the artifact", art, "wall_s", True),
            ("whole run, eager `batch_fused`", eager, "wall_s", True)]
    for name, label, key, both in rows:
        mid = cell(e, label, key) if both else ""
        assert f"| {name} | {cell(b, label, key)} | {mid} | {cell(h, label, key)} |".replace("|  |", "| |") in page, name
    ips = [cell(d, art, "img_per_s", "{:,.0f}", "") for d in (b, e, h)]
    assert f"| top rung, steady img/s | {' | '.join(ips)} |" in page
    for d in (b, e, h):
        assert d["summary"]["top_with_artifact_finishes_first_every_run"] is False
        assert max(col(d, eager, "wall_s")) < min(col(d, art, "wall_s"))  # "in every run of all three records"
    s_old = json.loads((res / "cold_start_stages.json").read_text())
    assert (f"the whole run with the artifact takes {cell(h, art, 'wall_s')}, against "
            f"{cell(s_old, art, 'wall_s')} in `cold_start_stages.json`") in page
    assert (f"and the eager rung {cell(h, eager, 'wall_s')} against {cell(s_old, 'whole run batch_fused', 'wall_s')}"
            ) in page
    st, ste = e["summary"]["run_artifact_stages_s"], statistics.median
    eager_loop = ste(r["stages_s"]["loop"] for r in runs(e, eager))
    assert (f"it spends {st['compile_cache_load']:.1f} s loading the artifact and {st['loop']:.1f} s in its epochs "
            f"against {eager_loop:.1f} s (its first step {_span(col(e, art, 'first_step_s'))} s against "
            f"{_span(col(e, eager, 'first_step_s'))} s)") in page
    later = lambda d, label: ste(sum(r["epoch_s"][1:]) for r in runs(d, label))  # noqa: E731
    assert later(e, art) < later(e, eager) / 2  # "in under half the eager rung's time"
    inner = [r["compile_phases_s"]["_compile.compile_inner"] for r in first_art]
    assert f"{_span(inner)} s is dynamo tracing the model and loading the cached graph" in page
    samples = json.loads((res / "stack_samples_muon_artifact.json").read_text())["by_inner_frames_s"]
    backward = next(v for k, v in samples.items() if k.startswith("torch/autograd/graph.py:_engine_run_backward"))
    forward = next(v for k, v in samples.items() if "runtime_wrappers.py:__torch_dispatch__" in k)
    assert f"charges {backward:.1f} s of the run to backward calls and {forward:.1f} s to the compiled" in page
    assert (f"No goal is met on the H100: the cold first step is {cell(h, 'first step, cold', 'first_step_s')} (goal "
            f"12 s), the first step with the artifact {cell(h, 'first step, artifact', 'first_step_s')} (goal 3 s), "
            f"the whole run with the artifact is behind the eager rung's, and the top rung runs "
            f"{cell(h, art, 'img_per_s', '{:,.0f}', '')} img/s (goal 100k)") in page
    assert not any(g["met"] for d in (b, h) for g in d["summary"]["goals"].values())
    assert max(col(h, art, "img_per_s")) < 100_000


def test_results_page_ddp_rounds_and_lab4_regrade_match_their_records():
    import json

    res = RES
    page = " ".join(results_page("ddp", "grading", "coldstart").split())
    d = json.loads((res / "ddp_scaling_rounds3.json").read_text())
    assert d["env"]["device_name"] == "NVIDIA H200" and d["env"]["gpu_count"] == 2 and d["complete"]
    pct = lambda xs: ", ".join(f"{100 * x:.1f}%" for x in xs)  # noqa: E731
    rounds = d["weak_efficiency_rounds"]
    assert f"median at {100 * d['weak_efficiency']:.1f}%, rounds {pct(rounds[:2])} and {pct(rounds[2:])}" in page
    ips = lambda n: [r["img_per_s"] for r in d["runs"] if r["processes"] == n and not r.get("variant")  # noqa: E731
                     and r["round"] is not None]
    assert f"one GPU ran {_span(ips(1), '{:,.0f}')} img/s every time, two GPUs {_span(ips(2), '{:,.0f}')}" in page
    gpus = d["gpus"]["per_gpu"]
    clocks = {c for g in gpus.values() for c in g["sm_mhz"]}
    assert len(gpus) == 2 and len(clocks) == 1 and not any(g["reasons"] for g in gpus.values())
    assert f"both SM clocks at {clocks.pop():.0f} MHz with no clock-event reason in any busy sample" in page
    numa = d["variants"]["numa"]["weak_efficiency_rounds"]
    assert f"measured again: {pct(numa[:2])} and {pct(numa[2:])}" in page
    t8 = d["variants"]["8 threads"]
    assert (f"gave {100 * t8['weak_efficiency']:.1f}% ({100 * min(t8['weak_efficiency_rounds']):.1f}–"
            f"{100 * max(t8['weak_efficiency_rounds']):.1f}%)") in page

    _own_bn_numbers_match(res, page, pct)

    lab4 = json.loads((res / "grade_reference_gpu_lab4.json").read_text())
    assert lab4["all_gradable_full_marks"] and lab4["env"]["device_name"] == "NVIDIA H100 80GB HBM3"
    speed = next(v for v in lab4["labs"]["lab4"]["verdicts"] if v["check"] == "lab4.speed")
    m = speed["measurements"]
    assert speed["sandbox"] == "bwrap"
    assert f"full marks, {m['speedup']:.2f}x the naive step ({m['student_img_per_s']:,} vs {m['naive_img_per_s']:,}" \
        f" img/s)" in page


def test_results_page_ablation_and_boundary_remeasurement_match_their_records():
    """The leave-one-out table and its time to target, and the H100 record of a near-boundary re-measurement."""
    import json

    from labkit import report

    res = RES
    page = results_page("ladder", "grading")
    ab = json.loads((res / "ladder_ablation.json").read_text())
    target = report.target_accuracy(ab)
    assert " ".join(report.ablation_table(ab["rungs"], target).split()) in page
    assert ab["complete"] and ab["repeats"] == 2 and f"first reached {100 * target:.2f}%" in page
    rows = {r["rung"]: r for r in report.ladder_rows(ab["rungs"], target)}
    assert f"reaches it is the top rung without Muon (batch 512, SGD): {rows['without_muon']['to_target_s'][0]:.1f} s " \
           f"with compilation, {rows['without_muon']['to_target_s'][1]:.1f} s without, against " \
           f"{rows['baseline']['to_target_s'][0]:.1f} s for the baseline" in page
    assert all(rows[n]["to_target_s"] is None for n in rows if n != "without_muon" and n != "baseline")

    g = json.loads((res / "grade_boundary_h100.json").read_text())
    v = {x["submission"].split(" ")[0]: x for x in g["verdicts"]}
    ref, bd = v["reference"], v["borderline"]
    assert ref["remeasured"] and bd["remeasured"] and bd["regrade_recommended"] and not ref["regrade_recommended"]
    for x, boundary in ((ref, 4), (bd, 3)):
        first = x["first_measurement"]
        assert abs(first["ratio"] - boundary) <= first["iqr"]
    assert f"first measured {ref['first_measurement']['ratio']:.2f}x (IQR {ref['first_measurement']['iqr']:.2f})" in page
    assert f"pooled {ref['pooled']['rounds']} rounds at {ref['pooled']['ratio']:.2f}x" in page
    assert f"measured {bd['first_measurement']['ratio']:.2f}x (IQR {bd['first_measurement']['iqr']:.2f}), pooled " \
           f"{bd['pooled']['ratio']:.2f}x over {bd['pooled']['rounds']} rounds" in page
    states = [m["gpu_state"][k] for x in (ref, bd) for m in (x["first_measurement"], x["remeasurement"])
              for k in ("start", "end")]
    assert {s["sm_clock_mhz"] for s in states} == {1980.0} and {s["mem_clock_mhz"] for s in states} == {2619.0}
    assert not any(s["throttle_reasons"] for s in states)
    temps = [s["temperature_c"] for s in states]
    assert f"SM clock 1980 MHz, memory clock 2619 MHz, no throttle reasons, {min(temps):.0f}–{max(temps):.0f} °C" in page


def test_results_page_ladder_paragraph_matches_the_ladder_record():
    """The measured matmul peak and the cold / warm first steps quoted beside the ladder table."""
    import json

    from labkit import report

    ladder = json.loads((RES / "ladder.json").read_text())
    page = results_page("ladder")
    assert f"commit {ladder['measured_commit'][:12]}, {ladder['env']['timestamp']}" in page
    from labkit.waves import datasheet_peak

    sheet = datasheet_peak(ladder["env"]["device_name"], "bf16")
    assert f"{ladder['peak_bf16_tflops']:.0f} TFLOP/s (the denominator of \"share of measured peak\"; MFU divides by " \
        f"the datasheet's {sheet:.1f})" in page
    rows = {r["rung"]: r for r in report.ladder_rows(ladder["rungs"])}
    m, g = rows["muon"], rows["cuda_graphs"]
    assert f"{m['first_step_s']:.2f} s for `muon`, {g['first_step_s']:.2f} s for `cuda_graphs`" in page
    assert f"reuse the graphs the first run compiled ({m['first_step_warm_s']:.2f} s and {g['first_step_warm_s']:.2f} s)" \
        in page


def _own_bn_numbers_match(res, page, pct):
    """The DDP paragraph on dropping the buffer broadcast quotes ddp_scaling_own_bn.json, its profiles and the
    second call at the new default."""
    import json
    import statistics

    d = json.loads((res / "ddp_scaling_own_bn.json").read_text())
    assert d["env"]["device_name"] == "NVIDIA H200" and d["env"]["gpu_count"] == 2 and d["complete"]
    v = d["variants"]["own BN stats"]
    assert v["changes"] == ["ddp_broadcast_buffers=false"] and d["epochs"] == 11
    three = lambda xs: f"{pct(xs[:2])} and {pct(xs[2:])} (median {100 * statistics.median(xs):.1f}%)"  # noqa: E731
    assert (f"gave {three(v['weak_efficiency_rounds'])}, against {three(d['weak_efficiency_rounds'])} for the launch "
            f"with the broadcast") in page
    assert min(v["weak_efficiency_rounds"]) >= 0.9  # the goal, every round
    two = lambda variant: [e for r in d["runs"] if r["processes"] == 2 and r.get("variant") == variant  # noqa: E731
                           and r["scaling"] == "weak" for e in r["epoch_s"][1:]]
    assert (f"epochs took {_span(two('own BN stats'), '{:.3f}')} s in every round, against "
            f"{_span(two(None), '{:.3f}')} s with the broadcast") in page
    prof = {k: json.loads((res / "ddp_profile_own_bn" / f"{k}.diagnosis.json").read_text())
            for k in ("own_bn_stats", "broadcast_buffers")}
    steps = [f"{p['evidence']['step_ms']:.1f} ms" for p in prof.values()]
    idle = [f"idle {round(100 - float(p['reasons'][0].split('busy ')[1].split('%')[0]))}%" for p in prof.values()]
    assert f"a step took {steps[0]} without the broadcast and {steps[1]} with it" in page
    assert f"the GPU {idle[0]} and {idle[1].split()[1]} of the step" in page
    acc = lambda n: [r["accuracy"] for r in d["runs"] if r["processes"] == n and r["scaling"] == "weak"]  # noqa: E731
    assert f"({_span(acc(2), '{:.3f}')} in this call, against {_span(acc(1), '{:.3f}')} on one GPU)" in page
    again = json.loads((res / "ddp_scaling_no_broadcast.json").read_text())
    assert again["env"]["device_name"] == "NVIDIA H200" and again["env"]["gpu_count"] == 2 and again["complete"]
    assert not again["variants"] and again["epochs"] == 11 and min(again["weak_efficiency_rounds"]) >= 0.9
    ips = lambda n: [r["img_per_s"] for r in again["runs"] if r["processes"] == n and r["scaling"] == "weak"]  # noqa: E731
    assert (f"(`ddp_scaling_no_broadcast.json`, 2x NVIDIA H200) gave {three(again['weak_efficiency_rounds'])}: one GPU "
            f"ran {_span(ips(1), '{:,.0f}')} img/s, two GPUs {_span(ips(2), '{:,.0f}')}") in page



def test_results_page_cudnn_warmup_rows_match_their_records():
    import json

    res = RES
    page = " ".join(results_page("log").split())
    art, off = "whole run muon, artifact", "whole run muon, artifact, no warm-up"

    def cell(d, label, key):
        return _span([r[key] for r in d["jobs"][label]["runs"]]) + " s"

    rows = [("its own thread, forward and backward", "cold_start_warmup_thread.json", "3d22ab1"),
            ("the training thread, the artifact loading beside it", "cold_start_warmup_main.json", "577e074"),
            ("backward only, through autograd's device thread", "cold_start_warmup.json", "1adf512")]
    for name, file, commit in rows:
        d = json.loads((res / file).read_text())
        assert d["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and d["env"]["git_commit"].startswith(commit)
        assert "--variant 'no warm-up:set.cudnn_warmup=false'" in d["env"]["command"]
        assert (f"| {name} | {cell(d, art, 'first_step_s')} / {cell(d, off, 'first_step_s')} | "
                f"{cell(d, art, 'wall_s')} / {cell(d, off, 'wall_s')} | `{file}` |") in page, name
    main = json.loads((res / "cold_start_warmup_main.json").read_text())
    both = [r["stages_s"]["compile_cache_load"] for r in main["jobs"][art]["runs"]]
    alone = [r["stages_s"]["compile_cache_load"] for r in main["jobs"][off]["runs"]]
    assert f"together they took {_span(both)} s, against {_span(alone)} s for loading alone" in page
    kept = json.loads((res / "cold_start_warmup.json").read_text())["jobs"]
    for key in ("first_step_s", "wall_s"):  # "both its numbers stayed within noise": the spreads overlap
        on, no = ([r[key] for r in kept[label]["runs"]] for label in (art, off))
        assert min(on) <= max(no) and min(no) <= max(on)
    keys = json.loads((res / "cold_start_warmup_keys.json").read_text())
    missed = keys["jobs"]["first step, artifact, no warm-up"]["runs"]
    assert all(r["compiled"].get("fxgraph_cache_miss") == 2 for r in missed)
    assert f"the first step compiled from scratch: {_span([r['first_step_s'] for r in missed])} s" in page
    from labkit.presets import TrainConfig

    assert TrainConfig().cudnn_warmup is None  # "off by default, except where `labkit train` starts tiered"


def test_results_page_cudnn_choice_and_saved_forward_rows_match_their_records():
    import json

    res = RES
    page = " ".join(results_page("log").split())

    def runs(d, label):
        return d["jobs"][label]["runs"]

    def s(d, label, key):
        return _span([r[key] for r in runs(d, label)])

    def n(d, label):
        return _span([r["img_per_s"] for r in runs(d, label)], "{:,.0f}")

    art = "whole run muon, artifact"
    choice = json.loads((res / "cold_start_cudnn_choice.json").read_text())
    assert choice["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and choice["env"]["git_commit"].startswith("ec2cd44")
    for name, label in (("times 10 candidates per shape (the rung)", art),
                        ("times every candidate (`cudnn_limit=0`)", art + ", all algorithms"),
                        ("its heuristics, no timing (`cudnn_benchmark=false`)", art + ", no timing"),
                        ("its slower heuristics, no timing (`TORCH_CUDNN_USE_HEURISTIC_MODE_B=1`)",
                         art + ", heuristics B, no timing"),
                        ("the slower heuristics, 3 timed (`cudnn_limit=3`)", art + ", heuristics B, 3 timed")):
        assert f"| {name} | {s(choice, label, 'first_step_s')} s | {n(choice, label)} |" in page, name
    every, rung = ([r["img_per_s"] for r in runs(choice, lb)] for lb in (art + ", all algorithms", art))
    assert min(every) <= max(rung) and min(rung) <= max(every)  # "within noise of the rung's"

    pre = json.loads((res / "cold_start_precompiled.json").read_text())
    assert pre["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and pre["env"]["git_commit"].startswith("4312ad3")
    assert "--variant 'artifact path:env.LABKIT_PRECOMPILED=0'" in pre["env"]["command"]

    def load(d, label):
        return _span([r["stages_s"]["compile_cache_load"] for r in runs(d, label)])

    def after(d, label):
        return _span([r["wall_s"] - sum(v or 0.0 for v in r["stages_s"].values()) for r in runs(d, label)])

    path, eager = art + ", artifact path", "whole run batch_fused"
    for name, label, loading in (("top rung, the saved forward", art, f"{load(pre, art)} s"),
                                 ("top rung, torch.compile on the artifact", path, f"{load(pre, path)} s"),
                                 ("eager `batch_fused`", eager, "")):
        row = f"| {name} | {s(pre, label, 'first_step_s')} s | {loading} | {s(pre, label, 'wall_s')} s | {n(pre, label)} |"
        assert " ".join(row.split()) in page, name
    assert max(r["first_step_s"] for r in runs(pre, art)) <= 3.0  # "meets the 3 s goal in every run"
    walls = {lb: [r["wall_s"] for r in runs(pre, lb)] for lb in (art, path, eager)}
    assert min(walls[art]) <= max(walls[path]) and min(walls[path]) <= max(walls[art])  # within noise
    assert max(walls[eager]) < min(walls[art] + walls[path])  # both finish after the eager rung
    pool = json.loads((res / "cold_start_precompiled_pool.json").read_text())
    assert pool["env"]["git_commit"].startswith("19c6660")
    assert (f"{after(pool, art)} s after the result, against {after(pool, path)} s on the artifact path" in page
            and f"the run: {after(pre, art)} s after the result" in page)


def test_results_page_tiered_start_rows_match_their_records():
    import json
    import statistics

    res = RES
    page = " ".join(results_page("log").split())
    tiered = json.loads((res / "cold_start_tiered.json").read_text())
    warm = json.loads((res / "cold_start_tiered_warmup.json").read_text())
    for d, variant in ((tiered, "--variant waiting:env.LABKIT_TIERED=0"),
                       (warm, "--variant 'cudnn warm-up:set.cudnn_warmup=true'")):
        assert d["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and d["env"]["git_commit"].startswith("a7daa1b")
        assert d["env"]["torch"].startswith("2.11") and variant in d["env"]["command"]

    def runs(d, label):
        return d["jobs"][label]["runs"]

    def span(d, label, key, fmt="{:.1f}", scale=1.0):
        lo, hi = (fmt.format(f(r[key] for r in runs(d, label)) * scale) for f in (min, max))
        return lo if lo == hi else f"{lo}–{hi}"

    top, eager = "whole run muon", "whole run batch_fused"
    for name, label in (("top rung, cold, tiered", f"{top}, cold"), ("top rung, cold, waiting", f"{top}, cold, waiting"),
                        ("top rung, artifact, tiered", f"{top}, artifact"),
                        ("top rung, artifact, waiting", f"{top}, artifact, waiting"), ("eager `batch_fused`", eager)):
        row = (f"| {name} | {span(tiered, label, 'first_step_s')} s | {span(tiered, label, 'wall_s')} s | "
               f"{span(tiered, label, 'img_per_s', '{:,.0f}')} | {span(tiered, label, 'accuracy', scale=100)}% |")
        assert row in page, name

    cold = [r["tiered"] for r in runs(tiered, f"{top}, cold")]
    assert all(t["eager_steps"] == 60 and t["compiled_steps"] == 0 and t["stopped_compiling"] for t in cold)
    ratio = (statistics.median(r["wall_s"] for r in runs(tiered, f"{top}, cold"))
             / statistics.median(r["wall_s"] for r in runs(tiered, f"{top}, cold, waiting")))
    assert 0.25 < ratio < 0.42  # "about a third of the wait"
    art = [r["tiered"] for r in runs(tiered, f"{top}, artifact")]
    ready = f"{min(t['ready_s'] for t in art):.1f}–{max(t['ready_s'] for t in art):.1f} s"
    switch = f"{min(t['switch_step_s'] for t in art):.2f}–{max(t['switch_step_s'] for t in art):.2f} s"
    assert all(t["eager_steps"] == 1 and t["source"] == "saved forward" for t in art)
    assert f"ready {ready} after the run started, after one eager step" in page
    assert f"The step that switched took {switch}." in page

    def firsts(d, label):  # rounds in which the top rung finished before the eager rung (runs are in round order)
        return sum(a["wall_s"] < e["wall_s"] for a, e in zip(runs(d, label), runs(d, eager), strict=True))

    def overlap(d, a, b):
        xs, ys = ([r["wall_s"] for r in runs(d, lb)] for lb in (a, b))
        return min(xs) <= max(ys) and min(ys) <= max(xs)

    assert firsts(tiered, f"{top}, artifact") == 2 and overlap(tiered, f"{top}, artifact", eager)
    assert "finished first in two of three rounds. The spreads overlap" in page
    wu = f"{top}, artifact, cudnn warm-up"
    assert firsts(warm, wu) == firsts(warm, f"{top}, artifact") == 3 and overlap(warm, f"{top}, artifact", eager)
    assert not overlap(warm, wu, eager)
    slowest = {lb: max(r["wall_s"] for r in runs(warm, lb)) for lb in (wu, f"{top}, artifact")}
    fastest = min(r["wall_s"] for r in runs(warm, eager))
    assert (f"its slowest run took {slowest[f'{top}, artifact']:.2f} s and the eager rung's fastest {fastest:.2f} s. "
            f"With it, every run finished before every eager run, but only just: its slowest took {slowest[wu]:.2f} s. "
            f"Three runs a side and a {fastest - slowest[wu]:.2f} s margin") in page
    assert (f"Its first step fell to {span(warm, wu, 'first_step_s')} s from {span(warm, f'{top}, artifact', 'first_step_s')} s, "
            f"and its whole run took {span(warm, wu, 'wall_s')} s, against {span(warm, f'{top}, artifact', 'wall_s')} s "
            f"without it and {span(warm, eager, 'wall_s')} s for the eager rung.") in page

    rep = json.loads((res / "cold_start_tiered_repeat.json").read_text())
    assert rep["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and rep["env"]["git_commit"].startswith("75687af")
    base = f"{top}, artifact"
    assert (f"where the eager rung was faster: {span(rep, eager, 'wall_s')} s. There the tiered top rung took "
            f"{span(rep, base, 'wall_s')} s and finished after the eager rung in every round. With the warm-up it took "
            f"{span(rep, wu, 'wall_s')} s and finished first in one round of four.") in page
    assert firsts(rep, base) == 0 and firsts(rep, wu) == 1 and len(runs(rep, eager)) == 4

    def paired(key, sign=1):  # the tiered top rung's stage minus the eager rung's, round by round
        def stage(r):
            return r["wall_s"] - sum(v or 0.0 for v in r["stages_s"].values()) if key == "exit" else r["stages_s"][key]
        return _span([sign * (stage(a) - stage(b)) for a, b in zip(runs(rep, base), runs(rep, eager), strict=True)])

    assert (f"setup took {paired('setup')} s longer, its loop {paired('loop', -1)} s less, and its exit "
            f"{paired('exit')} s longer.") in page


def test_results_page_fast_exit_gate_and_tiered_warmup_match_their_records():
    import json
    import statistics

    res = RES
    page = " ".join(results_page("coldstart", "log").split())
    recs = {name: json.loads((res / f"{name}.json").read_text()) for name in
            ("cold_start_fast_exit", "cold_start_tiered_gate", "cold_start_tiered_warmup_rounds",
             "cold_start_tiered_final", "cold_start_tiered_repeat")}
    for name, commit in (("cold_start_fast_exit", "088580c"), ("cold_start_tiered_gate", "088580c"),
                         ("cold_start_tiered_warmup_rounds", "480dc43"), ("cold_start_tiered_final", "1f23e9b")):
        env = recs[name]["env"]
        assert env["device_name"] == "NVIDIA H100 80GB HBM3" and env["git_commit"].startswith(commit), name
        assert env["torch"].startswith("2.11") and f"commit {commit}" in page

    def runs(name, label):
        return recs[name]["jobs"][label]["runs"]

    def span(name, label, what, fmt="{:.1f}"):
        get = what if callable(what) else (lambda r: r[what])
        return _span([get(r) for r in runs(name, label)], fmt)

    def after(r):
        return r["wall_s"] - sum(v or 0.0 for v in r["stages_s"].values())

    def stage(key):
        return lambda r: r["stages_s"][key]

    top, eager = "whole run muon, artifact", "whole run batch_fused"
    early = f"{top}, loading from the start"

    def firsts(name, label):  # rounds in which it finished before the eager rung (runs are in round order)
        return sum(a["wall_s"] < e["wall_s"] for a, e in zip(runs(name, label), runs(name, eager), strict=True))

    def ratios(name, label):
        return _span([a["wall_s"] / e["wall_s"] for a, e in zip(runs(name, label), runs(name, eager), strict=True)],
                     "{:.3f}")

    fx = "cold_start_fast_exit"
    assert "--variant 'full exit:env.LABKIT_FAST_EXIT=0'" in recs[fx]["env"]["command"]
    assert (f"The top rung spent {span(fx, top, after, '{:.2f}')} s after its result, against "
            f"{span(fx, f'{top}, full exit', after, '{:.2f}')} s with the teardown") in page
    assert (f"Its whole run took {span(fx, top, 'wall_s')} s, against {span(fx, f'{top}, full exit', 'wall_s')} s "
            f"with the teardown.") in page
    assert (f"spent {span(fx, eager, after, '{:.2f}')} s after its result. In `cold_start_tiered_repeat.json` it spent "
            f"{span('cold_start_tiered_repeat', eager, after, '{:.2f}')} s, and the top rung "
            f"{span('cold_start_tiered_repeat', top, after, '{:.2f}')} s.") in page

    assert (f"The setup then took {span(fx, top, stage('setup'))} s instead of {span(fx, early, stage('setup'))} s, "
            f"but the forward was ready later and the loop took longer: {span(fx, top, stage('loop'))} s against "
            f"{span(fx, early, stage('loop'))} s.") in page
    gate = "cold_start_tiered_gate"
    assert (f"it finished before the eager rung in {firsts(fx, top)} and {firsts(gate, top)} rounds, and loading "
            f"from the start did so in {firsts(fx, early)} and {firsts(gate, early)}.") in page

    wr, wu = "cold_start_tiered_warmup_rounds", f"{top}, cudnn warm-up"
    assert "--variant 'cudnn warm-up:set.cudnn_warmup=true'" in recs[wr]["env"]["command"]
    assert (f"the tiered top rung took {span(wr, wu, 'wall_s')} s, against {span(wr, top, 'wall_s')} s without it. "
            f"It was the faster of the two in every round.") in page
    assert all(a["wall_s"] < b["wall_s"] for a, b in zip(runs(wr, wu), runs(wr, top), strict=True))
    assert firsts(wr, wu) == 8 and firsts(wr, top) == 4 and len(runs(wr, eager)) == 8
    assert f"It finished before the eager rung ({span(wr, eager, 'wall_s')} s) in 8 of 8 rounds, against 4 of 8" in page

    fin = "cold_start_tiered_final"
    assert "--parts run" in recs[fin]["env"]["command"]
    assert "--variant 'no warm-up:set.cudnn_warmup=false'" in recs[fin]["env"]["command"]
    total = len(runs(fin, eager))
    for name, label in (("top rung, artifact", top), ("top rung, artifact, no warm-up", f"{top}, no warm-up"),
                        ("top rung, cold", "whole run muon, cold"),
                        ("top rung, cold, no warm-up", "whole run muon, cold, no warm-up")):
        assert (f"| {name} | {span(fin, label, 'first_step_s')} s | {span(fin, label, 'wall_s')} s | "
                f"{firsts(fin, label)} of {total} | {ratios(fin, label)} |") in page, name
    assert f"| eager `batch_fused` | {span(fin, eager, 'first_step_s')} s | {span(fin, eager, 'wall_s')} s | | |" in page
    warmed = [r["cudnn_warmup"] for r in runs(fin, top)]
    assert all(w and w["shapes"] and w["error"] is None for w in warmed)  # on by default: the record shows it ran
    assert all(r["cudnn_warmup"] is None for r in runs(fin, f"{top}, no warm-up"))
    assert firsts(fin, top) == total and firsts(wr, wu) == 8 and f"{total + 8} of {total + 8}" in page
    assert "0.830–0.981 in the 8-round call, 0.860–0.997 here" in page
    assert ratios(wr, wu) == "0.830–0.981" and ratios(fin, top) == "0.860–0.997"
    rep = "cold_start_tiered_final_repeat"
    recs[rep] = json.loads((res / f"{rep}.json").read_text())
    assert recs[rep]["env"]["git_commit"].startswith("ad2bb7b") and "commit ad2bb7b, 6 rounds" in page
    assert recs[rep]["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and recs[rep]["env"]["torch"].startswith("2.11")
    assert (f"the top rung took {span(rep, top, 'wall_s')} s against {span(rep, eager, 'wall_s')} s. It finished "
            f"first in {firsts(rep, top)} of {len(runs(rep, eager))} rounds, and its ratio over the eager rung was "
            f"{ratios(rep, top)}.") in page

    def medians(name, label):
        return (statistics.median(r["wall_s"] for r in runs(name, label))
                / statistics.median(r["wall_s"] for r in runs(name, eager)))

    assert (f"Median over median was {medians(wr, wu):.3f}, {medians(fin, top):.3f} and {medians(rep, top):.3f}, and "
            f"the top rung finished first in {firsts(wr, wu) + firsts(fin, top) + firsts(rep, top)} of "
            f"{8 + total + len(runs(rep, eager))} rounds.") in page
    assert f"({span(fin, top, 'wall_s')} s against {span(fin, eager, 'wall_s')} s)" in page
    assert max(r["wall_s"] for r in runs(fin, top)) > min(r["wall_s"] for r in runs(fin, eager))  # "still overlap"
    recs["cold_start_tiered_warmup"] = json.loads((res / "cold_start_tiered_warmup.json").read_text())
    before = [firsts(name, wu) for name in ("cold_start_tiered_warmup", "cold_start_tiered_repeat")]
    assert (f"with the warm-up, first in {before[0]} of 3 rounds on one machine and {before[1]} of 4 on "
            f"another") in page
    assert f"Accuracy stayed at {_span([r['accuracy'] * 100 for r in runs(fin, top)])}%" in page
    assert f"Steady speed was {span(fin, top, 'img_per_s', '{:,.0f}')} img/s." in page
    slow = min(runs(fin, top), key=lambda r: r["img_per_s"])
    assert slow["tiered"]["eager_steps"] == 15 and f"which took {slow['epoch_s'][1]:.2f} s" in page
    cold = [r["tiered"] for r in runs(fin, "whole run muon, cold")]
    assert all(t["eager_steps"] == 60 and t["stopped_compiling"] for t in cold)
    assert (f"eager steps run at {span(fin, 'whole run muon, cold', 'img_per_s', '{:,.0f}')} img/s, against "
            f"{span(fin, eager, 'img_per_s', '{:,.0f}')} for `batch_fused`") in page

    from labkit.presets import TrainConfig

    assert TrainConfig().cudnn_warmup is None  # on only where labkit train starts tiered


def test_results_page_compiling_in_regions_matches_its_h200_record():
    """'Compiling the model in regions, at once': every figure of the table and the bullets from its record."""
    import json
    import statistics

    page = results_page("coldstart")
    r = json.loads((RES / "compile_regions_h200.json").read_text())
    assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert r["env"]["git_commit"].startswith("81039b0") and r["env"]["command"].startswith("compile_regions.py")
    assert "(`compile_regions_h200.json`, NVIDIA H200, torch 2.11.0+cu130, commit 81039b0, 2 rounds)" in page
    groups = {k: [g for g in r["compile"] if g["k"] == k] for k in (1, 2, 4)}
    assert all(len(g) == 2 and all("error" not in x for gr in g for x in gr["regions"]) for g in groups.values())

    def span(xs, f):
        return f"{f(min(xs))}–{f(max(xs))}"

    one, count = (lambda x: f"{x:.1f}"), (lambda x: f"{x:,.0f}")  # noqa: E731
    label = {1: "1 region (whole)", 2: "2 regions, 2 processes", 4: "4 regions, 4 processes"}
    speed = {k: r["speed"][str(k)]["img_per_s"] for k in (1, 2, 4)}
    for k, gs in groups.items():
        first = [max(x["first_step_s"] for x in g["regions"]) for g in gs]
        assert (f"| {label[k]} | {span(first, one)} s | {span([g['wall_s'] for g in gs], one)} s | "
                f"{statistics.median(speed[k]):,.0f} ({span(speed[k], count)}) |") in page
    slowest4 = max(max(x["first_step_s"] for x in g["regions"]) for g in groups[4])
    fastest1 = min(g["regions"][0]["first_step_s"] for g in groups[1])
    assert slowest4 < fastest1 / 2 and "compiled every region in less than half the time" in page
    assert min(speed[4]) <= max(speed[1]) and max(speed[4]) >= min(speed[1])  # the spreads overlap: within noise
    assert min(speed[2]) > max(speed[1])  # spreads apart
    gain = statistics.median(speed[2]) / statistics.median(speed[1]) - 1
    assert f"two regions ran {100 * gain:.1f}% faster, spreads apart" in page
    setups = [x["setup_s"] for gs in groups.values() for g in gs for x in g["regions"]]
    assert f"Each process also paid {span(setups, one)} s of setup" in page


def test_results_page_saved_regions_match_their_h200_record():
    """'Saved and loaded, as a run would take them': the table, the per-round gain and the loss check."""
    import json

    page = results_page("coldstart")
    r = json.loads((RES / "compile_regions_saved_h200.json").read_text())
    assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert r["env"]["git_commit"].startswith("bcdd00d") and "--parts compile,saved --splits 1,4" in r["env"]["command"]
    assert "(`compile_regions_saved_h200.json`, same card, commit bcdd00d, 3 rounds)" in page
    one = lambda x: f"{x:.1f}"  # noqa: E731

    def span(xs):
        return f"{one(min(xs))}–{one(max(xs))}"

    runs = {k: [s for s in r["saved"] if s["k"] == k] for k in (1, 4)}
    assert all(len(v) == 3 and all("error" not in s for s in v) for v in runs.values())
    label = {1: "1 (the whole model)", 4: "4 (the regions)"}
    for k, rs in runs.items():
        assert (f"| {label[k]} | {span([s['built_s'] for s in rs])} s | "
                f"{span([s['loaded_s'] - s['built_s'] for s in rs])} s | "
                f"{span([s['first_step_end_s'] - s['loaded_s'] for s in rs])} s | "
                f"{span([s['first_step_s'] for s in rs])} s |") in page
        assert all(s["losses"][0] == s["eager_loss"] for s in rs)
    # rounds alternate the order of the splits: pair each round's two runs
    rounds = [r["saved"][i:i + 2] for i in range(0, 6, 2)]
    gains = [next(s for s in p if s["k"] == 1)["first_step_s"] - next(s for s in p if s["k"] == 4)["first_step_s"]
             for p in rounds]
    assert f"first step {span(gains)} s shorter within a round" in page
    setups = [b["setup_s"] for s in runs[4] for b in s["builders"]]
    assert f"Each builder spends {span(setups)} s starting" in page
    assert f"The run then spends {span([s['loaded_s'] - s['built_s'] for s in runs[4]])} s loading the files, and " \
           f"{span([s['first_step_end_s'] - s['loaded_s'] for s in runs[4]])} s in its first call" in page


def test_results_page_step_parts_match_their_h200_records():
    """'Where the steady step goes': the parts table, the profile and the inductor settings from their records."""
    import json
    import statistics

    page = results_page("top_rung")
    rec = RES
    r = json.loads((rec / "step_parts_h200.json").read_text())
    assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert r["env"]["git_commit"].startswith("453621e") and r["env"]["command"].startswith("step_parts.py")
    assert "(`step_parts_h200.json`, NVIDIA H200, torch 2.11.0+cu130, commit 453621e, 5 rounds)" in page
    assert r["rounds"] == 5 and r["batch"] == 4096 and r["steps_per_epoch"] == 12 and not r["quick"]
    parts, n = r["parts"], r["images_per_epoch"]
    rung = statistics.median(parts["rung"]["epoch_s"])
    labels = {"rung": "the rung's step", "fixed batch": "on a fixed batch (no data path)",
              "no optimizer": "no optimizer", "model only": "model only (a plain sum of the logits, no loss function)"}
    for key, label in labels.items():
        ips = [n / t for t in parts[key]["epoch_s"]]
        share = statistics.median(parts[key]["epoch_s"]) / rung
        assert (f"| {label} | {statistics.median(ips):,.0f} | {min(ips):,.0f}–{max(ips):,.0f} | {share:.3f} |"
                in page), label
        # every spread overlaps the rung's: within noise
        assert min(ips) <= max(n / t for t in parts["rung"]["epoch_s"])
        assert max(ips) >= min(n / t for t in parts["rung"]["epoch_s"])
    for key, label in (("data only", "the data alone"), ("optimizer", "the optimizer alone")):
        share = statistics.median(parts[key]["epoch_s"]) / rung
        assert f"| {label} | | | {share:.3f} |" in page
        assert f"{100 * share:.1f}%" in page
    prof = r["profile"]
    cls = prof["ms_per_step_by_class"]
    conv, tri = cls["convolutions and matmuls"], cls["Triton (fused BN/ReLU/add)"]
    busy, wall = prof["kernel_ms_per_step"], prof["wall_ms_per_step"]
    assert f"The GPU is busy {100 * busy / wall:.0f}% of the step" in page
    assert f"kernels ran {busy:.2f} ms of a {wall:.2f} ms step" in page
    assert f"convolutions and matrix products {conv:.2f} ms ({100 * conv / busy:.0f}%)" in page
    assert f"BatchNorm, ReLU and the adds {tri:.2f} ms ({100 * tri / busy:.0f}%)" in page
    assert f"other kernels {cls['other']:.2f} ms, fused AdamW {cls['optimizer']:.2f} ms" in page

    k = json.loads((rec / "top_rung_bn_kernels_h200.json").read_text())
    assert k["env"]["device_name"] == "NVIDIA H200" and k["env"]["torch"] == "2.11.0+cu130" and k["note"]
    assert k["env"]["git_commit"].startswith("5f0430a") and "--parts model" in k["env"]["command"]
    assert "(fused SGD, batch 4096; `top_rung_bn_kernels_h200.json`, same card, commit 5f0430a" in page
    ms = k["model_step"]
    base = ms["4096-reduce-overhead"]
    rows = {"inductor's default": "", "`max_autotune_pointwise`": "-max-autotune-pointwise",
            "`triton.multi_kernel`": "-multi-kernel", "`aggressive_fusion`": "-aggressive-fusion",
            "`benchmark_fusion`": "-benchmark-fusion", "`triton.cooperative_reductions`": "-cooperative-reductions"}
    for label, suffix in rows.items():
        v = ms["4096-reduce-overhead" + suffix]
        assert (f"| {label} | {v['ms_per_step']:.2f} | {v['spread_ms']:.2f} | {v['img_per_s']:,.0f} | "
                f"{v['compile_s']:.1f} s") in page, label
        # "none is faster than the default by more than its spread"
        assert base["ms_per_step"] - v["ms_per_step"] < max(base["spread_ms"], v["spread_ms"])
    slow = ms["4096-reduce-overhead-cooperative-reductions"]["ms_per_step"] / base["ms_per_step"]
    assert int(slow) == 23 and "23 times slower" in page


def test_results_page_power_limit_matches_its_h200_record():
    """'At the power limit': every figure of the table and its bullets from step_power_h200.json."""
    import json

    page = results_page("top_rung", "log")
    r = json.loads((RES / "step_power_h200.json").read_text())
    assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert r["env"]["git_commit"].startswith("fb73a0d") and r["env"]["command"].startswith("step_power.py")
    assert (f"(`step_power_h200.json`, NVIDIA H200, torch 2.11.0+cu130, commit fb73a0d, {r['rounds']} rounds of "
            f"{r['steps']} calls)") in page
    assert not r["quick"] and r["sample_ms"] == 20 and "every 20 ms" in page
    card, parts = r["card"], r["parts"]
    assert f"The card's limits: {card['power_limit_w']:.0f} W, and an SM clock of at most {card['max_sm_clock_mhz']:,} MHz" in page
    labels = {"rung step": "the rung's step", "model, trained": "model step, the rung's weights after an epoch",
              "model, fresh": "model step, the model freshly built", "matmul": "bf16 matmul, 8192 x 8192"}
    for key, label in labels.items():
        p = parts[key]
        lo, hi = p["rate_spread"]
        assert (f"| {label} | {p['rate_median']:,.0f} {p['unit']} | {lo:,.0f}–{hi:,.0f} | {p['sm_clock_mhz']:,.0f} MHz "
                f"| {p['power_w']:.0f} W | in every sample |") in page, label
        # "in every sample": the power-cap bit in every reading of every round
        assert all(rd["reasons"].get("power cap") == 1.0 for rd in p["rounds"]) and len(p["rounds"]) == r["rounds"]
    watts = [w for p in parts.values() for w in p["power_w_spread"]]
    assert f"Every part drew {min(watts):.0f}–{max(watts):.0f} W of the {card['power_limit_w']:.0f} W" in page
    rung, fresh, trained = parts["rung step"], parts["model, fresh"], parts["model, trained"]
    assert f"ran at {rung['sm_clock_mhz']:,.0f} MHz, {100 * rung['sm_clock_mhz'] / card['max_sm_clock_mhz']:.0f}% of" in page
    ratio = fresh["rate_median"] / trained["rate_median"]
    assert f"The same kernels ran {ratio:.2f}x faster on other weights" in page
    assert fresh["rate_spread"][0] > trained["rate_spread"][1]  # beyond both spreads, not noise
    assert f"the card held {fresh['sm_clock_mhz']:,.0f} MHz" in page
    m = parts["matmul"]
    assert f"{m['rate_median']:.0f} TFLOP/s at {m['sm_clock_mhz']:,.0f} MHz" in page
    assert f"its clock held at {100 * rung['sm_clock_mhz'] / card['max_sm_clock_mhz']:.0f}% of the maximum" in page


def test_results_page_ladder_power_table_matches_its_h200_record():
    """'At the power limit': each rung's steady clock and power, as labkit train read them, from ladder_power_h200.json."""
    import json

    page = results_page("top_rung")
    r = json.loads((RES / "ladder_power_h200.json").read_text())
    assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert r["env"]["git_commit"].startswith("d15ed2e") and r["repeats"] == 1
    assert r["env"]["command"] == "ladder.py --epochs 5 --repeats 1 --no-real-data --out /root/out"
    assert "(`ladder_power_h200.json`, commit d15ed2e," in page
    for rung in r["rungs"]:
        p = rung["gpu_power"]
        assert p["samples"] > 50 and p["max_sm_clock_mhz"] == 1980 and p["power_limit_w"] == 700
        capped = p["reasons"].get("power cap") == 1.0
        assert capped or p["reasons"] == {}, rung["name"]  # all or nothing: the table has no other wording
        cap = "in every reading" if capped else "never"
        assert (f"| `{rung['name']}` | {rung['img_per_s']:,.0f} | {p['sm_clock_mhz']:,.0f} MHz | {p['power_w']:.0f} W "
                f"| {cap} |") in page, rung["name"]
    *below, top = r["rungs"]
    assert top["name"] == "muon" and top["gpu_power"]["reasons"] == {"power cap": 1.0}
    assert all(b["gpu_power"]["sm_clock_mhz"] == 1980 and not b["gpu_power"]["reasons"] for b in below)
    closest = max(below, key=lambda b: b["gpu_power"]["power_w"])
    assert (f"The `{closest['name']}` rung came closest to the limit, at {closest['gpu_power']['power_w']:.0f} W"
            in page)
    tp = top["gpu_power"]
    assert f"The top rung ran at {tp['sm_clock_mhz']:,.0f} MHz and {tp['power_w']:.0f} W" in page


def test_results_page_regions_from_a_shared_cache_match_their_h200_records():
    """'Compiled from a shared cache instead': the table's spreads, the cache hits, the losses and the builders'
    times from compile_regions_cached_h200.json and compile_regions_cached_nobench_h200.json."""
    import json

    page = results_page("coldstart")
    rec = RES
    a = json.loads((rec / "compile_regions_cached_h200.json").read_text())
    b = json.loads((rec / "compile_regions_cached_nobench_h200.json").read_text())
    for r, commit, parts in ((a, "f9be5b9", "saved,cached"), (b, "726ff9a", "cached")):
        assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130"
        assert r["env"]["git_commit"].startswith(commit) and r["repeats"] == 2 and r["splits"] == [1, 4, 10]
        assert f"--parts {parts} --splits 1,4,10 --repeats 2" in r["env"]["command"]
        assert f"commit {commit}, 2 rounds" in page
        for run in r["cached"]:  # every region's graphs from the cache, and the same loss as eager
            hits = run["cache"]
            assert hits["inductor.fxgraph_cache_hit"] > 0 and hits["aot_autograd.autograd_cache_hit"] > 0
            assert not hits.get("inductor.fxgraph_cache_miss") and not hits.get("aot_autograd.autograd_cache_miss")
            assert run["losses"][0] == run["eager_loss"]
    f = lambda v: f"{v[0]:.1f}–{v[1]:.1f} s"  # noqa: E731
    sa, sb = a["summary"], b["summary"]
    label = {"1": "1 (the whole model)", "4": "4", "10": "10"}
    for k in ("1", "4", "10"):
        assert (f"| {label[k]} | {f(sa[k]['saved_first_step_s'])} | {f(sa[k]['cached_first_step_s'])} | "
                f"{f(sb[k]['cached_first_step_s'])} |") in page, k
    for k in ("4", "10"):  # the shared cache beat the saved files, spreads apart
        assert sa[k]["cached_first_step_s"][1] < sa[k]["saved_first_step_s"][0]
    assert f"the builders were done {f(sa['4']['cached_built_s'])[:-2]} s into the run" in page
    four = [bd["compile_s"] for run in a["cached"] if run["k"] == 4 for bd in run["builders"]]
    ten = [bd["compile_s"] for run in a["cached"] if run["k"] == 10 for bd in run["builders"]]
    assert f"each spending {min(four):.1f}–{max(four):.1f} s compiling its region" in page
    assert f"Their builders took {min(ten):.1f}–{max(ten):.1f} s each" in page
    assert f"first call through the regions took {f(sa['4']['cached_first_call_s'])}" in page
    assert f"the whole model also took longer ({f(sb['1']['cached_first_step_s'])})" in page
    assert f"Within it, 4 regions took {f(sb['4']['cached_first_step_s'])}" in page
    # the second call's whole model is apart from the first's: the calls are not compared run for run
    assert sb["1"]["cached_first_step_s"][0] > sa["1"]["cached_first_step_s"][1]


def test_results_page_quick_mode_on_a_gpu_matches_its_records():
    """gpu_quick.py's two records cover every labkit command and every notebook; the page's counts are theirs."""
    import json

    from labkit import cli
    from labkit.notebooks import notebook_paths

    page = " ".join(page_text("notebooks").split())
    res = RES
    cmds = json.loads((res / "gpu_quick_commands_h200.json").read_text())
    nbs = json.loads((res / "gpu_quick_notebooks_h200.json").read_text())
    for r in (cmds, nbs):
        assert r["env"]["device_name"] == "NVIDIA H200" and r["env"]["torch"] == "2.11.0+cu130" and r["note"]
    assert cmds["env"]["git_commit"].startswith("7569b20") and nbs["env"]["git_commit"].startswith("9df6388")
    ran = {u["command"].split()[1] for u in cmds["units"]}  # "labkit COMMAND ..."
    assert ran == set(cli.COMMANDS), ran ^ set(cli.COMMANDS)
    assert {u["name"] for u in nbs["units"]} == {p.name for p in notebook_paths()}
    failed = [u for u in cmds["units"] if not u["ok"]]
    assert [u["name"] for u in failed] == ["doctor"] and failed[0]["rc"] == 1
    assert "required package(s) missing or broken: jupyterlab, nbgrader" in failed[0]["tail"][-1]
    n_ok = len(cmds["units"]) - len(failed)
    assert f"{n_ok} of the {len(cmds['units'])} commands ran cleanly" in page
    bad = sorted(u["name"] for u in nbs["units"] if not u["ok"])
    assert bad == []
    assert f"all {len(nbs['units'])} notebooks ran cleanly" in page

"""The headline (README, the results page's lead, week 6's section 0) leads with time to the baseline's accuracy,
says the top rung ends below it wherever its speedup is quoted, and quotes only figures of the records."""

import json
import re
from pathlib import Path

from labkit import report
from labkit.bench import Records

ROOT = Path(__file__).resolve().parents[1]
RES = Records(ROOT / "benchmarks" / "results")  # a record by name, in whichever topic folder holds it
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:–\d[\d,]*(?:\.\d+)?)?\s?(?:TFLOP/s|s\b|%|x\b))")


def _load(name):
    return json.loads((RES / f"{name}.json").read_text())


def _headline():
    return report.headline(_load("ladder_ablation"), _load("ladder"), _load("cold_start_tiered_final"))


def _cold():
    return report.cold_time_to_accuracy(_load("time_to_accuracy_h200"))


def _fold(text):
    return " ".join(text.split())


def _section(text, start, end):
    return _fold(text[text.index(start):text.index(end)])


def test_the_records_say_what_the_headline_says():
    h = _headline()
    assert not h["top_reaches"] and not h["cold_top_reaches"] and h["cold_eager_reaches"]
    assert h["cold_eager_rounds"] == h["cold_top_rounds"] == 6
    assert float(h["sooner"][:-1]) > 1  # the fast rung does reach the target sooner


def test_readme_leads_with_time_to_accuracy_and_every_figure_is_a_records():
    h = _headline()
    readme = (ROOT / "README.md").read_text()
    lead = _section(readme, "## Results on an H200 and an H100", "![ResNet-18 ladder")
    assert lead.index("Time to the baseline's accuracy comes first, from a cold process") < lead.index("img/s")
    c = _cold()
    for sentence in (f"the baseline reaches the target ({c['tta_target']}, its own median final accuracy) in "
                     f"{c['tta_base_s']} ({c['tta_base_spread']})",
                     f"the top rung without Muon in {c['tta_fast_s']} ({c['tta_fast_spread']}): {c['tta_sooner']} sooner",
                     f"(it ends at {c['tta_top_accs']})", f"{c['tta_rounds']} rounds"):
        assert sentence in lead, sentence
    v = report.variant_time_to_accuracy(_load("time_to_accuracy_muon_b2048_h200"), "muon_b2048")
    assert c["tta_top_never"] and not v["var_top_never"]
    peers, eager, nowarm = _calls()
    span = _span(v, peers, eager, nowarm)
    assert f"reaches its baseline's accuracy {span} sooner from a cold process" in _fold(readme)
    lightning = _load("time_to_accuracy_peers_h200")["summary"]["lightning"]
    assert lightning["reached_target"] == 0 and lightning["accuracy"]["min"] == lightning["accuracy"]["max"]
    for sentence in (f"At half its batch, Muon gets there {span} sooner",
                     f"Three more calls give {peers['var_sooner']} (`time_to_accuracy_peers_h200.json`, target "
                     f"{peers['var_target']}), {eager['var_sooner']} (`time_to_accuracy_eager_h200.json`) and "
                     f"{nowarm['var_sooner']} (`time_to_accuracy_nowarm_h200.json`: its baseline ended at "
                     f"{nowarm['var_base_accs']}, so the target was {nowarm['var_target']})",
                     f"The Lightning bf16 peer, in the {peers['var_sooner']} call, ends every run at "
                     f"{100 * lightning['accuracy']['median']:.2f}% and never reaches the target",
                     f"{v['var_img_per_s']}) reaches that run's target ({v['var_target']}) in {v['var_fast_s']} "
                     f"({v['var_fast_spread']}), in {v['var_fast_reached']} runs",
                     f"against the baseline's {v['var_base_s']} ({v['var_base_spread']}), and ends at {v['var_fast_accs']}",
                     f"with the saved compile artifact, {v['var_artifact_s']} ({v['var_artifact_sooner']}), no sooner",
                     f"{v['var_before_loop']} of each run passes before its first step, and 10x would leave it "
                     f"{v['var_tenth_of_base']} in all"):
        assert sentence in lead, sentence
    # training time alone, the cold eager rung and the table live on the results page (its lead is tested below)
    for sentence in (f"ends its 5 epochs at {h['top_accs']}, below the baseline's {h['baseline_accs']}",
                     f"Its {h['throughput']} the baseline's img/s (`ladder.json`: ",
                     "is throughput alone",
                     f"over the datasheet's {h['datasheet']} dense bf16) is {h['mfu']}",
                     f"measured in the same run it is {h['share_measured']}, which the tables call \"share of "
                     f"measured peak\", not MFU"):
        assert sentence in lead, sentence
    values = {x for x in [*h.values(), *c.values(), *v.values(), *peers.values(), *eager.values(), *nowarm.values(), span, "10x",
                          f"{100 * lightning['accuracy']['median']:.2f}%"] if isinstance(x, str)}
    assert {f for f in FIGURE.findall(lead)} <= values, set(FIGURE.findall(lead)) - values


def _calls():
    """The batch-2048 Muon variant in the three later time-to-accuracy calls: the peers call, the one beside the
    rung with nothing compiled and the one with the cuDNN warm-up tried off."""
    return tuple(report.variant_time_to_accuracy(_load(n), "muon_b2048") for n in
                 ("time_to_accuracy_peers_h200", "time_to_accuracy_eager_h200", "time_to_accuracy_nowarm_h200"))


def _span(*variants):
    x = sorted(float(v["var_sooner"][:-1]) for v in variants)
    return f"{x[0]:.1f}–{x[-1]:.1f}x"


def test_results_page_lead_is_time_to_accuracy_with_spreads_from_the_records():
    h = _headline()
    page = (ROOT / "docs" / "results" / "ladder.md").read_text()
    lead = _section(page, "## The headline: time to the baseline's accuracy", "## The ResNet-18 ladder on an H100")
    assert page.index("## The headline") < page.index("## The ResNet-18 ladder")
    for sentence in (f"Its target is {h['target']}, the lower of the baseline's two runs",
                     f"reaches it after {h['baseline_s']} of training ({h['baseline_s_without']} without its first step)",
                     f"reaches it in {h['fast_s']} with its compilation and {h['fast_s_without']} without: "
                     f"{h['sooner']} sooner with compilation, {h['sooner_without']} without",
                     f"{h['top_ablation_acc']} there and {h['top_ladder_acc']} in `ladder.json`, below every baseline "
                     f"run of the two records ({h['baseline_accs']})",
                     f"({h['throughput_ladder']} in `ladder.json`, {h['throughput_ablation']} in the ablation) is "
                     f"throughput alone",
                     f"finishes its 5 epochs in {h['cold_eager_s']} ({h['cold_eager_spread']}) at {h['cold_eager_acc']} "
                     f"in every run",
                     f"in {h['cold_top_s']} ({h['cold_top_spread']}) at {h['cold_top_accs']}, below the target",
                     f"({h['datasheet_exact']} for an H100 SXM", f"{h['mfu']} for the top rung",
                     f"measured in that run is {h['share_measured']}"):
        assert sentence in lead, sentence
    c = _cold()
    v = report.variant_time_to_accuracy(_load("time_to_accuracy_muon_b2048_h200"), "muon_b2048")
    for sentence in (f"the top rung without Muon is {c['tta_sooner']} sooner than the baseline ({c['tta_fast_s']} "
                     f"against {c['tta_base_s']})",
                     f"2048 is {v['var_sooner']} sooner ({v['var_fast_s']}, {v['var_fast_spread']}, against "
                     f"{v['var_base_s']}, {v['var_base_spread']}) in {v['var_fast_reached']} runs, ending at "
                     f"{v['var_fast_accs']}",
                     f"each of those Muon runs spends {v['var_before_loop']}, so 10x ({v['var_tenth_of_base']} in all)"):
        assert sentence in lead, sentence
    values = {x for x in [*h.values(), *c.values(), *v.values(), "10x"] if isinstance(x, str)}
    assert {f for f in FIGURE.findall(lead)} <= values, set(FIGURE.findall(lead)) - values


def test_week6_opens_with_its_executed_copy_and_computes_its_headline():
    nb = json.loads((ROOT / "notebooks" / "06_resnet_ladder.ipynb").read_text())
    first = "".join(nb["cells"][0]["source"])
    link = "benchmarks/results/notebooks/06_resnet_ladder.md"
    assert f"(../{link})" in first and (ROOT / link).exists()
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert 'load_result("ladder_ablation")' in code and 'load_result("cold_start_tiered_final")' in code
    assert 'load_result("time_to_accuracy_h200")' in code and 'load_result("time_to_accuracy_muon_b2048_h200")' in code
    assert "no record yet holds the baseline" not in code
    assert "report.accuracy_spread(" in code and "zoom_accuracy" not in code


def test_accuracy_chart_shows_every_run_and_the_baseline_band_on_an_honest_axis():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = _load("ladder")["rungs"]
    fig, ax = plt.subplots()
    report.accuracy_spread(ax, rungs)
    lo, hi = ax.get_ylim()
    assert hi - lo >= 8.0  # a few tenths of a point stay a few tenths of the axis
    dots = sum(len(line.get_ydata()) for line in ax.lines if line.get_marker() == "o")
    assert dots == sum(len(r.get("runs") or [r]) for r in rungs)
    base = [100 * x["accuracy"] for x in rungs[0]["runs"]]
    band = ax.patches[0].get_path().get_extents(ax.patches[0].get_transform())  # the shaded baseline band
    assert band is not None and "baseline" in ax.get_legend().get_texts()[0].get_text()
    assert f"{min(base):.1f}–{max(base):.1f}%" in ax.get_legend().get_texts()[0].get_text()
    plt.close(fig)


def test_results_page_peer_cold_start_and_energy_section_quotes_its_records():
    """The Lightning peer in the same call, the three calls' ratios, why a cold run is eager, and mJ per image:
    every figure of that section from the records it names."""
    page = (ROOT / "docs" / "results" / "ladder.md").read_text()
    sec = _fold(page[page.index("## Beside a Lightning peer, the cold start and energy per image"):])
    first = report.variant_time_to_accuracy(_load("time_to_accuracy_muon_b2048_h200"), "muon_b2048")
    peers, eager, nowarm = _calls()
    eager_rec = _load("time_to_accuracy_eager_h200")
    no_compile = report.variant_time_to_accuracy(eager_rec, "muon_b2048_eager")
    parts_of = lambda label, part: [r["setup_parts_s"][part] for r in eager_rec["runs"]  # noqa: E731
                                    if r["label"].startswith(f"{label}-")]
    secs = lambda v: f"{min(v):.2f}–{max(v):.2f} s"  # noqa: E731
    nowarm_off = report.variant_time_to_accuracy(_load("time_to_accuracy_nowarm_h200"), "muon_b2048_nowarm")
    rec = _load("time_to_accuracy_peers_h200")
    lt = rec["summary"]["lightning"]
    lt_whole = [r["whole_s"] for r in rec["runs"] if r["label"].startswith("lightning-")]
    assert rec["peers"] == ["lightning"] and lt["reached_target"] == 0 and lt["runs"] == 3
    tier = _load("cold_b2048_tier_h200")["runs"]
    t, u = tier["tiered"], tier["untiered"]
    assert t["config"]["batch_size"] == u["config"]["batch_size"] == 2048 and u["tiered"] is None
    assert t["tiered"]["compiled_steps"] == 0 and t["tiered"]["stopped_compiling"]
    power = {b: _load(f"step_power_b{b}_h200")["parts"] for b in (2048, 4096)}
    assert all(p["rung step"]["power_cap_share"] == 1.0 for p in power.values())
    parts = _load("step_parts_b2048_h200")["parts"]
    need = 690 / 100_000 * 1000  # mJ an image at the cap's 690 W for 100k img/s
    mj = {b: power[b]["rung step"]["mj_per_image"] for b in power}
    rng = lambda v: f"{v[0]:,.0f}–{v[1]:,.0f}"  # noqa: E731
    figures = {
        f"sets the target at {peers['var_target']}, the median of the baseline's runs ({peers['var_base_accs']})",
        f"The baseline reaches it in {peers['var_base_s']} ({peers['var_base_spread']}), in {peers['var_base_reached']} runs",
        f"Muon at batch 2048 reaches it in {peers['var_fast_s']} ({peers['var_fast_spread']}), in "
        f"{peers['var_fast_reached']} runs: {peers['var_sooner']} sooner, ending at {peers['var_fast_accs']}",
        f"PNG files through a worker per core, {lt['img_per_s']['median']:,.0f} img/s) ends all 3 runs at "
        f"{100 * lt['accuracy']['median']:.2f}% and never reaches the target; its whole runs take "
        f"{min(lt_whole):.1f}–{max(lt_whole):.1f} s",
        f"is {first['var_sooner']}, {peers['var_sooner']}, {eager['var_sooner']} and {nowarm['var_sooner']} sooner",
        f"{no_compile['var_fast_s']} ({no_compile['var_fast_spread']}) to the target against {eager['var_fast_s']} "
        f"({eager['var_fast_spread']}) tiered, {no_compile['var_sooner']} against {eager['var_sooner']}, from "
        f"{eager_rec['summary']['muon_b2048_eager']['to_target_s']['n']} runs each and within noise",
        f"Its data loads in {secs(parts_of('muon_b2048_eager', 'data'))}, where the tiered run's takes "
        f"{secs(parts_of('muon_b2048', 'data'))}",
        f"building its step takes {secs(parts_of('muon_b2048_eager', 'step'))} instead",
        f"the eager run spends {no_compile['var_before_loop']} before its first step, and 10x its baseline would leave "
        f"{no_compile['var_tenth_of_base']} for the whole run",
        f"the baseline's runs ended at {nowarm['var_base_accs']}, so the target was {nowarm['var_target']}",
        f"which Muon at 2048 ({nowarm['var_fast_accs']}) reached in {nowarm['var_fast_reached']} runs",
        f"{nowarm_off['var_fast_s']} ({nowarm_off['var_fast_spread']}) to the target against {nowarm['var_fast_s']} "
        f"({nowarm['var_fast_spread']}) with it, {nowarm_off['var_sooner']} against {nowarm['var_sooner']}",
        f"took all its {t['tiered']['eager_steps']} steps eager at {t['img_per_s']:,.0f} img/s",
        f"its steps ran compiled at {u['img_per_s']:,.0f} img/s, but its first epoch took {u['epoch_s'][0]:.1f} s",
        f"run of the peers call spends {peers['var_before_loop']}, and 10x its baseline would leave "
        f"{peers['var_tenth_of_base']} for the whole run",
        *(f"at batch {b}, {power[b]['rung step']['rate_median']:,.0f} img/s ({rng(power[b]['rung step']['rate_spread'])}) "
          f"at {power[b]['rung step']['power_w']:.0f} W: {mj[b]:.2f} mJ an image "
          f"({power[b]['rung step']['mj_per_image_spread'][0]:.2f}–{power[b]['rung step']['mj_per_image_spread'][1]:.2f})"
          for b in power),
        f"100k img/s at 690 W needs {need:.2f} mJ an image: {100 * (1 - need / mj[2048]):.1f}% less than batch 2048 "
        f"spends and {100 * (1 - need / mj[4096]):.1f}% less than batch 4096",
        f"runs {power[2048]['model, fresh']['rate_median']:,.0f} and {power[4096]['model, fresh']['rate_median']:,.0f} "
        f"img/s at {power[2048]['model, fresh']['mj_per_image']:.2f} and {power[4096]['model, fresh']['mj_per_image']:.2f} "
        f"mJ an image",
        f"at {power[2048]['model, fresh']['sm_clock_mhz']:,.0f} MHz in both against the rung's "
        f"{power[2048]['rung step']['sm_clock_mhz']:,.0f} and {power[4096]['rung step']['sm_clock_mhz']:,.0f} MHz",
        f"times an epoch of the rung with its own batches at {parts['rung']['img_per_s']:,.0f} img/s, beside "
        f"{parts['fixed batch']['img_per_s']:,.0f} img/s on one fixed batch",
    }
    for sentence in figures:
        assert sentence in sec, sentence
    assert power[2048]["model, fresh"]["sm_clock_mhz"] == power[4096]["model, fresh"]["sm_clock_mhz"]
    lo, hi = parts["fixed batch"]["img_per_s_spread"]
    assert lo <= parts["rung"]["img_per_s"] <= hi  # "within noise": the rung's median inside the other's spread
    a, b = (eager_rec["summary"][k]["to_target_s"] for k in ("muon_b2048_eager", "muon_b2048"))
    assert a["n"] == b["n"] == 3 and a["max"] >= b["min"]  # "within noise": the two spreads overlap

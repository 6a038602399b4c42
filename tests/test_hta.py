"""The Holistic Trace Analysis cross-check: labkit.hta, diagnose(hta=True) and the committed
benchmarks/results/diagnosis/trace_corpus/hta_crosscheck.json with the results page's paragraph on it. HTA is an optional
extra that CI does not install: everything here but the last test runs without it."""

import json
import sys
from pathlib import Path

import pytest

from labkit import diagnosis as D
from labkit import hta as H
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "results" / "diagnosis" / "trace_corpus"
RESULTS_PAGES = ROOT / "docs" / "results"  # one page per topic; docs/results.md is their index
SMALL = CORPUS / "slow_decode_workers0.pt.trace.json.gz"  # the smallest corpus trace: fast to read


def page_text(*names: str) -> str:
    """The results pages `names` (docs/results/<name>.md), one after another."""
    return "\n".join((RESULTS_PAGES / f"{name}.md").read_text() for name in names)


def results_page(*names: str) -> str:
    """The results pages `names` with their line breaks folded into spaces, so a sentence matches across lines."""
    return " ".join(page_text(*names).split())


def _records():
    path = CORPUS / "hta_crosscheck.json"
    if not path.exists():
        pytest.skip("no HTA cross-check committed: run `python benchmarks/trace_corpus.py --hta` with labkit[hta]")
    return json.loads((CORPUS / "trace_corpus.json").read_text()), json.loads(path.read_text())


def test_the_crosscheck_covers_the_corpus_and_says_why_for_each_disagreement():
    corpus, hta = _records()
    assert hta["hta_version"] and hta["labkit_commit"] != "unknown"
    recorded = {r["name"]: r for r in corpus["traces"] if "error" not in r}
    rows = {r["name"]: r for r in hta["traces"]}
    assert len(rows) == len(hta["traces"]) and set(rows) == set(recorded)  # one row per trace, none missing
    by_q: dict[str, list[int]] = {}
    for name, row in rows.items():
        assert row["file"] == recorded[name]["file"] and row["intended"] == recorded[name]["intended"]
        # the same verdict as the corpus record: rerun --hta after --rediagnose changes one
        assert row["ours"]["verdict"] == recorded[name]["diagnosed"]["verdict"], name
        for c in row["checks"]:
            assert c["agree"] or c.get("why"), f"{name}: {c['quantity']} disagrees with no why"
            by_q.setdefault(c["quantity"], []).append(bool(c["agree"]))
        assert row["agree"] == all(c["agree"] for c in row["checks"])
    s = hta["summary"]
    assert s["traces"] == len(rows) and s["agree_all"] == sum(r["agree"] for r in rows.values())
    assert s["by_quantity"] == {q: {"agree": sum(v), "of": len(v)} for q, v in by_q.items()}
    assert set(s["why"]) == set(s["disagreements"])
    assert corpus["disagreements"] == f"see hta_crosscheck.json: {s['text']}"


def test_results_page_states_the_crosscheck_as_recorded():
    _, hta = _records()
    page, s = results_page("diagnosis"), hta["summary"]
    rows = {r["name"]: r for r in hta["traces"]}
    q = s["by_quantity"]
    assert f"Holistic Trace Analysis {hta['hta_version']}" in page
    assert f"agree on every compared quantity on {s['agree_all']} of {s['traces']} traces" in page
    assert f"on {q['bound by']['agree']} of {q['bound by']['of']}:" in page
    host = [r["theirs"]["idle"]["split"]["host_wait"] for r in rows.values() if r["ours"]["causes"][0]["cause"] != "compute"]
    assert f"puts {100 * min(host):.0f}–{max(host):.0%} of the GPU's idle time down to host wait" in page
    alone = [r for r in rows.values() if r["ours"]["causes"][0]["cause"] == "compute" and r["ours"]["causes"][1]["share"] < 0.1]
    assert len(alone) == 3 and all(r["theirs"]["idle"]["split"]["kernel_wait"] == 1.0 for r in alone)
    assert s["disagreements"]["bound by"] == ["mixed_transformer_and_sync"]
    mt = rows["mixed_transformer_and_sync"]
    assert f"ranks compute first ({mt['ours']['causes'][0]['share']:.0%}) with sync second " \
           f"({mt['ours']['causes'][1]['share']:.0%})" in page
    assert f"finds the GPU idle {mt['theirs']['temporal']['idle_share']:.0%} of its span" in page
    idle, exact = q["GPU idle share"], q["GPU idle share, HTA without its us rounding"]
    assert f"within 10 points on {idle['agree']} of {idle['of']}, and within 1 point on {exact['agree']} of " \
           f"{exact['of']}" in page
    m = rows["mixed_matmul_and_slow_loader"]
    assert s["disagreements"]["GPU idle share, HTA without its us rounding"] == [m["name"]]
    assert f"(ours {m['ours']['gpu_idle_share']:.0%}, HTA's " \
           f"{m['theirs_without_rounding']['temporal']['idle_share']:.0%})" in page
    kernel = s["disagreements"]["mean kernel length, us"]
    t = rows["tiny_op_rnn"]
    assert len(kernel) == 5 and "tiny_op_rnn" in kernel and "on the five traces of microsecond kernels" in page
    assert f"ours {t['ours']['mean_kernel_us']:.2f} us, HTA's {t['theirs']['launch']['mean_kernel_us']:.2f} us" in page
    assert f"HTA reads {t['theirs_without_rounding']['launch']['mean_kernel_us']:.2f} us too" in page
    assert "error" in rows["small_batch_mlp"]["theirs"]["temporal"]
    assert s["disagreements"]["kernels start as soon as launched (host-limited)"] == [m["name"]]
    assert f"median launch delay ({m['theirs']['launch']['median_launch_delay_us'] / 1e3:.1f} ms)" in page


def _reading(idle, host_wait, kernel_wait, delay, mean_kernel):
    return {"temporal": {"idle_share": idle},
            "idle": {"split": {"host_wait": host_wait, "kernel_wait": kernel_wait, "other": 1 - host_wait - kernel_wait}},
            "launch": {"median_launch_delay_us": delay, "mean_kernel_us": mean_kernel}}


def _ours(top, idle, mean_kernel):
    causes = {"compute": 1 - idle, "data": 0.0, "sync": 0.0, "overhead": 0.0}
    if top != "compute":
        causes[top] = idle
    return {"gpu_idle_share": idle, "cause_shares": causes, "mean_kernel_us": mean_kernel,
            "idle_by_cause": {k: causes[k] for k in ("data", "sync", "overhead")}}


def test_compare_reads_host_bound_and_gpu_bound_alike_and_explains_a_split():
    rows = {c["quantity"]: c for c in H.compare(_ours("sync", 0.9, 2.0), _reading(0.92, 0.99, 0.01, 3.0, 1.9))}
    assert all(c["agree"] for c in rows.values()) and rows["bound by"]["theirs"] == "host"
    rows = {c["quantity"]: c for c in H.compare(_ours("compute", 0.02, 500.0), _reading(0.03, 0.0, 1.0, 4e4, 490.0))}
    assert all(c["agree"] for c in rows.values()) and "share of GPU idle time the host caused" not in rows
    # launch/Python by ours, yet HTA finds the idle time queued: a disagreement that says why
    rows = {c["quantity"]: c for c in H.compare(_ours("overhead", 0.6, 1.8), _reading(0.6, 0.1, 0.9, 3.0, 0.8))}
    assert not rows["bound by"]["agree"] and "kernel wait" in rows["bound by"]["why"]
    assert not rows["mean kernel length, us"]["agree"] and "rounds" in rows["mean kernel length, us"]["why"]
    exact = _reading(0.5, 0.1, 0.9, 3.0, 1.8)
    row = next(c for c in H.compare(_ours("overhead", 0.6, 1.8), exact, exact) if "rounding" in c["quantity"])
    assert not row["agree"] and "windows" in row["why"]


def test_without_hta_diagnose_says_so_and_ranks_the_same(monkeypatch):
    monkeypatch.setattr(H, "version", lambda: None)
    with pytest.raises(LabkitError, match=r"pip install 'labkit\[hta\]'"):
        H.hta_summary(SMALL)
    assert H.idle_split(SMALL) is None
    plain, asked = D.diagnose(SMALL), D.diagnose(SMALL, hta=True)
    assert [c["cause"] for c in asked.causes] == [c["cause"] for c in plain.causes] and "hta" not in asked.evidence
    assert any("not installed" in n for n in asked.notes)


def test_hta_bad_input_is_a_clear_error(tmp_path):
    if H.version() is None:
        pytest.skip("HTA not installed")
    with pytest.raises(LabkitError, match="no trace file"):
        H.hta_summary(tmp_path / "missing.json")
    with pytest.raises(LabkitError, match="trace file or a trace dict"):
        H.hta_summary(42)


def test_crosscheck_command_without_hta_exits_cleanly(monkeypatch, capsys):
    import importlib.util

    monkeypatch.setattr(H, "version", lambda: None)
    spec = importlib.util.spec_from_file_location("trace_corpus", ROOT / "benchmarks" / "trace_corpus.py")
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the repository first, as a script does
    assert tc.main(["--hta", "--out", str(CORPUS)]) == 2
    err = capsys.readouterr().err
    assert "labkit[hta]" in err and "Traceback" not in err


def test_with_hta_installed_the_reading_matches_the_committed_one():
    pytest.importorskip("hta")
    _, hta = _records()
    row = next(r for r in hta["traces"] if r["file"] == SMALL.name)
    s = H.hta_summary(D.load_trace(SMALL))  # a trace dict goes through a temporary file
    assert s["temporal"]["idle_share"] == pytest.approx(row["theirs"]["temporal"]["idle_share"], abs=1e-6)
    d = D.diagnose(SMALL, hta=True)
    assert d.evidence["hta"]["host_wait"] == pytest.approx(row["theirs_without_rounding"]["idle"]["split"]["host_wait"])
    assert any(n.startswith("Holistic Trace Analysis") for n in d.notes)


def test_results_page_states_the_corpus_accuracy_and_interventions_as_recorded():
    corpus, _ = _records()
    page = results_page("diagnosis")
    acc = corpus["accuracy"]
    assert acc["all"] == 1.0 and acc["recorded"] == 14 and "it names the intended cause of all 14" in page
    rows = {t["name"]: t for t in corpus["traces"]}
    sp = lambda name, what: rows[name]["intervention"]["removed"][what]["speedup"]  # noqa: E731
    assert f"sync_grad_norm_logging up {sp('sync_grad_norm_logging', 'reads'):.2f}x and mixed_transformer_and_sync " \
           f"{sp('mixed_transformer_and_sync', 'reads'):.2f}x" in page
    assert f"mixed_loader_and_item up {sp('mixed_loader_and_item', 'data'):.2f}x" in page
    assert f"gains nothing ({sp('mixed_loader_and_item', 'reads'):.2f}x)" in page
    share = rows["mixed_loader_and_item"]["intervention"]["removed"]["reads"]["diagnosed_share"]
    assert f"the reads' {share:.0%} of the step" in page

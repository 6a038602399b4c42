"""benchmarks/time_to_accuracy.py without a GPU: its variants are checked before any work, and summarized apart."""

from __future__ import annotations

import sys

import pytest

from labkit.env import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import time_to_accuracy as tta  # noqa: E402


def test_a_variant_is_a_preset_with_fields_changed_and_bad_ones_are_refused_before_any_work():
    assert tta.parse_variant("muon_b2048=muon:batch_size=2048,epochs=6") == (
        "muon_b2048", "muon", ("batch_size=2048", "epochs=6"))
    for bad, said in (("muon", "expected LABEL=PRESET"), ("x=muon", "expected LABEL=PRESET"),
                      ("x=nope:epochs=3", "unknown preset 'nope'"), ("x=muon:epochz=3", "epochz=3"),
                      ("x y=muon:epochs=3", "expected LABEL=PRESET")):
        with pytest.raises(SystemExit, match=said):
            tta.parse_variant(bad)
    with pytest.raises(SystemExit, match="label 'muon' is taken"):
        tta.main(["--variant", "muon=muon:epochs=6"])


def test_variants_are_summarized_under_their_own_labels_against_the_baselines_target():
    def run(label, acc, curve):
        return {"label": label, "ok": True, "whole_s": 10.0, "before_loop_s": 5.0, "accuracy": acc,
                "img_per_s": 1.0, "curve": [{"accuracy": a, "train_s": t} for a, t in curve]}

    runs = [run("baseline-r0", 0.92, [(0.90, 30.0), (0.92, 60.0)]),
            run("muon-r0", 0.91, [(0.85, 2.0), (0.91, 4.0)]),
            run("muon_b2048-r0", 0.93, [(0.90, 2.0), (0.925, 4.0)])]
    tta.score(runs, 0.92)
    s = tta.summarize(runs, 0.92)
    assert s["muon"]["reached_target"] == 0 and s["muon"]["ratio_vs_baseline"] is None
    assert s["muon_b2048"]["to_target_s"]["median"] == 9.0 and s["muon_b2048"]["ratio_vs_baseline"] == 65 / 9


def test_the_lightning_peer_runs_in_its_own_process_and_is_refused_before_any_work_without_lightning(
        monkeypatch, tmp_path, capsys):
    """--lightning times the Lightning peer (benchmarks/peers.py --time-to-accuracy-run) beside the rungs; where
    Lightning is not installed the call stops before the data or any run, saying how to install it."""
    peer = tta.command(tta.LIGHTNING, (), tmp_path / "p.json")
    assert peer[1].endswith("peers.py") and peer[2:] == ["--time-to-accuracy-run", str(tmp_path / "p.json")]
    rung = tta.command("muon", ("batch_size=2048",), tmp_path / "m.json")
    assert rung[1:5] == ["-m", "labkit", "train", "--preset"] and "batch_size=2048" in rung
    monkeypatch.setattr(tta.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"--lightning: Lightning is not installed here \(pip install"):
        tta.main(["--lightning", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_peers_timed_run_says_why_it_timed_nothing_without_lightning(monkeypatch, tmp_path, capsys):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import peers

    monkeypatch.setattr(peers, "_lightning", lambda: None)
    assert peers.main(["--time-to-accuracy-run", str(tmp_path / "p.json")]) == 3
    assert "Lightning is not installed" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_each_run_imports_this_checkouts_labkit_and_keeps_its_tiered_report(monkeypatch, tmp_path):
    """The Lightning peer is a script, whose own folder is on its path, not the checkout's: it puts the checkout on
    its path itself, so it imports this labkit run from any folder with no PYTHONPATH (the peer's first GPU call
    failed to import labkit without it). The record keeps the run's tiered-start report, the steps it ran eager and
    compiled, not just whether it started tiered."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # without this checkout's editable install, as on a GPU machine whose torch environment has no labkit
    probe = subprocess.run([sys.executable, "-c", "import runpy, sys; "
                            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
                            "sys.argv = ['peers.py', '--help']; "
                            f"runpy.run_path({str(REPO_ROOT / 'benchmarks' / 'peers.py')!r}, run_name='__main__')"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and "--time-to-accuracy-run" in probe.stdout, probe.stderr[-800:]

    def fake_run(cmd, env, **kw):
        out = tmp_path / "lightning-r0.json"
        out.write_text(json.dumps({"stages_s": {"setup": 2.0}, "accuracy": 0.9, "accuracy_curve": [],
                                   "tiered": {"eager_steps": 120, "compiled_steps": 0}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(tta.subprocess, "run", fake_run)
    r = tta.run_once(tta.LIGHTNING, {}, tmp_path, "lightning-r0")
    assert r["ok"] and r["before_loop_s"] == 2.0 and r["tiered"] == {"eager_steps": 120, "compiled_steps": 0}

"""benchmarks/cold_start.py: its plan and summary, its variants' checks, and a clean exit without a GPU."""

import time

import pytest
import torch
from conftest import benchmark_module


@pytest.fixture(scope="module")
def cs():
    return benchmark_module("cold_start")


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(cs, tmp_path, capsys):
    assert cs.main(["--device", "cpu", "--variants", "--out", str(tmp_path)]) == 0
    assert "cold_start: needs a CUDA GPU (muon replays CUDA graphs); on cpu nothing is measured (skipped)" \
        in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_every_default_variant_names_real_settings_and_bad_ones_fail_before_any_run(cs, capsys):
    for changes in cs.VARIANTS.values():
        cs.changes(changes)
    label, c = cs.parse_variant("mine:env.TORCHINDUCTOR_COMPILE_THREADS=8,inductor.triton.autotune_pointwise=0,"
                                "warm_pool=true")
    assert label == "mine" and c == {"env": {"TORCHINDUCTOR_COMPILE_THREADS": "8"}, "dynamo": {},
                                     "inductor": {"triton.autotune_pointwise": False}, "warm_pool": True,
                                     "sets": [], "artifact": False}
    _, c = cs.parse_variant("warm, no autotune:set.cudnn_benchmark=false,artifact=true")
    assert c["sets"] == ["cudnn_benchmark=false"] and c["artifact"] is True
    for argv, needle in [(["--variant", "no colon"], "write LABEL:KEY=VALUE"),
                         (["--variant", "x:inductor.turbo=1"], "torch._inductor.config has no 'turbo'"),
                         (["--variant", "x:cuda.graphs=1"], "write env.NAME=V"),
                         (["--variant", "x:set.turbo=1"], "unknown TrainConfig field"),
                         (["--variant", "x:sets=1"], "write env.NAME=V"),
                         (["--rung", "batch_fused"], "does not compile"),
                         (["--eager", "compile"], "not an eager rung"),
                         (["--parts", "first,hot"], "--parts"),
                         (["--repeats", "0"], ">= 1")]:
        with pytest.raises(SystemExit):
            cs.main(argv)
        assert needle in capsys.readouterr().err, argv


def test_a_round_runs_the_top_rung_beside_its_variants_and_the_eager_rungs_and_sums_up(cs):
    jobs = cs.plan_jobs("muon", ["batch_fused"], {"v": {}, "a, w": {"artifact": True}}, ["first", "run"])
    assert [j[0] for j in jobs] == ["first step, cold", "first step, artifact", "first step, cold, v",
                                    "first step, artifact, a, w",
                                    "whole run muon, cold", "whole run muon, artifact", "whole run batch_fused"]
    assert jobs[3][2]["artifact"] is True and "artifact" not in jobs[2][2]  # the variant's first step loads it
    runs = {"first step, cold": [{"first_step_s": 20.0}, {"first_step_s": 30.0}],
            "first step, artifact": [{"first_step_s": 2.0}, {"error": "exit 1: boom"}],
            "first step, cold, v": [{"first_step_s": 11.0}], "first step, artifact, a, w": [{"first_step_s": 1.5}],
            "whole run muon, cold": [{"wall_s": 60.0}], "whole run muon, artifact": [{"wall_s": 35.0}],
            "whole run batch_fused": [{"wall_s": 40.0}, {"wall_s": 34.0}, {"wall_s": 41.0}]}
    s = cs.summarize({"jobs": {k: {"runs": v} for k, v in runs.items()}}, "muon", ["batch_fused"])
    assert s["first_step_cold_s"] == 25.0 and s["first_step_artifact_s"] == 2.0  # the failed run has no number
    assert s["variants_first_step_s"] == {"v": 11.0, "a, w": 1.5} and s["fastest_eager"] == "batch_fused"
    # first by the medians (35 s against 40 s), not in every run: one eager run took 34 s
    assert s["top_with_artifact_finishes_first"] is True and s["top_with_artifact_finishes_first_every_run"] is False
    assert s["goals"] == {"first_step_cold_s": {"goal": 12.0, "met": False},
                          "first_step_artifact_s": {"goal": 3.0, "met": True}}


def test_a_first_step_record_says_where_compile_time_went(cs):
    """compile_phases: torch._dynamo's timed phases after a compile, longest first, in seconds."""
    fn = torch.compile(lambda x: (x * 2).relu().sum(), backend="eager")
    fn(torch.randn(8))
    phases = cs.compile_phases()
    assert phases and all(isinstance(v, float) and v >= 0 for v in phases.values())
    assert list(phases.values()) == sorted(phases.values(), reverse=True)


def test_a_variant_of_trainconfig_fields_is_another_top_rung_run_whole_with_its_own_artifact(cs):
    fast = cs.changes(["set.compile_autotune=false", "set.compile_combo=true"])
    env_only = cs.changes(["env.TORCHINDUCTOR_COMPILE_THREADS=1"])
    patched = cs.changes(["inductor.combo_kernels=true"])  # patched inside a first-steps process: no whole run
    jobs = cs.plan_jobs("muon", ["batch_fused"], {"fast": fast, "1 thread": env_only, "combo": patched}, ["run"])
    assert [j[0] for j in jobs] == ["whole run muon, cold", "whole run muon, artifact", "whole run muon, cold, fast",
                                    "whole run muon, artifact, fast", "whole run muon, cold, 1 thread",
                                    "whole run muon, artifact, 1 thread", "whole run batch_fused"]
    assert jobs[3][2] == {"rung": "muon", "variant": "fast", "artifact": True}
    warm = cs.plan_jobs("muon", ["batch_fused"], {"1 thread": env_only, "combo": patched}, ["warm"])
    assert [j[0] for j in warm] == ["whole run muon, artifact", "whole run muon, artifact, 1 thread",
                                    "whole run batch_fused"]  # warm: no cold compiles
    stages = {"process_before_command": 2.0, "device_and_config": 1.0, "compile_cache_load": 0.5, "setup": 1.5,
              "loop": 8.0, "final_evaluation": 1.0}
    runs = {"whole run muon, artifact": [{"wall_s": 22.0, "img_per_s": 85e3, "accuracy": 0.91, "stages_s": stages}],
            "whole run muon, cold, fast": [{"wall_s": 30.0, "first_step_s": 11.0}],
            "whole run muon, artifact, fast": [{"wall_s": 14.0, "first_step_s": 2.5, "img_per_s": 84e3,
                                                "accuracy": 0.912}],
            "whole run batch_fused": [{"wall_s": 15.0}]}
    s = cs.summarize({"jobs": {k: {"runs": v} for k, v in runs.items()},
                      "variants": {"fast": fast, "1 thread": env_only}}, "muon", ["batch_fused"])
    assert s["top_with_artifact_finishes_first"] is False and s["run_img_per_s"] == 85e3
    assert s["run_artifact_stages_s"] == {**stages, "after_result": 8.0}  # 22 s of wall, 14 s in the stages
    assert s["variants_whole_run"] == {"fast": {
        "first_step_cold_s": 11.0, "first_step_artifact_s": 2.5, "cold_wall_s": 30.0, "artifact_wall_s": 14.0,
        "img_per_s": 84e3, "accuracy": 0.912, "artifact_stages_s": None, "finishes_first_with_artifact": True}}


def test_without_installed_bytecode_every_process_shares_one_bytecode_folder_filled_before_timing(cs, monkeypatch,
                                                                                                  tmp_path):
    """A torch installed without .pyc (pip --no-compile, a folder Python may not write) recompiles its sources in
    every process: the call gives them one PYTHONPYCACHEPREFIX, filled by an untimed first import."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")
    seen = []
    monkeypatch.setattr(cs, "import_seconds", lambda: seen.append(dict(cs.os.environ)) or {"torch_s": 1.0})
    monkeypatch.setattr(cs, "bytecode_status", lambda: {"cached": False, "missing": ["__init__.py"]})
    info = cs.installed_bytecode("installed", str(tmp_path))
    assert len(seen) == 2 and all(e["PYTHONPYCACHEPREFIX"] == str(tmp_path) for e in seen)
    assert all("PYTHONDONTWRITEBYTECODE" not in e for e in seen)  # else nothing would be written there
    assert info["prefix"] == str(tmp_path) and info["import_s_without"] == info["import_s"] == {"torch_s": 1.0}
    assert cs.fresh_env(tmp_path, None)["PYTHONPYCACHEPREFIX"] == str(tmp_path)  # every job inherits it
    seen.clear()
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")
    info = cs.installed_bytecode("as-found", str(tmp_path))  # the machine as it is: only the import times
    assert len(seen) == 1 and seen[0]["PYTHONPYCACHEPREFIX"] == "" and "prefix" not in info


def test_a_variant_gets_its_own_artifact_only_when_it_changes_the_graph(cs):
    assert not cs.changes_graph("muon", [], ["cudnn_warmup=false"])  # the same graph: the base artifact serves
    assert not cs.changes_graph("muon", ["epochs=3"], ["cudnn_limit=3"])
    assert cs.changes_graph("muon", [], ["batch_size=1024"])
    assert cs.changes_graph("muon", ["batch_size=1024"], ["compile_combo=true"])


def test_compile_regions_cuts_the_model_into_regions_that_chain_to_it_and_skips_without_a_gpu(tmp_path, capsys):
    """benchmarks/compile_regions.py: each split's regions, run in turn, are the model (same parameters, same
    output), each region's input has the shape its child compiles for, and bad splits fail before any work."""
    cr, mr = benchmark_module("compile_regions"), benchmark_module("model_regions")
    from labkit.models import resnet18

    model = resnet18(zero_init_residual=True).eval()
    x = torch.randn(2, 3, 32, 32)
    want = model(x)
    assert set(mr.CUTS) == set(cr.SPLITS)
    for k, cuts in mr.CUTS.items():
        h = x
        for i, (region, c) in enumerate(zip(mr.regions(model, k), cuts, strict=False)):
            assert h.shape[1:] == (mr.ENTERING[c][0], mr.ENTERING[c][1], mr.ENTERING[c][1])
            assert cr.region_input(k, i, torch.device("cpu"), 2).shape == h.shape
            h = region(h)
        assert torch.allclose(h, want), k
    # a run's setup (the saved and cached parts share it) and its builders' records
    dev, m, regs, xb, yb, age = cr._run_setup(4, 2, "cpu", time.perf_counter())
    assert len(regs) == 4 and xb.shape == (2, 3, 32, 32) and yb.shape == (2,) and age(time.perf_counter()) > 0
    (tmp_path / "r0.json").write_text('{"region": 0}')
    (tmp_path / "b1.log").write_text("compiling\nRuntimeError: out of memory\n")
    assert cr._builder_records(tmp_path, [0]) == [{"region": 0}]
    with pytest.raises(SystemExit, match="builder 1 failed: RuntimeError: out of memory"):
        cr._builder_records(tmp_path, [0, 1])
    for f in ("r0.json", "b1.log"):
        (tmp_path / f).unlink()
    for bad in (["--splits", "2,4"], ["--splits", "6,1"], ["--parts", "warm"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            cr.main([*bad, "--device", "cpu", "--out", str(tmp_path)])
    if not torch.cuda.is_available():
        assert cr.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
        assert "compile_regions: needs a CUDA GPU" in capsys.readouterr().out
        assert list(tmp_path.iterdir()) == []


def test_step_parts_times_every_part_of_a_tiny_step_on_cpu_and_refuses_bad_input_first(tmp_path, capsys):
    """benchmarks/step_parts.py: on a CPU every part runs (eager, tiny), the record says so, and a bad argument or an
    output folder it cannot write fails before any model is built."""
    import json

    sp = benchmark_module("step_parts")
    with pytest.raises(SystemExit):
        sp.main(["--rounds", "0", "--out", str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert sp.main(["--out", str(blocker / "sub"), "--device", "cpu"]) == 2
    assert "cannot write there" in capsys.readouterr().err
    assert sp.main(["--preset", "nonesuch", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "unknown preset 'nonesuch'" in capsys.readouterr().err
    assert sp.main(["--device", "cpu", "--rounds", "2", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "nothing here is a measurement" in out and "no kernel profile without a CUDA GPU (skipped)" in out
    r = json.loads((tmp_path / "r" / "step_parts.json").read_text())
    assert r["quick"] and r["rounds"] == 2 and "profile" not in r
    assert set(r["parts"]) == set(sp.PARTS)
    assert all(len(p["epoch_s"]) == 2 and p["img_per_s"] > 0 for p in r["parts"].values())
    assert r["parts"]["rung"]["share_of_rung"] == 1.0


def test_step_power_runs_every_part_on_cpu_and_refuses_bad_input_first(tmp_path, capsys):
    """benchmarks/step_power.py: on a CPU every part runs (eager, tiny) and says what it skips; bad input fails
    first. Its readings are labkit.gpu_power's (tests/test_gpu_power.py)."""
    import json

    sp = benchmark_module("step_power")
    with pytest.raises(SystemExit):
        sp.main(["--sample-ms", "0", "--out", str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert sp.main(["--out", str(blocker / "sub"), "--device", "cpu"]) == 2
    assert "cannot write there" in capsys.readouterr().err
    assert sp.main(["--device", "cpu", "--rounds", "2", "--steps", "2", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "nothing here is a measurement" in out and "(skipped: clocks, power)" in out
    r = json.loads((tmp_path / "r" / "step_power.json").read_text())
    assert r["quick"] and r["card"] == {} and set(r["parts"]) == set(sp.PARTS)
    assert all(len(p["rate"]) == 2 and p["rounds"] == [] for p in r["parts"].values())
    assert sp.main(["--batch", "0", "--device", "cpu", "--out", str(tmp_path / "b")]) == 2
    assert "--batch 0: give a positive number" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_step_power_gives_each_rounds_energy_per_image_from_its_own_watts_and_rate():
    """mJ/img is each round's board watts over that round's img/s (x 1000), then the median and spread of those:
    700 W at 100,000 img/s is 7 mJ an image. The matmul part, in TFLOP/s, gets none."""
    sp = benchmark_module("step_power")
    rnd = lambda w: {"sm_clock_mhz": 1700, "power_w": w, "at_limit": 1.0, "reasons": {"power cap": 1.0}}  # noqa: E731
    res = {"parts": {"rung step": {"unit": "img/s", "rate": [100_000.0, 50_000.0, 70_000.0],
                                   "rounds": [rnd(700.0), rnd(700.0), rnd(700.0)]},
                     "matmul": {"unit": "TFLOP/s", "rate": [700.0], "rounds": [rnd(690.0)]}}}
    sp.summarize(res)
    part = res["parts"]["rung step"]
    assert part["mj_per_image"] == 10.0 and part["mj_per_image_spread"] == [7.0, 14.0]
    assert "mj_per_image" not in res["parts"]["matmul"]

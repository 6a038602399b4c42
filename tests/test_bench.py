import json
import time

import pytest

from labkit import bench
from labkit.env import LabkitError


def test_quantile_and_timing_statistics():
    t = bench.Timing([5.0, 1.0, 2.0, 3.0, 4.0])
    assert t.median == 3.0
    assert t.iqr == pytest.approx(2.0)  # q75=4, q25=2
    assert t.p95 == pytest.approx(4.8)
    assert t.min == 1.0
    assert t.throughput(300) == pytest.approx(100.0)
    assert bench.quantile([7.0], 0.5) == 7.0
    with pytest.raises(ValueError):
        bench.Timing([])


def test_median_ignores_outliers():
    t = bench.Timing([1.0] * 9 + [100.0])
    assert t.median == 1.0 and t.p95 > 10


def test_time_fn_measures_sleep_with_generous_margin():
    t = bench.time_fn(lambda: time.sleep(0.01), warmup=1, repeats=5)
    assert len(t.samples) == 5
    assert 0.009 < t.median < 0.05


def test_time_fn_runs_warmup_and_inner_calls():
    calls = []
    t = bench.time_fn(lambda: calls.append(1), warmup=3, repeats=4, inner=5)
    assert len(calls) == 3 + 4 * 5 and len(t.samples) == 4
    with pytest.raises(LabkitError):
        bench.time_fn(lambda: None, repeats=0)


def test_compare_interleaves_and_reports_ratio():
    order = []

    def a():
        order.append("a")
        time.sleep(0.012)

    def b():
        order.append("b")
        time.sleep(0.004)

    r = bench.compare(a, b, rounds=5, warmup=1)
    assert len(r.ratios) == 5
    # Alternating order within rounds: ABBA..., after the warm-up pair.
    assert order[2:6] == ["a", "b", "b", "a"]
    assert 1.8 < r.ratio < 4.5  # true ratio 3, generous for a loaded 2-core machine
    assert r.ratio_iqr >= 0 and r.ratio_range[0] <= r.ratio <= r.ratio_range[1]
    s = r.summary()
    assert s["rounds"] == 5 and "a" in s and "b" in s


def test_compare_equal_functions_ratio_near_one():
    r = bench.compare(lambda: time.sleep(0.005), lambda: time.sleep(0.005), rounds=7)
    assert 0.6 < r.ratio < 1.6


def test_torch_timer_returns_timing():
    import torch

    x = torch.randn(64, 64)
    t = bench.torch_timer(lambda: x @ x, min_run_time=0.05)
    assert t.median > 0


def test_save_and_load_result_carry_environment(tmp_results):
    p = bench.save_result("unit", {"kind": "selftest", "value": 1.5}, out_dir=tmp_results, command="pytest")
    data = json.loads(p.read_text())
    assert data["value"] == 1.5 and data["name"] == "unit"
    for key in ("device_name", "torch", "git_commit", "command", "cpu_count", "timestamp"):
        assert key in data["env"]
    assert data["env"]["command"] == "pytest"
    assert bench.load_result("unit", results_dir=tmp_results)["value"] == 1.5
    assert "torch" in bench.recorded_note(data)
    assert not list(tmp_results.glob(".*.tmp"))  # atomic write left no temp file


def test_result_errors_are_clear(tmp_results):
    with pytest.raises(LabkitError, match="no recorded result"):
        bench.load_result("missing", results_dir=tmp_results)
    (tmp_results / "broken.json").write_text("{not json")
    with pytest.raises(LabkitError, match="not valid JSON"):
        bench.load_result("broken", results_dir=tmp_results)
    with pytest.raises(LabkitError, match="bad result name"):
        bench.save_result("../escape", {}, out_dir=tmp_results)


def test_compile_cache_compiles_cold_then_reads_the_folder_back_warm(tmp_path, monkeypatch):
    import os

    import torch
    from torch._dynamo.utils import counters

    from labkit.bench import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-cache"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)

    def f(x):
        return torch.sin(x) * 2 + x.relu()

    x = torch.randn(64)
    folder = tmp_path / "course-cache"
    hits = {}
    for kind in ("cold", "warm"):
        counters.clear()
        with compile_cache(folder) as d:
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
            assert torch.allclose(torch.compile(f)(x), f(x))
        hits[kind] = dict(counters["inductor"])
    # cold: inductor compiled the graph and stored it; warm: the same graph came back from the folder
    assert hits["cold"].get("fxgraph_cache_miss") == 1 and not hits["cold"].get("fxgraph_cache_hit")
    assert hits["warm"].get("fxgraph_cache_hit") == 1 and not hits["warm"].get("fxgraph_cache_miss")
    assert d == str(folder) and any(folder.iterdir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "machine-cache")
    assert "TRITON_CACHE_DIR" not in os.environ
    with compile_cache() as tmp:  # no folder given: a temporary one, removed afterwards
        assert os.environ["TRITON_CACHE_DIR"].startswith(tmp)
    assert not os.path.exists(tmp)

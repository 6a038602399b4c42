"""labkit.overlap: copy-compute overlap, its CPU stand-in, and the benchmark's --overlap record."""

import subprocess
import sys

import pytest

from labkit import bench
from labkit import overlap as O
from labkit.env import REPO_ROOT, LabkitError


def test_cpu_runs_a_tiny_version_and_says_overlap_needs_cuda():
    r = O.copy_compute_overlap("cpu", O.OverlapConfig(batches=3, repeats=1, matmuls=2))
    assert not r["cuda"] and r["matmuls"] == 2 and r["same_result"]
    assert r["batch_bytes"] <= 2**18 and all(r[f"{m}_s"] > 0 for m in O.MODES)
    assert "needs CUDA" in r["note"] and "needs CUDA" in O.overlap_summary(r)
    assert "x   (ideal" not in O.overlap_summary(r)  # no speedup claimed where nothing can overlap


@pytest.mark.parametrize("cfg, msg", [(O.OverlapConfig(batches=1), "at least 2"),
                                      (O.OverlapConfig(batch_mib=0), "positive"),
                                      (O.OverlapConfig(matmuls=0), "matmuls")])
def test_bad_config_is_one_line_error(cfg, msg):
    with pytest.raises(LabkitError, match=msg):
        O.copy_compute_overlap("cpu", cfg)


def test_summary_of_a_cuda_record_shows_the_speedup():
    r = {"device": "cuda:0", "cuda": True, "batch_bytes": 64 * 2**20, "matmuls": 3, "copy_s": 3e-3,
         "compute_s": 2.5e-3, "serial_s": 8e-3, "pinned_s": 5.6e-3, "overlap_s": 3.2e-3, "speedup": 2.5,
         "ideal_speedup": 1.83, "same_result": True, "note": ""}
    text = O.overlap_summary(r)
    assert "serial / overlap: 2.50x" in text and "ideal for these two times: 1.83x" in text


def test_benchmark_overlap_flag_records_on_cpu(tmp_results):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "week4_loaders.py"), "--overlap", "--quick",
                           "--device", "cpu", "--out", str(tmp_results)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = bench.load_result(tmp_results / "week4_overlap.json")
    assert res["env"]["device_type"] == "cpu" and res["quick"] and res["same_result"]
    assert not (tmp_results / "week4_loaders.json").exists()

"""benchmarks/attention_gpu.py: refuses without a GPU, and its --device cpu --quick dry run writes a whole record
while importing neither matplotlib, tqdm nor psutil (the GPU machine may lack them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "attention_gpu.py"
# Run the script with the optional packages made unimportable, as on a machine that has only torch and numpy.
RUNNER = ("import runpy, sys\n"
          "for m in ('matplotlib', 'tqdm', 'psutil'):\n"
          "    sys.modules[m] = None\n"
          "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
          "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run_script(*args, tmp_path):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", RUNNER, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)


def test_refuses_without_gpu_and_cpu_without_quick(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import attention_gpu
    finally:
        sys.path.pop(0)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert attention_gpu.main(["--out", str(tmp_path)]) == 2
    assert attention_gpu.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())
    with pytest.raises(Exception, match="at least 5 timed rounds"):
        attention_gpu.SweepConfig(reps=3).check()


def test_cpu_quick_dry_run_writes_the_record(tmp_path):
    out = tmp_path / "out"
    proc = run_script("--device", "cpu", "--quick", "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "L=128" in proc.stdout and "profiled bf16 step" in proc.stdout  # progress per stage
    rec = json.loads((out / "attention_cpu_quick.json").read_text())
    assert rec["env"]["torch"] and rec["env"]["device_name"].startswith("CPU") and "git_commit" in rec["env"]
    assert "--quick" in rec["env"]["command"]
    rows = rec["rows"]
    cfg = rec["config"]
    assert {(r["dtype"], r["seq_len"]) for r in rows} == {(d, n) for d in cfg["dtypes"] for n in cfg["seq_lens"]}
    timed = [r for r in rows if "skipped" not in r]
    assert {"naive", "SDPA"} <= {r["name"] for r in timed}
    for r in timed:
        for part in ("forward", "forward_backward"):
            t = r[part]
            assert t["n"] >= 5 and t["median_s"] > 0 and t["iqr_s"] >= 0 and t["peak_bytes"] >= 0
        assert r["saved_bytes"] > 0
    sdpa = [r for r in timed if r["name"] == "SDPA"]
    assert all(r["backend"] == "flash" and "flash_attention" in r["op"] for r in sdpa)  # the CPU's fused kernel
    # the CPU has no memory-efficient kernel: forcing it is recorded as skipped, with the reason
    assert all("skipped" in r for r in rows if r["name"] == "SDPA efficient")
    # naive attention keeps the L x L probabilities: more saved bytes than SDPA at the longest L
    by = {(r["dtype"], r["name"], r["seq_len"]): r for r in timed}
    n = max(cfg["seq_lens"])
    assert by["float32", "naive", n]["saved_bytes"] > by["float32", "SDPA", n]["saved_bytes"]
    assert [p["attention"] for p in rec["profiles"]] == ["naive", "SDPA"]
    for p in rec["profiles"]:
        assert p["by"] == "cpu" and p["top_ops"][0]["share"] == 1.0 and p["step_median_s"] > 0

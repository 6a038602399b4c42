import io
import subprocess
import sys

import pytest
import torch

from labkit import env
from labkit.env import LabkitError


def test_environment_record_fields():
    rec = env.environment(command=["labkit", "doctor"])
    assert rec["command"] == "labkit doctor"
    assert rec["torch"] == torch.__version__
    assert rec["cpu_count"] >= 1
    assert rec["device_name"]
    assert "git_commit" in rec and "cuda" in rec and "cudnn" in rec


def test_environment_record_keeps_nccl_settings(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    nccl = env.environment(command=["x"])["nccl_env"]
    assert nccl["NCCL_PROTO"] == "Simple" and nccl["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.delenv("NCCL_PROTO")
    assert "NCCL_PROTO" not in env.environment(command=["x"])["nccl_env"]


def test_pick_device_errors():
    assert env.pick_device("cpu").type == "cpu"
    assert env.pick_device(None).type in ("cpu", "cuda")
    with pytest.raises(LabkitError, match="unknown device"):
        env.pick_device("tpu-9000")
    if not torch.cuda.is_available():
        with pytest.raises(LabkitError, match="no CUDA GPU"):
            env.pick_device("cuda")


def test_torch_switches_restore():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),
              torch.backends.cudnn.benchmark_limit)
    with env.torch_switches(tf32=not before[0], cudnn_benchmark=not before[2], cudnn_limit=before[4] + 1):
        assert torch.backends.cuda.matmul.allow_tf32 == (not before[0])
        assert torch.backends.cudnn.benchmark == (not before[2])
        assert torch.backends.cudnn.benchmark_limit == before[4] + 1
    after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark_limit)
    assert after == before


def test_quick_mode_env(monkeypatch):
    monkeypatch.setenv("LABKIT_QUICK", "0")
    assert env.quick_mode() is False
    monkeypatch.setenv("LABKIT_QUICK", "1")
    assert env.quick_mode() is True


def test_doctor_output_lists_capabilities_and_packages():
    out = io.StringIO()
    code = env.doctor(out=out)
    text = out.getvalue()
    assert code == 0
    for word in ("tensor_cores", "bf16", "fp8", "TF32 switches", "nbgrader", "what runs here", "week 6"):
        assert word in text


def test_doctor_missing_package_fails_with_one_line(capsys):
    code = env.doctor(out=io.StringIO(), packages=[("torch", "torch"), ("no-such-pkg", "no_such_pkg_xyz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and "no-such-pkg" in err[0] and "pip install" in err[0]


def test_doctor_cli_broken_package_exit_code():
    # A package that is installed but fails to import (simulated by blocking it in sys.modules).
    code = ("import sys; sys.modules['nbgrader'] = None; "
            "from labkit.cli import main; sys.exit(main(['doctor']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "nbgrader" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_help_and_unknown_command():
    r = subprocess.run([sys.executable, "-m", "labkit", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "doctor" in r.stdout
    r = subprocess.run([sys.executable, "-m", "labkit", "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_doctor_says_when_every_process_recompiles_torch_and_how_to_keep_its_bytecode(monkeypatch, tmp_path):
    """Python looks for bytecode under sys.pycache_prefix: an empty one is a torch installed without .pyc."""
    assert set(env.bytecode_status()) == {"cached", "missing", "writes", "prefix"}
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    status = env.bytecode_status()
    assert status == {"cached": False, "missing": list(env.BYTECODE_SOURCES), "writes": False,
                      "prefix": str(tmp_path)}
    out = io.StringIO()
    env.doctor(out=out)
    assert "bytecode: no cached .pyc for torch" in out.getvalue() and "unset PYTHONDONTWRITEBYTECODE" in out.getvalue()
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    out = io.StringIO()
    env.doctor(out=out)
    assert f"find it under PYTHONPYCACHEPREFIX={tmp_path}" in out.getvalue()


def test_torch_switches_leave_matmul_precision_alone_unless_tf32_is_given(monkeypatch):
    # setting the float32 matmul precision, even to its current value, changes torch.compile's cache keys: a block
    # that sets only cuDNN switches (the cuDNN warm-up, evaluation) must not write it, or a compile-cache artifact
    # built in one process misses in the next (benchmarks/results/coldstart/cold_start_warmup_keys.json)
    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(p))
    with env.torch_switches(cudnn_benchmark=True, cudnn_limit=3, cudnn_deterministic=False):
        pass
    assert calls == []
    with env.torch_switches(tf32=True):
        pass
    assert calls == ["high", torch.get_float32_matmul_precision()]


def test_a_tf32_block_leaves_the_precision_settings_as_it_found_them():
    # torch's precision setters mark the new-style settings as set ("none" -> "ieee"), which compile keys include
    marks = [m for m in (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
             if hasattr(m, "fp32_precision")]
    before = [m.fp32_precision for m in marks] + [torch.get_float32_matmul_precision()]
    for tf32 in (True, False):
        with env.torch_switches(tf32=tf32):
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
        assert [m.fp32_precision for m in marks] + [torch.get_float32_matmul_precision()] == before

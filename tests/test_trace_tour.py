"""Week 5's additions: the guided trace reading (labkit.trace_tour), NVTX ranges and the nsys command
(labkit.profiling), graph breaks (labkit.graph_breaks)."""

import pytest
import torch

from labkit import graph_breaks, profiling
from labkit import trace_tour as TT
from labkit.env import REPO_ROOT, LabkitError

CORPUS = REPO_ROOT / "benchmarks" / "results" / "diagnosis" / "trace_corpus"


def _ev(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_tour_of_a_small_cpu_trace(capsys):
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        _ev("ProfilerStep#1", 0, 1000, "user_annotation"), _ev("ProfilerStep#2", 1000, 1000, "user_annotation"),
        _ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 600, "user_annotation"),
        _ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1000, 400, "user_annotation"),
        _ev("aten::linear", 700, 200), _ev("aten::addmm", 710, 180), _ev("aten::linear", 1500, 200),
        _ev("aten::relu", 1800, 100), _ev("aten::mm", 0, 50, tid=2)]}
    f = TT.tour(trace)
    assert f["steps"] == {"count": 2, "mean_ms": 1.0}
    assert f["data"]["annotation"] == "DataLoader annotation" and f["data"]["share"] == pytest.approx(0.5)
    assert f["kernel_rows"] == [] and f["gpu_gaps"] is None
    assert [o["name"] for o in f["top_ops"]] == ["aten::linear", "aten::relu"]  # addmm runs inside linear
    assert f["threads"][0]["name"] == "main" and f["threads"][0]["steps_here"]
    TT.print_tour(f)
    out = capsys.readouterr().out
    assert "2. 2 ProfilerStep ranges, 1.0 ms each" in out and "(50% of the step)" in out and "4-5. no kernel" in out
    assert len(TT.TOUR) == 6
    with pytest.raises(LabkitError, match="no ProfilerStep"):
        TT.tour({"traceEvents": [_ev("aten::mm", 0, 5)]})


def test_tour_of_a_gpu_trace_that_labkit_did_not_make():
    f = TT.tour(CORPUS / "slow_decode_workers0.pt.trace.json.gz")
    assert f["data"]["annotation"] == "DataLoader annotation" and f["data"]["share"] > 0.5
    assert f["kernel_rows"] and f["gpu_gaps"]["share"] > 0.5  # the GPU idles while the loop decodes


def test_nvtx_range_is_a_no_op_without_cuda_and_nsys_command():
    with profiling.nvtx_range("step"):
        x = 1
    assert x == 1
    with pytest.raises(LabkitError, match="non-empty name"):
        with profiling.nvtx_range(""):
            pass
    cmd = profiling.nsys_command(["python", "train.py", "--epochs", "1"], out="runs/n")
    assert cmd.startswith("nsys profile --trace=cuda,nvtx,osrt") and "--output=runs/n" in cmd
    assert cmd.endswith("python train.py --epochs 1")
    with pytest.raises(LabkitError):
        profiling.nsys_command([])


def _with_breaks(x, w):
    y = torch.relu(x @ w)
    if y.sum() > 0:  # data-dependent control flow: a break
        y = y * 2
    s = y.mean().item()  # a Python number: another break
    return y + s


def test_explain_counts_graphs_and_breaks_with_their_lines():
    r = graph_breaks.explain(_with_breaks, torch.randn(4, 4), torch.randn(4, 4))
    assert r["graphs"] == 3 and r["breaks"] == 2 and len(r["reasons"]) == 2
    assert all("test_trace_tour.py" in x["where"] for x in r["reasons"])
    assert "item()" in r["reasons"][1]["reason"]
    assert graph_breaks.explain(lambda x: x * 2 + 1, torch.randn(3))["breaks"] == 0
    with pytest.raises(LabkitError):
        graph_breaks.explain(3)
    with graph_breaks.logging_breaks():
        pass

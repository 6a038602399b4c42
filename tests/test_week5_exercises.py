"""Week 5's self-checks catch wrong answers with a message that says what differed; the readers they compare
with (profiling.read_key_averages, profiling.read_nsys_stats) read what torch.profiler and nsys print; a CPU
profile's stderr carries no CUDA-probe noise; a scenario's in-thread data wait is not ranked as a worker queue."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from labkit import diagnosis as D
from labkit import exercises as ex
from labkit import profiling as P
from labkit import week5_exercises as W

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    P.quiet_cpu_profiler()


# ----------------------------------------------------------------------------------------------- 5.1


def _loop(step_first: bool = False, steps_extra: int = 0, one_file: bool = False):
    def profile_loop(step, out_dir, wait=1, warmup=1, active=3, repeat=1):
        def write(p):
            name = "trace.json" if one_file else f"t{p.step_num}.json"
            p.export_chrome_trace(os.path.join(out_dir, name))

        with profile(activities=[ProfilerActivity.CPU], on_trace_ready=write,
                     schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)) as prof:
            for _ in range((wait + warmup + active) * repeat + steps_extra):
                if step_first:
                    prof.step()
                step()
                if not step_first:
                    prof.step()
        return prof

    return profile_loop


def test_5_1_catches_a_wrong_count_and_one_file_for_all_cycles():
    assert "right" in ex.check("5.1", _loop(), quiet=True)
    with pytest.raises(ex.Wrong, match="should run step"):
        ex.check("5.1", _loop(steps_extra=1), quiet=True)
    with pytest.raises(ex.Wrong, match="one trace file per active cycle"):
        ex.check("5.1", _loop(one_file=True), quiet=True)
    # prof.step() before step() only shifts which call each range holds (the first range is empty): still right
    assert "right" in ex.check("5.1", _loop(step_first=True), quiet=True)


# ----------------------------------------------------------------------------------------------- 5.2


def _labelled_profile(data_ms=3.0):
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(3):
            with record_function("data"):
                time.sleep(data_ms / 1e3)
            with record_function("forward"):
                torch.randn(128, 128) @ torch.randn(128, 128)
            prof.step()
    return prof


def test_read_key_averages_reads_the_top_operator_and_the_data_share():
    r = P.read_key_averages(_labelled_profile())
    assert r["top_op"].startswith("aten::") and r["steps"] == 2
    assert 0.0 < r["phase_share"] < 1.0 and r["phase_ms"] > 2.0  # the sleep; a loaded machine stretches the rest
    with pytest.raises(P.LabkitError, match="ProfilerStep"):
        with profile(activities=[ProfilerActivity.CPU]) as plain:
            torch.randn(8, 8).sum()
        P.read_key_averages(plain)
    with pytest.raises(P.LabkitError, match="'cpu' or 'cuda'"):
        P.read_key_averages(plain, by="gpu")


def test_5_2_catches_self_time_for_the_share_and_total_time_for_the_top():
    def self_time_share(prof):
        rows = {r.key: r for r in prof.key_averages()}
        top = max((r for k, r in rows.items() if k.startswith("aten::")), key=lambda r: r.self_cpu_time_total)
        return top.key, rows["data"].self_cpu_time_total / rows["ProfilerStep*"].cpu_time_total / 2

    def total_time_top(prof):
        rows = {r.key: r for r in prof.key_averages()}
        top = max((r for k, r in rows.items() if k.startswith("aten::")), key=lambda r: r.cpu_time_total)
        return top.key, rows["data"].cpu_time_total / rows["ProfilerStep*"].cpu_time_total

    with pytest.raises(ex.Wrong, match="'data' range took"):
        ex.check("5.2", self_time_share, quiet=True)
    with pytest.raises(ex.Wrong, match="top operator by self CPU time"):
        ex.check("5.2", total_time_top, quiet=True)


# ----------------------------------------------------------------------------------------------- 5.3


def test_5_3_catches_missing_labels_and_nvtx_pushed_when_not_asked():
    def unlabelled(model, opt, next_batch, nvtx=False):
        x, y = next_batch()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ref = ex.reference("5.3")

    def always_nvtx(model, opt, next_batch, nvtx=False):
        return ref(model, opt, next_batch, nvtx=True)

    with pytest.raises(ex.Wrong, match=r"record_function\('data'\)"):
        ex.check("5.3", unlabelled, quiet=True)
    with pytest.raises(ex.Wrong, match="nvtx=False"):
        ex.check("5.3", always_nvtx, quiet=True)


def test_the_nvtx_stand_in_is_removed_after_the_check():
    import torch.cuda.nvtx as nvtx

    before = nvtx._nvtx
    with contextlib.suppress(ex.Wrong):
        ex.check("5.3", lambda *a, **k: torch.zeros(()), quiet=True)
    assert nvtx._nvtx is before


# ----------------------------------------------------------------------------------------------- 5.4


def test_read_nsys_stats_reads_the_sample_files_in_column_layout():
    kern, nvtx = (DATA / "week5_nsys_cuda_gpu_kern_sum.txt").read_text(), (DATA / "week5_nsys_nvtx_sum.txt").read_text()
    r = P.read_nsys_stats(kern, nvtx)
    assert r["top_kernel"].startswith("sm90_xmma_fprop_implicit_gemm") and r["top_kernel_instances"] == 50
    assert r["top_kernel_share"] == pytest.approx(0.7) and r["kernel_ms"] == pytest.approx(10.0)
    assert r["steps"] == 10 and r["data_share"] == pytest.approx(0.25) and r["step_ms"] == pytest.approx(3.0)
    rows = P.parse_nsys_stats(kern)
    assert rows[0]["Name"].endswith("(int, T2, T3)") and rows[0]["Instances"] == 100.0  # spaces kept, commas gone
    assert ex.check("5.4", ex.reference("5.4"), quiet=True)


def test_read_nsys_stats_says_what_is_missing():
    kern = (DATA / "week5_nsys_cuda_gpu_kern_sum.txt").read_text()
    with pytest.raises(P.LabkitError, match="no nsys stats table"):
        P.parse_nsys_stats("nothing to see\n")
    no_step = "\n".join(ln for ln in (DATA / "week5_nsys_nvtx_sum.txt").read_text().splitlines()
                        if not ln.rstrip().endswith("step"))
    with pytest.raises(P.LabkitError, match="no NVTX range named 'step'"):
        P.read_nsys_stats(kern, no_step)


def test_5_4_catches_the_first_row_and_a_cut_name():
    def first_row(kern, nvtx):
        rows = P.parse_nsys_stats(kern)
        r = P.read_nsys_stats(kern, nvtx)
        return rows[0]["Name"], rows[0]["Time (%)"] / 100, r["data_share"]

    def cut_name(kern, nvtx):
        r = P.read_nsys_stats(kern, nvtx)
        return r["top_kernel"][:30], r["top_kernel_share"], r["data_share"]  # a fixed-width column's cut

    with pytest.raises(ex.Wrong, match="most total time"):
        ex.check("5.4", first_row, quiet=True)
    with pytest.raises(ex.Wrong, match="keep the whole name"):
        ex.check("5.4", cut_name, quiet=True)


def test_5_4_reads_the_recorded_run_when_there_is_one():
    verdict = ex.check("5.4", ex.reference("5.4"), quiet=True)
    if W.recorded_nsys_stats() is None:
        assert "only the samples were read" in verdict
    else:
        assert "the recorded GPU run" in verdict and W.nsys_record()["status"] == "ok"


# ----------------------------------------------------------------------------------------------- 5.5


def test_5_5_lists_the_clear_cases_a_fixed_answer_gets_wrong():
    with pytest.raises(ex.Wrong, match=r"clear cases differ:[\s\S]*labkit says 'data'"):
        ex.check("5.5", lambda m: "compute", quiet=True)
    with pytest.raises(ex.Wrong, match="return one of"):
        ex.check("5.5", lambda m: "slow", quiet=True)


def test_clear_cases_have_one_cause_far_ahead_of_the_next():
    cases = W.clear_cases(live_cpu=False)
    assert len(cases) >= 10 and {c["kind"] for c in cases} == set(D.KINDS)
    for c in cases:
        shares = sorted(c["shares"], reverse=True)
        assert shares[0] >= W.CLEAR_MARGIN * shares[1] and c["kind"] in c["verdict"] + str(D.CAUSES)
    recorded = {c["name"].split(" ")[0]: c["kind"] for c in cases if "recorded on" in c["name"]}
    assert recorded.get("data-slow") == "data" and recorded.get("sync-slow") == "sync"  # the H100 scenarios
    with pytest.raises(ex.LabkitError, match="Diagnosis"):
        W.measured(["not", "evidence"])


# ----------------------------------------------------------------------------------------------- 5.6


def test_5_6_catches_a_bigger_batch_and_a_fix_that_leaves_the_decoding():
    from labkit import scenarios as S

    with pytest.raises(ex.Wrong, match="keep the model and the batch"):
        ex.check("5.6", lambda cfg: S.with_changes(cfg, loader="batched", batch=2 * cfg.batch), quiet=True)
    with pytest.raises(ex.Wrong, match="still waits"):
        ex.check("5.6", lambda cfg: S.with_changes(cfg, augment=False), quiet=True)


# ------------------------------------------------------------------------------------ CPU profiler noise

PROFILE_ONCE = """
import torch
from torch.profiler import ProfilerActivity, profile
{prelude}
with profile(activities=[ProfilerActivity.CPU]) as p:
    torch.randn(16, 16) @ torch.randn(16, 16)
print("profiled")
"""


def _stderr_of(prelude: str, env_extra=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", PROFILE_ONCE.format(prelude=prelude)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and "profiled" in r.stdout, r.stderr[-2000:]
    return r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a CUDA GPU keeps kineto's messages")
def test_a_cpu_profile_prints_no_cuda_probe_once_quieted():
    quiet = _stderr_of("from labkit import profiling\nassert profiling.quiet_cpu_profiler()")
    assert "gpuGetDeviceCount" not in quiet and "USDT" not in quiet, quiet
    if torch.version.cuda:  # a CUDA build without a driver: without the call, the probe's error shows
        assert "gpuGetDeviceCount failed" in _stderr_of("")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a CUDA GPU keeps kineto's messages")
def test_profile_steps_is_quiet_on_a_cpu_and_a_users_log_level_is_left_alone():
    prog = ("import torch\nfrom labkit import profiling, scenarios as S\n"
            "wl = S.workload(S.with_changes(S.scenario_config('overhead', quick=True), n_samples=256), 'cpu')\n"
            "profiling.profile_steps(wl, 'cpu')\nprint('profiled')\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and "gpuGetDeviceCount" not in r.stderr and "USDT" not in r.stderr, r.stderr[-2000:]
    saved = os.environ.get("KINETO_LOG_LEVEL")
    os.environ["KINETO_LOG_LEVEL"] = "1"
    try:
        assert P.quiet_cpu_profiler() is False and os.environ["KINETO_LOG_LEVEL"] == "1"
    finally:
        if saved is None:
            del os.environ["KINETO_LOG_LEVEL"]
        else:
            os.environ["KINETO_LOG_LEVEL"] = saved


# ------------------------------------------------------------------------------ in-thread data, on a GPU


def _gpu_trace_waiting_in_data(meta=None) -> dict:
    """Three steps: 500 us in labkit's `data` label, then 90 launches of 3 us kernels every 15 us."""
    ev = []
    for i in range(3):
        s = 1000 + i * 2000
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i + 2}", "pid": 1, "tid": 1,
                   "ts": s, "dur": 2000})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "data", "pid": 1, "tid": 1, "ts": s, "dur": 500})
        for k in range(90):
            t = s + 510 + 15 * k
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t,
                       "dur": 5})
            ev.append({"ph": "X", "cat": "kernel", "name": "void elementwise_kernel", "pid": 0, "tid": 7,
                       "ts": t + 6, "dur": 3})
    trace = {"schemaVersion": 1, "traceEvents": ev}
    if meta is not None:
        trace["labkit"] = meta
    return trace


def test_a_scenarios_data_label_ranks_by_its_share_not_as_a_worker_queue():
    queue = D.diagnose(_gpu_trace_waiting_in_data())
    in_thread = D.diagnose(_gpu_trace_waiting_in_data({"data_loading": "in-thread"}))
    assert queue.evidence["data_wait"]["background"] and queue.kind == "data"
    assert not in_thread.evidence["data_wait"]["background"] and in_thread.kind == "overhead", str(in_thread)
    assert in_thread.evidence["data_wait"]["dataloader"] == "in the step's thread"
    assert "own thread" in in_thread.causes[1]["evidence"] or "own thread" in str(in_thread)


def test_profile_steps_marks_a_workloads_loading_as_in_thread():
    from labkit import scenarios as S

    wl = S.workload(S.with_changes(S.scenario_config("overhead", quick=True), n_samples=256), "cpu")
    prof = P.profile_steps(wl, "cpu", schedule=P.ProfileSchedule(wait=0, warmup=1, active=2))
    assert prof.trace["labkit"]["data_loading"] == "in-thread"


# ------------------------------------------------------------------------------------ benchmarks/week5_nsys.py


def _nsys_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("week5_nsys", ROOT / "benchmarks" / "week5_nsys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script really profiles")
def test_the_nsys_script_without_a_gpu_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/week5_nsys.py", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stdout and not (tmp_path / "o").exists()


def test_the_nsys_script_records_a_missing_nsys_and_a_run_that_left_no_report(tmp_path, monkeypatch):
    import json

    mod = _nsys_script()
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod.profiling, "find_nsys", lambda: None)
    monkeypatch.setattr(mod.bench, "environment", lambda command=None, device=None: {"device_name": "a fake card"})
    assert mod.main(["--out", str(tmp_path / "a")]) == 1
    rec = json.loads((tmp_path / "a" / "week5_nsys.json").read_text())
    assert rec["status"] == "nsys missing" and "PATH" in rec["why"]
    # an nsys that writes the raw .qdstrm and exits 0 without making the report, as seen on a lent machine
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'NVIDIA Nsight Systems version fake'; exit 0; fi\n"
                    "for a in \"$@\"; do case $a in --output=*) out=${a#--output=};; esac; done\n"
                    "touch \"$out.qdstrm\"; echo 'Generating report failed' >&2; exit 0\n")
    fake.chmod(0o755)
    assert mod.main(["--out", str(tmp_path / "b"), "--nsys", str(fake)]) == 1
    rec = json.loads((tmp_path / "b" / "week5_nsys.json").read_text())
    assert rec["status"] == "no report" and rec["files_left"] == ["week5_nsys.qdstrm"]
    assert "Generating report failed" in rec["profile_output"] and "fake" in rec["nsys_version"]
    assert rec["commands"][0].startswith(f"{fake} profile --trace=cuda,nvtx --capture-range=cudaProfilerApi")
    assert rec["importer"] is None  # no QdstrmImporter here to turn the .qdstrm into a report

"""labkit.profiling and labkit.scenarios: trace parsing, the diagnosis rules, real CPU runs, the Python profilers,
bad traces, the CLI and the week-5 benchmark in quick mode."""

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit import profiling as P
from labkit import scenarios as S
from labkit.cli import main as cli_main
from labkit.env import LabkitError

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[1]



# ------------------------------------------------------------------------------ synthetic GPU-style traces


class _Trace:
    """Builds a Chrome trace in the shape torch.profiler writes (ProfilerStep, annotations, runtime, kernels)."""

    def __init__(self):
        self.events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]

    def host(self, name, ts, dur, cat="user_annotation", tid=1):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur})

    def kernel(self, name, ts, dur):
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur})

    def steps(self, n, length, start=1000.0):
        for i in range(n):
            self.host(f"ProfilerStep#{i + 2}", start + i * length, length)
        return [start + i * length for i in range(n)]

    def dict(self):
        return {"schemaVersion": 1, "traceEvents": self.events}


def _data_bound():
    t = _Trace()
    for s in t.steps(3, 10_000):
        t.host("data", s, 7000)
        t.host("forward", s + 7000, 1000)
        t.host("backward", s + 8000, 1500)
        t.host("optimizer", s + 9500, 500)
        for k in range(28):
            t.kernel("void at::native::vectorized_elementwise_kernel", s + 7100 + 100 * k, 100)
    return t


def _sync_bound():
    t = _Trace()
    for s in t.steps(3, 1000):
        t.host("forward", s, 900)
        t.host("data", s + 900, 20)
        for k in range(20):
            t0 = s + 45 * k
            t.host("cudaLaunchKernel", t0, 5, cat="cuda_runtime")
            t.kernel("void at::native::reduce_kernel", t0 + 5, 20)
            t.host("aten::_local_scalar_dense", t0 + 5, 22, cat="cpu_op")
            t.host("cudaStreamSynchronize", t0 + 6, 20, cat="cuda_runtime")
            t.kernel("Memcpy DtoH (Device -> Pageable)", t0 + 25, 1)
            t.events[-1]["cat"] = "gpu_memcpy"
    return t


def _launch_bound():
    t = _Trace()
    for s in t.steps(3, 1500):
        t.host("data", s, 100)
        t.host("forward", s + 100, 600)
        t.host("backward", s + 700, 500)
        t.host("optimizer", s + 1200, 300)
        for k in range(90):
            t.host("cudaLaunchKernel", s + 105 + 15 * k, 8, cat="cuda_runtime")
            t.kernel("void at::native::elementwise_kernel", s + 112 + 15 * k, 3)
    return t


def _compute_bound(name="sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", data=0):
    t = _Trace()
    for s in t.steps(3, 10_000):
        t.host("data", s, max(data, 50))
        t.host("forward", s + max(data, 50), 3000)
        t.host("backward", s + 3050 + data, 3000)
        for k in range(19):
            t.kernel(name, s + 100 + 500 * k, 490)
    return t


@pytest.mark.parametrize("build,kind", [(_data_bound, "data"), (_sync_bound, "sync"), (_launch_bound, "overhead"),
                                        (_compute_bound, "compute")])
def test_gpu_rules_name_the_planted_bottleneck(build, kind):
    d = P.diagnose(build().dict())
    assert d.kind == kind, str(d)
    assert d.device == "cuda" and d.title == P.KINDS[kind] and d.fix == P.FIXES.get(kind, d.fix)
    ev = d.evidence
    assert ev["steps"] == 3
    assert 0 <= ev["gpu_idle_share"] <= 1 and abs(ev["gpu_busy_share"] + ev["gpu_idle_share"] - 1) < 1e-9
    assert sum(ev["idle_by_cause"].values()) == pytest.approx(ev["gpu_idle_share"], abs=1e-6)


def test_gpu_evidence_counts_what_happened():
    ev = P.diagnose(_sync_bound().dict()).evidence
    assert ev["syncs_per_step"] == 20 and ev["host_reads_per_step"] == 20 and ev["dtoh_copies_per_step"] == 20
    assert ev["idle_by_cause"]["sync"] > 0.4
    ev = P.diagnose(_launch_bound().dict()).evidence
    assert ev["kernels_per_step"] == 90 and ev["launches_per_step"] == 90
    assert ev["mean_kernel_us"] == pytest.approx(3)
    assert ev["launch_ms_per_step"] == pytest.approx(90 * 8 / 1e3)
    d = P.diagnose(_data_bound().dict())
    # Shares start at the first recorded kernel (7.1 ms into step 1) and end with step 3: 22.9 ms.
    assert d.evidence["data_share"] == pytest.approx(14_000 / 22_900)
    assert d.evidence["gpu_busy_share"] == pytest.approx(3 * 2800 / 22_900)
    assert any("first recorded GPU work" in n for n in d.notes)


def test_all_reduce_time_is_split_into_hidden_and_exposed():
    # Compute kernels 0-6 ms of each 10 ms step; NCCL all-reduces 4-5 ms (under compute: hidden) and 6-8 ms
    # (after backward: exposed), as when DDP all-reduces the last bucket after the graph.
    t = _compute_bound()
    t.events = [e for e in t.events if e.get("cat") != "kernel"]
    for s in [1000.0 + i * 10_000 for i in range(3)]:
        t.kernel("sm90_xmma_fprop_implicit_gemm_bf16", s, 6000)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", s + 4000, 1000)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", s + 6000, 2000)
    d = P.diagnose(t.dict())
    assert d.evidence["comm_ms_per_step"] == pytest.approx(3.0)
    assert d.evidence["comm_exposed_ms_per_step"] == pytest.approx(2.0)
    assert any("all-reduce (NCCL) kernels: 3.00 ms per step, 2.00 ms" in n for n in d.notes)
    assert "comm_ms_per_step" not in P.diagnose(_compute_bound().dict()).evidence  # one GPU: nothing to report


def test_a_host_running_ahead_does_not_look_like_an_idle_gpu():
    # Three 1 ms host steps launch 10 ms of GPU work each; the GPU is still busy with earlier, unrecorded work
    # until 20 ms, then runs the recorded kernels back to back.
    t = _Trace()
    for s in t.steps(3, 1000, start=0):
        t.host("data", s, 50)
        t.host("forward", s + 50, 500)
        t.host("backward", s + 550, 400)
        t.host("cudaGraphLaunch", s + 60, 20, cat="cuda_runtime")
    for k in range(30):
        t.kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 20_000 + 1000 * k, 1000)
    d = P.diagnose(t.dict())
    assert d.kind == "compute", str(d)
    assert d.evidence["step_ms"] == pytest.approx(10) and d.evidence["launches_per_step"] == 1


def _mixed(data_us):
    # A launch-bound step (kernels of 3 us every 15 us) that first waits `data_us` for its batch.
    t = _Trace()
    for s in t.steps(3, 1500 + data_us):
        t.host("data", s, data_us + 20)
        t.host("forward", s + data_us + 20, 1400)
        for k in range(90):
            t.kernel("void at::native::elementwise_kernel", s + data_us + 30 + 15 * k, 3)
    return t.dict()


def test_a_steady_wait_for_data_outranks_launch_overhead():
    # 500 us of data wait per 2 ms step is 25% of it: the loader is the slowest stage, though launch gaps
    # idle the GPU longer; 100 us (6%) is noise next to them.
    slow_loader, launch = P.diagnose(_mixed(500)), P.diagnose(_mixed(100))
    assert slow_loader.kind == "data", str(slow_loader)
    assert slow_loader.evidence["idle_by_cause"]["overhead"] > slow_loader.evidence["idle_by_cause"]["data"]
    assert any("next in line after the fix: CPU/launch bound" in n for n in slow_loader.notes)
    assert launch.kind == "overhead", str(launch)


def test_tensor_core_share_picks_the_fix():
    tc = P.diagnose(_compute_bound().dict())
    cuda_cores = P.diagnose(_compute_bound(name="volta_sgemm_128x64_nn").dict())
    assert tc.evidence["tensor_core_share"] == 1.0 and tc.fix == P.FIXES["compute_tensor_cores"]
    assert cuda_cores.evidence["tensor_core_share"] == 0.0 and cuda_cores.fix == P.FIXES["compute_cuda_cores"]
    assert cuda_cores.evidence["top"][0]["tensor_core"] is False


def test_a_busy_gpu_is_compute_bound_even_when_the_host_waits_in_data():
    d = P.diagnose(_compute_bound(data=4000).dict())
    assert d.kind == "compute"
    assert any("faster loading will not help" in n for n in d.notes)


def test_trace_without_steps_counts_as_one_step():
    t = _Trace()
    t.host("forward", 0, 100)
    t.host("aten::mm", 10, 80, cat="cpu_op")
    d = P.diagnose(t.dict())
    assert d.evidence["steps"] == 1 and any("ProfilerStep" in n for n in d.notes)
    assert any("no 'data' label" in n for n in d.notes)


# ------------------------------------------------------------------------------------- committed traces


def test_committed_cpu_traces_are_small_and_diagnosed():
    files = sorted(DATA.glob("cpu_*.pt.trace.json.gz"))
    assert len(files) >= 2
    assert sum(f.stat().st_size for f in files) < 400_000
    kinds = {f.name: P.diagnose(f).kind for f in files}
    assert kinds["cpu_data_slow.pt.trace.json.gz"] == "data"
    assert kinds["cpu_data_fixed.pt.trace.json.gz"] != "data"
    assert kinds["cpu_compute_slow.pt.trace.json.gz"] == "compute"
    ev = P.diagnose(DATA / "cpu_data_slow.pt.trace.json.gz").evidence
    assert ev["device"] == "cpu" and ev["gpu_idle_share"] is None and ev["steps"] == 2
    assert ev["data_share"] > 0.5 and ev["top"] and ev["ops_per_step"] > 100


def test_committed_gpu_traces_match_their_recorded_diagnosis():
    files = sorted(DATA.glob("gpu_*.json.gz"))
    if not files:
        pytest.skip("no GPU trace committed yet: benchmarks/week5_profiling.py --trace-out tests/data/gpu_... on a GPU")
    for f in files:
        trace = P.load_trace(f)
        d = P.diagnose(trace)
        assert d.device == "cuda" and d.evidence["kernels_per_step"] > 0
        meta = trace["labkit"]
        assert d.kind == (meta.get("planted") or meta["diagnosed"]), (f.name, str(d))
        assert f.stat().st_size < 2_500_000


# -------------------------------------------------------------------------------------------- bad input


def test_bad_traces_raise_labkit_errors(tmp_path):
    good = (DATA / "cpu_compute_slow.pt.trace.json.gz").read_bytes()
    with pytest.raises(LabkitError, match="no trace file"):
        P.diagnose(tmp_path / "missing.json.gz")
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(LabkitError, match="truncated"):
        P.diagnose(cut)
    plain = gzip.decompress(good)
    half = tmp_path / "half.json"
    half.write_bytes(plain[: len(plain) // 2])
    with pytest.raises(LabkitError, match="not complete JSON"):
        P.diagnose(half)
    for name, payload in [("other.json", {"name": "not a trace"}), ("list.json", [1, 2]),
                          ("empty.json", {"traceEvents": [{"ph": "M", "name": "process_name"}]})]:
        (tmp_path / name).write_text(json.dumps(payload))
        with pytest.raises(LabkitError, match="trace|profiler events"):
            P.diagnose(tmp_path / name)
    only_kernels = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 5}]}
    assert P.diagnose(only_kernels).evidence["steps"] == 1  # odd but readable: no crash
    untimed = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": "soon"}]}
    with pytest.raises(LabkitError, match="no timed events"):
        P.diagnose(untimed)
    (tmp_path / "blank.json").write_text("")
    with pytest.raises(LabkitError):
        P.diagnose(tmp_path / "blank.json")
    with pytest.raises(LabkitError, match="needs a Profile"):
        P.diagnose(42)


def test_cli_reports_a_bad_trace_in_one_line(tmp_path, capsys):
    assert cli_main(["profile", "--trace", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no trace file" in err[0]


# -------------------------------------------------------------------------------------- real CPU runs


def test_cpu_scenarios_are_diagnosed_as_planted(one_thread):
    got = {}
    # Six recorded steps, not three, so one descheduled moment on a shared 2-core machine weighs less in a share.
    sched = P.ProfileSchedule(wait=1, warmup=1, active=6)
    for name in ("data", "compute", "overhead"):
        for fixed in (False, True):
            if name == "overhead" and fixed:
                continue
            wl = S.workload(name, "cpu", fixed=fixed, quick=True)
            got[(name, fixed)] = P.profile_steps(wl, "cpu", schedule=sched).diagnose()
    assert got[("data", False)].kind == "data", str(got[("data", False)])
    assert got[("data", True)].kind != "data", str(got[("data", True)])
    assert got[("data", False)].evidence["data_share"] > got[("data", True)].evidence["data_share"] + 0.2
    assert got[("compute", False)].kind == "compute", str(got[("compute", False)])
    # Overhead on a CPU is a best effort (timings of microsecond operators on a shared machine), so compare:
    assert got[("overhead", False)].evidence["small_op_share"] > got[("compute", False)].evidence["small_op_share"]


def test_sync_scenario_counts_host_reads_on_cpu(one_thread):
    d = P.profile_steps(S.workload("sync", "cpu", quick=True), "cpu").diagnose()
    batch = S.scenario_config("sync", quick=True).batch
    assert d.evidence["host_reads_per_step"] == batch + 1  # one per sample, plus loss.item()
    assert d.kind != "sync" and any("host reads per step" in n for n in d.notes)
    fixed = P.profile_steps(S.workload("sync", "cpu", fixed=True, quick=True), "cpu").diagnose()
    assert fixed.evidence["host_reads_per_step"] == 0


def test_fixed_loader_feeds_the_same_images():
    # The fix must compute the same thing: without augmentation both loaders give identical batches.
    base = S.with_changes(S.scenario_config("data", quick=True), augment=False, n_samples=64, batch=8)
    slow, fast = S.Workload(base, "cpu"), S.Workload(S.with_changes(base, loader="batched"), "cpu")
    idx = torch.arange(8)
    assert torch.equal(slow._per_sample(idx), fast._batched(idx))
    slow.step()
    s = slow.summary()
    assert s["steps"] == 1 and s["samples"] == 8 and np.isfinite(s["mean_loss"])


def test_profile_steps_on_the_train_engine_writes_a_readable_trace(tmp_path, one_thread):
    from labkit import train as T

    cfg = T.TrainConfig(name="tiny", width=4, batch_size=16, n_test=16, loader="resident", workers=0)
    sched = P.ProfileSchedule(wait=1, warmup=1, active=2)
    prof = P.profile_steps(cfg, "cpu", schedule=sched, out=tmp_path)
    assert prof.trace_path.exists() and prof.trace_path.name == "tiny.pt.trace.json.gz"
    assert (tmp_path / "tiny.keyavg.txt").read_text().strip() and "Name" in prof.table
    trace = P.load_trace(prof.trace_path)
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert len(steps) == sched.active
    d = P.diagnose(prof.trace_path)
    assert d.kind == P.diagnose(prof).kind
    for phase in ("data", "forward", "backward", "optimizer"):
        assert d.evidence["phase_share"][phase] > 0, phase
    assert "fix:" in str(d) and d.to_dict()["evidence"]["steps"] == 2


def test_profile_steps_takes_a_plain_step_function():
    from torch.profiler import record_function

    w = torch.randn(64, 64, requires_grad=True)

    def step():
        with record_function("data"):
            x = torch.randn(32, 64)
        with record_function("forward"):
            loss = (x @ w).square().mean()
        with record_function("backward"):
            loss.backward()

    prof = P.profile_steps(step, "cpu", schedule=P.ProfileSchedule(0, 1, 2))
    assert prof.name == "step" and prof.diagnose().evidence["steps"] == 2
    with pytest.raises(LabkitError, match="active >= 1"):
        P.profile_steps(step, "cpu", schedule=P.ProfileSchedule(1, 1, 0))
    with pytest.raises(LabkitError, match="step function"):
        P.profile_steps(42, "cpu")


def test_suggest_schedule_waits_for_compile():
    from labkit import train as T

    assert P.suggest_schedule(T.TrainConfig(compile="default"), "cpu").wait >= 4
    assert P.suggest_schedule(T.TrainConfig(), "cpu").wait == 1


def test_bad_workload_configs_are_refused():
    with pytest.raises(LabkitError, match="loader"):
        S.Workload(S.WorkloadConfig(loader="disk"), "cpu")
    with pytest.raises(LabkitError, match="unknown scenario"):
        S.scenario_config("slowness")
    with pytest.raises(LabkitError, match="unknown WorkloadConfig"):
        S.with_changes(S.WorkloadConfig(), batchsize=3)


# ------------------------------------------------------------------------------------ Python profilers


def test_cprofile_and_line_profile_point_at_the_slow_loader(one_thread):
    # width 256, not the scenario's quick 512: at 512 the slow loader's line took 36-50% of a CPU step over two
    # steps, a coin toss against the 0.4 once asked; the claim here is about the profilers, not the scenario's sizes
    wl = S.Workload(S.with_changes(S.scenario_config("data", quick=True), batch=32, n_samples=256, width=256), "cpu")
    rep = P.cprofile(wl.step)
    assert any("_per_sample" in r["function"] for r in rep.rows[:6]), rep.text
    lines = P.line_profile(lambda: [wl.step() for _ in range(4)], functions=[S.Workload.step])
    top = lines.rows[0]  # the loader's line first, well clear of the next (about half the step against a sixth)
    assert "next_batch" in top["code"] and top["share"] > 0.35 and top["share"] > 1.5 * lines.rows[1]["share"], \
        lines.text
    assert top["hits"] == 4 and abs(sum(r["share"] for r in lines.rows) - 1) < 1e-6


def _leave_a_resident_hole_in_the_heap():
    # What a few training runs leave behind: glibc serves mid-sized arrays from its heap once a freed large one
    # has raised its mmap threshold, and a live block above them keeps their freed pages resident.
    big = np.ones(30 * 2**20, dtype=np.uint8)
    del big
    held = [np.ones(20 * 2**20, dtype=np.uint8) for _ in range(5)]
    pin = np.ones(2**20, dtype=np.uint8)
    del held
    return pin


def test_memory_profilers_see_a_big_allocation():
    def allocate():
        a = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, every page touched
        time.sleep(0.2)  # held long enough for the sampler (another process, every 5 ms) to see it
        return int(a[::4096].sum())

    pin = _leave_a_resident_hole_in_the_heap()
    m = P.memory_usage(allocate, interval=0.005)
    assert m["result"] == 64 * 2**20 // 4096 and m["peak_mib"] - m["start_mib"] > 32, m
    pin = _leave_a_resident_hole_in_the_heap()  # without the trim inside, the 64 MiB reuses the hole: 0 MiB
    lines = P.memory_lines(allocate)
    assert max(r["increment_mib"] for r in lines.rows) > 32, lines.text
    assert any("np.ones" in r["code"] for r in lines.rows)
    del pin


def test_py_spy_finds_the_hot_function():
    if P.py_spy_path() is None:
        pytest.skip("py-spy not installed (optional: pip install 'labkit[profiling]')")
    prog = "def hot_loop():\n    s = 0\n    for i in range(6_000_000):\n        s += i\n    return s\nhot_loop()\n"
    res = P.py_spy_top([sys.executable, "-c", prog], rate=200)
    if res is None:
        pytest.skip("py-spy may not trace here (ptrace permissions)")
    assert res["samples"] > 10 and res["inclusive"]
    assert any("hot_loop" in f for f, _ in res["self"][:3]), res
    inside = P.py_spy_top([sys.executable, "-c", prog], rate=200, within="hot_loop")
    assert inside["self"][0][0].startswith("hot_loop") and inside["self"][0][1] > 0.9, inside


def test_gpu_only_tools_say_so_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert P.cuda_memory_snapshot(lambda: None, tmp_path / "snap.pickle") is None
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "snap.pickle").exists()


# -------------------------------------------------------------------------------------- CLI, benchmark


def test_cli_profiles_a_scenario(tmp_path, capsys, one_thread):
    assert cli_main(["profile", "--scenario", "compute", "--quick", "--device", "cpu", "--out", str(tmp_path),
                     "--active", "2"]) == 0
    out = capsys.readouterr().out
    assert "compute bound" in out and "fix:" in out
    diag = json.loads((tmp_path / "compute-slow.diagnosis.json").read_text())
    assert diag["kind"] == "compute" and diag["evidence"]["steps"] == 2
    assert cli_main(["profile", "--trace", str(tmp_path / "compute-slow.pt.trace.json.gz")]) == 0
    assert cli_main(["profile", "--list"]) == 0
    assert cli_main(["profile", "--fixed"]) == 2
    assert cli_main(["profile", "--scenario", "nope", "--device", "cpu"]) == 2


def test_week5_benchmark_runs_quick_on_cpu(tmp_path):
    trace = tmp_path / "trace.json.gz"
    r = subprocess.run([sys.executable, "benchmarks/week5_profiling.py", "--quick", "--device", "cpu",
                        "--out", str(tmp_path), "--scenarios", "data", "--rungs", "baseline", "--rounds", "2",
                        "--trace-out", str(trace), "--trace-from", "data-fixed"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "week5_profiling.json").read_text())
    assert res["env"]["device_type"] == "cpu" and res["quick"] is True
    assert res["scenarios"]["data"]["slow"]["kind"] == "data"
    assert res["scenarios"]["data"]["speedup"] > 1
    assert res["rungs"]["baseline"]["kind"] in P.KINDS
    assert res["line_profiler_item"]["rows"]
    meta = P.load_trace(trace)["labkit"]
    assert meta["scenario"] == "data-fixed" and meta["planted"] is None
    assert meta["diagnosed"] == res["scenarios"]["data"]["fixed"]["kind"]

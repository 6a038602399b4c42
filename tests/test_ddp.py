"""DistributedDataParallel through torchrun, on CPU with gloo: N processes optimize what one process would."""

import json

import pytest

from labkit import ddp
from labkit import train as T
from labkit.env import LabkitError

SETS = ["width=8", "n_train=512", "n_test=128", "epochs=1", "batch_size=64", "augment=false", "lr=0.02",
        "max_steps=4", "loader=resident", "channels_last=false", "optimizer=sgd", "precision=default"]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """The record of a 2-process run on this machine with SETS + `extra`, launched once per module (seconds each)."""
    runs = {}

    def run(extra: list[str]) -> dict:
        if tuple(extra) not in runs:
            out = tmp_path_factory.mktemp("ddp") / "ddp.json"
            assert ddp.launch("resident_data", 2, quick=True, sets=SETS + extra, json_path=str(out), cpu=True,
                              timeout_s=600) == 0
            runs[tuple(extra)] = json.loads(out.read_text())
        return runs[tuple(extra)]

    return run


# Muon orthogonalizes the averaged gradient, which every rank holds after the all-reduce: its steps stay in step.
@pytest.mark.parametrize("optimizer", [[], ["optimizer=muon", "lr=0.004"]], ids=["sgd", "muon"])
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(two_process_run, optimizer):
    sets = SETS + optimizer
    rec = two_process_run(optimizer)
    assert rec["processes"] == 2 and rec["images"] == 4 * 64  # the global batch, not per rank
    assert rec["config"]["optimizer"] == (optimizer[0].split("=")[1] if optimizer else "sgd")
    one = T.train(T.with_changes(T.preset("resident_data", T.quick_base()), **T.parse_sets(sets)), "cpu")
    assert one["processes"] == 1
    # Same data, same init, gradients averaged over ranks: only BatchNorm's per-rank batch statistics
    # (32 images per rank instead of 64) separate the two, so the losses agree to well under 3%.
    for a, b in zip(rec["losses"], one["losses"], strict=True):
        assert abs(a - b) / b < 0.03
    assert rec["losses"] != one["losses"]  # two processes really ran (BN statistics differ)


def test_broadcasting_bn_statistics_changes_nothing_rank_zero_trains_or_reports(two_process_run):
    """DDP runs default to no buffer broadcast (a collective less per step, ddp_scaling_own_bn.json). In training
    mode BatchNorm normalizes with the batch's statistics, and rank 0's running statistics are its own either way,
    so rank 0, which evaluates and reports, computes exactly the same run."""
    assert T.TrainConfig().ddp_broadcast_buffers is False
    plain, broadcast = two_process_run([]), two_process_run(["ddp_broadcast_buffers=true"])
    assert broadcast["config"]["ddp_broadcast_buffers"] and not plain["config"]["ddp_broadcast_buffers"]
    assert plain["losses"] == broadcast["losses"] and plain["accuracy"] == broadcast["accuracy"]


def test_scaling_alternates_one_and_n_processes_with_the_same_per_process_batch(tmp_path, capsys):
    from labkit.cli import main

    out = tmp_path / "scaling.json"
    assert main(["ddp", "--scaling", "--cpu", "--quick", "--preset", "resident_data", "--nproc", "2",
                 "--set", *SETS, "--json", str(out)]) == 0
    assert "scaling efficiency 1 -> 2: weak" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["kind"] == "ddp_scaling" and r["env"]["command"]
    runs = r["runs"]
    assert [x["processes"] for x in runs] == [1, 2, 1, 2, 2] and [x["scaling"] for x in runs][-1] == "strong"
    one, two, strong = runs[0], runs[1], runs[-1]
    assert two["global_batch"] == 2 * one["global_batch"] == 128 and strong["global_batch"] == 64
    assert one["steps"] == two["steps"] == 4 and two["images"] == 2 * one["images"]  # weak: twice the work per step
    weak = sorted(x["img_per_s"] for x in runs if x["processes"] == 2 and x["scaling"] == "weak")
    assert r["weak_efficiency"] == pytest.approx(sum(weak) / 2 / (2 * r["img_per_s"]["1"]))
    assert r["strong_efficiency"] == pytest.approx(strong["img_per_s"] / (2 * r["img_per_s"]["1"]))


def test_scaling_variants_share_the_one_process_runs_and_a_broken_one_is_reported():
    seen = []
    r = ddp.scaling("resident_data", 2, repeats=1, strong=False, quick=True, sets=SETS, cpu=True,
                    variants={"bf16 grads": ["ddp_bf16_grads=true", "env.OMP_NUM_THREADS=2"],
                              "no bucket": ["ddp_bucket_mb=0"]}, on_run=lambda runs: seen.append(len(runs)))
    runs = r["runs"]
    assert [(x["processes"], x.get("variant")) for x in runs] == [(1, None), (2, None), (2, "bf16 grads")]
    assert seen == [1, 2, 3]  # the caller heard of every finished run, in time to save it
    # every rank reports its own epochs, CPU set and threads; the variant's environment reached each worker
    assert [k["rank"] for k in runs[1]["ranks"]] == [0, 1] and all(k["epoch_s"] and k["cpus"] for k in runs[1]["ranks"])
    assert all(k["omp_num_threads"] == "2" and k["torch_threads"] == 2 for k in runs[2]["ranks"])
    assert r["weak_efficiency_rounds"] == [pytest.approx(runs[1]["img_per_s"] / (2 * runs[0]["img_per_s"]))]
    assert "failed" in r["variants"]["no bucket"]["error"]  # its run exited with the config error; no number
    v = r["variants"]["bf16 grads"]
    assert v["changes"] == ["ddp_bf16_grads=true", "env.OMP_NUM_THREADS=2"]
    assert v["weak_efficiency"] == pytest.approx(runs[2]["img_per_s"] / (2 * runs[0]["img_per_s"]))
    # Gradients averaged in bf16 instead of fp32 (8 bits of mantissa): the same optimization to about 1%.
    assert runs[2]["final_loss"] == pytest.approx(runs[1]["final_loss"], rel=0.02)
    with pytest.raises(LabkitError, match="unknown"):
        ddp.scaling("resident_data", 2, cpu=True, quick=True, variants={"typo": ["ddp_bucket=5"]})


def test_variant_changes_reach_the_launcher_and_bad_ones_fail_before_any_process(monkeypatch):
    sets, env, flags = ddp.split_changes(["ddp_bucket_mb=50", "env.NCCL_ALGO=Ring", "launch.numa_binding=node"])
    assert (sets, env, flags) == (["ddp_bucket_mb=50"], {"NCCL_ALGO": "Ring"}, ["--numa-binding=node"])
    assert ddp.parse_variant("numa:launch.numa_binding=socket") == ("numa", ["launch.numa_binding=socket"])
    for bad, match in [("env.omp=1", "upper case"), ("launch.cpus=0-3", "numa_binding"),
                       ("launch.numa_binding=all", "numa_binding"), ("ddp_bucket=5", "unknown"),
                       ("env.OMP_NUM_THREADS", "FIELD=VALUE")]:
        with pytest.raises(LabkitError, match=match):
            ddp.parse_variant(f"x:{bad}")
    monkeypatch.setattr(ddp, "launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(LabkitError, match="needs GPUs"):  # binding to a GPU's CPUs means nothing on a CPU run
        ddp.scaling("resident_data", 2, cpu=True, quick=True, variants={"numa": ["launch.numa_binding=node"]})


def test_ddp_scaling_saves_each_finished_run_before_the_next(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ddp_scaling

    def cut_short(preset, nproc, on_run=None, **kw):
        on_run([{"processes": 1, "img_per_s": 100.0, "round": 0}])
        raise KeyboardInterrupt  # the call's time ran out
    monkeypatch.setattr(ddp_scaling.ddp, "scaling", cut_short)
    with pytest.raises(KeyboardInterrupt):
        ddp_scaling.main(["--cpu", "--quick", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "ddp_scaling.json").read_text())
    assert rec["complete"] is False and rec["runs"][0]["img_per_s"] == 100.0 and rec["env"]["command"]


def test_profiled_ddp_steps_leave_rank_zeros_trace_and_diagnosis(tmp_path, capfd):
    out = tmp_path / "prof"
    assert ddp.launch("resident_data", 2, quick=True, sets=SETS, cpu=True, timeout_s=600, profile_dir=str(out)) == 0
    assert "no all-reduce kernels in the trace (gloo all-reduces on the CPU)" in capfd.readouterr().out
    diag = json.loads((out / "resident_data-ddp2.diagnosis.json").read_text())
    assert diag["env"]["command"] and diag["kind"] in ("data", "overhead", "sync", "compute")
    assert diag["evidence"]["steps"] == 3  # the active steps of the schedule, on rank 0 only
    assert (out / "resident_data-ddp2.pt.trace.json.gz").stat().st_size > 0


def test_bad_ddp_requests_fail_before_starting():
    with pytest.raises(LabkitError, match="nproc"):
        ddp.launch("resident_data", 0, cpu=True)
    with pytest.raises(LabkitError, match="unknown preset"):
        ddp.launch("warp_speed", 2, cpu=True)
    with pytest.raises(LabkitError, match="unknown TrainConfig field"):
        ddp.launch("resident_data", 2, cpu=True, sets=["turbo=1"])


def test_pil_loader_is_refused_under_ddp(tmp_path, capfd):
    rc = ddp.launch("baseline", 2, quick=True, cpu=True, sets=["max_steps=1", "n_train=256"], timeout_s=600)
    assert rc != 0
    assert "use loader=resident" in capfd.readouterr().err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_meeting_through_torchrun_compute_what_one_machine_does(tmp_path, two_process_run,
                                                                            monkeypatch):
    """Two "machines" on localhost, one process each, static rendezvous: the two-process run of one machine."""
    import os
    import threading

    # the thread count the one-machine run gives each of its 2 processes, so the CPU kernels add in the same order
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or str(max(1, os.cpu_count() // 2)))
    endpoint, out, codes = f"127.0.0.1:{_free_port()}", tmp_path / "nodes.json", {}

    def node(rank):  # what `labkit ddp --nproc 1 --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT` runs
        codes[rank] = ddp.launch("resident_data", 1, quick=True, sets=SETS, json_path=str(out), cpu=True,
                                 timeout_s=300, nodes=ddp.Nodes(2, rank, endpoint))

    launchers = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]  # node 1 waits for node 0
    for t in launchers:
        t.start()
    for t in launchers:
        t.join()
    assert codes == {0: 0, 1: 0}
    a, b = json.loads(out.read_text()), two_process_run([])
    assert a["processes"] == b["processes"] == 2 and a["images"] == b["images"] == 4 * 64
    # Global rank r takes the same share of every global batch in either layout, and the all-reduce sums the
    # same two gradients: the runs agree to rounding (another shard per rank would differ by about 1e-2).
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-6) and a["accuracy"] == b["accuracy"]


@pytest.mark.parametrize(("nodes", "match"), [
    (ddp.Nodes(nnodes=2), "needs --rdzv-endpoint"),
    (ddp.Nodes(nnodes=0), "--nnodes must be >= 1"),
    (ddp.Nodes(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), r"outside 0\.\.1"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="node0"), "write HOST:PORT"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="node0:99999"), "write HOST:PORT"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="h:1", rdzv_backend="static"), "static rendezvous needs --node-rank"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="h:1", node_rank=0, rdzv_backend="c10d"), "drop --node-rank"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="h:1", rdzv_backend="etcd"), "choose c10d or static"),
    (ddp.Nodes(nnodes=2, rdzv_endpoint="h:1", rdzv_id="my job"), "one word"),
    (ddp.Nodes(rdzv_id="42"), "need --rdzv-endpoint"),
])
def test_bad_node_settings_fail_before_starting(nodes, match):
    with pytest.raises(LabkitError, match=match):
        ddp.launch("resident_data", 1, cpu=True, nodes=nodes)


def test_node_settings_become_torchruns_rendezvous_flags(capsys):
    from labkit.cli import main

    assert ddp.torchrun_args(ddp.Nodes()) == ["--standalone"]
    assert ddp.torchrun_args(ddp.Nodes(nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="77")) == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=77"]
    assert ddp.torchrun_args(ddp.Nodes(nnodes=2, node_rank=1, rdzv_endpoint="[::1]:29400"))[-1] == "--node-rank=1"
    assert main(["ddp", "--scaling", "--cpu", "--nnodes", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "--scaling compares 1 and NPROC processes on this one machine" in capsys.readouterr().err
    assert main(["ddp", "--cpu", "--nnodes", "2", "--node-rank", "1"]) == 2  # the flags reach Nodes
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in capsys.readouterr().err


def test_each_scaling_run_keeps_the_gpu_clocks_of_its_own_time_window(tmp_path, monkeypatch):
    """nvidia-smi samples the GPUs through a scaling call; every run gets the busy samples of its own window, so a
    slow run can be told apart from a throttled card (clock, power, clock-event reasons)."""
    import datetime
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ddp_scaling

    t0 = datetime.datetime(2026, 11, 27, 16, 1, 0)
    line = lambda s, gpu, mhz, util, reasons: (  # noqa: E731 - one sampler line, seconds after t0
        f"{(t0 + datetime.timedelta(seconds=s)).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {gpu}, {mhz}, 600.5, 50, "
        f"{util}, {reasons}")
    text = "\n".join([line(1, 0, 1980, 95, "0x0000000000000000"), line(1, 1, 1980, 93, "0x0000000000000000"),
                      line(2, 0, 1755, 97, "0x0000000000000004"), line(3, 0, 345, 0, "0x0000000000000001"),
                      line(9, 0, 1980, 96, "0x0000000000000000"), "2026/11/27 16:01:1"])  # cut off mid-line
    log = tmp_path / "gpus.csv"
    log.write_text(text)
    start = t0.timestamp()
    runs = [{"processes": 2, "started": start, "ended": start + 5}, {"processes": 1, "round": 0}]
    first, old = ddp_scaling.with_gpu_state(runs, log)
    assert first["gpus"] == {"0": {"samples": 2, "sm_mhz": [1755.0, 1867.5, 1980.0], "power_w": [600.5, 600.5, 600.5],
                                   "temp_c_max": 50.0, "reasons": ["0x4"]},  # idle sample left out, power cap seen
                             "1": {"samples": 1, "sm_mhz": [1980.0] * 3, "power_w": [600.5] * 3, "temp_c_max": 50.0,
                                   "reasons": []}}
    assert "gpus" not in old  # a run without a window (an old record's) stays as it was
    assert ddp_scaling.with_gpu_state(runs, None) == runs  # no sampler (a CPU run): the runs as they were


def test_the_gpu_sampler_falls_back_to_the_older_reasons_field(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ddp_scaling

    fake = tmp_path / "bin" / "nvidia-smi"  # exits at once for the new field name, samples with the old one
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncase \"$1\" in *clocks_event_reasons*) exit 2;; esac\necho sampled; exec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{__import__('os').environ['PATH']}")
    proc = ddp_scaling.start_gpu_log(tmp_path / "gpus.csv")
    assert proc is not None
    try:
        assert "clocks_throttle_reasons.active" in " ".join(proc.args)
    finally:
        proc.terminate()
        proc.wait()
    assert (tmp_path / "gpus.csv").read_text() == "sampled\n"

"""labkit.gpu_power: NVML readings of clock and power, summarized; a fake NVML stands in for a GPU."""

import time
import types

import torch

from labkit import gpu_power as GP


def fake_nvml(readings):
    """A pynvml stand-in for one 700 W card of 1,980 MHz whose readings cycle through (MHz, mW, reason bits)."""
    it = iter(readings * 10_000)
    now = {}

    def clock(h, which):
        now["r"] = next(it)
        return now["r"][0]

    return types.SimpleNamespace(
        NVML_CLOCK_SM=0, nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i), nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000, nvmlDeviceGetMaxClockInfo=lambda h, w: 1980,
        nvmlDeviceGetClockInfo=clock, nvmlDeviceGetPowerUsage=lambda h: now["r"][1],
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: now["r"][2])


def test_summary_takes_medians_and_the_share_of_readings_with_each_slowing_reason():
    # (seconds, SM MHz, W, reason bits): power cap 0x4 in two of four, thermal 0x20 in one; idle (0x1) is no reason
    samples = [(0, 1600, 699.0, 0x4), (0, 1700, 690.0, 0x4 | 0x1), (0, 1800, 500.0, 0x20), (0, 1980, 100.0, 0x1)]
    s = GP.summary(samples, 700.0)
    assert s["samples"] == 4 and s["sm_clock_mhz"] == 1750 and s["power_w"] == 595.0 and s["at_limit"] == 0.5
    assert s["reasons"] == {"power cap": 0.5, "thermal (software)": 0.25}
    assert GP.summary([], 700.0) == {} and GP.summary(samples, None)["at_limit"] is None
    assert GP.describe(None) == "" and GP.describe({"samples": 0}) == ""


def test_a_meter_reads_on_a_thread_only_inside_its_blocks_and_reports_against_the_card(monkeypatch):
    nv = fake_nvml([(1680, 693_000, 0x4), (1650, 695_000, 0x4)])
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nv)
    meter = GP.Meter.open(torch.device("cuda", 0), every_s=0.002)
    assert meter is not None and meter.card == {"power_limit_w": 700.0, "max_sm_clock_mhz": 1980}
    with meter.reading() as r:
        time.sleep(0.1)
    n = len(meter.samples)
    assert n >= 5 and r.samples == meter.samples
    time.sleep(0.05)
    assert len(meter.samples) == n  # nothing read between blocks
    rep = meter.report()
    assert rep["power_limit_w"] == 700.0 and rep["reasons"] == {"power cap": 1.0} and rep["at_limit"] == 1.0
    assert 1650 <= rep["sm_clock_mhz"] <= 1680
    text = GP.describe(rep)
    assert "/1,980 MHz, " in text and text.endswith("/700 W, power cap 100%"), text


def test_no_meter_without_a_cuda_device_or_nvml_and_a_failing_nvml_keeps_its_readings(monkeypatch):
    import sys
    assert GP.Meter.open(torch.device("cpu")) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert GP.Meter.open(torch.device("cuda", 0)) is None
    broken = fake_nvml([(1980, 100_000, 0)])
    broken.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert GP.Meter.open(torch.device("cuda", 0)) is None
    # NVML failing mid-run: the block ends normally with what was read before
    flaky = fake_nvml([(1980, 100_000, 0)] * 3)
    monkeypatch.setitem(sys.modules, "pynvml", flaky)
    meter = GP.Meter.open(torch.device("cuda", 0), every_s=0.002)
    calls = {"n": 0}
    real = meter.read

    def read():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("GPU is lost")
        return real()
    meter.read = read
    with meter.reading():
        time.sleep(0.05)
    assert len(meter.samples) == 3


def test_cuda_visible_devices_maps_a_cuda_index_to_nvmls(monkeypatch):
    nv = fake_nvml([(1980, 1, 0)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert GP._handle(nv, 0) == ("index", 3) and GP._handle(nv, 1) == ("uuid", "GPU-abc")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert GP._handle(nv, 1) == ("index", 1)


def test_training_records_the_steady_epochs_readings_and_none_without_a_meter(monkeypatch):
    """labkit.train: gpu_power is None on a CPU; with a meter, readings are taken in the epochs after the first
    (the steady epochs img_per_s counts), and the ladder's result line names clock and power."""
    from labkit import data as D
    from labkit import train as T

    ds = D.synthetic_cifar(1024, 128, seed=0, cache=False)
    cfg = T.TrainConfig(width=4, n_train=512, n_test=128, epochs=2, batch_size=64, augment=False, workers=0)
    assert T.train(cfg, "cpu", dataset=ds)["gpu_power"] is None
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml([(1680, 693_000, 0x4)]))
    opened = []

    def open_meter(dev, every_s=0.02):
        m = GP.Meter(__import__("sys").modules["pynvml"], ("index", 0), 0.001)
        real = m.reading

        def reading():
            opened.append(len(m.samples))
            return real()
        m.reading = reading
        return m
    monkeypatch.setattr(GP.Meter, "open", staticmethod(open_meter))
    rec = T.train(cfg, "cpu", dataset=ds)
    assert opened == [0]  # one block: the second epoch's, none in the first
    p = rec["gpu_power"]
    assert p["samples"] > 0 and p["sm_clock_mhz"] == 1680 and p["power_limit_w"] == 700.0
    assert GP.describe(p) == "1,680/1,980 MHz, 693/700 W, power cap 100%"


CORPUS = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "diagnosis" / "trace_corpus"
CAPPED = {"power_limit_w": 700.0, "max_sm_clock_mhz": 1980, "samples": 60, "sm_clock_mhz": 1470, "power_w": 693.0,
          "at_limit": 1.0, "reasons": {"power cap": 1.0}}


def _with_power(name: str, power) -> dict:
    from labkit.diagnosis import load_trace
    trace = load_trace(CORPUS / f"{name}.pt.trace.json.gz")
    trace["labkit"] = {**(trace.get("labkit") or {}), "gpu_power": power}
    return trace


def test_diagnosis_names_the_power_limit_where_the_readings_show_it_and_only_there():
    """A compute-bound GPU trace with readings at the power limit: the compute evidence names them and the fix
    says what still pays; below the limit, with no readings, or with readings that are not labkit's, nothing
    is claimed; where another cause ranks first the limit is a note."""
    from labkit import diagnosis as D

    plain = D.diagnose(_with_power("big_matmul", None))
    assert plain.kind == "compute" and "power limit" not in str(plain)
    d = D.diagnose(_with_power("big_matmul", CAPPED))
    assert d.kind == "compute"
    assert d.causes[0]["evidence"].endswith("; the card ran at its power limit (1,470/1,980 MHz, 693/700 W, power cap 100%)")
    assert d.fix.endswith(D.POWER_FIX) and d.fix.startswith(plain.fix)
    below = {**CAPPED, "sm_clock_mhz": 1980, "power_w": 400.0, "at_limit": 0.0, "reasons": {}}
    assert "power limit" not in str(D.diagnose(_with_power("big_matmul", below)))
    for junk in ({"reasons": {"power cap": 1.0}}, {**CAPPED, "power_w": "693"}, "capped", {**CAPPED, "reasons": [1]},
                 {**CAPPED, "reasons": {"power cap": "all"}}):
        assert "power limit" not in str(D.diagnose(_with_power("big_matmul", junk))), junk
    other = D.diagnose(_with_power("small_batch_mlp", CAPPED))
    assert other.kind != "compute"
    assert any(n.startswith("the card ran at its power limit (1,470/1,980 MHz") for n in other.notes)


def test_profile_steps_reads_the_card_over_the_active_steps_only(monkeypatch):
    """labkit.profiling: the readings start once the wait and warm-up steps are done, stop with the run, and land
    in the trace (labkit.gpu_power) where diagnose finds them; without a meter there are none."""
    import sys

    from labkit import profiling as PR

    nv = fake_nvml([(1470, 693_000, 0x4)])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    done, started = [], []

    def open_meter(dev, every_s=0.02):
        m = GP.Meter(nv, ("index", 0), 0.001)
        real = m.reading

        def reading():
            started.append(len(done))
            return real()
        m.reading = reading
        return m

    def step():
        done.append(1)
        time.sleep(0.01)

    sched = PR.ProfileSchedule(wait=2, warmup=1, active=3)
    assert PR.profile_steps(step, "cpu", schedule=sched).trace["labkit"]["gpu_power"] is None
    monkeypatch.setattr(GP.Meter, "open", staticmethod(open_meter))
    done.clear()
    prof = PR.profile_steps(step, "cpu", schedule=sched)
    assert started == [3]  # after wait + warm-up, before the first active step
    p = prof.trace["labkit"]["gpu_power"]
    assert p["samples"] > 0 and p["reasons"] == {"power cap": 1.0} and p["sm_clock_mhz"] == 1470
    started.clear()
    done.clear()
    import warnings
    with warnings.catch_warnings():  # torch.profiler warns that a schedule without warm-up skews its results
        warnings.simplefilter("ignore", UserWarning)
        PR.profile_steps(step, "cpu", schedule=PR.ProfileSchedule(wait=0, warmup=0, active=2))
    assert started == [0]


def test_profiling_a_training_config_reads_the_card_with_one_meter(monkeypatch):
    """profile_steps on a TrainConfig: train leaves the readings to the profiler's meter (read_power=False), so one
    NVML thread runs beside the profiled steps, not two."""
    import sys

    from labkit import data as D
    from labkit import profiling as PR
    from labkit import train as T

    nv = fake_nvml([(1470, 693_000, 0x4)])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    opened = []

    def open_meter(dev, every_s=0.02):
        opened.append(dev)
        return GP.Meter(nv, ("index", 0), 0.001)
    monkeypatch.setattr(GP.Meter, "open", staticmethod(open_meter))
    ds = D.synthetic_cifar(512, 64, seed=0, cache=False)
    cfg = T.TrainConfig(width=4, n_train=256, n_test=64, epochs=1, batch_size=32, augment=False, workers=0)
    prof = PR.profile_steps(cfg, "cpu", schedule=PR.ProfileSchedule(wait=1, warmup=1, active=2), dataset=ds)
    assert len(opened) == 1 and prof.trace["labkit"]["gpu_power"]["samples"] > 0

"""labkit.waves: the tile-and-wave model, datasheet peaks, tile sizes from kernel names, the sweep on CPU and the
week-2 benchmark's --waves mode."""

import importlib.util
import json

import pytest

from labkit import waves as wv
from labkit.env import REPO_ROOT, LabkitError


def test_tile_and_wave_model_on_an_h100():
    r = wv.tile_waves(8192, 8192, 132)
    assert (r["tiles"], r["waves"]) == (64 * 64, 32)  # 4096 tiles: 31 full waves and 4 tiles left over
    assert r["last_wave"] == pytest.approx(4 / 132) and r["tile_efficiency"] == 1.0
    assert r["efficiency"] == pytest.approx(4096 / (32 * 132))
    past = wv.tile_waves(8200, 8200, 132)  # one more row of tiles: 65 x 65, and a 33rd wave
    assert (past["tiles"], past["waves"]) == (65 * 65, 33) and past["efficiency"] < r["efficiency"]
    assert wv.tile_waves(8191, 8191, 132)["waves"] == 32  # the model cannot see misalignment
    assert wv.tile_waves(8448, 8448, 132)["efficiency"] == 1.0  # 66 x 66 tiles = 33 full waves
    assert wv.tile_waves(100, 300, 4, tile=(64, 128))["tiles"] == 2 * 3
    with pytest.raises(LabkitError, match="positive"):
        wv.tile_waves(8192, 8192, 0)


def test_wave_sizes_bracket_the_center():
    sizes = wv.wave_sizes(8192, 128, 4)
    assert sizes[0] == 7680 and sizes[-1] == 8704 and {8191, 8192, 8193, 8200} <= set(sizes)
    assert sizes == sorted(set(sizes)) and len(sizes) == 17 + 3
    with pytest.raises(LabkitError, match="center"):
        wv.wave_sizes(100, 128, 4)


@pytest.mark.parametrize("name,card", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                       ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-40GB", "A100"),
                                       ("NVIDIA L4", "L4"), ("Tesla T4", "T4"), ("NVIDIA L40S", None),
                                       ("NVIDIA H100 NVL", None), ("CPU (x86_64, 2 cores)", None)])
def test_datasheet_lookup(name, card):
    d = wv.datasheet(name)
    assert (d and d["card"]) == card
    if d:
        t = d["tflops"]
        assert t["fp32"] < (t["bf16"] or t["fp16"]) and d["sms"] > 0
        assert t["bf16"] is None or t["fp16"] == t["bf16"]


def test_datasheet_peak():
    assert wv.datasheet_peak("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(2 * wv.datasheet_peak("NVIDIA H100 80GB HBM3"), rel=1e-3)
    assert wv.datasheet_peak("Tesla T4", "bf16") is None and wv.datasheet_peak("cpu") is None
    with pytest.raises(LabkitError, match="unknown matmul kind"):
        wv.datasheet_peak("NVIDIA L4", "int8")


@pytest.mark.parametrize("name,tile", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", (256, 128)),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x256x32_warpgroupsize2x1x1_execute", (128, 256)),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)", (64, 64)),
    ("ampere_sgemm_128x64_nn", (128, 64)),
    ("aten::mm", None),
])
def test_kernel_tile_from_names(name, tile):
    assert wv.kernel_tile(name) == tile


def test_sweep_on_cpu_and_its_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert wv.sm_count("cpu") is None
    with pytest.raises(LabkitError, match="no SM count"):
        wv.wave_sweep([32], "fp32", "cpu", measure=False)
    with pytest.raises(LabkitError, match="unknown matmul kind"):
        wv.wave_sweep([32], "int8", "cpu", sms=4, measure=False)
    predicted = wv.wave_sweep([8191, 8192, 8200], "bf16", "cpu", sms=132, measure=False)
    assert [r["waves"] for r in predicted] == [32, 32, 33] and all(r["tflops"] is None for r in predicted)
    rows = wv.wave_sweep([30, 32, 34], "fp32", "cpu", sms=4, tile=(16, 16), repeats=2, progress=False)
    assert all(r["tflops"] > 0 and r["median_s"] > 0 for r in rows) and rows[2]["tiles"] == 9
    for rs in (rows, predicted):
        ax = wv.plot_wave_sweep(rs)
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend()
    assert len(wv.plot_wave_sweep(rows, model=False).get_legend().get_texts()) == 1
    plt.close("all")


def test_week2_benchmark_waves_mode_quick(tmp_results):
    spec = importlib.util.spec_from_file_location("week2_matmul", REPO_ROOT / "benchmarks" / "week2_matmul.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--waves", "--quick", "--out", str(tmp_results), "--device", "cpu", "--repeats", "2"]) == 0
    rec = json.loads((tmp_results / "week2_waves.json").read_text())
    assert not (tmp_results / "week2_matmul.json").exists()
    assert rec["name"] == "week2_waves" and rec["quick"] is True and rec["kind"] == "bf16"
    assert rec["sms"] == 132 and rec["sms_from_device"] is False and rec["datasheet"] is None
    assert [r["n"] for r in rec["rows"]] == rec["sizes"] and all(r["tflops"] > 0 for r in rec["rows"])
    assert set(rec["kernels"]) == {"63", "64", "66"} and rec["checks"]["ratio_aligned_over_misaligned"] > 0
    # A recorded GPU sweep is not replaced by a quick run into the default folder.
    (tmp_results / "week2_waves.json").write_text(json.dumps({"name": "week2_waves", "quick": False}))
    script.RESULTS_DIR = tmp_results
    assert script.main(["--waves", "--quick", "--device", "cpu"]) == 2

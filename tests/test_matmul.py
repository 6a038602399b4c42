"""labkit.matmul on CPU: the arithmetic, each kind's product, well-formed tiny benchmark tables, kernel flags,
the CLI and the week-2 benchmark script in quick mode."""

import importlib.util
import json

import pytest
import torch

from labkit import matmul as mm
from labkit.cli import main as cli_main
from labkit.env import REPO_ROOT, LabkitError

ROW_KEYS = {"kind", "m", "n", "k", "device", "median_s", "iqr_s", "tflops", "tflops_best", "intensity", "note"}


def test_flops_intensity_roofline_and_padding():
    assert mm.matmul_flops(2, 3, 4) == 48
    assert mm.arithmetic_intensity(8192, 8192, 8192, "bf16") == pytest.approx(8192 / 3)
    assert mm.arithmetic_intensity(8192, 8192, 8192, "fp32") == pytest.approx(8192 / 6)
    # fp8 reads 1-byte inputs but writes a 2-byte (bf16) output.
    assert mm.arithmetic_intensity(64, 64, 64, "fp8") == pytest.approx(2 * 64**3 / (64 * 64 * 4))
    assert mm.roofline(10.0, 1e15, 1e12) == 1e13 and mm.roofline(1e4, 1e15, 1e12) == 1e15
    assert mm.pad_to_multiple(8191) == 8192 and mm.pad_to_multiple(8192) == 8192 and mm.pad_to_multiple(1, 16) == 16
    with pytest.raises(LabkitError, match="unknown matmul kind"):
        mm.arithmetic_intensity(1, 1, 1, "int4")


@pytest.mark.parametrize("kind,tol", [("fp32", 1e-5), ("tf32", 1e-5), ("fp16", 3e-3), ("bf16", 2e-2),
                                      ("fp8", 0.1)])
def test_each_kind_computes_the_product_of_its_operands(kind, tol):
    m, n, k = 32, 48, 64
    out = mm.make_matmul(kind, m, n, k, device="cpu", seed=3)()
    g = torch.Generator().manual_seed(3)
    a, bt = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ref = a.double() @ bt.double().t()
    assert out.shape == (m, n)
    assert float((out.double() - ref).norm() / ref.norm()) < tol


def test_make_matmul_rejects_bad_shapes():
    with pytest.raises(LabkitError, match="multiple of 16"):
        mm.make_matmul("fp8", 8191, device="cpu")
    with pytest.raises(LabkitError, match="positive"):
        mm.make_matmul("bf16", 0, device="cpu")
    with pytest.raises(LabkitError, match="unknown matmul kind"):
        mm.make_matmul("fp64", 16, device="cpu")


def test_tf32_switches_are_scoped():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    with mm.tf32():
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
        with mm.strict_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before


def test_tiny_grid_table_is_well_formed():
    rows = mm.matmul_grid(tuple(mm.KINDS), [32, 31], "cpu", warmup=1, repeats=2, progress=False)
    assert [(r["kind"], r["m"]) for r in rows] == [(k, s) for k in mm.KINDS for s in (32, 31)]
    for r in rows:
        assert set(r) == ROW_KEYS and r["note"]
        if r["kind"] == "fp8" and r["m"] == 31:
            assert r["tflops"] is None and "multiples of 16" in r["note"]
        elif mm.kind_support(r["kind"], "cpu")[0]:
            assert r["tflops"] > 0 and r["median_s"] > 0 and r["tflops_best"] >= r["tflops"]
            assert r["tflops"] == pytest.approx(mm.matmul_flops(r["m"], r["n"], r["k"]) / r["median_s"] / 1e12)
    table = mm.grid_table(rows)
    assert all(k in table for k in mm.KINDS) and "32x32x32" in table and "TFLOP/s" in table
    json.dumps(rows)  # results files take the rows as they are


def test_compare_matmuls_reports_consistent_ratios():
    r = mm.compare_matmuls(("fp32", 31, 31, 31), ("fp32", 32, 32, 32), "cpu", rounds=3, warmup=1)
    assert r["rounds"] == 3 and r["time_ratio"] > 0
    lo, hi = r["time_ratio_range"]
    assert lo <= r["time_ratio"] <= hi
    assert r["throughput_ratio"] == pytest.approx(r["time_ratio"] * 32**3 / 31**3)


def test_bandwidth_and_roofline_points():
    bw = mm.measure_copy_bandwidth("cpu", 1 << 22, repeats=3)
    assert bw["bytes"] == 2 * (1 << 22) and bw["bytes_per_s"] > 1e7
    pts = mm.roofline_points("bf16", [(64, 64, 16), (64, 64, 64)], "cpu", repeats=2, progress=False)
    assert [p["k"] for p in pts] == [16, 64] and pts[0]["intensity"] < pts[1]["intensity"]


def test_accuracy_follows_mantissa_width():
    err = {r["kind"]: r["relative_error"] for r in mm.accuracy_by_kind(128)}
    assert err["fp32"] == 0.0  # inputs already fp32: nothing rounded
    assert err["tf32"] == pytest.approx(err["fp16"], rel=0.2)  # same 10-bit mantissa
    assert 0 < err["tf32"] < err["bf16"] < err["fp8"] < 0.2


def test_tf32_probe_reports_exact_fp32_without_tensor_cores():
    assert mm.tf32_rounding_probe("cpu") == "exact fp32"


@pytest.mark.parametrize("name,expected", [
    ("ampere_sgemm_128x64_nn", False),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute", False),
    ("sm90_xmma_gemm_f32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_on_kernel", False),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", True),
    ("nvjet_sm90_hss_320x128_64x3_1x2_h_bz_coopB_NNT", True),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)", True),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", None),
    ("aten::mm", False),
])
def test_tensor_core_flag_from_kernel_names(name, expected):
    flag, why = mm.is_tensor_core_kernel(name)
    assert flag is expected and why


def test_kernels_ran_on_cpu_lists_the_matmul_quietly(capfd):
    rows = mm.kernels_ran(mm.make_matmul("fp32", 64, device="cpu"), "cpu")
    names = [r["name"] for r in rows]
    assert "aten::mm" in names
    mm_row = rows[names.index("aten::mm")]
    assert mm_row["calls"] == 1 and mm_row["tensor_core"] is False and mm_row["time_us"] > 0
    assert "USDT" not in capfd.readouterr().err


def test_scaled_mm_handles_the_old_tuple_api(monkeypatch):
    def old_scaled_mm(a, b, *, out_dtype=None, scale_a=None, scale_b=None):  # torch <= 2.3: no use_fast_accum
        return (a.float() @ b.float() * scale_a * scale_b).to(out_dtype), torch.tensor(0.0)

    monkeypatch.setattr(torch, "_scaled_mm", old_scaled_mm, raising=False)
    a, b = torch.ones(16, 16), torch.ones(16, 16)
    out = mm.scaled_mm(a, b, torch.tensor(2.0), torch.tensor(0.5))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and float(out[0, 0]) == 16.0
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(LabkitError, match="no torch._scaled_mm"):
        mm.scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0))
    assert mm.kind_support("fp8", "cpu")[0] is False


def test_plots_return_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"kind": "bf16", "m": 8, "n": 8, "k": 8, "tflops": 1.0, "intensity": 2.0},
            {"kind": "fp8", "m": 8, "n": 8, "k": 8, "tflops": None, "intensity": 4.0}]
    assert mm.plot_tflops(rows).get_title()
    assert mm.plot_roofline(rows[:1], peak_tflops=10.0, bandwidth=1e12).get_xscale() == "log"
    plt.close("all")


def test_cli_matmul_quick(tmp_path, capsys):
    out = tmp_path / "m.json"
    code = cli_main(["matmul", "--device", "cpu", "--size", "32", "--kinds", "fp32,bf16,fp8", "--repeats", "2",
                     "--kernels", "--roofline", "--json", str(out), "--plot", str(tmp_path / "m.png")])
    assert code == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU" in text and "copy bandwidth" in text and "aten::mm" in text
    rec = json.loads(out.read_text())
    assert [r["kind"] for r in rec["grid"]] == ["fp32", "bf16", "fp8"] and rec["env"]["device_type"] == "cpu"
    assert rec["roofline"]["peak_tflops"] > 0 and (tmp_path / "m.png").exists()
    assert cli_main(["matmul", "--kinds", "int4"]) == 2
    assert "unknown matmul kind" in capsys.readouterr().err


def _load_script():
    spec = importlib.util.spec_from_file_location("week2_matmul", REPO_ROOT / "benchmarks" / "week2_matmul.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_week2_benchmark_quick_writes_a_well_formed_result(tmp_results):
    script = _load_script()
    assert script.main(["--quick", "--out", str(tmp_results), "--device", "cpu"]) == 0
    rec = json.loads((tmp_results / "week2_matmul.json").read_text())
    assert rec["name"] == "week2_matmul" and rec["quick"] is True and rec["env"]["command"]
    assert {r["kind"] for r in rec["grid"]} == set(mm.KINDS) and all(set(r) == ROW_KEYS for r in rec["grid"])
    assert [s["kind"] for s in rec["shape_effect"]] == ["bf16", "fp16"]
    assert rec["shape_effect"][0]["misaligned"] == 127 and rec["shape_effect"][0]["throughput_ratio"] > 0
    assert rec["tf32_vs_fp32"]["time_ratio"] > 0 and "supported" in rec["fp8"]
    roof = rec["roofline"]
    assert roof["bandwidth"]["bytes_per_s"] > 0 and len(roof["points"]) == 4
    assert roof["peak_tflops"] == max(r["tflops"] for r in rec["grid"] + roof["points"]
                                      if r["kind"] == "bf16" and r["tflops"])
    assert set(rec["kernels"]["by_kind"]) == set(mm.KINDS)
    assert any(k["name"] == "aten::mm" for k in rec["kernels"]["by_kind"]["bf16"])
    assert rec["tf32_input_rounding"] == "exact fp32"
    assert rec["cast_overflow"]["float16"] == "inf"
    assert 0 < rec["checks"]["bf16_big_fraction_of_peak"] <= 1


def test_week2_benchmark_keeps_a_recorded_gpu_result(tmp_path, monkeypatch):
    script = _load_script()
    (tmp_path / "week2_matmul.json").write_text(json.dumps({"name": "week2_matmul", "quick": False}))
    monkeypatch.setattr(script, "RESULTS_DIR", tmp_path)
    assert script.main(["--quick", "--device", "cpu"]) == 2
    assert json.loads((tmp_path / "week2_matmul.json").read_text())["quick"] is False

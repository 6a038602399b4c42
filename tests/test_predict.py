"""labkit.predict, and the predict-then-measure exercises of every week."""

import ast
import json

import pytest

from labkit import predict
from labkit.env import REPO_ROOT, LabkitError


def test_numeric_predictions(capsys):
    r = predict.compare(2.0, 2.2, "time", unit="ms")
    assert r["verdict"].startswith("close") and "2.2 ms" in capsys.readouterr().out
    assert predict.compare(10, 2.0, "x", show=False)["verdict"] == "off by a factor of 5 (too high)"
    assert predict.compare(33, 33, "waves", show=False)["verdict"] == "exactly right"
    # How close, with its direction: never "1x the measurement" for a prediction that is not exact.
    assert predict.compare(2.0, 2.2, "x", show=False)["verdict"] == "close: within 25% (9% below the measurement)"
    assert predict.compare(1.0004, 1.0, "x", show=False)["verdict"] == "close: within 25% (under 1% above the measurement)"
    assert predict.compare(float("inf"), 3.0, "x", show=False)["verdict"] == "differs"
    assert predict.compare("0.5", 2.0, "x", show=False)["verdict"] == "off by a factor of 4 (too low)"
    assert predict.compare(0, 0.1, "x", close=2.0, show=False)["verdict"].startswith("close")
    assert predict.compare(-1.0, 1.0, "x", show=False)["verdict"].startswith("off by 2")
    with pytest.raises(LabkitError, match="should be a number"):
        predict.compare("fast", 2.0, "speed", show=False)


def test_words_flags_orderings_and_placeholders(capsys):
    assert predict.compare(" Delayed ", "delayed", "which", show=False)["verdict"] == "matches"
    assert predict.compare(True, False, "survives", show=False)["verdict"] == "differs"
    assert predict.compare(["a", "b"], ("A", "b"), "order", show=False)["verdict"] == "matches"
    assert predict.compare(["b", "a"], ["a", "b"], "order", show=False)["verdict"] == "differs"
    with pytest.raises(LabkitError, match="True or False"):
        predict.compare("yes", True, "survives", show=False)
    r = predict.compare(None, 3.0, "sum")
    assert r["verdict"] == "no prediction" and "write a prediction first" in capsys.readouterr().out
    assert predict.compare(1.0, None, "H100 time", show=False)["verdict"] == "not measured"


def _cells(name):
    nb = json.loads((REPO_ROOT / "notebooks" / name).read_text())
    return [("".join(c["source"]) if isinstance(c["source"], list) else c["source"], c["cell_type"])
            for c in nb["cells"]]


# each week's look-up exercises (answered by a number printed just above them), gone since predictions replaced them
GONE = {"01_float_formats.ipynb": (), "02_tensor_cores.ipynb": ("answer_2_1", "answer_2_2", "answer_2_3", "answer_2_4"),
        "03_mixed_precision.ipynb": (), "04_data_loading.ipynb": ("answer_4_1",),
        "05_profiling.ipynb": ("answer_5_1", "answer_5_3"),
        "06_resnet_ladder.ipynb": ("Self-check", "biggest_step", "peak_tflops = 783")}


@pytest.mark.parametrize("name", list(GONE))
def test_weeks_predict_before_they_measure(name):
    """At least two predictions per week, each a placeholder None that a later cell passes to predict.compare."""
    cells = _cells(name)
    placeholders = {}
    for i, (src, kind) in enumerate(cells):
        if kind != "code":
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None:
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id.startswith("prediction_"):
                        placeholders[t.id] = i
    assert len(placeholders) >= 2, placeholders
    for var, at in placeholders.items():
        later = [src for src, kind in cells[at + 1:] if kind == "code" and "predict.compare(" in src and var in src]
        assert later, f"{var} is never compared with a measurement"
    # A comparison is never a cell's last expression, where Jupyter would echo its dict under the printout.
    for src, kind in cells:
        if kind == "code" and src.strip():
            last = ast.parse(src).body[-1]
            assert not (isinstance(last, ast.Expr) and "predict.compare" in ast.unparse(last)), src[:80]
    # No exercise is answered by a number printed just above it: the old look-ups are gone.
    text = "\n".join(src for src, _ in cells)
    for gone in GONE[name]:
        assert gone not in text


@pytest.mark.parametrize("name, uses", [("03_mixed_precision.ipynb", "autocast_ops.op_dtypes("),
                                        ("04_data_loading.ipynb", "O.copy_compute_overlap(")])
def test_weeks_3_and_4_measure_their_new_sections_live(name, uses):
    """The autocast dtype table and the copy-compute overlap are computed by labkit in the notebook, not pasted."""
    assert any(kind == "code" and uses in src for src, kind in _cells(name))


def test_week_5_reads_the_trace_before_the_verdict_and_week_6_measures_the_ablation():
    """Week 5's predictions come before what they predict: the data share before the tour measures it, the
    verdict before diagnose() reveals it; week 6 predicts the regressing rung before the recorded table, and
    compares predictions with the ablation and both MFU peaks."""
    w5 = [src for src, kind in _cells("05_profiling.ipynb") if kind == "code"]
    at = lambda cells, text: next(i for i, s in enumerate(cells) if text in s)  # noqa: E731
    assert at(w5, "prediction_data_share = None") < at(w5, "trace_tour.tour(prof.trace_path)")
    assert at(w5, "prediction_kind = None") < at(w5, "diag = profiling.diagnose(prof)")
    assert at(w5, "prediction_host_reads = None") < at(w5, "diags[w.cfg.name] = profiling.profile_steps")
    assert at(w5, "prediction_graphs = None") < at(w5, "graph_breaks.explain(train_metric")
    assert any("profiling.nvtx_range(" in s and "profiling.nsys_command(" in s for s in w5)
    assert any("slow_decode_workers0" in s and "trace_tour.tour" in s for s in w5)  # a trace labkit did not make
    assert any("profiling.diagnose(plain_trace)" in s for s in w5)
    w6 = [src for src, kind in _cells("06_resnet_ladder.ipynb") if kind == "code"]
    assert at(w6, "prediction_regressing_rung = None") < at(w6, 'rec = load_result("ladder")')
    assert at(w6, "prediction_mfu_datasheet = None") < at(w6, "datasheet_peak(rec")
    assert at(w6, "prediction_costliest_here = None") < at(w6, "T.ablation_from(result")

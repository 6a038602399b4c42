"""benchmarks/stack_samples.py: a command's wall time broken down by stack samples, its exit included."""

import json

import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def ss():
    return benchmark_module("stack_samples")


def test_a_sampled_train_command_says_where_its_seconds_went(ss, tmp_path, capsys):
    args = ["train", "--quick", "--device", "cpu", "--preset", "resident_data", "--no-compile-cache",
            "--set", "max_steps=2", "width=4", "n_train=256", "n_test=64", "workers=0"]
    assert ss.main(["--name", "samples", "--out", str(tmp_path), "--", *args]) == 0
    rec = json.loads((tmp_path / "samples.json").read_text())
    assert rec["kind"] == "stack_samples" and rec["command"] == ["labkit", *args] and rec["exit_code"] == 0
    assert 0 < rec["command_returned_s"] <= rec["atexit_done_s"] < rec["wall_s"]
    # every interval is charged once: the breakdown adds up to the sampled span, labkit's own frames by name
    assert sum(rec["by_labkit_frame_s"].values()) == pytest.approx(rec["sampled_s"], abs=0.05)
    assert rec["sampled_s"] == pytest.approx(rec["atexit_done_s"], abs=0.1)
    assert any(k.startswith("labkit/train.py:") for k in rec["by_labkit_frame_s"])
    assert any(k.startswith("import: ") for k in rec["by_inner_frames_s"])  # torch's import, seen from inside
    assert "resident_data:" in rec["said"][-1] and f"wrote {tmp_path / 'samples.json'}" in capsys.readouterr().out


def test_bad_requests_fail_before_the_command_runs(ss, tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for argv, needle in [(["--out", str(blocked / "x"), "--", "train"], "cannot write"),
                         (["--name", "x"], "after --")]:
        with pytest.raises(SystemExit):
            ss.main(argv)
        assert needle in capsys.readouterr().err, argv
    assert list(tmp_path.iterdir()) == [blocked]


def test_the_breakdown_charges_each_interval_to_the_stack_that_began_it(ss):
    samples = [(0.0, ["torch/x.py:f", "labkit/train.py:train"]), (1.0, ["<frozen importlib._bootstrap>:_load",
               "torch/__init__.py:<module>", "labkit/train.py:<module>"]), (1.5, ["os.py:exit"])]
    s = ss.summarize(samples, {"command_returned_s": 1.2, "atexit_done_s": 3.5})
    assert s["by_labkit_frame_s"] == {"after the command": 2.0, "labkit/train.py:train": 1.0,
                                      "labkit/train.py:<module>": 0.5}
    assert s["by_inner_frames_s"]["import: torch/__init__.py:<module> < labkit/train.py:<module>"] == 0.5
    assert s["sampled_s"] == 3.5

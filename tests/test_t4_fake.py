"""The free Colab GPU, a Tesla T4, faked on a CPU (tests/t4_fake.py): the notebooks' hardware decisions and lab 4's
trusted checks take the T4's branches and say so.

Why not run all seven notebooks again under the fake: test_notebooks.py already runs every cell of them on the
CPU (94 s for the seven on this 2-core machine, shared), a second full run would cost as much again, and it could
not pass: week 3's training cells would train fp16 on the CPU, which labkit refuses. The fake changes only what
`labkit.env.gpu_facts` reports (tensors stay on the CPU), so a cell can behave differently under it only if it
reads a card fact. This test finds those cells by name (HARDWARE), runs them with every earlier cell they need
(found from the names they load) in one process under the fake (about 3 s on an idle 2-core machine), and asserts
on what they print; `test_every_hardware_cell_is_covered` ties the selection to the notebooks, so a new
card-reading cell is picked up. Two kinds of cell cannot run under the fake, because they need the card itself:
cells that train on DEVICE in the card's 16-bit format (AMP is fp16 here, and labkit refuses fp16 autocast on a
CPU) and the GPU branches of cells that test where tensors live (ON_GPU, DEVICE.type), which launch CUDA kernels.
For those the test checks the source: they take the format from AMP / caps["amp"], never "bf16" by name.
"""

import ast
import builtins
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import t4_fake
import torch

from labkit import env, notebooks, waves
from labkit import train as T
from labkit.env import LabkitError

ROOT = Path(__file__).resolve().parents[1]

# A cell reads a card fact when it calls one of labkit's fact functions or uses what a setup cell derived from them.
HARDWARE = re.compile(r"\b(caps|capabilities|amp_precision|native_bf16|sm_count|AMP|SMS|live_ladder_size)\b"
                      r"|\bgpu_facts\(")
# A claim of bf16 tensor cores, as opposed to "no bf16 tensor cores".
BF16_CLAIM = re.compile(r"(?<!no )(?<!without )bf16 tensor cores", re.I)


@pytest.fixture
def t4():
    with t4_fake.fake_t4() as facts:
        yield facts


def _code(path: Path) -> dict[int, str]:
    cells = json.loads(path.read_text())["cells"]
    return {i: "".join(c["source"]) for i, c in enumerate(cells) if c["cell_type"] == "code"}


def _names(src: str) -> tuple[set, set]:
    """(names a cell defines, names it loads), builtins left out."""
    defined, loaded = set(), set()
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else defined).add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(n.name)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            defined.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
    return defined, loaded - set(dir(builtins))


def hardware_cells(path: Path) -> list[int]:
    """Indices of the notebook's code cells that read a card fact."""
    return [i for i, src in _code(path).items() if HARDWARE.search(src)]


def card_compute_cells(path: Path) -> list[int]:
    """Hardware cells that compute on DEVICE in the card's 16-bit format (AMP): fp16 there needs the card itself
    (labkit refuses fp16 autocast on a CPU), so under the fake they are checked, not run."""
    code = _code(path)
    return [i for i in hardware_cells(path)
            if {"AMP", "DEVICE"} <= _names(code[i])[1] and "AMP" not in _names(code[i])[0]]


def cells_to_run(path: Path) -> list[int]:
    """The hardware cells that can run under the fake plus, transitively, the latest earlier cell defining each
    name they load."""
    code = _code(path)
    names = {i: _names(src) for i, src in code.items()}
    chosen = set(hardware_cells(path)) - set(card_compute_cells(path))
    todo = list(chosen)
    while todo:
        i = todo.pop()
        defined, loaded = names[i]
        for name in loaded - defined:
            earlier = [j for j in code if j < i and name in names[j][0]]
            if earlier and earlier[-1] not in chosen:
                chosen.add(earlier[-1])
                todo.append(earlier[-1])
    return sorted(chosen)


@pytest.fixture(scope="module")
def t4_run(tmp_path_factory):
    """Every notebook's hardware cells (and what they need), run once under the fake in a fresh process."""
    tmp = tmp_path_factory.mktemp("t4_notebooks")
    spec = {"cwd": str(tmp), "notebooks": {}}
    for path in notebooks.notebook_paths():
        code = _code(path)
        spec["notebooks"][path.stem] = [[i, code[i]] for i in cells_to_run(path)]
    (tmp / "spec.json").write_text(json.dumps(spec))
    env_vars = {"LABKIT_QUICK": "1", "MPLBACKEND": "Agg", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(t4_fake.__file__)), str(tmp / "spec.json"), str(tmp / "out.json")],
                          capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, **env_vars})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp / "out.json").read_text())
    out["_seconds"] = time.monotonic() - t0
    return out


def _printed(run: dict, stem: str) -> str:
    return "".join(c["stdout"] for c in run[stem].values())


def test_every_hardware_cell_is_covered(t4_run):
    """Each notebook's card-reading cells all ran under the fake, without an error."""
    for path in notebooks.notebook_paths():
        ran = t4_run[path.stem]
        errors = {i: c["error"] for i, c in ran.items() if c["error"]}
        assert not errors, f"{path.name} under a faked T4: {errors}"
        runnable = set(hardware_cells(path)) - set(card_compute_cells(path))
        assert set(map(str, runnable)) <= set(ran), path.name
        assert not BF16_CLAIM.search(_printed(t4_run, path.stem)), path.name


def bf16_on_the_gpu(src: str) -> list[str]:
    """Calls given "bf16" by name, and `"bf16" if <GPU test>` choices, inside a branch taken only on a GPU
    (its test names ON_GPU or cuda): wrong on a T4, where the course runs fp16."""
    found = []
    for n in ast.walk(ast.parse(src)):
        if not isinstance(n, ast.If | ast.IfExp) or not re.search(r"ON_GPU|cuda", ast.unparse(n.test)):
            continue
        if isinstance(n, ast.IfExp):
            if isinstance(n.body, ast.Constant) and n.body.value == "bf16":
                found.append(ast.unparse(n))
            continue
        found += [ast.unparse(m) for b in n.body for m in ast.walk(b) if isinstance(m, ast.Call)
                  and any(isinstance(a, ast.Constant) and a.value == "bf16" for a in m.args)]
    return found


def test_gpu_only_branches_ask_the_card_for_its_16_bit_format():
    assert bf16_on_the_gpu('kind = "bf16" if ON_GPU else "fp32"') and bf16_on_the_gpu(
        'if ON_GPU and not QUICK:\n    live = mm.bench_matmul("bf16", 8192)')  # the two the T4 path fixed
    for path in notebooks.notebook_paths():
        for i, src in _code(path).items():
            assert not bf16_on_the_gpu(src), f"{path.name} cell {i} picks bf16 by name on a GPU (a T4 runs fp16)"


def test_cells_that_train_in_the_cards_format_take_it_from_the_setup_cell(t4):
    """The cells left out of the run (they need the card) train in AMP, which the setup cell set to fp16 here."""
    skipped = {p.stem: card_compute_cells(p) for p in notebooks.notebook_paths()}
    assert skipped["03_mixed_precision"], "week 3 trains in the card's format: its cells should be found"
    for stem, cells in skipped.items():
        code = _code(ROOT / "notebooks" / f"{stem}.ipynb")
        for i in cells:
            literals = {n.value for n in ast.walk(ast.parse(code[i])) if isinstance(n, ast.Constant)}
            assert "bf16" not in literals, f"{stem} cell {i} names bf16 where it trains in the card's format"
    assert env.amp_precision() == "fp16"


def test_week2_reports_the_t4_and_its_40_sms(t4_run):
    text = _printed(t4_run, "02_tensor_cores")
    assert "device: Tesla T4 | tensor cores: True | bf16: False | tf32: False | fp8: False" in text
    assert "the model for 40 SMs, 128 x 128 tiles" in text and "an H100 SXM's" not in text


def test_week3_picks_fp16_and_says_fp8_is_out_of_reach(t4_run):
    text = _printed(t4_run, "03_mixed_precision")
    assert "16-bit format: fp16" in text
    assert "FP8 matmuls on this device: no (needs compute capability 8.9+)" in text


def test_week6_picks_fp16_and_its_ladder_falls_back_and_says_so(t4_run, t4):
    assert "16-bit format here: fp16" in _printed(t4_run, "06_resnet_ladder")
    plan = T.plan_ladder(torch.device("cuda", 0), quick=False)  # the plan the notebook's ladder runs on a T4
    assert {c.name: c.precision for c in plan.rungs}["bf16"] == "fp16"
    assert "compute capability 7.5 has no bf16 tensor cores" in plan.notes[0] and "GradScaler" in plan.notes[0]


def test_week6_runs_a_short_live_ladder_on_a_t4_and_the_full_one_on_an_h100():
    """The live ladder's size follows the card: a T4 (40 SMs, fp16 only) gets 2 runs of 2 epochs per rung and is
    told how to ask for the recorded size; an H100-class card gets the recorded 3 runs of 5 epochs."""
    from labkit.env import GpuFacts

    with t4_fake.fake_t4(cuda_device=True):
        base, names, repeats, why = T.live_ladder_size(torch.device("cuda", 0))
        assert (base.epochs, base.n_train, names, repeats) == (2, None, None, 2)
        assert "Tesla T4, 40 SMs" in why and 'LIVE_SIZE = "full"' in why
        assert T.live_ladder_size(torch.device("cuda", 0), size="full")[:3] == (None, None, 3)
    h100 = GpuFacts(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory_bytes=85 * 2**30, multiprocessors=132,
                    bf16_emulated=False, simulated=True)
    with t4_fake.fake_gpu(h100, cuda_device=True):
        base, names, repeats, why = T.live_ladder_size(torch.device("cuda", 0))
        assert (base, names, repeats) == (None, None, T.REPEATS) and "132 SMs" in why
        assert T.live_ladder_size(torch.device("cuda", 0), size="short")[0].epochs == 2
    with pytest.raises(LabkitError, match="choose one of auto, full, short"):
        T.live_ladder_size("cpu", size="tiny")


def test_the_fake_reports_a_t4_while_tensors_stay_on_the_cpu(t4):
    assert env.pick_device().type == "cpu" and not torch.cuda.is_available()
    caps = env.capabilities()
    assert caps["name"] == "Tesla T4" and caps["capability"] == "7.5" and caps["amp"] == "fp16" and caps["simulated"]
    assert waves.sm_count() == 40 and waves.datasheet_peak(caps["name"], "fp16") == 65.0
    rec = env.environment(command="x")
    assert rec["device_name"].startswith("CPU") and rec["simulated_gpu"] == "Tesla T4"  # CPU timings stay CPU's


def test_the_fake_leaves_nothing_behind():
    with t4_fake.fake_t4():
        pass
    assert env.gpu_facts("cpu") is None and env.amp_precision("cpu") == "bf16"


def test_the_notebook_run_stays_cheap(t4_run):
    assert t4_run["_seconds"] < 120, f"{t4_run['_seconds']:.0f} s: select fewer cells (see the module docstring)"


def test_lab4_grades_a_t4_on_its_own_tier_class_with_an_fp16_twin(t4, tmp_path, monkeypatch):
    """Lab 4's trusted checks in this (trusted) process under the fake, on CPU-sized problems as
    test_hostile_lab4.py runs them: the T4 tier class, the fp16 reference twin, and a verdict that names the class.
    The student's sandboxed process never sees the fake: the grader reads the card itself."""
    from autograder.checks import gpu_policy, harness
    from autograder.checks import lab4_checks as L
    from autograder.sandbox import jail

    nb = ROOT / "assignments" / "source" / "lab4_speedrun" / "lab4_speedrun.ipynb"  # the reference solution

    monkeypatch.setattr(L, "SPEED_ROUNDS", {"rounds": 1, "warmup": 0, "inner": 1})  # the verdict's labels, not
    monkeypatch.setattr(L, "SPEED_WARMUP_STEPS", 1)  # its speed, are what this test reads
    box, work = tmp_path / "box", tmp_path / "work"
    box.mkdir()
    work.mkdir()
    f = box / "student_speedrun.py"
    f.write_text(harness.student_file_from_notebook(nb, tmp_path).read_text())
    dev = env.pick_device()
    ctx = harness.Context(device=dev, hardware=harness.hardware_class(dev), small=True, work_dir=work,
                          student_file=f, sandbox="bwrap" if jail.probe() is None else "none")
    try:
        v = harness._run_in_worker(harness.CHECKS["lab4.speed"], ctx)
    finally:
        ctx.close()
    m = v["measurements"]
    assert v["gradable"] and v["hardware"] == "tensor_core_gpu" and v["device"] == "cpu", v
    assert m["tier_class"] == "fp16_tensor_core_gpu" and m["twin_dtype"] == "torch.float16", m
    assert m["tiers"] == gpu_policy.LAB4_SPEED_TIERS["fp16_tensor_core_gpu"].describe()
    assert "Tiers of the fp16_tensor_core_gpu class (policy (T4 class, not yet calibrated on a T4))" in v["message"]


def test_lab4_states_every_tier_class_it_grades_with():
    """The lab's instructions quote each hardware class's tiers as gpu_policy sets them (T4 class included)."""
    import json
    from pathlib import Path

    from autograder.checks import gpu_policy

    nb = Path(__file__).resolve().parents[1] / "assignments" / "source" / "lab4_speedrun" / "lab4_speedrun.ipynb"
    text = " ".join("".join(json.loads(nb.read_text())["cells"][0]["source"]).split())
    t4 = gpu_policy.LAB4_SPEED_TIERS["fp16_tensor_core_gpu"]
    quoted = ", ".join(f"{b:g}x: {round(6 * f)}" for b, f in t4.steps[:-1])
    assert f"7.x: the free Colab GPU): {quoted}, **{t4.steps[-1][0]:g}x: 6**, bonus at {t4.bonus:g}x" in text
    h100 = gpu_policy.LAB4_SPEED_TIERS["bf16_tensor_core_gpu"]
    assert f"**{h100.steps[-1][0]:g}x: 6**" in text and f"at {h100.bonus:g}x" in text

"""The `labkit` command line: fast help, one list of commands, outputs checked before any work, no silent overwrite."""

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import cli

ROOT = Path(__file__).resolve().parents[1]
HELP_LIMIT_S = 2.0  # `labkit --help` must answer without loading torch (which alone takes seconds on a cold disk)


def test_help_is_fast_in_a_fresh_process_and_loads_no_torch():
    code = ("import sys, time\nt = time.perf_counter()\nfrom labkit.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, time.perf_counter() - t, file=sys.stderr)")
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "ladder" in check.stdout, check.stderr
    assert check.stderr.split()[0] == "False", check.stderr  # torch stays unloaded
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "labkit", "--help"], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    assert r.returncode == 0 and all(name in r.stdout for name in cli.COMMANDS)
    print(f"python -m labkit --help: {wall:.2f} s wall in a fresh process")
    assert wall < HELP_LIMIT_S, f"labkit --help took {wall:.2f} s"


def test_the_graders_help_is_fast_and_loads_neither_torch_nor_nbgrader():
    code = ("import sys, time\nt = time.perf_counter()\nfrom autograder.__main__ import main\ntry:\n"
            "    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules or 'nbgrader' in sys.modules, file=sys.stderr)")
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode == 0 and "grade" in check.stdout and check.stderr.split()[0] == "False", check.stderr
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "autograder", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    wall = time.perf_counter() - t0
    assert r.returncode == 0 and "grade" in r.stdout, r.stderr
    assert wall < HELP_LIMIT_S, f"python -m autograder --help took {wall:.2f} s"


def test_the_command_list_matches_what_the_modules_define():
    full, light = cli.build_parser(), cli.build_parser([])
    assert full.format_help() == light.format_help()  # same commands, same order, same help lines
    sub = next(a for a in full._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)
    for name, cmd in cli.COMMANDS.items():
        actions = {a.dest: a for a in sub.choices[name]._actions}
        for dest in (*cmd.writes, *cmd.read_only_with):
            assert dest in actions, (name, dest)
        # any option that looks like an output must be one the command line checks
        looks = {d for d, a in actions.items() if d in ("out", "json", "plot") or a.metavar == "DIR"}
        assert looks <= set(cmd.writes), (name, looks - set(cmd.writes))
        assert ("overwrite" in actions) == bool(cmd.writes)


UNWRITABLE = [("a file where a folder should be", lambda tmp: tmp / "file.txt" / "sub")]
if Path("/proc").is_dir():
    UNWRITABLE.append(("/proc", lambda tmp: Path("/proc/labkit-no-such/out")))


@pytest.mark.parametrize("why,where", UNWRITABLE, ids=[u[0] for u in UNWRITABLE])
@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_unwritable_output_fails_in_one_line_before_any_work(name, why, where, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("not a folder")
    base = {"doctor": [], "ladder": ["--device", "cpu"], "train": ["--quick", "--device", "cpu"],
            "ddp": ["--cpu", "--quick"], "formats": [], "matmul": ["--device", "cpu"], "amp": [],
            "data": ["--device", "cpu"], "profile": ["--device", "cpu"], "compile-cache": []}[name]
    importlib.import_module(cli.COMMANDS[name].module)  # importing torch is not the work being timed
    for dest in cli.COMMANDS[name].writes:
        target = where(tmp_path)
        t0 = time.perf_counter()
        code = cli.main([name, *base, f"--{dest}", str(target)])
        took = time.perf_counter() - t0
        err = capsys.readouterr().err.strip()
        assert code == 2, (name, dest, err)
        assert err.startswith(f"labkit {name}: error: --{dest} ") and "cannot write there" in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert took < 5, f"{name} --{dest}: {took:.1f} s before failing: it did work first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


MATMUL = ["matmul", "--quick", "--device", "cpu", "--size", "16", "--kinds", "fp32", "--repeats", "1"]


def test_a_second_run_never_overwrites_the_first_unasked(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert cli.main([*MATMUL, "--json", str(out)]) == 0
    first = out.read_text()
    capsys.readouterr()
    assert cli.main([*MATMUL, "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert out.read_text() == first  # the earlier run is untouched ...
    again = [p for p in tmp_path.iterdir() if p.name.startswith("m-")]
    assert len(again) == 1 and again[0].suffix == ".json"  # ... this one went next to it, and said so
    assert f"holds an earlier run: this one goes to {again[0]}" in err and "--overwrite" in err
    assert json.loads(again[0].read_text())["grid"]
    assert cli.main([*MATMUL, "--json", str(out), "--overwrite"]) == 0
    assert len(list(tmp_path.iterdir())) == 2 and out.read_text() != first


def test_commands_that_write_nothing_leave_the_output_alone(tmp_path, capsys):
    out = tmp_path / "ladder"
    out.mkdir()
    (out / "ladder.json").write_text("{}")
    assert cli.main(["ladder", "--list", "--out", str(out)]) == 0
    assert "earlier run" not in capsys.readouterr().err and sorted(tmp_path.iterdir()) == [out]


def test_matmul_accepts_quick(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert cli.main([*MATMUL, "--json", str(out)]) == 0  # MATMUL says --quick
    assert json.loads(out.read_text())["grid"][0]["kind"] == "fp32"
    assert cli.main(["matmul", "--quick", "--full"]) == 2
    assert "contradict" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-5"])
def test_data_with_no_images_is_an_error_not_a_default(n, capsys):
    assert cli.main(["data", "--n", n, "--device", "cpu", "--sweep", "padding"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--n must be >= 1" in err and len(err.splitlines()) == 1


LEAVE = """
import atexit, os, sys, threading, time
from labkit import cli

class Teardown:  # freed only by the interpreter's teardown, which a fast exit skips
    def __init__(self):
        self.mark, self.open = sys.argv[1] + ".teardown", open  # builtins may be gone by then

    def __del__(self):
        self.open(self.mark, "w").write("x")

kept = Teardown()
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("x"))
if sys.argv[2] == "thread":  # a thread that is not a daemon: waited for, as a normal exit does
    threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[1] + ".thread", "w").write("x"))).start()
sys.stdout.write("the result, no newline")
cli.leave(3)
"""


@pytest.mark.parametrize("case", ["fast", "thread", "off"])
def test_leaving_keeps_exit_handlers_output_code_and_threads(tmp_path, case):
    env = dict(__import__("os").environ, LABKIT_FAST_EXIT="0" if case == "off" else "1")
    base = tmp_path / "mark"
    r = subprocess.run([sys.executable, "-c", LEAVE, str(base), case], capture_output=True, text=True, timeout=60,
                       env=env, cwd=ROOT)
    assert r.returncode == 3 and r.stdout == "the result, no newline", r.stderr
    assert Path(f"{base}.atexit").exists()  # temporary folders, logging, worker pools: still closed
    assert Path(f"{base}.thread").exists() == (case == "thread")
    assert Path(f"{base}.teardown").exists() == (case != "fast")  # the skipped part, and only where it is safe


def test_the_labkit_command_leaves_through_leave():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["labkit"] == "labkit.cli:console"
    assert "console()" in (ROOT / "labkit" / "__main__.py").read_text()


def test_ladder_json_writes_the_record_where_asked(tmp_path, monkeypatch, capsys):
    # `labkit ladder --quick --json benchmarks/results/ladder/ladder_quick_cpu.json` is how the CPU record is made
    from labkit import train as T

    seen = {}

    def fake_run_ladder(dev, **kw):
        seen.update(kw)
        return {"kind": "ladder", "rungs": [], "machine_load": {"trustworthy": True}}

    monkeypatch.setattr(T, "run_ladder", fake_run_ladder)
    record = tmp_path / "results" / "ladder_quick_cpu.json"
    assert cli.main(["ladder", "--quick", "--device", "cpu", "--out", str(tmp_path / "l"), "--json", str(record)]) == 0
    assert json.loads(record.read_text())["machine_load"]["trustworthy"] is True
    assert seen["out"] == str(tmp_path / "l") and f"wrote {record}" in capsys.readouterr().out


def test_set_given_twice_keeps_both_fields():
    """`--set a=1 --set b=2` changes both fields: a second --set used to replace the first, so a run silently
    trained without the first change (found when a batch-2048 run trained at the preset's 4096)."""
    from labkit import cli

    args = cli.build_parser(["train"]).parse_args(["train", "--preset", "muon", "--set", "batch_size=2048",
                                                   "--set", "eval_every_epoch=true", "epochs=2"])
    assert args.set == ["batch_size=2048", "eval_every_epoch=true", "epochs=2"]
    assert cli.build_parser(["train"]).parse_args(["train"]).set == []

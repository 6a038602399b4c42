"""Every `labkit` command and every notebook in quick mode, on whatever device this machine has.

CI runs them all on a CPU. Quick mode on a GPU takes other paths: compiled rungs, CUDA graphs, bf16, NVML, batches
fitted to a small dataset on a fast card. Two bugs once showed only there. Each command runs in a fresh process
with LABKIT_QUICK=1 and a time limit, then the notebooks run through `run_notebooks.py --quick`. The record keeps,
for each unit, its exit status, its wall time, the lines where it says what it skips, and the tail of its output.
It is saved after each unit, so a run cut short keeps what finished.

    python benchmarks/gpu_quick.py --out /tmp/q                  # every command, then every notebook
    python benchmarks/gpu_quick.py --out /tmp/q --parts commands  # the commands only

Saves <out>/gpu_quick.json; exits 1 if any unit failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labkit.errors import LabkitError  # noqa: E402
from labkit.outputs import check_writable  # noqa: E402

# One quick run per command, outputs under {tmp}. compile-cache builds the top rung's quick artifact, and the train
# after it loads that artifact, as a student's second run would.
COMMANDS = {
    "doctor": ["doctor", "--json", "{tmp}/doctor.json"],
    "formats": ["formats", "--check"],
    "matmul": ["matmul", "--quick", "--json", "{tmp}/matmul.json"],
    "amp": ["amp", "--json", "{tmp}/amp.json"],
    "data": ["data", "--quick", "--out", "{tmp}/data"],
    "profile": ["profile", "--quick", "--out", "{tmp}/profile"],
    "profile --scenario": ["profile", "--quick", "--scenario", "data", "--out", "{tmp}/scenario"],
    "ladder": ["ladder", "--quick", "--repeats", "1", "--out", "{tmp}/ladder"],
    "compile-cache": ["compile-cache", "--build", "--quick", "--rungs", "muon", "--dir", "{tmp}/cache"],
    "train": ["train", "--quick", "--preset", "muon", "--json", "{tmp}/train.json"],
    "ddp": ["ddp", "--quick", "--preset", "resident_data", "--nproc", "1", "--json", "{tmp}/ddp.json"],
}
BAR = re.compile(r"\d+%\|")  # a progress bar's frames say nothing the last line doesn't
SKIP = re.compile(r"\bskip|\bnot (run|measured|timed)\b|\bwithout (a|CUDA|NVML)\b|\bquick mode\b", re.I)


def run_unit(name: str, cmd: list[str], env: dict, limit_s: float) -> dict:
    """Run one command; its status, wall seconds, the lines saying what it skipped and its output's tail."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    seconds = time.monotonic() - t0
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip() and not BAR.search(ln)]
    skips = list(dict.fromkeys(ln[:300] for ln in lines if SKIP.search(ln)))
    print(f"{name}: rc {rc} in {seconds:.1f} s" + (f", {len(skips)} skip line(s)" if skips else ""), file=sys.stderr)
    return {"name": name, "command": shlex.join(cmd[2:] if cmd[1:2] == ["-m"] else cmd[1:]), "rc": rc,
            "ok": rc == 0, "seconds": round(seconds, 2), "skips": skips, "tail": lines[-12:]}


def run_notebooks(out: Path, env: dict, limit_s: float) -> list[dict]:
    """The notebooks through run_notebooks.py --quick; one unit per notebook from its summary."""
    folder = out / "notebooks"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run_notebooks.py"), "--quick", "--out", str(folder),
           "--timeout", str(limit_s)]
    whole = run_unit("notebooks", cmd, env, limit_s * 8)
    try:
        summary = json.loads((folder / "notebook_runs.json").read_text())["notebooks"]
    except (OSError, ValueError, KeyError):
        return [whole]  # nothing recorded: the driver itself failed, and its output says why
    units = []
    for nb in summary:
        errors = [c for c in nb.get("cells", []) if c.get("status") == "error"]
        units.append({"name": Path(nb["path"]).name, "command": f"run_notebooks.py --quick {nb['path']}",
                      "rc": 0 if nb["status"] == "ok" else nb["status"], "ok": nb["status"] == "ok",
                      "seconds": round(nb["wall_s"], 2), "error": nb.get("error"),
                      "cells_with_errors": [c.get("cell") for c in errors]})
    return units


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_quick.json and the notebooks' records")
    ap.add_argument("--parts", default="commands,notebooks", help="comma-separated: commands, notebooks")
    ap.add_argument("--only", default="", help="comma-separated command names to run (default: all)")
    ap.add_argument("--limit", type=float, default=300, help="seconds one command or notebook may run")
    ap.add_argument("--name", default="gpu_quick", help="result file stem")
    args = ap.parse_args(argv)
    parts = set(filter(None, args.parts.split(",")))
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    try:
        if not parts or parts - {"commands", "notebooks"}:
            raise LabkitError(f"--parts: pick from commands, notebooks (got {args.parts!r})")
        if set(only) - set(COMMANDS):
            raise LabkitError(f"--only: no such command {sorted(set(only) - set(COMMANDS))}; known: {list(COMMANDS)}")
        out = check_writable(args.out, "dir", "--out")
        out.mkdir(parents=True, exist_ok=True)
    except LabkitError as e:
        print(f"gpu_quick: {e}", file=sys.stderr)
        return 2
    from labkit.bench import save_result

    env = dict(os.environ, LABKIT_QUICK="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = shlex.join(["python", "benchmarks/gpu_quick.py", *(argv if argv is not None else sys.argv[1:])])
    units: list[dict] = []

    def save():
        save_result(args.name, {"note": "every labkit command and notebook in quick mode, each in a fresh process "
                                        "(LABKIT_QUICK=1): exit status, wall seconds, what it said it skipped",
                                "units": units}, out_dir=out, command=command, device="auto")

    with tempfile.TemporaryDirectory(prefix="gpu_quick_") as tmp:
        env["LABKIT_COMPILE_CACHE"] = f"{tmp}/cache"  # the artifact compile-cache builds is the one train loads
        if "commands" in parts:
            for name, argv_ in COMMANDS.items():
                if only and name not in only:
                    continue
                cmd = [sys.executable, "-m", "labkit", *(a.format(tmp=tmp) for a in argv_)]
                units.append(run_unit(name, cmd, env, args.limit))
                save()
        if "notebooks" in parts:
            units.extend(run_notebooks(out, env, args.limit))
            save()
    bad = [u["name"] for u in units if not u["ok"]]
    print(f"{len(units) - len(bad)} of {len(units)} ran cleanly" + (f"; failed: {', '.join(bad)}" if bad else ""),
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

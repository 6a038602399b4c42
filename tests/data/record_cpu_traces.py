"""Re-record the small CPU traces that tests/test_profiling.py parses (run from the repository root).

    .venv/bin/python tests/data/record_cpu_traces.py

Each is a quick-size scenario from labkit.scenarios, profiled by labkit.profiling.profile_steps on the CPU.
The data scenario runs at batch 64 and 2 active steps so that its per-sample operators stay a small file.
"""

from pathlib import Path

from labkit import profiling
from labkit import scenarios as S

HERE = Path(__file__).resolve().parent
RECORDINGS = {
    # file stem: (scenario, fixed, WorkloadConfig changes, active steps)
    "cpu_data_slow": ("data", False, {"batch": 64}, 2),
    "cpu_data_fixed": ("data", True, {}, 3),
    "cpu_compute_slow": ("compute", False, {}, 3),
}


def main() -> None:
    for stem, (name, fixed, changes, active) in RECORDINGS.items():
        cfg = S.with_changes(S.scenario_config(name, fixed=fixed, quick=True), **changes)
        prof = profiling.profile_steps(S.Workload(cfg, "cpu"), "cpu",
                                       schedule=profiling.ProfileSchedule(wait=1, warmup=1, active=active))
        prof.trace["labkit"]["scenario"] = f"{name}-{'fixed' if fixed else 'slow'}"
        path = profiling.save_trace(prof.trace, HERE / f"{stem}.pt.trace.json.gz")
        print(f"{path.name}: {path.stat().st_size / 1e3:.0f} kB, diagnosed {prof.diagnose().title}")


if __name__ == "__main__":
    main()

"""`python -m autograder grade <assignment> --submissions DIR`: grade a class, unattended."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from autograder import commands
from autograder.base import shown
from labkit.cli import run

PRESET_NAMES = ("class", "quick")  # autograder.grade.PRESETS, named here so --help need not import the grader


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograder", description="Grade a class of nbgrader "
                                     "submissions: isolated, resumable, with checks re-run outside the students' kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("grade", help="grade every hand-in of one assignment and write grades.csv and feedback")
    g.add_argument("assignment", help="assignment id, e.g. lab4_speedrun (a folder under COURSE/source/)")
    g.add_argument("--submissions", required=True, metavar="DIR",
                   help="folder (or .zip) of hand-ins: one folder per student, or LMS-named files/zips")
    g.add_argument("--course", default=None, help="nbgrader course root (default: assignments)")
    g.add_argument("--out", default=None, help="output folder (default: grading/<assignment>)")
    g.add_argument("--work", default=None, help="scratch folder (default: a temporary folder, removed afterwards)")
    g.add_argument("--preset", choices=PRESET_NAMES, default="class",
                   help="limits: 'class' for a GPU box (default), 'quick' for small CPU assignments")
    g.add_argument("--cell-timeout", type=int, default=None, metavar="S",
                   help="per-cell time limit, seconds (default: the course's c.Execute.timeout, else 600)")
    g.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="one student's whole grading, seconds (the process group is killed past it)")
    g.add_argument("--memory-gb", type=float, default=None, help="memory budget of one student's processes, GiB")
    g.add_argument("--disk-gb", type=float, default=None,
                   help="what one student's processes may leave in their folders together, GiB (default 8; at most "
                        "100,000 files); past it they are stopped")
    g.add_argument("--address-space-limit", action="store_true",
                   help="also cap each process's virtual memory at --memory-gb (RLIMIT_AS; CPU-only machines: "
                        "torch alone reserves ~3.5 GiB of address space)")
    g.add_argument("--jobs", type=int, default=None,
                   help="students graded at once (default: one per GPU; 1 without a GPU)")
    g.add_argument("--trusted-submissions", action="store_true",
                   help="run the students' code without the sandbox (only where bubblewrap is missing and you "
                        "trust every hand-in: their code then runs as you, next to the checks)")
    g.add_argument("--harness", default=None, metavar="MODULE",
                   help="module providing run_checks/run_check for the trusted re-run (default: autograder.harness)")
    g.add_argument("--force", action="store_true", help="regrade students that already have a result")
    g.add_argument("--only", nargs="+", default=(), metavar="STUDENT", help="grade only these student ids")
    g.add_argument("--keep-work", action="store_true", help="keep each student's scratch course for debugging")
    g.add_argument("--lms-regex", default=None,
                   help="regular expression with (?P<student_id>...) for LMS-named files")
    g.add_argument("--no-feedback", action="store_true", help="skip the HTML feedback pages")
    g.add_argument("--show-hidden-tests", action="store_true",
                   help="leave hidden tests visible in the feedback (hidden by default)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands.add_grade_args(g)
    g.set_defaults(func=_cli_grade)
    commands.add_commands(sub)
    return parser


def _cli_grade(args) -> int:
    from autograder.base.nbstart import skip_iri_checker

    skip_iri_checker()  # before the grader's imports reach nbformat
    from autograder.grade import PRESETS, default_out, grade_class
    from labkit.env import LabkitError

    cfg = PRESETS[args.preset]
    changes = {"course": args.course, "out": args.out or str(default_out(args.assignment)), "work": args.work,
               "cell_timeout_s": args.cell_timeout, "wall_timeout_s": args.timeout, "memory_gb": args.memory_gb,
               "disk_gb": args.disk_gb,
               "jobs": args.jobs, "harness_module": args.harness, "lms_regex": args.lms_regex}
    cfg = replace(cfg, **{k: v for k, v in changes.items() if v is not None}, force=args.force,
                  only=tuple(args.only), keep_work=args.keep_work, trusted_submissions=args.trusted_submissions,
                  feedback=not args.no_feedback, hide_hidden_tests=not args.show_hidden_tests,
                  progress=not args.no_progress, address_space_limit=args.address_space_limit,
                  **commands.grade_changes(args))
    if cfg.jobs is not None and cfg.jobs < 1:
        raise LabkitError("--jobs must be at least 1")
    rep = grade_class(args.assignment, args.submissions, cfg)
    print(shown.block((rep.out / "summary.txt").read_text()), end="")
    graded = sum(r.status == "graded" for r in rep.results)
    wrote = [p for p in (rep.out / "grades.csv", rep.out / "feedback", rep.out / "gradebook.db") if p.exists()]
    print(f"\n{len(rep.results)} students: {graded} graded, {len(rep.results) - graded} not graded "
          f"({rep.graded_now} processed in this run, {rep.wall_s:.0f} s). Wrote {', '.join(map(str, wrote))}; "
          f"log: {rep.out / 'grade_log.txt'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, "autograder", "interrupted; run the same command again to resume")


if __name__ == "__main__":
    sys.exit(main())

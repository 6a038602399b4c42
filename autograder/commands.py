"""The class-level subcommands of `python -m autograder` beside `grade`: merge, export, gradescope, similarity,
variant, secret, and the options they share with `grade` (slices, late policy, hardware refusal, open kit).

Heavy modules are imported inside the handlers, so `--help` stays instant.
"""

from __future__ import annotations

import argparse

from autograder.base import shown


def add_late_args(p: argparse.ArgumentParser) -> None:
    """Options of the late policy (autograder.intake.late.LatePolicy)."""
    g = p.add_argument_group("late policy (applied to the total; shown in the summary, grades.csv and feedback bundles)")
    g.add_argument("--due", default=None, metavar="ISO", help="due date, e.g. 2025-03-04T23:59 (time zone: --timezone)")
    g.add_argument("--grace-minutes", type=float, default=0.0, help="minutes after the due date still on time")
    g.add_argument("--late-per-day", type=float, default=10.0, metavar="PCT",
                   help="percent of the points lost per started day late (default 10)")
    g.add_argument("--late-cap", type=float, default=100.0, metavar="PCT", help="at most this percent off (default 100)")
    g.add_argument("--extensions", default=None, metavar="CSV", help="per-student extensions: student_id,days or "
                   "student_id,due")
    g.add_argument("--submitted-csv", default=None, metavar="CSV",
                   help="submission times student_id,submitted_at (beat file names and zip dates)")
    g.add_argument("--timezone", default="UTC", help="IANA zone for times given without one (default UTC)")


def late_policy(args):
    """LatePolicy from the parsed options, or None without --due; LabkitError for options that do not fit."""
    from labkit.env import LabkitError

    if args.due is None:
        if args.extensions or args.submitted_csv:
            raise LabkitError("--extensions and --submitted-csv need --due")
        return None
    from autograder.intake import late

    if args.grace_minutes < 0 or args.late_per_day < 0 or not 0 <= args.late_cap <= 100:
        raise LabkitError("--grace-minutes and --late-per-day must be >= 0, --late-cap within 0..100")
    due = late.parse_time(args.due, args.timezone, "--due")
    ext = late.read_extensions(args.extensions, due, args.timezone) if args.extensions else {}
    if args.submitted_csv:
        late.read_times_csv(args.submitted_csv, args.timezone)  # its errors now, before any grading
    return late.LatePolicy(due, args.grace_minutes * 60, args.late_per_day, args.late_cap, ext, args.submitted_csv,
                           args.timezone, getattr(args, "roster", None))


def add_grade_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--shard", default=None, metavar="K/N",
                   help="grade only slice K (0..N-1) of N, by a stable hash of the student id; then `merge`")
    g.add_argument("--roster", default=None, metavar="CSV",
                   help="class list: the CSV `make student ROSTER=` reads (column student_id) or the LMS's gradebook "
                        "export (Canvas: Student, ID, SIS Login ID); each hand-in is matched to exactly one listed "
                        "id, the longest its name starts with, and a name matching none or several stops the run")
    g.add_argument("--allow-ungradable", action="store_true",
                   help="grade a lab this machine cannot fully grade (its GPU checks score 0; students listed)")
    add_open_kit_arg(g)
    add_late_args(g)
    add_manual_arg(g)


def add_manual_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manual-scores", default=None, metavar="CSV",
                   help="instructor's grades of the written answers (columns student_id, cell, score); kept in the "
                        "output's gradebook.db, as are grades given there in formgrader")


def add_open_kit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--open-kit", action="store_true",
                   help="no course secret: use the public open-kit default (rehearsals and self-study only: its "
                        "hidden cases are public and lab 3 has one variant for everyone)")


def grade_changes(args) -> dict:
    """GradeConfig fields set by the options add_grade_args added."""
    from autograder.intake import shard

    if args.shard:
        shard.parse(args.shard)
    return {"shard": args.shard, "allow_ungradable": args.allow_ungradable, "late": late_policy(args),
            "open_kit": args.open_kit, "manual_scores": args.manual_scores, "roster": args.roster}


def add_commands(sub) -> None:
    m = sub.add_parser("merge", help="combine the output folders of `grade --shard K/N` jobs into one")
    m.add_argument("out", help="merged output folder")
    m.add_argument("slices", nargs="+", metavar="SLICE_DIR", help="output folders of the slices")
    m.add_argument("--submissions", default=None, metavar="DIR", help="the class's hand-ins: name who is missing")
    m.add_argument("--roster", default=None, metavar="CSV",
                   help="class list, as for grade (column student_id, or the LMS's gradebook export): name who is "
                        "missing")
    m.add_argument("--lms-regex", default=None, help="as for grade")
    m.add_argument("--no-progress", action="store_true")
    add_late_args(m)
    add_manual_arg(m)
    m.set_defaults(func=_cli_merge)

    e = sub.add_parser("export", help="Canvas gradebook CSV, Gradescope results.json or feedback bundles")
    e.add_argument("out", help="a grading (or merged) output folder")
    e.add_argument("--to", required=True, choices=("canvas", "gradescope", "feedback"))
    e.add_argument("--dest", default=None, help="folder for the export (default OUT/lms/<to>)")
    e.add_argument("--title", default=None, help="Canvas column: assignment name, or 'Name (canvas assignment id)'")
    e.add_argument("--roster", default=None, metavar="CSV", help="the course's Canvas gradebook export (fills IDs)")
    e.add_argument("--submissions", default=None, metavar="DIR", help="LMS download: Canvas ids and file prefixes")
    e.add_argument("--lms-regex", default=None)
    e.set_defaults(func=_cli_export)

    s = sub.add_parser("gradescope", help="grade one Gradescope submission (labs 1-3): what run_autograder calls")
    s.add_argument("lab", choices=("lab1", "lab2", "lab3"))
    s.add_argument("--submission", default="/autograder/submission", help="folder with the student's files")
    s.add_argument("--results", default="/autograder/results/results.json", help="where results.json goes")
    s.add_argument("--course", default=None, help="course root holding source/<lab>/ (default: assignments)")
    s.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto")
    add_open_kit_arg(s)
    s.set_defaults(func=_cli_gradescope)

    y = sub.add_parser("similarity", help="flag pairs of hand-ins far more alike than the class (fingerprints)")
    y.add_argument("assignment")
    y.add_argument("--submissions", required=True, metavar="DIR")
    y.add_argument("--course", default="assignments", help="course root (its source notebook gives the starter)")
    y.add_argument("--starter", default=None, metavar="FILE", help="starter module to exclude (default: from --course)")
    y.add_argument("--out", default=None, help="report folder (default grading/<assignment>)")
    y.add_argument("--min-similarity", type=float, default=None, help="flag only pairs at least this alike (0.6)")
    y.add_argument("--z", type=float, default=None, help="... and this many spreads above the median (3)")
    y.add_argument("--lms-regex", default=None)
    y.add_argument("--roster", default=None, metavar="CSV",
                   help="class list, as for grade (column student_id, or the LMS's gradebook export): names "
                        "matched to its ids")
    y.add_argument("--no-progress", action="store_true")
    y.set_defaults(func=_cli_similarity)

    v = sub.add_parser("variant", help="write a student's own slow_train.py for lab 3 (from the course secret)")
    v.add_argument("lab", choices=("lab3",))
    v.add_argument("--student", action="append", default=[], metavar="ID",
                   help="student id (repeat for several); none: the course's common variant")
    v.add_argument("--roster", default=None, metavar="CSV", help="class list (column student_id): one per student")
    v.add_argument("--out", required=True, metavar="DIR",
                   help="OUT/slow_train.py for one student, OUT/<id>/slow_train.py for several")
    v.add_argument("--show-key", action="store_true",
                   help="also print each variant's answer key (instructor only: never into a student's folder)")
    add_open_kit_arg(v)
    v.set_defaults(func=_cli_variant)

    k = sub.add_parser("secret", help="print a new course secret (set it as LABKIT_COURSE_SECRET; keep it private)")
    k.set_defaults(func=_cli_secret)


def _cli_merge(args) -> int:
    from autograder import merge
    from autograder.base.progress import table
    from autograder.intake import submissions as intake

    rep = merge.merge(args.slices, args.out, submissions=args.submissions, roster=args.roster,
                      policy=late_policy(args), lms_regex=args.lms_regex or intake.LMS_REGEX,
                      progress=not args.no_progress, manual_scores=args.manual_scores)
    print(shown.block((rep.out / "summary.txt").read_text()), end="")
    print("\n" + table([[s["shard"] or "-", len(s["students"]), s["folder"]] for s in rep.slices],
                       ["slice", "students", "folder"]), end="")
    print(f"{len(rep.results)} students merged into {rep.out}; missing: {len(rep.missing)}; "
          f"rejected markers: {len(rep.rejected)}")
    return 1 if rep.missing or rep.rejected else 0


def _cli_export(args) -> int:
    from pathlib import Path

    from autograder.intake import submissions as intake
    from autograder.lms import exports as lms

    dest = args.dest or str(Path(args.out) / "lms" / args.to)
    for line in lms.export(args.out, args.to, dest, title=args.title, roster=args.roster,
                           submissions=args.submissions, lms_regex=args.lms_regex or intake.LMS_REGEX):
        print(shown.line(line))
    return 0


def _cli_gradescope(args) -> int:
    from autograder.lms import exports as lms

    r = lms.run_gradescope(args.lab, args.submission, args.results, course=args.course, sandbox=args.sandbox,
                           open_kit=args.open_kit)
    print(f"{r['score']:g} points; wrote {args.results}")
    return 0


def _cli_similarity(args) -> int:
    from dataclasses import replace

    from autograder.grade import default_out
    from autograder.gradebook import similarity

    cfg = similarity.SimilarityConfig()
    cfg = replace(cfg, **{k: v for k, v in (("min_similarity", args.min_similarity), ("z", args.z)) if v is not None})
    pairs, txt = similarity.run(args.assignment, args.submissions, course=args.course,
                                out=args.out or default_out(args.assignment), starter=args.starter, cfg=cfg,
                                lms_regex=args.lms_regex, progress=not args.no_progress, roster=args.roster)
    print(shown.block(txt.read_text()), end="")
    print(f"wrote {txt} and {txt.with_suffix('.json')}")
    return 0


def _cli_variant(args) -> int:
    from autograder.base import course_secret
    from autograder.checks import lab3_variants

    secret = course_secret.for_grading(args.open_kit)
    students: list[str | None] = list(args.student)
    if args.roster:
        students += lab3_variants.roster_ids(args.roster)
    students = list(dict.fromkeys(students)) or [None]
    for s, path in zip(students, lab3_variants.write(args.out, students, secret), strict=True):
        key = lab3_variants.answer_key(lab3_variants.spec_for(s, secret))
        print(f"{s or '(common)'}: {path}" + (f"  key: {key}" if args.show_key else ""))
    print(f"{len(students)} variant(s) from the {secret.label}")
    return 0


def _cli_secret(args) -> int:
    from autograder.base import course_secret

    print(course_secret.new_secret())
    return 0

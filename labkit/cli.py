"""The `labkit` command line: one subcommand per course tool.

Each module below that exists contributes its subcommands through an `add_cli(subparsers)` function.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from labkit.env import LabkitError

# In the order `labkit --help` lists them.
MODULES = [
    "labkit.env",
    "labkit.train",
    "labkit.compile_artifacts",
    "labkit.ddp",
    "labkit.floats",
    "labkit.matmul",
    "labkit.amp",
    "labkit.loader_bench",
    "labkit.profiling",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="Make deep learning training fast, and prove it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        mod = importlib.import_module(name)
        if hasattr(mod, "add_cli"):
            mod.add_cli(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None, prog: str,
        interrupted: str = "interrupted") -> int:
    """Parse `argv` and call the chosen subcommand's `func`; its exit code.

    A LabkitError becomes one line on stderr (exit 2), Ctrl-C prints `interrupted` (exit 130), no subcommand
    prints the help (exit 2). Shared by `labkit` and `python -m autograder`.
    """
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LabkitError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: {interrupted}", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, "labkit")


if __name__ == "__main__":
    sys.exit(main())

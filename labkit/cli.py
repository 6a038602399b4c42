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
    "labkit.ddp",
    "labkit.floats",
    "labkit.matmul",
    "labkit.amp",
    "labkit.loaders",
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LabkitError as e:
        print(f"labkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"labkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

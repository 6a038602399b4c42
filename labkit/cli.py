"""The `labkit` command line: one subcommand per course tool.

`COMMANDS` is the one list of subcommands: the module whose `add_cli(subparsers)` defines each, the line
`labkit --help` shows for it, and the options through which it writes results. Only the module of the command
that runs is imported, so `labkit --help` answers without loading torch; a test checks that this list and the
modules agree.

Output options are handled here, for every command alike, before the command does any work: the path must be
writable (else one line and exit 2), and where an earlier run already wrote there, this run goes to a
timestamped name next to it unless `--overwrite` (added to every command that writes) says to replace it.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
from dataclasses import dataclass, field

from labkit.errors import LabkitError
from labkit.outputs import prepare_output


@dataclass(frozen=True)
class Command:
    """One `labkit` subcommand, as the command line knows it before importing its module."""

    module: str                                 # the module whose add_cli defines it
    help: str                                   # its line in `labkit --help`
    writes: dict = field(default_factory=dict)  # {option dest: "file" | "dir"} through which it writes results
    read_only_with: tuple = ()                  # options with which it writes nothing (outputs left alone)


COMMANDS: dict[str, Command] = {
    "doctor": Command("labkit.env", "print the environment, capabilities and what the course can run here",
                      {"json": "file"}),
    "ladder": Command("labkit.train", "run the ResNet-18 optimization ladder and write a table, JSON and chart",
                      {"json": "file", "out": "dir"}, ("list",)),
    "train": Command("labkit.train", "train ResNet-18 with one ladder preset (and overrides)", {"json": "file"}),
    "compile-cache": Command("labkit.faststart.warmstart", "save torch.compile's work once per card and torch "
                                                         "version, or show whether this machine has it"),
    "ddp": Command("labkit.ddp", "train a ladder rung on several processes with DistributedDataParallel",
                   {"json": "file", "profile": "dir"}),
    "formats": Command("labkit.floats", "floating-point formats: property table, decode values, check rounding",
                       {"plot": "file"}),
    "matmul": Command("labkit.matmul", "matmul TFLOP/s by dtype and shape, TF32 speedup, roofline, kernel names",
                      {"json": "file", "plot": "file"}),
    "amp": Command("labkit.amp", "mixed precision: .half() vs autocast race, hand-made scaler vs GradScaler, "
                                 "bytes per parameter", {"json": "file"}),
    "data": Command("labkit.loader_bench", "loader-only throughput: storage formats, decoders, worker sweeps, "
                                           "padding", {"out": "dir"}),
    "profile": Command("labkit.profiling", "profile a few training steps, write the trace, print the diagnosed "
                                           "bottleneck", {"out": "dir"}, ("list", "trace")),
}


def build_parser(load: list[str] | None = None) -> argparse.ArgumentParser:
    """The `labkit` parser, with the full options of the commands in `load` (None: all of them).

    Commands not loaded get a placeholder with their help line only, so their modules stay unimported.
    """
    parser = argparse.ArgumentParser(prog="labkit", description="Make deep learning training fast, and prove it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {COMMANDS[c].module for c in (COMMANDS if load is None else load)}
    for name, cmd in COMMANDS.items():
        if name in sub.choices:
            continue  # registered by an earlier command's module (labkit.train defines ladder and train)
        if cmd.module in modules:
            importlib.import_module(cmd.module).add_cli(sub)
        else:
            sub.add_parser(name, help=cmd.help, add_help=False)
    for name, cmd in COMMANDS.items():
        if cmd.writes and name in sub.choices and (load is None or name in load):
            sub.choices[name].add_argument(
                "--overwrite", action="store_true",
                help="replace an earlier run's results at the output path (default: write this run to a new "
                     "timestamped name next to it)")
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def prepare_outputs(args: argparse.Namespace, cmd: Command, prog: str) -> None:
    """Check each output option of `cmd` set in `args` and point it at where this run writes (`labkit.outputs`)."""
    if any(getattr(args, opt, None) for opt in cmd.read_only_with):
        return
    for dest, kind in cmd.writes.items():
        path = getattr(args, dest, None)
        if path:
            where = prepare_output(path, kind, overwrite=getattr(args, "overwrite", False),
                                   what=f"--{dest.replace('_', '-')}",
                                   log=lambda msg: print(f"{prog} {args.command}: {msg}", file=sys.stderr))
            setattr(args, dest, os.fspath(where))


def run(parser: argparse.ArgumentParser, argv: list[str] | None, prog: str,
        interrupted: str = "interrupted", commands: dict[str, Command] | None = None) -> int:
    """Parse `argv` and call the chosen subcommand's `func`; its exit code.

    The output options that `commands` names for the chosen subcommand are checked by `prepare_outputs` before it
    runs. A LabkitError becomes one line on stderr (exit 2), Ctrl-C prints `interrupted` (exit 130), no
    subcommand prints the help (exit 2). Shared by `labkit` and `python -m autograder`.
    """
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in (commands or {}):
            prepare_outputs(args, commands[args.command], prog)
        return int(args.func(args) or 0)
    except LabkitError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: {interrupted}", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _command(argv)
    parser = build_parser([name] if name in COMMANDS else [])
    return run(parser, argv, "labkit", commands=COMMANDS)


def console() -> None:
    """The `labkit` command (and `python -m labkit`): `main()`, then `leave` with its exit code."""
    leave(main())


def leave(code: int) -> None:
    """Exit with `code` once the command is done, without the interpreter's teardown where nothing needs it.

    After the result is written, a process that imported torch spent 0.4 s tearing down its modules on this
    project's CI machine, 1.0 s with torch.compile's (`labkit train` of a compiled rung), and a student waits for
    that before the prompt returns. Exit handlers still run (temporary folders, logging, multiprocessing's
    children, inductor's compile workers) and output is flushed; only the freeing of what the process is about to
    lose anyway is skipped. A thread that is not a daemon would be waited for, so with one alive the interpreter
    exits as usual; LABKIT_FAST_EXIT=0 does so always (to measure the difference).
    """
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others or os.environ.get("LABKIT_FAST_EXIT", "1") == "0":
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing left to write
            pass
    try:  # C libraries' buffered output (stdout to a pipe is block-buffered in C too)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows)
        pass
    os._exit(code)


if __name__ == "__main__":
    console()

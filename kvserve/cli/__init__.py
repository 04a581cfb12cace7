"""The `kvserve` command line: one sub-command module per subsystem.

Each module in COMMANDS defines `register(subparsers)`, which adds its parser and sets `func`. Modules are
imported when the command line is built, so they must keep heavy imports (torch, the engine) inside the
function that runs the command.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from kvserve._version import __version__
from kvserve.options import add_foreign_flags
from kvserve.threads import apply_thread_defaults

# name -> module under kvserve.cli; a module that is not there yet is skipped.
COMMANDS = (
    "generate",
    "serve",
    "bench",
    "plan",
    "simulate",
    "eval",
    "train_demo",
    "check",
    "quantize",
    "tp_node",
    "engine_core",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kvserve.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvserve.cli.{name}":
                continue
            raise
        module.register(subparsers)
    show_defaults(parser)
    finite_floats_only(parser)
    for sub in _subparsers(parser):  # the commands with the engine's flags: serve, generate, ...
        if "--max-num-seqs" in sub._option_string_actions:
            add_foreign_flags(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                found += _subparsers(sub)
    return found


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` should name this option's default: it has a real one (not None, not a
    flag's False) that its help text does not already state."""
    if not action.option_strings or action.help in (None, argparse.SUPPRESS):
        return False
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return False
    text = action.help
    return "%(default)" not in text and "default" not in text and str(action.default) not in text


def finite_float(text: str) -> float:
    """argparse type for every float option: a finite number ("nan" passes checks written as
    `x <= 0`, and "inf" overflows durations). Options
    that mean something by inf (a request rate) parse their own text."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_floats_only(parser: argparse.ArgumentParser) -> None:
    """Give every option declared with `type=float`, in every sub-command, `finite_float`."""
    for sub in _subparsers(parser):
        for action in sub._actions:
            if action.type is float:
                action.type = finite_float


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append '(default: X)' to every option's help that does not state its default, in every
    sub-command (one pass here instead of a formatter class per parser)."""
    for sub in _subparsers(parser):
        for action in sub._actions:
            if shows_default(action):
                action.help = f"{action.help} (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    # Before anything imports torch: OpenMP reads its variables once (kvserve/threads.py).
    apply_thread_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from kvserve.core.errors import KVServeError

    try:
        return int(args.func(args) or 0)
    except KVServeError as exc:  # bad input the user can fix: a message, not a traceback
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. an output path that cannot be created
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

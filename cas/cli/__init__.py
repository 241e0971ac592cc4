"""The `cas` command line.

The store comes from `--store PATH` (before or after the command name), else $CAS_STORE, else
the current folder. Exit status: 0 fine, 1 a check found a problem, 2 usage error or bad input,
always with a one-line message and no traceback.

base holds the registry and what commands share; commands, interop, transfer and values register
the commands by importing it; this module imports them all and runs one.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from cas.errors import CasError

from . import audit, commands, interop, transfer, values  # noqa: F401 - importing them registers their commands
from .base import COMMANDS, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, run_on_store

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cas", description="Content-addressed checkpoint store.")
    parser.add_argument("--store", help="store folder (default: $CAS_STORE, else the current folder)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, fn in COMMANDS.items():
        p = sub.add_parser(name, help=fn.cli_help, description=fn.cli_help)
        p.add_argument("--store", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if fn.cli_arguments:
            fn.cli_arguments(p)
    return parser


# A checkpoint's ints may have up to 32767 bits (store/values.py), about 9,900 digits: more than
# Python's default limit on int-to-str conversions (4,300), which made `cas show --values` and
# `cas cat` fail on them with a traceback. The commands print with room for them.
INT_DIGITS = 10_000


def main(argv: list[str] | None = None) -> int:
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0 if limit == 0 else max(limit, INT_DIGITS))
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _main(argv)
    finally:
        sys.set_int_max_str_digits(limit)
        warnings.formatwarning = formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """The library's warnings (each starts "cas: ") as the CLI's own lines, not Python's."""
    text = str(message)
    return f"{text if text.startswith('cas: ') else f'cas: {text}'}\n"


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    path = args.store or os.environ.get("CAS_STORE") or os.getcwd()
    try:
        from cas.api import Store

        fn = COMMANDS[args.command]
        if not fn.cli_opens_store:
            return fn(path, args)
        return run_on_store(fn, Store, path, args)
    except BrokenPipeError:  # `cas ls | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (CasError, OSError) as exc:
        print(f"cas: error: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(f"cas: {note}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("cas: interrupted", file=sys.stderr)
        return 130

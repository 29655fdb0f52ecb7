"""The ``kiln`` command line. Each subcommand lives in its own module with ``add_parser(sub)``.

Subcommands print JSON references on stdout and human progress on stderr; exit codes are
0 success, 2 usage error, 3 a data or promotion gate said no, 1 any other failure (with the reason).

A usage error is a bad argument: a malformed flag value (argparse), a bad recipe or setting
(``ConfigError``), or a target path kiln cannot use, found before any work starts. Every failure
ends in one line ``kiln <command>: error: <why>`` on stderr, never a traceback: an ``OSError`` that
escapes a subcommand (a full disk mid-write) is named by its path and cause.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__
from kiln.errors import ConfigError, KilnError
from kiln.util.fs import os_error_text

EXIT_FAULT = 1
EXIT_USAGE = 2
_SYMLINK_LOOP = "Symlink loop from "

# Imported lazily by name so that `kiln --help` stays fast and one broken area cannot hide the rest.
SUBCOMMAND_MODULES = (
    "kiln.cli.corpus",
    "kiln.cli.snapshot",
    "kiln.cli.validate",
    "kiln.cli.contract",
    "kiln.cli.registry",
    "kiln.cli.export",
    "kiln.cli.verify",
    "kiln.cli.keys",
    "kiln.cli.datasheet",
    "kiln.cli.reproduce",
    "kiln.cli.audit",
    "kiln.cli.stack",
    "kiln.cli.demo",
    "kiln.cli.signals",
    "kiln.cli.train",
    "kiln.cli.tokenize",
    "kiln.cli.conformance",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: DVC snapshot -> GE shard validation -> torchrun training -> gated MLflow promotion.",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def command_name(args: argparse.Namespace) -> str:
    """``snapshot restore``, ``train``: the words the user typed to pick the subcommand."""
    action = getattr(args, f"{args.command}_command", None)
    return f"{args.command} {action}" if action else str(args.command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        return _fail(args, str(exc), EXIT_USAGE)
    except KilnError as exc:
        return _fail(args, str(exc), EXIT_FAULT)
    except OSError as exc:
        return _fail(args, os_error_text(exc), EXIT_FAULT)
    except RuntimeError as exc:
        # Python 3.11's Path.resolve() reports a symlink loop (ELOOP) as a RuntimeError, not an
        # OSError: a path argument that loops is a usage error like any other unusable path.
        looped = str(exc).removeprefix(_SYMLINK_LOOP)
        if looped == str(exc):
            raise
        path = looped[1:-1] if len(looped) > 1 and looped[0] == looped[-1] in "'\"" else looped  # pathlib's %r
        return _fail(args, f"{path}: Too many levels of symbolic links (a symlink loop)", EXIT_USAGE)
    except KeyboardInterrupt:
        return 130


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    print(f"kiln {command_name(args)}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

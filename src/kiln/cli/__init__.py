"""The ``kiln`` command line. Each subcommand lives in its own module with ``add_parser(sub)``.

Subcommands print JSON references on stdout and human progress on stderr; exit codes are
0 success, 2 usage error, 3 a data or promotion gate said no, 1 any other failure (with the reason).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__
from kiln.errors import KilnError

# Imported lazily by name so that `kiln --help` stays fast and one broken area cannot hide the rest.
SUBCOMMAND_MODULES = (
    "kiln.cli.corpus",
    "kiln.cli.snapshot",
    "kiln.cli.validate",
    "kiln.cli.registry",
    "kiln.cli.audit",
    "kiln.cli.stack",
    "kiln.cli.demo",
    "kiln.cli.signals",
    "kiln.cli.train",
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KilnError as exc:
        print(f"kiln {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

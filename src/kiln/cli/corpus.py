"""``kiln corpus build``: write the sample corpus (Python stdlib sources as Parquet shards)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.data.corpus import DEFAULT_MAX_BYTES, POISON_KINDS, build_corpus
from kiln.errors import ConfigError


def _poison_help() -> str:
    width = max(len(k) for k in POISON_KINDS)
    lines = [f"  {k.name:<{width}}  {k.description}\n  {'':<{width}}    trips {k.trips}" for k in POISON_KINDS.values()]
    return (
        "poison kinds (each makes one shard break exactly one rule of the stdlib-py contract;\n"
        "see data_contracts/stdlib-py/README.md):\n" + "\n".join(lines)
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    corpus = subparsers.add_parser(
        "corpus",
        help="build the sample corpus",
        description="Sample corpora for demos and tests.",
    )
    actions = corpus.add_subparsers(dest="corpus_command", metavar="COMMAND", required=True)
    build = actions.add_parser(
        "build",
        help="write Parquet shards of the Python standard library's own sources",
        description=(
            "Write DIR/train/shard-NNNNN.parquet and a held-out DIR/eval/eval-00000.parquet from the "
            "Python standard library's .py files on this machine (no download). Same arguments → "
            "byte-identical files. Prints a JSON summary on stdout, including which shard got which "
            "poison (that map is never written inside DIR)."
        ),
        epilog=_poison_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument("--out", required=True, type=Path, metavar="DIR", help="corpus directory to write")
    build.add_argument("--shards", type=int, default=8, metavar="N", help="number of training shards (default 8)")
    build.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the file split and poison placement (default 0)")
    build.add_argument(
        "--poison",
        action="extend",
        nargs="+",
        default=[],
        choices=list(POISON_KINDS),
        metavar="KIND",
        help="poison one shard per KIND (repeatable; kinds listed below)",
    )
    build.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="B",
        help=f"text budget of the whole corpus in bytes (default {DEFAULT_MAX_BYTES})",
    )
    build.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    try:
        summary = build_corpus(args.out, shards=args.shards, seed=args.seed, poison=args.poison, max_bytes=args.max_bytes)
    except ConfigError as exc:
        print(f"kiln corpus build: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0

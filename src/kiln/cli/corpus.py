"""``kiln corpus``: build the sample corpus, import your own, list the corpora kiln knows.

::

    kiln corpus build --out DIR                   the sample corpus (Python stdlib sources as Parquet shards)
    kiln corpus import SRC --name NAME --format jsonl|parquet|text [...]
                                                  your own text, as corpus NAME under the corpus root
    kiln corpus build-text --out FILE [--man N]   natural-language text found on the machine, as JSON lines
    kiln corpus list [--json]                     the corpora under the corpus root, with their kind and contract
"""

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
        help="build the sample corpus, import your own text, list corpora",
        description="Corpora: the sample corpus for demos and tests, your own text imported, the registry of them.",
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
    _add_import_parser(actions)
    text = actions.add_parser(
        "build-text",
        help="write natural-language text found on this machine as JSON lines, for `kiln corpus import`",
        description=(
            "Write FILE: JSON lines {id, text, source} of English prose no one here wrote — the Python reference's "
            "pydoc topics (every CPython ships them) and Debian's /usr/share/common-licenses (on every Debian "
            "machine), and, with --man, the man pages of the given sections (not on slim container images). "
            "Cut at paragraphs into documents of at most 4 KiB; the same machine gives the same bytes. Then: "
            "kiln corpus import FILE --name NAME --format jsonl --id-field id"
        ),
    )
    text.add_argument("--out", required=True, type=Path, metavar="FILE", help="JSON lines file to write")
    text.add_argument("--man", action="extend", nargs="+", default=[], metavar="N",
                      help="also the man pages of these sections (1-9) under /usr/share/man")
    text.set_defaults(func=_build_text)
    listing = actions.add_parser(
        "list", help="list the corpora under the corpus root",
        description="List the corpora under the corpus root (the DVC workspace's corpora/ folder, where the DAGs "
                    "find a corpus by name) with the kind of text and the contract each was made for.",
    )
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    listing.set_defaults(func=_list)


def _add_import_parser(actions: argparse._SubParsersAction) -> None:
    from kiln.data.corpora import TEXT_KINDS
    from kiln.data.corpus_import import DEFAULT_EVAL_FRACTION, DEFAULT_SHARD_BYTES, FORMATS

    imp = actions.add_parser(
        "import",
        help="import your own text (JSON lines, Parquet, a tree of text files) as a kiln corpus",
        description=(
            "Read SRC (a file or a directory tree) and write corpus NAME in kiln's layout: Parquet shards "
            "train/shard-NNNNN.parquet and a held-out split eval/eval-NNNNN.parquet (doc_id, text, source), "
            "and corpus.json (kind of text, contract, source, split). By default under the corpus root, where "
            "`kiln snapshot create` and the DAGs find it by name. Constant memory whatever the input size; the "
            "same input gives byte-identical files; bad input is refused naming the file and line or row, and "
            "leaves nothing behind. Prints a JSON summary on stdout."
        ),
        epilog=(
            "formats:\n"
            "  jsonl    one JSON object per line (.jsonl, .ndjson, .json; gzip or zstd compressed too); the\n"
            "           document is the string field --text-field; ids: --id-field, else FILE:LINE\n"
            "  parquet  the string column --text-field of .parquet files; ids: --id-field, else FILE#ROW\n"
            "  text     every (non-hidden) file of a tree is one UTF-8 document; its id is its path\n"
            "inside a tree only regular files are read: a symlink is skipped and named, a FIFO, socket or\n"
            "device is refused; --replace replaces only a corpus kiln wrote (its corpus.json, its shards).\n"
            "held-out split: a document goes to eval/ when the blake2b hash of its text keyed by --seed falls\n"
            "below --eval-fraction: identical texts always land on the same side."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("src", type=Path, metavar="SRC", help="input file or directory")
    imp.add_argument("--name", required=True, metavar="NAME",
                     help="corpus name: [a-z0-9][a-z0-9_.-]*, at most 64 characters")
    imp.add_argument("--format", required=True, choices=FORMATS, help="input format")
    imp.add_argument("--text-field", default="text", metavar="F", help="field/column holding the text (default: text)")
    imp.add_argument("--id-field", default=None, metavar="F",
                     help="field/column holding each document's id (default: ids from file and line or row)")
    imp.add_argument("--shard-bytes", default=str(DEFAULT_SHARD_BYTES), metavar="B",
                     help=f"UTF-8 text per training shard, e.g. 64M (default {DEFAULT_SHARD_BYTES // 2**20}M)")
    imp.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, metavar="X",
                     help=f"share of documents held out for evaluation (default {DEFAULT_EVAL_FRACTION})")
    imp.add_argument("--seed", type=int, default=0, metavar="S", help="key of the split hash (default 0)")
    imp.add_argument("--kind", choices=list(TEXT_KINDS), default="natural-language",
                     help="kind of text, which decides the contracts that fit it (default natural-language)")
    imp.add_argument("--contract", default=None, metavar="NAME[@V]",
                     help="contract the corpus is made for (default: the latest made for --kind: "
                          + ", ".join(f"{k} -> {v}" for k, v in TEXT_KINDS.items()) + ")")
    imp.add_argument("--root", type=Path, default=None, metavar="DIR",
                     help="write the corpus to DIR/NAME instead of the configured corpus root (KILN_HOME's "
                          "dvc-repo/corpora, where the DAGs look)")
    imp.add_argument("--replace", action="store_true", help="replace an existing corpus at the target")
    imp.set_defaults(func=_import)


def _import(args: argparse.Namespace) -> int:
    from kiln.data.corpora import corpus_root
    from kiln.data.corpus_import import ImportConfig, import_corpus, parse_byte_size

    config = ImportConfig(name=args.name, format=args.format, text_field=args.text_field, id_field=args.id_field,
                          shard_bytes=parse_byte_size(args.shard_bytes), eval_fraction=args.eval_fraction,
                          seed=args.seed, kind=args.kind, contract=args.contract)
    out = (args.root if args.root is not None else corpus_root()) / config.name
    summary = import_corpus(args.src, out, config, replace=args.replace)
    for entry in summary["skipped"]:
        print(f"skipped {entry['path']}: {entry['reason']}", file=sys.stderr)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _build_text(args: argparse.Namespace) -> int:
    from kiln.data.prose import build_prose

    print(json.dumps(build_prose(args.out, args.man), indent=2, sort_keys=True))
    return 0


def _list(args: argparse.Namespace) -> int:
    from kiln.data.corpora import corpus_root, list_corpora

    entries = list_corpora()
    if args.json:
        print(json.dumps([{"name": e.name, "path": str(e.path), "problem": e.problem,
                           "metadata": e.metadata.to_json() if e.metadata else None} for e in entries], indent=2))
        return 0
    if not entries:
        print(f"no corpora under {corpus_root()}", file=sys.stderr)
    for e in entries:
        print(e.label())
    return 0


def handler(args: argparse.Namespace) -> int:
    try:
        summary = build_corpus(args.out, shards=args.shards, seed=args.seed, poison=args.poison, max_bytes=args.max_bytes)
    except ConfigError as exc:
        print(f"kiln corpus build: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0

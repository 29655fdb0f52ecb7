"""``kiln contract``: draft a data contract from a corpus, and check a contract file.

    kiln contract init NAME --from CORPUS_DIR [--out FILE] [--base web-text@1] [--text-column text] [--version N]
    kiln contract check FILE

``init`` profiles a sample of ``CORPUS_DIR/train/*.parquet`` (``kiln.data.authoring``) and writes a
draft contract for a person to review: columns, types, length ranges and the document rules'
thresholds at observed quantiles, with what was observed in ``meta.kiln_profile``. It never
overwrites a file (a published contract version is never edited). ``check`` names every bad field
of a contract file, one per line on stderr, then one ``kiln contract check: error:`` line.

Exit codes: 0 written / no problem; 1 problems found (``check``) or a fault; 2 usage errors (an
unusable ``--out``, a corpus without shards, an unknown base contract).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.cli.args import positive_int, refuse_unusable_target


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("contract", help="draft a data contract from a corpus, or check a contract file")
    actions = parser.add_subparsers(dest="contract_command", metavar="ACTION", required=True)
    init = actions.add_parser(
        "init", help="profile a corpus sample and write a draft contract to review",
        description="Profile a sample of CORPUS_DIR/train/*.parquet and write a draft contract (columns, types, length "
                    "ranges, document-rule thresholds at observed quantiles) for a person to review.",
    )
    init.add_argument("name", metavar="NAME", help="contract name, e.g. my-corpus")
    init.add_argument("--from", dest="corpus_dir", required=True, type=Path, metavar="CORPUS_DIR",
                      help="corpus directory with train/*.parquet")
    init.add_argument("--out", type=Path, default=None, metavar="FILE",
                      help="where to write the draft (default: NAME.vVERSION.draft.json here); never overwritten")
    init.add_argument("--base", default="web-text@1", metavar="NAME@VERSION",
                      help="contract whose rules the draft starts from (default: web-text@1)")
    init.add_argument("--text-column", default="text", help="the column holding the documents (default: text)")
    init.add_argument("--version", type=positive_int, default=1, help="meta.kiln.version of the draft (default: 1)")
    init.set_defaults(func=_init)
    check = actions.add_parser("check", help="name every bad field of a contract file",
                               description="Check a contract file: JSON, structure, each expectation as Great "
                                           "Expectations parses it, document rules against datatrove's parameters.")
    check.add_argument("file", type=Path, metavar="FILE", help="contract JSON, e.g. data_contracts/web-text/v1.json")
    check.set_defaults(func=_check)


def _init(args: argparse.Namespace) -> int:
    from kiln.data.authoring import draft_contract
    from kiln.data.contracts import contract_problems
    from kiln.errors import ConfigError, ContractError, KilnError
    from kiln.util.fs import atomic_write_text

    out = args.out if args.out is not None else Path(f"{args.name}.v{args.version}.draft.json")
    if out.exists() or out.is_symlink():
        raise ConfigError(f"--out {out} already exists: a contract file is never overwritten (choose another --out)")
    refuse_unusable_target("--out", out, directory=False)
    if not args.corpus_dir.is_dir():
        raise ConfigError(f"--from {args.corpus_dir}: not a directory")
    try:
        suite, profile = draft_contract(args.name, args.corpus_dir, version=args.version, base=args.base,
                                        text_column=args.text_column)
    except ContractError as exc:
        raise ConfigError(f"--base {args.base}: {exc}") from exc
    problems = contract_problems(suite, name=args.name, version=args.version)
    if problems:  # a draft kiln cannot load would be a bug here, not the user's to fix
        raise KilnError(f"the draft contract has problems: {'; '.join(problems)}")
    atomic_write_text(out, json.dumps(suite, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote a draft contract to {out}: review it, then publish it as data_contracts/{args.name}/"
          f"v{args.version}.json", file=sys.stderr)
    print(json.dumps({"draft": str(out.resolve()), "name": args.name, "version": args.version, "base": profile["base"],
                      "documents_profiled": profile["documents"], "shards_profiled": len(profile["shards_sampled"]),
                      "document_rules_would_drop": profile["document_rules_would_drop"]}, indent=2, sort_keys=True))
    return 0


def _check(args: argparse.Namespace) -> int:
    from kiln.data.authoring import check_contract_file
    from kiln.errors import ContractError

    problems = check_contract_file(args.file)
    for problem in problems:
        print(f"{args.file}: {problem}", file=sys.stderr)
    print(json.dumps({"file": str(args.file), "ok": not problems, "problems": problems}, indent=2))
    if problems:  # the one error line every failing kiln command ends with (exit 1)
        raise ContractError(f"{len(problems)} problem(s) in {args.file}, listed above")
    return 0

"""``kiln validate``: check a corpus directory or snapshot against a data contract.

Exit codes: 0 the quarantined share is within the threshold; 3 it is not (data gate breached);
2 usage errors (bad arguments, unknown contract, a target that is neither a corpus directory nor a
snapshot id); 1 any other fault (e.g. a snapshot that cannot be restored).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from kiln.errors import ContractError, DataGateError, KilnError
from kiln.policy import SANDBOX

EXIT_OK = 0
EXIT_FAULT = 1
EXIT_USAGE = 2
EXIT_GATE = 3

_SNAPSHOT_ID = re.compile(r"^[0-9a-f]{32}\.dir$")


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {share}")
    return share


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "validate",
        help="validate corpus shards against a data contract (quarantine + data gate)",
        description=(
            "Validate every training shard (DIR/train/*.parquet) of a corpus directory or DVC snapshot "
            "against a data contract, write a report listing every shard with its verdict and reasons, "
            "and apply the data gate. Exit 0: quarantined share within the threshold; 3: above it; "
            "2: usage error; 1: other failure."
        ),
    )
    parser.add_argument("target", metavar="DIR_OR_SNAPSHOT_ID", help="corpus directory, or a DVC snapshot id <md5>.dir")
    parser.add_argument("--contract", required=True, metavar="NAME[@VERSION]", help="data contract, e.g. stdlib-py@1")
    parser.add_argument("--report", required=True, type=Path, metavar="REPORT.json", help="where to write the report")
    parser.add_argument(
        "--manifest-out",
        type=Path,
        metavar="MANIFEST.json",
        help="write the TrainingManifest (healthy shards only) here; not written when the gate fails",
    )
    parser.add_argument(
        "--max-quarantine-share",
        type=_share,
        default=SANDBOX.max_quarantine_share,
        metavar="SHARE",
        help=f"data gate threshold in [0, 1] (default: the sandbox policy's, {SANDBOX.max_quarantine_share})",
    )
    parser.set_defaults(func=handler)


def _fail(code: int, message: str) -> int:
    print(f"kiln validate: error: {message}", file=sys.stderr)
    return code


def handler(args: argparse.Namespace) -> int:
    from kiln.contracts import load_contract

    try:
        contract = load_contract(args.contract)
    except ContractError as exc:
        return _fail(EXIT_USAGE, str(exc))

    target = str(args.target)
    if _SNAPSHOT_ID.match(target):
        from kiln.snapshot import checkout_snapshot

        try:
            ref = checkout_snapshot(target)
        except KilnError as exc:
            return _fail(EXIT_FAULT, f"cannot check out snapshot {target}: {exc}")
        corpus_dir, snapshot_id, corpus = Path(ref.path), ref.id, ref.corpus
    elif Path(target).is_dir():
        corpus_dir = Path(target)
        # Not a DVC snapshot: say so in the manifest instead of inventing an id.
        snapshot_id, corpus = f"unversioned:{os.path.abspath(target)}", Path(target).resolve().name
    else:
        return _fail(EXIT_USAGE, f"{target!r} is neither a corpus directory nor a snapshot id (<md5>.dir)")

    from kiln import validation

    shards = validation.train_shards(corpus_dir)
    if not shards:
        return _fail(EXIT_USAGE, f"{corpus_dir} has no training shards ({validation.TRAIN_GLOB})")
    try:
        reports = validation.validate_directory(corpus_dir, contract)
        validation.write_quarantine_report(
            reports, args.report, snapshot_id=snapshot_id, max_quarantine_share=args.max_quarantine_share
        )
    except KilnError as exc:
        return _fail(EXIT_FAULT, str(exc))

    bad = [r for r in reports if r.verdict != "healthy"]
    for r in bad:
        rules = ", ".join(sorted({reason["expectation"] for reason in r.reasons}))
        print(f"quarantined {Path(r.path).name}: {rules}", file=sys.stderr)
    summary = {
        "target": target,
        "snapshot_id": snapshot_id,
        "contract": contract.ref,
        "shards": len(reports),
        "healthy": len(reports) - len(bad),
        "quarantined": [r.path for r in bad],
        "quarantined_share": round(validation.quarantined_share(reports), 6),
        "max_quarantine_share": args.max_quarantine_share,
        "report": str(args.report),
        "gate": "pass",
        "manifest": None,
    }
    code = EXIT_OK
    try:
        validation.gate(reports, args.max_quarantine_share, expected_paths=shards)
    except DataGateError as exc:
        print(f"kiln validate: {exc}", file=sys.stderr)
        summary["gate"], code = "fail", EXIT_GATE

    if code == EXIT_OK and args.manifest_out is not None:
        try:
            manifest = validation.build_training_manifest(
                snapshot_id, corpus, contract, reports, validation.eval_shards(corpus_dir)
            )
            manifest.write(args.manifest_out)
        except KilnError as exc:
            return _fail(EXIT_FAULT, str(exc))
        summary["manifest"], summary["manifest_sha256"] = str(args.manifest_out), manifest.sha256
    print(json.dumps(summary, indent=2, sort_keys=True))
    return code

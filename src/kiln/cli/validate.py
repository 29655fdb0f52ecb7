"""``kiln validate``: check a corpus directory or snapshot against a data contract.

Exit codes: 0 the quarantined share is within the threshold; 3 it is not (data gate breached);
2 usage errors (bad arguments, unknown contract, a target that is neither a corpus directory nor a
snapshot id, a ``--report`` / ``--manifest-out`` that cannot be written there: missing or read-only
folder, a directory or device in its place, both the same file, a path inside the corpus); 1 any
other fault (e.g. a snapshot that cannot be restored, a disk that fills up while writing).

The outputs are checked before any shard is read, and each is written atomically: a failed write
leaves what was there before, and no manifest is written after a failed report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kiln.data.snapshot import SNAPSHOT_ID
from kiln.errors import ContractError, DataGateError, KilnError
from kiln.policy import SANDBOX
from kiln.util.fs import check_file_target, names_a_bad_path, os_error_cause

EXIT_OK = 0
EXIT_FAULT = 1
EXIT_USAGE = 2
EXIT_GATE = 3

def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {share}")
    return share


def add_parser(subparsers: argparse._SubParsersAction) -> None:
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
    parser.add_argument(
        "--report", required=True, type=Path, metavar="REPORT.json",
        help="where to write the report (in an existing folder, outside the corpus)",
    )
    parser.add_argument(
        "--manifest-out",
        type=Path,
        metavar="MANIFEST.json",
        help="write the TrainingManifest (healthy shards only) here, not the --report file; not written when the gate fails",
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


def _outputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    named = [("--report", args.report), ("--manifest-out", args.manifest_out)]
    return [(flag, path) for flag, path in named if path is not None]


def _same_file(a: Path, b: Path) -> bool:
    """Also through other spellings, a symlink (to the file or a folder above it) or a hard link."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _unwritable_output(args: argparse.Namespace) -> tuple[int, str] | None:
    """Why an output cannot be written, as ``(exit code, message)``; checked before any work."""
    for flag, path in _outputs(args):
        try:
            check_file_target(path)
        except OSError as exc:
            return _write_failure(flag, path, exc)
    if args.manifest_out is not None and _same_file(args.report, args.manifest_out):
        return EXIT_USAGE, (
            f"--report {args.report} and --manifest-out {args.manifest_out} are the same file: "
            "the manifest would overwrite the report"
        )
    return None


def _write_failure(flag: str, path: Path, exc: OSError) -> tuple[int, str]:
    code = EXIT_USAGE if names_a_bad_path(exc) else EXIT_FAULT
    return code, f"cannot write {flag} {path}: {os_error_cause(exc, path)}"


def _output_inside(args: argparse.Namespace, corpus_dir: Path) -> str | None:
    """An output inside the corpus would change the data it reports on (or replace a shard)."""
    root = os.path.realpath(corpus_dir)
    for flag, path in _outputs(args):
        if os.path.commonpath([root, os.path.realpath(path)]) == root:
            return f"{flag} {path} lies inside the corpus {corpus_dir}: writing it there would change the corpus"
    return None


def handler(args: argparse.Namespace) -> int:
    from kiln.data.contracts import load_contract
    from kiln.data.layout import layout_hint

    problem = _unwritable_output(args)
    if problem is not None:
        return _fail(*problem)
    try:
        contract = load_contract(args.contract)
    except ContractError as exc:
        return _fail(EXIT_USAGE, str(exc))

    target = str(args.target)
    if SNAPSHOT_ID.fullmatch(target):
        from kiln.data.snapshot import checkout_snapshot

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

    from kiln.data import validation

    shards = validation.train_shards(corpus_dir)
    skipped = validation.skipped_train_entries(corpus_dir)
    if not shards:
        found = f"; train/ holds only {', '.join(Path(e.path).name for e in skipped)}" if skipped else ""
        return _fail(EXIT_USAGE, f"{corpus_dir} has no training shards ({validation.TRAIN_GLOB}){found}")
    inside = _output_inside(args, corpus_dir)
    if inside is not None:
        return _fail(EXIT_USAGE, inside)
    try:
        reports = validation.validate_directory(corpus_dir, contract)
    except KilnError as exc:
        return _fail(EXIT_FAULT, str(exc))
    try:
        validation.write_quarantine_report(
            reports, args.report, snapshot_id=snapshot_id, max_quarantine_share=args.max_quarantine_share, skipped=skipped
        )
    except OSError as exc:
        return _fail(*_write_failure("--report", args.report, exc))

    for entry in skipped:
        print(f"skipped {entry.path}: {entry.reason}", file=sys.stderr)
    bad = [r for r in reports if r.verdict != "healthy"]
    for r in bad:
        rules = ", ".join(sorted({reason["expectation"] for reason in r.reasons}))
        errors = "; ".join(reason["error"] for reason in r.reasons if reason.get("error"))
        print(f"quarantined {Path(r.path).name}: {rules}" + (f" ({errors})" if errors else ""), file=sys.stderr)
    summary = {
        "target": target,
        "snapshot_id": snapshot_id,
        "contract": contract.ref,
        "shards": len(reports),
        "healthy": len(reports) - len(bad),
        "quarantined": [r.path for r in bad],
        "skipped": [e.path for e in skipped],
        "quarantined_share": round(validation.quarantined_share(reports), 6),
        "max_quarantine_share": args.max_quarantine_share,
        "report": str(args.report),
        "gate": "pass",
        "manifest": None,
    }
    if contract.drops_documents:
        # What leaves training besides the quarantined shards: the healthy shards' dropped documents.
        dropped = validation.report.dropped_summary(reports)
        kept = dropped["healthy_shards"]
        summary["documents_dropped"] = {"documents": kept["documents"], "of_documents": kept["of_documents"],
                                        "by_rule": kept["by_rule"]}
        # The quarantine report's hint (kiln.data.layout): most drops are hard-wrapped text judged line by line.
        hint = layout_hint(dropped["all_shards"], [contract.ref])
        if hint:
            summary["hint"] = hint
            print(f"hint: {hint}", file=sys.stderr)
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
        except KilnError as exc:
            return _fail(EXIT_FAULT, str(exc))
        except OSError as exc:  # an eval file vanished or changed since it was read
            return _fail(EXIT_FAULT, f"cannot hash the eval split of {corpus_dir}: {exc}")
        try:
            manifest.write(args.manifest_out)
        except OSError as exc:
            return _fail(*_write_failure("--manifest-out", args.manifest_out, exc))
        summary["manifest"], summary["manifest_sha256"] = str(args.manifest_out), manifest.sha256
    print(json.dumps(summary, indent=2, sort_keys=True))
    return code

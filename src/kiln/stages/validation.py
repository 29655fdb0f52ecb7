"""Shard validation and the data gate: quarantine report, TrainingManifest of the healthy shards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln import runs
from kiln.errors import ConfigError, DataGateError, ManifestError, RunMismatchError
from kiln.policy import Policy
from kiln.refs import DataGateResult, PinnedSnapshot, QuarantinedShard, ShardReport, TrainingManifest, sha256_file
from kiln.runs import existing_run_dir, run_dir
from kiln.stages.records import differing_fields, mlflow_run_of, recorded_snapshot
from kiln.util.fs import atomic_write_text, read_own_json

if TYPE_CHECKING:
    from kiln.data.contracts import Contract


def shard_batches(policy: Policy, snapshot: PinnedSnapshot) -> list[list[str]]:
    """The snapshot's shards cut into the batches the mapped validation tasks take, in order."""
    shards = list(snapshot.shards)
    size = max(policy.validation_batch_shards, -(-len(shards) // policy.validation_max_tasks))
    return [shards[i : i + size] for i in range(0, len(shards), size)]


def validate_stage(policy: Policy, snapshot: PinnedSnapshot, shards: list[str], key: str,
                   source: str | None = None) -> list[ShardReport]:
    """Check a batch of shards against the policy's contract in one process (one GE context), and
    record the verdicts in the run's directory (``validation/batch-<digest>.json``): the record the
    data gate trusts, where the returned XCom is only a reference anyone may rewrite.

    Never raises for bad data: a quarantined shard is a report, not an exception. The shards are
    read from kiln's pinned copy of the snapshot (by id), never from the path ``snapshot`` names.
    ``source``: the mixture source the shards are of (its signatures kept apart, its name recorded)."""
    from kiln.data.contracts import load_contract
    from kiln.data.validation import load_eval_doc_hashes, validate_shards

    root = Path(recorded_snapshot(snapshot.id).path)
    reports = list(validate_shards([root / s for s in shards], load_contract(policy.contract), load_eval_doc_hashes(root),
                                   signatures_dir=_signatures_dir(key, source)))
    record = {"kind": runs.VALIDATION_BATCH_KIND, "snapshot_id": snapshot.id, "contract": policy.contract,
              "shards": list(shards), "reports": [r.to_json() for r in reports]}
    if source is not None:
        record["source"] = source
    # Named by the batch's shards (a mixture's by "<source>:<shard>": two sources have the same paths).
    named = list(shards) if source is None else [f"{source}:{shard}" for shard in shards]
    atomic_write_text(run_dir(key) / runs.VALIDATION_SUBDIR / runs.validation_batch(named),
                      json.dumps(record, indent=1, sort_keys=True) + "\n")
    return reports


def _signatures_dir(key: str, source: str | None = None) -> Path:
    """The run's MinHash signatures, written by the validation tasks, read by the data gate (a mixture's
    per source: near-duplicates are a contract's rule, judged within the source)."""
    folder = run_dir(key) / runs.VALIDATION_SUBDIR / runs.VALIDATION_SIGNATURES_SUBDIR
    return folder if source is None else folder / source


def recorded_shard_reports(key: str, snapshot_id: str, contract: str) -> dict[str, ShardReport]:
    """Shard path -> the verdict this run's validation tasks recorded for it, on this snapshot under
    this contract. Two records that disagree about a shard are refused (``RunMismatchError``)."""
    home = existing_run_dir(key)
    folder = (home or Path("/nonexistent")) / runs.VALIDATION_SUBDIR
    own: dict[str, ShardReport] = {}
    for path in sorted(folder.glob("batch-*.json")) if home is not None else []:
        try:
            record = read_own_json(path)
            if record.get("kind") != runs.VALIDATION_BATCH_KIND:
                raise ValueError(f"kind {record.get('kind')!r}")
            reports = [ShardReport.from_json(r) for r in record["reports"]]
        except (OSError, ValueError, KeyError, TypeError, ManifestError) as exc:
            raise RunMismatchError(f"validation record {path} of run {key} is unreadable: {exc}") from exc
        if record.get("snapshot_id") != snapshot_id or record.get("contract") != contract:
            continue  # an earlier try's, of other bytes or another contract: not evidence for this one
        for report in reports:
            seen = own.setdefault(report.path, report)
            if seen != report:
                raise RunMismatchError(f"run {key}'s validation records disagree about shard {report.path}: "
                                       f"{seen.verdict} and {report.verdict} (see {folder})")
    return own


def data_gate_stage(policy: Policy, snapshot: PinnedSnapshot, batches: list[list[ShardReport]], key: str) -> DataGateResult:
    """Cross-shard checks, the quarantine report, the gate, and the TrainingManifest (healthy shards only).

    Fails (no retry) when a shard of the snapshot has no report: a run never trains past shards
    that were not validated; and when the run already pinned another training manifest (a re-run on
    other bytes): a run trains on one snapshot."""
    from kiln.data.contracts import load_contract
    from kiln.data.validation import train_shards

    pinned_snapshot = recorded_snapshot(snapshot.id)
    root = Path(pinned_snapshot.path)
    expected = {str(p) for p in train_shards(root)}  # the snapshot's shards, not the plan's XCom
    reports = check_reports(key, snapshot.id, policy.contract, expected, [r for batch in batches for r in batch])
    out = run_dir(key)
    pinned = _pinned_training_manifest(out / runs.TRAINING_MANIFEST)
    if pinned is not None and pinned.snapshot_id != snapshot.id:
        raise RunMismatchError(
            f"run {key} already pinned training manifest {out / runs.TRAINING_MANIFEST} of snapshot "
            f"{pinned.snapshot_id}; this try's snapshot is {snapshot.id}: a run trains on one snapshot, "
            "trigger a new run for the new bytes"
        )
    # The quarantine report goes to the run's MLflow run too (the one training will log into).
    mlflow_run_id = mlflow_run_of(policy, key, {"kiln.snapshot_id": snapshot.id, "kiln.policy": policy.name})
    gated = gate_snapshot(load_contract(policy.contract), root, snapshot.id, pinned_snapshot.corpus, reports, out,
                          signatures_dir=_signatures_dir(key), max_quarantine_share=policy.max_quarantine_share,
                          mlflow_run_id=mlflow_run_id)
    shard_reports, published, manifest = gated.reports, gated.published, gated.manifest
    quarantined = [r for r in shard_reports if r.verdict == "quarantined"]
    rate = len(quarantined) / len(shard_reports) if shard_reports else 1.0
    as_gated = pinned.without_tokens() if pinned is not None else None
    if as_gated is not None and as_gated.sha256 != manifest.sha256:
        differs = differing_fields(as_gated.to_json(), manifest.to_json(), skip=frozenset({"sha256"}))
        raise RunMismatchError(
            f"run {key} already pinned training manifest {as_gated.sha256[:16]}… of snapshot {as_gated.snapshot_id}; "
            f"this try built {manifest.sha256[:16]}… from the same snapshot (differs in {', '.join(differs)}): not "
            "replacing it"
        )
    manifest_path = out / runs.TRAINING_MANIFEST
    if as_gated is None or as_gated is pinned:  # else the record is this manifest with its packed tokens: kept
        manifest.write(manifest_path)
    return DataGateResult(
        manifest=str(manifest_path),
        manifest_sha256=manifest.sha256,
        healthy=len(manifest.shards),
        quarantined=[QuarantinedShard(path=Path(r.path).name, reasons=_short_reasons(r)) for r in quarantined],
        quarantine_rate=round(rate, 4),
        report=published["json"],
        report_html=published["html"],
        report_html_uri=published.get("html_uri", ""),
        mlflow_run_id=mlflow_run_id,
        contract=policy.contract,
    )


def check_reports(key: str, snapshot_id: str, contract: str, expected: set[str], said: list[ShardReport],
                  what: str = "") -> list[ShardReport]:
    """The run's own verdicts on every shard in ``expected`` (a snapshot's, by path), in path order.

    The verdicts are the ones the validation tasks recorded, not their XComs (``said``): a rewritten
    XCom could call a poisoned shard healthy, so one that disagrees with the record is refused
    (``RunMismatchError``); a shard never validated, or a report of no shard, fails the gate.
    ``what``: which part of the run the shards are (a mixture's source), for the messages."""
    own = recorded_shard_reports(key, snapshot_id, contract)
    of = f" ({what})" if what else ""
    missing = sorted(expected - set(own))
    if missing:
        raise DataGateError(f"{len(missing)} shard(s) of snapshot {snapshot_id}{of} were never validated: {missing[:5]}")
    unplanned = sorted({r.path for r in said} - expected)
    if unplanned:
        raise DataGateError(f"{len(unplanned)} report(s) are of no shard of snapshot {snapshot_id}{of}: {unplanned[:5]}")
    # An XCom carries each report's dropped rows as a digest (ShardReport.as_xcom): compared as such.
    forged = sorted(r.path for r in said if r.as_xcom() != own[r.path].as_xcom())
    if forged:
        raise RunMismatchError(
            f"the validate_shards XComs of run {key} disagree with the run's own validation records about "
            f"{len(forged)} shard(s){of}, e.g. {forged[0]}: XCom {next(r.verdict for r in said if r.path == forged[0])}, "
            f"record {own[forged[0]].verdict} (an XCom is only a reference; refusing)"
        )
    return [own[path] for path in sorted(expected)]


@dataclass(frozen=True, slots=True)
class GatedSnapshot:
    """What the data gate made of a snapshot's shard reports: the reports after the snapshot rules,
    the published quarantine report (``publish_quarantine_report``'s paths) and the training manifest."""

    reports: list[ShardReport]
    published: dict[str, str]
    manifest: TrainingManifest


def gate_snapshot(contract: Contract, root: Path, snapshot_id: str, corpus: str, reports: list[ShardReport], out: Path,
                  *, signatures_dir: Path, max_quarantine_share: float, mlflow_run_id: str | None,
                  artifact_path: str | None = None) -> GatedSnapshot:
    """The data gate on the shard reports of the snapshot at ``root`` (every shard's, in path order):
    the snapshot rules, the quarantine report written to ``out`` (and logged to ``mlflow_run_id``),
    the gate (``DataGateError`` above ``max_quarantine_share``, once the report is written), and the
    training manifest of the healthy shards and the eval split. Pure of the run's records: the data
    gate stage and ``kiln reproduce`` both call it. ``artifact_path``: where in the MLflow run the
    report goes (default ``quarantine/``; a mixture source's, ``quarantine/<source>``)."""
    from kiln.data.validation import (
        build_training_manifest,
        cross_shard_duplicates,
        drop_near_duplicates,
        gate,
        publish_quarantine_report,
        skipped_train_entries,
    )

    # The snapshot rules, in path order whatever order the validation tasks finished in: doc ids in one
    # healthy shard only, then near-duplicate documents dropped, of each other and of the eval split (a
    # contract with near_duplicates).
    shard_reports = drop_near_duplicates(cross_shard_duplicates(reports), contract, signatures_dir=signatures_dir,
                                         eval_split=root)
    # Published before the gate (on-call needs it most when the gate fails): JSON + an HTML page.
    published = publish_quarantine_report(
        shard_reports, out, snapshot_id=snapshot_id, contract=contract, max_quarantine_share=max_quarantine_share,
        mlflow_run_id=mlflow_run_id, skipped=skipped_train_entries(root),
        **({"artifact_path": artifact_path} if artifact_path else {}),
    )
    gate(shard_reports, max_quarantine_share)
    eval_shards = [
        {"path": str(p), "sha256": sha256_file(p), "rows": _parquet_rows(p)} for p in sorted((root / "eval").glob("*.parquet"))
    ]
    if not eval_shards:
        raise ConfigError(f"snapshot {snapshot_id} has no held-out eval split under eval/")
    manifest = build_training_manifest(snapshot_id, corpus, contract.ref, shard_reports, eval_shards)
    return GatedSnapshot(reports=shard_reports, published=published, manifest=manifest)


def _pinned_training_manifest(path: Path) -> TrainingManifest | None:
    """The training manifest an earlier try of this run wrote (None: none yet)."""
    return TrainingManifest.read(path) if path.is_file() else None


def _short_reasons(report: ShardReport) -> list[str]:
    return [r.get("error") or f"{r.get('expectation')} ({r.get('unexpected_count', '?')} rows)" for r in report.reasons]


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_metadata(path).num_rows)

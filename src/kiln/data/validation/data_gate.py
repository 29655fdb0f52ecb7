"""The data gate (no retry above the quarantine threshold) and the TrainingManifest of the shards that passed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kiln.data.contracts import Contract
from kiln.data.validation.dropped import drop_rows
from kiln.errors import ContractError, DataGateError
from kiln.refs import ShardEntry, ShardReport, TrainingManifest
from kiln.util.fs import open_regular_file


def quarantined_share(reports: Sequence[ShardReport]) -> float:
    if not reports:
        return 1.0
    return sum(r.verdict != "healthy" for r in reports) / len(reports)


def gate(
    reports: Sequence[ShardReport], max_quarantine_share: float, *, expected_paths: Iterable[str | Path] | None = None
) -> None:
    """The data gate: raise ``DataGateError`` (never retried) when training must not start.

    Fails when the quarantined share exceeds ``max_quarantine_share``, when no shard is healthy,
    and, given ``expected_paths``, when any of those shards has no report (never validated).
    Run ``cross_shard_duplicates`` first: the gate judges the reports it is given.
    """
    if not 0 <= max_quarantine_share <= 1:
        raise DataGateError(f"max_quarantine_share must be within [0, 1], got {max_quarantine_share}")
    if expected_paths is not None:
        reported = {os.path.abspath(r.path) for r in reports}
        missing = sorted(os.path.abspath(p) for p in expected_paths if os.path.abspath(p) not in reported)
        if missing:
            raise DataGateError(f"data gate: {len(missing)} shard(s) were never validated: {_names(missing)}")
    if not reports:
        raise DataGateError("data gate: no shards were validated")
    bad = sorted(r.path for r in reports if r.verdict != "healthy")
    share = len(bad) / len(reports)
    if share > max_quarantine_share:
        raise DataGateError(
            f"data gate: {len(bad)}/{len(reports)} shards quarantined ({share:.1%}) exceeds the maximum "
            f"{max_quarantine_share:.1%}: {_names(bad)}"
        )
    if len(bad) == len(reports):
        raise DataGateError(f"data gate: no healthy shard among {len(reports)}: {_names(bad)}")


def _names(paths: Sequence[str], limit: int = 10) -> str:
    names = [Path(p).name for p in paths[:limit]]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(names) + more


def _shard_entry(shard: str | Path | ShardEntry | dict[str, Any]) -> dict[str, Any]:
    if isinstance(shard, ShardEntry):
        return shard.to_json()
    if isinstance(shard, dict):
        return ShardEntry.from_json(shard).to_json()
    import pyarrow.parquet as pq

    path = os.path.abspath(shard)
    try:
        with open_regular_file(path) as fh:  # the bytes hashed are the bytes counted; never through a link
            digest = hashlib.sha256()
            while block := fh.read(1 << 20):
                digest.update(block)
            fh.seek(0)
            rows = int(pq.ParquetFile(fh).metadata.num_rows)
    except OSError as exc:
        raise ContractError(f"shard {path} cannot be listed in the TrainingManifest: {exc.strerror or exc}") from None
    return ShardEntry(path=path, sha256=digest.hexdigest(), rows=rows).to_json()


def build_training_manifest(
    snapshot_id: str,
    corpus: str,
    contract: Contract | str,
    reports: Sequence[ShardReport],
    eval_shards: Sequence[str | Path | ShardEntry | dict[str, Any]] = (),
) -> TrainingManifest:
    """What the trainer may read: the healthy shards (path, sha256, rows, and the ``drop_rows`` the
    contract dropped from them), sorted by path.

    Quarantined shards are listed by path only (their bytes stay in the snapshot for forensics).
    Reports checked against another contract version than ``contract`` are a fault.
    """
    ref = contract.ref if isinstance(contract, Contract) else contract
    foreign = sorted({r.contract for r in reports if r.contract != ref})
    if foreign:
        raise ContractError(f"reports were checked against {foreign}, not {ref}: re-validate before building a manifest")
    healthy = sorted((r for r in reports if r.verdict == "healthy"), key=lambda r: r.path)
    return TrainingManifest.build(
        snapshot_id=snapshot_id,
        corpus=corpus,
        contract=ref,
        shards=[ShardEntry(path=r.path, sha256=r.sha256, rows=r.rows, drop_rows=drop_rows(r) or None).to_json() for r in healthy],
        eval_shards=sorted((_shard_entry(s) for s in eval_shards), key=lambda e: e["path"]),
        quarantined=sorted(r.path for r in reports if r.verdict != "healthy"),
    )

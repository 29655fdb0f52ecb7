"""The snapshot rule checked across shards: a ``doc_id`` stands in one healthy shard only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.data.validation.reasons import SAMPLE_SIZE
from kiln.data.validation.shards import READABLE_RULE, _decode_strings, _NotAShardFile, _open_corpus_file
from kiln.refs import ShardReport

CROSS_SHARD_RULE = "doc_id_unique_across_shards"


def cross_shard_duplicates(reports: Sequence[ShardReport], column: str = "doc_id") -> list[ShardReport]:
    """Quarantine each healthy shard whose ``doc_id``s already appear in an earlier healthy shard.

    "Earlier" is path order, so the verdict does not depend on the order validation finished in.
    Returns the reports in the given order, the colliding ones replaced by quarantined copies.
    """
    import pyarrow.parquet as pq

    first_seen: dict[str, str] = {}
    updated: dict[int, ShardReport] = {}
    for i in sorted(range(len(reports)), key=lambda i: reports[i].path):
        report = reports[i]
        if report.verdict != "healthy":
            continue
        try:
            with _open_corpus_file(report.path) as fh:  # a FIFO swapped in since must not block the gate
                ids = [v for v in _decode_strings(pq.read_table(fh, columns=[column]).column(column)) if v is not None]
        except _NotAShardFile as exc:
            updated[i] = replace(report, verdict="quarantined", reasons=[{"expectation": READABLE_RULE, "error": str(exc)}])
            continue
        except Exception as exc:  # the file changed or vanished since it was validated
            reason: dict[str, Any] = {"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"[:500]}
            updated[i] = replace(report, verdict="quarantined", reasons=[reason])
            continue
        collisions = [v for v in ids if v in first_seen]
        if collisions:
            sample = [f"{v} (also in {Path(first_seen[v]).name})" for v in collisions[:SAMPLE_SIZE]]
            reason = {"expectation": CROSS_SHARD_RULE, "column": column, "unexpected_count": len(collisions),
                      "sample": sample}
            updated[i] = replace(report, verdict="quarantined", reasons=[*report.reasons, reason])
        else:
            first_seen.update(dict.fromkeys(ids, report.path))
    return [updated.get(i, r) for i, r in enumerate(reports)]

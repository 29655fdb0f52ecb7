"""Documents a contract drops instead of quarantining the shard: document rules and near-duplicates.

    judge_documents(loaded, report, contract)        the document rules on one validated shard
    write_signatures(loaded, report, contract, dir)  its MinHash signatures, for the data gate
    drop_near_duplicates(reports, contract, ...)     the snapshot's near-duplicates, in path order
    drop_rows(report)                                the rows left out of training (the manifest's ``drop_rows``)

A dropped document stays in the shard file (the snapshot's bytes never change); the report lists its
row, the rule and a short sample (``ShardReport.dropped``), the TrainingManifest carries the rows
(``ShardEntry.drop_rows``, part of its hash) and every packer skips them
(``kiln_trainer.packed.iter_training_texts``). A shard whose dropped
share exceeds the contract's ``max_dropped_share`` is quarantined with the reason
``max_dropped_share`` naming the count per rule: a producer delivering mostly spam is not fixed by
dropping its documents one by one.

Only a shard healthy under the contract's expectations is judged document by document (a
quarantined shard is out whatever its documents say), and only its documents that passed the
document rules take part in near-duplicate removal.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kiln.data.contracts import Contract
from kiln.data.doc_rules import PII_KIND, DocumentRuleSet, build_rule_set
from kiln.data.near_duplicates import NearDuplicateIndex, NearDuplicateSettings, signatures
from kiln.data.validation.eval_split import eval_documents
from kiln.data.validation.reasons import SAMPLE_SIZE, _excerpt
from kiln.data.validation.shards import READABLE_RULE, _decode_strings, _LoadedShard, _NotAShardFile, _open_corpus_file
from kiln.refs import ShardReport

DROPPED_SHARE_RULE = "max_dropped_share"
"""Reason id of a shard quarantined because too many of its documents were dropped."""
NEAR_DUPLICATE_RULE = "near_duplicate"
"""Rule id under which near-duplicates are counted in ``ShardReport.dropped``."""
EVAL_SPLIT_DETAIL = "eval_split"
"""Detail of a near-duplicate whose kept copy is a document of the held-out eval split."""
SIGNATURES_SUFFIX = ".minhash.npy"
HARD_WRAPPED_LAYOUT = "hard_wrapped_layout"
"""Key of ``ShardReport.dropped``: how many dropped documents are hard-wrapped text that a line rule
dropped for its layout (``kiln.data.layout``); absent when none."""


@dataclass(frozen=True, slots=True)
class _Drop:
    row: int
    rule: str
    detail: str
    sample: str
    hard_wrapped_layout: bool = False


def drop_rows(report: ShardReport) -> list[int]:
    """The rows of a shard left out of training (sorted; empty when nothing was dropped)."""
    return list((report.dropped or {}).get("rows", []))


def _rule_set(contract: Contract) -> DocumentRuleSet:
    return build_rule_set(contract.document_rules, cache_key=f"{contract.ref}:{contract.sha256}")


def _text_column(contract: Contract) -> str:
    return str((contract.near_duplicates or {}).get("column", "text"))


def judge_documents(loaded: _LoadedShard, report: ShardReport, contract: Contract) -> ShardReport:
    """``report`` with the contract's document rules applied to the shard's documents (a healthy shard
    of a contract with document rules; any other report comes back unchanged)."""
    names = loaded.table.column_names
    if report.verdict != "healthy" or not contract.document_rules or "text" not in names:
        return report
    from kiln.data.validation.frames import _valid_text

    texts = _valid_text(loaded.table.column("text"))
    rule_set = _rule_set(contract)
    found = rule_set.judge(texts, {c: loaded.table.column(c) for c in rule_set.columns if c in names})
    pii_rules = {r["rule"] for r in contract.document_rules if r["kind"] == PII_KIND}
    ids = loaded.table.column("doc_id") if "doc_id" in names else None
    drops = []
    shown: dict[str, int] = {}
    for d in found:
        sample = ""
        if shown.get(d.rule, 0) < SAMPLE_SIZE:  # only the shown samples read their text
            shown[d.rule] = shown.get(d.rule, 0) + 1
            doc_id = ids[d.row].as_py() if ids is not None else f"row {d.row}"
            label = f"{_excerpt(doc_id, contract.secret_patterns)} ({d.detail})"
            # A PII sample would print the address it found: the id and what kind of PII it was is enough.
            text = "" if d.rule in pii_rules else ": " + _excerpt(texts[d.row].as_py(), contract.secret_patterns)
            sample = label + text
        drops.append(_Drop(d.row, d.rule, d.detail, sample, d.hard_wrapped_layout))
    return _with_drops(report, contract, drops)


def _with_drops(report: ShardReport, contract: Contract, drops: Sequence[_Drop]) -> ShardReport:
    """The report with ``drops`` added to its ``dropped`` (created even when empty: judged, nothing
    dropped), quarantined when the dropped share now exceeds ``max_dropped_share``."""
    before: dict[str, dict[str, Any]] = (report.dropped or {}).get("rules") or {}
    rules: dict[str, dict[str, Any]] = {k: dict(v) for k, v in before.items()}
    rows = set(drop_rows(report))
    layout = int((report.dropped or {}).get(HARD_WRAPPED_LAYOUT, 0))
    for drop in drops:
        if drop.row in rows:
            continue
        rows.add(drop.row)
        layout += drop.hard_wrapped_layout
        entry = rules.setdefault(drop.rule, {"count": 0, "details": {}, "sample": []})
        entry["count"] += 1
        entry["details"] = {**entry["details"], drop.detail: entry["details"].get(drop.detail, 0) + 1}
        if drop.sample and len(entry["sample"]) < SAMPLE_SIZE:
            entry["sample"] = [*entry["sample"], drop.sample]
    share = len(rows) / report.rows if report.rows else 0.0
    body: dict[str, Any] = {"rows": sorted(rows), "share": round(share, 6), "rules": dict(sorted(rules.items()))}
    if layout:  # absent when none: the reports of text that is not hard-wrapped keep their bytes
        body[HARD_WRAPPED_LAYOUT] = layout
    updated = replace(report, dropped=body)
    if share <= contract.max_dropped_share or report.verdict != "healthy":
        return updated
    counts = sorted(((v["count"], k) for k, v in rules.items()), key=lambda c: (-c[0], c[1]))
    reason = {
        "expectation": DROPPED_SHARE_RULE,
        "column": "text",
        "unexpected_count": len(rows),
        "by_rule": {rule: count for count, rule in counts},
        "sample": [f"{len(rows)} of {report.rows} documents dropped ({share:.1%}), above the contract's "
                   f"{contract.max_dropped_share:.1%}: " + ", ".join(f"{rule} {count}" for count, rule in counts)],
    }
    return replace(updated, verdict="quarantined", reasons=[*report.reasons, reason])


# -- near-duplicates ------------------------------------------------------------------------------------


def _settings(contract: Contract) -> NearDuplicateSettings | None:
    raw = contract.near_duplicates
    return None if raw is None else NearDuplicateSettings.from_contract(raw)


def signature_path(directory: str | Path, shard_sha256: str, settings: NearDuplicateSettings) -> Path:
    """Where the signatures of a shard's bytes under these settings are kept (content-addressed)."""
    return Path(directory) / f"{shard_sha256}-{settings.key}{SIGNATURES_SUFFIX}"


def write_signatures(loaded: _LoadedShard, report: ShardReport, contract: Contract, directory: str | Path) -> None:
    """Compute a healthy shard's MinHash signatures while its rows are in memory (in the mapped
    validation task) and keep them for the data gate. Idempotent: same bytes, same file."""
    settings = _settings(contract)
    if settings is None or report.verdict != "healthy":
        return
    import io

    import numpy as np

    from kiln.util.fs import atomic_write_bytes

    path = signature_path(directory, loaded.sha256, settings)
    if path.is_file():
        return
    values = signatures(_decode_strings(loaded.table.column(settings.column)), settings)
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    atomic_write_bytes(path, buffer.getvalue())


def _read_column(report: ShardReport, column: str) -> list[str | None]:
    """A column of a validated shard, read again; the bytes must still be the ones validated."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open_corpus_file(report.path) as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != report.sha256:
        raise ValueError(f"{report.path} changed since it was validated (sha256 differs)")
    return _decode_strings(pq.read_table(pa.BufferReader(data), columns=[column]).column(column))


def _shard_signatures(report: ShardReport, settings: NearDuplicateSettings, directory: str | Path | None) -> Any:
    import numpy as np

    if directory is not None:
        path = signature_path(directory, report.sha256, settings)
        if path.is_file():
            try:
                values = np.load(path, allow_pickle=False)
            except (OSError, ValueError):
                values = None
            if values is not None and values.shape == (report.rows, settings.num_perm) and values.dtype == np.uint32:
                return values
    return signatures(_read_column(report, settings.column), settings)


def drop_near_duplicates(
    reports: Sequence[ShardReport], contract: Contract, *, signatures_dir: str | Path | None = None,
    on_shard: Callable[[ShardReport], None] | None = None, eval_split: str | Path | None = None,
) -> list[ShardReport]:
    """Drop near-duplicate documents across the healthy shards, visited in path order (the first copy
    stays). A shard whose dropped share then exceeds the threshold is quarantined and its documents
    leave the index, so they make no later copy a duplicate. Returns the reports in the given order.

    ``eval_split``: a corpus directory whose held-out split (``eval/*.parquet``) is indexed first, so
    that a training document that is a near copy of an eval document is dropped too (detail
    ``eval_split``): the exact-hash contamination rule misses an edited copy. Eval documents are
    never dropped.

    Signatures come from ``signatures_dir`` (written by the validation tasks) when there, else are
    computed from the shard (whose bytes must still hash to the report's sha256). ``on_shard`` sees
    each healthy shard's final report (benchmarks count documents with it)."""
    settings = _settings(contract)
    if settings is None:
        return list(reports)
    index = NearDuplicateIndex(settings)
    order = sorted((i for i, r in enumerate(reports) if r.verdict == "healthy"), key=lambda i: reports[i].path)
    updated: dict[int, ShardReport] = {}
    ids_of: dict[int, list[str | None]] = {}
    held_out: list[tuple[str, str | None]] = []  # (eval shard name, doc id) of each row of the eval pseudo-shard
    first = 0
    if eval_split is not None:
        texts: list[str | None] = []
        for path, ids, shard_texts in eval_documents(eval_split):
            held_out += [(path.name, doc_id) for doc_id in ids]
            texts += shard_texts
        if texts:
            index.check_shard(0, signatures(texts, settings))  # an eval copy of an eval document is no concern here
            index.accept()
            first = 1
    for position, i in enumerate(order, start=first):
        report = reports[i]
        try:
            values = _shard_signatures(report, settings, signatures_dir)
        except (_NotAShardFile, OSError, ValueError) as exc:
            reason: dict[str, Any] = {"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"[:500]}
            updated[i] = replace(report, verdict="quarantined", reasons=[*report.reasons, reason])
            continue
        found = index.check_shard(position, values, frozenset(drop_rows(report)))
        if not found:
            index.accept()
            final = report if report.dropped is not None else _with_drops(report, contract, [])
        else:
            drops = []
            for n, dup in enumerate(found):
                of_eval = dup.of_shard < first
                sample = ""
                if n < SAMPLE_SIZE:
                    mine = _ids(ids_of, position, report)[dup.row]
                    if of_eval:
                        where, theirs = held_out[dup.of_row]
                        where = f"the eval split's {where}"
                    else:
                        original = reports[order[dup.of_shard - first]]
                        where, theirs = os.path.basename(original.path), _ids(ids_of, dup.of_shard, original)[dup.of_row]
                    sample = (f"{_excerpt(mine, contract.secret_patterns)} ≈ {_excerpt(theirs, contract.secret_patterns)} "
                              f"in {where} (Jaccard ≈ {dup.similarity:.2f})")
                drops.append(_Drop(dup.row, NEAR_DUPLICATE_RULE, EVAL_SPLIT_DETAIL if of_eval else NEAR_DUPLICATE_RULE, sample))
            final = _with_drops(report, contract, drops)
            if final.verdict == "healthy":
                index.accept()
            else:
                index.reject()
        updated[i] = final
        if on_shard is not None:
            on_shard(final)
    return [updated.get(i, r) for i, r in enumerate(reports)]


def _ids(cache: dict[int, list[str | None]], position: int, report: ShardReport) -> list[str | None]:
    if position not in cache:
        try:
            cache[position] = _read_column(report, "doc_id")
        except Exception:  # only a sample label: the row number says as much
            cache[position] = [f"row {n}" for n in range(report.rows)]
    return cache[position]

"""The entry points: one shard, a batch of shards (stacked where it can be), a corpus directory."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kiln.data.contracts import Contract
from kiln.data.validation.cross_shard import cross_shard_duplicates
from kiln.data.validation.dropped import drop_near_duplicates, judge_documents, write_signatures
from kiln.data.validation.eval_split import load_eval_doc_hashes
from kiln.data.validation.one_shard import _validate_alone
from kiln.data.validation.shards import _load_shard, _LoadedShard, train_shards
from kiln.data.validation.stacking import MAX_BATCH_ROWS, _source_columns, _stackable, _validate_stack
from kiln.data.validation.suite import _as_contract, _great_expectations
from kiln.errors import ContractError
from kiln.refs import ShardReport


def _finished(
    loaded: _LoadedShard, report: ShardReport, contract: Contract, signatures_dir: str | Path | None
) -> ShardReport:
    """A judged shard's report with its documents judged too (contracts with document rules), and its
    near-duplicate signatures kept for the data gate (given ``signatures_dir``)."""
    report = judge_documents(loaded, report, contract)
    if signatures_dir is not None:
        write_signatures(loaded, report, contract, signatures_dir)
    return report


def validate_shard(
    path: str | Path, contract: Contract | str, eval_doc_hashes: frozenset[str] = frozenset(), *, root: str | Path | None = None
) -> ShardReport:
    """Check one shard against the contract. Bad data gives a quarantined report; it never raises.

    The bytes are read once: the sha256 in the report is the hash of exactly the bytes validated.
    Only a regular file is read: a symlink, FIFO, device or (given the corpus ``root``) a path
    through a symlinked directory is quarantined unopened.
    Raises only ``ContractError`` when the contract itself cannot be evaluated (a fault, not data).
    """
    contract = _as_contract(contract)
    ge = _great_expectations()
    loaded = _load_shard(path, contract, None if root is None else str(root))
    if isinstance(loaded, ShardReport):
        return loaded
    return _finished(loaded, _validate_alone(loaded, contract, ge, eval_doc_hashes), contract, None)


def validate_shards(
    paths: Iterable[str | Path],
    contract: Contract | str,
    eval_doc_hashes: frozenset[str] = frozenset(),
    *,
    root: str | Path | None = None,
    signatures_dir: str | Path | None = None,
) -> list[ShardReport]:
    """A batch of shards in one process: what a mapped DAG task runs. Reports in ``paths`` order.

    Shards of the same schema are stacked into one GE run (up to ``MAX_BATCH_ROWS`` rows), and
    each report is exactly the one ``validate_shard`` gives for that shard alone. Unreadable shards
    (and files that are not regular, see ``validate_shard``) are quarantined one by one; like
    ``validate_shard``, this raises only ``ContractError``. A contract with document rules also
    judges each healthy shard's documents (``ShardReport.dropped``); with near-duplicate settings and
    ``signatures_dir``, each healthy shard's MinHash signatures are written there for the data gate.
    """
    contract = _as_contract(contract)
    ge = _great_expectations()
    needed = _source_columns(contract)
    reports: list[ShardReport | None] = []
    pending: dict[tuple[tuple[str, str, bool], ...], list[tuple[int, _LoadedShard]]] = {}
    pending_rows = 0

    def flush() -> None:
        nonlocal pending_rows
        for members in pending.values():
            judged = _validate_stack([s for _, s in members], contract, ge, eval_doc_hashes)
            for (position, shard), report in zip(members, judged, strict=True):
                reports[position] = _finished(shard, report, contract, signatures_dir)
        pending.clear()
        pending_rows = 0

    for path in paths:
        loaded = _load_shard(path, contract, None if root is None else str(root))
        if isinstance(loaded, ShardReport):
            reports.append(loaded)
        elif not _stackable(loaded, contract, needed):
            reports.append(_finished(loaded, _validate_alone(loaded, contract, ge, eval_doc_hashes), contract, signatures_dir))
        else:
            reports.append(None)
            pending.setdefault(loaded.schema_key, []).append((len(reports) - 1, loaded))
            pending_rows += loaded.rows
            if pending_rows >= MAX_BATCH_ROWS:
                flush()
    flush()
    missing = [i for i, r in enumerate(reports) if r is None]
    if missing:  # a shard without a verdict must never pass silently
        raise ContractError(f"validation produced no report for {len(missing)} shard(s)")
    return [r for r in reports if r is not None]


def validate_directory(corpus_dir: str | Path, contract: Contract | str) -> list[ShardReport]:
    """Every ``train/*.parquet`` of a corpus directory, then the snapshot rules across shards: doc
    ids unique, and (contracts with ``near_duplicates``) near-duplicate documents dropped.

    Shards are read only from inside the corpus: a link (or symlinked folder) to elsewhere is
    quarantined. What else lies in ``train/`` is listed by ``skipped_train_entries``."""
    contract = _as_contract(contract)
    hashes = load_eval_doc_hashes(corpus_dir)
    reports = cross_shard_duplicates(validate_shards(train_shards(corpus_dir), contract, hashes, root=corpus_dir))
    return drop_near_duplicates(reports, contract, eval_split=corpus_dir)

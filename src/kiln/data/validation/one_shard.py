"""One shard, one GE run: the reference semantics the stacked run must reproduce, and a judged shard's report."""

from __future__ import annotations

from typing import Any

from kiln.data.contracts import Contract
from kiln.data.validation.frames import _Frame, _runnable, _shard_frame
from kiln.data.validation.reasons import SAMPLE_SIZE, _quarantined, _reason
from kiln.data.validation.shards import _LoadedShard, _unreadable
from kiln.data.validation.suite import _expectation_index, _GreatExpectations, _suite
from kiln.errors import ContractError
from kiln.refs import ShardReport

EVALUATION_ERROR_RULE = "contract_evaluation"
"""Reason id when GE itself failed on a shard: the shard is not proven healthy, so it is quarantined."""


def _index_columns(shard: _Frame) -> list[str]:
    """Columns that identify an unexpected row in a sample."""
    return [c for c in ("doc_id", "source") if c in shard.present]


def _failed_results(ge: _GreatExpectations, contract: Contract, shard: _Frame, keep: tuple[int, ...]) -> list[dict[str, Any]]:
    """GE results (JSON) of the expectations ``keep`` that fail on one frame. Caller holds ``ge.lock``."""
    result_format: dict[str, Any] = {"result_format": "SUMMARY", "partial_unexpected_count": SAMPLE_SIZE}
    index_columns = _index_columns(shard)
    if index_columns:
        result_format["unexpected_index_column_names"] = index_columns
    batch = ge.batch_definition.get_batch(batch_parameters={"dataframe": shard.frame})
    # Most shards are healthy: a pass/fail-only run costs ~40% less than one collecting
    # samples, so details are computed only for the expectations that failed.
    verdicts = batch.validate(_suite(ge, contract, keep), result_format="BOOLEAN_ONLY")
    failed = tuple(sorted(_expectation_index(r.expectation_config, contract) for r in verdicts.results if not r.success))
    if not failed:
        return []
    details = batch.validate(_suite(ge, contract, failed), result_format=result_format)
    results = [r.to_json_dict() for r in details.results if not r.success]
    if not results:  # GE disagreed with itself between the two runs: never call that healthy
        results = [{"expectation_config": contract.suite["expectations"][i], "result": {}} for i in failed]
    return results


def _judged(loaded: _LoadedShard, contract: Contract, reasons: list[dict[str, Any]]) -> ShardReport:
    """The report of a shard GE has judged: reasons in contract order."""
    order = {e["type"] + str(e["kwargs"].get("column")): i for i, e in enumerate(contract.suite["expectations"])}
    reasons = sorted(reasons, key=lambda r: order.get(r["expectation"] + str(r.get("column")), len(order)))
    if reasons:
        return _quarantined(loaded.path, loaded.sha256, loaded.rows, contract, reasons)
    return ShardReport(path=loaded.path, sha256=loaded.sha256, rows=loaded.rows, verdict="healthy", reasons=[],
                       contract=contract.ref)


def _evaluation_error(loaded: _LoadedShard, contract: Contract, exc: Exception) -> ShardReport:
    error = f"{type(exc).__name__}: {exc}"[:500]
    reasons = [{"expectation": EVALUATION_ERROR_RULE, "error": error}]
    return _quarantined(loaded.path, loaded.sha256, loaded.rows, contract, reasons)


def _validate_alone(
    loaded: _LoadedShard, contract: Contract, ge: _GreatExpectations, eval_doc_hashes: frozenset[str]
) -> ShardReport:
    """One GE run over one shard: the reference semantics the stacked path must reproduce."""
    try:
        shard = _shard_frame(loaded.table, contract, eval_doc_hashes)
    except Exception as exc:  # a column pandas cannot take: as unreadable as a broken footer
        return _unreadable(loaded.path, loaded.sha256, contract, exc)
    keep = _runnable(contract, shard)
    try:
        with ge.lock:
            results = _failed_results(ge, contract, shard, keep)
    except ContractError:
        raise
    except Exception as exc:  # a shard GE cannot evaluate is not proven healthy
        return _evaluation_error(loaded, contract, exc)
    return _judged(loaded, contract, [_reason(r, contract, loaded.rows) for r in results])

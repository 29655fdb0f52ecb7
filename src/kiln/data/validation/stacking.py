"""The batch optimiser: a batch's shards stacked into one GE run, each result charged back to its shard.

A shard's verdict and reasons are exactly what ``one_shard`` gives it alone; what cannot be stacked runs alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.data.contracts import Contract
from kiln.data.validation.frames import _Frame, _is_string_type, _pandas_strings, _shard_frame
from kiln.data.validation.one_shard import _failed_results, _index_columns, _judged, _validate_alone
from kiln.data.validation.patterns import _re2_literal, required_literals
from kiln.data.validation.reasons import SAMPLE_SIZE, _reason
from kiln.data.validation.shards import _LoadedShard
from kiln.data.validation.suite import _columns_of, _expectation_index, _GreatExpectations, _suite
from kiln.errors import ContractError
from kiln.refs import ShardReport

# A batch of shards is validated with ONE Great Expectations run over the shards' frames stacked
# end to end (GE's fixed cost, 0.05-0.2 s per run, dwarfs the per-row work of a small shard). Every
# expectation of the contract falls in one of these classes, and each class is mapped back to the
# shards so that a shard's verdict and reasons are exactly what validating it alone gives
# (``tests/unit/kiln/data/test_validation_stacking.py`` checks this over the whole poison zoo):

ROW_LOCAL_EXPECTATIONS = frozenset(
    {
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_null",
        "expect_column_values_to_be_of_type",  # object-dtype columns only: GE then checks value by value
        "expect_column_values_to_be_in_type_list",
        "expect_column_values_to_be_in_set",
        "expect_column_values_to_not_be_in_set",
        "expect_column_values_to_be_between",
        "expect_column_value_lengths_to_be_between",
        "expect_column_value_lengths_to_equal",
        "expect_column_values_to_match_regex",
        "expect_column_values_to_not_match_regex",
        "expect_column_values_to_match_regex_list",
        "expect_column_values_to_not_match_regex_list",
        "expect_column_values_to_match_like_pattern",
        "expect_column_values_to_not_match_like_pattern",
        "expect_column_values_to_match_strftime_format",
        "expect_column_values_to_be_dateutil_parseable",
        "expect_column_values_to_be_json_parseable",
    }
)
"""Column-map expectations whose verdict on a row depends on that row alone: GE flags rows of the
stacked frame (``unexpected_index_list``) and each flagged row is charged to the shard it came from."""

UNIQUE_WITHIN_SHARD = "expect_column_values_to_be_unique"
"""GE flags every row whose value repeats anywhere in the stack; a shard keeps the flagged rows whose
value repeats *within* it (a superset, so nothing is missed). Repeats across shards are the snapshot
rule's business (``cross_shard_duplicates``), not this one's."""

SCHEMA_EXPECTATIONS = frozenset(
    {
        "expect_table_columns_to_match_set",
        "expect_table_columns_to_match_ordered_list",
        "expect_table_column_count_to_equal",
        "expect_table_column_count_to_be_between",
        "expect_column_to_exist",
    }
)
"""Facts about the column names: shards are stacked only with shards of the very same column names, so
the stack's result is each shard's result."""

ROW_COUNT = "expect_table_row_count_to_be_between"
"""GE can only count the stack's rows: the bounds are applied to each shard's own row count here."""
_ROW_COUNT_KWARGS = frozenset({"min_value", "max_value", "strict_min", "strict_max"})

MAX_BATCH_ROWS = 50_000
"""Rows stacked into one GE run at most (memory: GE copies the text column per regex); a longer
list of shards is validated in several runs."""

_ROW, _UNIQUE, _SCHEMA, _COUNT, _ALONE = "row", "unique", "schema", "row_count", "alone"


def _batch_class(expectation: dict[str, Any]) -> str:
    """How an expectation is evaluated over a stack of shards (``_ALONE``: once per shard, by GE)."""
    kind, kwargs = expectation["type"], expectation["kwargs"]
    if "mostly" in kwargs:  # success depends on each shard's own share of unexpected rows
        return _ALONE
    if kind in ROW_LOCAL_EXPECTATIONS:
        return _ROW
    if kind == UNIQUE_WITHIN_SHARD:
        return _UNIQUE
    if kind in SCHEMA_EXPECTATIONS:
        return _SCHEMA
    if kind == ROW_COUNT and set(kwargs) <= _ROW_COUNT_KWARGS and all(
        kwargs.get(k) is None or isinstance(kwargs[k], int) for k in ("min_value", "max_value")
    ):
        return _COUNT
    return _ALONE


def _source_columns(contract: Contract) -> frozenset[str]:
    """The shard columns the contract's rules read (derived columns replaced by their sources)."""
    derived = contract.derived_columns
    needed = {c for e in contract.suite["expectations"] for c in _columns_of(e) if c not in derived}
    needed.update(spec["column"] for spec in derived.values())
    return frozenset(needed)


def _stackable(loaded: _LoadedShard, contract: Contract, needed: frozenset[str] | None = None) -> bool:
    """Whether the shard can share a GE run: every rule runs on it, on string columns.

    A shard with a missing or mistyped column runs a subset of the rules (``_runnable``), and a
    numeric column's pandas dtype depends on its nulls, which would change GE's type check, so
    those shards are validated alone (rare, and they are quarantined anyway).
    """
    schema = loaded.table.schema
    names = schema.names
    columns = _source_columns(contract) if needed is None else needed
    return all(names.count(c) == 1 and _is_string_type(schema.field(c).type) for c in columns)


class _StackFallback(Exception):
    """GE reported an exception on the stacked frame: judge each shard alone instead."""


def _row_sample_result(frame: Any, rows: Sequence[int], column: str | None, index_columns: list[str]) -> dict[str, Any]:
    """What GE's SUMMARY result of one shard holds for these unexpected rows (stack positions)."""
    head = rows[:SAMPLE_SIZE]
    if index_columns:
        names = [*([column] if column and column not in index_columns else []), *index_columns]
        partial = [{c: frame[c].iat[i] for c in names} for i in head]
        return {"unexpected_count": len(rows), "partial_unexpected_index_list": partial}
    values = [frame[column].iat[i] for i in head] if column else []
    return {"unexpected_count": len(rows), "partial_unexpected_list": values}


def _row_count_fails(kwargs: dict[str, Any], rows: int) -> bool:
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    if low is not None and (rows <= low if kwargs.get("strict_min") else rows < low):
        return True
    return high is not None and (rows >= high if kwargs.get("strict_max") else rows > high)


PREFILTERED_EXPECTATIONS = frozenset({"expect_column_values_to_not_match_regex_list", "expect_column_values_to_not_match_regex"})
"""Row-local rules that flag a row only when one of their patterns matches it. In the stacked run GE
checks them on a copy of the column that keeps only the rows containing a required literal of some
pattern (``required_literals``; null elsewhere, and GE skips nulls): a row without one cannot match,
so the verdicts are the same, and GE's regexes (Python's ``re`` for a pattern RE2 would read
differently) touch a handful of rows instead of every row. One RE2 scan for the literals finds them."""

PREFILTERED_PREFIX = "__kiln_prefiltered_"


def _prefiltered_columns(
    shard: _Frame, contract: Contract, keep: Sequence[int]
) -> tuple[dict[str, Any], dict[int, str], set[int]]:
    """Prefiltered column copies for the stacked run (see ``PREFILTERED_EXPECTATIONS``).

    Returns the new columns, which expectation reads which of them, and the expectations that
    cannot flag any row of this stack (no row holds a required literal): GE need not run those.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    new: dict[str, Any] = {}
    moved: dict[int, str] = {}
    cannot_fail: set[int] = set()
    by_key: dict[tuple[str, frozenset[str]], str | None] = {}
    for i in keep:
        exp = contract.suite["expectations"][i]
        kwargs = exp["kwargs"]
        column = kwargs.get("column")
        if (exp["type"] not in PREFILTERED_EXPECTATIONS or column not in shard.texts
                or set(kwargs) - {"column", "regex", "regex_list"}):
            continue
        patterns = kwargs.get("regex_list") if "regex_list" in kwargs else [kwargs.get("regex")]
        if not patterns or not all(isinstance(p, str) for p in patterns):
            continue
        literal_sets = [required_literals(p) for p in patterns]
        known = [found for found in literal_sets if found is not None]
        if len(known) != len(literal_sets):
            continue  # a pattern without a required literal: GE checks every row
        literals = frozenset[str]().union(*known)
        key = (column, literals)
        if key not in by_key:
            text = shard.texts[column]
            hits = pc.match_substring_regex(text, "|".join(_re2_literal(lit) for lit in sorted(literals)))
            if not pc.any(hits, min_count=0).as_py():
                by_key[key] = None
            else:
                name = f"{PREFILTERED_PREFIX}{len(new)}"
                new[name] = _pandas_strings(pc.if_else(hits, text, pa.scalar(None, text.type)))
                by_key[key] = name
        prefiltered = by_key[key]
        if prefiltered is None:
            cannot_fail.add(i)
        else:
            moved[i] = prefiltered
    return new, moved, cannot_fail


def _validate_stack(
    group: Sequence[_LoadedShard], contract: Contract, ge: _GreatExpectations, eval_doc_hashes: frozenset[str]
) -> list[ShardReport]:
    """Validate shards of one schema with one GE run over their stacked rows."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    def each_alone() -> list[ShardReport]:
        return [_validate_alone(s, contract, ge, eval_doc_hashes) for s in group]

    expectations = contract.suite["expectations"]
    classes = [_batch_class(e) for e in expectations]
    in_stack = tuple(i for i, c in enumerate(classes) if c in (_ROW, _UNIQUE, _SCHEMA))
    alone = tuple(i for i, c in enumerate(classes) if c == _ALONE)
    starts = np.cumsum([0, *(s.rows for s in group)])
    try:
        table = pa.concat_tables([s.table for s in group]) if len(group) > 1 else group[0].table
        shard = _shard_frame(table, contract, eval_doc_hashes)
    except Exception:  # e.g. a column pandas cannot take: each shard alone says which
        return each_alone()
    frame = shard.frame
    index_columns = _index_columns(shard)
    try:
        prefiltered, moved, cannot_fail = _prefiltered_columns(shard, contract, in_stack)
    except Exception:  # the prefilter is an optimisation: per shard, the reference path decides
        return each_alone()
    # Prefiltered rules run on their own frame (same rows, same positions), so that the rules about
    # the frame's columns never see the prefiltered copies.
    runs = [(frame, tuple(i for i in in_stack if i not in moved and i not in cannot_fail))]
    if moved:
        side = pd.DataFrame({**{c: frame[c] for c in index_columns}, **prefiltered}, index=frame.index)
        runs.append((side, tuple(i for i in in_stack if i in moved)))

    def failing(data: Any, keep: tuple[int, ...]) -> list[dict[str, Any]]:
        """Failed GE results of ``keep`` on ``data`` (COMPLETE: every unexpected row). Caller holds ``ge.lock``."""
        columns = tuple((i, moved[i]) for i in keep if i in moved)
        batch = ge.batch_definition.get_batch(batch_parameters={"dataframe": data})
        verdicts = batch.validate(_suite(ge, contract, keep, columns), result_format="BOOLEAN_ONLY")
        failed = tuple(sorted(_expectation_index(r.expectation_config, contract) for r in verdicts.results if not r.success))
        if not failed:
            return []
        suite = _suite(ge, contract, failed, tuple(c for c in columns if c[0] in failed))
        details = batch.validate(suite, result_format={"result_format": "COMPLETE"})
        found = [r.to_json_dict() for r in details.results if not r.success]
        if len(found) != len(failed) or any((r.get("exception_info") or {}).get("raised_exception") for r in found):
            raise _StackFallback
        return found

    try:
        with ge.lock:
            results = [r for data, keep in runs if keep for r in failing(data, keep)]
            alone_results: list[list[dict[str, Any]]] = [[] for _ in group]
            if alone:
                for j in range(len(group)):
                    own_rows = shard.frame.iloc[starts[j] : starts[j + 1]].reset_index(drop=True)
                    part = _Frame(frame=own_rows, present=shard.present, typed_wrong=shard.typed_wrong)
                    alone_results[j] = _failed_results(ge, contract, part, alone)
    except ContractError:
        raise
    except Exception:  # GE failed on the stack: per shard, the reference path decides
        return each_alone()

    reasons: list[list[dict[str, Any]]] = [[] for _ in group]
    for result in results:
        config = result["expectation_config"]
        index = _expectation_index(config, contract)
        kind = classes[index]
        if index in moved:  # checked on a prefiltered copy: report it on the contract's column
            original = expectations[index]["kwargs"]["column"]
            config = {**config, "kwargs": {**config.get("kwargs", {}), "column": original}}
        column = config.get("kwargs", {}).get("column")
        if kind == _SCHEMA:  # same column names in every shard of the stack: same result
            for j, s in enumerate(group):
                reasons[j].append(_reason(result, contract, s.rows))
            continue
        detail = result.get("result") or {}
        flagged = [int(i) for i in detail.get("unexpected_index_list") or []]
        if not flagged or len(flagged) != detail.get("unexpected_count"):  # failed without the rows to blame
            return each_alone()
        owners = np.searchsorted(starts, flagged, side="right") - 1
        by_shard: dict[int, list[int]] = {}
        for position, owner in zip(flagged, owners.tolist(), strict=True):
            by_shard.setdefault(owner, []).append(position)
        for j, rows in sorted(by_shard.items()):
            if kind == _UNIQUE:
                values = frame[column]
                counts: dict[Any, int] = {}
                for i in rows:
                    counts[values.iat[i]] = counts.get(values.iat[i], 0) + 1
                rows = [i for i in rows if counts[values.iat[i]] > 1]
                if not rows:
                    continue
            sample = _row_sample_result(frame, rows, column, index_columns)
            reasons[j].append(_reason({"expectation_config": config, "result": sample}, contract, group[j].rows))
    for i, kind in enumerate(classes):
        if kind == _COUNT:
            exp = expectations[i]
            for j, s in enumerate(group):
                if _row_count_fails(exp["kwargs"], s.rows):
                    failure = {"expectation_config": exp, "result": {"observed_value": s.rows}}
                    reasons[j].append(_reason(failure, contract, s.rows))
    for j, s in enumerate(group):
        reasons[j].extend(_reason(r, contract, s.rows) for r in alone_results[j])
    return [_judged(s, contract, r) for s, r in zip(group, reasons, strict=True)]

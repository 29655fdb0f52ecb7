"""The one Great Expectations context per process, and the GE suite of a contract (cached per rule subset).

great_expectations is imported on first use: ~3 s once, ~55 ms per validation after that (measured on the 2-core dev box).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

from kiln.data.contracts import REGEX_EXPECTATIONS, Contract, load_contract
from kiln.errors import ContractError

INDEX_META_KEY = "kiln_expectation_index"
"""Added to each expectation's meta when kiln builds the GE suite: its position in the contract."""


@dataclass
class _GreatExpectations:
    batch_definition: Any
    suites: dict[tuple[str, str, tuple[int, ...], tuple[tuple[int, str], ...]], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_GE: _GreatExpectations | None = None
_GE_INIT_LOCK = threading.Lock()


def _great_expectations() -> _GreatExpectations:
    """Build the process-wide ephemeral context once: pandas source → dataframe asset → whole batch."""
    global _GE
    with _GE_INIT_LOCK:
        if _GE is None:
            import great_expectations as gx
            from great_expectations.data_context.types.base import ProgressBarsConfig
            from great_expectations.execution_engine import pandas_execution_engine

            # GE fingerprints every in-memory batch (md5 over a pandas hash of all its rows) for a
            # batch marker kiln never reads: ~10% of a stacked run. Frames above this size skip it.
            pandas_execution_engine.HASH_THRESHOLD = 0
            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = ProgressBarsConfig(globally=False)
            asset = context.data_sources.add_pandas("kiln_shards").add_dataframe_asset("shard")
            _GE = _GreatExpectations(batch_definition=asset.add_batch_definition_whole_dataframe("whole_shard"))
        return _GE


def _suite(
    ge: _GreatExpectations, contract: Contract, keep: tuple[int, ...], columns: tuple[tuple[int, str], ...] = ()
) -> Any:
    """The GE suite of the contract restricted to expectations ``keep`` (cached).

    ``columns`` points expectation ``i`` at another column of the frame (``(i, name)`` pairs): the
    stacked run uses it for prefiltered copies of a column (see ``_prefiltered_columns``)."""
    key = (contract.ref, contract.sha256, keep, columns)
    suite = ge.suites.get(key)
    if suite is None:
        import great_expectations as gx

        # The position rides along in meta: GE drops kwargs equal to their default from its results,
        # so matching results back by kwargs alone fails for a contract that spells a default out.
        # Deep copies: GE writes into what it is given (meta gains great_expectations_version), and
        # the contract's suite must stay byte-identical to its file (its sha256 is recorded).
        expectations = copy.deepcopy([contract.suite["expectations"][i] for i in keep])
        moved = dict(columns)
        for i, exp in zip(keep, expectations, strict=True):
            exp["meta"] = {**(exp.get("meta") or {}), INDEX_META_KEY: i}
            if i in moved:
                exp["kwargs"]["column"] = moved[i]
            if exp["type"] in REGEX_EXPECTATIONS:
                _on_re2(exp["kwargs"], contract)
        try:
            suite = gx.ExpectationSuite(
                name=contract.ref,
                expectations=expectations,
                meta=copy.deepcopy(contract.suite.get("meta")),
                notes=contract.suite.get("notes"),
            )
        except Exception as exc:  # GE raises pydantic / its own config errors: the contract is broken
            raise ContractError(f"contract {contract.ref} ({contract.path}) is not a valid GE suite: {exc}") from exc
        ge.suites[key] = suite
    return suite


def _on_re2(kwargs: dict[str, Any], contract: Contract) -> None:
    """Replace a regex expectation's patterns by their RE2 translations (same verdicts): pandas then runs
    them in Arrow's RE2, never in Python's backtracking ``re`` (``kiln.data.re2_patterns``)."""
    from kiln.data.re2_patterns import re2_search
    from kiln.errors import PatternNotLinear

    try:
        if isinstance(kwargs.get("regex"), str):
            kwargs["regex"] = re2_search(kwargs["regex"], end="\\Z")
        if isinstance(kwargs.get("regex_list"), list):
            kwargs["regex_list"] = [re2_search(p, end="\\Z") for p in kwargs["regex_list"]]
    except (PatternNotLinear, TypeError) as exc:
        raise ContractError(f"contract {contract.ref} ({contract.path}): a regex cannot run on RE2: {exc}") from exc


def _expectation_index(config: Any, contract: Contract) -> int:
    """Position in the contract of the expectation a GE result belongs to (GE reorders results).

    ``config`` is GE's ExpectationConfiguration or its JSON form."""
    if isinstance(config, dict):
        kind, kwargs, meta = config["type"], config.get("kwargs", {}), config.get("meta") or {}
    else:
        kind, kwargs, meta = config.type, dict(config.kwargs), config.meta or {}
    index = meta.get(INDEX_META_KEY)
    expectations = contract.suite["expectations"]
    if isinstance(index, int) and 0 <= index < len(expectations) and expectations[index]["type"] == kind:
        return index
    raise ContractError(f"GE returned a result for an expectation not in {contract.ref}: {kind} {kwargs}")


def _columns_of(expectation: dict[str, Any]) -> list[str]:
    kwargs = expectation["kwargs"]
    names = [kwargs[k] for k in ("column", "column_A", "column_B") if isinstance(kwargs.get(k), str)]
    names.extend(kwargs.get("column_list", []) or [])
    return names


def _as_contract(contract: Contract | str) -> Contract:
    return contract if isinstance(contract, Contract) else load_contract(contract)

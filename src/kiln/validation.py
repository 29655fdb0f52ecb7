"""Shard validation against a data contract, quarantine, and the data gate.

    validate_shard(path, contract, eval_doc_hashes) -> ShardReport     one shard, never raises on data
    validate_shards(paths, ...) / validate_directory(corpus_dir, ...)  batches: one GE run per batch
    cross_shard_duplicates(reports) -> reports                          snapshot rule: ids unique across shards
    gate(reports, max_quarantine_share)                                 DataGateError (no retry) above threshold
    build_training_manifest(...) -> TrainingManifest                    healthy shards only
    write_quarantine_report(reports, path)                              every shard with its verdict (JSON)
    publish_quarantine_report(reports, out_dir, ...)                    JSON + HTML page, logged to MLflow

A quarantined shard is a value (``ShardReport(verdict="quarantined")``), never an exception: bad
*data* must not crash a worker. Exceptions are for faults: a contract GE cannot parse
(``ContractError``), a gate breach (``DataGateError``).

great_expectations and pandas are imported on first use, so importing this module stays cheap
(DAG files and the CLI's ``--help`` import it). One ephemeral GE context is built per process and
reused by every validation (FIELD-NOTES: ~3 s import, ~55 ms per validation after that). Since that
fixed cost dwarfs a small shard's rows, ``validate_shards`` stacks a batch's shards into one GE run
and maps the results back to each shard (see "validation" below); ``validate_shard`` is the
one-shard reference the batched path is tested against.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.contracts import Contract, load_contract
from kiln.errors import ContractError, DataGateError, RegistryError
from kiln.fsutil import atomic_write_text
from kiln.refs import ShardEntry, ShardReport, TrainingManifest, sha256_file

TRAIN_GLOB = "train/*.parquet"
EVAL_GLOB = "eval/*.parquet"
"""Corpus layout written by ``kiln.corpus.build_corpus``."""

READABLE_RULE = "readable_parquet"
"""Reason id of a shard that could not be read as Parquet at all."""
CROSS_SHARD_RULE = "doc_id_unique_across_shards"
EVALUATION_ERROR_RULE = "contract_evaluation"
"""Reason id when GE itself failed on a shard: the shard is not proven healthy, so it is quarantined."""

INDEX_META_KEY = "kiln_expectation_index"
"""Added to each expectation's meta when kiln builds the GE suite: its position in the contract."""

SAMPLE_SIZE = 3
SAMPLE_CHARS = 100
REDACTED = "[REDACTED]"

_STRING_TYPE_NAMES = ("str", "string", "object")


# -- the one GE context per process ----------------------------------------------------------------


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

            from great_expectations.execution_engine import pandas_execution_engine

            # GE fingerprints every in-memory batch (md5 over a pandas hash of all its rows) for a
            # batch marker kiln never reads: ~10% of a stacked run. Frames above this size skip it.
            pandas_execution_engine.HASH_THRESHOLD = 0
            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = {"globally": False}
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
        for i, exp in zip(keep, expectations):
            exp["meta"] = {**(exp.get("meta") or {}), INDEX_META_KEY: i}
            if i in moved:
                exp["kwargs"]["column"] = moved[i]
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


# -- reading a shard -------------------------------------------------------------------------------


def _is_string_type(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type))


def _decode_strings(column: Any) -> list[str | None]:
    """Parquet strings as Python str; invalid UTF-8 decodes to U+FFFD (the encoding rule counts it)."""
    import pyarrow as pa

    try:
        column.validate(full=True)  # checks UTF-8 in C++; valid text needs no per-value decode
    except pa.ArrowInvalid:
        raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        return [None if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()]
    return column.to_pylist()


def _read_table(data: bytes) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data))


@dataclass(frozen=True, slots=True)
class _Frame:
    frame: Any
    """pandas DataFrame: raw columns (strings Arrow-backed, valid UTF-8) + derived columns."""
    present: frozenset[str]
    """Columns GE may check with every expectation (present, and of the expected type when it is str)."""
    typed_wrong: frozenset[str]
    """Present columns with a non-string type where the contract expects str: only the type rule runs."""
    texts: dict[str, Any] = field(default_factory=dict)
    """The string columns of ``frame`` as the Arrow arrays they share memory with."""


def _expected_types(contract: Contract) -> dict[str, str]:
    return {
        e["kwargs"]["column"]: str(e["kwargs"].get("type_", ""))
        for e in contract.suite["expectations"]
        if e["type"] == "expect_column_values_to_be_of_type" and "column" in e["kwargs"]
    }


# -- regex analysis: what a Python pattern can match -----------------------------------------------


def _sre_parse(pattern: str) -> Any:
    """Python's own parse tree of ``pattern`` (``re._parser``), or None when it does not compile."""
    try:
        from re import _parser as sre_parse  # type: ignore[attr-defined]
    except ImportError:  # Python < 3.11
        import sre_parse  # type: ignore[no-redef]
    try:
        return sre_parse.parse(pattern)
    except (re.error, TypeError, ValueError):
        return None


def _sre_names() -> dict[str, Any]:
    try:
        from re import _constants as sre_constants  # type: ignore[attr-defined]
    except ImportError:  # Python < 3.11
        import sre_constants  # type: ignore[no-redef]
    names = ("LITERAL", "IN", "RANGE", "SUBPATTERN", "BRANCH", "MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT", "ATOMIC_GROUP")
    return {n: getattr(sre_constants, n, None) for n in names}


MAX_LITERAL_OPTIONS = 64
"""A node matching more fixed strings than this is not used as a prefilter."""
MIN_LITERAL_CHARS = 3
"""Required literals shorter than this would let most rows through: no prefilter then."""


def _fixed_strings(nodes: Any, names: dict[str, Any]) -> set[str] | None:
    """The finite set of strings a node sequence can match, if it is small and made of literals only."""
    options = {""}
    for op, av in nodes:
        if op == names["LITERAL"]:
            choices = {chr(av)}
        elif op == names["IN"]:
            choices = set()
            for item_op, item_av in av:
                if item_op == names["LITERAL"]:
                    choices.add(chr(item_av))
                elif item_op == names["RANGE"] and item_av[1] - item_av[0] < MAX_LITERAL_OPTIONS:
                    choices.update(chr(c) for c in range(item_av[0], item_av[1] + 1))
                else:  # NEGATE, CATEGORY, a wide range
                    return None
        elif op == names["SUBPATTERN"]:
            _group, add_flags, _del_flags, sub = av
            if add_flags & re.IGNORECASE:
                return None
            choices = _fixed_strings(sub, names)
        elif op == names["BRANCH"]:
            choices = set()
            for branch in av[1]:
                fixed = _fixed_strings(branch, names)
                if fixed is None:
                    return None
                choices |= fixed
        else:
            return None
        if choices is None or len(options) * len(choices) > MAX_LITERAL_OPTIONS:
            return None
        options = {a + b for a in options for b in choices}
    return options


def _required_in(nodes: Any, names: dict[str, Any]) -> list[set[str]]:
    """Sets of strings such that every match of ``nodes`` contains at least one string of each set."""
    found: list[set[str]] = []
    run: list[Any] = []

    def close_run() -> None:
        if run:
            fixed = _fixed_strings(run, names)
            if fixed:
                found.append(fixed)
            run.clear()

    for op, av in nodes:
        if _fixed_strings([(op, av)], names) is not None:
            run.append((op, av))
            # a run longer than the option cap is still useful: keep its best prefix
            if _fixed_strings(run, names) is None:
                run.pop()
                close_run()
                run.append((op, av))
            continue
        close_run()
        if op == names["SUBPATTERN"] and not av[1] & re.IGNORECASE:
            found.extend(_required_in(av[3], names))
        elif op in (names["MAX_REPEAT"], names["MIN_REPEAT"], names["POSSESSIVE_REPEAT"]) and av[0] >= 1:
            found.extend(_required_in(av[2], names))
        elif op == names["ATOMIC_GROUP"]:
            found.extend(_required_in(av, names))
        elif op == names["BRANCH"]:
            per_branch = [_best_literals(_required_in(branch, names)) for branch in av[1]]
            if all(per_branch):
                found.append(set().union(*per_branch))  # type: ignore[arg-type]
    close_run()
    return found


def _best_literals(candidates: list[set[str]]) -> set[str] | None:
    usable = [c for c in candidates if c and min(map(len, c)) >= MIN_LITERAL_CHARS]
    if not usable:
        return None
    return max(usable, key=lambda c: (min(map(len, c)), -len(c)))


def required_literals(pattern: str) -> frozenset[str] | None:
    """Strings one of which every match of the Python regex ``pattern`` contains, or None if unknown.

    Sound by construction: a match is the concatenation of the matches of the pattern's top-level
    nodes, so it contains what a run of literal nodes (or a group, a branch of such runs, a repeat
    of at least one) matches. Case-insensitive patterns and anything this does not understand
    return None. A text that contains none of the strings cannot match the pattern.
    """
    parsed = _sre_parse(pattern)
    if parsed is None or parsed.state.flags & re.IGNORECASE:
        return None
    best = _best_literals(_required_in(parsed.data, _sre_names()))
    return frozenset(best) if best else None


def _valid_text(column: Any) -> Any:
    """A string column as valid UTF-8 Arrow strings: invalid bytes become U+FFFD (the encoding rule counts it).

    Valid text (the common case) is checked in C++ and returned as is, with no per-value decode.
    The chunks of a stacked batch are joined first: Arrow's regex kernels compile their pattern once
    per chunk, which cost more than the matching itself on a stack of small shards."""
    import pyarrow as pa

    if column.num_chunks > 1:
        try:
            column = pa.chunked_array([column.combine_chunks()])
        except pa.ArrowException:  # over 2 GiB of string data: stays chunked
            pass
    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        return pa.chunked_array(
            [pa.array([None if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()], type=column.type)]
        )
    return column


def _pandas_strings(column: Any) -> Any:
    """An Arrow string column as pandas' ``str`` dtype without a copy.

    Arrow-backed, so GE's ``astype(str)`` is a no-op and pandas runs ``str.contains`` / ``str.len``
    in Arrow (RE2) wherever that gives exactly Python's answer (pandas falls back to ``re`` itself
    when it would not)."""
    import numpy as np
    import pandas as pd

    return pd.Series(pd.arrays.ArrowStringArray(column, dtype=pd.StringDtype("pyarrow", na_value=np.nan)))


def _re2_char_class(pattern: str) -> str | None:
    """The RE2 spelling of a Python regex that is one character class, or None.

    Built from the parsed class (code point ranges), so both engines accept exactly the same
    characters; anything else (several nodes, categories like ``\\w``, flags) returns None."""
    parsed = _sre_parse(pattern)
    if parsed is None or parsed.state.flags & re.IGNORECASE or len(parsed.data) != 1:
        return None
    (op, av), = parsed.data
    names = _sre_names()
    if op == names["LITERAL"]:
        return f"\\x{{{av:x}}}"
    if op != names["IN"]:
        return None
    parts = []
    for item_op, item_av in av:
        if item_op == names["LITERAL"]:
            parts.append(f"\\x{{{item_av:x}}}")
        elif item_op == names["RANGE"]:
            parts.append(f"\\x{{{item_av[0]:x}}}-\\x{{{item_av[1]:x}}}")
        else:  # NEGATE, CATEGORY: leave those to Python
            return None
    return "[" + "".join(parts) + "]"


def _char_share(text: Any, pattern: str) -> Any:
    """Per row: characters matching ``pattern`` / all characters (0.0 for "", NaN for null), float64."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    re2 = _re2_char_class(pattern)
    if re2 is None:  # not a single class: Python's re, value by value (correct, slower)
        bad = re.compile(pattern)
        values = [np.nan if t is None else (len(bad.findall(t)) / len(t) if t else 0.0) for t in text.to_pylist()]
        return np.asarray(values, dtype="float64")
    bad_chars = pc.count_substring_regex(text, re2).cast(pa.float64())
    lengths = pc.utf8_length(text).cast(pa.float64())
    share = pc.if_else(pc.equal(lengths, 0.0), 0.0, pc.divide(bad_chars, lengths))
    return share.to_numpy(zero_copy_only=False)  # nulls become NaN


def _in_eval_split(text: Any, eval_doc_hashes: frozenset[str]) -> Any:
    """Per row: sha256(UTF-8 text) in the eval split (object array of bool, None for null).

    Only rows whose byte length is the length of some eval document can be equal to one, so with
    ``EvalDocHashes`` (what ``load_eval_doc_hashes`` returns) only those are hashed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    flags = np.where(pc.is_null(text).to_numpy(zero_copy_only=False), None, False).astype(object)
    if not eval_doc_hashes:
        return flags
    raw = text.cast(pa.large_binary() if pa.types.is_large_string(text.type) else pa.binary())
    lengths = getattr(eval_doc_hashes, "byte_lengths", None)
    if lengths is None:
        maybe = pc.is_valid(raw)
    else:
        maybe = pc.fill_null(pc.is_in(pc.binary_length(raw), value_set=pa.array(sorted(lengths), pa.int64())), False)
    rows = np.flatnonzero(maybe.to_numpy(zero_copy_only=False))
    if len(rows):
        for i, value in zip(rows.tolist(), raw.filter(maybe).to_pylist()):
            flags[i] = hashlib.sha256(value).hexdigest() in eval_doc_hashes
    return flags


def _shard_frame(table: Any, contract: Contract, eval_doc_hashes: frozenset[str]) -> _Frame:
    import pandas as pd

    expected = _expected_types(contract)
    columns: dict[str, Any] = {}
    texts: dict[str, Any] = {}
    usable: set[str] = set()
    typed_wrong: set[str] = set()
    for name in table.column_names:
        column = table.column(name)
        if _is_string_type(column.type):
            texts[name] = _valid_text(column)
            columns[name] = _pandas_strings(texts[name])
            usable.add(name)
        else:
            columns[name] = column.to_pandas()
            if expected.get(name, "") in _STRING_TYPE_NAMES:
                typed_wrong.add(name)
            else:
                usable.add(name)
    for derived, spec in contract.derived_columns.items():
        source = spec["column"]
        if source not in usable:
            continue  # the schema rules already report the missing / mistyped source column
        if source not in texts:
            import pyarrow as pa

            texts[source] = pa.chunked_array([pa.array(list(columns[source]))])
        if spec["kind"] == "char_share":
            columns[derived] = pd.Series(_char_share(texts[source], spec["pattern"]))
        elif spec["kind"] == "in_eval_split":
            columns[derived] = pd.Series(_in_eval_split(texts[source], eval_doc_hashes), dtype="object")
        usable.add(derived)
    # One constructor call: adding columns one by one re-builds pandas 3's arrow-backed column index
    # each time, which cost more than the whole GE run of a small shard.
    frame = pd.DataFrame(columns, index=pd.RangeIndex(table.num_rows))
    return _Frame(frame=frame, present=frozenset(usable), typed_wrong=frozenset(typed_wrong), texts=texts)


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


def _runnable(contract: Contract, shard: _Frame) -> tuple[int, ...]:
    """Expectations that can be evaluated on this shard.

    One broken column must produce one reason, not a cascade: expectations on a missing column are
    left to the required-columns rule, and a mistyped column gets only its type rule.
    """
    keep = []
    for i, exp in enumerate(contract.suite["expectations"]):
        columns = _columns_of(exp)
        if all(c in shard.present for c in columns):
            keep.append(i)
        elif exp["type"] == "expect_column_values_to_be_of_type" and columns[0] in shard.typed_wrong:
            keep.append(i)
    return tuple(keep)


# -- reasons ---------------------------------------------------------------------------------------


def redact(text: str, patterns: Iterable[str]) -> str:
    for pattern in patterns:
        text = re.sub(pattern, REDACTED, text)
    return text


def _excerpt(value: Any, patterns: Sequence[str]) -> str:
    """A short, printable, secret-free window of a value (around the first secret, if any)."""
    if not isinstance(value, str):
        return repr(value)[:SAMPLE_CHARS]
    # Redact the whole value before cutting, so a window never shows half of a secret.
    # Nothing after the first secret is shown either: a PEM header matches, its key body does not.
    clean = redact(value, patterns)
    start = clean.find(REDACTED)
    if start >= 0:
        window = clean[max(0, start - 40) : start + len(REDACTED)]
        return repr(window)[1:-1] + "…"
    shown = repr(clean[:SAMPLE_CHARS])[1:-1]
    return shown[:SAMPLE_CHARS] + ("…" if len(clean) > SAMPLE_CHARS or len(shown) > SAMPLE_CHARS else "")


def _plain(value: Any) -> Any:
    """A frame value as plain Python: numpy scalars unwrapped, pandas' missing (NaN, NA) as None."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if value is None or (isinstance(value, float) and value != value):
        return None
    if type(value).__name__ in ("NAType", "NaTType"):
        return None
    return value


def _sample(result: dict[str, Any], column: str | None, patterns: Sequence[str]) -> list[str]:
    indexed = result.get("partial_unexpected_index_list") or []
    sample: list[str] = []
    if indexed and isinstance(indexed[0], dict):
        for row in indexed[:SAMPLE_SIZE]:
            row = {k: _plain(v) for k, v in row.items()}
            doc_id = row.get("doc_id")
            label = _excerpt(doc_id, patterns) if doc_id is not None else f"<null doc_id> from {row.get('source')}"
            if column is None or column == "doc_id":
                sample.append(label)
            else:
                sample.append(f"{label}: {_excerpt(row.get(column), patterns)}")
        return sample
    return [_excerpt(_plain(v), patterns) for v in (result.get("partial_unexpected_list") or [])[:SAMPLE_SIZE]]


def _reason(validation_result: dict[str, Any], contract: Contract, rows: int) -> dict[str, Any]:
    config = validation_result["expectation_config"]
    kwargs = config.get("kwargs", {})
    column = kwargs.get("column")
    result = validation_result.get("result") or {}
    reason: dict[str, Any] = {"expectation": config["type"], "column": column}
    exception = validation_result.get("exception_info") or {}
    if exception.get("raised_exception"):
        reason.update(unexpected_count=0, sample=[], error=str(exception.get("exception_message"))[:300])
        return reason
    if "unexpected_count" in result:
        reason.update(unexpected_count=int(result["unexpected_count"]), sample=_sample(result, column, contract.secret_patterns))
        return reason
    observed = result.get("observed_value")
    if config["type"] == "expect_table_columns_to_match_set":
        mismatched = (result.get("details") or {}).get("mismatched") or {}
        missing = list(mismatched.get("missing") or [])
        unexpected = list(mismatched.get("unexpected") or []) if kwargs.get("exact_match", True) else []
        reason.update(
            unexpected_count=len(missing) + len(unexpected),
            sample=[f"missing column {c!r}" for c in missing] + [f"unexpected column {c!r}" for c in unexpected],
        )
    elif config["type"] == "expect_column_values_to_be_of_type":
        # A column's type is one fact about all its values: every row is affected.
        reason.update(unexpected_count=rows, sample=[f"observed type {observed}, expected {kwargs.get('type_')}"])
    else:
        bounds = {k: kwargs[k] for k in ("min_value", "max_value") if k in kwargs}
        reason.update(unexpected_count=1, sample=[f"observed {observed!r}" + (f", expected {bounds}" if bounds else "")])
    return reason


# -- validation ------------------------------------------------------------------------------------
#
# A batch of shards is validated with ONE Great Expectations run over the shards' frames stacked
# end to end (GE's fixed cost, 0.05-0.2 s per run, dwarfs the per-row work of a small shard). Every
# expectation of the contract falls in one of these classes, and each class is mapped back to the
# shards so that a shard's verdict and reasons are exactly what validating it alone gives
# (``tests/unit/kiln/test_validation.py`` checks this over the whole poison zoo):

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


@dataclass(frozen=True, slots=True)
class _LoadedShard:
    """A shard read as an Arrow table, not yet judged."""

    path: str
    sha256: str
    table: Any

    @property
    def rows(self) -> int:
        return int(self.table.num_rows)

    @property
    def schema_key(self) -> tuple[tuple[str, str, bool], ...]:
        """Shards with the same key can be stacked into one table (``pa.concat_tables``)."""
        return tuple((f.name, str(f.type), f.nullable) for f in self.table.schema)


def _quarantined(path: str, sha256: str, rows: int, contract: Contract, reasons: list[dict[str, Any]]) -> ShardReport:
    return ShardReport(path=path, sha256=sha256, rows=rows, verdict="quarantined", reasons=reasons, contract=contract.ref)


def _as_contract(contract: Contract | str) -> Contract:
    return contract if isinstance(contract, Contract) else load_contract(contract)


def _unreadable(path: str, sha256: str, contract: Contract, exc: BaseException) -> ShardReport:
    error = f"{type(exc).__name__}: {exc}"[:500]
    return _quarantined(path, sha256, 0, contract, [{"expectation": READABLE_RULE, "error": error}])


def _load_shard(path: str | Path, contract: Contract) -> ShardReport | _LoadedShard:
    """Read one shard. Unreadable → its quarantined report (never raises for bad data)."""
    abspath = os.path.abspath(path)
    try:
        with open(abspath, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return _quarantined(abspath, "", 0, contract, [{"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"}])
    sha256 = hashlib.sha256(data).hexdigest()  # of exactly the bytes validated
    try:
        table = _read_table(data)
    except Exception as exc:  # pyarrow raises many types for truncated/garbage/foreign files
        return _unreadable(abspath, sha256, contract, exc)
    return _LoadedShard(path=abspath, sha256=sha256, table=table)


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
    return ShardReport(path=loaded.path, sha256=loaded.sha256, rows=loaded.rows, verdict="healthy", reasons=[], contract=contract.ref)


def _evaluation_error(loaded: _LoadedShard, contract: Contract, exc: Exception) -> ShardReport:
    error = f"{type(exc).__name__}: {exc}"[:500]
    return _quarantined(loaded.path, loaded.sha256, loaded.rows, contract, [{"expectation": EVALUATION_ERROR_RULE, "error": error}])


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
    except Exception as exc:  # noqa: BLE001 - a shard GE cannot evaluate is not proven healthy
        return _evaluation_error(loaded, contract, exc)
    return _judged(loaded, contract, [_reason(r, contract, loaded.rows) for r in results])


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


def _re2_literal(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


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
        if exp["type"] not in PREFILTERED_EXPECTATIONS or column not in shard.texts or set(kwargs) - {"column", "regex", "regex_list"}:
            continue
        patterns = kwargs.get("regex_list") if "regex_list" in kwargs else [kwargs.get("regex")]
        if not patterns or not all(isinstance(p, str) for p in patterns):
            continue
        literal_sets = [required_literals(p) for p in patterns]
        if any(found is None for found in literal_sets):
            continue  # a pattern without a required literal: GE checks every row
        literals = frozenset().union(*literal_sets)  # type: ignore[arg-type]
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
        if by_key[key] is None:
            cannot_fail.add(i)
        else:
            moved[i] = by_key[key]  # type: ignore[assignment]
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
    except Exception:  # noqa: BLE001 - e.g. a column pandas cannot take: each shard alone says which
        return each_alone()
    frame = shard.frame
    index_columns = _index_columns(shard)
    try:
        prefiltered, moved, cannot_fail = _prefiltered_columns(shard, contract, in_stack)
    except Exception:  # noqa: BLE001 - the prefilter is an optimisation: per shard, the reference path decides
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
        details = batch.validate(_suite(ge, contract, failed, tuple(c for c in columns if c[0] in failed)), result_format={"result_format": "COMPLETE"})
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
    except Exception:  # noqa: BLE001 - GE failed on the stack: per shard, the reference path decides
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
        for position, owner in zip(flagged, owners.tolist()):
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
                    reasons[j].append(_reason({"expectation_config": exp, "result": {"observed_value": s.rows}}, contract, s.rows))
    for j, s in enumerate(group):
        reasons[j].extend(_reason(r, contract, s.rows) for r in alone_results[j])
    return [_judged(s, contract, r) for s, r in zip(group, reasons)]


def validate_shard(
    path: str | Path, contract: Contract | str, eval_doc_hashes: frozenset[str] = frozenset()
) -> ShardReport:
    """Check one shard against the contract. Bad data gives a quarantined report; it never raises.

    The bytes are read once: the sha256 in the report is the hash of exactly the bytes validated.
    Raises only ``ContractError`` when the contract itself cannot be evaluated (a fault, not data).
    """
    contract = _as_contract(contract)
    ge = _great_expectations()
    loaded = _load_shard(path, contract)
    return loaded if isinstance(loaded, ShardReport) else _validate_alone(loaded, contract, ge, eval_doc_hashes)


def validate_shards(
    paths: Iterable[str | Path], contract: Contract | str, eval_doc_hashes: frozenset[str] = frozenset()
) -> list[ShardReport]:
    """A batch of shards in one process: what a mapped DAG task runs. Reports in ``paths`` order.

    Shards of the same schema are stacked into one GE run (up to ``MAX_BATCH_ROWS`` rows), and
    each report is exactly the one ``validate_shard`` gives for that shard alone. Unreadable shards
    are quarantined one by one; like ``validate_shard``, this raises only ``ContractError``.
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
            for (position, _), report in zip(members, judged, strict=True):
                reports[position] = report
        pending.clear()
        pending_rows = 0

    for path in paths:
        loaded = _load_shard(path, contract)
        if isinstance(loaded, ShardReport):
            reports.append(loaded)
        elif not _stackable(loaded, contract, needed):
            reports.append(_validate_alone(loaded, contract, ge, eval_doc_hashes))
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


class EvalDocHashes(frozenset):  # type: ignore[type-arg]
    """sha256 hex digests of the eval split's texts, plus their UTF-8 byte lengths.

    A plain frozenset of the digests works everywhere this does; the lengths only let validation
    hash just the rows that could be equal to an eval document (same byte length)."""

    byte_lengths: frozenset[int]

    def __new__(cls, hashes: Iterable[str], byte_lengths: Iterable[int]) -> EvalDocHashes:
        self = super().__new__(cls, hashes)
        self.byte_lengths = frozenset(byte_lengths)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (EvalDocHashes, (frozenset(self), self.byte_lengths))


def load_eval_doc_hashes(corpus_dir: str | Path) -> EvalDocHashes:
    """sha256 of every document text of the corpus' eval split (``eval/*.parquet``).

    No eval split → empty set (the contamination rule then has nothing to compare with). An eval
    split that cannot be read is a fault: contamination could not be checked.
    """
    import pyarrow.parquet as pq

    hashes: set[str] = set()
    lengths: set[int] = set()
    for path in sorted(Path(corpus_dir).glob(EVAL_GLOB)):
        try:
            column = pq.read_table(path, columns=["text"]).column("text")
            texts = _decode_strings(column)
        except Exception as exc:
            raise ContractError(f"cannot read the eval split {path} for the contamination rule: {exc}") from exc
        for text in texts:
            if text is not None:
                data = text.encode("utf-8")
                hashes.add(hashlib.sha256(data).hexdigest())
                lengths.add(len(data))
    return EvalDocHashes(hashes, lengths)


def train_shards(corpus_dir: str | Path) -> list[Path]:
    return sorted(Path(corpus_dir).glob(TRAIN_GLOB))


def eval_shards(corpus_dir: str | Path) -> list[Path]:
    return sorted(Path(corpus_dir).glob(EVAL_GLOB))


def validate_directory(corpus_dir: str | Path, contract: Contract | str) -> list[ShardReport]:
    """Every ``train/*.parquet`` of a corpus directory, then the snapshot rule across shards."""
    contract = _as_contract(contract)
    hashes = load_eval_doc_hashes(corpus_dir)
    return cross_shard_duplicates(validate_shards(train_shards(corpus_dir), contract, hashes))


# -- snapshot-level rule, gate, manifest, report -----------------------------------------------------


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
            ids = [v for v in _decode_strings(pq.read_table(report.path, columns=[column]).column(column)) if v is not None]
        except Exception as exc:  # the file changed or vanished since it was validated
            reason = {"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"[:500]}
            updated[i] = replace(report, verdict="quarantined", reasons=[reason])
            continue
        collisions = [v for v in ids if v in first_seen]
        if collisions:
            sample = [f"{v} (also in {Path(first_seen[v]).name})" for v in collisions[:SAMPLE_SIZE]]
            reason = {"expectation": CROSS_SHARD_RULE, "column": column, "unexpected_count": len(collisions), "sample": sample}
            updated[i] = replace(report, verdict="quarantined", reasons=[*report.reasons, reason])
        else:
            first_seen.update(dict.fromkeys(ids, report.path))
    return [updated.get(i, r) for i, r in enumerate(reports)]


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
    return ShardEntry(path=path, sha256=sha256_file(path), rows=int(pq.ParquetFile(path).metadata.num_rows)).to_json()


def build_training_manifest(
    snapshot_id: str,
    corpus: str,
    contract: Contract | str,
    reports: Sequence[ShardReport],
    eval_shards: Sequence[str | Path | ShardEntry | dict[str, Any]] = (),
) -> TrainingManifest:
    """What the trainer may read: the healthy shards (path, sha256, rows), sorted by path.

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
        shards=[ShardEntry(path=r.path, sha256=r.sha256, rows=r.rows).to_json() for r in healthy],
        eval_shards=sorted((_shard_entry(s) for s in eval_shards), key=lambda e: e["path"]),
        quarantined=sorted(r.path for r in reports if r.verdict != "healthy"),
    )


def quarantine_report(
    reports: Sequence[ShardReport],
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
) -> dict[str, Any]:
    """The JSON report: every shard with verdict and reasons, quarantined ones listed first-class."""
    ordered = sorted(reports, key=lambda r: r.path)
    share = quarantined_share(ordered)
    body: dict[str, Any] = {
        "kind": "kiln.QuarantineReport",
        "contract": sorted({r.contract for r in ordered}),
        "shards": len(ordered),
        "healthy": sum(r.verdict == "healthy" for r in ordered),
        "quarantined": [r.path for r in ordered if r.verdict != "healthy"],
        "quarantined_share": round(share, 6),
        "reports": [r.to_json() for r in ordered],
    }
    if snapshot_id is not None:
        body["snapshot_id"] = snapshot_id
    if max_quarantine_share is not None:
        body["max_quarantine_share"] = max_quarantine_share
        body["gate"] = "pass" if ordered and share <= max_quarantine_share and body["healthy"] else "fail"
    if isinstance(contract, Contract):
        body["contract_sha256"] = contract.sha256
    return body


def write_quarantine_report(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
) -> Path:
    """Write ``quarantine_report(...)`` atomically; same reports → same bytes (no timestamps)."""
    body = quarantine_report(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract)
    return atomic_write_text(path, json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


_HTML_STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}"
    "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
    "tr.quarantined td:nth-child(2){color:#b00;font-weight:bold}tr.healthy td:nth-child(2){color:#070}"
    "code{font-size:90%}ul{margin:0;padding-left:1.2em}"
)


def _html_reason(reason: dict[str, Any], patterns: Sequence[str]) -> str:
    from html import escape

    def shown(value: Any) -> str:  # reports may come from JSON of unknown age: redact again
        return escape(redact(str(value), patterns))

    parts = [f"<code>{escape(str(reason.get('expectation')))}</code>"]
    if reason.get("column"):
        parts.append(f" on <code>{escape(str(reason['column']))}</code>")
    if "unexpected_count" in reason:
        parts.append(f" — {reason['unexpected_count']} unexpected")
    parts.extend(f"<br><code>{shown(sample)}</code>" for sample in reason.get("sample", []))
    if reason.get("error"):
        parts.append(f"<br><code>{shown(reason['error'])}</code>")
    return "<li>" + "".join(parts) + "</li>"


def _html_contract(contract: Contract) -> str:
    from html import escape

    rules = []
    for i, exp in enumerate(contract.suite["expectations"]):
        kwargs = {k: v for k, v in exp["kwargs"].items() if k != "regex_list"}
        if "regex_list" in exp["kwargs"]:
            kwargs["regex_list"] = f"{len(exp['kwargs']['regex_list'])} patterns"
        rules.append(
            f"<tr><td>{i}</td><td><code>{escape(str((exp.get('meta') or {}).get('kiln_rule', '')))}</code></td>"
            f"<td><code>{escape(exp['type'])}</code></td><td><code>{escape(json.dumps(kwargs, sort_keys=True))}</code></td>"
            f"<td>{escape(str(exp.get('description', '')))}</td></tr>"
        )
    return (
        f"<h2>Contract <code>{escape(contract.ref)}</code></h2><p>sha256 <code>{contract.sha256}</code> · "
        f"<code>{escape(str(contract.path))}</code></p>"
        "<table><tr><th>#</th><th>rule</th><th>expectation</th><th>arguments</th><th>why</th></tr>"
        + "".join(rules)
        + "</table>"
    )


def render_quarantine_html(
    reports: Sequence[ShardReport],
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
) -> str:
    """A self-contained HTML page of the quarantine report (for the Airflow task link / MLflow).

    Every shard (path, verdict, rows, sha256, reasons with redacted samples), the snapshot id, the
    gate outcome and, given a ``Contract``, the rules it was checked against. Deterministic.
    """
    from html import escape

    body = quarantine_report(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract)
    loaded = contract if isinstance(contract, Contract) else None
    patterns = loaded.secret_patterns if loaded is not None else ()
    paths = [r["path"] for r in body["reports"]]
    root = os.path.commonpath(paths) if len(paths) > 1 else (os.path.dirname(paths[0]) if paths else "")
    rows = []
    for r in sorted(body["reports"], key=lambda r: (r["verdict"] == "healthy", r["path"])):  # on-call reads the top
        name = os.path.relpath(r["path"], root) if root else r["path"]
        reasons = "".join(_html_reason(reason, patterns) for reason in r["reasons"])
        rows.append(
            f"<tr class='{escape(r['verdict'])}'><td title='{escape(r['path'])}'>{escape(name)}</td><td>{escape(r['verdict'])}</td>"
            f"<td>{r['rows']}</td><td><code title='{escape(r['sha256'])}'>{escape(r['sha256'][:12])}</code></td>"
            f"<td><ul>{reasons}</ul></td></tr>"
        )
    gate_line = (
        f"<p>Data gate: <b>{escape(body['gate'])}</b> (max quarantined share {body['max_quarantine_share']:.1%})</p>"
        if "gate" in body
        else ""
    )
    contract_refs = sorted({*body["contract"], *([loaded.ref] if loaded else ([contract] if isinstance(contract, str) else []))})
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kiln quarantine report</title><style>{_HTML_STYLE}</style>"
        "</head><body>"
        f"<h1>Quarantine report</h1><p>Snapshot: <code>{escape(str(body.get('snapshot_id', '-')))}</code> · "
        f"contract: <code>{escape(', '.join(contract_refs))}</code> · {body['healthy']}/{body['shards']} shards healthy · "
        f"quarantined share {body['quarantined_share']:.1%}</p>{gate_line}"
        f"<p>Shards under <code>{escape(root or '-')}</code>; a quarantined shard's bytes stay in the snapshot.</p>"
        "<table><tr><th>shard</th><th>verdict</th><th>rows</th><th>sha256</th><th>reasons</th></tr>"
        + "".join(rows)
        + "</table>"
        + (_html_contract(loaded) if loaded is not None else "")
        + "</body></html>\n"
    )


def write_quarantine_html(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
) -> Path:
    html = render_quarantine_html(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract)
    return atomic_write_text(path, html)


QUARANTINE_JSON = "quarantine-report.json"
QUARANTINE_HTML = "quarantine-report.html"
QUARANTINE_ARTIFACT_DIR = "quarantine"
"""Where ``publish_quarantine_report`` logs both files in the MLflow run."""


def publish_quarantine_report(
    reports: Sequence[ShardReport],
    out_dir: str | Path,
    *,
    snapshot_id: str,
    contract: Contract | str,
    max_quarantine_share: float,
    mlflow_run_id: str | None = None,
) -> dict[str, str]:
    """Write the JSON report and the HTML page to ``out_dir``; log both to an MLflow run if given.

    Returns ``{"json": path, "html": path}`` plus ``"json_uri"`` / ``"html_uri"`` (artifact URIs
    under ``quarantine/`` of the run) when ``mlflow_run_id`` is given; the tracking URI comes from
    the environment (``MLFLOW_TRACKING_URI``). Idempotent: the same reports rewrite the same bytes
    and re-log the same artifact paths. An MLflow failure is a ``RegistryError`` (retryable).
    """
    contract = _as_contract(contract)
    out = Path(out_dir)
    json_path = write_quarantine_report(
        reports, out / QUARANTINE_JSON, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract
    )
    html_path = write_quarantine_html(
        reports, out / QUARANTINE_HTML, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract
    )
    published = {"json": str(json_path), "html": str(html_path)}
    if mlflow_run_id:
        from mlflow import MlflowClient

        from kiln.settings import load

        try:
            # Explicit URI: mlflow's process-global one may have been set by other code in this process.
            client = MlflowClient(tracking_uri=load().mlflow_uri)
            for path in (json_path, html_path):
                client.log_artifact(mlflow_run_id, str(path), artifact_path=QUARANTINE_ARTIFACT_DIR)
            base = client.get_run(mlflow_run_id).info.artifact_uri.rstrip("/")
        except Exception as exc:  # MlflowException, connection errors, artifact store errors
            raise RegistryError(f"cannot log the quarantine report to MLflow run {mlflow_run_id}: {exc}") from exc
        published["json_uri"] = f"{base}/{QUARANTINE_ARTIFACT_DIR}/{json_path.name}"
        published["html_uri"] = f"{base}/{QUARANTINE_ARTIFACT_DIR}/{html_path.name}"
    return published

"""A shard as the frame GE checks: Arrow-backed strings, the contract's derived columns, the rules that can run on it.

pandas, numpy and pyarrow are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

from kiln.data.contracts import Contract
from kiln.data.validation.patterns import _re2_char_class
from kiln.data.validation.suite import _columns_of

_STRING_TYPE_NAMES = ("str", "string", "object")


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


def _is_string_type(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type))


def _valid_text(column: Any) -> Any:
    """A string column as valid UTF-8 Arrow strings: invalid bytes become U+FFFD (the encoding rule counts it).

    Valid text (the common case) is checked in C++ and returned as is, with no per-value decode.
    The chunks of a stacked batch are joined first: Arrow's regex kernels compile their pattern once
    per chunk, which cost more than the matching itself on a stack of small shards."""
    import pyarrow as pa

    if column.num_chunks > 1:
        with contextlib.suppress(pa.ArrowException):  # over 2 GiB of string data: stays chunked
            column = pa.chunked_array([column.combine_chunks()])
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


def _char_share(text: Any, pattern: str) -> Any:
    """Per row: characters matching ``pattern`` / all characters (0.0 for "", NaN for null), float64."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kiln.data.re2_patterns import re2_exact

    # One character class (the common case) is spelled for RE2 directly; any other pattern is translated
    # with Python's meaning kept (``contract check`` refuses one that cannot be): either way Arrow's RE2 counts.
    re2 = _re2_char_class(pattern) or re2_exact(pattern)
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

    is_null = pc.is_null(text).to_numpy(zero_copy_only=False)
    flags = np.full(len(is_null), False, dtype=object)
    flags[is_null] = None
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
        for i, value in zip(rows.tolist(), raw.filter(maybe).to_pylist(), strict=True):
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


def _runnable(contract: Contract, shard: _Frame) -> tuple[int, ...]:
    """Expectations that can be evaluated on this shard.

    One broken column must produce one reason, not a cascade: expectations on a missing column are
    left to the required-columns rule, and a mistyped column gets only its type rule.
    """
    keep = []
    for i, exp in enumerate(contract.suite["expectations"]):
        columns = _columns_of(exp)
        present = all(c in shard.present for c in columns)
        if present or (exp["type"] == "expect_column_values_to_be_of_type" and columns[0] in shard.typed_wrong):
            keep.append(i)
    return tuple(keep)

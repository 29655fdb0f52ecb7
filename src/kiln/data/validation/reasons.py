"""What a shard's report says: its reasons, built from GE results, with short and redacted samples."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from kiln.data.contracts import Contract
from kiln.refs import ShardReport

SAMPLE_SIZE = 3
SAMPLE_CHARS = 100
REDACTED = "[REDACTED]"


def redact(text: str, patterns: Iterable[str]) -> str:
    """``text`` with every match of the secret ``patterns`` replaced, on RE2 (linear in the text; a redacted
    span may take one neighbouring character more where the pattern starts or ends with a lookaround or
    ``\\b``). A pattern RE2 cannot take (only from a report older than that check) falls back to ``re``."""
    from kiln.data.re2_patterns import compiled_search
    from kiln.errors import PatternNotLinear

    for pattern in patterns:
        try:
            text = compiled_search(pattern).sub(REDACTED, text)
        except (PatternNotLinear, TypeError):
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


def _quarantined(path: str, sha256: str, rows: int, contract: Contract, reasons: list[dict[str, Any]]) -> ShardReport:
    return ShardReport(path=path, sha256=sha256, rows=rows, verdict="quarantined", reasons=reasons, contract=contract.ref)

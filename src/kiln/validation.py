"""Shard validation against a data contract, quarantine, and the data gate.

    validate_shard(path, contract, eval_doc_hashes) -> ShardReport     one shard, never raises on data
    validate_shards(paths, ...) / validate_directory(corpus_dir, ...)  batches (one GE context)
    cross_shard_duplicates(reports) -> reports                          snapshot rule: ids unique across shards
    gate(reports, max_quarantine_share)                                 DataGateError (no retry) above threshold
    build_training_manifest(...) -> TrainingManifest                    healthy shards only
    write_quarantine_report(reports, path)                              every shard with its verdict

A quarantined shard is a value (``ShardReport(verdict="quarantined")``), never an exception: bad
*data* must not crash a worker. Exceptions are for faults: a contract GE cannot parse
(``ContractError``), a gate breach (``DataGateError``).

great_expectations and pandas are imported on first use, so importing this module stays cheap
(DAG files and the CLI's ``--help`` import it). One ephemeral GE context is built per process and
reused by every validation (FIELD-NOTES: ~3 s import, ~55 ms per validation after that).
"""

from __future__ import annotations

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
from kiln.errors import ContractError, DataGateError
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

SAMPLE_SIZE = 3
SAMPLE_CHARS = 100
REDACTED = "[REDACTED]"

_STRING_TYPE_NAMES = ("str", "string", "object")


# -- the one GE context per process ----------------------------------------------------------------


@dataclass
class _GreatExpectations:
    batch_definition: Any
    suites: dict[tuple[str, str, tuple[int, ...]], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_GE: _GreatExpectations | None = None
_GE_INIT_LOCK = threading.Lock()


def _great_expectations() -> _GreatExpectations:
    """Build the process-wide ephemeral context once: pandas source → dataframe asset → whole batch."""
    global _GE
    with _GE_INIT_LOCK:
        if _GE is None:
            import great_expectations as gx

            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = {"globally": False}
            asset = context.data_sources.add_pandas("kiln_shards").add_dataframe_asset("shard")
            _GE = _GreatExpectations(batch_definition=asset.add_batch_definition_whole_dataframe("whole_shard"))
        return _GE


def _suite(ge: _GreatExpectations, contract: Contract, keep: tuple[int, ...]) -> Any:
    """The GE suite of the contract restricted to expectations ``keep`` (cached)."""
    key = (contract.ref, contract.sha256, keep)
    suite = ge.suites.get(key)
    if suite is None:
        import great_expectations as gx

        expectations = [contract.suite["expectations"][i] for i in keep]
        try:
            suite = gx.ExpectationSuite(
                name=contract.ref, expectations=expectations, meta=contract.suite.get("meta"), notes=contract.suite.get("notes")
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

    raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    return [None if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()]


def _read_table(data: bytes) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data))


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class _Frame:
    frame: Any
    """pandas DataFrame: raw columns (strings decoded) + derived columns."""
    present: frozenset[str]
    """Columns GE may check with every expectation (present, and of the expected type when it is str)."""
    typed_wrong: frozenset[str]
    """Present columns with a non-string type where the contract expects str: only the type rule runs."""


def _expected_types(contract: Contract) -> dict[str, str]:
    return {
        e["kwargs"]["column"]: str(e["kwargs"].get("type_", ""))
        for e in contract.suite["expectations"]
        if e["type"] == "expect_column_values_to_be_of_type" and "column" in e["kwargs"]
    }


def _shard_frame(table: Any, contract: Contract, eval_doc_hashes: frozenset[str]) -> _Frame:
    import pandas as pd

    expected = _expected_types(contract)
    columns: dict[str, Any] = {}
    usable: set[str] = set()
    typed_wrong: set[str] = set()
    for name in table.column_names:
        column = table.column(name)
        if _is_string_type(column.type):
            columns[name] = pd.Series(_decode_strings(column), dtype="object")
            usable.add(name)
        else:
            columns[name] = column.to_pandas()
            if expected.get(name, "") in _STRING_TYPE_NAMES:
                typed_wrong.add(name)
            else:
                usable.add(name)
    frame = pd.DataFrame(columns, index=pd.RangeIndex(table.num_rows))
    for derived, spec in contract.derived_columns.items():
        source = spec["column"]
        if source not in usable:
            continue  # the schema rules already report the missing / mistyped source column
        values = frame[source]
        if spec["kind"] == "char_share":
            bad = re.compile(spec["pattern"])
            frame[derived] = pd.Series(
                [None if t is None else (len(bad.findall(t)) / len(t) if t else 0.0) for t in values], dtype="object"
            )
        elif spec["kind"] == "in_eval_split":
            frame[derived] = pd.Series(
                [None if t is None else _text_sha256(t) in eval_doc_hashes for t in values], dtype="object"
            )
        usable.add(derived)
    return _Frame(frame=frame, present=frozenset(usable), typed_wrong=frozenset(typed_wrong))


def _expectation_index(config: Any, contract: Contract) -> int:
    """Position in the contract of the expectation a GE result belongs to (GE reorders results)."""
    kwargs = dict(config.kwargs)
    for i, exp in enumerate(contract.suite["expectations"]):
        if exp["type"] == config.type and all(kwargs.get(k) == v for k, v in exp["kwargs"].items()):
            return i
    raise ContractError(f"GE returned a result for an expectation not in {contract.ref}: {config.type} {kwargs}")


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


def _sample(result: dict[str, Any], column: str | None, patterns: Sequence[str]) -> list[str]:
    indexed = result.get("partial_unexpected_index_list") or []
    sample: list[str] = []
    if indexed and isinstance(indexed[0], dict):
        for row in indexed[:SAMPLE_SIZE]:
            doc_id = row.get("doc_id")
            label = _excerpt(doc_id, patterns) if doc_id is not None else f"<null doc_id> from {row.get('source')}"
            if column is None or column == "doc_id":
                sample.append(label)
            else:
                sample.append(f"{label}: {_excerpt(row.get(column), patterns)}")
        return sample
    return [_excerpt(v, patterns) for v in (result.get("partial_unexpected_list") or [])[:SAMPLE_SIZE]]


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


def _quarantined(path: str, sha256: str, rows: int, contract: Contract, reasons: list[dict[str, Any]]) -> ShardReport:
    return ShardReport(path=path, sha256=sha256, rows=rows, verdict="quarantined", reasons=reasons, contract=contract.ref)


def _as_contract(contract: Contract | str) -> Contract:
    return contract if isinstance(contract, Contract) else load_contract(contract)


def validate_shard(
    path: str | Path, contract: Contract | str, eval_doc_hashes: frozenset[str] = frozenset()
) -> ShardReport:
    """Check one shard against the contract. Bad data gives a quarantined report; it never raises.

    The bytes are read once: the sha256 in the report is the hash of exactly the bytes validated.
    Raises only ``ContractError`` when the contract itself cannot be evaluated (a fault, not data).
    """
    contract = _as_contract(contract)
    ge = _great_expectations()
    abspath = os.path.abspath(path)
    try:
        with open(abspath, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return _quarantined(abspath, "", 0, contract, [{"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"}])
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        table = _read_table(data)
        shard = _shard_frame(table, contract, eval_doc_hashes)
    except Exception as exc:  # pyarrow raises many types for truncated/garbage/foreign files
        error = f"{type(exc).__name__}: {exc}"[:500]
        return _quarantined(abspath, sha256, 0, contract, [{"expectation": READABLE_RULE, "error": error}])
    rows = int(table.num_rows)

    keep = _runnable(contract, shard)
    result_format: dict[str, Any] = {"result_format": "SUMMARY", "partial_unexpected_count": SAMPLE_SIZE}
    index_columns = [c for c in ("doc_id", "source") if c in shard.present]
    if index_columns:
        result_format["unexpected_index_column_names"] = index_columns
    try:
        with ge.lock:
            batch = ge.batch_definition.get_batch(batch_parameters={"dataframe": shard.frame})
            # Most shards are healthy: a pass/fail-only run costs ~40% less than one collecting
            # samples, so details are computed only for the expectations that failed.
            verdicts = batch.validate(_suite(ge, contract, keep), result_format="BOOLEAN_ONLY")
            failed = tuple(sorted(_expectation_index(r.expectation_config, contract) for r in verdicts.results if not r.success))
            results = []
            if failed:
                details = batch.validate(_suite(ge, contract, failed), result_format=result_format)
                results = [r.to_json_dict() for r in details.results if not r.success]
    except ContractError:
        raise
    except Exception as exc:  # noqa: BLE001 - a shard GE cannot evaluate is not proven healthy
        error = f"{type(exc).__name__}: {exc}"[:500]
        return _quarantined(abspath, sha256, rows, contract, [{"expectation": EVALUATION_ERROR_RULE, "error": error}])
    if failed and not results:  # GE disagreed with itself between the two runs: never call that healthy
        results = [{"expectation_config": contract.suite["expectations"][i], "result": {}} for i in failed]
    reasons = [_reason(r, contract, rows) for r in results]
    order = {e["type"] + str(e["kwargs"].get("column")): i for i, e in enumerate(contract.suite["expectations"])}
    reasons.sort(key=lambda r: order.get(r["expectation"] + str(r.get("column")), len(order)))
    if reasons:
        return _quarantined(abspath, sha256, rows, contract, reasons)
    return ShardReport(path=abspath, sha256=sha256, rows=rows, verdict="healthy", reasons=[], contract=contract.ref)


def load_eval_doc_hashes(corpus_dir: str | Path) -> frozenset[str]:
    """sha256 of every document text of the corpus' eval split (``eval/*.parquet``).

    No eval split → empty set (the contamination rule then has nothing to compare with). An eval
    split that cannot be read is a fault: contamination could not be checked.
    """
    import pyarrow.parquet as pq

    hashes: set[str] = set()
    for path in sorted(Path(corpus_dir).glob(EVAL_GLOB)):
        try:
            column = pq.read_table(path, columns=["text"]).column("text")
            texts = _decode_strings(column)
        except Exception as exc:
            raise ContractError(f"cannot read the eval split {path} for the contamination rule: {exc}") from exc
        hashes.update(_text_sha256(t) for t in texts if t is not None)
    return frozenset(hashes)


def validate_shards(
    paths: Iterable[str | Path], contract: Contract | str, eval_doc_hashes: frozenset[str] = frozenset()
) -> list[ShardReport]:
    """A batch of shards in one process (one GE context): what a mapped DAG task runs."""
    contract = _as_contract(contract)
    return [validate_shard(p, contract, eval_doc_hashes) for p in paths]


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
    reports: Sequence[ShardReport], *, snapshot_id: str | None = None, max_quarantine_share: float | None = None
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
    return body


def write_quarantine_report(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
) -> Path:
    """Write ``quarantine_report(...)`` atomically; same reports → same bytes (no timestamps)."""
    body = quarantine_report(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share)
    return atomic_write_text(path, json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def render_quarantine_html(
    reports: Sequence[ShardReport], *, snapshot_id: str | None = None, max_quarantine_share: float | None = None
) -> str:
    """A self-contained HTML page of the quarantine report (for the Airflow task link / MLflow)."""
    from html import escape

    body = quarantine_report(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share)
    rows = []
    for r in body["reports"]:
        reasons = "".join(
            "<li><code>{}</code>{}{}{}</li>".format(
                escape(str(reason.get("expectation"))),
                f" on <code>{escape(str(reason['column']))}</code>" if reason.get("column") else "",
                f" — {reason['unexpected_count']} unexpected" if "unexpected_count" in reason else "",
                "".join(f"<br><code>{escape(str(s))}</code>" for s in reason.get("sample", []))
                + (f"<br><code>{escape(str(reason['error']))}</code>" if reason.get("error") else ""),
            )
            for reason in r["reasons"]
        )
        rows.append(
            f"<tr class='{escape(r['verdict'])}'><td>{escape(Path(r['path']).name)}</td><td>{escape(r['verdict'])}</td>"
            f"<td>{r['rows']}</td><td><code>{escape(r['sha256'][:12])}</code></td><td><ul>{reasons}</ul></td></tr>"
        )
    gate_line = (
        f"<p>Data gate: <b>{escape(body['gate'])}</b> (max quarantined share {body['max_quarantine_share']:.1%})</p>"
        if "gate" in body
        else ""
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kiln quarantine report</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px 8px;vertical-align:top}tr.quarantined td:nth-child(2){color:#b00;font-weight:bold}"
        "tr.healthy td:nth-child(2){color:#070}code{font-size:90%}</style></head><body>"
        f"<h1>Quarantine report</h1><p>Snapshot: <code>{escape(str(body.get('snapshot_id', '-')))}</code> · "
        f"contract: <code>{escape(', '.join(body['contract']))}</code> · {body['healthy']}/{body['shards']} shards healthy · "
        f"quarantined share {body['quarantined_share']:.1%}</p>{gate_line}"
        "<table><tr><th>shard</th><th>verdict</th><th>rows</th><th>sha256</th><th>reasons</th></tr>"
        + "".join(rows)
        + "</table></body></html>\n"
    )


def write_quarantine_html(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
) -> Path:
    html = render_quarantine_html(reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share)
    return atomic_write_text(path, html)

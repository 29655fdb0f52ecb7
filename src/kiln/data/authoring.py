"""Contract authoring: a draft contract profiled from a sample of a corpus, and a check that names every
bad field of a contract file (``kiln contract init`` / ``kiln contract check``).

    draft_contract(name, corpus_dir, ...) -> (suite, profile)   columns, types, length ranges, rule thresholds
    check_contract_file(path) -> [problem]                      every bad field, each named

A draft is for a person to review, never used as is: its ``notes`` say so, and ``meta.kiln_profile``
records what was observed (rows, columns, quantiles, and the share of the sample each document rule
would drop) so the reviewer can see why each threshold is what it is. How thresholds are set:

* columns present in every sampled shard are required (``exact_match: false``), with their types;
  a column without nulls gets a not-null rule, ``doc_id`` (if present) a uniqueness rule;
* row count: 1 up to 10x the largest sampled shard (a shard far larger than any seen is a fault);
* text length: half the 0.1 % quantile up to twice the 99.9 % quantile of the sample, within [1, 10^7];
* encoding: the share of control / replacement characters at most max(1 %, the 99.9 % quantile);
* document rules (copied from a base contract, ``web-text@1`` by default): Gopher's word-count bounds
  widened to the sample's 1 % / 99.9 % quantiles of whitespace words where the paper's would cut
  more, the script rule's share to the 99 % quantile when the sample has more letters of other scripts;
  every other threshold is the base contract's (the papers') value;
* ``max_dropped_share``: the base contract's, raised to the largest share a sampled shard would drop
  plus 0.1 (capped at 0.9) so the sample itself passes.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

from kiln.data.contracts import contract_problems, load_contract
from kiln.errors import ConfigError, ContractError

SAMPLE_SHARDS = 64
"""Shards profiled at most (evenly spread over the sorted shard list)."""
SAMPLE_DOCUMENTS = 20_000
"""Documents profiled at most."""


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def _type_name(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    return str(arrow_type.to_pandas_dtype().__name__) if hasattr(arrow_type, "to_pandas_dtype") else str(arrow_type)


def _sample_shards(corpus_dir: Path) -> list[Path]:
    from kiln.data.validation import train_shards

    shards = [p for p in train_shards(corpus_dir) if p.is_file() and not p.is_symlink()]
    if not shards:
        raise ConfigError(f"{corpus_dir} has no training shards (train/*.parquet) to profile")
    if len(shards) <= SAMPLE_SHARDS:
        return shards
    step = len(shards) / SAMPLE_SHARDS
    return [shards[int(i * step)] for i in range(SAMPLE_SHARDS)]


def draft_contract(
    name: str, corpus_dir: str | Path, *, version: int = 1, base: str = "web-text@1", text_column: str = "text"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A draft contract suite for the corpus under ``corpus_dir`` and the profile it was made from."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kiln.data.contracts import _NAME

    if not _NAME.fullmatch(name):
        raise ConfigError(f"contract name {name!r}: use lowercase letters, digits, '.', '_' or '-' (e.g. my-corpus)")
    template = load_contract(base)
    corpus_dir = Path(corpus_dir)
    paths = _sample_shards(corpus_dir)
    tables = []
    unreadable = []
    empty: list[str] = []
    budget = SAMPLE_DOCUMENTS
    for path in paths:
        if budget <= 0:
            break
        try:
            table = pq.read_table(path)
        except Exception as exc:  # a broken shard is the validation's to quarantine; the profile names it
            unreadable.append(f"{path.name}: {type(exc).__name__}: {exc}"[:200])
            continue
        if table.num_rows == 0:  # no document, and its columns may be typed null: named, not profiled
            empty.append(path.name)
            continue
        tables.append((path, table.slice(0, budget)))
        budget -= min(budget, table.num_rows)
    if not tables:
        why = "; ".join(unreadable[:3]) or f"{len(empty)} shard(s) without a row"
        raise ConfigError(f"no shard of {corpus_dir} has documents to profile: {why}")
    common = set(tables[0][1].column_names)
    for _, table in tables[1:]:
        common &= set(table.column_names)
    columns = [c for c in tables[0][1].column_names if c in common]
    if text_column not in columns:
        raise ConfigError(f"--text-column {text_column!r} is not a column of every sampled shard (columns: {columns})")
    types = {c: _type_name(tables[0][1].schema.field(c).type) for c in columns}
    if types[text_column] != "str":
        raise ConfigError(f"--text-column {text_column!r} holds {types[text_column]}, not strings")
    nulls = {c: sum(t.column(c).null_count for _, t in tables) for c in columns}
    # string and large_string are both text: shards written by different tools mix them.
    texts = pa.chunked_array([t.column(text_column).cast(pa.large_string()) for _, t in tables]).combine_chunks()
    lengths = [float(v) for v in pc.utf8_length(texts).to_pylist() if v is not None]
    bad_share = _bad_char_shares(texts, template)
    words = [float(len(t.split())) for t in texts.to_pylist() if t is not None]
    rows = [t.num_rows for _, t in tables]

    suite = copy.deepcopy(template.suite)
    suite["name"] = name
    suite["notes"] = (f"DRAFT made by `kiln contract init {name} --from {corpus_dir}` from {len(lengths)} documents of "
                      f"{len(tables)} shard(s), based on {template.ref}: review every rule and threshold (and "
                      "meta.kiln_profile) before publishing it as data_contracts/<name>/v<N>.json.")
    kiln = suite["meta"]["kiln"]
    kiln["contract"], kiln["version"] = name, version
    expectations: list[dict[str, Any]] = [{
        "type": "expect_table_columns_to_match_set",
        "kwargs": {"column_set": columns, "exact_match": False},
        "meta": {"kiln_rule": "schema.required_columns"},
        "description": f"The shard has the columns {', '.join(columns)} (seen in every sampled shard; extra columns allowed).",
    }]
    for column in columns:
        expectations.append({"type": "expect_column_values_to_be_of_type", "kwargs": {"column": column, "type_": types[column]},
                             "meta": {"kiln_rule": "schema.types"}, "description": f"{column} is {types[column]} (observed)."})
    expectations.append({"type": "expect_table_row_count_to_be_between",
                         "kwargs": {"min_value": 1, "max_value": max(1000, 10 * max(rows))}, "meta": {"kiln_rule": "row_count"},
                         "description": f"1 to 10x the largest sampled shard ({max(rows)} rows) documents per shard."})
    for column in columns:
        if nulls[column] == 0:
            expectations.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": column},
                                 "meta": {"kiln_rule": "not_null"}, "description": f"No null {column} (none in the sample)."})
    if "doc_id" in columns:
        expectations.append({"type": "expect_column_values_to_be_unique", "kwargs": {"column": "doc_id"},
                             "meta": {"kiln_rule": "unique_ids"}, "description": "Document ids are unique within the shard."})
    low = max(1, int(_quantile(lengths, 0.001) // 2))
    high = min(10**7, max(low + 1, int(math.ceil(_quantile(lengths, 0.999) * 2))))
    expectations.append({"type": "expect_column_value_lengths_to_be_between",
                         "kwargs": {"column": text_column, "min_value": low, "max_value": high},
                         "meta": {"kiln_rule": "text_length"},
                         "description": f"{low} to {high} characters: half the 0.1% and twice the 99.9% quantile of the sample."})
    kept_for_text = [e for e in template.expectations
                     if (e.get("meta") or {}).get("kiln_rule") in ("text_encoding", "no_secrets", "no_eval_contamination")]
    for exp in copy.deepcopy(kept_for_text):
        if exp["kwargs"].get("column") == "text":
            exp["kwargs"]["column"] = text_column
        if (exp.get("meta") or {}).get("kiln_rule") == "text_encoding":
            exp["kwargs"]["max_value"] = round(max(0.01, _quantile(bad_share, 0.999)), 6)
        expectations.append(exp)
    suite["expectations"] = expectations
    for spec in kiln.get("derived_columns", {}).values():
        spec["column"] = text_column
    if "near_duplicates" in kiln:
        kiln["near_duplicates"]["column"] = text_column

    rules = kiln.get("document_rules", [])
    for rule in rules:
        params = rule.setdefault("params", {})
        if rule["kind"] == "datatrove.GopherQualityFilter":
            if params.get("min_doc_words") is not None:
                params["min_doc_words"] = int(min(params["min_doc_words"], _quantile(words, 0.01)))
            if params.get("max_doc_words") is not None:
                params["max_doc_words"] = int(max(params["max_doc_words"], math.ceil(_quantile(words, 0.999) * 2)))
        if rule["kind"] == "kiln.script":
            share = _other_script_shares(texts, params)
            params["max_other_letter_share"] = round(min(1.0, max(params["max_other_letter_share"], _quantile(share, 0.99))), 4)
    drops: dict[str, Any] = _drop_profile(tables, text_column, rules) if rules else {"by_rule": {}, "max_shard_share": 0.0}
    if "max_dropped_share" in kiln:
        kiln["max_dropped_share"] = round(min(0.9, max(kiln["max_dropped_share"], drops["max_shard_share"] + 0.1)), 4)
    profile = {
        "corpus": str(corpus_dir.resolve()),
        "base": template.ref,
        "shards_sampled": [p.name for p, _ in tables],
        "shards_unreadable": unreadable,
        "shards_empty": empty,
        "documents": len(lengths),
        "columns": {c: {"type": types[c], "nulls": nulls[c]} for c in columns},
        "rows_per_shard": {"min": min(rows), "max": max(rows)},
        "text_chars": {q: _quantile(lengths, float(q)) for q in ("0.001", "0.01", "0.5", "0.99", "0.999")},
        "text_words": {q: _quantile(words, float(q)) for q in ("0.001", "0.01", "0.5", "0.99", "0.999")},
        "bad_char_share_0.999": _quantile(bad_share, 0.999),
        "document_rules_would_drop": drops,
    }
    suite["meta"]["kiln_profile"] = profile
    return suite, profile


def _bad_char_shares(texts: Any, template: Any) -> list[float]:
    """Per document, the base contract's encoding share (its ``char_share`` derived column), as validation computes it."""
    import pyarrow as pa

    from kiln.data.validation.frames import _char_share

    patterns = [spec["pattern"] for spec in template.derived_columns.values() if spec.get("kind") == "char_share"]
    if not patterns:
        return []
    shares = _char_share(pa.chunked_array([texts]), patterns[0])
    return [float(v) for v in shares if v == v]  # NaN (null text) left out


def _other_script_shares(texts: Any, params: dict[str, Any]) -> list[float]:
    import pyarrow.compute as pc

    allowed = "[" + "".join(f"\\p{{{s}}}" for s in params.get("scripts", ["Latin"])) + "]"
    letters = pc.count_substring_regex(texts, r"\pL").to_pylist()
    own = pc.count_substring_regex(texts, allowed).to_pylist()
    return [(n - m) / n for n, m in zip(letters, own, strict=True) if n]


def _drop_profile(tables: list[tuple[Path, Any]], text_column: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    """Share of the sample each document rule drops (first failing rule), and the largest shard share."""
    from kiln.data.doc_rules import build_rule_set

    rule_set = build_rule_set(rules)
    by_rule: dict[str, int] = {}
    total = 0
    worst = 0.0
    for _, table in tables:
        dropped = rule_set.judge(table.column(text_column))
        for d in dropped:
            by_rule[d.rule] = by_rule.get(d.rule, 0) + 1
        total += table.num_rows
        if table.num_rows:
            worst = max(worst, len(dropped) / table.num_rows)
    return {"by_rule": {k: round(v / total, 4) for k, v in sorted(by_rule.items())} if total else {},
            "max_shard_share": round(worst, 4)}


def check_contract_file(path: str | Path) -> list[str]:
    """Every problem of a contract file, each naming its field: JSON, the suite's structure, each
    expectation as Great Expectations parses it, the document rules' parameters against datatrove's
    signatures, and (for a file at ``.../NAME/vN.json``) name and version against its place."""
    from kiln.data.contracts import read_contract_json

    path = Path(path)
    try:
        suite = read_contract_json(path)
    except ContractError as exc:
        return [str(exc)]
    place = re.fullmatch(r"v([1-9][0-9]*)\.json", path.name)
    name = path.parent.name if place else None
    version = int(place.group(1)) if place else None
    problems = contract_problems(suite, name=name, version=version)
    if not isinstance(suite, dict):
        return problems
    kiln = (suite.get("meta") or {}).get("kiln") if isinstance(suite.get("meta"), dict) else None
    if isinstance(kiln, dict) and isinstance(kiln.get("document_rules"), list):
        from kiln.data.doc_rules import check_document_rules

        problems.extend(p for p in check_document_rules(kiln["document_rules"], deep=True) if p not in problems)
    problems.extend(_great_expectations_problems(suite.get("expectations")))
    return problems


def _great_expectations_problems(expectations: Any) -> list[str]:
    if not isinstance(expectations, list):
        return []
    import logging

    import great_expectations as gx

    problems = []
    # GE logs a traceback for an expectation it cannot build (and may then go on without it): the
    # problem is reported here in one line instead.
    ge_log = logging.getLogger("great_expectations")
    level = ge_log.level
    ge_log.setLevel(logging.CRITICAL)
    try:
        for i, exp in enumerate(expectations):
            if not isinstance(exp, dict) or not str(exp.get("type", "")).startswith("expect_") or not isinstance(
                    exp.get("kwargs"), dict):
                continue  # already named by the structural check
            try:
                built = gx.ExpectationSuite(name="check", expectations=[copy.deepcopy(exp)])
                why = "" if len(built.expectations) == 1 else "unknown expectation type"
            except Exception as exc:  # GE raises its own and pydantic errors
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if why:
                problems.append(f"expectations[{i}] ({exp['type']}): Great Expectations refuses it: {why}"[:400])
    finally:
        ge_log.setLevel(level)
    return problems

"""``kiln.data.validation.stacking``: a stacked batch gives each shard exactly the report it gets alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data import validation
from kiln.data.corpus import POISON_KINDS, parquet_bytes
from kiln.data.validation import (
    READABLE_RULE,
    load_eval_doc_hashes,
    stacking,  # stacking and validate: the modules whose internals these tests watch
    validate,
)
from kiln.data.validation.reasons import REDACTED

from shard_fixtures import shard_of, validated_one_by_one, write_file

# -- one GE run per batch: identical to one shard at a time -------------------------------------------


@pytest.mark.parametrize("corpus", ["clean_corpus", "poisoned_corpus"])
def test_batched_validation_equals_one_shard_at_a_time(corpus: str, request, stdlib_contract) -> None:
    summary = request.getfixturevalue(corpus)
    paths = validation.train_shards(summary["out"])
    hashes = load_eval_doc_hashes(summary["out"])
    alone = validated_one_by_one(paths, stdlib_contract, hashes)
    assert validation.validate_shards(paths, stdlib_contract, hashes) == alone  # the whole corpus in one batch
    in_fours = [r for i in range(0, len(paths), 4) for r in validation.validate_shards(paths[i : i + 4], stdlib_contract, hashes)]
    assert in_fours == alone  # the DAG's batches
    assert any(r.verdict == "quarantined" for r in alone) == (corpus == "poisoned_corpus")


def test_a_batch_runs_ge_once_and_alone_only_for_odd_schemas(poisoned_corpus, stdlib_contract, monkeypatch) -> None:
    stacks, alone = [], []
    real_stack, real_alone = validate._validate_stack, validate._validate_alone
    monkeypatch.setattr(validate, "_validate_stack", lambda group, *a: stacks.append(len(group)) or real_stack(group, *a))
    monkeypatch.setattr(validate, "_validate_alone", lambda loaded, *a: alone.append(loaded.path) or real_alone(loaded, *a))
    paths = validation.train_shards(poisoned_corpus["out"])
    validation.validate_shards(paths, stdlib_contract, load_eval_doc_hashes(poisoned_corpus["out"]))
    odd = sorted(shard_of(poisoned_corpus, k) for k in ("missing_column", "wrong_type"))
    unreadable = sum(POISON_KINDS[k].rule == READABLE_RULE for k in POISON_KINDS)
    assert sorted(alone) == odd  # every other readable shard went through the one stacked run
    assert stacks == [len(paths) - unreadable - len(odd)]


def test_the_shipped_contract_runs_entirely_in_the_stacked_run(stdlib_contract) -> None:
    classes = {e["type"]: stacking._batch_class(e) for e in stdlib_contract.expectations}
    assert "alone" not in classes.values(), classes


def test_ids_repeated_across_shards_of_one_batch_are_not_an_in_shard_duplicate(clean_corpus, stdlib_contract,
                                                                               tmp_path: Path) -> None:
    table = pq.read_table(clean_corpus["train"][0])
    copy = write_file(tmp_path / "copy.parquet", parquet_bytes(table))
    ids = table.column("doc_id").to_pylist()
    dup = write_file(tmp_path / "dup.parquet", parquet_bytes(table.set_column(0, "doc_id", pa.array([ids[1], *ids[1:]]))))
    paths = [clean_corpus["train"][0], copy, dup]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert reports == validated_one_by_one(paths, stdlib_contract, frozenset())
    assert [r.verdict for r in reports] == ["healthy", "healthy", "quarantined"]
    (reason,) = reports[2].reasons
    assert (reason["expectation"], reason["unexpected_count"]) == ("expect_column_values_to_be_unique", 2)


def _variant(contract, **changes: Any):
    """``contract`` with expectations' kwargs changed: {expectation index: {kwarg: value}}."""
    suite = json.loads(json.dumps(contract.suite))
    for index, kwargs in changes.items():
        suite["expectations"][int(index.lstrip("e"))]["kwargs"].update(kwargs)
    return dataclasses.replace(contract, suite=suite)


def test_batched_equals_alone_for_every_evaluation_class(clean_corpus, poisoned_corpus, stdlib_contract, tmp_path: Path) -> None:
    """Schema rules failing in a stack, per-shard row-count bounds (strict too), ``mostly`` (alone)."""
    clean = [Path(p) for p in clean_corpus["train"][:4]]
    rows = [pq.read_metadata(p).num_rows for p in clean]
    extra = pq.read_table(clean[0])
    extra = write_file(tmp_path / "extra-column.parquet",
                       parquet_bytes(extra.append_column("lang", pa.array(["py"] * extra.num_rows))))
    paths = [*clean, extra, *(shard_of(poisoned_corpus, k) for k in ("null_ids", "tiny_doc", "zero_rows", "truncated"))]
    hashes = load_eval_doc_hashes(poisoned_corpus["out"])

    def at(kind: str, column: str | None = None) -> str:
        return next(f"e{i}" for i, x in enumerate(stdlib_contract.expectations)
                    if (x["type"], x["kwargs"].get("column")) == (kind, column))

    count = at("expect_table_row_count_to_be_between")
    variants = [
        _variant(stdlib_contract, **{at("expect_table_columns_to_match_set"): {"exact_match": True}}),
        _variant(stdlib_contract, **{count: {"min_value": min(rows), "strict_min": True, "max_value": sorted(rows)[-2]}}),
        _variant(stdlib_contract, **{count: {"max_value": max(rows), "strict_max": True}}),
        _variant(stdlib_contract, **{at("expect_column_values_to_not_be_null", "doc_id"): {"mostly": 0.5}}),
    ]
    unchanged = validation.validate_shards(paths, stdlib_contract, hashes)
    for contract in variants:
        batched = validation.validate_shards(paths, contract, hashes)
        assert batched == validated_one_by_one(paths, contract, hashes), contract.suite["expectations"]
        assert [r.reasons for r in batched] != [r.reasons for r in unchanged]  # the variant does change verdicts


def test_stacked_run_checks_literal_hits_with_ge_and_matches_alone(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    """A literal without a match stays healthy; a real match is found, sampled and redacted."""
    table = pq.read_table(clean_corpus["train"][0])
    texts = table.column("text").to_pylist()
    near = write_file(tmp_path / "near.parquet",
                      parquet_bytes(table.set_column(1, "text", pa.array([texts[0] + " AKIA is a prefix", *texts[1:]]))))
    key = "AKIA" + "QWERTYUIOPASDFGH"
    hit = write_file(tmp_path / "hit.parquet",
                     parquet_bytes(table.set_column(1, "text", pa.array([*texts[:-1], texts[-1] + f" {key} "]))))
    paths = [clean_corpus["train"][1], near, hit]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert reports == validated_one_by_one(paths, stdlib_contract, frozenset())
    assert [r.verdict for r in reports] == ["healthy", "healthy", "quarantined"]
    (reason,) = reports[2].reasons
    assert (reason["expectation"], reason["column"], reason["unexpected_count"]) == (
        "expect_column_values_to_not_match_regex_list", "text", 1
    )
    assert key not in json.dumps(reason) and REDACTED in reason["sample"][0]


def test_eval_lengths_only_narrow_which_rows_are_hashed(poisoned_corpus, stdlib_contract) -> None:
    hashes = load_eval_doc_hashes(poisoned_corpus["out"])
    assert isinstance(hashes, validation.EvalDocHashes) and hashes.byte_lengths
    paths = [shard_of(poisoned_corpus, "eval_contamination"), shard_of(poisoned_corpus, "secret")]
    narrowed = validation.validate_shards(paths, stdlib_contract, hashes)
    assert narrowed == validation.validate_shards(paths, stdlib_contract, frozenset(hashes))
    assert [r.reasons[0]["column"] for r in narrowed] == ["kiln_text_in_eval_split", "text"]

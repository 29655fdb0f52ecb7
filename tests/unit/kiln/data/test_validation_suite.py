"""``kiln.data.validation.suite``: one GE context per process, a suite GE cannot parse, the contract untouched."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kiln.data import validation
from kiln.data.validation import validate_shard
from kiln.data.validation.suite import _great_expectations
from kiln.errors import ContractError


def test_one_ge_context_per_process(clean_corpus, stdlib_contract) -> None:
    first = _great_expectations()
    validate_shard(clean_corpus["train"][0], stdlib_contract)
    validate_shard(clean_corpus["train"][1], "stdlib-py@1")
    assert _great_expectations() is first
    context = first.batch_definition.data_asset.datasource.data_context
    assert [ds.name for ds in context.data_sources.all().values()] == ["kiln_shards"]


def test_a_broken_contract_is_a_fault_not_a_quarantine(clean_corpus, stdlib_contract) -> None:
    suite = json.loads(json.dumps(stdlib_contract.suite))
    suite["expectations"][8]["kwargs"]["no_such_kwarg"] = 1
    broken = dataclasses.replace(stdlib_contract, suite=suite)
    with pytest.raises(ContractError, match="not a valid GE suite"):
        validate_shard(clean_corpus["train"][0], broken)


def test_validation_leaves_the_contract_untouched(clean_corpus) -> None:
    from kiln.data.contracts import load_contract

    contract = load_contract("stdlib-py@1")
    before = json.loads(json.dumps(contract.suite)), contract.sha256
    validation.validate_shards(clean_corpus["train"][:2], contract)
    validate_shard(clean_corpus["train"][0], contract)
    assert (contract.suite, contract.sha256) == before
    assert contract.suite == json.loads(contract.path.read_text())

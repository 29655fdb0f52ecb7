"""``kiln.data.contracts``: loading versioned GE suites, and the stdlib-py@1 suite itself."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kiln.data.contracts import CONTRACTS_DIR, Contract, load_contract, parse_contract_ref
from kiln.errors import ContractError

V1 = CONTRACTS_DIR / "stdlib-py" / "v1.json"


@pytest.fixture
def contracts_root(tmp_path: Path) -> Path:
    """A private copy of data_contracts/ the test may break."""
    shutil.copytree(CONTRACTS_DIR, tmp_path / "contracts")
    return tmp_path / "contracts"


def _suite() -> dict[str, Any]:
    return json.loads(V1.read_text())


def _write(root: Path, name: str, version: int, suite: Any) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    text = suite if isinstance(suite, str) else json.dumps(suite)
    (root / name / f"v{version}.json").write_text(text)


@pytest.mark.parametrize("spec", ["stdlib-py@1", "stdlib-py@v1", "stdlib-py", " stdlib-py@1 "])
def test_load_by_name_and_version(spec: str) -> None:
    contract = load_contract(spec)
    assert isinstance(contract, Contract)
    assert (contract.name, contract.version, contract.ref) == ("stdlib-py", 1, "stdlib-py@1")
    assert contract.path == V1
    assert contract.suite == _suite()
    assert contract.settings["version"] == 1
    assert set(contract.derived_columns) == {"kiln_text_bad_char_share", "kiln_text_in_eval_split"}
    assert re.fullmatch(r"[0-9a-f]{64}", contract.sha256)


def test_no_version_means_the_latest(contracts_root: Path) -> None:
    suite = _suite()
    suite["meta"]["kiln"]["version"] = 2
    _write(contracts_root, "stdlib-py", 2, suite)
    assert load_contract("stdlib-py", contracts_root).version == 2
    assert load_contract("stdlib-py@1", contracts_root).version == 1


def test_env_var_points_at_another_contracts_dir(contracts_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(contracts_root / "stdlib-py", contracts_root / "other-corpus")
    suite = _suite()
    suite["name"] = "other-corpus"
    _write(contracts_root, "other-corpus", 1, suite)
    monkeypatch.setenv("KILN_CONTRACTS_DIR", str(contracts_root))
    assert load_contract("other-corpus").path == contracts_root / "other-corpus" / "v1.json"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-corpus@1", r"unknown contract 'no-such-corpus'.*known: .*stdlib-py"),
        ("stdlib-py@7", r"no version 7 \(known: 1\)"),
        ("stdlib-py@x", "bad contract version"),
        ("stdlib-py@0", "bad contract version"),
        ("Stdlib/../x", "bad contract name"),
        ("", "bad contract name"),
    ],
)
def test_unknown_or_bad_refs_are_contract_errors(spec: str, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        load_contract(spec)


def test_parse_contract_ref() -> None:
    assert parse_contract_ref("stdlib-py@3") == ("stdlib-py", 3)
    assert parse_contract_ref("stdlib-py") == ("stdlib-py", None)


def _broken(mutate) -> Any:
    suite = _suite()
    mutate(suite)
    return suite


@pytest.mark.parametrize(
    "suite, message",
    [
        ('{"name": "stdlib-py", "expectations": [', "not valid JSON"),
        ("[1, 2]", "top level must be a JSON object"),
        (_broken(lambda s: s.update(name="other")), "does not match the contract name"),
        (_broken(lambda s: s.update(expectations=[])), "non-empty list"),
        (_broken(lambda s: s["expectations"].append({"type": "drop_table", "kwargs": {}})), "starting with 'expect_'"),
        (_broken(lambda s: s["expectations"][0].pop("kwargs")), "needs a 'kwargs' object"),
        (_broken(lambda s: s["meta"].pop("kiln")), "meta.kiln"),
        (_broken(lambda s: s["meta"]["kiln"].update(version=3)), "does not match the file version"),
        (_broken(lambda s: s["meta"]["kiln"]["derived_columns"].update(x="text")), "kind must be one of"),
        (_broken(lambda s: s["meta"]["kiln"]["derived_columns"].update(x={"kind": "magic", "column": "text"})),
         "kind must be one of"),
        (_broken(lambda s: s["meta"]["kiln"]["derived_columns"]["kiln_text_bad_char_share"].update(pattern="[")),
         r"derived_columns\.kiln_text_bad_char_share\.pattern does not compile"),
        (_broken(lambda s: s["meta"]["kiln"]["snapshot_rules"].append({"rule": "vibes"})), "snapshot rule"),
        (_broken(lambda s: s["expectations"][11]["kwargs"]["regex_list"].append("(")), "does not compile"),
    ],
)
def test_malformed_contract_is_a_contract_error(contracts_root: Path, suite: Any, message: str) -> None:
    _write(contracts_root, "stdlib-py", 1, suite)
    with pytest.raises(ContractError, match=message):
        load_contract("stdlib-py@1", contracts_root)


@pytest.mark.parametrize("hostile", ["deep", "digits", "dev-zero", "fifo", "huge"])
def test_a_hostile_contract_file_is_named_by_load_and_check(contracts_root: Path, hostile: str, capsys) -> None:
    import os

    from kiln.cli import main
    from kiln.data.contracts import MAX_CONTRACT_BYTES

    path = contracts_root / "stdlib-py" / "v1.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    make = {"deep": lambda: path.write_text('{"name": ' + "[" * 300_000),
            "digits": lambda: path.write_text('{"name": ' + "7" * 5000 + "}"),
            "dev-zero": lambda: path.symlink_to("/dev/zero"),
            "fifo": lambda: os.mkfifo(path),
            "huge": lambda: path.write_bytes(b" " * (MAX_CONTRACT_BYTES + 1))}
    make[hostile]()
    expected = {"deep": "not valid JSON: nested deeper than 64 levels", "digits": "a number has more than 100 digits",
                "dev-zero": "character device, not a regular file", "fifo": "FIFO, not a regular file",
                "huge": f"over the {MAX_CONTRACT_BYTES:,}-byte limit"}[hostile]
    with pytest.raises(ContractError, match=expected):
        load_contract("stdlib-py@1", contracts_root)
    assert main(["contract", "check", str(path)]) == 1  # check's status for a file with problems
    err = capsys.readouterr().err
    assert expected.split(",")[0] in err and "Traceback" not in err and str(path) in err


def test_contract_errors_are_not_retried() -> None:
    assert ContractError.retryable is False


def test_v1_is_a_valid_great_expectations_suite() -> None:
    import great_expectations as gx

    suite = _suite()
    built = gx.ExpectationSuite(
        name=suite["name"], expectations=suite["expectations"], meta=suite["meta"], notes=suite["notes"]
    ).to_json_dict()
    assert [(e["type"], e["kwargs"]) for e in built["expectations"]] == [(e["type"], e["kwargs"]) for e in suite["expectations"]]


def test_v1_covers_every_rule_of_the_data_contract_issue() -> None:
    contract = load_contract("stdlib-py@1")
    by_type: dict[str, list[dict[str, Any]]] = {}
    for e in contract.expectations:
        by_type.setdefault(e["type"], []).append(e["kwargs"])
    assert by_type["expect_table_columns_to_match_set"][0]["column_set"] == ["doc_id", "text", "source"]
    assert {k["column"] for k in by_type["expect_column_values_to_be_of_type"]} == {"doc_id", "text", "source"}
    assert {k["column"] for k in by_type["expect_column_values_to_not_be_null"]} >= {"doc_id", "text"}
    assert by_type["expect_column_values_to_be_unique"] == [{"column": "doc_id"}]
    assert by_type["expect_table_row_count_to_be_between"][0]["min_value"] >= 1
    lengths = by_type["expect_column_value_lengths_to_be_between"][0]
    assert lengths["column"] == "text" and lengths["min_value"] > 0 and lengths["max_value"] > 4096
    assert by_type["expect_column_values_to_be_between"][0]["column"] == "kiln_text_bad_char_share"
    assert by_type["expect_column_values_to_be_in_set"][0] == {"column": "kiln_text_in_eval_split", "value_set": [False]}
    assert [r["rule"] for r in contract.snapshot_rules] == ["doc_id_unique_across_shards"]
    for e in contract.expectations:
        assert e["meta"]["kiln_rule"] and e["description"], e["type"]


@pytest.mark.parametrize(
    "text, secret",
    [
        ("x = '''-----BEGIN RSA " + "PRIVATE KEY-----\nMIIE...'''", True),
        ("-----BEGIN " + "PRIVATE KEY-----", True),
        ("-----BEGIN OPENSSH " + "PRIVATE KEY-----", True),
        ("key = 'AKIA" + "Q" * 16 + "'", True),
        ("token = 'ghp" + "_" + "a1" * 18 + "'", True),
        ("token = 'xoxb" + "-123456789012-abc'", True),
        ("PEM_HEADER = '-----BEGIN CERTIFICATE-----'", False),
        ("# AKIA is a prefix of AWS keys", False),
        ("def ghp_helper(): pass", False),
    ],
)
def test_secret_patterns(text: str, secret: bool) -> None:
    patterns = load_contract("stdlib-py@1").secret_patterns
    assert any(re.search(p, text) for p in patterns) is secret


def test_readme_explains_every_rule() -> None:
    contract = load_contract("stdlib-py@1")
    readme = (CONTRACTS_DIR / "stdlib-py" / "README.md").read_text()
    for e in contract.expectations:
        assert e["type"] in readme and e["meta"]["kiln_rule"] in readme
    for name in contract.derived_columns:
        assert name in readme
    for rule in contract.snapshot_rules:
        assert rule["rule"] in readme
    assert "readable_parquet" in readme

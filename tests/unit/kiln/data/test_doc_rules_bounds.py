"""Every rule runs in bounded time and memory: RE2 for every pattern, bounded parameters, a per-document budget."""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kiln.cli import main
from kiln.data.contracts import CONTRACTS_DIR, contract_problems, load_contract
from kiln.data.doc_rules import DOCUMENT_BUDGET_RULE, MAX_DOCUMENT_CHARS, build_rule_set

WEB_TEXT = CONTRACTS_DIR / "web-text" / "v1.json"


def _suite() -> dict[str, Any]:
    return json.loads(WEB_TEXT.read_text())


def _check(tmp_path: Path, suite: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> list[str]:
    path = tmp_path / "web-text" / "v1.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(suite))
    main(["contract", "check", str(path)])
    return list(json.loads(capsys.readouterr().out)["problems"])


def test_the_pii_email_rule_is_linear_in_the_document() -> None:
    # datatrove's e-mail pattern under Python's re took > 60 s on this 96,000-character document.
    rules = build_rule_set([{"rule": "pii", "kind": "kiln.pii", "params": {"emails": True, "public_ips": True}}])
    hostile = "a." * 48_000 + "@"  # every "a" starts a match attempt that scans to the end
    start = time.monotonic()
    rules.judge(pa.array([hostile, "write to someone@example.org today", "no address here"]))
    assert time.monotonic() - start < 5
    dropped = rules.judge(pa.array(["write to someone@example.org today", "nothing", "host 8.8.8.8 and 10.0.0.1"]))
    assert [(d.row, d.detail) for d in dropped] == [(0, "email"), (2, "public_ip")]


def test_a_catastrophic_phone_pattern_runs_on_re2() -> None:
    # (\d+)+x backtracks exponentially in Python's re on a line of digits without an x.
    rules = build_rule_set([{"rule": "pii", "kind": "kiln.pii",
                             "params": {"emails": False, "public_ips": False, "phone_pattern": r"(\d+)+x"}}])
    start = time.monotonic()
    dropped = rules.judge(pa.array(["1" * 33 + "!", "12x"]))
    assert time.monotonic() - start < 5
    assert [d.row for d in dropped] == [1]


def test_a_hostile_million_character_document_is_judged_within_a_bound() -> None:
    rules = build_rule_set(load_contract("web-text@1").document_rules)
    # Quadratic for datatrove's e-mail pattern under Python's re (hours); and a text the other rules must read whole.
    hostile = "a." * (MAX_DOCUMENT_CHARS // 2 - 1) + "@"
    words = " ".join(["the", "cat", "sat", "on", "a", "mat."] * (MAX_DOCUMENT_CHARS // 20))[:MAX_DOCUMENT_CHARS]
    start = time.monotonic()
    dropped = rules.judge(pa.array([hostile, words]))
    assert time.monotonic() - start < 10
    assert [d.row for d in dropped if d.rule == DOCUMENT_BUDGET_RULE] == []


def test_a_document_over_the_budget_is_dropped_with_a_named_reason_before_any_rule() -> None:
    rules = build_rule_set(load_contract("web-text@1").document_rules)
    dropped = rules.judge(pa.array(["x" * (MAX_DOCUMENT_CHARS + 1), None]))
    assert [(d.row, d.rule, d.detail) for d in dropped] == [(0, DOCUMENT_BUDGET_RULE, f"over_{MAX_DOCUMENT_CHARS}_chars")]


def test_the_budget_rule_id_is_reserved() -> None:
    suite = _suite()
    suite["meta"]["kiln"]["document_rules"][0]["rule"] = DOCUMENT_BUDGET_RULE
    assert any("is reserved" in p for p in contract_problems(suite))


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["meta"]["kiln"]["near_duplicates"].update(num_perm=2**40), r"near_duplicates\.num_perm .*\[2, 1024\]"),
        (lambda s: s["meta"]["kiln"]["near_duplicates"].update(shingle_words=10**6), r"near_duplicates\.shingle_words"),
        (lambda s: s["meta"]["kiln"]["near_duplicates"].update(seed=2**40), r"near_duplicates\.seed"),
        (lambda s: s["meta"]["kiln"]["document_rules"][1]["params"].update(min_letters=10**12), r"params\.min_letters"),
        (lambda s: s["meta"]["kiln"]["document_rules"][2]["params"].update(dup_n_grams=[[10**6, 0.1]]),
         r"document_rules\[2\]\.params\.dup_n_grams"),
        (lambda s: s["meta"]["kiln"]["document_rules"][3]["params"].update(max_doc_words=1e300),
         r"document_rules\[3\]\.params\.max_doc_words"),
        (lambda s: s["meta"]["kiln"]["document_rules"][0]["params"].update(phone_pattern=r"(\d+)\1"),
         r"document_rules\[0\]\.params\.phone_pattern cannot run on a linear-time engine \(RE2\)"),
        (lambda s: s["expectations"].append({"type": "expect_column_values_to_match_regex",
                                             "kwargs": {"column": "text", "regex": r"(?=a)b"}}),
         r"expectations\[\d+\]\.kwargs\.regex cannot run on a linear-time engine"),
        (lambda s: s["expectations"][11]["kwargs"]["regex_list"].append(r"(a)\1"),
         r"expectations\[11\]\.kwargs\.regex_list\[8\] cannot run"),
        (lambda s: s["meta"]["kiln"]["derived_columns"]["kiln_text_bad_char_share"].update(pattern=r"(?<=a)b"),
         r"derived_columns\.kiln_text_bad_char_share\.pattern cannot run"),
        (lambda s: s["meta"]["kiln"]["derived_columns"]["kiln_text_bad_char_share"].update(column="body"),
         r"derived_columns\.kiln_text_bad_char_share\.column 'body' is not a column the contract requires"),
        (lambda s: s["expectations"].append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "body"}}),
         r"checks column 'body', which the contract neither requires nor derives"),
    ],
)
def test_contract_check_refuses_what_would_stall_or_silently_weaken_validation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate, field: str) -> None:
    suite = copy.deepcopy(_suite())
    mutate(suite)
    problems = _check(tmp_path, suite, capsys)
    assert any(re.search(field, p) for p in problems), problems


def test_the_shipped_contracts_pass_the_bounds() -> None:
    for path in sorted(CONTRACTS_DIR.glob("*/v*.json")):
        assert contract_problems(json.loads(path.read_text())) == [], path


def test_a_catastrophic_ge_regex_validates_a_shard_within_a_bound(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from kiln.data.validation import validate_shard

    suite = json.loads((CONTRACTS_DIR / "stdlib-py" / "v1.json").read_text())
    # (\w+\s?)+$ is exponential in Python's re on non-ASCII text that does not end in a word character.
    suite["expectations"].append({"type": "expect_column_values_to_not_match_regex",
                                  "kwargs": {"column": "text", "regex": r"^(\w+\s?)+$"}})
    root = tmp_path / "contracts" / "stdlib-py"
    root.mkdir(parents=True)
    (root / "v1.json").write_text(json.dumps(suite))
    assert contract_problems(suite) == []
    contract = load_contract("stdlib-py@1", tmp_path / "contracts")
    shard = tmp_path / "train" / "part-0.parquet"
    shard.parent.mkdir()
    hostile = "é" + "a" * 32 + "!"
    pq.write_table(pa.table({"doc_id": ["d0", "d1"], "text": [hostile, "déjà vu"], "source": ["s", "s"]}), shard)
    start = time.monotonic()
    report = validate_shard(shard, contract)
    assert time.monotonic() - start < 30
    assert report.verdict == "quarantined"
    assert any(r["expectation"] == "expect_column_values_to_not_match_regex" and r.get("unexpected_count") == 1
               for r in report.reasons), report.reasons

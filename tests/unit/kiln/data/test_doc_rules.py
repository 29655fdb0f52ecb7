"""``kiln.data.doc_rules``: the document rules (datatrove's filters, PII, script) and their checks."""

from __future__ import annotations

import copy
import inspect
import re

import pyarrow as pa
import pytest

from kiln.data.contracts import contract_problems, load_contract
from kiln.data.doc_rules import (
    DATATROVE_FILTERS,
    build_rule_set,
    check_document_rules,
    datatrove_parameters,
)
from kiln.errors import ContractError

PROSE = (
    "The committee met on a cold morning to discuss the budget of the town library. After a long debate, the members "
    "agreed that the reading room should stay open in the evenings. They also decided to buy new books for the "
    "children's section. The librarian thanked everyone for their support and promised to report back next month. "
    "Several residents had written letters asking for longer opening hours, and the committee read them aloud. "
    "Nobody objected to the plan, so it was adopted with a clear majority and the meeting ended before noon."
)


@pytest.fixture(scope="module")
def rules():
    return build_rule_set(load_contract("web-text@1").document_rules)


def _judge(rules, texts):
    return {d.row: (d.rule, d.detail) for d in rules.judge(pa.array(texts, pa.string()))}


def test_each_rule_drops_its_document_and_the_first_failing_rule_names_it(rules) -> None:
    texts = [
        PROSE,
        PROSE + "\nWrite to jane.doe@example-mail.com for the minutes.",
        PROSE + "\nOr call +1 415 555 0134 after six.",
        PROSE + "\nThe archive lives at 8.8.4.4 now.",
        PROSE + "\nThe test server is 192.168.1.20 (private: not PII).",
        "".join({"a": "а", "e": "е", "o": "о", "p": "р", "c": "с"}.get(c, c) for c in PROSE.replace("t", "т").replace("n", "н")),
        PROSE + "\n" + "Subscribe to our newsletter today.\n" * 10,
        " ".join(["cheap watches discount luxury brand free shipping"] * 12).replace("watches", "watch"),
        "Too short to be a page.",
        None,
        PROSE.replace(".", "") + " {curly}",
    ]
    judged = _judge(rules, texts)
    assert 0 not in judged and 4 not in judged and 9 not in judged  # clean prose, a private IP, a null (not_null's)
    assert judged[1] == ("pii", "email") and judged[2] == ("pii", "phone") and judged[3] == ("pii", "public_ip")
    assert judged[5] == ("script", "other_script")
    assert judged[6][0] == "gopher_repetition"
    assert judged[7][0] in ("gopher_repetition", "gopher_quality")
    # datatrove's top-n-gram rule counts even a single occurrence: in a 5-word text the top 2-gram is 40 % of it.
    assert judged[8] == ("gopher_repetition", "top_2_gram")
    assert judged[10][0] == "c4_quality"


def test_a_document_a_rule_cannot_judge_is_dropped_with_the_error_named(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = build_rule_set([{"rule": "rep", "kind": "datatrove.GopherRepetitionFilter", "params": {}}])
    real = rules.rules[0].filter.filter

    def fragile(doc):  # datatrove raising on some input (older releases divided by an empty text's length)
        if doc.text.startswith("boom"):
            raise ZeroDivisionError("division by zero")
        return real(doc)

    monkeypatch.setattr(rules.rules[0].filter, "filter", fragile)
    assert _judge(rules, ["boom " + PROSE, PROSE]) == {0: ("rep", "rule_error: ZeroDivisionError")}


def test_contract_parameters_are_datatrove_constructor_parameters() -> None:
    contract = load_contract("web-text@1")
    for rule in contract.document_rules:
        if rule["kind"] in DATATROVE_FILTERS:
            allowed = datatrove_parameters(rule["kind"])
            assert set(rule["params"]) <= set(allowed), rule["rule"]
            assert "exclusion_writer" not in allowed and "language" not in allowed
    module, name = DATATROVE_FILTERS["datatrove.GopherQualityFilter"]
    import importlib

    signature = inspect.signature(getattr(importlib.import_module(module), name).__init__)
    assert datatrove_parameters("datatrove.GopherQualityFilter")["min_doc_words"] == signature.parameters["min_doc_words"].default


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r[3]["params"].update(min_doc_wordz=5), r"document_rules\[3\]\.params\.min_doc_wordz is not a parameter"),
        (lambda r: r[3]["params"].update(min_doc_words="fifty"), r"document_rules\[3\]\.params\.min_doc_words must be a number"),
        (lambda r: r[4]["params"].update(filter_javascript=1), r"\[4\]\.params\.filter_javascript must be true or false"),
        (lambda r: r[2]["params"].update(top_n_grams=0.2), r"document_rules\[2\]\.params\.top_n_grams must be a list"),
        (lambda r: r[0]["params"].update(phone_pattern="("), r"document_rules\[0\]\.params\.phone_pattern does not compile"),
        (lambda r: r[1]["params"].update(max_other_letter_share=2), r"document_rules\[1\]\.params\.max_other_letter_share"),
        (lambda r: r[1]["params"].update(scripts=[]), r"document_rules\[1\]\.params\.scripts"),
        (lambda r: r[5].update(kind="datatrove.LanguageFilter"), r"document_rules\[5\]\.kind must be one of"),
        (lambda r: r[5].update(rule="pii"), r"document_rules\[5\]\.rule 'pii' is used twice"),
        (lambda r: r[5].update(extra=1), r"document_rules\[5\] has unknown key"),
    ],
)
def test_every_bad_rule_field_is_named(mutate, field: str) -> None:
    rules = copy.deepcopy(load_contract("web-text@1").document_rules)
    mutate(rules)
    problems = check_document_rules(rules, deep=True)
    assert any(re.search(field, p) for p in problems), problems
    with pytest.raises(ContractError, match=field):
        build_rule_set(rules)


def test_contract_problems_lists_every_bad_field_at_once() -> None:
    suite = copy.deepcopy(load_contract("web-text@1").suite)
    suite["meta"]["kiln"]["max_dropped_share"] = 1.5
    suite["meta"]["kiln"]["near_duplicates"]["threshold"] = 0
    suite["meta"]["kiln"]["document_rules"][0]["kind"] = "nope"
    problems = contract_problems(suite, name="web-text", version=1)
    assert len(problems) == 3
    assert any("max_dropped_share" in p for p in problems) and any("near_duplicates.threshold" in p for p in problems)
    del suite["meta"]["kiln"]["max_dropped_share"]
    assert any("max_dropped_share is missing" in p for p in contract_problems(suite))

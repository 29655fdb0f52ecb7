"""Hard-wrapped prose: ``kiln.data.layout`` (unwrapping, the hint) and the ``prose-wrapped`` contract,
on the Python reference's own topics (``pydoc_data``, hard-wrapped, on every CPython)."""

from __future__ import annotations

import textwrap
from collections import Counter

import pyarrow as pa
import pytest

from kiln.data.contracts import load_contract
from kiln.data.doc_rules import build_rule_set, check_document_rules
from kiln.data.layout import hard_wrapped, layout_hint, unwrap
from kiln.data.poison_text import poison_documents
from kiln.data.prose import pydoc_topics
from kiln.data.validation.report import quarantine_report, render_quarantine_html
from kiln.refs import ShardReport

PARAGRAPH = ("The committee met on a cold morning to discuss the budget of the town library. After a long debate, the "
             "members agreed that the reading room should stay open in the evenings. They also decided to buy new books "
             "for the children's section, and the librarian promised to report back next month.")


def test_unwrap_joins_the_lines_a_wrapper_broke_and_keeps_every_other_break() -> None:
    wrapped = textwrap.fill(PARAGRAPH, 72)
    text = (f"A heading\n\n{wrapped}\n\n- a list item\n- another item\n\n    code = 1\n    more = 2\n\n"
            + textwrap.fill(PARAGRAPH, 72, initial_indent="* ", subsequent_indent="  ") + "\n")
    out = unwrap(text)
    assert out.split() == text.split(), "only line breaks and indentation change"
    assert f"A heading\n\n{PARAGRAPH}\n\n- a list item\n- another item\n\n    code = 1\n    more = 2\n\n* {PARAGRAPH}\n" == out
    assert hard_wrapped(text) and not hard_wrapped(out)


@pytest.mark.parametrize("text", [
    PARAGRAPH + "\n" + PARAGRAPH + "\n",                      # one paragraph a line (web text)
    "Home\nAbout us\nProducts and services\nContact\nPrivacy policy\nTerms of use\n",  # a menu
    "Roses are red,\nviolets are blue,\nthis short verse\nis not wrapped prose.\n",
])
def test_text_that_is_not_hard_wrapped_comes_back_unchanged(text: str) -> None:
    assert unwrap(text) == text and not hard_wrapped(text)


@pytest.fixture(scope="module")
def topics() -> list[str]:
    """The Python reference's topics, one document each, as they ship: hard-wrapped at ~70 columns."""
    return [text for _, text in pydoc_topics()]


@pytest.fixture(scope="module")
def judged(topics: list[str]) -> dict[str, list]:
    texts = pa.array(topics, pa.string())
    return {ref: build_rule_set(load_contract(ref).document_rules).judge(texts) for ref in ("web-text@1", "prose-wrapped@1")}


def test_web_text_drops_most_of_the_reference_for_its_layout_and_prose_wrapped_does_not(topics, judged) -> None:
    assert sum(hard_wrapped(t) for t in topics) > 0.8 * len(topics)
    web, prose = judged["web-text@1"], judged["prose-wrapped@1"]
    flagged = sum(d.hard_wrapped_layout for d in web)
    # Measured on 3.11's 79 topics: web-text@1 drops 52, 27 of them flagged; prose-wrapped@1 drops 36, none flagged.
    assert len(web) > 0.55 * len(topics) and flagged > len(web) / 3
    assert len(prose) < len(web) - 0.15 * len(topics)
    assert not any(d.hard_wrapped_layout for d in prose)
    layout = Counter(d.detail for d in prose)
    assert layout["line_punct_ratio"] + layout["short_line_ratio"] <= 2
    # What it still drops is content: a short topic under C4's five sentences, code braces, duplicated lines.
    assert all(len(topics[d.row]) < 1500 for d in prose if d.detail == "too_few_sentences")


@pytest.mark.parametrize("kind, rule", [("boilerplate", "gopher_repetition"), ("spam", "gopher_quality"),
                                        ("other_script", "script"), ("pii", "pii")])
def test_prose_wrapped_still_drops_junk_that_arrives_hard_wrapped(topics, judged, kind: str, rule: str) -> None:
    kept = sorted(set(range(len(topics))) - {d.row for d in judged["prose-wrapped@1"]})[:12]
    docs = [(f"d{i}", topics[i], "pydoc") for i in kept]
    poisoned = poison_documents(kind, docs)
    texts = ["\n".join(textwrap.fill(line, 72) for line in text.split("\n")) for _, text, _ in poisoned]
    changed = [i for i, (_, text, _) in enumerate(poisoned) if text != docs[i][1]]
    found = {d.row: d.rule for d in build_rule_set(load_contract("prose-wrapped@1").document_rules).judge(pa.array(texts))}
    assert changed and all(i in found for i in changed), (kind, found)
    assert Counter(found[i] for i in changed).most_common(1)[0][0] == rule, (kind, found)


def _report(path: str, dropped: dict | None, contract: str = "web-text@1") -> ShardReport:
    return ShardReport(path=path, sha256="0" * 64, verdict="healthy", contract=contract, rows=10, reasons=[],
                       dropped=dropped)


def test_the_quarantine_report_hints_at_prose_wrapped_when_wrapped_text_is_dropped_for_its_layout() -> None:
    rules = {"c4_quality": {"count": 4, "details": {"too_few_sentences": 4}, "sample": []}}
    wrapped = _report("/c/train/shard-00000.parquet", {"rows": [0, 1, 2, 3], "share": 0.4, "rules": rules,
                                                     "hard_wrapped_layout": 2})
    body = quarantine_report([wrapped])
    assert "--contract prose-wrapped@1" in body["hint"] and body["dropped"]["all_shards"]["hard_wrapped_layout"] == 2
    assert "<b>Hint:</b> 2 of the 4 dropped documents (50%) are hard-wrapped" in render_quarantine_html([wrapped])
    few = _report("/c/train/shard-00000.parquet", {"rows": [0, 1, 2, 3], "share": 0.4, "rules": rules,
                                                 "hard_wrapped_layout": 1})
    assert "hint" not in quarantine_report([few])
    plain = _report("/c/train/shard-00000.parquet", {"rows": [0, 1, 2, 3], "share": 0.4, "rules": rules})
    body = quarantine_report([plain])
    assert "hint" not in body and "hard_wrapped_layout" not in body["dropped"]["all_shards"]
    assert layout_hint({"documents": 4, "hard_wrapped_layout": 4}, ["prose-wrapped@1"]) is None


def test_lines_and_words_are_checked_and_apply_to_datatrove_rules_only() -> None:
    rules = [{"rule": "c4", "kind": "datatrove.C4QualityFilter", "lines": "paragraphs", "words": "spacy"},
             {"rule": "pii", "kind": "kiln.pii", "params": {}, "lines": "unwrapped"}]
    problems = check_document_rules(rules)
    assert any("[0].lines must be one of ['stored', 'unwrapped']" in p for p in problems)
    assert any("[0].words must be one of ['whitespace', 'datatrove']" in p for p in problems)
    assert any("[1].lines applies to datatrove kinds only" in p for p in problems)

"""``DocumentRuleSet.judge`` runs a contract's datatrove rules document by document (each text
converted once, datatrove's word cache hit by every rule) and skips PII patterns on documents that
cannot match: it drops exactly what the rules applied one after the other drop, with the same rule
and reason, on every document of a real corpus (the prose fixture and each poison kind of
``kiln.data.poison_text``) and on edge cases."""

from __future__ import annotations

import pytest
from datatrove.data import Document

from kiln.data.contracts import load_contract
from kiln.data.doc_rules import _DatatroveRule
from kiln.data.poison_text import TEXT_POISON_KINDS

from webtext_fixtures import poisoned, prose_documents

EDGE_CASES = [
    "", " ", "\n", "\n\n\n", "a", "é", "word", "{", "lorem ipsum dolor sit amet.",
    "ÉCOLE café naïve “quoted” — dash … and more… done.", "1 2 3 4 5 6 7 8 9 10 11 12.",
    "x " * 40, "ab c abc a bc ab c abc a bc ab c abc a bc ab c abc.", "{ }\n" * 9, "- item\n" * 12,
    "Wait...\n" * 6, "# # # # heading\n" * 5, "a\u00a0b c\u2003d e.\n" * 8, "ａｂｃ．\n" * 6,
    "Ça va? Oui! Très bien. Merci. Au revoir. À demain.",
    "This is javascript. Use cookies here. Terms of use apply. A B C. D E F. G H I. J K L. M N O.",
    ("The quick brown fox jumps over the lazy dog. " * 3 + "\n") * 4,
    "one two three four five six seven eight nine ten " * 3 + "eleven twelve.",
    "w" * 1200 + " long word line.\nShort one here. Another one here. Third one here. Fourth here. Fifth here.",
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = prose_documents()
    texts = [text for _, text, _ in docs]
    for kind in TEXT_POISON_KINDS:
        texts += [text for _, text, _ in poisoned(kind, docs[:150], donors=docs[150:300])]
    return texts + EDGE_CASES


def _outcome(implementation, text: str):
    """What ``filter`` returns, or the exception it raises (a rule error names its type)."""
    try:
        return implementation.filter(Document(text=text, id="0"))
    except Exception as exc:  # compared, not hidden
        return ("raises", type(exc).__name__)


def test_the_contract_rule_set_drops_what_datatrove_filters_rule_by_rule_drop(corpus: list[str]) -> None:
    """``DocumentRuleSet.judge`` (datatrove's rules document by document, the PII prefilters) against the
    contract's rules applied one after the other, each on every document still kept, with every PII
    pattern run on every document."""
    import pyarrow as pa

    from kiln.data.doc_rules import build_rule_set

    rules = build_rule_set(load_contract("web-text@1").document_rules)
    texts = [*corpus, None]
    want: dict[int, tuple[str, str]] = {}
    for row, text in enumerate(texts):
        if text is None:
            continue
        for rule in rules.rules:
            if isinstance(rule, _DatatroveRule):
                verdict = _outcome(rule.filter, text)
                detail = None if verdict is True else (f"rule_error: {verdict[1]}" if verdict[0] == "raises" else verdict[1])
            elif hasattr(rule, "checks"):  # PII: every pattern on the whole text, no prefilter
                detail = next((name for name, pattern, valid in rule.checks
                               if any(valid is None or valid(m.group(0)) for m in pattern.finditer(text))), None)
            else:
                detail = rule.judge(pa.array([text], pa.string()), [0]).get(0)
            if detail is not None:
                want[row] = (rule.rule, detail)
                break
    got = {d.row: (d.rule, d.detail) for d in rules.judge(pa.array(texts, pa.string()))}
    assert got == want
    assert {rule for rule, _ in want.values()} >= {"pii", "script", "gopher_repetition", "gopher_quality", "c4_quality"}

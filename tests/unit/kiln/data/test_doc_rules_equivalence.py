"""kiln's implementations of datatrove's Gopher repetition, Gopher quality and C4 filters
(``kiln.data.doc_rules._KILN_IMPLEMENTATIONS``) give datatrove's verdict and reason on every document
of a real corpus: the prose fixture, each poison kind of ``kiln.data.poison_text``, and edge cases,
under the web-text@1 contract's parameters, datatrove's defaults and stricter ones that reach the
later checks. datatrove's filter is the reference."""

from __future__ import annotations

import pytest
from datatrove.data import Document
from datatrove.pipeline.filters.gopher_repetition_filter import find_all_duplicate, find_top_duplicate, get_n_grams

from kiln.data.contracts import load_contract
from kiln.data.doc_rules import _KILN_IMPLEMENTATIONS, _DatatroveRule, _RepeatedNGrams
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


def _contract_params(kind: str) -> dict:
    return next(r["params"] for r in load_contract("web-text@1").document_rules if r["kind"] == kind)


VARIANTS = {
    "datatrove.GopherRepetitionFilter": [
        {"dup_line_frac": None, "dup_para_frac": None, "dup_line_char_frac": None, "dup_para_char_frac": None,
         "top_n_grams": [[1, 0.05], [2, 0.02], [3, 0.015], [4, 0.01]],
         "dup_n_grams": [[2, 0.1], [3, 0.05], [5, 0.01], [6, 0.005], [7, 0.003], [10, 0.001]]},
        {"dup_line_frac": None, "dup_para_frac": None, "dup_line_char_frac": None, "dup_para_char_frac": None,
         "top_n_grams": [], "dup_n_grams": [[8, 0.0], [5, 0.0], [1, 0.5]]},
    ],
    "datatrove.GopherQualityFilter": [
        {"min_doc_words": 5, "max_doc_words": 400, "min_avg_word_length": 4.5, "max_avg_word_length": 5.2},
        {"min_doc_words": None, "max_doc_words": None, "min_avg_word_length": None, "max_avg_word_length": None,
         "max_symbol_word_ratio": 0.002, "max_bullet_lines_ratio": 0.05, "max_ellipsis_lines_ratio": 0.05,
         "max_non_alpha_words_ratio": 0.97, "min_stop_words": 6},
    ],
    "datatrove.C4QualityFilter": [
        {"min_num_sentences": 12, "min_words_per_line": 12, "max_word_length": 12},
        {"split_paragraph": False, "min_num_sentences": 8, "remove_citations": False, "filter_no_terminal_punct": False,
         "filter_curly_bracket": False, "filter_lorem_ipsum": False},
        {"min_num_sentences": -1, "filter_javascript": False, "filter_policy": False, "max_word_length": -1},
    ],
}


def _outcome(implementation, text: str):
    """What ``filter`` returns, or the exception it raises (a rule error names its type)."""
    try:
        return implementation.filter(Document(text=text, id="0"))
    except Exception as exc:  # compared, not hidden
        return ("raises", type(exc).__name__)


@pytest.mark.parametrize("kind", sorted(_KILN_IMPLEMENTATIONS))
def test_kiln_implementation_gives_datatrove_verdict_and_reason(kind: str, corpus: list[str]) -> None:
    params_list = [_contract_params(kind), {}, *VARIANTS[kind]]
    reasons: set = set()
    for params in params_list:
        rule = _DatatroveRule("r", kind, params)
        assert type(rule.filter) is _KILN_IMPLEMENTATIONS[kind] and rule.filter.reference is rule.reference
        for i, text in enumerate(corpus):
            want = _outcome(rule.reference, text)
            assert _outcome(rule.filter, text) == want, (kind, params, i, text[:200])
            reasons.add(want if want is True else want[1])
    assert len(reasons) >= 4, reasons  # the parameter sets reach several of the rule's checks


def test_ngram_counts_equal_datatrove_helpers(corpus: list[str]) -> None:
    """The two n-gram computations, per size, on every document (not only up to the first failing check)."""
    from collections import Counter

    for text in corpus:
        words = text.split()
        repeats = _RepeatedNGrams(words)
        for n in (10, 9, 8, 7, 6, 5, 4, 3, 2, 1):
            assert repeats.of(n) == find_all_duplicate(words, n), (n, text[:200])
        for n in (1, 2, 3, 4):
            grams = get_n_grams(words, n)
            if grams:
                top, count = Counter(zip(*(words[k:] for k in range(n)), strict=False)).most_common(1)[0]
                assert (sum(map(len, top)) + n - 1) * count == find_top_duplicate(grams), (n, text[:200])


def test_the_contract_rule_set_drops_what_datatrove_filters_rule_by_rule_drop(corpus: list[str]) -> None:
    """End to end: ``DocumentRuleSet.judge`` (document by document, kiln's implementations, the PII
    prefilters) against the contract's rules applied one after the other with datatrove's filters as is
    and every PII pattern run on every document."""
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
                verdict = _outcome(rule.reference, text)
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


SENTENCE_LINES = [
    "", ".", "...", "a", "A.", "x.", "U.S. Army went home.", "Hello. World", "Dr. Who? Yes!!! \"Quoted.\" 'x.' Fin",
    "no terminal at all", "é. ü? 。 full-width．done", "He said “Stop.” Then she left.” End", "a.b.c.d", "!!!abc",
    "Word .. word ?! word", 'Ends with quote."', "  spaced  .  out  !  ", "tab\tinside. line?",
]


def test_c4_sentence_count_equals_datatrove_splitter_on_every_line(corpus: list[str]) -> None:
    """``_KilnC4Quality._sentences`` (unbounded) is ``len(split_into_sentences(line))`` on every line of
    the corpus, stripped as C4 strips them, and on lines built to hit acronyms, quotes and runs."""
    from datatrove.utils.text import split_into_sentences

    rule = _DatatroveRule("c4", "datatrove.C4QualityFilter", _contract_params("datatrove.C4QualityFilter"))
    assert rule.filter.sentence_ends is not None  # the shortcut is in use
    lines = {line.strip() for text in corpus for line in text.splitlines()} | set(SENTENCE_LINES)
    for line in sorted(lines):
        want = len(split_into_sentences(line, rule.reference.language))
        assert rule.filter._sentences(line, 10**9) == want, line
        assert rule.filter._sentences(line, 2) == min(2, want), line  # counting stops at what C4 still needs

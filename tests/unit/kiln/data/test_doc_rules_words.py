"""A contract's datatrove rules may choose datatrove's own English words (``"words": "datatrove"``:
spaCy's blank English tokenizer and sentencizer, no download); their verdicts are then a datatrove
pipeline's on the same documents. ``web-text@1`` keeps whitespace words (its file never changes).

One test: importing spaCy costs seconds (it imports thinc), paid once here."""

from __future__ import annotations

import pyarrow as pa

from kiln.data.contracts import load_contract
from kiln.data.doc_rules import DATATROVE_FILTERS, _as_datatrove_value, _datatrove_class, build_rule_set, datatrove_parameters
from kiln.data.poison_text import poison_documents
from kiln.data.prose import chunk_text, extract_prose, pydoc_topics


def _pipeline_kept(rules: list[dict], texts: list[str]) -> set[int]:
    """The ids a datatrove pipeline of the rules' filters keeps: each filter built as datatrove builds
    it (its default language, English, so its default word tokenizer), chained as a pipeline runs them."""
    from datatrove.data import Document

    data = (Document(text=text, id=str(i)) for i, text in enumerate(texts))
    for rule in rules:
        defaults = datatrove_parameters(rule["kind"])
        step = _datatrove_class(rule["kind"])(**{k: _as_datatrove_value(defaults.get(k), v) for k, v in rule["params"].items()})
        data = step.run(data, rank=0, world_size=1)
    return {int(doc.id) for doc in data}


def test_datatrove_words_give_a_datatrove_pipelines_verdicts_and_web_text_keeps_whitespace_words() -> None:
    web = load_contract("web-text@1")
    assert not any("words" in r or "lines" in r for r in web.document_rules), "web-text@1 is published: never edited"
    rules = [{**r, "words": "datatrove"} for r in web.document_rules if r["kind"] in DATATROVE_FILTERS]
    prose = [chunk for _, text in list(pydoc_topics())[:25] for chunk in chunk_text(extract_prose(text)) if len(chunk) > 64]
    docs = [(str(i), text, "pydoc") for i, text in enumerate(prose[:40])]
    texts = [text for _, text, _ in docs] + [text for kind in ("boilerplate", "spam")
                                              for _, text, _ in poison_documents(kind, docs[:8])]
    dropped = build_rule_set(rules).judge(pa.array(texts, pa.string()))
    kept = set(range(len(texts))) - {d.row for d in dropped}
    assert kept == _pipeline_kept(rules, texts)
    assert 0 < len(kept) < len(texts)
    # The choice matters: spaCy counts punctuation marks as words, so Gopher's "80 % of words have a
    # letter" drops ordinary prose that whitespace words keep (web-text@1's documented choice).
    whitespace = build_rule_set([{k: v for k, v in r.items() if k != "words"} for r in rules]).judge(pa.array(texts))
    assert len(whitespace) < len(dropped)
    assert {d.detail for d in dropped} >= {"gopher_below_alpha_threshold"}

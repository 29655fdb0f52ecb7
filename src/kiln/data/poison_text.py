"""Natural-language poison kinds: each turns a shard's documents into ones a rule of ``web-text@1``
drops, and only that rule, so that tests and demos show every document rule at work.

    kind              rule (web-text@1)     what is done to ``POISONED_SHARE`` of the shard's documents
    pii               pii                   a contact line (e-mail, phone number, public IP) is appended
    boilerplate       gopher_repetition     a navigation/newsletter block is appended, repeated
    other_script      script                the text is transliterated into Cyrillic letters
    spam              gopher_quality        replaced by machine-generated keyword spam (no stop words)
    near_duplicates   near_duplicate        replaced by a lightly edited copy of a document of an earlier shard

Poisoning works on ``(doc_id, text, source)`` triples, so any builder of natural-language shards can
use it (``kiln corpus`` for the sample corpus, the tests' fixture). Seeded: the same documents and
seed give the same poisoned documents. A poisoned shard drops more than ``web-text@1``'s
``max_dropped_share`` of its documents and is quarantined for it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.errors import ConfigError

Document = tuple[str, str, str]
"""``(doc_id, text, source)``: a row of kiln's shard layout."""

POISONED_SHARE = 0.75
"""Share of a poisoned shard's documents that are poisoned (above ``web-text@1``'s 0.5 threshold,
whatever the rules drop of the rest)."""


@dataclass(frozen=True, slots=True)
class TextPoison:
    name: str
    rule: str
    """The ``web-text@1`` rule id (``document_rules[].rule``, or ``near_duplicate``) that drops the poisoned documents."""
    description: str


TEXT_POISON_KINDS: dict[str, TextPoison] = {
    p.name: p
    for p in (
        TextPoison("pii", "pii", "an e-mail address, a phone number or a public IP address appended"),
        TextPoison("boilerplate", "gopher_repetition", "a newsletter/navigation block appended 8 times"),
        TextPoison("other_script", "script", "the text transliterated into Cyrillic"),
        TextPoison("spam", "gopher_quality", "replaced by seeded keyword spam without stop words"),
        TextPoison("near_duplicates", "near_duplicate", "replaced by a lightly edited copy of an earlier shard's document"),
    )
}

_BOILERPLATE = (
    "Subscribe to our newsletter for the latest updates and exclusive offers.\n"
    "Home | About us | Contact | Privacy | Terms of service\n"
)
_SPAM_WORDS = (
    "cheap", "replica", "watches", "discount", "luxury", "brand", "free", "shipping", "best", "price", "online", "store",
    "buy", "now", "sale", "outlet", "genuine", "quality", "guaranteed", "lowest", "prices", "wholesale", "deals", "fast",
    "delivery", "top", "rated", "bonus", "casino", "slots", "jackpot", "winner", "instant", "payout", "crypto", "profit",
    "trading", "signals", "returns", "weight", "loss", "pills", "miracle", "formula", "exclusive", "limited", "offer",
    "click", "here", "order", "today", "authentic", "designer", "handbags", "sneakers",
)
_CYRILLIC = dict(zip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                     "абцдефгхийклмнопярстуввхызАБЦДЕФГХИЙКЛМНОПЯРСТУВВХЫЗ", strict=True))


def _contact_line(rng: random.Random, n: int) -> str:
    name = rng.choice(("jane.doe", "j.smith", "alex.m", "sam.lee", "chris.w"))
    kind = n % 3
    if kind == 0:
        return f"\nFor questions write to {name}{rng.randrange(10, 99)}@mailbox-{rng.randrange(100, 999)}.com today."
    if kind == 1:
        return f"\nCall us on +1 415 {rng.randrange(200, 999)} {rng.randrange(1000, 9999)} for more information."
    address = ".".join(str(rng.randrange(1, 254)) for _ in range(3))
    return f"\nThe server answered from {rng.randrange(23, 99)}.{address} last night."


def _spam(rng: random.Random) -> str:
    return " ".join(rng.choice(_SPAM_WORDS) for _ in range(rng.randrange(180, 260)))


def _light_edit(text: str, rng: random.Random) -> str:
    """About one word in a hundred replaced: the shingle sets stay ~90 % alike."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 100)):
        words[i] = "indeed"
    return " ".join(words)


def poison_documents(
    kind: str, docs: Sequence[Document], *, seed: int = 0, donors: Sequence[Document] = ()
) -> list[Document]:
    """The shard's documents with ``POISONED_SHARE`` of them poisoned by ``kind`` (ids kept: only the
    text changes). ``near_duplicates`` needs ``donors``: documents of earlier shards (kept by the rules)."""
    if kind not in TEXT_POISON_KINDS:
        raise ConfigError(f"unknown natural-language poison kind {kind!r}; known: {', '.join(TEXT_POISON_KINDS)}")
    if not docs:
        raise ConfigError(f"poison {kind}: the shard has no documents to poison")
    if kind == "near_duplicates" and not donors:
        raise ConfigError("poison near_duplicates needs donor documents of an earlier shard to copy")
    rng = random.Random(f"kiln-text-poison:{seed}:{kind}")
    out = list(docs)
    count = max(1, round(POISONED_SHARE * len(out)))
    picks = sorted(rng.sample(range(len(out)), count))
    copies = rng.sample(range(len(donors)), min(count, len(donors))) if donors else []
    for n, i in enumerate(picks):
        doc_id, text, source = out[i]
        if kind == "pii":
            text = text + _contact_line(rng, n)
        elif kind == "boilerplate":
            text = text + "\n" + _BOILERPLATE * 8
        elif kind == "other_script":
            text = "".join(_CYRILLIC.get(c, c) for c in text)
        elif kind == "spam":
            text = _spam(rng)
        elif kind == "near_duplicates":
            text = _light_edit(donors[copies[n % len(copies)]][1], rng)
        out[i] = (doc_id, text, source)
    return out

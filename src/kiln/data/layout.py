"""Hard-wrapped text: telling it apart, reading it by paragraph, and naming it when it is dropped.

Books, papers, licences and most documentation arrive **hard-wrapped**: a paragraph is broken into
lines of 70-80 columns by whoever typeset it, so a line ends wherever the next word did not fit. Web
text, as an extractor gives it, holds one paragraph a line. The line rules of the web-text
literature read a line as a paragraph: C4 keeps only lines that end in terminal punctuation before
it counts sentences, FineWeb wants ≥ 12 % of lines ending in punctuation and ≤ 67 % short lines.
On hard-wrapped prose those rules judge the typesetter's line breaks, not the text.

``unwrap(text)`` is the text with its **soft line breaks** (the ones the wrapping made) replaced by
one space, every other character kept: a line break is soft when the document is wrapped at a width
``W`` in ``[MIN_WRAP_WIDTH, MAX_WRAP_WIDTH]`` (the 90th percentile of its line lengths) and the line
is *full* — its length, a space and the next line's first word would pass ``W``, which is exactly why
a greedy wrapper (``textwrap``, ``fmt``, an editor's auto-fill) broke there. A break before a blank
line, a list item (``-``, ``*``, ``•``, ``1.``, ``(a)``), or a line indented deeper than the
paragraph (code, a quotation) is kept, and so is a break after a line that is not full (a heading,
the end of a paragraph, a short line of code or verse). A document with no width in range (one
paragraph a line, or a list of short items) comes back unchanged.

``hard_wrapped(text)``: whether at least half of a document's line breaks between non-blank lines are
soft (``unwrap`` would rejoin them): a hard-wrapped document.

``layout_hint(...)``: what ``kiln validate`` and the quarantine report print when most of the drops
come from the line rules on hard-wrapped text, and which contract fits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MIN_WRAP_WIDTH = 40
"""Narrowest width taken for a wrap (narrower lines are lists, verse or menus, not wrapped prose)."""
MAX_WRAP_WIDTH = 132
"""Widest width taken for a wrap (a line printer's; wider lines are one paragraph a line)."""
MIN_LINES = 3
"""A document with fewer non-blank lines has no wrap width to find."""
_LIST_ITEM = re.compile(r"[ \t]*(?:[-*+•–]|\d{1,3}[.)]|\(?[a-zA-Z0-9]{1,3}\))[ \t]")
_INDENT = re.compile(r"[ \t]*")

LAYOUT_SENSITIVE: Mapping[str, frozenset[str]] = {
    "datatrove.C4QualityFilter": frozenset({"too_few_sentences"}),
    "datatrove.FineWebQualityFilter": frozenset({"line_punct_ratio", "short_line_ratio"}),
    "datatrove.GopherQualityFilter": frozenset({"gopher_too_many_bullets", "gopher_too_many_end_ellipsis"}),
}
"""The (filter kind, datatrove reason) pairs that read line ends: on hard-wrapped text they judge the
wrapping. C4's sentences are counted only on lines ending in terminal punctuation; FineWeb's line
punctuation and short-line shares; Gopher's bullet and end-ellipsis line shares."""
HINT_MIN_SHARE = 1 / 3
"""The hint shows when more than this share of the dropped documents are hard-wrapped documents that
a layout-sensitive rule dropped. A third, not a half: the rest of a drop list on real documentation is
content (short pages under C4's five sentences, code braces, duplicated lines), and web text is almost
never hard-wrapped, so a third of the drops being wrapped text is already far from web text (on the
Python reference's topics, web-text@1 drops 52 of 79, 27 of them flagged)."""
WRAPPED_CONTRACT = "prose-wrapped"
"""The contract family made for hard-wrapped prose (its line rules read paragraphs)."""


def _width(lines: list[str]) -> int | None:
    """The wrap width: the 90th percentile of the lengths of the lines up to ``MAX_WRAP_WIDTH`` (a
    long line of code or a URL does not move it), when those are most of the non-blank lines."""
    lengths = [len(line) for line in lines if line.strip()]
    short = sorted(n for n in lengths if n <= MAX_WRAP_WIDTH)
    if len(short) < MIN_LINES or 2 * len(short) < len(lengths):
        return None
    width = short[(len(short) * 9) // 10 - (1 if len(short) % 10 == 0 else 0)]
    return width if width >= MIN_WRAP_WIDTH else None


def _indent(line: str) -> int:
    return len(_INDENT.match(line).group(0).expandtabs(8))  # type: ignore[union-attr]  # always matches


def _soft_breaks(lines: list[str]) -> tuple[list[bool], int]:
    """For each break between ``lines[i]`` and ``lines[i + 1]``: whether it is soft; and how many of
    the breaks lie between two non-blank lines."""
    stripped = [line.rstrip() for line in lines]
    width = _width(stripped)
    soft = [False] * max(0, len(lines) - 1)
    between = 0
    paragraph_indent: int | None = None
    for i in range(len(lines) - 1):
        line, nxt = stripped[i], stripped[i + 1]
        if not line.strip():
            paragraph_indent = None
            continue
        if paragraph_indent is None:
            paragraph_indent = _indent(line)
        if not nxt.strip():
            continue
        between += 1
        if width is None or _LIST_ITEM.match(nxt):
            continue
        # A hanging indent (a list item's continuation, a first-line indent) is the paragraph's; a
        # line indented deeper than both is a block of its own.
        if _indent(nxt) > max(_indent(line), paragraph_indent) + 1 and _indent(nxt) - _indent(line) >= 3:
            continue
        first_word = nxt.split(None, 1)[0]
        if len(line) + 1 + len(first_word) > width:
            soft[i] = True
    return soft, between


def unwrap(text: str) -> str:
    """``text`` with its soft line breaks (and the next line's indentation) replaced by one space."""
    if "\n" not in text:
        return text
    lines = text.split("\n")
    soft, _ = _soft_breaks(lines)
    if not any(soft):
        return text
    out = [lines[0]]
    for i, is_soft in enumerate(soft):
        nxt = lines[i + 1]
        if is_soft:
            out[-1] = out[-1].rstrip() + " " + nxt.lstrip()
        else:
            out.append(nxt)
    return "\n".join(out)


def hard_wrapped(text: str) -> bool:
    """Whether at least half of the breaks between two non-blank lines of ``text`` are soft."""
    if "\n" not in text:
        return False
    soft, between = _soft_breaks(text.split("\n"))
    return between > 0 and 2 * sum(soft) >= between


def layout_sensitive(kind: str, detail: str) -> bool:
    """Whether a drop by a rule of ``kind`` with datatrove's reason ``detail`` read the line ends."""
    return detail in LAYOUT_SENSITIVE.get(kind, frozenset())


def layout_hint(dropped: Mapping[str, Any], contracts: Iterable[str]) -> str | None:
    """One line naming the fitting contract when many drops (over ``HINT_MIN_SHARE``) are layout drops
    on hard-wrapped text.

    ``dropped``: a quarantine report's ``dropped["all_shards"]`` tally (``documents`` and, when the
    rules recorded it, ``hard_wrapped_layout``: documents that are hard-wrapped and were dropped by a
    layout-sensitive rule). ``contracts``: the refs the shards were validated against. None when the
    hint does not apply (nothing dropped, too few layout drops, or the contract already reads
    paragraphs)."""
    documents = int(dropped.get("documents") or 0)
    layout = int(dropped.get("hard_wrapped_layout") or 0)
    refs = sorted(contracts)
    if not documents or layout <= documents * HINT_MIN_SHARE or any(r.split("@", 1)[0] == WRAPPED_CONTRACT for r in refs):
        return None
    return (f"{layout} of the {documents} dropped documents ({layout / documents:.0%}) are hard-wrapped text dropped by "
            f"line rules that read each line as a paragraph (C4's sentence count, FineWeb's line punctuation); "
            f"the text is likely fine: validate it with --contract {WRAPPED_CONTRACT}@1, whose line rules read "
            f"paragraphs (data_contracts/{WRAPPED_CONTRACT}/README.md)")

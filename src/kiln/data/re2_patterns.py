"""Every regex a contract or a document rule runs, as an RE2 pattern with Python's meaning.

Python's ``re`` backtracks: a pattern like datatrove's e-mail one is quadratic in the text, ``(a+)+b``
exponential, so one document could hold a validation task for hours. RE2 runs in time linear in the
text. Contracts are written in Python's regex syntax (what Great Expectations and datatrove use), so
kiln translates each pattern from Python's own parse tree into RE2, keeping Python's meaning:

* ``\\d``, ``\\w``, ``\\s`` (and negations) become the exact Unicode classes Python uses for a ``str``
  (``str.isdecimal``, ``str.isalnum() or "_"``, ``str.isspace``): RE2's own are ASCII only;
* groups, alternatives, classes, greedy and lazy repeats (at most ``MAX_REPEAT``) and ``\\A`` / ``^``
  / ``\\Z`` translate one to one;
* for a pattern that is only *searched* (does it match somewhere: GE's regex expectations, the PII
  phone pattern), the edges RE2 has no assertion for are spelled as the character they look at: a
  lookbehind of one character class at the start, a lookahead of one class or ``$`` at the end, and
  ``\\b`` / ``\\B`` at either end next to one class or a repeat of one.

Anything else (backreferences, other lookarounds, atomic groups, possessive repeats, inline flags,
conditionals) is refused with the reason, and ``kiln contract check`` names the field: a contract
cannot ask for a pattern kiln would have to run on a backtracking engine. The emitted pattern uses
no escape Python cannot parse and none of the constructs for which pandas leaves Arrow's RE2 for
Python's ``re`` (``\\s``/``\\w``/``\\d``/``\\b``, lookarounds, ``$``, ``\\u``), so a GE expectation
given the translation runs on RE2 too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from kiln.errors import PatternNotLinear

MAX_REPEAT = 1000
"""Largest bounded repeat count (RE2's own limit)."""
MAX_PATTERN_CHARS = 10_000
"""Longest pattern a contract may hold."""
_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)

Ranges = tuple[tuple[int, int], ...]


def _parser() -> tuple[Any, Any]:
    """Python's own regex parser (private modules, not in typeshed: imported by name)."""
    import importlib

    return importlib.import_module("re._parser"), importlib.import_module("re._constants")


def _normalise(ranges: Sequence[tuple[int, int]]) -> Ranges:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_normalise([*_complement(a), *_complement(b)]))


@functools.cache
def _python_class(test: str) -> Ranges:
    """The code points for which Python's ``str`` method ``test`` holds (what ``re`` uses for ``\\d \\w \\s``)."""
    check: Callable[[str], bool] = (
        (lambda c: c.isalnum() or c == "_") if test == "word" else getattr(str, test))
    ranges: list[tuple[int, int]] = []
    for code in range(_MAX_CODE_POINT + 1):
        if check(chr(code)):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    return tuple(ranges)


def _category(name: str) -> Ranges:
    base = {"DIGIT": "isdecimal", "WORD": "word", "SPACE": "isspace"}
    negated = name.startswith("CATEGORY_NOT_")
    key = name.removeprefix("CATEGORY_NOT_").removeprefix("CATEGORY_")
    if key not in base:
        raise PatternNotLinear(f"the class {name} (a locale or line-break class) has no RE2 spelling")
    ranges = _python_class(base[key])
    return _complement(ranges) if negated else ranges


_WORD = "WORD"


def _word() -> Ranges:
    return _python_class("word")


def _char(code: int) -> str:
    """One code point, spelled so that both RE2 and Python's parser read it (no ``\\u``, no ``\\x{}``)."""
    if code < 0x80:
        ch = chr(code)
        return ch if ch.isalnum() or ch == "_" else f"\\x{code:02x}"
    return chr(code)


def _class(ranges: Ranges) -> str:
    # Arrow strings are valid UTF-8: the surrogates can never occur, and cannot be spelled in UTF-8.
    ranges = _intersect(ranges, _complement(((_SURROGATES[0], _SURROGATES[1]),)))
    if not ranges:
        raise PatternNotLinear("a character class that matches no character")
    if ranges == ((0, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, _MAX_CODE_POINT)):
        return "(?s:.)"
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    return "[" + "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges) + "]"


class _Translator:
    def __init__(self) -> None:
        self.p, self.c = _parser()

    def char_set(self, op: Any, av: Any) -> Ranges | None:
        """The characters a one-character node matches, or None when the node is not one character."""
        c = self.c
        if op == c.LITERAL:
            return ((av, av),)
        if op == c.NOT_LITERAL:
            return _complement(((av, av),))
        if op == c.ANY:
            return _complement(((10, 10),))
        if op != c.IN:
            return None
        negate = False
        parts: list[tuple[int, int]] = []
        for item_op, item_av in av:
            if item_op == c.NEGATE:
                negate = True
            elif item_op == c.LITERAL:
                parts.append((item_av, item_av))
            elif item_op == c.RANGE:
                parts.append(item_av)
            elif item_op == c.CATEGORY:
                parts.extend(_category(str(item_av)))
            else:
                raise PatternNotLinear(f"the class item {item_op} has no RE2 spelling")
        ranges = _normalise(parts)
        return _complement(ranges) if negate else ranges

    def nodes(self, nodes: Any, end: str) -> str:
        return "".join(self.node(op, av, end) for op, av in nodes)

    def node(self, op: Any, av: Any, end: str) -> str:
        c = self.c
        chars = self.char_set(op, av)
        if chars is not None:
            return _class(chars)
        if op == c.BRANCH:
            return "(?:" + "|".join(self.nodes(branch, end) for branch in av[1]) + ")"
        if op == c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if (add_flags | del_flags) & ~re.VERBOSE:
                raise PatternNotLinear("inline flags (?i) (?m) (?s) (?a) inside a group are not supported")
            return "(?:" + self.nodes(sub, end) + ")"
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, sub = av
            unbounded = high == c.MAXREPEAT
            if low > MAX_REPEAT or (not unbounded and high > MAX_REPEAT):
                raise PatternNotLinear(f"a repeat count above {MAX_REPEAT} (RE2's limit)")
            count = ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}") if unbounded else (
                "?" if (low, high) == (0, 1) else f"{{{low}}}" if low == high else f"{{{low},{high}}}")
            return "(?:" + self.nodes(sub, end) + ")" + count + ("?" if op == c.MIN_REPEAT else "")
        if op == c.AT:
            if av in (c.AT_BEGINNING, c.AT_BEGINNING_STRING):
                return "\\A"
            if av == c.AT_END_STRING:
                return end
            if av == c.AT_END:
                raise PatternNotLinear("'$' is supported only at the very end of a pattern that is searched")
            raise PatternNotLinear("\\b and \\B are supported only at either end of a pattern that is searched, "
                                   "next to one character class or a repeat of one")
        if op in (c.ASSERT, c.ASSERT_NOT):
            raise PatternNotLinear("lookarounds are supported only as one-character lookbehind at the start or "
                                   "lookahead at the end of a pattern that is searched")
        names = {c.GROUPREF: "a backreference", c.GROUPREF_EXISTS: "a conditional group"}
        for name in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP"):
            if getattr(c, name, None) is not None:
                names[getattr(c, name)] = "a possessive repeat or atomic group"
        raise PatternNotLinear(f"{names.get(op, str(op))} has no linear-time (RE2) form")

    # -- edges of a searched pattern ----------------------------------------------------------------

    def one_class_assertion(self, av: Any, direction: int) -> Ranges | None:
        look, sub = av
        if look != direction or len(sub.data) != 1:
            return None
        return self.char_set(*sub.data[0])

    def split_repeat(self, op: Any, av: Any) -> tuple[Ranges, str] | None:
        """A one-character node, or a repeat (at least once) of one, as (its class, the rest but one)."""
        c = self.c
        chars = self.char_set(op, av)
        if chars is not None:
            return chars, ""
        if op in (c.MAX_REPEAT, c.MIN_REPEAT) and av[0] >= 1 and len(av[2]) == 1:
            chars = self.char_set(*av[2][0])
            if chars is not None:
                low, high = av[0] - 1, av[1] if av[1] == c.MAXREPEAT else av[1] - 1
                rest = self.node(op, (low, high, av[2]), "\\z") if (low, high) != (0, 0) else ""
                return chars, rest
        return None


def _flags_problem(flags: int) -> str | None:
    unsupported = flags & ~(re.UNICODE | re.VERBOSE)
    if unsupported:
        return f"flags {re.RegexFlag(unsupported)!r} are not supported (spell the variants out, e.g. [Aa])"
    return None


def _parse(pattern: Any) -> Any:
    if not isinstance(pattern, str):
        raise PatternNotLinear(f"a pattern must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternNotLinear(f"{len(pattern)} characters, above the {MAX_PATTERN_CHARS} allowed")
    parser, _ = _parser()
    try:
        parsed = parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        raise PatternNotLinear(f"not a valid regex: {exc}") from exc
    problem = _flags_problem(parsed.state.flags)
    if problem:
        raise PatternNotLinear(problem)
    return parsed


def _compiled_check(translated: str) -> str:
    import re2

    try:
        re2.compile(translated.replace("\\Z", "\\z"))
    except re2.error as exc:
        raise PatternNotLinear(f"RE2 cannot compile it: {exc}") from exc
    return translated


@functools.lru_cache(maxsize=256)
def re2_exact(pattern: str) -> str:
    """An RE2 pattern with the same matches (spans, order) as the Python regex ``pattern``; raises
    ``PatternNotLinear``. For patterns whose matches are used or counted (``finditer``, ``findall``)."""
    parsed = _parse(pattern)
    try:
        return _compiled_check(_Translator().nodes(parsed.data, "\\z"))
    except RecursionError as exc:
        raise PatternNotLinear("nested too deeply") from exc


@functools.lru_cache(maxsize=256)
def re2_search(pattern: str, *, end: str = "\\z") -> str:
    """An RE2 pattern that matches somewhere in a text exactly when ``re.search(pattern, text)`` does;
    raises ``PatternNotLinear``. ``end`` spells the end of the text (``\\Z`` for a pattern handed to
    pandas, which rewrites it for RE2 itself)."""
    parsed = _parse(pattern)
    t = _Translator()
    c = t.c
    data = list(parsed.data)
    word = _word()
    head = tail = ""
    try:
        if data and data[0][0] in (c.ASSERT, c.ASSERT_NOT) and (chars := t.one_class_assertion(data[0][1], -1)) is not None:
            head = _class(chars) if data[0][0] == c.ASSERT else f"(?:\\A|{_class(_complement(chars))})"
            data = data[1:]
        elif data and data[0] == (c.AT, c.AT_BOUNDARY) or data and data[0] == (c.AT, c.AT_NON_BOUNDARY):
            boundary = data[0][1] == c.AT_BOUNDARY
            split = t.split_repeat(*data[1]) if len(data) > 1 else None
            if split is None:
                raise PatternNotLinear("\\b or \\B at the start must be followed by one character class or a repeat of one")
            chars, rest = split
            options = []
            for own, before in ((_intersect(chars, word), not boundary), (_intersect(chars, _complement(word)), boundary)):
                if own:  # the character before must be a word character exactly when `before`
                    lead = _class(word) if before else f"(?:\\A|{_class(_complement(word))})"
                    options.append(lead + _class(own))
            if not options:
                raise PatternNotLinear("a character class that matches no character")
            head = "(?:" + "|".join(options) + ")" + rest
            data = data[2:]
        if data and data[-1][0] in (c.ASSERT, c.ASSERT_NOT) and (chars := t.one_class_assertion(data[-1][1], 1)) is not None:
            tail = _class(chars) if data[-1][0] == c.ASSERT else f"(?:{end}|{_class(_complement(chars))})"
            data = data[:-1]
        elif data and data[-1] == (c.AT, c.AT_END):
            tail = f"(?:\\n?{end})"
            data = data[:-1]
        elif data and data[-1] in ((c.AT, c.AT_BOUNDARY), (c.AT, c.AT_NON_BOUNDARY)):
            boundary = data[-1][1] == c.AT_BOUNDARY
            split = t.split_repeat(*data[-2]) if len(data) > 1 else None
            if split is None:
                raise PatternNotLinear("\\b or \\B at the end must follow one character class or a repeat of one")
            chars, rest = split
            options = []
            for own, after in ((_intersect(chars, word), not boundary), (_intersect(chars, _complement(word)), boundary)):
                if own:
                    trail = _class(word) if after else f"(?:{end}|{_class(_complement(word))})"
                    options.append(_class(own) + trail)
            if not options:
                raise PatternNotLinear("a character class that matches no character")
            tail = rest + "(?:" + "|".join(options) + ")"
            data = data[:-2]
        return _compiled_check(head + t.nodes(data, end) + tail)
    except RecursionError as exc:
        raise PatternNotLinear("nested too deeply") from exc


def pattern_problem(pattern: Any, *, searched: bool) -> str | None:
    """Why ``pattern`` cannot run on RE2, as a phrase to follow the field's name (None when it can): what
    ``kiln contract check`` reports, e.g. ``does not compile: ...`` or ``cannot run on ... RE2: ...``."""
    if not isinstance(pattern, str):
        return f"must be a regex string, got {type(pattern).__name__}"
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        return f"does not compile: {exc}"
    try:
        re2_search(pattern) if searched else re2_exact(pattern)
    except PatternNotLinear as exc:
        return f"cannot run on a linear-time engine (RE2): {exc} (pattern {pattern[:200]!r})"
    return None


@functools.lru_cache(maxsize=256)
def compiled_search(pattern: str) -> Any:
    """``re2`` compiled form of ``re2_search(pattern)``."""
    import re2

    return re2.compile(re2_search(pattern))


@functools.lru_cache(maxsize=256)
def compiled_exact(pattern: str) -> Any:
    """``re2`` compiled form of ``re2_exact(pattern)``."""
    import re2

    return re2.compile(re2_exact(pattern))

"""What a Python regex can match, read off Python's own parse: required literals and RE2 spellings."""

from __future__ import annotations

import re
from typing import Any


def _sre_parse(pattern: str) -> Any:
    """Python's own parse tree of ``pattern`` (``re._parser``), or None when it does not compile."""
    try:
        from re import _parser as sre_parse  # type: ignore[attr-defined]  # private, so not in typeshed
    except ImportError:  # Python < 3.11
        import sre_parse
    try:
        return sre_parse.parse(pattern)
    except (re.error, TypeError, ValueError):
        return None


def _sre_names() -> dict[str, Any]:
    try:
        from re import _constants as sre_constants  # type: ignore[attr-defined]  # private, so not in typeshed
    except ImportError:  # Python < 3.11
        import sre_constants
    names = ("LITERAL", "IN", "RANGE", "SUBPATTERN", "BRANCH", "MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT", "ATOMIC_GROUP")
    return {n: getattr(sre_constants, n, None) for n in names}


MAX_LITERAL_OPTIONS = 64
"""A node matching more fixed strings than this is not used as a prefilter."""
MIN_LITERAL_CHARS = 3
"""Required literals shorter than this would let most rows through: no prefilter then."""
MAX_LITERAL_LENGTH = 256
"""A run of literals is cut into required strings of about this length: a longer one filters no better."""


def _fixed_strings(nodes: Any, names: dict[str, Any]) -> set[str] | None:
    """The finite set of strings a node sequence can match, if it is small and made of literals only."""
    options = {""}
    for op, av in nodes:
        choices: set[str] | None
        if op == names["LITERAL"]:
            choices = {chr(av)}
        elif op == names["IN"]:
            choices = set()
            for item_op, item_av in av:
                if item_op == names["LITERAL"]:
                    choices.add(chr(item_av))
                elif item_op == names["RANGE"] and item_av[1] - item_av[0] < MAX_LITERAL_OPTIONS:
                    choices.update(chr(c) for c in range(item_av[0], item_av[1] + 1))
                else:  # NEGATE, CATEGORY, a wide range
                    return None
        elif op == names["SUBPATTERN"]:
            _group, add_flags, _del_flags, sub = av
            if add_flags & re.IGNORECASE:
                return None
            choices = _fixed_strings(sub, names)
        elif op == names["BRANCH"]:
            choices = set()
            for branch in av[1]:
                fixed = _fixed_strings(branch, names)
                if fixed is None:
                    return None
                choices |= fixed
        else:
            return None
        if choices is None or len(options) * len(choices) > MAX_LITERAL_OPTIONS:
            return None
        options = {a + b for a in options for b in choices}
    return options


def _required_in(nodes: Any, names: dict[str, Any]) -> list[set[str]]:
    """Sets of strings such that every match of ``nodes`` contains at least one string of each set.

    One pass: a run of literal nodes grows its set of fixed strings node by node (a contract's
    pattern comes from a stranger, and re-reading the run at each node was cubic in its length)."""
    found: list[set[str]] = []
    options: set[str] | None = None  # the fixed strings the current run of literal nodes matches

    def close_run() -> None:
        nonlocal options
        if options:
            found.append(options)
        options = None

    for op, av in nodes:
        choices = _fixed_strings([(op, av)], names)
        if choices is not None:
            # a run longer than the option cap, or than MAX_LITERAL_LENGTH, is still useful: keep its
            # best prefix and start a new run (each run's strings are required on their own)
            if (options is None or len(options) * len(choices) > MAX_LITERAL_OPTIONS
                    or max(map(len, options)) >= MAX_LITERAL_LENGTH):
                close_run()
                options = choices
            else:
                options = {a + b for a in options for b in choices}
            continue
        close_run()
        if op == names["SUBPATTERN"] and not av[1] & re.IGNORECASE:
            found.extend(_required_in(av[3], names))
        elif op in (names["MAX_REPEAT"], names["MIN_REPEAT"], names["POSSESSIVE_REPEAT"]) and av[0] >= 1:
            found.extend(_required_in(av[2], names))
        elif op == names["ATOMIC_GROUP"]:
            found.extend(_required_in(av, names))
        elif op == names["BRANCH"]:
            per_branch = [_best_literals(_required_in(branch, names)) for branch in av[1]]
            usable = [literals for literals in per_branch if literals]
            if len(usable) == len(per_branch):
                found.append(set[str]().union(*usable))
    close_run()
    return found


def _best_literals(candidates: list[set[str]]) -> set[str] | None:
    usable = [c for c in candidates if c and min(map(len, c)) >= MIN_LITERAL_CHARS]
    if not usable:
        return None
    return max(usable, key=lambda c: (min(map(len, c)), -len(c)))


def required_literals(pattern: str) -> frozenset[str] | None:
    """Strings one of which every match of the Python regex ``pattern`` contains, or None if unknown.

    Sound by construction: a match is the concatenation of the matches of the pattern's top-level
    nodes, so it contains what a run of literal nodes (or a group, a branch of such runs, a repeat
    of at least one) matches. Case-insensitive patterns and anything this does not understand
    return None. A text that contains none of the strings cannot match the pattern.
    """
    parsed = _sre_parse(pattern)
    if parsed is None or parsed.state.flags & re.IGNORECASE:
        return None
    best = _best_literals(_required_in(parsed.data, _sre_names()))
    return frozenset(best) if best else None


def _re2_char_class(pattern: str) -> str | None:
    """The RE2 spelling of a Python regex that is one character class, or None.

    Built from the parsed class (code point ranges), so both engines accept exactly the same
    characters; anything else (several nodes, categories like ``\\w``, flags) returns None."""
    parsed = _sre_parse(pattern)
    if parsed is None or parsed.state.flags & re.IGNORECASE or len(parsed.data) != 1:
        return None
    (op, av), = parsed.data
    names = _sre_names()
    if op == names["LITERAL"]:
        return f"\\x{{{av:x}}}"
    if op != names["IN"]:
        return None
    parts = []
    for item_op, item_av in av:
        if item_op == names["LITERAL"]:
            parts.append(f"\\x{{{item_av:x}}}")
        elif item_op == names["RANGE"]:
            parts.append(f"\\x{{{item_av[0]:x}}}-\\x{{{item_av[1]:x}}}")
        else:  # NEGATE, CATEGORY: leave those to Python
            return None
    return "[" + "".join(parts) + "]"


def _re2_literal(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)

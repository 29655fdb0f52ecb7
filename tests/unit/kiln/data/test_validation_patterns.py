"""``kiln.data.validation.patterns``: required literals (sound, found for each shipped secret), RE2 spellings."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from kiln.data.validation.frames import _char_share
from kiln.data.validation.patterns import _re2_char_class, required_literals


def test_every_shipped_secret_pattern_has_required_literals(stdlib_contract) -> None:
    """Otherwise the stacked run falls back to GE's regexes over every row (correct, but slow)."""
    found = {p: required_literals(p) for p in stdlib_contract.secret_patterns}
    assert all(found.values()), found
    assert found["(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\\b"] == {"AKIA", "ASIA", "ABIA", "ACCA"}
    assert found["-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"] == {"PRIVATE KEY-----"}


@pytest.mark.parametrize("pattern", ["a|bcd", "(?i)secret", "x(?i:abc)y", ".*", "\\w{20}", "[^a]{5}", "ab", "(?:abc)?z"])
def test_required_literals_give_up_where_a_match_needs_no_literal(pattern: str) -> None:
    assert required_literals(pattern) is None


def test_required_literals_are_sound_on_random_patterns_and_texts() -> None:
    """Whenever Python's ``re`` finds a match, the text holds one of the required literals."""
    import random

    rng = random.Random(4)
    atoms = ["ab", "abc", "b", "c", "[abc]", "[a-c]", "[^a]", ".", "\\w", "\\b", "(?:ab|ca)", "(?:abc|cab)", "a+", "(?:bc)+",
             "c*", "(?:ab)?", "x{2,3}", "(a)\\1"]
    checked = 0
    for _ in range(1000):
        pattern = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.2:
            pattern = f"{pattern}|{rng.choice(atoms)}{rng.choice(atoms)}"
        literals = required_literals(pattern)
        if literals is None:
            continue
        compiled = re.compile(pattern)
        for _ in range(80):
            text = "".join(rng.choice("abcx ") for _ in range(rng.randint(0, 12)))
            if compiled.search(text):
                checked += 1
                assert any(lit in text for lit in literals), (pattern, text, literals)
    assert checked > 200  # the property was exercised, not vacuous


def test_required_literals_of_a_long_literal_pattern_take_one_pass() -> None:
    """A contract's pattern is a stranger's: 5,000 literal characters took 17 s, 20,000 minutes (each run of
    literals was re-read at every node: cubic); a bound, not a benchmark."""
    import time

    started = time.monotonic()
    literals = required_literals("z" * 5_000 + "(a|b)" + "y" * 10)
    assert time.monotonic() - started < 5
    assert literals == frozenset({"z" * 256})


def test_required_literals_cut_a_long_run_into_required_strings() -> None:
    pattern = "x" * 300 + "[0-9]+" + "tail"
    assert required_literals(pattern) == frozenset({"x" * 256})
    assert re.search(pattern, "x" * 300 + "42tail") and "x" * 256 in "x" * 300 + "42tail"
    assert required_literals("x" * 10 + "\\d+" + "y" * 40) == frozenset({"y" * 40})


def test_char_share_in_arrow_equals_python(stdlib_contract) -> None:
    pattern = stdlib_contract.derived_columns["kiln_text_bad_char_share"]["pattern"]
    texts = ["", "plain", "tab\tand\nnewline", "bell\x07x", "\ufffd" * 3 + "abc", "c1 \x85 and é ü", "\x00", None, "日本語\x9f"]
    arrow = _char_share(pa.chunked_array([pa.array(texts, pa.string())]), pattern)
    bad = re.compile(pattern)
    expected = [float("nan") if t is None else (len(bad.findall(t)) / len(t) if t else 0.0) for t in texts]
    assert _re2_char_class(pattern) is not None  # the RE2 path ran
    assert [None if v != v else v for v in arrow.tolist()] == [None if v != v else v for v in expected]
    assert _re2_char_class("[\\w]") is None and _re2_char_class("ab") is None

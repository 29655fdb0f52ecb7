"""``kiln.data.re2_patterns``: Python regexes translated to RE2 with the same verdicts, or refused with the reason."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.contracts import CONTRACTS_DIR
from kiln.data.re2_patterns import compiled_exact, compiled_search, pattern_problem, re2_search
from kiln.errors import PatternNotLinear

WEB_TEXT = json.loads((CONTRACTS_DIR / "web-text" / "v1.json").read_text())
PHONE = WEB_TEXT["meta"]["kiln"]["document_rules"][0]["params"]["phone_pattern"]
SECRETS = [p for e in WEB_TEXT["expectations"] for p in e["kwargs"].get("regex_list", [])]
EMAIL = (r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@(?:(?:[A-Za-z0-9](?:["
         r"A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?|\[(?:(?:25[0-5]|2[0-4][0-9]|["
         r"01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?|[A-Za-z0-9-]*[A-Za-z0-9]:)])")
IP = r"(?:(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
SEARCHED = [EMAIL, PHONE, *SECRETS, r"^\w+$", r"(?<!x)\d\d(?=\s)", r"\bab\B", r"[\s\S]x\Z", r"a{2,5}?b|c*"]
# Characters around the edges the patterns look at: ASCII and Unicode word characters, digits of other
# scripts (Python's \d takes them, RE2's does not), Unicode spaces, and the punctuation of e-mails and numbers.
ALPHABET = st.sampled_from(list("aAbxz_09@.-+() \n\t\u00a0é١ßK[]:!") + ["AKIA", "ab", "x@y.io", "+1 (555) 123-4567"])


@settings(max_examples=400, deadline=None)
@given(st.lists(ALPHABET, max_size=20).map("".join), st.sampled_from(SEARCHED))
def test_a_searched_pattern_matches_somewhere_exactly_when_pythons_does(text: str, pattern: str) -> None:
    assert bool(compiled_search(pattern).search(text)) == bool(re.search(pattern, text))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("0123456789.25 a")), max_size=30).map("".join))
def test_an_exact_pattern_finds_pythons_matches(text: str) -> None:
    assert [m.group(0) for m in compiled_exact(IP).finditer(text)] == re.findall(IP, text)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [(r"(a)\1", "backreference"), (r"a(?=b)c", "lookarounds"), (r"(?i)abc", "IGNORECASE"), (r"a{2000}", "above 1000"),
     (r"(?>a+)b", "possessive repeat or atomic group"), (r"a++", "possessive"), (r"a$b", r"'\$'"), ("x" * 20_000, "allowed")],
)
def test_what_re2_cannot_take_is_refused_with_the_reason(pattern: str, why: str) -> None:
    with pytest.raises(PatternNotLinear, match=why):
        re2_search(pattern)
    assert re.search(why, pattern_problem(pattern, searched=True) or "")


def test_a_pattern_that_does_not_compile_is_named_so() -> None:
    assert (pattern_problem("(", searched=False) or "").startswith("does not compile")
    assert pattern_problem(7, searched=True) == "must be a regex string, got int"
    assert pattern_problem(PHONE, searched=True) is None


def test_the_translation_leaves_nothing_for_pandas_to_run_on_pythons_re() -> None:
    # pandas runs str.contains in Arrow's RE2 unless the pattern holds \s \w \d \b, lookarounds, $ or \u.
    for pattern in SEARCHED:
        translated = re2_search(pattern, end="\\Z")
        assert not re.search(r"\\[swdbSWDBuUN]|\(\?<?[=!]|\$", translated), (pattern, translated[:200])

"""Document-level rules: which documents of a shard are dropped, and by which rule.

A contract's ``meta.kiln.document_rules`` is an ordered list; each document is dropped by the first
rule it fails (the order of datatrove's FineWeb pipeline: a document a filter removed never reaches
the next one), and kept when it passes them all::

    {"rule": "gopher_quality", "kind": "datatrove.GopherQualityFilter", "params": {"min_doc_words": 50}}

Kinds (``DOCUMENT_RULE_KINDS``):

    datatrove.GopherRepetitionFilter   Rae et al. 2021 (Gopher), table A1          datatrove's filter, as is
    datatrove.GopherQualityFilter      Rae et al. 2021, MassiveWeb quality rules   datatrove's filter, as is
    datatrove.C4QualityFilter          Raffel et al. 2020 (C4), section 2.2        datatrove's filter, verdict only
    datatrove.FineWebQualityFilter     Penedo et al. 2024 (FineWeb)                datatrove's filter, as is
    kiln.pii                           e-mail and public IP addresses (datatrove's PIIFormatter patterns),
                                       phone numbers (the contract's pattern)
    kiln.script                        share of letters outside the contract's Unicode scripts (RE2 ``\\p{Script}``)
    kiln.extension, kiln.secrets,      source code: extension allow-list, credentials, generated-file markers,
    kiln.generated, kiln.license_header,  licence headers, line length and alphanumeric share
    kiln.code_lines                    (``kiln.data.code_rules``: Codex, The Stack, StarCoder)

A datatrove rule may also say how it reads the document (``LINES``, ``WORDS``)::

    {"rule": "c4_quality", "kind": "datatrove.C4QualityFilter", "params": {...},
     "lines": "unwrapped", "words": "whitespace"}

``lines``: ``stored`` (default) or ``unwrapped`` (soft line breaks of hard-wrapped paragraphs joined,
``kiln.data.layout``: the line rules then judge paragraphs; ``prose-wrapped@1``). ``words``:
``whitespace`` (default, below) or ``datatrove`` (datatrove's English default, spaCy's blank
tokenizer with its sentencizer: the verdicts are then a datatrove pipeline's on the same documents,
tested on a sample; one departure remains, below: C4's line removal is not handed on to the rules
after it. Importing spaCy imports torch through thinc where torch is installed: seconds, once a process).

Two choices keep every rule offline and the verdict about the bytes kiln trains on:

* **Words are whitespace-separated** unless a rule says ``"words": "datatrove"``: datatrove's English
  default is a spaCy tokenizer (15 more packages) that counts punctuation as words, which Gopher's rules do not (its
  80 %-alphabetic-words rule then drops ordinary prose: measured on the standard library's docs,
  median 0.65). Sentences use datatrove's own regex sentence splitter (no NLTK punkt download).
* **A rule judges the original text.** C4's filter removes lines (no terminal punctuation, "javascript",
  cookie notices) before counting sentences and passes the cleaned text on; kiln never rewrites a
  document (training reads the snapshot's bytes), so only the document-level verdict is used and each
  rule sees the text as stored.

* **The filters run as datatrove ships them.** A verdict-identical rewrite of the three costliest
  (Gopher repetition and quality, C4) was measured at about half the rules' CPU (commit 8f60ba0 and
  the three after it) and taken out again: the rules are the literature's as a maintained library
  implements them, and the validation goal (≤ 3× a pyarrow read) stayed far out of reach even with it
  (46×). What is kept: each document is converted once and judged by the run of datatrove rules
  document by document (datatrove's word cache splits it once), and PII skips its patterns on
  documents that cannot match.

Not usable offline, so not offered: datatrove's ``LanguageFilter`` (fastText model download; ``kiln.script``
stands in for "another script"), ``C4BadWordsFilter`` (word list download), NLTK-based tokenizers.

datatrove is imported on first use (0.4 s); ``check_document_rules`` needs it only for the datatrove
kinds' parameter names.
"""

from __future__ import annotations

import inspect
import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from kiln.data.code_rules import CODE_RULE_KINDS, CodeRule, code_rule_problems
from kiln.data.re2_patterns import compiled_exact, compiled_search, pattern_problem
from kiln.errors import ContractError

DATATROVE_FILTERS: dict[str, tuple[str, str]] = {
    "datatrove.GopherRepetitionFilter": ("datatrove.pipeline.filters.gopher_repetition_filter", "GopherRepetitionFilter"),
    "datatrove.GopherQualityFilter": ("datatrove.pipeline.filters.gopher_quality_filter", "GopherQualityFilter"),
    "datatrove.C4QualityFilter": ("datatrove.pipeline.filters.c4_filters", "C4QualityFilter"),
    "datatrove.FineWebQualityFilter": ("datatrove.pipeline.filters.fineweb_quality_filter", "FineWebQualityFilter"),
}
"""Contract kind -> (module, class) of the datatrove 0.10 filter it runs."""
PII_KIND = "kiln.pii"
SCRIPT_KIND = "kiln.script"
DOCUMENT_RULE_KINDS = frozenset({*DATATROVE_FILTERS, PII_KIND, SCRIPT_KIND, *CODE_RULE_KINDS})

LINES = ("stored", "unwrapped")
"""A datatrove rule's ``lines``: ``stored`` (default) reads the text's own lines; ``unwrapped`` reads it
with the soft line breaks of hard-wrapped paragraphs joined (``kiln.data.layout.unwrap``), so that its
line rules judge paragraphs, not where a typesetter broke them. Words are the same either way."""
WORDS = ("whitespace", "datatrove")
"""A datatrove rule's ``words``: ``whitespace`` (default) splits words with ``str.split()`` and sentences
with datatrove's regex splitter; ``datatrove`` uses datatrove's own English default, spaCy's blank
English tokenizer with its sentencizer (no model download; needs the ``spacy`` package), so that the
rule's verdicts are a datatrove pipeline's."""
RULE_KEYS = frozenset({"rule", "kind", "params", "description", "source", "lines", "words"})
_NOT_CONTRACT_PARAMS = frozenset({"self", "exclusion_writer", "language", "batch_size"})
"""datatrove constructor arguments a contract may not set: kiln writes no exclusion files, and the
word tokenizer is kiln's (see the module docstring)."""
PII_PARAMS: dict[str, str] = {"emails": "bool", "public_ips": "bool", "phone_pattern": "regex or null"}
SCRIPT_PARAMS: dict[str, str] = {"scripts": "list of Unicode script names", "max_other_letter_share": "number in [0, 1]",
                                 "min_letters": "int >= 0"}
_RULE_ID = re.compile(r"^[a-z][a-z0-9_.-]*$")
MAX_DOCUMENT_CHARS = 1_000_000
"""The per-document budget: a longer document is dropped (rule ``DOCUMENT_BUDGET_RULE``) before any rule
runs, so no document holds a validation task longer than the rules take on this many characters."""
DOCUMENT_BUDGET_RULE = "document_budget"
"""Rule id of a document dropped for its size; reserved: no contract rule may take it."""
MAX_RULE_NUMBER = 10**9
"""Largest magnitude of a number in a rule's parameters (a count or a threshold; nothing needs more)."""
MAX_N_GRAM = 64
"""Largest n of a Gopher n-gram table entry: datatrove's work per document grows with n."""
MAX_SCRIPTS = 64
"""Most Unicode script names a kiln.script rule may list."""


@dataclass(frozen=True, slots=True)
class DroppedDocument:
    """One document a rule dropped."""

    row: int
    """Row index in the shard (0-based, every row counted)."""
    rule: str
    """The contract's rule id (``document_rules[i].rule``)."""
    detail: str
    """What exactly failed, e.g. datatrove's reason ``gopher_enough_stop_words`` or ``email``."""
    hard_wrapped_layout: bool = False
    """A hard-wrapped document (``kiln.data.layout.hard_wrapped``) that a rule reading its stored lines
    dropped for a layout-sensitive reason (``kiln.data.layout.LAYOUT_SENSITIVE``): likely the wrapping,
    not the text, failed."""


# -- checking a contract's rules (pure JSON, no datatrove import unless asked) ------------------------


def check_document_rules(rules: Any, *, where: str = "meta.kiln.document_rules", deep: bool = False) -> list[str]:
    """Every problem of a ``document_rules`` list, each naming its field. ``deep`` also checks the
    datatrove kinds' parameter names and types against datatrove's own signatures (imports it)."""
    if not isinstance(rules, list):
        return [f"{where} must be a list of rules"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, rule in enumerate(rules):
        at = f"{where}[{i}]"
        if not isinstance(rule, dict):
            problems.append(f"{at} must be an object with 'rule', 'kind', 'params'")
            continue
        unknown = sorted(set(rule) - RULE_KEYS)
        if unknown:
            problems.append(f"{at} has unknown key(s) {unknown} (allowed: {', '.join(sorted(RULE_KEYS))})")
        rule_id = rule.get("rule")
        if not isinstance(rule_id, str) or not _RULE_ID.fullmatch(rule_id):
            problems.append(f"{at}.rule must be an id like 'gopher_quality' (lowercase, digits, _ . -), got {rule_id!r}")
        elif rule_id == DOCUMENT_BUDGET_RULE:
            problems.append(f"{at}.rule {rule_id!r} is reserved: kiln drops documents over its size budget under it")
        elif rule_id in seen:
            problems.append(f"{at}.rule {rule_id!r} is used twice: rule ids name the reasons in reports")
        else:
            seen.add(rule_id)
        kind = rule.get("kind")
        if kind not in DOCUMENT_RULE_KINDS:
            problems.append(f"{at}.kind must be one of {sorted(DOCUMENT_RULE_KINDS)}, got {kind!r}")
            continue
        for key, choices in (("lines", LINES), ("words", WORDS)):
            if key not in rule:
                continue
            if kind not in DATATROVE_FILTERS:
                problems.append(f"{at}.{key} applies to datatrove kinds only ({kind} does not split lines or words)")
            elif rule[key] not in choices:
                problems.append(f"{at}.{key} must be one of {list(choices)}, got {rule[key]!r}")
        params = rule.get("params", {})
        if not isinstance(params, dict):
            problems.append(f"{at}.params must be an object")
            continue
        if kind == PII_KIND:
            problems.extend(_pii_problems(params, f"{at}.params"))
        elif kind == SCRIPT_KIND:
            problems.extend(_script_problems(params, f"{at}.params"))
        elif kind in CODE_RULE_KINDS:
            problems.extend(code_rule_problems(kind, params, f"{at}.params"))
        elif deep:
            problems.extend(_datatrove_problems(kind, params, f"{at}.params"))
    return problems


def _pii_problems(params: dict[str, Any], at: str) -> list[str]:
    problems = [f"{at}.{k} is not a parameter of kiln.pii (known: {sorted(PII_PARAMS)})"
                for k in sorted(set(params) - set(PII_PARAMS))]
    for key in ("emails", "public_ips"):
        if key in params and not isinstance(params[key], bool):
            problems.append(f"{at}.{key} must be true or false, got {params[key]!r}")
    phone = params.get("phone_pattern")
    if phone is not None:
        if not isinstance(phone, str):
            problems.append(f"{at}.phone_pattern must be a regex string or null, got {phone!r}")
        else:
            problem = pattern_problem(phone, searched=True)
            if problem:
                problems.append(f"{at}.phone_pattern {problem}")
    return problems


def _script_problems(params: dict[str, Any], at: str) -> list[str]:
    problems = [f"{at}.{k} is not a parameter of kiln.script (known: {sorted(SCRIPT_PARAMS)})"
                for k in sorted(set(params) - set(SCRIPT_PARAMS))]
    scripts = params.get("scripts")
    names_ok = isinstance(scripts, list) and all(isinstance(s, str) and re.fullmatch(r"[A-Z][A-Za-z_]*", s) for s in scripts)
    if not names_ok or not scripts or len(scripts) > MAX_SCRIPTS:
        problems.append(f"{at}.scripts must be a list of 1 to {MAX_SCRIPTS} Unicode script names like 'Latin', "
                        f"got {scripts!r}"[:300])
    share = params.get("max_other_letter_share")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        problems.append(f"{at}.max_other_letter_share must be a number in [0, 1], got {share!r}")
    letters = params.get("min_letters", 1)
    if isinstance(letters, bool) or not isinstance(letters, int) or not 0 <= letters <= MAX_RULE_NUMBER:
        problems.append(f"{at}.min_letters must be an int in [0, {MAX_RULE_NUMBER}], got {letters!r}"[:300])
    return problems


def datatrove_parameters(kind: str) -> dict[str, Any]:
    """The constructor parameters a contract may set for a datatrove kind, with datatrove's defaults."""
    cls = _datatrove_class(kind)
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in _NOT_CONTRACT_PARAMS and p.kind is p.POSITIONAL_OR_KEYWORD}


def _datatrove_problems(kind: str, params: dict[str, Any], at: str) -> list[str]:
    allowed = datatrove_parameters(kind)
    problems = []
    for key, value in sorted(params.items()):
        if key not in allowed:
            problems.append(f"{at}.{key} is not a parameter of {kind} (known: {sorted(allowed)})")
            continue
        default = allowed[key]
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif default is None or isinstance(default, (int, float)):
            ok, want = value is None or _bounded_number(value), f"a number or null, at most {MAX_RULE_NUMBER:.0e} in magnitude"
        elif isinstance(default, (tuple, list)):
            ok, want = _n_gram_table(value), (f"a list of at most {MAX_N_GRAM} [n, fraction] pairs, "
                                              f"n an int in [1, {MAX_N_GRAM}], fraction in [0, 1]")
        elif isinstance(default, str):
            ok, want = isinstance(value, str), "a string"
        else:
            ok, want = True, ""
        if not ok:
            problems.append(f"{at}.{key} must be {want} (datatrove's default is {default!r}), got {value!r}")
    return problems


def _bounded_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= MAX_RULE_NUMBER)


def _n_gram_table(value: Any) -> bool:
    """datatrove's n-gram tables (``top_n_grams``, ``dup_n_grams``): [[n, fraction], ...], n bounded."""
    return isinstance(value, list) and len(value) <= MAX_N_GRAM and all(
        isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
        and 1 <= pair[0] <= MAX_N_GRAM and _bounded_number(pair[1]) and 0 <= pair[1] <= 1 for pair in value)


def _datatrove_class(kind: str) -> Any:
    import importlib

    module, name = DATATROVE_FILTERS[kind]
    return getattr(importlib.import_module(module), name)


# -- running them -------------------------------------------------------------------------------------


def _whitespace_words() -> Any:
    """datatrove's regex sentence splitter with words = ``str.split()`` (see the module docstring)."""
    from datatrove.utils.word_tokenizers import WhitespaceTokenizer

    class WhitespaceWords(WhitespaceTokenizer):
        """Gopher's words: whitespace-separated; datatrove's sentences: its terminal-punctuation regex."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

    return WhitespaceWords()


_WORDS: Any = None


def whitespace_words() -> Any:
    """The one word tokenizer instance every filter shares (datatrove caches a document's words by
    (text, tokenizer), so the Gopher and FineWeb rules split a document once)."""
    global _WORDS
    if _WORDS is None:
        _WORDS = _whitespace_words()
    return _WORDS


def _as_datatrove_value(default: Any, value: Any) -> Any:
    if isinstance(default, tuple) and isinstance(value, list):  # JSON has no tuples: n-gram tables are tuples there
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


class _Rule:
    rule: str

    def judge(self, texts: Any, candidates: list[int], columns: Any = None) -> dict[int, str]:  # row -> detail
        raise NotImplementedError


def _datatrove_english_words() -> Any:
    """datatrove's default English tokenizer (spaCy's blank ``en`` with a sentencizer), the very
    instance its filters load by default; ``ContractError`` when spaCy is not installed."""
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    try:
        import spacy  # noqa: F401
    except ImportError:
        raise ContractError("a document rule asks for words 'datatrove' (spaCy's blank English tokenizer), but the "
                            "spacy package is not installed: pip install -c constraints.txt spacy") from None
    return load_word_tokenizer("en")


class _DatatroveRule(_Rule):
    def __init__(self, rule: str, kind: str, params: dict[str, Any], *, lines: str = "stored",
                 words: str = "whitespace") -> None:
        defaults = datatrove_parameters(kind)
        args = {k: _as_datatrove_value(defaults.get(k), v) for k, v in params.items()}
        self.rule = rule
        self.kind = kind
        self.lines = lines
        tokenizer = whitespace_words() if words == "whitespace" else _datatrove_english_words()
        self.filter = _datatrove_class(kind)(**args, language=tokenizer)

    def judge_one(self, row: int, text: str) -> str | None:
        """The detail this rule drops the document with, or None when it keeps it."""
        from datatrove.data import Document

        # A fresh Document per rule: C4's filter rewrites doc.text, and each rule judges the stored text.
        try:
            verdict = self.filter.filter(Document(text=text, id=str(row)))
        except Exception as exc:  # a document the rule cannot judge is not proven good: dropped, named
            return f"rule_error: {type(exc).__name__}"
        if verdict is True:
            return None
        return verdict[1] if isinstance(verdict, tuple) else "dropped"

    def judge(self, texts: Any, candidates: list[int], columns: Any = None) -> dict[int, str]:
        values = texts.take(candidates).to_pylist() if candidates else []
        failed: dict[int, str] = {}
        for row, text in zip(candidates, values, strict=True):
            detail = self.judge_one(row, text)
            if detail is not None:
                failed[row] = detail
        return failed


def _public_ip(candidate: str) -> bool:
    try:
        return ipaddress.ip_address(candidate).is_global
    except ValueError:
        return False


class _PiiRule(_Rule):
    """datatrove's PIIFormatter patterns (e-mail; IPv4 kept only when public), plus the contract's
    phone pattern. A document with any match is dropped (kiln never rewrites text, so it cannot
    anonymise in place as the formatter does). Every pattern runs on RE2 (``kiln.data.re2_patterns``):
    the e-mail pattern is quadratic under Python's ``re``."""

    def __init__(self, rule: str, params: dict[str, Any]) -> None:
        from datatrove.pipeline.formatters.pii import PIIFormatter

        reference = PIIFormatter()
        self.rule = rule
        # (detail, RE2 pattern, validator of each match or None: any match at all drops the document)
        self.checks: list[tuple[str, Any, Any]] = []
        # Each check with an RE2 pattern that every match of its regex contains (None: no such filter):
        # a document without it is not scanned.
        self.needs: list[str | None] = []
        if params.get("emails", True):
            self.checks.append(("email", compiled_search(reference.emails_replacer.regex.pattern), None))
            self.needs.append("@")  # the address pattern's one literal "@" (not inside an alternative)
        if params.get("public_ips", True):
            self.checks.append(("public_ip", compiled_exact(reference.ip_replacer.regex.pattern), _public_ip))
            self.needs.append(r"[0-9]\.[0-9]")  # every octet but the last ends in a digit, then "." and a digit
        if params.get("phone_pattern"):
            self.checks.append(("phone", compiled_search(params["phone_pattern"]), None))
            self.needs.append(None)

    def judge(self, texts: Any, candidates: list[int], columns: Any = None) -> dict[int, str]:
        import pyarrow.compute as pc

        failed: dict[int, str] = {}
        if not candidates or not self.checks:
            return failed
        subset = texts.take(candidates)
        # Every e-mail holds "@", every IP or phone number a digit: one RE2 scan skips the rest.
        maybe = pc.match_substring_regex(subset, r"[@0-9]")
        rows = [row for row, hit in zip(candidates, maybe.to_pylist(), strict=True) if hit]
        if not rows:
            return failed
        subset = subset.filter(maybe)
        needs = [None if need is None else pc.match_substring_regex(subset, need).to_pylist() for need in self.needs]
        values = subset.to_pylist()
        for i, (row, text) in enumerate(zip(rows, values, strict=True)):
            for (name, pattern, valid), need in zip(self.checks, needs, strict=True):
                if need is not None and not need[i]:
                    continue
                hit = pattern.search(text) is not None if valid is None else any(
                    valid(m.group(0)) for m in pattern.finditer(text))
                if hit:
                    failed[row] = name
                    break
        return failed


class _ScriptRule(_Rule):
    """Share of letters (RE2 ``\\pL``) outside the contract's scripts (``\\p{Latin}`` ...), in Arrow."""

    def __init__(self, rule: str, params: dict[str, Any]) -> None:
        self.rule = rule
        # Letters of no allowed script: "not (a non-letter or an allowed letter)", one RE2 class.
        self.foreign = "[^\\PL" + "".join(f"\\p{{{s}}}" for s in params["scripts"]) + "]"
        self.max_share = float(params["max_other_letter_share"])
        self.min_letters = int(params.get("min_letters", 1))
        self.scripts = list(params["scripts"])

    def judge(self, texts: Any, candidates: list[int], columns: Any = None) -> dict[int, str]:
        import pyarrow as pa
        import pyarrow.compute as pc

        if not candidates:
            return {}
        subset = texts.take(candidates)
        try:
            foreign = pc.count_substring_regex(subset, self.foreign)
        except pa.ArrowInvalid as exc:
            raise ContractError(f"rule {self.rule}: scripts {self.scripts} are not all Unicode script names RE2 "
                                f"knows: {exc}") from exc
        # Only documents with a foreign letter can fail: count all their letters (most have none).
        some = pc.greater(foreign, 0)
        rows = [row for row, hit in zip(candidates, some.to_pylist(), strict=True) if hit]
        if not rows:
            return {}
        letters = pc.count_substring_regex(subset.filter(some), r"\pL").to_pylist()
        failed = {}
        for row, n, other in zip(rows, letters, pc.filter(foreign, some).to_pylist(), strict=True):
            if n and n >= self.min_letters and other / n > self.max_share:
                failed[row] = "other_script"
        return failed


@dataclass(frozen=True, slots=True)
class DocumentRuleSet:
    """A contract's document rules, built once per process and contract."""

    rules: tuple[_Rule | CodeRule, ...]

    @property
    def rule_ids(self) -> tuple[str, ...]:
        return tuple(r.rule for r in self.rules)

    @property
    def columns(self) -> frozenset[str]:
        """Columns besides ``text`` that some rule reads (the extension rule's path column)."""
        return frozenset(r.column for r in self.rules if isinstance(r, CodeRule) and r.column)

    def judge(self, texts: Any, columns: Any = None) -> list[DroppedDocument]:
        """The dropped documents of one shard's text column (an Arrow string array; nulls are left to
        the not-null rule), each with the first rule it failed, in row order. ``columns``: name ->
        Arrow array of the shard's other columns that ``self.columns`` names (a rule whose column is
        not given keeps every document)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
        valid = pc.is_valid(texts).to_pylist()
        too_long = set(pc.indices_nonzero(pc.fill_null(pc.greater(pc.utf8_length(texts), MAX_DOCUMENT_CHARS), False))
                       .to_pylist()) if self.rules else set()
        # A document over the budget is dropped before any rule sees it: no rule's time depends on it.
        dropped = [DroppedDocument(row, DOCUMENT_BUDGET_RULE, f"over_{MAX_DOCUMENT_CHARS}_chars") for row in sorted(too_long)]
        remaining = [i for i, ok in enumerate(valid) if ok and i not in too_long]
        for per_document, group in groupby(self.rules, key=lambda rule: isinstance(rule, _DatatroveRule)):
            # A run of datatrove rules is applied document by document (see _document_by_document); any
            # other rule judges the shard's remaining documents at once, in Arrow.
            for step in [list(group)] if per_document else [[rule] for rule in group]:
                failed = (_document_by_document(step, texts, remaining) if per_document
                          else {row: (step[0].rule, detail, False)
                                for row, detail in step[0].judge(texts, remaining, columns).items()})
                dropped.extend(DroppedDocument(row, rule_id, detail, layout)
                               for row, (rule_id, detail, layout) in failed.items())
                remaining = [i for i in remaining if i not in failed]
        return sorted(dropped, key=lambda d: d.row)


def _document_by_document(run: Sequence[Any], texts: Any, rows: list[int]) -> dict[int, tuple[str, str, bool]]:
    """Row -> (rule id, detail, hard-wrapped layout drop) of the first rule of ``run``
    (``_DatatroveRule``s) each document fails. Each text is converted once (and unwrapped at most once)
    and every rule with the same ``lines`` sees the same string, so datatrove's word cache (keyed by
    text and tokenizer) splits it once; the verdicts are those of the rules applied one after the other."""
    from kiln.data.layout import hard_wrapped, layout_sensitive, unwrap

    failed: dict[int, tuple[str, str, bool]] = {}
    values = texts.take(rows).to_pylist() if rows else []
    for row, text in zip(rows, values, strict=True):
        unwrapped: str | None = None
        for rule in run:
            if rule.lines == "unwrapped":
                unwrapped = unwrap(text) if unwrapped is None else unwrapped
                detail = rule.judge_one(row, unwrapped)
            else:
                detail = rule.judge_one(row, text)
            if detail is not None:
                layout = rule.lines == "stored" and layout_sensitive(rule.kind, detail) and hard_wrapped(text)
                failed[row] = (rule.rule, detail, layout)
                break
    return failed


_CACHE: dict[str, DocumentRuleSet] = {}


def build_rule_set(rules: Sequence[dict[str, Any]], cache_key: str | None = None) -> DocumentRuleSet:
    """The runnable rules of a contract's ``document_rules`` (checked deep first: a bad parameter is a
    ``ContractError`` naming its field, never a crash on the first document)."""
    if cache_key is not None and cache_key in _CACHE:
        return _CACHE[cache_key]
    problems = check_document_rules(list(rules), deep=True)
    if problems:
        raise ContractError("bad document rules: " + "; ".join(problems))
    built: list[_Rule | CodeRule] = []
    for spec in rules:
        params = dict(spec.get("params", {}))
        if spec["kind"] in CODE_RULE_KINDS:
            built.append(CodeRule(spec["rule"], spec["kind"], params))
        elif spec["kind"] == PII_KIND:
            built.append(_PiiRule(spec["rule"], params))
        elif spec["kind"] == SCRIPT_KIND:
            built.append(_ScriptRule(spec["rule"], params))
        else:
            try:
                built.append(_DatatroveRule(spec["rule"], spec["kind"], params, lines=spec.get("lines", "stored"),
                                            words=spec.get("words", "whitespace")))
            except (TypeError, ValueError) as exc:
                raise ContractError(f"document rule {spec['rule']} ({spec['kind']}): {exc}") from exc
    rule_set = DocumentRuleSet(rules=tuple(built))
    if cache_key is not None:
        _CACHE[cache_key] = rule_set
    return rule_set

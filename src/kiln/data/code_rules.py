"""Document rules for source code: the published filters of code pretraining sets, run by kiln.

Kinds (``CODE_RULE_KINDS``), each a document rule of ``kiln.data.doc_rules`` (a failing document is
dropped, counted by rule and detail, up to the contract's ``max_dropped_share``):

    kiln.extension        the document's file extension must be one of its languages' (``source`` or
                          ``doc_id`` column: the path; a trailing ``#N`` chunk index is ignored)
    kiln.code_lines       longest line, mean line length, share of alphanumeric characters
                          (Codex, Chen et al. 2021, section 3.1; The Stack's and StarCoder's "basic"
                          filter, bigcode-dataset ``preprocessing/filtering.py``: 1000 / 100 / 0.25)
    kiln.generated        a generated-file marker (``auto-generated``, ``do not edit``, ``@generated`` ...)
                          in the first lines (StarCoder 2 and The Stack v2 drop generated files with
                          go-enry's ``IsGenerated``; kiln checks the header markers only)
    kiln.license_header   a licence the corpus may not hold, named in the first lines (a copyleft
                          header in a permissive-only corpus; The Stack selects by repository licence)
    kiln.secrets          a credential pattern anywhere (StarCoder redacts secrets; kiln never rewrites
                          a document, so it drops it; samples are redacted with the same patterns)

Every pattern runs on RE2 (``kiln.data.re2_patterns``), markers are literal strings matched without
case. None needs a download or a model.

Where kiln departs from the published rules, the contract's ``source`` field says so; the main one:
a kiln document may be a **chunk** of a file (``kiln corpus build`` cuts files at 4 KiB), so line
statistics are per chunk and header markers are found only in a file's first chunk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kiln.data.re2_patterns import compiled_search, pattern_problem

EXTENSION_KIND = "kiln.extension"
CODE_LINES_KIND = "kiln.code_lines"
GENERATED_KIND = "kiln.generated"
LICENSE_KIND = "kiln.license_header"
SECRETS_KIND = "kiln.secrets"
CODE_RULE_KINDS = frozenset({EXTENSION_KIND, CODE_LINES_KIND, GENERATED_KIND, LICENSE_KIND, SECRETS_KIND})

PARAMS: dict[str, dict[str, str]] = {
    EXTENSION_KIND: {"languages": "object: language -> list of extensions like '.py'", "column": "'source' or 'doc_id'"},
    CODE_LINES_KIND: {"max_line_length": "int >= 1", "max_mean_line_length": "number > 0",
                      "min_alphanum_fraction": "number in [0, 1]"},
    GENERATED_KIND: {"markers": "list of strings", "head_lines": "int >= 1"},
    LICENSE_KIND: {"deny": "list of strings", "head_lines": "int >= 1"},
    SECRETS_KIND: {"patterns": "list of regexes"},
}
REQUIRED: dict[str, frozenset[str]] = {
    EXTENSION_KIND: frozenset({"languages"}), CODE_LINES_KIND: frozenset(), GENERATED_KIND: frozenset({"markers"}),
    LICENSE_KIND: frozenset({"deny"}), SECRETS_KIND: frozenset({"patterns"}),
}
MAX_ENTRIES = 256
"""Most languages, extensions per language, markers or patterns a code rule may list."""
MAX_MARKER_CHARS = 200
MAX_HEAD_LINES = 1000
_EXTENSION = re.compile(r"^\.[A-Za-z0-9_+-]{1,16}$")
_CHUNK_SUFFIX = re.compile(r"#\d+$")


def _strings(value: Any, *, limit: int = MAX_ENTRIES, chars: int = MAX_MARKER_CHARS) -> bool:
    return (isinstance(value, list) and 0 < len(value) <= limit
            and all(isinstance(v, str) and 0 < len(v) <= chars for v in value))


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number_in(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def code_rule_problems(kind: str, params: Mapping[str, Any], at: str) -> list[str]:
    """Every problem of a code rule's ``params``, each naming its field."""
    problems = [f"{at}.{k} is not a parameter of {kind} (known: {sorted(PARAMS[kind])})"
                for k in sorted(set(params) - set(PARAMS[kind]))]
    problems += [f"{at}.{k} is required ({PARAMS[kind][k]})" for k in sorted(REQUIRED[kind] - set(params))]
    for key, value in params.items():
        if key not in PARAMS[kind]:
            continue
        ok = True
        if key == "languages":
            ok = (isinstance(value, dict) and 0 < len(value) <= MAX_ENTRIES and all(
                isinstance(lang, str) and _strings(exts) and all(_EXTENSION.fullmatch(e) for e in exts)
                for lang, exts in value.items()))
        elif key == "column":
            ok = value in ("source", "doc_id")
        elif key == "max_line_length":
            ok = _int_in(value, 1, 10**9)
        elif key == "max_mean_line_length":
            ok = _number_in(value, 1e-9, 1e9)
        elif key == "min_alphanum_fraction":
            ok = _number_in(value, 0, 1)
        elif key in ("markers", "deny"):
            ok = _strings(value)
        elif key == "head_lines":
            ok = _int_in(value, 1, MAX_HEAD_LINES)
        elif key == "patterns":
            ok = _strings(value, chars=10_000)
            if ok:
                problems += [f"{at}.patterns[{i}] {p}" for i, pattern in enumerate(value)
                             if (p := pattern_problem(pattern, searched=True))]
        if not ok:
            problems.append(f"{at}.{key} must be {PARAMS[kind][key]}, got {value!r}"[:300])
    return problems


def rule_column(kind: str, params: Mapping[str, Any]) -> str | None:
    """The column besides ``text`` a code rule reads (the extension rule's path), or None."""
    return str(params.get("column", "source")) if kind == EXTENSION_KIND else None


class CodeRule:
    """One code rule of a contract (built by ``kiln.data.doc_rules.build_rule_set``)."""

    def __init__(self, rule: str, kind: str, params: Mapping[str, Any]) -> None:
        self.rule, self.kind = rule, kind
        self.column = rule_column(kind, params)
        if kind == EXTENSION_KIND:
            self.extensions = {ext.lower() for exts in params["languages"].values() for ext in exts}
        elif kind == CODE_LINES_KIND:
            self.max_line = int(params.get("max_line_length", 1000))
            self.max_mean = float(params.get("max_mean_line_length", 100))
            self.min_alnum = float(params.get("min_alphanum_fraction", 0.25))
        elif kind in (GENERATED_KIND, LICENSE_KIND):
            self.head_lines = int(params.get("head_lines", 5 if kind == GENERATED_KIND else 30))
            self.markers = [m.lower() for m in params["markers" if kind == GENERATED_KIND else "deny"]]
        else:
            self.patterns = [compiled_search(p) for p in params["patterns"]]

    def judge(self, texts: Any, candidates: list[int], columns: Mapping[str, Any] | None = None) -> dict[int, str]:
        """Row -> detail of the candidates this rule drops."""
        if not candidates:
            return {}
        if self.kind == EXTENSION_KIND:
            column = columns.get(self.column) if columns is not None and self.column else None
            if column is None:
                return {}  # the shard lacks the column: the contract's required-columns rule has said so
            paths = column.take(candidates).to_pylist()
            return {row: "extension_not_allowed" for row, path in zip(candidates, paths, strict=True)
                    if path is None or self._extension(path) not in self.extensions}
        failed: dict[int, str] = {}
        for row, text in zip(candidates, texts.take(candidates).to_pylist(), strict=True):
            detail = self.judge_one(text)
            if detail is not None:
                failed[row] = detail
        return failed

    @staticmethod
    def _extension(path: str) -> str:
        name = _CHUNK_SUFFIX.sub("", path).rsplit("/", 1)[-1]
        return "." + name.rsplit(".", 1)[1].lower() if "." in name.lstrip(".") else ""

    def judge_one(self, text: str) -> str | None:
        if self.kind == CODE_LINES_KIND:
            lengths = [len(line) for line in text.splitlines()] or [0]
            if max(lengths) > self.max_line:
                return "max_line_length"
            if sum(lengths) / len(lengths) > self.max_mean:
                return "mean_line_length"
            if text and sum(map(str.isalnum, text)) / len(text) < self.min_alnum:
                return "alphanum_fraction"
            return None
        if self.kind in (GENERATED_KIND, LICENSE_KIND):
            head = "\n".join(text.split("\n", self.head_lines)[: self.head_lines]).lower()
            if any(marker in head for marker in self.markers):
                return "generated" if self.kind == GENERATED_KIND else "license_denied"
            return None
        if any(p.search(text) is not None for p in self.patterns):
            return "secret"
        return None

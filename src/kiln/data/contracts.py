"""Data contracts: versioned Great Expectations suites under ``data_contracts/<name>/v<N>.json``.

The suite JSON *is* the contract. Rules that need a value GE cannot compute per row cheaply
(share of control characters, membership in the eval split) are GE expectations on derived
columns; the suite's ``meta.kiln.derived_columns`` says how kiln computes each one before
validation, so nothing about the contract lives only in code. Rules over a whole snapshot
(``meta.kiln.snapshot_rules``: doc ids unique across shards) are checked by
``kiln.data.validation.cross_shard_duplicates``. Document-level rules (``meta.kiln.document_rules``,
``kiln.data.doc_rules``) and near-duplicate removal (``meta.kiln.near_duplicates``,
``kiln.data.near_duplicates``) drop documents instead of quarantining the shard, up to
``meta.kiln.max_dropped_share`` of its documents.

Loading is pure JSON (no great_expectations import); GE itself parses the suite on first use in
``kiln.data.validation.suite`` and any error it finds there is also a ``ContractError``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import ContractError
from kiln.refs import canonical_json
from kiln.shipped import CONTRACTS_DIR
from kiln.util.fs import parse_json, read_bounded

# CONTRACTS_DIR (kiln.shipped) is the default home of the contracts; ``KILN_CONTRACTS_DIR`` overrides it.

DERIVED_COLUMN_KINDS = frozenset({"char_share", "in_eval_split"})
"""Derived-column kinds this kiln can compute (see ``kiln.data.validation.frames``)."""
SNAPSHOT_RULES = frozenset({"doc_id_unique_across_shards"})
REGEX_EXPECTATIONS = frozenset({"expect_column_values_to_match_regex", "expect_column_values_to_not_match_regex",
                                "expect_column_values_to_match_regex_list", "expect_column_values_to_not_match_regex_list"})
"""GE expectations whose patterns kiln hands to GE translated for RE2 (``kiln.data.re2_patterns``)."""
DOCUMENT_RULES_COLUMN = "text"
"""The column document rules judge (``kiln.data.validation.dropped.judge_documents``)."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_VERSION_FILE = re.compile(r"^v([1-9][0-9]*)\.json$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    """One loaded contract version."""

    name: str
    """Corpus / contract name, the folder under ``data_contracts/``."""
    version: int
    suite: dict[str, Any]
    """The GE expectation suite exactly as stored (``name``, ``expectations``, ``meta``, ...)."""
    settings: dict[str, Any]
    """``suite["meta"]["kiln"]``: derived columns, snapshot-level rules."""
    path: Path

    @property
    def ref(self) -> str:
        """``name@version``, as recorded in every ShardReport and TrainingManifest."""
        return f"{self.name}@{self.version}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.suite)).hexdigest()

    @property
    def expectations(self) -> list[dict[str, Any]]:
        return list(self.suite["expectations"])

    @property
    def derived_columns(self) -> dict[str, dict[str, Any]]:
        return dict(self.settings.get("derived_columns", {}))

    @property
    def snapshot_rules(self) -> list[dict[str, Any]]:
        return list(self.settings.get("snapshot_rules", []))

    @property
    def document_rules(self) -> list[dict[str, Any]]:
        """``meta.kiln.document_rules``: ordered document-level rules (``kiln.data.doc_rules``); a
        document failing one is dropped, not the shard quarantined."""
        return list(self.settings.get("document_rules", []))

    @property
    def near_duplicates(self) -> dict[str, Any] | None:
        """``meta.kiln.near_duplicates``: MinHash LSH settings (``kiln.data.near_duplicates``), or None."""
        raw = self.settings.get("near_duplicates")
        return dict(raw) if isinstance(raw, dict) else None

    @property
    def max_dropped_share(self) -> float:
        """Share of a shard's documents that may be dropped (document rules + near-duplicates) before the
        shard is quarantined; 1.0 when the contract drops nothing."""
        return float(self.settings.get("max_dropped_share", 1.0))

    @property
    def drops_documents(self) -> bool:
        return bool(self.document_rules) or self.near_duplicates is not None

    @property
    def secret_patterns(self) -> tuple[str, ...]:
        """Regexes of every ``expect_column_values_to_not_match_regex_list`` and of every ``kiln.secrets``
        document rule: also used to redact samples."""
        patterns: list[str] = []
        for exp in self.suite["expectations"]:
            if exp["type"] == "expect_column_values_to_not_match_regex_list":
                patterns.extend(exp["kwargs"].get("regex_list", []))
        for rule in self.document_rules:
            if rule.get("kind") == "kiln.secrets":
                patterns.extend(p for p in (rule.get("params") or {}).get("patterns", []) if p not in patterns)
        return tuple(patterns)


def required_columns(expectations: Any) -> frozenset[str]:
    """The columns a shard must have to pass the contract's schema rules (a shard without one is quarantined)."""
    found: set[str] = set()
    for exp in expectations if isinstance(expectations, list) else []:
        if not isinstance(exp, dict) or not isinstance(exp.get("kwargs"), dict):
            continue
        kwargs = exp["kwargs"]
        if exp.get("type") == "expect_table_columns_to_match_set":
            found.update(c for c in kwargs.get("column_set") or [] if isinstance(c, str))
        elif exp.get("type") == "expect_table_columns_to_match_ordered_list":
            found.update(c for c in kwargs.get("column_list") or [] if isinstance(c, str))
        elif exp.get("type") == "expect_column_to_exist" and isinstance(kwargs.get("column"), str):
            found.add(kwargs["column"])
    return frozenset(found)


def _columns_named(kwargs: dict[str, Any]) -> list[str]:
    """The columns an expectation's kwargs name (what validation needs present to run it)."""
    names = [kwargs[k] for k in ("column", "column_A", "column_B") if isinstance(kwargs.get(k), str)]
    if isinstance(kwargs.get("column_list"), list):
        names.extend(c for c in kwargs["column_list"] if isinstance(c, str))
    return names


def _regex_problems(kwargs: dict[str, Any], at: str) -> list[str]:
    from kiln.data.re2_patterns import pattern_problem

    problems = []
    if "regex" in kwargs:
        problem = pattern_problem(kwargs["regex"], searched=True)
        if problem:
            problems.append(f"{at}.regex {problem}")
    if "regex_list" in kwargs:
        patterns = kwargs["regex_list"]
        if not isinstance(patterns, list):
            return [*problems, f"{at}.regex_list must be a list of patterns"]
        for j, pattern in enumerate(patterns):
            problem = pattern_problem(pattern, searched=True)
            if problem:
                problems.append(f"{at}.regex_list[{j}] {problem}")
    return problems


def _char_share_problem(pattern: Any) -> str | None:
    from kiln.data.re2_patterns import pattern_problem

    problem = pattern_problem(pattern, searched=False)
    if problem is None and re.fullmatch(pattern, "") is not None:
        problem = "matches the empty string: a share of characters counts characters"
    return problem


def contracts_dir() -> Path:
    return Path(os.environ.get("KILN_CONTRACTS_DIR", CONTRACTS_DIR))


def parse_contract_ref(spec: str) -> tuple[str, int | None]:
    """``"stdlib-py@1"`` → ``("stdlib-py", 1)``; ``"stdlib-py"`` → ``("stdlib-py", None)`` (latest)."""
    name, sep, version = spec.strip().partition("@")
    if not _NAME.fullmatch(name):
        raise ContractError(f"bad contract name {name!r} in {spec!r}: expected NAME[@VERSION], e.g. stdlib-py@1")
    if not sep:
        return name, None
    digits = version[1:] if version.startswith("v") else version
    if not digits.isdigit() or int(digits) < 1:
        raise ContractError(f"bad contract version {version!r} in {spec!r}: expected a positive integer")
    return name, int(digits)


def available_versions(name: str, root: Path | None = None) -> list[int]:
    folder = (root or contracts_dir()) / name
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _VERSION_FILE.fullmatch(p.name)))


def available_contracts(root: Path | None = None) -> list[str]:
    base = root or contracts_dir()
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and available_versions(p.name, base))


def load_contract(spec: str, contracts_root: Path | None = None) -> Contract:
    """Load ``NAME[@VERSION]`` (no version: the latest). Every problem is a ``ContractError``."""
    root = Path(contracts_root) if contracts_root is not None else contracts_dir()
    name, version = parse_contract_ref(spec)
    versions = available_versions(name, root)
    if not versions:
        known = ", ".join(available_contracts(root)) or "none"
        raise ContractError(f"unknown contract {name!r} under {root} (known: {known})")
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise ContractError(
            f"contract {name!r} has no version {version} (known: {', '.join(str(v) for v in versions)})"
        )
    path = root / name / f"v{version}.json"
    suite = read_contract_json(path)
    _check_suite(suite, name, version, path)
    return Contract(name=name, version=version, suite=suite, settings=suite["meta"]["kiln"], path=path)


MAX_CONTRACT_BYTES = 16 << 20
"""A contract is a suite of expectations and rule settings: kilobytes; a larger file is not one."""


def read_contract_json(path: Path) -> Any:
    """The JSON of the contract file ``path`` through the bounded reader: a regular file of at most
    ``MAX_CONTRACT_BYTES``, nested and numbered within bounds; ``ContractError`` naming what is wrong."""
    raw = read_bounded(path, "contract", ContractError, max_bytes=MAX_CONTRACT_BYTES)
    try:
        return parse_json(raw, "", ContractError)
    except ContractError as exc:
        detail = str(exc).removeprefix(": ").removeprefix("not JSON: ")
        raise ContractError(f"contract {path} is not valid JSON: {detail}") from None


def _check_suite(suite: Any, name: str, version: int, path: Path) -> None:
    """Structural checks GE would report late or obscurely; GE parses the details on first use."""
    problems = contract_problems(suite, name=name, version=version)
    if problems:
        raise ContractError(f"malformed contract {path}: " + "; ".join(problems))


def contract_problems(suite: Any, *, name: str | None = None, version: int | None = None) -> list[str]:
    """Every structural problem of a contract suite, each naming its field (``kiln contract check``
    lists them all; ``load_contract`` refuses a contract with any). ``name`` / ``version``: what the
    file's place says they must be (unchecked when None). Pure JSON: no GE, no datatrove import."""
    from kiln.data.code_rules import rule_column
    from kiln.data.doc_rules import check_document_rules
    from kiln.data.near_duplicates import check_near_duplicate_settings

    if not isinstance(suite, dict):
        return ["top level must be a JSON object (a GE expectation suite)"]
    problems: list[str] = []
    if not isinstance(suite.get("name"), str) or not _NAME.fullmatch(suite["name"]):
        problems.append(f"name must be a contract name (lowercase letters, digits, . _ -), got {suite.get('name')!r}")
    elif name is not None and suite["name"] != name:
        problems.append(f"suite name {suite.get('name')!r} does not match the contract name {name!r}")
    expectations = suite.get("expectations")
    if not isinstance(expectations, list) or not expectations:
        problems.append("'expectations' must be a non-empty list")
        expectations = []
    for i, exp in enumerate(expectations):
        if not isinstance(exp, dict) or not str(exp.get("type", "")).startswith("expect_"):
            problems.append(f"expectations[{i}] needs a 'type' starting with 'expect_'")
            continue
        if not isinstance(exp.get("kwargs"), dict):
            problems.append(f"expectations[{i}] ({exp['type']}) needs a 'kwargs' object")
            continue
        if exp["type"] in REGEX_EXPECTATIONS:
            problems.extend(_regex_problems(exp["kwargs"], f"expectations[{i}].kwargs"))
    kiln = suite.get("meta", {}).get("kiln") if isinstance(suite.get("meta"), dict) else None
    if not isinstance(kiln, dict):
        problems.append("'meta.kiln' (kiln settings: version, derived columns, snapshot rules) is missing")
        return problems
    if version is not None and kiln.get("version") != version:
        problems.append(f"meta.kiln.version {kiln.get('version')!r} does not match the file version {version}")
    elif isinstance(kiln.get("version"), bool) or not isinstance(kiln.get("version"), int) or kiln["version"] < 1:
        problems.append(f"meta.kiln.version must be a positive integer, got {kiln.get('version')!r}")
    derived = kiln.get("derived_columns", {})
    if not isinstance(derived, dict):
        problems.append("meta.kiln.derived_columns must be an object")
        derived = {}
    required = required_columns(expectations)
    for column, spec in derived.items():
        at = f"meta.kiln.derived_columns.{column}"
        if not isinstance(spec, dict) or spec.get("kind") not in DERIVED_COLUMN_KINDS:
            problems.append(f"{at}: kind must be one of {sorted(DERIVED_COLUMN_KINDS)}")
            continue
        if not isinstance(spec.get("column"), str):
            problems.append(f"{at} needs the source 'column'")
        elif spec["column"] not in required:
            # Validation computes a derived column only from a column the shard has: from one the contract
            # does not require, every rule on it would be silently off.
            problems.append(f"{at}.column {spec['column']!r} is not a column the contract requires "
                            f"(required: {sorted(required)}): the rules on {column!r} would never run")
        if spec["kind"] == "char_share":
            problem = _char_share_problem(spec.get("pattern"))
            if problem:
                problems.append(f"{at}.pattern {problem}")
    for i, exp in enumerate(expectations):
        if isinstance(exp, dict) and isinstance(exp.get("kwargs"), dict):
            for name in _columns_named(exp["kwargs"]):
                if name not in required and name not in derived:
                    problems.append(f"expectations[{i}] ({exp.get('type')}) checks column {name!r}, which the contract "
                                    f"neither requires nor derives (required: {sorted(required)}): it would never run")
    rules = kiln.get("snapshot_rules", [])
    for i, rule in enumerate(rules if isinstance(rules, list) else [rules]):
        if not isinstance(rule, dict) or rule.get("rule") not in SNAPSHOT_RULES:
            problems.append(f"meta.kiln.snapshot_rules[{i}]: snapshot rule {rule!r}: 'rule' must be one of "
                            f"{sorted(SNAPSHOT_RULES)}")
    if "document_rules" in kiln:
        problems.extend(check_document_rules(kiln["document_rules"]))
        if kiln["document_rules"] and DOCUMENT_RULES_COLUMN not in required:
            problems.append(f"meta.kiln.document_rules judge the {DOCUMENT_RULES_COLUMN!r} column, which the contract does "
                            f"not require (required: {sorted(required)}): the rules would never run")
        for i, rule in enumerate(kiln["document_rules"] if isinstance(kiln["document_rules"], list) else []):
            column = (rule_column(rule.get("kind", ""), rule.get("params") or {})
                      if isinstance(rule, dict) and isinstance(rule.get("params", {}), dict) else None)
            if column is not None and column not in required:
                problems.append(f"meta.kiln.document_rules[{i}] reads the {column!r} column, which the contract does not "
                                f"require (required: {sorted(required)}): the rule would never run")
    if "near_duplicates" in kiln:
        problems.extend(check_near_duplicate_settings(kiln["near_duplicates"]))
        near = kiln["near_duplicates"]
        if isinstance(near, dict) and near.get("column", "text") not in required:
            problems.append(f"meta.kiln.near_duplicates.column {near.get('column', 'text')!r} is not a column the contract "
                            f"requires (required: {sorted(required)}): near-duplicates would never be looked for")
    share = kiln.get("max_dropped_share")
    if "max_dropped_share" in kiln and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
        problems.append(f"meta.kiln.max_dropped_share must be a number in [0, 1], got {share!r}")
    if ("document_rules" in kiln or "near_duplicates" in kiln) and "max_dropped_share" not in kiln:
        problems.append("meta.kiln.max_dropped_share is missing: a contract that drops documents must say above which "
                        "share of a shard's documents the shard is quarantined")
    return problems

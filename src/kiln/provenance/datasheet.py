"""A registered model's datasheet, generated from its signed provenance statement: where the training
data came from, how it was cleaned, how the model was trained and evaluated, and who approved it (in
the spirit of the EU AI Act's Annex IV 2(d), "datasheets describing the training methodologies and
techniques and the training data sets used ... their provenance, scope and main characteristics; how
the data was obtained and selected; ... data cleaning methodologies").

    build_datasheet(statement, sources) -> Datasheet    pure: every fact with the source it was read from
    datasheet_markdown(sheet), datasheet_html(sheet)     its two renderings (every value escaped)

The statement is the source of truth. It records the quarantine report and the contract suite by
sha256 only, so the cleaning section reads them from ``DatasheetSources`` and uses each only when
its bytes have the digest the statement signed; a document that differs is named as differing and
not shown. What the statement does not bind (the corpus' own ``corpus.json``, which names the import
source; the version's approval tags, made after registration) is shown with its source named as not
signed. The datasheet itself is derived and never signed: ``kiln verify`` checks the statement it was
made from, and ``kiln datasheet`` makes it again from a verified statement (docs/provenance.md).
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ProvenanceError
from kiln_trainer.contract import canonical_json

DATASHEET_DIR = "datasheet"
"""Where registration logs the datasheet in the version's MLflow run."""
DATASHEET_MARKDOWN = "datasheet.md"
DATASHEET_HTML = "datasheet.html"
SOURCES_DIR = "sources"
"""``datasheet/sources/``: the documents the logged datasheet read beside the statement."""

# Where a fact was read from (the datasheet's "from" column), and what binds it to the statement.
FROM_STATEMENT = "statement"
FROM_REPORT = "quarantine report"
FROM_CONTRACT = "contract suite"
FROM_CORPUS = "corpus.json"
FROM_TAGS = "version tags"
FROM_APPROVAL = "approval attestation"
FROM_DERIVED = "derived"
SOURCE_LEGEND = {
    FROM_STATEMENT: "the signed provenance statement (in-toto v1, SLSA Provenance v1)",
    FROM_REPORT: "the data gate's quarantine report, used only when its sha256 is the one the statement signed",
    FROM_CONTRACT: "the data contract's expectation suite, used only when its sha256 is the one the statement signed",
    FROM_CORPUS: "the corpus' own record (corpus.json) in kiln's copy of the snapshot: not in the statement",
    FROM_TAGS: "the model version's tags, written after registration: not signed",
    FROM_APPROVAL: "the approval attestation promotion signed with the policy's key, naming this statement by its sha256",
    FROM_DERIVED: "computed here from signed values (the formula is given)",
}
EVAL_CONTAMINATION_RULE = "no_eval_contamination"
"""The contracts' rule id (``meta.kiln_rule``) of the exact-copy check against the eval split."""
NEAR_DUPLICATE_RULE = "near_duplicate"
EVAL_SPLIT_DETAIL = "eval_split"
"""A near-duplicate whose kept copy is an eval document (``kiln.data.validation.dropped``)."""
APPROVAL_TAG_PREFIXES = ("kiln.promotion.", "kiln.review.")
"""The version tags that record a review and an approval (``kiln.registry.tags``), with ``kiln.review``
itself (the outcome)."""


# ------------------------------------------------------------------------------ what goes in


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasheetSources:
    """What the datasheet reads beside the statement. Each is optional; a missing one is said so."""

    model_version: str = ""
    """``MODEL/VERSION`` when known (registration knows the run, not yet the version number)."""
    quarantine_report: bytes | None = None
    """The quarantine report's bytes, as hashed into the statement."""
    contract_suite: Mapping[str, Any] | None = None
    """The contract's GE expectation suite (``Contract.suite``), whose canonical JSON the statement hashes."""
    corpus_metadata: bytes | None = None
    """The corpus' ``corpus.json`` from the snapshot copy the run read."""
    approval_tags: Mapping[str, str] = field(default_factory=dict)
    """The version's review and approval tags (``APPROVAL_TAG_PREFIXES``)."""
    approval: Mapping[str, Any] | None = None
    """The predicate of a verified approval attestation of this statement (``kiln.provenance.approval``)."""
    approval_problem: str = ""
    """Why an approval attestation the version names was not used (it does not verify, or is not at hand)."""


@dataclass(frozen=True, slots=True)
class Fact:
    label: str
    value: str
    source: str
    code: bool = False
    """An identifier, digest or path: shown as code."""


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    source: str


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    facts: tuple[Fact, ...] = ()
    tables: tuple[Table, ...] = ()
    notes: tuple[str, ...] = ()
    block: tuple[str, str] | None = None
    """``(title, text)`` shown verbatim (the resolved recipe)."""


@dataclass(frozen=True, slots=True)
class Datasheet:
    title: str
    intro: tuple[Fact, ...]
    sections: tuple[Section, ...]


# ------------------------------------------------------------------------------ reading the statement


@dataclass(frozen=True, slots=True)
class _Statement:
    """The parts of a kiln statement the datasheet reads, with its shape checked once."""

    sha256: str
    subjects: int
    external: Mapping[str, Any]
    internal: Mapping[str, Any]
    deps: dict[str, Mapping[str, Any]]
    """By kind (``snapshot``, ``contract``, ``quarantine-report``, ...: the name before ``:``)."""
    dep_names: dict[str, str]
    builder: Mapping[str, Any]
    metadata: Mapping[str, Any]
    byproducts: dict[str, Mapping[str, Any]]
    sources: tuple[Mapping[str, Any], ...] = ()
    """A mixture's ``source:<name>`` dependencies, in declared order (none for one corpus)."""


def _read(statement: Mapping[str, Any]) -> _Statement:
    try:
        predicate = statement["predicate"]
        build, run = predicate["buildDefinition"], predicate["runDetails"]
        deps = {str(d["name"]).split(":", 1)[0]: d for d in build["resolvedDependencies"]}
        return _Statement(
            sha256=hashlib.sha256(canonical_json(statement)).hexdigest(), subjects=len(statement["subject"]),
            external=build["externalParameters"], internal=build["internalParameters"], deps=deps,
            dep_names={kind: str(d["name"]) for kind, d in deps.items()}, builder=run["builder"],
            metadata=run["metadata"], byproducts={str(b["name"]): b for b in run.get("byproducts", [])},
            sources=tuple(d for d in build["resolvedDependencies"] if str(d["name"]).startswith("source:")))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ProvenanceError(f"provenance statement: not kiln's shape, no datasheet can be made ({exc!r})") from exc


def _digest(dep: Mapping[str, Any] | None, algorithm: str = "sha256") -> str:
    return str(((dep or {}).get("digest") or {}).get(algorithm, ""))


def _annotation(dep: Mapping[str, Any] | None, key: str) -> Any:
    return ((dep or {}).get("annotations") or {}).get(key)


def _content(byproduct: Mapping[str, Any] | None) -> Mapping[str, Any]:
    content = _annotation(byproduct, "content")
    return content if isinstance(content, Mapping) else {}


def _text(value: Any) -> str:
    if value is None or value == "":
        return "not recorded"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _get(mapping: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


# ------------------------------------------------------------------------------ the sources, checked


@dataclass(frozen=True, slots=True)
class _Checked:
    report: Mapping[str, Any] | None
    suite: Mapping[str, Any] | None
    corpus: Mapping[str, Any] | None
    corpus_sha256: str
    problems: tuple[str, ...]


def _check_sources(st: _Statement, sources: DatasheetSources) -> _Checked:
    """The sources bound to the statement by digest, parsed; a differing or unreadable one is a problem
    (named in the datasheet), never a fault: the datasheet still says what the statement says."""
    from kiln.util.fs import parse_json

    problems: list[str] = []
    report = None
    signed_report = _digest(st.deps.get("quarantine-report"))
    if sources.quarantine_report is not None and signed_report:
        got = hashlib.sha256(sources.quarantine_report).hexdigest()
        if got != signed_report:
            problems.append(f"the quarantine report at hand has sha256 {got}, the statement signed {signed_report}: "
                            "it is not shown")
        else:
            try:
                parsed = parse_json(sources.quarantine_report, "the quarantine report", ProvenanceError)
                report = parsed if isinstance(parsed, Mapping) else None
            except ProvenanceError as exc:
                problems.append(str(exc))
    elif signed_report:
        problems.append("the quarantine report the statement names was not at hand: the cleaning figures it holds "
                        "are not shown")
    suite = None
    signed_suite = _digest(st.deps.get("contract"))
    if sources.contract_suite is not None and signed_suite:
        got = hashlib.sha256(canonical_json(sources.contract_suite)).hexdigest()
        if got != signed_suite:
            problems.append(f"the installed contract {st.dep_names.get('contract', '').removeprefix('contract:')} has "
                            f"suite sha256 {got}, the statement signed {signed_suite}: its rules are not listed")
        else:
            suite = sources.contract_suite
    corpus = None
    corpus_sha256 = ""
    if sources.corpus_metadata is not None:
        corpus_sha256 = hashlib.sha256(sources.corpus_metadata).hexdigest()
        try:
            parsed = parse_json(sources.corpus_metadata, "corpus.json", ProvenanceError)
            corpus = parsed if isinstance(parsed, Mapping) else None
        except ProvenanceError as exc:
            problems.append(str(exc))
    return _Checked(report, suite, corpus, corpus_sha256, tuple(problems))


# ------------------------------------------------------------------------------ the sections


def build_datasheet(statement: Mapping[str, Any], sources: DatasheetSources | None = None) -> Datasheet:
    """The datasheet of the model a kiln provenance statement describes (``ProvenanceError`` for a
    statement that is not kiln's shape). Pure: the same statement and sources give the same sheet."""
    sources = sources or DatasheetSources()
    st = _read(statement)
    checked = _check_sources(st, sources)
    run_key = _text(st.metadata.get("invocationId"))
    title = f"Datasheet of {sources.model_version}" if sources.model_version else f"Datasheet of the model of run {run_key}"
    intro = (
        *((Fact("model version", sources.model_version, FROM_TAGS, code=True),) if sources.model_version else ()),
        Fact("policy", _text(st.internal.get("policy")), FROM_STATEMENT),
        Fact("made by", f"{_text(st.builder.get('id'))} (kiln {_text(_get(st.builder, 'version', 'kiln'))})",
             FROM_STATEMENT),
        Fact("Airflow run", run_key, FROM_STATEMENT, code=True),
        Fact("statement sha256", st.sha256, FROM_DERIVED, code=True),
        Fact("signed files", f"{st.subjects} (every file of the registered model directory)", FROM_STATEMENT),
    )
    sections = (_data_section(st, checked), _cleaning_section(st, checked), _training_section(st),
                _evaluation_section(st), _approval_section(st, sources), _gaps_section(st, checked))
    return Datasheet(title=title, intro=intro, sections=sections)


def _data_section(st: _Statement, c: _Checked) -> Section:
    snapshot = st.deps.get("snapshot")
    corpus_name = st.dep_names.get("snapshot", "").removeprefix("snapshot:")
    facts = [
        Fact("corpus", corpus_name or "not recorded", FROM_STATEMENT, code=True),
        Fact("snapshot (DVC id)", _text(_annotation(snapshot, "dvc_id")), FROM_STATEMENT, code=True),
        Fact("snapshot remote", _text((snapshot or {}).get("uri")), FROM_STATEMENT, code=True),
        Fact("snapshot copy the run read", _text(_annotation(snapshot, "path")), FROM_STATEMENT, code=True),
    ]
    notes = []
    if c.corpus is not None:
        source = c.corpus.get("source")
        if isinstance(source, Mapping) and source:
            facts.append(Fact("import source", "; ".join(f"{k}: {_text(v)}" for k, v in sorted(source.items())),
                              FROM_CORPUS))
        facts += [Fact("written by", _text(c.corpus.get("producer")), FROM_CORPUS),
                  Fact("kind of text", _text(c.corpus.get("kind")), FROM_CORPUS)]
        split = c.corpus.get("split")
        if isinstance(split, Mapping) and split:
            facts.append(Fact("held-out split", "; ".join(f"{k}: {_text(v)}" for k, v in sorted(split.items())),
                              FROM_CORPUS))
        for name in ("train", "eval"):
            stats = c.corpus.get(name)
            if isinstance(stats, Mapping):
                facts.append(Fact(f"{name} split", f"{_text(stats.get('documents'))} documents in "
                                  f"{_text(stats.get('shards'))} shards, {_text(stats.get('text_bytes'))} bytes of text",
                                  FROM_CORPUS))
        facts.append(Fact("corpus.json sha256", c.corpus_sha256, FROM_CORPUS, code=True))
    else:
        notes.append("The import source is not recorded: the snapshot copy's corpus.json was not at hand (or the "
                     "corpus has none).")
    if c.report is not None:
        facts.append(Fact("shards validated", f"{_text(c.report.get('shards'))}, of which {_text(c.report.get('healthy'))} "
                          "healthy", FROM_REPORT))
        healthy = _get(c.report, "dropped", "healthy_shards")
        if isinstance(healthy, Mapping):
            kept = int(healthy.get("of_documents", 0)) - int(healthy.get("documents", 0))
            facts.append(Fact("documents trained on", f"{kept} (of {_text(healthy.get('of_documents'))} in the healthy "
                              "shards)", FROM_REPORT))
    facts += [
        Fact("training manifest sha256", _digest(st.deps.get("training-manifest")) or "not recorded", FROM_STATEMENT,
             code=True),
        Fact("tokenizer", f"{st.dep_names.get('tokenizer', 'tokenizer:?').removeprefix('tokenizer:')}, sha256 "
             f"{_digest(st.deps.get('tokenizer')) or 'not recorded'}", FROM_STATEMENT),
        Fact("token manifest sha256", _digest(st.deps.get("token-manifest")) or "none (trained on the byte stream)",
             FROM_STATEMENT, code=bool(_digest(st.deps.get("token-manifest")))),
    ]
    tables: tuple[Table, ...] = ()
    if st.sources:
        notes.append("A data mixture: the snapshot, contract and tokens above name every source; each source is "
                     "below, under its own contract and data gate (its quarantine report and contract suite by sha256).")
        tables = (Table("Sources of the mixture (share: of the samples trained)",
                        ("source", "corpus", "snapshot (DVC id)", "contract", "contract suite sha256",
                         "quarantine report sha256", "token manifest sha256", "weight", "share", "tokens seen"),
                        tuple(_source_row(dep) for dep in st.sources), FROM_STATEMENT),)
    return Section("Training data: where it came from", tuple(facts), tables=tables, notes=tuple(notes))


def _source_row(dep: Mapping[str, Any]) -> tuple[str, ...]:
    a = dep.get("annotations") or {}
    share = a.get("share")
    return (str(dep["name"]).split(":", 1)[1], _text(a.get("corpus")), _text(a.get("dvc_id")), _text(a.get("contract")),
            _text(a.get("contract_suite_sha256")), _text(a.get("quarantine_report_sha256")),
            _text(a.get("token_manifest_sha256")), _text(a.get("weight")),
            f"{float(share):.1%}" if isinstance(share, int | float) else _text(share), _text(a.get("tokens")))


def _rule_ids(suite: Mapping[str, Any] | None) -> dict[tuple[str, str], str]:
    """``(expectation type, column) -> kiln rule id`` of a contract suite."""
    found: dict[tuple[str, str], str] = {}
    for exp in (suite or {}).get("expectations") or []:
        rule = _get(exp, "meta", "kiln_rule")
        if rule:
            found[(str(exp.get("type")), str(_get(exp, "kwargs", "column") or ""))] = str(rule)
    return found


def _reason_name(reason: Mapping[str, Any], ids: Mapping[tuple[str, str], str]) -> str:
    expectation, column = str(reason.get("expectation", "?")), str(reason.get("column") or "")
    rule = ids.get((expectation, column))
    by_rule = reason.get("by_rule")
    if isinstance(by_rule, Mapping) and by_rule:  # max_dropped_share: which document rules dropped them
        counts = sorted(by_rule.items(), key=lambda kv: (-int(kv[1]) if isinstance(kv[1], int) else 0, str(kv[0])))
        return f"{expectation} (documents dropped: {', '.join(f'{k} {v}' for k, v in counts)})"
    where = f" on {column}" if column else ""
    return f"{rule} ({expectation}{where})" if rule else f"{expectation}{where}"


def _cleaning_section(st: _Statement, c: _Checked) -> Section:
    contract = st.deps.get("contract")
    facts = [Fact("data contract", st.dep_names.get("contract", "contract:?").removeprefix("contract:"), FROM_STATEMENT,
                  code=True),
             Fact("contract suite sha256", _digest(contract) or "not recorded", FROM_STATEMENT, code=True),
             Fact("data gate threshold", "quarantined share at most "
                  f"{_text(st.internal.get('max_quarantine_share'))}", FROM_STATEMENT)]
    tables: list[Table] = []
    notes: list[str] = []
    ids = _rule_ids(c.suite)
    settings = _get(c.suite, "meta", "kiln") or {}
    if c.suite is not None:
        rows = [(str(_get(exp, "meta", "kiln_rule") or ""), str(exp.get("type", "")),
                 str(_get(exp, "kwargs", "column") or ""), str(exp.get("description") or ""))
                for exp in c.suite.get("expectations") or []]
        tables.append(Table("Shard rules (a shard failing one is quarantined: none of its documents is trained on)",
                            ("rule", "expectation", "column", "why"), tuple(rows), FROM_CONTRACT))
        doc_rules = [(str(r.get("rule", "")), str(r.get("kind", "")), str(r.get("description") or ""))
                     for r in settings.get("document_rules") or [] if isinstance(r, Mapping)]
        near = settings.get("near_duplicates")
        if isinstance(near, Mapping):
            shown = ", ".join(f"{k} {_text(v)}" for k, v in sorted(near.items()) if k not in ("description", "source"))
            doc_rules.append((NEAR_DUPLICATE_RULE, str(near.get("kind", "")), f"{near.get('description') or ''} ({shown})"))
        if doc_rules:
            tables.append(Table(f"Document rules (a failing document is dropped; a shard dropping more than "
                                f"{_text(settings.get('max_dropped_share'))} of its documents is quarantined)",
                                ("rule", "kind", "why"), tuple(doc_rules), FROM_CONTRACT))
    report = c.report
    if report is not None:
        facts += [Fact("data gate outcome", f"{_text(report.get('gate'))}: {len(report.get('quarantined') or [])} of "
                       f"{_text(report.get('shards'))} shards quarantined (share {_text(report.get('quarantined_share'))})",
                       FROM_REPORT)]
        root = _text(_annotation(st.deps.get("snapshot"), "path"))
        quarantined = []
        for shard in report.get("reports") or []:
            if not isinstance(shard, Mapping) or shard.get("verdict") == "healthy":
                continue
            name = str(shard.get("path", ""))
            name = name[len(root) + 1:] if root and name.startswith(root + "/") else name
            reasons = "; ".join(f"{_reason_name(r, ids)}: {_text(r.get('unexpected_count', '?'))}"
                                for r in shard.get("reasons") or [] if isinstance(r, Mapping))
            quarantined.append((name, _text(shard.get("rows")), reasons))
        if quarantined:
            tables.append(Table("Quarantined shards (left out of training whole; their bytes stay in the snapshot)",
                                ("shard", "documents", "rules that failed: count"), tuple(quarantined), FROM_REPORT))
        dropped = report.get("dropped")
        if isinstance(dropped, Mapping):
            healthy, everywhere = dropped.get("healthy_shards") or {}, dropped.get("all_shards") or {}
            facts.append(Fact("documents dropped", f"{_text(healthy.get('documents'))} of "
                              f"{_text(healthy.get('of_documents'))} in the healthy shards (share "
                              f"{_text(healthy.get('share'))}); {_text(everywhere.get('documents'))} in all judged shards",
                              FROM_REPORT))
            rules = sorted(set(healthy.get("by_rule") or {}) | set(everywhere.get("by_rule") or {}))
            tables.append(Table("Documents dropped, by rule (a dropped document stays in its shard file; the training "
                                "manifest lists its row and training skips it)",
                                ("rule", "in healthy shards", "in all judged shards", "by reason (all judged shards)"),
                                tuple((rule, str((healthy.get("by_rule") or {}).get(rule, 0)),
                                       str((everywhere.get("by_rule") or {}).get(rule, 0)),
                                       ", ".join(f"{k} {v}" for k, v in sorted(((everywhere.get("details") or {})
                                                                                .get(rule) or {}).items())))
                                      for rule in rules), FROM_REPORT))
            near_healthy = int((healthy.get("by_rule") or {}).get(NEAR_DUPLICATE_RULE, 0))
            near_eval = int(((healthy.get("details") or {}).get(NEAR_DUPLICATE_RULE) or {}).get(EVAL_SPLIT_DETAIL, 0))
            facts.append(Fact("near-duplicates removed", f"{near_healthy} documents from the healthy shards"
                              + (f", {near_eval} of them near copies of eval documents" if near_eval else ""),
                              FROM_REPORT))
        elif c.suite is not None and not settings.get("near_duplicates"):
            facts.append(Fact("near-duplicates removed", "none: the contract has no near-duplicate rule", FROM_CONTRACT))
        facts.append(_decontamination(report, ids, c.suite is not None))
    return Section("Training data: how it was cleaned", tuple(facts), tuple(tables), tuple(notes))


def _decontamination(report: Mapping[str, Any], ids: Mapping[tuple[str, str], str], have_suite: bool) -> Fact:
    """The eval split kept out of training: exact copies (a shard holding one is quarantined) and, with
    near-duplicate removal, near copies (dropped)."""
    keys = {key for key, rule in ids.items() if rule == EVAL_CONTAMINATION_RULE}
    if not keys:
        why = "the contract has no exact-copy rule against the eval split" if have_suite else \
            "the contract's rules were not at hand"
        return Fact("eval decontamination", why, FROM_CONTRACT)
    shards = copies = 0
    for shard in report.get("reports") or []:
        hits = [r for r in (shard.get("reasons") or []) if isinstance(r, Mapping)
                and (str(r.get("expectation")), str(r.get("column") or "")) in keys]
        if hits:
            shards += 1
            copies += sum(int(r.get("unexpected_count") or 0) for r in hits)
    dropped = _get(report, "dropped", "all_shards", "details", NEAR_DUPLICATE_RULE, EVAL_SPLIT_DETAIL) or 0
    return Fact("eval decontamination", f"rule {EVAL_CONTAMINATION_RULE}: {copies} exact copies of eval documents "
                f"found in {shards} shards, quarantined; {dropped} near copies dropped", FROM_REPORT)


def _training_section(st: _Statement) -> Section:
    ext, recipe = st.external, st.external.get("recipe") or {}
    steps = ext.get("steps")
    batch, block = _get(recipe, "data", "global_batch_size"), _get(recipe, "model", "block_size")
    tokens = (f"{steps * batch * block:,} (steps {steps} x global batch {batch} sequences x block size {block})"
              if all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, batch, block)) else "not recorded")
    model = recipe.get("model") or {}
    optim = recipe.get("optim") or {}
    trainer = st.deps.get("trainer")
    code = st.deps.get("code")
    nodes = st.internal.get("nodes") or []
    facts = (
        Fact("steps trained", _text(steps), FROM_STATEMENT),
        Fact("tokens trained on", tokens, FROM_DERIVED),
        Fact("seed", _text(ext.get("seed")), FROM_STATEMENT),
        Fact("world size and strategy", f"{_text(ext.get('world_size'))} ranks, {_text(ext.get('strategy'))}",
             FROM_STATEMENT),
        Fact("model", ", ".join(f"{k} {_text(v)}" for k, v in sorted(model.items())) or "not recorded",
             FROM_STATEMENT),
        Fact("optimizer", ", ".join(f"{k} {_text(v)}" for k, v in sorted(optim.items())) or "not recorded",
             FROM_STATEMENT),
        Fact("device and precision", f"{_text(_get(recipe, 'train', 'device'))}, {_text(_get(recipe, 'train', 'dtype'))}",
             FROM_STATEMENT),
        Fact("launcher", _text(st.internal.get("launcher")), FROM_STATEMENT),
        Fact("nodes", ", ".join(map(str, nodes)) or "not recorded", FROM_STATEMENT),
        Fact("platform", _text(_annotation(st.deps.get("platform"), "description")), FROM_STATEMENT),
        Fact("torch, Python", f"{_text(_annotation(st.deps.get('torch'), 'version'))}, "
             f"{_text(_annotation(st.deps.get('python'), 'version'))}", FROM_STATEMENT),
        Fact("trainer", f"{st.dep_names.get('trainer', 'trainer:?').removeprefix('trainer:')} from "
             f"{_text(_annotation(trainer, 'distribution'))} {_text(_annotation(trainer, 'version'))}, source sha256 "
             f"{_digest(trainer) or 'not recorded'}", FROM_STATEMENT),
        Fact("kiln's code", f"sha256 {_digest(code) or 'not recorded'}, "
             f"git commit {_digest(code, 'gitCommit') or 'not recorded'}", FROM_STATEMENT),
        Fact("ran", f"{_text(st.metadata.get('startedOn'))} to {_text(st.metadata.get('finishedOn'))}", FROM_STATEMENT),
        Fact("checkpoint manifest sha256", _digest(st.byproducts.get("checkpoint-manifest")) or "not recorded",
             FROM_STATEMENT, code=True),
    )
    return Section("How the model was trained", facts,
                   block=("The resolved recipe (every default filled in), as the checkpoint records it",
                          json.dumps(recipe, indent=1, sort_keys=True, ensure_ascii=False) if recipe else "not recorded"))


def _evaluation_section(st: _Statement) -> Section:
    report = _content(st.byproducts.get("evaluation-report"))
    decision = _content(st.byproducts.get("gate-decision"))
    facts = [
        Fact("split", _text(report.get("split")), FROM_STATEMENT),
        Fact("bits per byte", _text(report.get("bits_per_byte")), FROM_STATEMENT),
        Fact("loss", _text(report.get("loss")), FROM_STATEMENT),
        Fact("tokens evaluated", _text(report.get("tokens")), FROM_STATEMENT),
        Fact("weights sha256", _text(report.get("weights_sha256")), FROM_STATEMENT, code=True),
        Fact("model gate", f"{_text(decision.get('action'))}: {'; '.join(map(str, decision.get('reasons') or []))}",
             FROM_STATEMENT),
    ]
    if decision.get("champion_bits_per_byte") is not None:
        facts.append(Fact("champion at registration", f"{_text(decision.get('champion_bits_per_byte'))} bits per byte",
                          FROM_STATEMENT))
    notes = ["Held-out evaluation on the corpus' eval split, which the contamination rules keep out of training "
             "(above)."]
    tables: tuple[Table, ...] = ()
    per_source = report.get("sources")
    if isinstance(per_source, list) and per_source:
        notes.append("A data mixture: each source is scored on its own held-out split; the bits per byte and loss "
                     "above are the sources' figures averaged with the declared weights.")
        tables = (Table("Held-out score per source", ("source", "weight", "bits per byte", "loss", "tokens evaluated"),
                        tuple((_text(src.get("name")), _text(src.get("weight")),
                               _text(src.get("bits_per_byte")) if src.get("bits_per_byte") is not None
                               else "not scored (no held-out shards)", _text(src.get("loss")), _text(src.get("tokens")))
                              for src in per_source if isinstance(src, Mapping)), FROM_STATEMENT),)
    return Section("How the model was evaluated", tuple(facts), tables=tables, notes=tuple(notes))


def _approval_section(st: _Statement, sources: DatasheetSources) -> Section:
    signed = st.byproducts.get("approval")
    if signed is not None:
        return Section("Who approved it", tuple(Fact(str(k), _text(v), FROM_STATEMENT)
                                                for k, v in sorted(_content(signed).items())))
    if sources.approval is not None:
        a = sources.approval
        given = a.get("decision")
        decision: Mapping[str, Any] = given if isinstance(given, dict) else {}
        facts = (Fact("approved by", _text(a.get("approver")), FROM_APPROVAL),
                 Fact("approved at", _text(a.get("approvedAt")), FROM_APPROVAL),
                 Fact("how", _text(a.get("approval")), FROM_APPROVAL),
                 Fact("promoted as", f"{_text(a.get('target'))} ({_text(a.get('alias'))}; before it "
                                     f"{_text(a.get('previousVersion') or 'none')})", FROM_APPROVAL, code=True),
                 Fact("candidate", _text(a.get("candidate")), FROM_APPROVAL, code=True),
                 Fact("gate decision promoted on", f"{_text(decision.get('action'))}: "
                                                   f"{'; '.join(map(str, decision.get('reasons') or []))}", FROM_APPROVAL),
                 Fact("promoting run", _text(a.get("runKey")), FROM_APPROVAL, code=True),
                 Fact("signed by the key of policy", _text(a.get("policy")), FROM_APPROVAL))
        return Section("Who approved it", facts, notes=(
            "Signed at promotion, after this statement: the approval attestation names the statement by its sha256 "
            "and is signed with a key the policy trusts.",))
    tags = approval_tags(sources.approval_tags)
    if tags:
        notes = ["These tags were written after registration and are not signed."]
        if sources.approval_problem:
            notes.append(f"The approval attestation was not used: {sources.approval_problem}.")
        return Section("Who approved it", tuple(Fact(k, _text(v), FROM_TAGS) for k, v in tags.items()),
                       notes=tuple(notes))
    return Section("Who approved it", notes=(
        "No approval is recorded: the statement is made at registration, before any review. Once the version is "
        "reviewed or promoted, kiln datasheet MODEL@ALIAS shows its approval tags here (not signed).",))


def _gaps_section(st: _Statement, c: _Checked) -> Section:
    unrecorded = [str(u) for u in st.internal.get("unrecorded") or []]
    notes = [f"Not recorded by the stages before registration: {', '.join(unrecorded)}."] if unrecorded else []
    notes += [p[0].upper() + p[1:] + "." for p in c.problems]
    notes.append("This datasheet is derived from the statement and is not itself signed: kiln verify checks the "
                 "statement, and kiln datasheet makes the datasheet again from a verified one.")
    return Section("What this datasheet cannot say", notes=tuple(notes))


# ------------------------------------------------------------------------------ Markdown


def _as_code(fact: Fact) -> bool:
    return fact.code and fact.value != _text(None)


_MD_ESCAPED = re.compile(r"([\\`*_\[\]|~#])")


def _md(text: str) -> str:
    """Text for a Markdown table cell or paragraph: markup characters backslash-escaped, HTML's
    characters as entities (a raw ``<script>`` would be HTML to a Markdown renderer), one line."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_ESCAPED.sub(r"\\\1", " ".join(text.split()))


def _md_code(text: str) -> str:
    one_line = " ".join(text.split())
    if "`" in one_line or not one_line:
        return _md(text)
    return "`" + one_line.replace("|", "\\|") + "`"


def _md_fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}json\n{text}\n{fence}"


def datasheet_markdown(sheet: Datasheet) -> str:
    out = [f"# {_md(sheet.title)}", "",
           "Generated from the model's signed provenance statement; each fact names where it was read from.", "",
           "| | |", "|---|---|"]
    out += [f"| {_md(f.label)} | {_md_code(f.value) if _as_code(f) else _md(f.value)} |" for f in sheet.intro]
    for section in sheet.sections:
        out += ["", f"## {_md(section.title)}", ""]
        if section.facts:
            out += ["| what | value | from |", "|---|---|---|"]
            out += [f"| {_md(f.label)} | {_md_code(f.value) if _as_code(f) else _md(f.value)} | {_md(f.source)} |"
                    for f in section.facts]
            out.append("")
        for table in section.tables:
            out += [f"**{_md(table.title)}** (from: {_md(table.source)})", "",
                    "| " + " | ".join(_md(h) for h in table.header) + " |", "|" + "---|" * len(table.header)]
            out += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in table.rows]
            out.append("")
        out += [f"{_md(note)}\n" for note in section.notes]
        if section.block is not None:
            out += [f"**{_md(section.block[0])}**", "", _md_fence(section.block[1]), ""]
    out += ["## Sources", ""]
    out += [f"- {_md(name)}: {_md(meaning)}" for name, meaning in SOURCE_LEGEND.items()]
    return "\n".join(out).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------ HTML

_HTML_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;margin-bottom:1.2em}"
    "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}td.from{color:#666}"
    "code,pre{font-size:90%}pre{white-space:pre-wrap;word-break:break-all;background:#f6f6f6;padding:.6em}"
)


def _h(text: str) -> str:
    return html.escape(text, quote=True)


def _html_value(fact: Fact) -> str:
    return f"<code>{_h(fact.value)}</code>" if _as_code(fact) else _h(fact.value)


def datasheet_html(sheet: Datasheet) -> str:
    """A self-contained page (no script, no external resource); every value escaped."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_h(sheet.title)}</title>"
             f"<style>{_HTML_STYLE}</style></head><body>", f"<h1>{_h(sheet.title)}</h1>",
             "<p>Generated from the model's signed provenance statement; each fact names where it was read from.</p>",
             "<table>" + "".join(f"<tr><th>{_h(f.label)}</th><td>{_html_value(f)}</td></tr>" for f in sheet.intro)
             + "</table>"]
    for section in sheet.sections:
        parts.append(f"<h2>{_h(section.title)}</h2>")
        if section.facts:
            parts.append("<table><tr><th>what</th><th>value</th><th>from</th></tr>" + "".join(
                f"<tr><td>{_h(f.label)}</td><td>{_html_value(f)}</td><td class='from'>{_h(f.source)}</td></tr>"
                for f in section.facts) + "</table>")
        for table in section.tables:
            parts.append(f"<h3>{_h(table.title)} <small>(from: {_h(table.source)})</small></h3><table><tr>"
                         + "".join(f"<th>{_h(h)}</th>" for h in table.header) + "</tr>"
                         + "".join("<tr>" + "".join(f"<td>{_h(cell)}</td>" for cell in row) + "</tr>"
                                   for row in table.rows) + "</table>")
        parts += [f"<p>{_h(note)}</p>" for note in section.notes]
        if section.block is not None:
            parts.append(f"<details><summary>{_h(section.block[0])}</summary><pre>{_h(section.block[1])}</pre></details>")
    parts.append("<h2>Sources</h2><ul>" + "".join(f"<li><b>{_h(k)}</b>: {_h(v)}</li>" for k, v in SOURCE_LEGEND.items())
                 + "</ul></body></html>\n")
    return "".join(parts)


def render(statement: Mapping[str, Any], sources: DatasheetSources | None = None) -> tuple[str, str]:
    """``(markdown, html)`` of the statement's datasheet."""
    sheet = build_datasheet(statement, sources)
    return datasheet_markdown(sheet), datasheet_html(sheet)


def approval_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The review and approval tags among a version's tags (what ``DatasheetSources.approval_tags`` takes)."""
    return {k: v for k, v in sorted(tags.items()) if k == "kiln.review" or k.startswith(APPROVAL_TAG_PREFIXES)}


__all__: Sequence[str] = (
    "DATASHEET_DIR", "DATASHEET_HTML", "DATASHEET_MARKDOWN", "Datasheet", "DatasheetSources", "Fact", "Section",
    "Table", "approval_tags", "build_datasheet", "datasheet_html", "datasheet_markdown", "render",
)

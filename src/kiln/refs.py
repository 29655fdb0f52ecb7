"""The small JSON references that cross a task boundary (XCom, CLI stdout, files).

They carry ids, paths and hashes, never data. Each has ``to_json()`` (a JSON-safe dict) and
``from_json(d)``; the trainer reads the TrainingManifest JSON on its own (it never imports kiln),
so the wire format of each ref is documented on the class and must not change silently.

What each stage of a run hands on (``kiln.stages``; the Airflow adapter turns them into XComs and
back)::

    snapshot         PinnedSnapshot          (a SnapshotRef and the shards to validate)
    validate_shards  [ShardReport, ...]
    data_gate        DataGateResult          (the TrainingManifest written, the quarantine report)
    train            TrainResult             (planned as a kiln.launchers.LaunchPlan, followed by its
                                              JobHandle and StragglerWatchPlan, ended as JobEnded)
    evaluate         EvalReport
    register         RegisteredCandidate     (with the gate's Decision)
    model_gate       Decision
    approval         ApprovalAnswer in, Review recorded
    promote          PromotionRecord
    outcome          RunOutcome
    champion watch   ChampionEvaluation (of VersionEvaluations) → WatchDecision → Review, RollbackRecord
                     → WatchOutcome
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from kiln.errors import ManifestError
from kiln_trainer.contract import (  # the trainer contract: one canonical JSON, one hash rule (standard library only)
    TRAINING_MANIFEST_KIND,
    canonical_json,
    training_manifest_sha256,
)
from kiln_trainer.contract import (
    sha256_file as sha256_file,
)
from kiln_trainer.contract.training_manifest import (  # format 2: one reader of mixtures, both sides
    MIXTURE_FORMAT,
    check_training_manifest,
    mixture_summary,
    mixture_tokens_sha256,
)

if TYPE_CHECKING:
    from kiln.launchers.base import State


class Ref:
    """JSON round-trip shared by every ref (each one a frozen dataclass).

    ``from_json`` ignores keys it does not know: the trainer (a separate package and process) may
    add facts to its results before this side learns to use them. Integrity never rests on that:
    manifests are verified by their content hash, checkpoints by their per-file sha256. A value
    that is not a JSON object, or lacks a required key, is a ``ManifestError`` naming the ref.
    """

    if TYPE_CHECKING:  # every ref is a dataclass: what asdict() and fields() ask for
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    _nested: ClassVar[Mapping[str, type[Ref]]] = {}
    """Fields that hold refs (one, a list of them, or None): ``from_json`` rebuilds them."""
    _absent_when_none: ClassVar[frozenset[str]] = frozenset()
    """Fields whose key is left off the wire while they are None (facts a ref has only sometimes)."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self)
                if not (f.name in self._absent_when_none and getattr(self, f.name) is None)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        if not isinstance(data, dict):
            raise ManifestError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        for name, ref in cls._nested.items():
            if known.get(name) is not None:
                known[name] = _nested_from_json(ref, known[name], f"{cls.__name__}.{name}")
        try:
            return cls(**known)
        except TypeError as exc:  # a required field is missing
            raise ManifestError(f"{cls.__name__}: {exc}") from exc


def _json_value(value: Any) -> Any:
    """A field's value on the wire: a ref as its own ``to_json``, containers copied, the rest as is."""
    if isinstance(value, Ref):
        return value.to_json()
    if isinstance(value, list | tuple):
        return type(value)(_json_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def _nested_from_json(ref: type[Ref], value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [ref.from_json(v) for v in value]
    if isinstance(value, dict):
        return ref.from_json(value)
    raise ManifestError(f"{where}: expected a {ref.__name__} or a list of them, got {type(value).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotRef(Ref):
    """An immutable DVC snapshot of a corpus directory.

    Wire format: ``{"id": "<md5>.dir", "corpus", "files", "bytes", "dvc", "remote", "path"}``.
    """

    id: str
    """DVC directory hash, ``<md5>.dir``: the identity of exactly these bytes."""
    corpus: str
    """Corpus name (the DVC-tracked directory name inside the kiln DVC repo)."""
    files: int
    bytes: int
    dvc: str
    """The full ``.dvc`` text: enough to restore the bytes from the remote with no git history."""
    remote: str
    """Remote URL the snapshot was pushed to (never with credentials)."""
    path: str
    """Absolute path of the snapshotted directory in the DVC workspace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PinnedSnapshot(SnapshotRef):
    """The snapshot a run is pinned to (the verified copy kiln keeps of it), with the shards its
    validation covers: what the snapshot stage hands on.

    Wire format: ``SnapshotRef``'s keys (``path`` is the pinned copy), ``"shards"`` and ``"skipped"``.
    """

    shards: list[str]
    """The shards to validate (``train/*.parquet``), relative to ``path``, sorted."""
    skipped: list[dict[str, str]] = field(default_factory=list)
    """``{"path", "reason"}`` of each other entry of ``train/``: never validated, never trained on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PinnedSource(Ref):
    """One source of a mixture run, pinned: its declared name and weight, and its snapshot.

    Wire format: ``{"name", "weight", "snapshot": PinnedSnapshot}``."""

    name: str
    weight: float
    snapshot: PinnedSnapshot

    _nested = {"snapshot": PinnedSnapshot}


@dataclass(frozen=True, kw_only=True, slots=True)
class PinnedMixture(Ref):
    """The snapshots a mixture run is pinned to, one per source, in declared order: what the snapshot
    stage hands on for a run of a mixture (``kiln.data.mixtures``).

    Wire format: ``{"mixture", "id", "corpus", "sources": [PinnedSource, ...]}``. ``id`` and ``corpus``
    name every source's (``"code=<md5>.dir,docs=<md5>.dir"``), as a mixture's training manifest does, so
    what reads a run's ``snapshot`` XCom for one id reads a set of them pinned together."""

    mixture: str
    id: str
    corpus: str
    sources: list[PinnedSource]

    _nested = {"sources": PinnedSource}

    @classmethod
    def of(cls, mixture: str, sources: list[PinnedSource]) -> PinnedMixture:
        summary = mixture_summary([{"name": s.name, "snapshot_id": s.snapshot.id, "corpus": s.snapshot.corpus,
                                    "contract": ""} for s in sources])
        return cls(mixture=mixture, id=summary["snapshot_id"], corpus=summary["corpus"], sources=list(sources))

    def source(self, name: str) -> PinnedSource:
        for s in self.sources:
            if s.name == name:
                return s
        raise ManifestError(f"mixture {self.mixture!r} pinned no source {name!r}: "
                            f"its sources are {', '.join(s.name for s in self.sources)}")


def pinned_input(data: Any) -> PinnedSnapshot | PinnedMixture:
    """A run's ``snapshot`` XCom as the ref it carries: one corpus' snapshot, or a mixture's set."""
    if isinstance(data, dict) and "sources" in data:
        return PinnedMixture.from_json(data)
    return PinnedSnapshot.from_json(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry(Ref):
    """One shard a manifest lists: ``{"path", "sha256", "rows"}`` (path absolute), plus
    ``"drop_rows"`` when the contract dropped some of its documents."""

    path: str
    sha256: str
    rows: int
    """Rows in the file (all of them, dropped ones included)."""
    drop_rows: list[int] | None = None
    """Sorted row indices (0-based) left out of training: documents the contract's document rules or
    near-duplicate removal dropped (``kiln.data.validation.dropped``). Absent when none, so a manifest
    of a contract that drops nothing keeps the hash it always had."""

    _absent_when_none = frozenset({"drop_rows"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardReport(Ref):
    """The verdict on one shard. Quarantine is a value, not an exception.

    Wire format: ``{"path", "sha256", "rows", "verdict", "reasons", "contract"}``; each reason is
    ``{"expectation": str, "column": str|None, "unexpected_count": int, "sample": [str, ...]}`` or,
    for an unreadable shard, ``{"expectation": "readable_parquet", "error": str}``. A contract that
    drops documents adds ``"dropped"`` (absent otherwise; its XCom form, ``as_xcom``, carries
    ``rows_count`` and ``rows_sha256`` instead of ``rows``)::

        {"rows": [3, 17], "share": 0.05,
         "rules": {"gopher_quality": {"count": 1, "details": {"gopher_short_doc": 1}, "sample": ["id (…): …"]},
                   "near_duplicate": {"count": 1, "details": {"near_duplicate": 1}, "sample": ["…"]}}}
    """

    path: str
    sha256: str
    rows: int
    verdict: Literal["healthy", "quarantined"]
    reasons: list[dict[str, Any]] = field(default_factory=list)
    contract: str = ""
    """``name@version`` of the contract the shard was checked against."""
    dropped: dict[str, Any] | None = None
    """Documents left out of training, by rule (``kiln.data.validation.dropped``); None: none judged."""

    _absent_when_none = frozenset({"dropped"})

    def as_xcom(self) -> ShardReport:
        """The report as a ``validate_shards`` XCom carries it: ``dropped["rows"]`` (one index per
        dropped document, unbounded) replaced by ``rows_count`` and ``rows_sha256`` (of the rows'
        canonical JSON); everything else, bounded samples included, as is. Idempotent.

        The data gate trusts the validation tasks' records, never an XCom, and refuses an XCom that
        disagrees with them. The digest keeps that check whole while a batch of 10^3 shards with 10^4
        dropped documents each stays a small XCom row rather than megabytes in Airflow's database."""
        if not self.dropped or "rows" not in self.dropped:
            return self
        rows = self.dropped["rows"]
        digest = {"rows_count": len(rows), "rows_sha256": hashlib.sha256(canonical_json(rows)).hexdigest()}
        return dataclasses.replace(self, dropped={**{k: v for k, v in self.dropped.items() if k != "rows"}, **digest})


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingManifest(Ref):
    """What the trainer may read: a snapshot's healthy shards under one contract version, and once
    the tokenize stage has packed them, those shards as packed tokens; or, in format 2, several such
    sources mixed by weight.

    Wire format (the trainer parses this itself, ``kiln_trainer.contract.training_manifest``)::

        {"kind": "kiln.TrainingManifest", "snapshot_id": "<md5>.dir", "corpus": "...",
         "contract": "name@version", "shards": [{"path", "sha256", "rows"}, ...],
         "eval_shards": [{"path", "sha256", "rows"}, ...], "quarantined": ["path", ...],
         "tokens": {"manifest": "<token_manifest.json path or s3:// URL>", "sha256": "<hex>"},
         "trainer": {"spec": "kiln", "distribution": "kiln-trainer", "version": "0.1.0"},
         "sha256": "<hex>"}

    ``tokens`` is absent until the shards are packed (the trainer then packs them itself).
    ``trainer`` is the trainer the run's recipe names, as ``trainer_record`` resolves it
    (``kiln_trainer.contract.entrypoint``), absent on a manifest issued before runs named theirs.
    ``sha256`` is the sha256 of ``canonical_json`` of every other key except ``kind``; an absent
    ``tokens`` or ``trainer`` is not in it, so a manifest without them keeps the hash it always had. Kind and hash
    rule are the trainer contract's (``kiln_trainer.contract.training_manifest_sha256``), which the
    trainer's reader calls too.

    Format 2, a mixture (``build_mixture``)::

        {"kind": "kiln.TrainingManifest", "format": 2, "trainer": {...},
         "sources": [{"name": "web", "weight": 0.7, "corpus", "snapshot_id", "contract", "shards",
                      "eval_shards", "quarantined",
                      "tokens": {"manifest", "sha256", "tokenizer_sha256", "block_size"}}, ...],
         "sha256": "<hex>"}

    Only those keys are on its wire; its ``snapshot_id``, ``corpus``, ``contract``, ``shards``,
    ``eval_shards``, ``quarantined`` and ``tokens`` answer for all its sources, as the contract's
    ``mixture_summary`` says (``"web=<id>,code=<id>"``, the lists concatenated, ``tokens`` only for one
    source). It is checked by the contract's own reader when built or read, so kiln refuses what the
    trainer would, naming the field.
    """

    snapshot_id: str
    corpus: str
    contract: str
    shards: list[dict[str, Any]]
    eval_shards: list[dict[str, Any]]
    quarantined: list[str] = field(default_factory=list)
    tokens: dict[str, Any] | None = None
    trainer: dict[str, str] | None = None
    """The trainer the run's recipe names: ``{"spec", "distribution", "version"}`` (``trainer_record``)."""
    format: int | None = None
    """``2`` for a mixture; None (absent from the wire, as on every manifest issued before) for format 1."""
    sources: list[dict[str, Any]] | None = None
    """Format 2's sources, as on the wire, in declared order."""
    sha256: str = ""

    _absent_when_none = frozenset({"tokens", "trainer", "format", "sources"})

    def _wire(self) -> dict[str, Any]:
        """What is on the wire (``sha256`` too, outside the hash), without ``kind``."""
        if self.format != MIXTURE_FORMAT:
            return Ref.to_json(self)
        wire: dict[str, Any] = {"format": self.format, "sources": _json_value(self.sources)}
        if self.trainer is not None:
            wire["trainer"] = dict(self.trainer)
        return wire | {"sha256": self.sha256}

    def content_hash(self) -> str:
        return training_manifest_sha256(self._wire())

    @classmethod
    def build(cls, **kwargs: Any) -> TrainingManifest:
        unsigned = cls(**kwargs)
        return dataclasses.replace(unsigned, sha256=unsigned.content_hash())

    @classmethod
    def build_mixture(cls, sources: list[dict[str, Any]], *, trainer: dict[str, str] | None = None) -> TrainingManifest:
        """A format-2 manifest of ``sources`` (each ``{"name", "weight", "corpus", "snapshot_id",
        "contract", "shards", "eval_shards", "quarantined", "tokens"}``), checked by the contract's
        reader (``ManifestError`` naming the field), under its hash."""
        wire: dict[str, Any] = {"format": MIXTURE_FORMAT, "sources": sources}
        if trainer is not None:
            wire["trainer"] = dict(trainer)
        return cls._mixture(wire, "TrainingManifest.build_mixture", sha256=training_manifest_sha256(wire))

    @classmethod
    def _mixture(cls, wire: dict[str, Any], where: str, *, sha256: str) -> TrainingManifest:
        from kiln_trainer.contract import TrainingManifestError

        try:
            check_training_manifest(wire, where)
        except TrainingManifestError as exc:
            raise ManifestError(str(exc)) from None
        sources = copy.deepcopy(wire["sources"])  # the caller's lists stay theirs
        summary = mixture_summary(sources)
        return cls(
            snapshot_id=summary["snapshot_id"], corpus=summary["corpus"], contract=summary["contract"],
            shards=summary["shards"], eval_shards=summary["eval_shards"], quarantined=summary["quarantined"],
            tokens=dict(sources[0]["tokens"]) if len(sources) == 1 and sources[0].get("tokens") else None,
            trainer=wire.get("trainer"),
            format=MIXTURE_FORMAT, sources=sources, sha256=sha256,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingManifest:
        if isinstance(data, dict) and data.get("format") == MIXTURE_FORMAT:
            sha256 = data.get("sha256")
            if not isinstance(sha256, str):
                raise ManifestError(f"TrainingManifest: 'sha256' must be a string, got {sha256!r:.80}")
            return cls._mixture({k: v for k, v in data.items() if k != "sha256"}, "TrainingManifest", sha256=sha256)
        return super(TrainingManifest, cls).from_json(data)

    def tokens_sha256(self) -> str | None:
        """What names the packed tokens a run of this manifest reads, as its checkpoints record it
        (``token_manifest_sha256``): the one token manifest's sha256 (None before packing), or for a
        mixture the contract's ``mixture_tokens_sha256`` of its sources."""
        if self.format == MIXTURE_FORMAT and self.sources is not None and len(self.sources) > 1:
            if not self.packed:
                return None
            return mixture_tokens_sha256([(s["name"], s["weight"], s["tokens"]["sha256"]) for s in self.sources])
        return None if self.tokens is None else str(self.tokens["sha256"])

    @property
    def packed(self) -> bool:
        """Whether the trainer can read it as is: the shards named as packed tokens (a format-1 manifest
        without them is packed by the trainer itself; a mixture's sources never are)."""
        if self.format == MIXTURE_FORMAT and self.sources is not None:
            return all(s.get("tokens") for s in self.sources)
        return self.tokens is not None

    def without_tokens(self) -> TrainingManifest:
        """This manifest as its data gate made it, before the tokenize stage named packed tokens."""
        if self.format == MIXTURE_FORMAT and self.sources is not None:
            if not any(s.get("tokens") for s in self.sources):
                return self
            return type(self).build_mixture([{k: v for k, v in s.items() if k != "tokens"} for s in self.sources],
                                            trainer=self.trainer)
        return self if self.tokens is None else self.with_tokens("", None)

    def with_tokens(self, token_manifest: str, token_manifest_sha256: str | None) -> TrainingManifest:
        """This manifest naming its packed tokens (``None``: naming none), under its new hash."""
        if self.format == MIXTURE_FORMAT:
            raise ManifestError("a format-2 TrainingManifest names packed tokens per source: with_source_tokens")
        tokens = None if token_manifest_sha256 is None else {"manifest": token_manifest, "sha256": token_manifest_sha256}
        unsigned = dataclasses.replace(self, tokens=tokens, sha256="")
        return dataclasses.replace(unsigned, sha256=unsigned.content_hash())

    def with_source_tokens(self, name: str, tokens: dict[str, Any]) -> TrainingManifest:
        """This mixture with source ``name``'s packed tokens (``{"manifest", "sha256",
        "tokenizer_sha256", "block_size"}``) replaced, checked and under its new hash."""
        if self.format != MIXTURE_FORMAT or self.sources is None:
            raise ManifestError("with_source_tokens: a format-1 TrainingManifest has one source: with_tokens")
        names = [s["name"] for s in self.sources]
        if name not in names:
            raise ManifestError(f"with_source_tokens: unknown source {name!r}; the manifest's sources are {names}")
        sources = [{**s, "tokens": dict(tokens)} if s["name"] == name else s for s in self.sources]
        return type(self).build_mixture(sources, trainer=self.trainer)

    def with_trainer(self, record: dict[str, str] | None) -> TrainingManifest:
        """This manifest naming the trainer that is to read it (``None``: naming none), under its new hash."""
        if self.format == MIXTURE_FORMAT and self.sources is not None:
            return type(self).build_mixture(self.sources, trainer=None if record is None else dict(record))
        unsigned = dataclasses.replace(self, trainer=None if record is None else dict(record), sha256="")
        return dataclasses.replace(unsigned, sha256=unsigned.content_hash())

    def verify(self) -> TrainingManifest:
        if self.sha256 != self.content_hash():
            raise ManifestError("TrainingManifest content hash does not match its sha256 field")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"kind": TRAINING_MANIFEST_KIND, **self._wire()}

    def write(self, path: str | Path) -> Path:
        from kiln.util.fs import atomic_write_text

        return atomic_write_text(path, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> TrainingManifest:
        from kiln.util.fs import load_json

        try:
            data = load_json(path, "TrainingManifest", ManifestError)
        except ManifestError as exc:
            raise ManifestError(f"cannot read TrainingManifest {path}: {str(exc).removeprefix(f'{path}: ')}") from None
        return cls.from_json(data).verify()


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantinedShard(Ref):
    """A shard the data gate kept out of training, as its answer names it: ``{"path", "reasons"}``."""

    path: str
    """The shard's file name (the quarantine report has the full path)."""
    reasons: list[str]
    """Each failed expectation with its row count, or the read error, in words."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerRef(Ref):
    """The tokenizer a run's recipe asks for, as an artifact in kiln's store.

    Wire format: ``{"kind", "sha256", "vocab_size", "eos_id", "path"}``; ``path`` is the artifact
    (``KILN_HOME/tokenizers/<sha256>.json``), whose bytes hash to ``sha256``."""

    kind: str
    """``byte``, ``bpe`` (trained on the run's healthy training shards) or ``file``."""
    sha256: str
    vocab_size: int
    eos_id: int
    path: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedPart(Ref):
    """One shard of a training manifest packed into token shards (one mapped tokenize task packs a
    batch of them). Wire format: ``{"part", "samples", "tokens", "documents", "dropped_tokens"}``."""

    part: int
    """The shard's index in the training manifest, which is the part's number."""
    samples: int
    tokens: int
    documents: int
    dropped_tokens: int
    """The tail shorter than one sample, left out."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedTokensRef(Ref):
    """A training manifest's shards as packed token shards (the tokenize stage's join).

    Wire format: ``{"token_manifest", "token_manifest_sha256", "tokenizer_kind", "tokenizer_sha256",
    "vocab_size", "block_size", "samples", "tokens", "documents"}``."""

    token_manifest: str
    """The token manifest (``token_manifest.json``): a path, or an ``s3://`` URL once published."""
    token_manifest_sha256: str
    tokenizer_kind: str
    tokenizer_sha256: str
    vocab_size: int
    block_size: int
    samples: int
    """Training samples of ``block_size + 1`` tokens."""
    tokens: int
    documents: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceGate(Ref):
    """The data gate's verdict on one source of a mixture, judged by its own contract and threshold.

    Wire format: ``{"name", "weight", "corpus", "snapshot_id", "contract", "healthy", "quarantined",
    "quarantine_rate", "max_quarantine_share", "report", "report_html", "report_html_uri"}``, and
    ``"tokens"`` (its ``PackedTokensRef``) once the tokenize stage packed it."""

    name: str
    weight: float
    corpus: str
    snapshot_id: str
    contract: str
    healthy: int
    quarantined: list[QuarantinedShard]
    quarantine_rate: float
    max_quarantine_share: float
    report: str
    report_html: str
    report_html_uri: str = ""
    tokens: PackedTokensRef | None = None

    _nested = {"quarantined": QuarantinedShard, "tokens": PackedTokensRef}
    _absent_when_none = frozenset({"tokens"})


@dataclass(frozen=True, kw_only=True, slots=True)
class DataGateResult(Ref):
    """What the data gate hands on: the run's TrainingManifest (healthy shards only) and its
    quarantine report, both written into the run directory.

    Wire format: ``{"manifest", "manifest_sha256", "healthy", "quarantined": [{"path", "reasons"}],
    "quarantine_rate", "report", "report_html", "report_html_uri", "mlflow_run_id", "contract"}``.
    """

    manifest: str
    """Path of the run's training manifest; later stages read the run's own, and refuse this
    reference if it names another."""
    manifest_sha256: str
    healthy: int
    """How many shards the manifest lists."""
    quarantined: list[QuarantinedShard]
    quarantine_rate: float
    """Quarantined shards over validated shards, rounded to 4 places."""
    report: str
    """Path of the quarantine report (JSON)."""
    report_html: str
    report_html_uri: str = ""
    """The HTML report as an artifact of the run's MLflow run ("" when not logged)."""
    mlflow_run_id: str = ""
    """The run's MLflow run (the one training logs into)."""
    contract: str = ""
    """``name@version`` of the contract the shards were checked against."""
    tokens: PackedTokensRef | None = None
    """The manifest's shards as packed tokens, once the tokenize stage made them (then ``manifest``
    and ``manifest_sha256`` are of the training manifest that names them); absent before."""

    sources: list[SourceGate] | None = None
    """A mixture's sources, each gated by its own contract (absent for a run of one corpus). The
    top-level fields then answer for all of them: ``healthy`` and ``quarantined`` summed (each
    quarantined path as ``<source>/<file>``), ``contract`` as the manifest names them, ``report`` and
    ``report_html`` the index of the sources' reports."""

    _nested = {"quarantined": QuarantinedShard, "tokens": PackedTokensRef, "sources": SourceGate}
    _absent_when_none = frozenset({"tokens", "sources"})


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult(Ref):
    """What the train stage hands on. Mirrors the trainer's ``result.json``."""

    run_dir: str
    checkpoint: str
    checkpoint_manifest_sha256: str
    weights_sha256: str
    step: int
    metrics: dict[str, float]
    mlflow_run_id: str = ""
    world_size: int = 1
    total_steps: int = 0
    """Steps the recipe asks for; ``step == total_steps`` when ``completed``."""
    completed: bool = True
    recipe_sha256: str = ""
    snapshot_id: str = ""
    training_manifest_sha256: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Notable trainer events (resumes, rollbacks after a loss spike), in order."""
    stop: dict[str, Any] | None = None
    """Why training ended before ``total_steps`` although ``completed``: a mixture's capped source
    (``{"reason": "mixture_cap", "source", "limit", "draws", "loader_step", "step"}``); None otherwise."""

    _absent_when_none = frozenset({"stop"})


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerWatchPlan(Ref):
    """How the trigger a train task defers on follows the job's straggler flags (its ``stragglers``
    kwarg): ``{"action", "offset", "excluded"}``."""

    action: Literal["alert", "exclude_node"]
    """The policy's straggler action."""
    offset: int = 0
    """Where in the run's ``metrics.jsonl`` to start reading: flags before it were acted on already."""
    excluded: list[str] = field(default_factory=list)
    """Nodes already excluded from this run's job (Slurm)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEnded(Ref):
    """How a submitted training job ended: a deferrable trigger's event (whose other keys, the
    handle and straggler state, it leaves aside) or what the in-task wait saw."""

    state: State
    reason: str = ""
    log_tail: str = ""
    """The last lines of the job's log (on failure)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport(Ref):
    """Held-out evaluation of one committed checkpoint."""

    checkpoint: str
    weights_sha256: str
    split: str
    bits_per_byte: float
    loss: float
    tokens: int
    step: int = 0
    windows: int = 0
    snapshot_id: str = ""
    training_manifest_sha256: str = ""
    checkpoint_manifest_sha256: str = ""
    sources: list[dict[str, Any]] | None = None
    """A mixture's score per source (``name``, ``weight``, ``bits_per_byte``, ``loss``, ``tokens``,
    ``bytes``, ``windows``; ``bits_per_byte`` None for a source without held-out shards): the figures
    above are their mean weighted by the declared weights. Absent for a run of one corpus."""

    _absent_when_none = frozenset({"sources"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision(Ref):
    """The promotion gate's answer: ``promote`` or ``hold``, always with reasons."""

    action: Literal["promote", "hold"]
    reasons: list[str]
    candidate_bits_per_byte: float
    champion_bits_per_byte: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RegisteredCandidate(Ref):
    """The model version a run's registration made (or found again on a retry), with the decision
    recorded on it: what the register stage hands on.

    Wire format: ``{"model_name", "version", "run_id", "model_uri", "source", "decision": Decision,
    "created", "report_uri", "ui_url"}``.
    """

    model_name: str
    version: str
    run_id: str = ""
    """The MLflow run the model was logged into."""
    model_uri: str = ""
    source: str = ""
    decision: Decision
    """The gate's decision as registration recorded it on the version (promotion reads it there)."""
    created: bool = False
    """False on a retry that found the version."""
    report_uri: str = ""
    """The reviewer's report (evaluation, loss curve, metrics against the champion)."""
    ui_url: str = ""
    """The version's page in the MLflow UI."""

    _nested = {"decision": Decision}


ReviewOutcome = Literal["approved", "rejected", "timed out"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Review(Ref):
    """A person's answer to an approval task, as that task recorded it on the model version reviewed.

    Only the approval task writes one (from the answer Airflow handed it); a promotion or rollback
    that needs an approval reads it back from the registry, never from an XCom or a task state,
    which any Airflow user with the role "user" may set.
    """

    subject: str
    """What was asked, exactly: ``kiln.registry.promotion_subject`` / ``rollback_subject``."""
    outcome: ReviewOutcome
    reviewer: str
    """Who answered (an Airflow user name); for a timeout, who was asked."""
    at: str
    """When the answer was given (ISO 8601)."""
    run_key: str
    """The Airflow run (``<dag_id>/<run_id>``) whose approval task asked."""
    comment: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ApprovalAnswer(Ref):
    """The answer Airflow handed an approval task (its HITL record), which that task records as a
    ``Review``. Wire format (the task's ``review`` XCom, for its log and the UI only)::

        {"chosen_options": [...], "responded_by_user": {"id", "name"}, "timed_out", "responded_at"}
    """

    chosen_options: list[str] = field(default_factory=list)
    responded_by_user: dict[str, str] = field(default_factory=dict)
    """Who answered, as Airflow names them (``id``, ``name``); empty when nobody did."""
    timed_out: bool = False
    """Nobody answered within the timeout: the default (Reject) applied."""
    responded_at: str = ""
    """ISO 8601."""
    comment: str | None = None

    _absent_when_none = frozenset({"comment"})


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionRecord(Ref):
    """An alias moved to a version: by promotion (``approver``: who approved) or by rollback."""

    registered_model: str
    version: str
    alias: str
    approver: str
    at: str
    previous_version: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome(Ref):
    """How a run ended for its model, in words: what the outcome stage hands on, and the run's
    ``summary.json``.

    Wire format: ``{"candidate_model", "candidate_version", "decision", "decision_reasons",
    "promoted", "message"}``; with ``"review", "reviewer", "reviewed_at", "review_comment"`` when a
    review was recorded, and ``"model", "version", "alias", "approver"`` when promoted.
    """

    candidate_model: str
    candidate_version: str
    decision: Literal["promote", "hold"]
    decision_reasons: list[str]
    promoted: bool
    message: str
    review: ReviewOutcome | None = None
    reviewer: str | None = None
    reviewed_at: str | None = None
    review_comment: str | None = None
    model: str | None = None
    """Where the candidate was promoted to (the target model)."""
    version: str | None = None
    alias: str | None = None
    approver: str | None = None

    _absent_when_none = frozenset({"review", "reviewer", "reviewed_at", "review_comment", "model", "version", "alias",
                                   "approver"})


# ---------------------------------------------------------------------------------- champion watch
@dataclass(frozen=True, kw_only=True, slots=True)
class VersionEvaluation(Ref):
    """Today's held-out evaluation of one registered version, next to the one recorded in its tags."""

    version: str
    recorded_bits_per_byte: float
    recorded_snapshot_id: str
    current_bits_per_byte: float
    current_tokens: int
    checkpoint: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ChampionEvaluation(Ref):
    """What the champion watch's re-evaluation hands on: the ``champion`` and ``previous`` versions
    on the held-out split of the registered corpus as it is today (None: nobody holds the alias).

    Wire format: ``{"model", "alias", "champion", "previous", "snapshot_id"}``, each version a
    ``VersionEvaluation``; ``snapshot_id`` (the corpus as pinned today) only when there is a champion.
    """

    model: str
    alias: str
    champion: VersionEvaluation | None = None
    previous: VersionEvaluation | None = None
    snapshot_id: str | None = None

    _nested = {"champion": VersionEvaluation, "previous": VersionEvaluation}
    _absent_when_none = frozenset({"snapshot_id"})


WatchAction = Literal["propose_rollback", "ok", "regressed_no_fallback", "no_champion"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchDecision(Ref):
    """The champion watch's decision, with every number that decided: a proposed rollback is this.

    Wire format: ``{"model", "alias", "tolerance", "snapshot_id", "champion_version",
    "previous_version", "action", "reasons"}``, and with a champion ``"champion_current_bits_per_byte",
    "champion_recorded_bits_per_byte", "previous_current_bits_per_byte"`` (None without a previous).
    """

    model: str
    alias: str
    tolerance: float
    """Bits per byte (absolute) the champion may lose before it counts as regressed."""
    snapshot_id: str | None
    champion_version: str | None
    previous_version: str | None
    action: WatchAction
    reasons: list[str]
    champion_current_bits_per_byte: float | None = None
    champion_recorded_bits_per_byte: float | None = None
    previous_current_bits_per_byte: float | None = None

    def to_json(self) -> dict[str, Any]:
        body = Ref.to_json(self)  # (no zero-argument super() in a slots dataclass)
        if self.champion_version is None:  # nothing was measured
            for name in ("champion_current_bits_per_byte", "champion_recorded_bits_per_byte",
                         "previous_current_bits_per_byte"):
                del body[name]
        return body


@dataclass(frozen=True, kw_only=True, slots=True)
class RollbackRecord(PromotionRecord):
    """A rollback of the champion alias, with the watch's reason (also in the version's audit tags)."""

    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchOutcome(Ref):
    """How a champion watch ended, in words (and its run's ``summary.json``):
    ``{"decision", "reasons", "model", "rolled_back", "message"}``."""

    decision: WatchAction
    reasons: list[str]
    model: str | None
    rolled_back: bool
    message: str

"""The small JSON references that cross a task boundary (XCom, CLI stdout, files).

They carry ids, paths and hashes, never data. Each has ``to_json()`` (a JSON-safe dict) and
``from_json(d)``; the trainer reads the TrainingManifest JSON on its own (it never imports kiln),
so the wire format of each ref is documented on the class and must not change silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kiln.errors import ManifestError


def canonical_json(obj: Any) -> bytes:
    """The bytes every content hash in kiln is taken over: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class _Ref:
    """JSON round-trip shared by every ref.

    ``from_json`` ignores keys it does not know: the trainer (a separate package and process) may
    add facts to its results before this side learns to use them. Integrity never rests on that:
    manifests are verified by their content hash, checkpoints by their per-file sha256.
    """

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, data: dict[str, Any]):  # type: ignore[no-untyped-def]
        if not isinstance(data, dict):
            raise ManifestError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:  # a required field is missing
            raise ManifestError(f"{cls.__name__}: {exc}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotRef(_Ref):
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
class ShardEntry(_Ref):
    """One shard a manifest lists: ``{"path", "sha256", "rows"}`` (path absolute)."""

    path: str
    sha256: str
    rows: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardReport(_Ref):
    """The verdict on one shard. Quarantine is a value, not an exception.

    Wire format: ``{"path", "sha256", "rows", "verdict", "reasons", "contract"}``; each reason is
    ``{"expectation": str, "column": str|None, "unexpected_count": int, "sample": [str, ...]}`` or,
    for an unreadable shard, ``{"expectation": "readable_parquet", "error": str}``.
    """

    path: str
    sha256: str
    rows: int
    verdict: Literal["healthy", "quarantined"]
    reasons: list[dict[str, Any]] = field(default_factory=list)
    contract: str = ""
    """``name@version`` of the contract the shard was checked against."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingManifest(_Ref):
    """What the trainer may read: a snapshot's healthy shards under one contract version.

    Wire format (the trainer parses this itself)::

        {"kind": "kiln.TrainingManifest", "snapshot_id": "<md5>.dir", "corpus": "...",
         "contract": "name@version", "shards": [{"path", "sha256", "rows"}, ...],
         "eval_shards": [{"path", "sha256", "rows"}, ...], "quarantined": ["path", ...],
         "sha256": "<hex>"}

    ``sha256`` is the sha256 of ``canonical_json`` of every other key except ``kind``.
    """

    snapshot_id: str
    corpus: str
    contract: str
    shards: list[dict[str, Any]]
    eval_shards: list[dict[str, Any]]
    quarantined: list[str] = field(default_factory=list)
    sha256: str = ""

    def content_hash(self) -> str:
        body = asdict(self)
        body.pop("sha256")
        return hashlib.sha256(canonical_json(body)).hexdigest()

    @classmethod
    def build(cls, **kwargs: Any) -> "TrainingManifest":
        unsigned = cls(**kwargs)
        return cls(**{**asdict(unsigned), "sha256": unsigned.content_hash()})

    def verify(self) -> "TrainingManifest":
        if self.sha256 != self.content_hash():
            raise ManifestError("TrainingManifest content hash does not match its sha256 field")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kiln.TrainingManifest", **asdict(self)}

    def write(self, path: str | Path) -> Path:
        from kiln.fsutil import atomic_write_text

        return atomic_write_text(path, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "TrainingManifest":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ManifestError(f"cannot read TrainingManifest {path}: {exc}") from exc
        return cls.from_json(data).verify()


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult(_Ref):
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


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport(_Ref):
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision(_Ref):
    """The promotion gate's answer: ``promote`` or ``hold``, always with reasons."""

    action: Literal["promote", "hold"]
    reasons: list[str]
    candidate_bits_per_byte: float
    champion_bits_per_byte: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionRecord(_Ref):
    registered_model: str
    version: str
    alias: str
    approver: str
    at: str
    previous_version: str | None = None

"""The TrainingManifest as the trainer reads it: which shards (path, sha256, rows) it may train and
evaluate on, under a content hash that refuses a manifest edited after kiln issued it. The kind and the hash rule are the
contract's (``kiln_trainer.contract.training_manifest_sha256``), the same function kiln's writer calls.

Optional ``tokens``: the packed token shards the tokenize stage made of those shards::

    "tokens": {"manifest": "/abs/.../token_manifest.json" | "s3://bucket/prefix/token_manifest.json",
               "sha256": "<the token manifest's own sha256>"}

part of the content hash like every other field. Without it the trainer packs the listed shards
itself (``kiln_trainer.data``).

Optional ``trainer``: the trainer the run's recipe names, as kiln resolved it
(``kiln_trainer.contract.entrypoint.trainer_record``)::

    "trainer": {"spec": "kiln" | "package.module:function", "distribution": "...", "version": "..."}

part of the content hash when present; a manifest issued before it existed keeps its hash.

Part of the trainer contract, standard library only (no torch): kiln reads a manifest with it (the
launchers check one before any worker starts) and the trainer parses the same way on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln_trainer.contract import TRAINING_MANIFEST_KIND, read_json, training_manifest_sha256
from kiln_trainer.errors import TrainingManifestError

__all__ = ["TRAINING_MANIFEST_KIND", "ShardEntry", "TokensRef", "TrainingManifest", "load_training_manifest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    path: str
    sha256: str
    rows: int
    drop_rows: tuple[int, ...] = ()
    """Rows the data contract dropped (document rules, near-duplicates): never read for training.
    Optional in the wire format (absent = none), part of the manifest's content hash when present."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokensRef:
    """Where the packed token shards of this manifest are, and the sha256 their token manifest must have."""

    manifest: str
    """Absolute path or ``s3://`` URL of ``token_manifest.json`` (or of the directory / prefix holding it)."""
    sha256: str

    @property
    def remote(self) -> bool:
        return self.manifest.startswith("s3://")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingManifest:
    """The trainer's own parse of kiln's TrainingManifest wire format (it never imports kiln)."""

    snapshot_id: str
    corpus: str
    contract: str
    shards: tuple[ShardEntry, ...]
    eval_shards: tuple[ShardEntry, ...]
    quarantined: tuple[str, ...] = field(default=())
    tokens: TokensRef | None = None
    """The packed token shards of ``shards``, when the tokenize stage made them."""
    trainer: dict[str, str] | None = None
    """The trainer the run's recipe names (``trainer_record``), when kiln recorded it."""
    sha256: str
    path: str = ""
    """Where it was read from (not part of the content)."""


def _shard_entries(raw: Any, key: str, where: str) -> tuple[ShardEntry, ...]:
    if not isinstance(raw, list):
        raise TrainingManifestError(f"{where}: {key!r} must be a list")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise TrainingManifestError(f"{where}: {key}[{i}] must be an object")
        try:
            path, digest, rows = item["path"], item["sha256"], item["rows"]
        except KeyError as exc:
            raise TrainingManifestError(f"{where}: {key}[{i}] lacks {exc.args[0]!r}") from exc
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise TrainingManifestError(f"{where}: {key}[{i}].path must be an absolute path, got {path!r}")
        if not isinstance(digest, str) or len(digest) != 64:
            raise TrainingManifestError(f"{where}: {key}[{i}].sha256 must be 64 hex chars")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise TrainingManifestError(f"{where}: {key}[{i}].rows must be an int >= 0")
        entries.append(ShardEntry(path=path, sha256=digest, rows=rows,
                                  drop_rows=_drop_rows(item.get("drop_rows", []), rows, f"{where}: {key}[{i}]")))
    return tuple(entries)


def _drop_rows(raw: Any, rows: int, where: str) -> tuple[int, ...]:
    """A shard entry's ``drop_rows``: ascending, unique row numbers of the shard."""
    if not isinstance(raw, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
        raise TrainingManifestError(f"{where}.drop_rows must be a list of row numbers, got {raw!r:.80}")
    if raw != sorted(set(raw)) or (raw and not 0 <= raw[0] <= raw[-1] < rows):
        raise TrainingManifestError(f"{where}.drop_rows must be ascending, unique and within [0, {rows})")
    return tuple(raw)


def _tokens_ref(raw: Any, where: str) -> TokensRef | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"manifest", "sha256"}:
        raise TrainingManifestError(f"{where}: 'tokens' must be an object with exactly 'manifest' and 'sha256'")
    location, digest = raw["manifest"], raw["sha256"]
    if not isinstance(location, str) or not (location.startswith("s3://") or Path(location).is_absolute()):
        raise TrainingManifestError(f"{where}: tokens.manifest must be an absolute path or an s3:// URL, got {location!r}")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise TrainingManifestError(f"{where}: tokens.sha256 must be 64 lowercase hex chars, got {digest!r}")
    return TokensRef(manifest=location, sha256=digest)


def _trainer_record(raw: Any, where: str) -> dict[str, str] | None:
    if raw is None:
        return None
    if not (isinstance(raw, dict) and {"spec", "distribution", "version"} <= set(raw)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items())):
        raise TrainingManifestError(f"{where}: 'trainer' must be an object of strings with 'spec', 'distribution' "
                                    f"and 'version', got {raw!r:.120}")
    return dict(raw)


def load_training_manifest(path: str | Path) -> TrainingManifest:
    """Read a TrainingManifest JSON and check its content hash; raise TrainingManifestError otherwise."""
    where = str(path)
    _raw, data = read_json(path, "training manifest", TrainingManifestError)
    if not isinstance(data, dict) or data.get("kind") != TRAINING_MANIFEST_KIND:
        raise TrainingManifestError(f"{where}: kind is not {TRAINING_MANIFEST_KIND!r}")
    declared = data.get("sha256")
    try:
        actual = training_manifest_sha256(data)
    except UnicodeEncodeError as exc:  # JSON can spell a lone surrogate ("\\ud800"); UTF-8 cannot hold it
        raise TrainingManifestError(f"{where}: a string holds a lone surrogate {exc.object[exc.start:exc.end]!r}, "
                                    "which no UTF-8 manifest kiln issued holds") from None
    if declared != actual:
        raise TrainingManifestError(
            f"{where}: content hash mismatch (declared {declared}, computed {actual}); "
            "the manifest was edited after it was issued"
        )
    for key in ("snapshot_id", "corpus", "contract"):
        if not isinstance(data.get(key), str):
            raise TrainingManifestError(f"{where}: {key!r} must be a string")
    shards = _shard_entries(data.get("shards"), "shards", where)
    if not shards:
        raise TrainingManifestError(f"{where}: 'shards' is empty: nothing to train on")
    eval_shards = _shard_entries(data.get("eval_shards", []), "eval_shards", where)
    quarantined = data.get("quarantined", [])
    if not isinstance(quarantined, list):
        raise TrainingManifestError(f"{where}: 'quarantined' must be a list")
    return TrainingManifest(
        snapshot_id=data["snapshot_id"],
        corpus=data["corpus"],
        contract=data["contract"],
        shards=shards,
        eval_shards=eval_shards,
        quarantined=tuple(quarantined),
        tokens=_tokens_ref(data.get("tokens"), where),
        trainer=_trainer_record(data.get("trainer"), where),
        sha256=actual,
        path=str(Path(path).resolve()),
    )

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

**Format 2: a mixture of sources** (``"format": 2``; a manifest without ``format`` is format 1, the
one source above, read and hashed exactly as before). The run reads several corpora, each under its
own contract and snapshot, packed with the run's one tokenizer, drawn by weight
(``kiln_trainer.mixture``)::

    {"kind": "kiln.TrainingManifest", "format": 2,
     "sources": [{"name": "web", "weight": 0.7, "corpus": "web-en", "snapshot_id": "<md5>.dir",
                  "contract": "web-text@1", "shards": [{"path", "sha256", "rows"}, ...],
                  "eval_shards": [...], "quarantined": ["path", ...],
                  "tokens": {"manifest": "...", "sha256": "<hex>", "tokenizer_sha256": "<hex>",
                             "block_size": 128}},
                 {"name": "code", "weight": 0.3, ..., "max_epochs": 2}],   # optional caps
     "trainer": {...},                                    # optional, as in format 1
     "sha256": "<hex>"}

The same hash rule (every key but ``kind`` and ``sha256``). No other top-level key is allowed (an
old top-level ``shards`` next to ``sources`` would be ambiguous), and no key in a source but those
shown. A source's ``tokens`` is absent only on a data gate's manifest, before the run's tokenize
stage packs every source (then on none of them: all sources or none). The trainer packs no mixture
itself: it refuses one whose sources name no tokens, before step 1. Once packed, each names the
tokenizer and block size it was packed with, so a manifest of mixed tokenizers or block sizes is
refused from the manifest alone, before a shard is opened; the trainer then checks each token
manifest against what its source names. A source's optional ``max_epochs`` and ``max_tokens``
(ints >= 1, absent when it has none) cap it: the trainer stops before the first step that would
draw it past either (``kiln_trainer.mixture.Mixture.cap_step``); a source without them recycles by
epochs. Refusals (``TrainingManifestError``) name the field: ``sources[1] ('code').weight = -1: ...``.

For what reads one value, a format-2 manifest answers for all its sources (``mixture_summary``,
which kiln's writer calls too): ``snapshot_id``, ``corpus`` and ``contract`` are
``"web=<value>,code=<value>"`` in source order, ``shards``, ``eval_shards`` and ``quarantined``
are the sources' lists concatenated in source order, and ``tokens`` is the one source's for a
mixture of one source, else None (``tokens_sha256`` names the whole set of packed tokens).
``data_sources`` is every manifest's list of sources: a format-1 manifest's is its one source,
named after its corpus, weight 1.

Part of the trainer contract, standard library only (no torch): kiln reads a manifest with it (the
launchers check one before any worker starts) and the trainer parses the same way on every rank.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kiln_trainer.contract import TRAINING_MANIFEST_KIND, canonical_json, read_json, training_manifest_sha256
from kiln_trainer.errors import TrainingManifestError

__all__ = [
    "MIXTURE_FORMAT",
    "SOURCE_NAME",
    "TRAINING_MANIFEST_FORMATS",
    "TRAINING_MANIFEST_KIND",
    "ManifestSource",
    "ShardEntry",
    "TokensRef",
    "TrainingManifest",
    "check_training_manifest",
    "load_training_manifest",
    "metric_name",
    "mixture_summary",
    "mixture_tokens_sha256",
]

MIXTURE_FORMAT: Final = 2
"""``format`` of a manifest that lists its sources; a manifest without ``format`` is format 1."""
TRAINING_MANIFEST_FORMATS: Final = (1, MIXTURE_FORMAT)
SOURCE_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
"""A source's name: a corpus name's alphabet (1-64 of ``a-z 0-9 _ . -``), so it can key tags and metrics."""
_MIXTURE_KEYS: Final = frozenset({"kind", "format", "sources", "trainer", "sha256"})
_SOURCE_REQUIRED: Final = ("name", "weight", "corpus", "snapshot_id", "contract", "shards")
_SOURCE_OPTIONAL: Final = ("eval_shards", "quarantined", "tokens", "max_epochs", "max_tokens")
_MIXTURE_TOKENS_KEYS: Final = frozenset({"manifest", "sha256", "tokenizer_sha256", "block_size"})
_MIXTURE_TOKENS_KIND: Final = "kiln.MixtureTokens"


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
    tokenizer_sha256: str = ""
    """A format-2 source's: the tokenizer the shards were packed with (format 1 names none: "")."""
    block_size: int = 0
    """A format-2 source's: the block size the shards were packed with (format 1 names none: 0)."""

    @property
    def remote(self) -> bool:
        return self.manifest.startswith("s3://")


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestSource:
    """One source of a run's data: a corpus snapshot's healthy shards under its own contract, its
    packed tokens and its weight in the mixture."""

    name: str
    weight: float
    corpus: str
    snapshot_id: str
    contract: str
    shards: tuple[ShardEntry, ...]
    eval_shards: tuple[ShardEntry, ...] = ()
    quarantined: tuple[str, ...] = ()
    tokens: TokensRef | None = None
    """Always set in a format-2 manifest; a format-1 manifest may name none (the trainer packs them)."""
    max_epochs: int | None = None
    """Cap: the run stops before this source's ``max_epochs + 1``-th epoch would be drawn; None: none."""
    max_tokens: int | None = None
    """Budget: the run stops before this source would give more than ``max_tokens`` tokens; None: none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingManifest:
    """The trainer's own parse of kiln's TrainingManifest wire format (it never imports kiln).

    In format 2 the single-valued fields answer for every source (the module docstring):
    ``sources`` holds them one by one."""

    snapshot_id: str
    corpus: str
    contract: str
    shards: tuple[ShardEntry, ...]
    eval_shards: tuple[ShardEntry, ...]
    quarantined: tuple[str, ...] = field(default=())
    tokens: TokensRef | None = None
    """The packed token shards of ``shards``, when the tokenize stage made them (format 2: the one
    source's, or None for several)."""
    trainer: dict[str, str] | None = None
    """The trainer the run's recipe names (``trainer_record``), when kiln recorded it."""
    format: int = 1
    sources: tuple[ManifestSource, ...] = ()
    """Format 2's sources, in declared order (format 1: none on the wire; ``data_sources`` has one)."""
    sha256: str
    path: str = ""
    """Where it was read from (not part of the content)."""

    @property
    def data_sources(self) -> tuple[ManifestSource, ...]:
        """Every source the run reads: format 2's list, or format 1's one source (named after its
        corpus, weight 1)."""
        if self.sources:
            return self.sources
        return (ManifestSource(name=self.corpus, weight=1.0, corpus=self.corpus, snapshot_id=self.snapshot_id,
                               contract=self.contract, shards=self.shards, eval_shards=self.eval_shards,
                               quarantined=self.quarantined, tokens=self.tokens),)

    @property
    def is_mixture(self) -> bool:
        """More than one source: the loader draws by weight (``kiln_trainer.mixture``)."""
        return len(self.data_sources) > 1

    @property
    def tokens_sha256(self) -> str | None:
        """What names the packed tokens the run reads (a checkpoint's ``token_manifest_sha256``): the
        token manifest's sha256 for one source (None when it names none), else ``mixture_tokens_sha256``."""
        sources = self.data_sources
        if len(sources) == 1:
            return None if sources[0].tokens is None else sources[0].tokens.sha256
        return mixture_tokens_sha256([(s.name, s.weight, s.tokens.sha256 if s.tokens else "") for s in sources])


def mixture_tokens_sha256(sources: Sequence[tuple[str, float, str]]) -> str:
    """The identity of a mixture's packed tokens: the sha256 of the canonical JSON of each source's
    ``(name, weight, token manifest sha256)`` in declared order (the weight as a float, so ``1`` and
    ``1.0`` agree). kiln and the trainer both call this; a checkpoint of a mixture records it."""
    body = {"kind": _MIXTURE_TOKENS_KIND,
            "sources": [{"name": name, "weight": float(weight), "sha256": digest} for name, weight, digest in sources]}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def metric_name(name: str) -> str:
    """A source's name as it keys metrics (Prometheus' alphabet: ``-`` and ``.`` become ``_``)."""
    return name.replace("-", "_").replace(".", "_")


def _joined(pairs: Sequence[tuple[str, str]]) -> str:
    return ",".join(f"{name}={value}" for name, value in pairs)


def mixture_summary(sources: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a format-2 manifest answers for the single-valued fields of format 1, from its wire
    ``sources``: ``snapshot_id``, ``corpus`` and ``contract`` as ``"name=value,..."``, and ``shards``,
    ``eval_shards`` and ``quarantined`` concatenated, all in source order (kiln's writer and this
    reader both take them from here)."""
    return {
        **{key: _joined([(s["name"], s[key]) for s in sources]) for key in ("snapshot_id", "corpus", "contract")},
        **{key: [item for s in sources for item in s.get(key, [])] for key in ("shards", "eval_shards", "quarantined")},
    }


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


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _tokens_ref(raw: Any, where: str, key: str = "tokens", *, mixture: bool = False) -> TokensRef | None:
    """Format 1's optional ``tokens`` (``manifest``, ``sha256``), or a format-2 source's, which also
    names its tokenizer and block size."""
    if raw is None:
        return None
    keys = _MIXTURE_TOKENS_KEYS if mixture else {"manifest", "sha256"}
    if not isinstance(raw, dict) or set(raw) != keys:
        raise TrainingManifestError(f"{where}: {key if mixture else repr(key)} must be an object with exactly "
                                    f"{' and '.join(map(repr, sorted(keys)))}"
                                    + (f", got {sorted(raw)!r:.200}" if isinstance(raw, dict) else ""))
    location, digest = raw["manifest"], raw["sha256"]
    if not isinstance(location, str) or not (location.startswith("s3://") or Path(location).is_absolute()):
        raise TrainingManifestError(f"{where}: {key}.manifest must be an absolute path or an s3:// URL, got {location!r}")
    if not _is_sha256(digest):
        raise TrainingManifestError(f"{where}: {key}.sha256 must be 64 lowercase hex chars, got {digest!r}")
    if not mixture:
        return TokensRef(manifest=location, sha256=digest)
    tokenizer, block = raw["tokenizer_sha256"], raw["block_size"]
    if not _is_sha256(tokenizer):
        raise TrainingManifestError(f"{where}: {key}.tokenizer_sha256 must be 64 lowercase hex chars, got {tokenizer!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise TrainingManifestError(f"{where}: {key}.block_size must be an int >= 1, got {block!r}")
    return TokensRef(manifest=location, sha256=digest, tokenizer_sha256=tokenizer, block_size=block)


def _trainer_record(raw: Any, where: str) -> dict[str, str] | None:
    if raw is None:
        return None
    if not (isinstance(raw, dict) and {"spec", "distribution", "version"} <= set(raw)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items())):
        raise TrainingManifestError(f"{where}: 'trainer' must be an object of strings with 'spec', 'distribution' "
                                    f"and 'version', got {raw!r:.120}")
    return dict(raw)


def _source(i: int, item: Any, where: str) -> ManifestSource:
    """``sources[i]``, checked; each refusal names the field."""
    if not isinstance(item, dict):
        raise TrainingManifestError(f"{where}: sources[{i}] must be an object, got {type(item).__name__}")
    name = item.get("name")
    if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
        raise TrainingManifestError(f"{where}: sources[{i}].name = {name!r:.80}: must be 1-64 characters of a-z, 0-9, "
                                    "'_', '.' and '-', starting with a letter or digit")
    label = f"sources[{i}] ({name!r})"
    unknown = sorted(set(item) - {*_SOURCE_REQUIRED, *_SOURCE_OPTIONAL})
    if unknown:
        raise TrainingManifestError(f"{where}: {label}: unknown key(s) {unknown!r:.200}; a source has "
                                    f"{', '.join(_SOURCE_REQUIRED)} and optionally {', '.join(_SOURCE_OPTIONAL)}")
    missing = [k for k in _SOURCE_REQUIRED if k not in item]
    if missing:
        raise TrainingManifestError(f"{where}: {label} lacks {', '.join(map(repr, missing))}")
    weight = item["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise TrainingManifestError(f"{where}: {label}.weight = {weight!r:.40}: must be a finite number > 0")
    for key in ("corpus", "snapshot_id", "contract"):
        if not isinstance(item[key], str) or not item[key]:
            raise TrainingManifestError(f"{where}: {label}.{key} = {item[key]!r:.80}: must be a non-empty string")
    shards = _shard_entries(item["shards"], f"{label}.shards", where)
    if not shards:
        raise TrainingManifestError(f"{where}: {label}.shards is empty: the source has no healthy shard to train on")
    quarantined = item.get("quarantined", [])
    if not isinstance(quarantined, list) or not all(isinstance(q, str) for q in quarantined):
        raise TrainingManifestError(f"{where}: {label}.quarantined must be a list of paths")
    for key in ("max_epochs", "max_tokens"):
        value = item.get(key)
        if key in item and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TrainingManifestError(f"{where}: {label}.{key} = {value!r:.40}: must be an int >= 1 (absent: no cap)")
    return ManifestSource(
        name=name, weight=float(weight), corpus=item["corpus"], snapshot_id=item["snapshot_id"],
        contract=item["contract"], shards=shards,
        eval_shards=_shard_entries(item.get("eval_shards", []), f"{label}.eval_shards", where),
        quarantined=tuple(quarantined),
        tokens=_tokens_ref(item.get("tokens"), where, f"{label}.tokens", mixture=True),
        max_epochs=item.get("max_epochs"), max_tokens=item.get("max_tokens"),
    )


def _sources(raw: Any, where: str) -> tuple[ManifestSource, ...]:
    """Format 2's ``sources``: unique names (also as metric names), one tokenizer and one block size."""
    if not isinstance(raw, list) or not raw:
        raise TrainingManifestError(f"{where}: 'sources' must be a non-empty list of sources, got {raw!r:.80}")
    sources: list[ManifestSource] = []
    for i, item in enumerate(raw):
        source = _source(i, item, where)
        for j, other in enumerate(sources):
            if other.name == source.name:
                raise TrainingManifestError(f"{where}: sources[{i}].name = {source.name!r}: duplicate, sources[{j}] "
                                            "has the same name")
            if metric_name(other.name) == metric_name(source.name):
                raise TrainingManifestError(
                    f"{where}: sources[{i}].name = {source.name!r}: its metrics would share the name "
                    f"{metric_name(source.name)!r} with sources[{j}] ({other.name!r}); rename one")
        sources.append(source)
    # Packed all at once by the run's tokenize stage: before it, a data gate's manifest names no source's
    # tokens; after it, every source's (the trainer refuses to train one that names none).
    unpacked = [i for i, source in enumerate(sources) if source.tokens is None]
    if unpacked and len(unpacked) < len(sources):
        i = unpacked[0]
        raise TrainingManifestError(f"{where}: sources[{i}] ({sources[i].name!r}).tokens: the source names no packed "
                                    "tokens while others do; a mixture's sources are packed together, with one tokenizer")
    if unpacked:
        return tuple(sources)
    first = sources[0]
    assert first.tokens is not None
    for i, source in enumerate(sources[1:], start=1):
        assert source.tokens is not None
        if source.tokens.tokenizer_sha256 != first.tokens.tokenizer_sha256:
            raise TrainingManifestError(
                f"{where}: sources[{i}] ({source.name!r}).tokens.tokenizer_sha256 = {source.tokens.tokenizer_sha256} "
                f"differs from sources[0] ({first.name!r}).tokens.tokenizer_sha256 = {first.tokens.tokenizer_sha256}: "
                "a mixture is packed with the run's one tokenizer; re-tokenize one of them")
        if source.tokens.block_size != first.tokens.block_size:
            raise TrainingManifestError(
                f"{where}: sources[{i}] ({source.name!r}).tokens.block_size = {source.tokens.block_size} differs from "
                f"sources[0] ({first.name!r}).tokens.block_size = {first.tokens.block_size}: every source's samples "
                "must have one length; re-pack one of them")
    return tuple(sources)


def _format(data: Mapping[str, Any], where: str) -> int:
    version = data.get("format", 1)
    if isinstance(version, bool) or version not in TRAINING_MANIFEST_FORMATS:
        raise TrainingManifestError(f"{where}: format = {version!r:.40}: this trainer reads TrainingManifest formats "
                                    f"{', '.join(map(str, TRAINING_MANIFEST_FORMATS))}")
    if version == 1 and "sources" in data:
        raise TrainingManifestError(f"{where}: 'sources' is format {MIXTURE_FORMAT}'s: a manifest listing sources says "
                                    f'"format": {MIXTURE_FORMAT}')
    return int(version)


def check_training_manifest(data: Mapping[str, Any], where: str, *, path: str = "") -> TrainingManifest:
    """A TrainingManifest's wire form, parsed and checked field by field (``TrainingManifestError``
    naming the field), under the content hash it has (not compared with its ``sha256`` key: that is
    ``load_training_manifest``'s). kiln's writer checks the manifests it builds with this too."""
    try:
        actual = training_manifest_sha256(data)
    except UnicodeEncodeError as exc:  # JSON can spell a lone surrogate ("\\ud800"); UTF-8 cannot hold it
        raise TrainingManifestError(f"{where}: a string holds a lone surrogate {exc.object[exc.start:exc.end]!r}, "
                                    "which no UTF-8 manifest kiln issued holds") from None
    version = _format(data, where)
    trainer = _trainer_record(data.get("trainer"), where)
    if version == MIXTURE_FORMAT:
        extra = sorted(set(data) - _MIXTURE_KEYS)
        if extra:
            raise TrainingManifestError(f"{where}: unexpected top-level key(s) {extra!r:.200} in a format-"
                                        f"{MIXTURE_FORMAT} manifest: its data is named per source, in 'sources'")
        sources = _sources(data.get("sources"), where)
        summary = mixture_summary(data["sources"])
        return TrainingManifest(
            snapshot_id=summary["snapshot_id"], corpus=summary["corpus"], contract=summary["contract"],
            shards=tuple(e for s in sources for e in s.shards), eval_shards=tuple(e for s in sources for e in s.eval_shards),
            quarantined=tuple(q for s in sources for q in s.quarantined),
            tokens=sources[0].tokens if len(sources) == 1 else None, trainer=trainer, format=version,
            sources=sources, sha256=actual, path=path,
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
        trainer=trainer,
        format=version,
        sha256=actual,
        path=path,
    )


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
    return check_training_manifest(data, where, path=str(Path(path).resolve()))

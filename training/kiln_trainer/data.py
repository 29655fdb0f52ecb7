"""Training data: only the shards a TrainingManifest lists, hash-checked, as a byte stream.

Pipeline (every rank does the same, deterministically)::

    manifest.json ──verify content hash──► shards (in listed order) ──verify each file's sha256──►
    column ``text`` (utf-8) ──► doc bytes + separator byte, concatenated ──► the global stream
    ──► contiguous slice ``[rank*N/W, (rank+1)*N/W)`` ──► windows of block_size+1 bytes

Position: the windows of optimizer step ``s`` on rank ``r`` are drawn from a fresh
``torch.Generator`` seeded with ``H(seed, rank, step, data_salt)``. The data position *is* the
step (plus the salt the loss guard bumps when it skips a window), so a resumed run draws exactly the
windows the uninterrupted run would have drawn, and no sampler state needs saving beyond that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from kiln_trainer.checkpoint_manifest import canonical_json, sha256_file
from kiln_trainer.errors import ManifestError, ShardIntegrityError

TRAINING_MANIFEST_KIND = "kiln.TrainingManifest"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    path: str
    sha256: str
    rows: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingManifest:
    """The trainer's own parse of kiln's TrainingManifest wire format (it never imports kiln)."""

    snapshot_id: str
    corpus: str
    contract: str
    shards: tuple[ShardEntry, ...]
    eval_shards: tuple[ShardEntry, ...]
    quarantined: tuple[str, ...] = field(default=())
    sha256: str
    path: str = ""
    """Where it was read from (not part of the content)."""


def _shard_entries(raw: Any, key: str, where: str) -> tuple[ShardEntry, ...]:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: {key!r} must be a list")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ManifestError(f"{where}: {key}[{i}] must be an object")
        try:
            path, digest, rows = item["path"], item["sha256"], item["rows"]
        except KeyError as exc:
            raise ManifestError(f"{where}: {key}[{i}] lacks {exc.args[0]!r}") from exc
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise ManifestError(f"{where}: {key}[{i}].path must be an absolute path, got {path!r}")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ManifestError(f"{where}: {key}[{i}].sha256 must be 64 hex chars")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ManifestError(f"{where}: {key}[{i}].rows must be an int >= 0")
        entries.append(ShardEntry(path=path, sha256=digest, rows=rows))
    return tuple(entries)


def load_training_manifest(path: str | Path) -> TrainingManifest:
    """Read a TrainingManifest JSON and check its content hash; raise ManifestError otherwise."""
    where = str(path)
    try:
        raw_bytes = Path(path).read_bytes()
    except OSError as exc:
        raise ManifestError(f"{where}: cannot read training manifest: {exc}") from exc
    try:
        data = json.loads(raw_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != TRAINING_MANIFEST_KIND:
        raise ManifestError(f"{where}: kind is not {TRAINING_MANIFEST_KIND!r}")
    declared = data.get("sha256")
    body = {k: v for k, v in data.items() if k not in ("kind", "sha256")}
    actual = hashlib.sha256(canonical_json(body)).hexdigest()
    if declared != actual:
        raise ManifestError(
            f"{where}: content hash mismatch (declared {declared}, computed {actual}); "
            "the manifest was edited after it was issued"
        )
    for key in ("snapshot_id", "corpus", "contract"):
        if not isinstance(data.get(key), str):
            raise ManifestError(f"{where}: {key!r} must be a string")
    shards = _shard_entries(data.get("shards"), "shards", where)
    if not shards:
        raise ManifestError(f"{where}: 'shards' is empty: nothing to train on")
    eval_shards = _shard_entries(data.get("eval_shards", []), "eval_shards", where)
    quarantined = data.get("quarantined", [])
    if not isinstance(quarantined, list):
        raise ManifestError(f"{where}: 'quarantined' must be a list")
    return TrainingManifest(
        snapshot_id=data["snapshot_id"],
        corpus=data["corpus"],
        contract=data["contract"],
        shards=shards,
        eval_shards=eval_shards,
        quarantined=tuple(quarantined),
        sha256=actual,
        path=str(Path(path).resolve()),
    )


def read_verified_texts(entry: ShardEntry) -> list[str]:
    """The ``text`` column of one shard, after checking the file's sha256 against the manifest."""
    path = Path(entry.path)
    if not path.is_file():
        raise ShardIntegrityError(f"shard {path} listed in the manifest does not exist")
    actual = sha256_file(path)
    if actual != entry.sha256:
        raise ShardIntegrityError(
            f"shard {path} sha256 mismatch (manifest {entry.sha256}, on disk {actual}); refusing to train on it"
        )
    try:
        table = pq.read_table(path, columns=["text"])
    except Exception as exc:  # pyarrow raises several types; the shard is unusable either way
        raise ShardIntegrityError(f"shard {path}: cannot read column 'text': {exc}") from exc
    return [t for t in table.column("text").to_pylist() if t is not None]


def build_byte_stream(entries: tuple[ShardEntry, ...] | list[ShardEntry], separator: int) -> np.ndarray:
    """Docs of all shards, in manifest order, each followed by the separator byte, as uint8."""
    sep = bytes([separator])
    chunks: list[bytes] = []
    for entry in entries:
        for text in read_verified_texts(entry):
            chunks.append(text.encode("utf-8"))
            chunks.append(sep)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def rank_slice(stream: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Contiguous, disjoint, byte-balanced share of the stream for one rank."""
    n = len(stream)
    return stream[rank * n // world_size : (rank + 1) * n // world_size]


def _step_seed(seed: int, rank: int, step: int, salt: int) -> int:
    digest = hashlib.sha256(f"kiln-data:{seed}:{rank}:{step}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class WindowSampler:
    """Random windows of one rank's stream; the batch of a step depends only on (seed, rank, step, salt)."""

    def __init__(
        self, stream: np.ndarray, *, block_size: int, batch_size: int, accum_steps: int, seed: int, rank: int
    ) -> None:
        if len(stream) < block_size + 2:
            raise ShardIntegrityError(
                f"rank {rank} has only {len(stream)} bytes of training data; need > block_size+1 "
                f"({block_size + 1}). Use more shards or fewer ranks."
            )
        self.stream = torch.from_numpy(stream)
        self.block_size = block_size
        self.batch_size = batch_size
        self.accum_steps = accum_steps
        self.seed = seed
        self.rank = rank
        self._offsets = torch.arange(block_size + 1)

    def step_batches(self, step: int, salt: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) int64 pairs, one per micro-batch, for optimizer step ``step`` (1-based)."""
        gen = torch.Generator().manual_seed(_step_seed(self.seed, self.rank, step, salt))
        high = len(self.stream) - self.block_size - 1
        starts = torch.randint(0, high + 1, (self.accum_steps, self.batch_size), generator=gen)
        windows = self.stream[starts.unsqueeze(-1) + self._offsets].long()
        return [(windows[m, :, :-1], windows[m, :, 1:]) for m in range(self.accum_steps)]


def eval_windows(stream: np.ndarray, block_size: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of block_size+1 bytes from the start of the stream (deterministic)."""
    n = min(max_windows, (len(stream) - 1) // block_size)
    if n < 1:
        raise ShardIntegrityError(f"eval stream has {len(stream)} bytes; need > block_size ({block_size})")
    data = torch.from_numpy(stream)
    starts = torch.arange(n) * block_size
    return data[starts.unsqueeze(-1) + torch.arange(block_size + 1)].long()

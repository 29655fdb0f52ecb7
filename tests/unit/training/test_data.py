"""TrainingManifest parsing/hash check, shard verification, rank split, resumable sampling."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from kiln_trainer.data import (
    WindowSampler,
    build_byte_stream,
    eval_windows,
    load_training_manifest,
    rank_slice,
)
from kiln_trainer.errors import ManifestError, ShardIntegrityError
from trainer_fixtures import canonical_json, stdlib_sources, write_shard, write_training_manifest


def test_manifest_loads_and_hash_matches(corpus: Path) -> None:
    m = load_training_manifest(corpus)
    assert m.snapshot_id.endswith(".dir") and len(m.shards) == 3 and len(m.eval_shards) == 1
    assert m.sha256 == json.loads(corpus.read_text())["sha256"]


def test_manifest_hash_mismatch_is_rejected(corpus: Path, tmp_path: Path) -> None:
    doc = json.loads(corpus.read_text())
    doc["shards"] = doc["shards"][:1]  # drop shards without re-issuing the hash
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="content hash mismatch"):
        load_training_manifest(edited)


def _reissue(doc: dict, path: Path) -> Path:
    """Write ``doc`` with a correct content hash, as a (buggy) issuer would."""
    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")}
    doc["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(kind="kiln.Other"), "kind"),
        (lambda d: d.update(shards=[]), "empty"),
        (lambda d: d["shards"][0].update(path="relative.parquet"), "absolute"),
        (lambda d: d["shards"][0].pop("sha256"), "sha256"),
        (lambda d: d["shards"][0].update(rows=-1), "rows"),
        (lambda d: d.update(snapshot_id=3), "snapshot_id"),
    ],
)
def test_malformed_manifest_is_rejected(corpus: Path, tmp_path: Path, mutate, message: str) -> None:
    doc = json.loads(corpus.read_text())
    mutate(doc)
    with pytest.raises(ManifestError, match=message):
        load_training_manifest(_reissue(doc, tmp_path / "m.json"))


def test_not_json_is_a_manifest_error(tmp_path: Path) -> None:
    bad = tmp_path / "m.json"
    bad.write_text("{nope")
    with pytest.raises(ManifestError, match="not JSON"):
        load_training_manifest(bad)


def test_shard_hash_mismatch_is_rejected(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "s.parquet", stdlib_sources(20_000))
    manifest = load_training_manifest(write_training_manifest(tmp_path / "m.json", [shard], []))
    assert len(build_byte_stream(manifest.shards, 0)) > 20_000
    # Same size, one byte different: only a content hash notices.
    data = bytearray(Path(shard["path"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(shard["path"]).write_bytes(bytes(data))
    with pytest.raises(ShardIntegrityError, match="sha256 mismatch"):
        build_byte_stream(manifest.shards, 0)
    Path(shard["path"]).unlink()
    with pytest.raises(ShardIntegrityError, match="does not exist"):
        build_byte_stream(manifest.shards, 0)


def test_stream_is_docs_joined_by_separator(tmp_path: Path) -> None:
    docs = [("a", "héllo"), ("b", "world")]
    shard = write_shard(tmp_path / "s.parquet", docs)
    manifest = load_training_manifest(write_training_manifest(tmp_path / "m.json", [shard], []))
    stream = build_byte_stream(manifest.shards, 30)
    assert stream.tobytes() == "héllo".encode() + b"\x1e" + b"world\x1e"


def test_rank_slices_are_disjoint_and_cover_the_stream() -> None:
    stream = np.arange(1001, dtype=np.int64).astype(np.uint8)
    for world in (1, 2, 3, 8):
        parts = [rank_slice(stream, r, world) for r in range(world)]
        assert sum(len(p) for p in parts) == len(stream)
        assert np.array_equal(np.concatenate(parts), stream)
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_sampler_batches_depend_only_on_seed_rank_step_salt() -> None:
    stream = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8).copy()

    def make(rank: int = 0) -> WindowSampler:
        return WindowSampler(stream, block_size=16, batch_size=4, accum_steps=2, seed=7, rank=rank)

    a, b = make(), make()
    torch.manual_seed(0)  # the global RNG must not matter
    first = a.step_batches(5)
    torch.manual_seed(123)
    again = b.step_batches(5)
    assert len(first) == 2
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (4, 16) and x1.dtype == torch.int64
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one byte
    assert not torch.equal(a.step_batches(6)[0][0], first[0][0])
    assert not torch.equal(a.step_batches(5, salt=1)[0][0], first[0][0])
    assert not torch.equal(make(rank=1).step_batches(5)[0][0], first[0][0])


def test_sampler_refuses_too_little_data() -> None:
    with pytest.raises(ShardIntegrityError, match="rank 1"):
        WindowSampler(np.zeros(10, dtype=np.uint8), block_size=16, batch_size=1, accum_steps=1, seed=0, rank=1)


def test_eval_windows_are_deterministic_and_bounded() -> None:
    stream = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8).copy()
    w = eval_windows(stream, block_size=16, max_windows=10)
    assert w.shape == (10, 17)
    assert torch.equal(w, eval_windows(stream, block_size=16, max_windows=10))
    assert eval_windows(stream, block_size=16, max_windows=10_000).shape[0] == (len(stream) - 1) // 16
    with pytest.raises(ShardIntegrityError):
        eval_windows(stream[:10], block_size=16, max_windows=4)

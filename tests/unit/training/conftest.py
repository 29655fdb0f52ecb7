"""Session fixtures for the trainer tests (helpers live in trainer_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_fixtures import stdlib_sources, write_shard, write_training_manifest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TrainingManifest over 3 training shards (~600 kB) and 1 eval shard (~100 kB)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = stdlib_sources(700_000)
    split = max(1, len(docs) * 6 // 7)
    train_docs, eval_docs = docs[:split], docs[split:]
    shards = [write_shard(root / f"train-{i:05d}.parquet", train_docs[i::3]) for i in range(3)]
    eval_shards = [write_shard(root / "eval-00000.parquet", eval_docs)]
    return write_training_manifest(root / "manifest.json", shards, eval_shards)

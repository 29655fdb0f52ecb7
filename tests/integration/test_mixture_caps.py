"""A mixture's caps from its TOML file to the trainer's manifest reader, through the DAG's data stages
in process on real snapshots: a source's ``max_epochs`` / ``max_tokens``, and ``on_exhausted = "stop"``
capping a source without one at an epoch, are what the data gate writes into each source's entry of
the training manifest (an uncapped mixture's entries, which carry none, are
``test_mixture_stages.py``'s). The trainer's stop at a cap is
``tests/unit/training/test_train_mixture.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln import runs, stages
from kiln.policy import SANDBOX
from kiln.refs import PinnedMixture, ShardReport, TrainingManifest
from kiln_trainer.training_manifest import load_training_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kiln" / "data"))  # the prose fixture

from webtext_fixtures import prose_documents, split, table, write_corpus

pytestmark = pytest.mark.slow
KEY = "kiln_sandbox/manual__caps"
CODE = {"name": "code", "corpus": "code", "weight": 0.7}
PROSE = {"name": "prose", "corpus": "prose", "contract": "web-text@1", "weight": 0.3}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str) -> Path:
    """KILN_HOME with two healthy corpora (``code``: the stdlib sample; ``prose``: web text) and a
    mixtures folder; the data gate logs its reports to the test MLflow server."""
    from kiln import settings as kiln_settings
    from kiln.data import mixtures
    from kiln.data.corpus import build_corpus, parquet_bytes

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    monkeypatch.delenv("KILN_DVC_REMOTE_ENDPOINT", raising=False)
    root = kiln_settings.load().corpus_root
    build_corpus(root / "code", shards=2, seed=5, max_bytes=80_000)
    docs = prose_documents()
    write_corpus(root / "prose", split(docs[:60], 2))
    (root / "prose" / "eval").mkdir()
    (root / "prose" / "eval" / "eval-00000.parquet").write_bytes(parquet_bytes(table(docs[300:310])))
    folder = tmp_path / "mixtures"
    folder.mkdir()
    monkeypatch.setattr(mixtures, "mixtures_dir", lambda: folder)
    return folder


def gated_sources(folder: Path, name: str, sources: list[dict[str, Any]], top: str = "") -> list[dict[str, Any]]:
    """The mixture file written, snapshotted, validated and gated: the training manifest's sources."""
    lines = [f'description = "{name} for a test"', top]
    for source in sources:
        lines += ["[[sources]]", *(f"{k} = {json.dumps(v)}" for k, v in source.items())]
    (folder / f"{name}.toml").write_text("\n".join(lines) + "\n")
    params = {"mixture": name, "recipe": "tiny.toml"}
    pinned = stages.snapshot_run_stage(SANDBOX, params)
    assert isinstance(pinned, PinnedMixture)
    batches = []
    for batch in stages.run_shard_batches(SANDBOX, pinned):
        reports = stages.validate_run_stage(SANDBOX, params, pinned, batch, f"{KEY}_{name}")
        batches.append([ShardReport.from_json(json.loads(json.dumps(r.as_xcom().to_json()))) for r in reports])
    stages.data_gate_run_stage(SANDBOX, params, pinned, batches, f"{KEY}_{name}")
    path = runs.run_dir(f"{KEY}_{name}") / runs.TRAINING_MANIFEST
    manifest = TrainingManifest.read(path)
    assert manifest.sources is not None
    read = load_training_manifest(path)  # the trainer's reader takes them, under the same hash
    assert read.sha256 == manifest.sha256
    assert [(s["name"], s.get("max_epochs"), s.get("max_tokens")) for s in manifest.sources] == \
        [(s.name, s.max_epochs, s.max_tokens) for s in read.data_sources]
    return manifest.sources


def test_a_sources_caps_reach_its_training_manifest_entry(home: Path) -> None:
    capped = gated_sources(home, "capped", [{**CODE, "max_tokens": 20_000}, {**PROSE, "max_epochs": 2}])
    assert [{k: s.get(k) for k in ("max_epochs", "max_tokens")} for s in capped] == \
        [{"max_epochs": None, "max_tokens": 20_000}, {"max_epochs": 2, "max_tokens": None}]
    stop = gated_sources(home, "stop", [{**CODE, "max_epochs": 3}, PROSE], top='on_exhausted = "stop"')
    assert [(s.get("max_epochs"), s.get("max_tokens")) for s in stop] == [(3, None), (1, None)]

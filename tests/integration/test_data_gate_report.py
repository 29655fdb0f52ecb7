"""The DAG's data path on a real corpus and a real MLflow server: snapshot → validate → data gate.

What lies in a snapshot's ``train/`` but is not a shard reaches the quarantine report (JSON and the
MLflow artifacts), as ``kiln validate`` reports it: named, never validated, never trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import settings as kiln_settings
from kiln import stages
from kiln.data.corpus import build_corpus
from kiln.policy import SANDBOX

pytestmark = pytest.mark.slow


def test_entries_of_train_that_are_not_shards_are_named_in_the_published_report(tmp_path, monkeypatch, mlflow_uri):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    corpus = kiln_settings.load().corpus_root / "scratch-corpus"
    build_corpus(corpus, shards=2)
    (corpus / "train" / "NOTES.txt").write_text("not a shard")
    snap = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    key = "kiln_sandbox/manual__stray"
    reports = [stages.validate_stage(SANDBOX, snap, batch, key) for batch in stages.shard_batches(SANDBOX, snap)]

    data = stages.data_gate_stage(SANDBOX, snap, reports, key)

    body = json.loads(Path(data.report).read_text())
    assert [Path(e["path"]).name for e in body["skipped"]] == ["NOTES.txt"]
    assert body["shards"] == 2 and data.healthy == 2, "the stray file was neither validated nor quarantined"
    assert "NOTES.txt" in Path(data.report_html).read_text()
    import mlflow

    artifacts = mlflow.MlflowClient(tracking_uri=mlflow_uri).list_artifacts(data.mlflow_run_id, "quarantine")
    assert {Path(a.path).name for a in artifacts} >= {"quarantine-report.json", "quarantine-report.html"}

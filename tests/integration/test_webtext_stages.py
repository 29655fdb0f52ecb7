"""web-text@1 through the DAG's stages in process, on a real snapshot (a real MLflow server takes the
data gate's report): validate (document rules, signatures kept in the run) -> data gate (near-duplicates
across shards, quarantine, drop lists in the manifest) -> tokenizer -> tokenize -> tokens. The packed
corpus holds exactly the documents the contract kept: a dropped document never reaches training."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from kiln import runs, stages
from kiln.errors import RunMismatchError
from kiln.policy import SANDBOX
from kiln.refs import ShardReport, TrainingManifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kiln" / "data"))  # the prose fixture

from webtext_fixtures import poisoned, prose_documents, split, table, write_corpus

pytestmark = pytest.mark.slow
POLICY = dataclasses.replace(SANDBOX, contract="web-text@1")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str) -> Path:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    monkeypatch.delenv("KILN_DVC_REMOTE_ENDPOINT", raising=False)
    return tmp_path / "kiln"


def test_dropped_documents_never_reach_the_packed_tokens(home: Path) -> None:
    import pyarrow.parquet as pq

    from kiln import settings as kiln_settings
    from kiln.data.corpus import parquet_bytes
    from kiln_trainer.packed import load_token_manifest

    docs = prose_documents()
    parts = split(docs[:200], 5)  # 40 documents a shard
    parts[3] = poisoned("pii", parts[3])
    parts[4] = [(f"copy-{i}", text, source) for i, (_, text, source) in enumerate(poisoned("near_duplicates", parts[4],
                                                                                            donors=parts[0]))]
    root = kiln_settings.load().corpus_root / "webtext-corpus"
    write_corpus(root, parts)
    (root / "eval").mkdir()
    (root / "eval" / "eval-00000.parquet").write_bytes(parquet_bytes(table(docs[300:310])))

    key = "kiln_sandbox/manual__webtext"
    snap = stages.snapshot_stage(POLICY, "webtext-corpus")
    batches = [stages.validate_stage(POLICY, snap, batch, key) for batch in stages.shard_batches(POLICY, snap)]
    assert len(list((runs.run_dir(key) / runs.VALIDATION_SUBDIR / runs.VALIDATION_SIGNATURES_SUBDIR).iterdir())) >= 3
    # What the validate_shards tasks push: each shard's dropped rows as a count and a digest, never the
    # list (the run's validation records hold it).
    xcoms = [json.loads(json.dumps([r.as_xcom().to_json() for r in batch])) for batch in batches]
    dropping = [r for batch in xcoms for r in batch if r.get("dropped")]
    assert dropping and all("rows" not in r["dropped"] and r["dropped"]["rows_count"] > 0 for r in dropping)
    said = [[ShardReport.from_json(r) for r in batch] for batch in xcoms]
    # A rewritten drop list is refused, as a full report or as its digest, before anything is written.
    full = next(r for batch in batches for r in batch if r.dropped and r.verdict == "healthy")
    fewer = dataclasses.replace(full, dropped={**full.dropped, "rows": full.dropped["rows"][1:]})
    recounted = full.as_xcom()
    recounted = dataclasses.replace(recounted, dropped={**recounted.dropped, "rows_count": 0})
    for forged in (fewer, recounted, fewer.as_xcom()):
        with pytest.raises(RunMismatchError, match="disagree with the run's own validation records"):
            stages.data_gate_stage(POLICY, snap, [[forged if r.path == full.path else r for r in b] for b in said], key)
    assert not (runs.run_dir(key) / runs.TRAINING_MANIFEST).exists()
    data = stages.data_gate_stage(POLICY, snap, said, key)
    assert sorted(q.path for q in data.quarantined) == ["shard-00003.parquet", "shard-00004.parquet"]
    assert data.healthy == 3
    report = json.loads(Path(data.report).read_text())
    assert report["dropped"]["healthy_shards"]["documents"] > 0
    assert "near_duplicate" in report["dropped"]["all_shards"]["by_rule"] and "pii" in report["dropped"]["all_shards"]["by_rule"]

    manifest = TrainingManifest.read(data.manifest)
    kept = 0
    for entry in manifest.shards:
        rows = pq.read_table(entry["path"], columns=["text"]).num_rows
        assert entry["drop_rows"] and all(0 <= r < rows for r in entry["drop_rows"])
        kept += rows - len(entry["drop_rows"])

    params = {"recipe": "tiny.toml"}
    tokenizer = stages.tokenizer_stage(POLICY, data, params, key)
    for batch in stages.token_parts(POLICY, data):
        stages.tokenize_stage(POLICY, data, tokenizer, batch, params, key)
    tokenized = stages.tokens_stage(POLICY, data, tokenizer, params, key)
    assert tokenized.tokens is not None and tokenized.tokens.documents == kept
    packed = load_token_manifest(tokenized.tokens.token_manifest)
    assert packed.documents == kept < sum(e["rows"] for e in manifest.shards)

"""The tokenize stage in process, on a real snapshot (a real MLflow server takes the data gate's
report): data gate -> tokenizer -> tokenize (batches) -> tokens. The run's training manifest names
the packed tokens afterwards; every step is idempotent; a BPE is trained once per shard set and
gives the same bytes; the XComs between the tasks are references the stages check against the
run's own records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kiln import runs, stages
from kiln.errors import KilnError
from kiln.policy import SANDBOX
from kiln.refs import DataGateResult, TrainingManifest

pytestmark = pytest.mark.slow


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str) -> Path:
    """A throwaway KILN_HOME (local DVC remote); the data gate publishes its report to the test MLflow."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    monkeypatch.delenv("KILN_DVC_REMOTE_ENDPOINT", raising=False)
    return tmp_path / "kiln"


def _gated(key: str) -> DataGateResult:
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    build_corpus(kiln_settings.load().corpus_root / "scratch-corpus", shards=3, seed=2, poison=["secret"],
                 max_bytes=200_000)
    snap = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    batches = [stages.validate_stage(SANDBOX, snap, batch, key) for batch in stages.shard_batches(SANDBOX, snap)]
    return stages.data_gate_stage(SANDBOX, snap, batches, key)


def _tokenize(data: DataGateResult, params: dict, key: str, policy=SANDBOX) -> DataGateResult:
    tokenizer = stages.tokenizer_stage(policy, data, params, key)
    for parts in stages.token_parts(policy, data):
        stages.tokenize_stage(policy, data, tokenizer, parts, params, key)
    return stages.tokens_stage(policy, data, tokenizer, params, key)


def test_the_run_manifest_names_its_packed_tokens_and_every_step_is_idempotent(home):
    from kiln_trainer.packed import load_token_manifest, verify_token_shards

    key = "kiln_sandbox/manual__tokenize"
    data = _gated(key)
    assert data.tokens is None and data.healthy == 2
    params = {"recipe": "tiny.toml"}
    tokenized = _tokenize(data, params, key)

    manifest_path = runs.run_dir(key) / runs.TRAINING_MANIFEST
    manifest = TrainingManifest.read(manifest_path)
    assert tokenized.manifest == str(manifest_path) and tokenized.manifest_sha256 == manifest.sha256 != data.manifest_sha256
    assert manifest.shards == TrainingManifest.read(manifest_path).shards
    assert manifest.tokens == {"manifest": tokenized.tokens.token_manifest, "sha256": tokenized.tokens.token_manifest_sha256}
    assert manifest.with_tokens("", None).sha256 == data.manifest_sha256, "the same shards, only the tokens added"
    packed = load_token_manifest(tokenized.tokens.token_manifest)
    verify_token_shards(packed, deep=True)
    assert packed.sha256 == tokenized.tokens.token_manifest_sha256 and packed.samples == tokenized.tokens.samples > 0
    assert tokenized.tokens.tokenizer_kind == "byte" and tokenized.tokens.vocab_size == 257
    assert Path(tokenized.tokens.token_manifest).is_relative_to(home / "tokens")

    # Again, from the same XComs (a cleared task group): nothing changes, nothing is rewritten.
    before = manifest_path.read_bytes(), Path(tokenized.tokens.token_manifest).stat().st_mtime_ns
    assert _tokenize(data, params, key) == tokenized
    assert (manifest_path.read_bytes(), Path(tokenized.tokens.token_manifest).stat().st_mtime_ns) == before
    # The data gate cleared and run again keeps the manifest that names the tokens.
    from kiln.stages.records import recorded_snapshot

    snap = recorded_snapshot(manifest.snapshot_id)
    pinned = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    assert pinned.id == snap.id
    batches = [stages.validate_stage(SANDBOX, pinned, batch, key) for batch in stages.shard_batches(SANDBOX, pinned)]
    again = stages.data_gate_stage(SANDBOX, pinned, batches, key)
    assert again.manifest_sha256 == data.manifest_sha256 and manifest_path.read_bytes() == before[0]
    assert _tokenize(again, params, key) == tokenized

    # Another run of the same shards with the same tokenizer reuses the packed corpus.
    other = "kiln_sandbox/manual__tokenize_again"
    assert _tokenize(_gated(other), params, other).tokens == tokenized.tokens


def test_a_bpe_recipe_trains_its_tokenizer_once_and_deterministically(home):
    from kiln_trainer.tokenizer import load_tokenizer

    key = "kiln_sandbox/manual__bpe"
    data = _gated(key)
    params = {"recipe": "tiny-bpe.toml"}
    first = stages.tokenizer_stage(SANDBOX, data, params, key)
    assert first.kind == "bpe" and first.vocab_size <= 512 and Path(first.path).name == f"{first.sha256}.json"
    assert load_tokenizer(first.path).sha256 == first.sha256
    Path(first.path).unlink()  # trained again from scratch: the same bytes
    trained = sorted((home / "tokenizers").glob("bpe-*.json"))
    assert len(trained) == 1
    trained[0].unlink()
    assert stages.tokenizer_stage(SANDBOX, data, params, key) == first

    tokenized = _tokenize(data, params, key)
    assert tokenized.tokens.tokenizer_sha256 == first.sha256 and tokenized.tokens.tokenizer_kind == "bpe"
    byte_samples = _tokenize(_gated("kiln_sandbox/manual__bytes"), {"recipe": "tiny.toml"}, "kiln_sandbox/manual__bytes")
    assert tokenized.tokens.samples < byte_samples.tokens.samples, "a BPE packs the same text into fewer tokens"


def test_a_tokenizer_reference_that_is_not_its_artifact_is_refused(home):
    key = "kiln_sandbox/manual__forged_tokenizer"
    data = _gated(key)
    params = {"recipe": "tiny.toml"}
    tokenizer = stages.tokenizer_stage(SANDBOX, data, params, key)
    forged = dataclasses.replace(tokenizer, sha256="0" * 64)
    with pytest.raises(KilnError, match="hashes to .* not the 0{64} the run chose"):
        stages.tokenize_stage(SANDBOX, data, forged, [0], params, key)
    with pytest.raises(KilnError, match="no shard of its manifest"):
        stages.tokenize_stage(SANDBOX, data, tokenizer, [7], params, key)
    other = dataclasses.replace(data, manifest_sha256="f" * 64)
    with pytest.raises(KilnError, match="disagrees with the run's own record"):
        stages.tokenizer_stage(SANDBOX, other, params, key)
    assert json.loads((runs.run_dir(key) / runs.TRAINING_MANIFEST).read_text()).get("tokens") is None


def test_with_a_tokens_remote_the_manifest_names_the_s3_copy_that_ranks_stream(home, moto_endpoint, monkeypatch, tmp_path):
    """KILN_TOKENS_REMOTE: the packed corpus is published (manifest object last) and the run's
    training manifest names the s3:// copy, whose manifest the trainer's remote reader accepts
    against the sha256 the training manifest names (a local moto server stands in for S3)."""
    import uuid

    import boto3

    from kiln_trainer.remote import open_remote_tokens

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAKILNTESTONLY0003")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", f"secret-{uuid.uuid4().hex}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"kiln-tokens-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    key = "kiln_sandbox/manual__remote_tokens"
    data = _gated(key)
    monkeypatch.setenv("KILN_DVC_REMOTE_ENDPOINT", moto_endpoint)  # after the snapshot: its remote stays local
    monkeypatch.setenv(stages.TOKENS_REMOTE_ENV, f"s3://{bucket}/packed")
    tokenized = _tokenize(data, {"recipe": "tiny.toml"}, key)

    url = tokenized.tokens.token_manifest
    assert url.startswith(f"s3://{bucket}/packed/") and url.endswith("/token_manifest.json")
    manifest = TrainingManifest.read(runs.run_dir(key) / runs.TRAINING_MANIFEST)
    assert manifest.tokens == {"manifest": url, "sha256": tokenized.tokens.token_manifest_sha256}
    listed = boto3.client("s3", endpoint_url=moto_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert {o["Key"].rsplit("/", 1)[-1] for o in listed} >= {"token_manifest.json", "tokenizer.json"}
    remote = open_remote_tokens(url.rsplit("/", 1)[0], cache_dir=tmp_path / "cache", cache_bytes=1 << 30,
                                expected_manifest_sha256=tokenized.tokens.token_manifest_sha256, endpoint_url=moto_endpoint)
    assert remote.manifest.samples == tokenized.tokens.samples
    assert remote.read([0, remote.manifest.samples - 1]).shape == (2, tokenized.tokens.block_size + 1)

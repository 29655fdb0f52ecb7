"""The trainer on token shards named by an ``s3://`` URL: a local ``moto_server`` stands in for S3
(same boto3 calls, real HTTP; the trainer finds it through boto3's own ``AWS_ENDPOINT_URL``).

One in-process run of the tiny recipe: the training manifest names the published token manifest;
the rank streams the shards and the tokenizer into its cache under the run dir, checks them, and
trains on the same samples a local read gives. A shard object corrupted on the remote afterwards is
a RemoteObjectError naming it, exit 1 (retryable: the store may heal), nothing trained."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from pathlib import Path

import pytest

from kiln_trainer import train as train_module
from kiln_trainer.config import load_recipe
from kiln_trainer.data import pack_run_tokens
from kiln_trainer.packed import load_token_manifest
from kiln_trainer.remote import publish_token_shards
from kiln_trainer.training_manifest import load_training_manifest

from training_manifests import stdlib_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
BUCKET = "kiln-train-tokens"
SHORT = ("train.steps=6", "checkpoint.every_steps=6", "train.log_every=3", "optim.warmup_steps=2")


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    import boto3

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID",
                 "KILN_TOKEN_CACHE_DIR", "KILN_TOKEN_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_TORCH_THREADS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAKILNTESTONLY0003")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", f"secret-{uuid.uuid4().hex}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=BUCKET)
    return client


def _manifest_naming(corpus: Path, out: Path, url: str, sha256: str) -> Path:
    from kiln.refs import canonical_json

    doc = json.loads(corpus.read_text())
    doc["tokens"] = {"manifest": f"{url}/token_manifest.json", "sha256": sha256}
    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")}
    doc["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    out.write_text(json.dumps(doc))
    return out


def _main(manifest: Path, run_dir: Path) -> int:
    args = ["--manifest", str(manifest), "--recipe", str(TINY), "--run-dir", str(run_dir)]
    for item in SHORT:
        args += ["--set", item]
    return train_module.main(args)


def test_training_from_s3_tokens_matches_a_local_read_and_a_corrupt_object_is_retryable(
    s3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "corpus").mkdir()
    corpus = stdlib_manifest(tmp_path / "corpus", max_chars=60_000)
    local_ref = pack_run_tokens(load_training_manifest(corpus), load_recipe(TINY), run_dir=tmp_path / "tokenize")
    local = load_token_manifest(local_ref.manifest)
    url = publish_token_shards(local, f"s3://{BUCKET}/tokens-{uuid.uuid4().hex[:8]}", client=s3)
    remote_manifest = _manifest_naming(corpus, tmp_path / "remote.json", url, local.sha256)
    local_manifest = _manifest_naming(corpus, tmp_path / "local.json", str(Path(local.path)), local.sha256)

    assert _main(remote_manifest, tmp_path / "remote-run") == 0
    assert _main(local_manifest, tmp_path / "local-run") == 0
    remote, disk = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("remote-run", "local-run"))
    assert remote["token_manifest_sha256"] == local.sha256 and remote["weights_sha256"] == disk["weights_sha256"]
    cache = tmp_path / "remote-run" / "token-cache" / "rank-00000"
    assert {p.name for p in cache.iterdir()} == {f"{s.sha256}.bin" for s in local.shards} | {
        f"{local.tokenizer['sha256']}.json"}
    assert not (tmp_path / "remote-run" / "tokens").exists()

    # The remote copy of a shard is replaced by other bytes: a fresh rank downloads it, the hash
    # refuses it, and the error names the object; exit 1 (a retry may find it healed).
    shard = local.shards[0]
    key = url.removeprefix(f"s3://{BUCKET}/") + "/" + shard.path
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"\0" * shard.bytes)
    run_dir = tmp_path / "corrupt-run"
    assert _main(remote_manifest, run_dir) == 1
    assert "RemoteObjectError" in caplog.text and f"s3://{BUCKET}/{key}" in caplog.text
    assert not (run_dir / "checkpoints").exists()

"""Packed token shards streamed from S3 into a bounded local cache: a local ``moto_server`` stands in
for S3 (same boto3 calls, real HTTP). Every object is hash-checked; a missing or corrupt one is a
retryable RemoteObjectError naming its s3:// URL."""

from __future__ import annotations

import contextlib
import sysconfig
import uuid
from pathlib import Path

import numpy as np
import pytest

from kiln_trainer.errors import RecipeError, RemoteObjectError, TokenManifestError
from kiln_trainer.loader import TokenLoader
from kiln_trainer.packed import PackedTokens, TokenManifest, pack_corpus
from kiln_trainer.remote import (
    CACHE_BYTES_ENV,
    S3ShardCache,
    cache_bytes_from_env,
    load_remote_manifest,
    open_remote_tokens,
    publish_token_shards,
)
from kiln_trainer.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow

BUCKET = "kiln-tokens"
B = 16


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAKILNTESTONLY0002")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", f"secret-{uuid.uuid4().hex}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> TokenManifest:
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    return pack_corpus(
        tmp_path_factory.mktemp("tokens"), snapshot_id="snap.dir", tokenizer=ByteTokenizer(), block_size=B,
        parts=[docs], shard_bytes=200 * (B + 1) * 2,
    )


@pytest.fixture
def remote_url(s3, local) -> str:
    return publish_token_shards(local, f"s3://{BUCKET}/tokens-{uuid.uuid4().hex[:8]}", client=s3)


def _key(url: str, name: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/") + "/" + name


def test_remote_reads_equal_local_reads_through_the_loader(s3, local, remote_url, tmp_path):
    remote = open_remote_tokens(remote_url, cache_dir=tmp_path / "cache", cache_bytes=1 << 30, client=s3,
                                expected_manifest_sha256=local.sha256)
    with TokenLoader(remote, global_batch_size=32, micro_batch_size=8, rank=0, world_size=1, seed=4) as from_s3, \
         TokenLoader(PackedTokens(local), global_batch_size=32, micro_batch_size=8, rank=0, world_size=1, seed=4) as from_disk:
        for _ in range(10):
            a, b = from_s3.next_step(), from_disk.next_step()
            assert np.array_equal(a.sample_ids, b.sample_ids)
            assert all(np.array_equal(x, y) for x, y in zip(a.micro_batches, b.micro_batches, strict=True))
    assert remote.store.stats["downloads"] <= len(local.shards)  # each shard fetched once, then cached


def test_publish_is_idempotent_and_puts_the_manifest_last(s3, local, remote_url):
    objects = s3.list_objects_v2(Bucket=BUCKET, Prefix=_key(remote_url, ""))["Contents"]
    assert len(objects) == len(local.shards) + 2  # shards, tokenizer.json, token_manifest.json
    manifest_time = next(o["LastModified"] for o in objects if o["Key"].endswith("token_manifest.json"))
    assert all(o["LastModified"] <= manifest_time for o in objects)
    before = {o["Key"]: o["ETag"] for o in objects}
    publish_token_shards(local, remote_url, client=s3)
    after = s3.list_objects_v2(Bucket=BUCKET, Prefix=_key(remote_url, ""))["Contents"]
    assert {o["Key"]: o["ETag"] for o in after} == before


def test_the_cache_stays_within_its_bound_by_evicting_whole_shards(s3, local, remote_url, tmp_path):
    bound = 3 * local.shards[0].bytes
    remote = open_remote_tokens(remote_url, cache_dir=tmp_path / "cache", cache_bytes=bound, client=s3)
    cache: S3ShardCache = remote.store
    for sample in range(0, remote.num_samples, 50):
        remote.read([sample])
        on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
        assert cache.used_bytes <= bound and on_disk <= bound
    assert cache.stats["evictions"] >= len(local.shards) - 3


def test_a_cache_left_by_an_earlier_process_is_reused_and_rehashed(s3, local, remote_url, tmp_path):
    cache_dir = tmp_path / "cache"
    first = open_remote_tokens(remote_url, cache_dir=cache_dir, cache_bytes=1 << 30, client=s3)
    first.read([0, first.num_samples - 1])
    cached = sorted(cache_dir.iterdir())
    victim = cached[0]
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # a disk error in the cache
    victim.write_bytes(bytes(data))
    second = open_remote_tokens(remote_url, cache_dir=cache_dir, cache_bytes=1 << 30, client=s3)
    assert np.array_equal(second.read([0, second.num_samples - 1]), PackedTokens(local).read([0, local.samples - 1]))
    assert second.store.stats["downloads"] == 1 and second.store.stats["hits"] == 1


def test_a_missing_remote_shard_is_a_retryable_error_naming_it(s3, local, remote_url, tmp_path):
    s3.delete_object(Bucket=BUCKET, Key=_key(remote_url, local.shards[1].path))
    remote = open_remote_tokens(remote_url, cache_dir=tmp_path / "cache", cache_bytes=1 << 30, client=s3)
    with pytest.raises(RemoteObjectError, match=rf"{remote_url}/{local.shards[1].path}: missing") as info:
        remote.read([int(remote.offsets[1])])
    assert info.value.retryable
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


def test_a_corrupt_remote_shard_is_a_retryable_error_naming_it(s3, local, remote_url, tmp_path):
    entry = local.shards[2]
    data = bytearray((Path(local.path) / entry.path).read_bytes())
    data[7] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=_key(remote_url, entry.path), Body=bytes(data))
    remote = open_remote_tokens(remote_url, cache_dir=tmp_path / "cache", cache_bytes=1 << 30, client=s3)
    with pytest.raises(RemoteObjectError, match=rf"{remote_url}/{entry.path}: corrupt: sha256") as info:
        remote.read([int(remote.offsets[2])])
    assert info.value.retryable
    assert list((tmp_path / "cache").iterdir()) == []  # nothing unverified is kept


def test_a_missing_or_unexpected_remote_manifest_is_named(s3, local, remote_url):
    with pytest.raises(TokenManifestError, match="but the training manifest names"):
        load_remote_manifest(remote_url, client=s3, expected_sha256="0" * 64)
    with pytest.raises(RemoteObjectError, match=r"s3://kiln-tokens/nowhere/token_manifest.json: missing"):
        load_remote_manifest(f"s3://{BUCKET}/nowhere", client=s3)


def test_a_cache_smaller_than_a_shard_is_refused_up_front(s3, local, remote_url, tmp_path):
    with pytest.raises(RecipeError, match="smaller than the largest shard"):
        open_remote_tokens(remote_url, cache_dir=tmp_path / "cache", cache_bytes=local.shards[0].bytes - 1, client=s3)


def test_cache_size_from_the_environment(monkeypatch):
    monkeypatch.delenv(CACHE_BYTES_ENV, raising=False)
    assert cache_bytes_from_env(123) == 123
    monkeypatch.setenv(CACHE_BYTES_ENV, "8G")
    assert cache_bytes_from_env(123) == 8 << 30
    monkeypatch.setenv(CACHE_BYTES_ENV, "lots")
    with pytest.raises(RecipeError, match=CACHE_BYTES_ENV):
        cache_bytes_from_env(123)

"""Packed token shards read straight from S3 into a bounded local cache, every object hash-checked.

::

    url = publish_token_shards(manifest, "s3://bucket/tokens/<key>")   # the tokenize stage, once
    tokens = open_remote_tokens(url, cache_dir=node_local_dir,          # every rank
                                cache_bytes=cache_bytes_from_env(8 << 30),
                                expected_manifest_sha256=sha_from_training_manifest)
    TokenLoader(tokens, ...)                                            # as for local shards

``publish_token_shards`` uploads the shards and the tokenizer, then ``token_manifest.json`` LAST
(the remote commit point), each object with its sha256 in the metadata, so a re-publish skips what
is there. The cache keeps whole shards as ``<sha256>.bin`` under ``cache_dir``; a shard is
downloaded to a temporary file while being hashed, and renamed into place only if its sha256 and
size are the manifest's. When a new shard does not fit in ``cache_bytes`` the least recently used
shards not in use are deleted. A missing, unreadable or corrupt object raises ``RemoteObjectError``
naming its ``s3://`` URL; it is retryable (the store may heal; the job's inputs are unchanged).

One cache directory per process (e.g. per local rank): the accounting is in-process. Files left
by an earlier process are adopted and re-hashed on first use. The order's ``window_shards``
decides how many shards a step touches: keep ``cache_bytes`` above a window's worth, or a
global shuffle re-downloads shards over and over. In the tests a local ``moto`` server stands in
for S3 (same boto3 calls); the endpoint comes from ``endpoint_url`` or boto3's own
``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from kiln_trainer.checkpoint_manifest import fsync_dir, sha256_file
from kiln_trainer.errors import RecipeError, RemoteObjectError, TokenManifestError
from kiln_trainer.packed import TOKEN_MANIFEST_NAME, PackedTokens, TokenManifest, TokenShardEntry, parse_token_manifest

__all__ = [
    "CACHE_BYTES_ENV",
    "S3ShardCache",
    "cache_bytes_from_env",
    "load_remote_manifest",
    "open_remote_tokens",
    "parse_s3_url",
    "publish_token_shards",
]

CACHE_BYTES_ENV = "KILN_TOKEN_CACHE_BYTES"
"""Overrides the recipe's cache size (bytes) on a node whose local disk is smaller or larger."""
SHA256_METADATA = "sha256"
_CHUNK = 8 << 20
_CACHED_RE = re.compile(r"^[0-9a-f]{64}\.bin$")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (no trailing slash)."""
    match = re.fullmatch(r"s3://([^/]+)/?(.*)", url)
    if not match or not match.group(1):
        raise RecipeError(f"remote {url!r}: must look like s3://bucket/prefix")
    return match.group(1), match.group(2).strip("/")


def cache_bytes_from_env(default: int) -> int:
    """``KILN_TOKEN_CACHE_BYTES`` if set (an int, or with a K/M/G suffix), else ``default``."""
    raw = os.environ.get(CACHE_BYTES_ENV, "").strip()
    if not raw:
        return default
    match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", raw, flags=re.IGNORECASE)
    if not match:
        raise RecipeError(f"{CACHE_BYTES_ENV} = {raw!r}: must be bytes, e.g. 8589934592 or 8G")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]


def _client(endpoint_url: str | None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _translated(exc: Exception, url: str) -> RemoteObjectError:
    """boto3's errors, at this one boundary, as a RemoteObjectError that names the object."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return RemoteObjectError(f"{url}: missing from the remote ({code}); was the tokenize stage's publish interrupted?")
        if code == "NoSuchBucket":
            return RemoteObjectError(f"{url}: the bucket does not exist ({code})")
        return RemoteObjectError(f"{url}: the remote refused the read ({code}): {exc}")
    return RemoteObjectError(f"{url}: cannot read from the remote: {exc}")


def _remote_errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def publish_token_shards(manifest: TokenManifest, url: str, *, client: Any = None, endpoint_url: str | None = None) -> str:
    """Upload a committed local token manifest's files to ``url``; the manifest object goes last."""
    bucket, prefix = parse_s3_url(url)
    client = client or _client(endpoint_url)
    root = Path(manifest.path)
    files = [(e.path, e.sha256) for e in manifest.shards] + [(manifest.tokenizer_file, manifest.tokenizer["sha256"])]
    for name, digest in files:
        key = _key(prefix, name)
        if _remote_sha256(client, bucket, key) == digest:
            continue  # already published (re-running the stage changes nothing)
        try:
            client.upload_file(str(root / name), bucket, key, ExtraArgs={"Metadata": {SHA256_METADATA: digest}})
        except _remote_errors() as exc:
            raise _translated(exc, f"s3://{bucket}/{key}") from exc
    manifest_path = root / TOKEN_MANIFEST_NAME
    key = _key(prefix, TOKEN_MANIFEST_NAME)
    try:  # LAST: readers trust a prefix only once its manifest is there
        client.upload_file(str(manifest_path), bucket, key, ExtraArgs={"Metadata": {SHA256_METADATA: sha256_file(manifest_path)}})
    except _remote_errors() as exc:
        raise _translated(exc, f"s3://{bucket}/{key}") from exc
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def _remote_sha256(client: Any, bucket: str, key: str) -> str | None:
    from botocore.exceptions import ClientError

    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError:
        return None
    return head.get("Metadata", {}).get(SHA256_METADATA)


def load_remote_manifest(
    url: str, *, client: Any = None, endpoint_url: str | None = None, expected_sha256: str | None = None
) -> TokenManifest:
    """The token manifest at ``url``, hash-checked, and equal to ``expected_sha256`` when given."""
    bucket, prefix = parse_s3_url(url)
    client = client or _client(endpoint_url)
    where = f"s3://{bucket}/{_key(prefix, TOKEN_MANIFEST_NAME)}"
    try:
        raw = client.get_object(Bucket=bucket, Key=_key(prefix, TOKEN_MANIFEST_NAME))["Body"].read()
    except _remote_errors() as exc:
        raise _translated(exc, where) from exc
    try:
        manifest = parse_token_manifest(raw, where)
    except TokenManifestError as exc:
        raise RemoteObjectError(f"{exc} (the remote copy is corrupt)") from exc
    if expected_sha256 is not None and manifest.sha256 != expected_sha256:
        raise TokenManifestError(
            f"{where}: token manifest sha256 {manifest.sha256}, but the training manifest names {expected_sha256}"
        )
    return dataclasses.replace(manifest, path=f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")


class S3ShardCache:
    """A ``ShardStore`` (see ``kiln_trainer.packed``) that fetches shards from S3 into ``cache_dir``."""

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | Path,
        cache_bytes: int,
        client: Any = None,
        endpoint_url: str | None = None,
        attempts: int = 2,
    ) -> None:
        if cache_bytes < 1:
            raise RecipeError(f"cache_bytes = {cache_bytes}: must be >= 1 (or set {CACHE_BYTES_ENV})")
        self.bucket, self.prefix = parse_s3_url(url)
        self.client = client or _client(endpoint_url)
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_bytes = cache_bytes
        self.attempts = max(1, attempts)
        self._lru: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, least recent first
        self._pins: Counter[str] = Counter()
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "downloads": 0, "downloaded_bytes": 0, "evictions": 0}
        for path in sorted(self.cache_dir.iterdir(), key=lambda p: p.stat().st_mtime):
            if _CACHED_RE.fullmatch(path.name):
                self._lru[path.name[:64]] = path.stat().st_size  # adopted; re-hashed on first use
            elif path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a download a crash interrupted

    @property
    def used_bytes(self) -> int:
        return sum(self._lru.values())

    def url_of(self, entry: TokenShardEntry) -> str:
        return f"s3://{self.bucket}/{_key(self.prefix, entry.path)}"

    def _path(self, digest: str) -> Path:
        return self.cache_dir / f"{digest}.bin"

    def acquire(self, entry: TokenShardEntry) -> Path:
        """A verified local copy of the shard, pinned (not evicted) until ``release``."""
        with self._lock:
            path = self._path(entry.sha256)
            if entry.sha256 in self._lru and entry.sha256 not in self._verified:
                if path.is_file() and path.stat().st_size == entry.bytes and sha256_file(path) == entry.sha256:
                    self._verified.add(entry.sha256)
                else:
                    self._drop(entry.sha256)
            if entry.sha256 in self._lru:
                self._lru.move_to_end(entry.sha256)
                self.stats["hits"] += 1
            else:
                self._make_room(entry)
                self._download(entry, path)
                self._lru[entry.sha256] = entry.bytes
                self._verified.add(entry.sha256)
            self._pins[entry.sha256] += 1
            return path

    def release(self, entry: TokenShardEntry) -> None:
        with self._lock:
            self._pins[entry.sha256] -= 1
            if self._pins[entry.sha256] <= 0:
                del self._pins[entry.sha256]

    def _drop(self, digest: str) -> None:
        self._lru.pop(digest, None)
        self._verified.discard(digest)
        self._path(digest).unlink(missing_ok=True)

    def _make_room(self, entry: TokenShardEntry) -> None:
        if entry.bytes > self.cache_bytes:
            raise RecipeError(
                f"token cache of {self.cache_bytes} bytes cannot hold shard {self.url_of(entry)} ({entry.bytes} bytes); "
                f"raise the cache size ({CACHE_BYTES_ENV}) or pack smaller shards"
            )
        for digest in list(self._lru):
            if self.used_bytes + entry.bytes <= self.cache_bytes:
                return
            if self._pins[digest] == 0:
                self._drop(digest)
                self.stats["evictions"] += 1
        if self.used_bytes + entry.bytes > self.cache_bytes:
            raise RecipeError(
                f"token cache of {self.cache_bytes} bytes is full of shards in use; cannot fetch {self.url_of(entry)}"
            )

    def _download(self, entry: TokenShardEntry, path: Path) -> None:
        url = self.url_of(entry)
        problem = ""
        for _ in range(self.attempts):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                digest, size = self._fetch_to(tmp, _key(self.prefix, entry.path), url)
                if digest == entry.sha256 and size == entry.bytes:
                    os.replace(tmp, path)
                    fsync_dir(self.cache_dir)
                    self.stats["downloads"] += 1
                    self.stats["downloaded_bytes"] += size
                    return
                problem = (
                    f"corrupt: sha256 {digest} and {size} bytes, "
                    f"the token manifest says {entry.sha256} and {entry.bytes} bytes"
                )
            finally:
                tmp.unlink(missing_ok=True)
        raise RemoteObjectError(f"{url}: {problem} (after {self.attempts} download(s))")

    def fetch_file(self, name: str, sha256: str) -> Path:
        """A small object next to the shards (the tokenizer artifact), hash-checked, kept as
        ``<sha256>.<suffix>`` in the cache (outside the shard accounting)."""
        path = self.cache_dir / f"{sha256}{Path(name).suffix or '.bin'}"
        if path.is_file() and sha256_file(path) == sha256:
            return path
        url = f"s3://{self.bucket}/{_key(self.prefix, name)}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            digest, _ = self._fetch_to(tmp, _key(self.prefix, name), url)
            if digest != sha256:
                raise RemoteObjectError(f"{url}: corrupt: sha256 {digest}, the token manifest says {sha256}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _fetch_to(self, tmp: Path, key: str, url: str) -> tuple[str, int]:
        digest, size = hashlib.sha256(), 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with open(tmp, "wb") as fh:
                while chunk := body.read(_CHUNK):
                    fh.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                fh.flush()
                os.fsync(fh.fileno())
        except _remote_errors() as exc:
            raise _translated(exc, url) from exc
        return digest.hexdigest(), size


def open_remote_tokens(
    url: str,
    *,
    cache_dir: str | Path,
    cache_bytes: int,
    client: Any = None,
    endpoint_url: str | None = None,
    expected_manifest_sha256: str | None = None,
    vocab_size: int | None = None,
) -> PackedTokens:
    """``PackedTokens`` over the token manifest at ``url``, its shards fetched on demand into the cache."""
    client = client or _client(endpoint_url)
    manifest = load_remote_manifest(url, client=client, expected_sha256=expected_manifest_sha256)
    cache = S3ShardCache(url, cache_dir=cache_dir, cache_bytes=cache_bytes, client=client)
    largest = max(e.bytes for e in manifest.shards)
    if largest > cache_bytes:
        raise RecipeError(f"token cache of {cache_bytes} bytes is smaller than the largest shard at {url} ({largest} bytes)")
    return PackedTokens(manifest, cache, vocab_size=vocab_size)

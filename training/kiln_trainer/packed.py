"""Packed token shards: fixed-length samples on disk, a token manifest, a random-access reader.

Layout of one packed corpus (a directory named by ``token_shards_key``)::

    ROOT/<key>/part-00000-00000.bin   samples of part 0, little-endian uint16|uint32, no header
    ROOT/<key>/part-00000.json        part record (its shards, counts), written after its shards
    ROOT/<key>/tokenizer.json         the tokenizer artifact (sha256 == manifest's tokenizer.sha256)
    ROOT/<key>/token_manifest.json    written LAST, atomically: the commit record

Packing: the documents of a part, in order, each followed by the EOS id, form one token stream;
sample ``k`` is ``stream[k*B : k*B + B + 1]`` (``B`` = block size), so consecutive samples share
one token and every next-token pair of the stream is trained on; no padding; the last ``< B+1``
tokens of a part are dropped (counted in ``dropped_tokens``). A shard is a ``[samples, B+1]``
array; its file size is exactly ``samples * (B+1) * itemsize``. Writing streams over documents
(memory: one encode batch plus one sample), flushes a shard every ``shard_bytes``, and writes each
file to a temporary name, fsyncs it and renames it: a half-written shard is never listed.

Identity: ``token_shards_key(snapshot_id, tokenizer_sha256, eos_id, block_size)`` names the
directory, so the same inputs find and reuse the shards (after ``verify_token_shards``). The token
manifest (``kind == "kiln.TokenManifest"``)::

    {"kind": "kiln.TokenManifest", "format": 1, "snapshot_id": "<md5>.dir",
     "tokenizer": {"kind": "bpe", "sha256": "<hex>", "vocab_size": 8192, "eos_id": 0},
     "tokenizer_file": "tokenizer.json", "block_size": 128, "dtype": "uint16",
     "shards": [{"path": "part-00000-00000.bin", "sha256": "<hex>", "samples": 812,
                 "max_id": 8191, "bytes": 209496}, ...],
     "samples": 812, "tokens": 104749, "documents": 311, "dropped_tokens": 36,
     "sha256": "<sha256 of the canonical JSON of every field but kind and sha256>"}

(the TrainingManifest's hash rule; ``tokens`` counts the stream tokens the samples cover).

Checks before step 1 (``check_compatible``, ``verify_token_shards``): tokenizer sha256 and EOS
id, block size, every shard's recorded ``max_id`` below the vocabulary, every file's size (a
truncated shard). When ``PackedTokens`` first opens a shard it re-scans the file for its largest
id (vectorised, 4 MiB at a time: one sequential read of the shard, a few GB/s from page cache)
and, if asked, its sha256 -- a shard altered after packing is refused before a row is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kiln_trainer.checkpoint_manifest import (
    TOKENIZER_FILE,
    atomic_write_bytes,
    canonical_json,
    fsync_dir,
    sha256_file,
)
from kiln_trainer.errors import (
    BlockSizeMismatchError,
    RecipeError,
    ShardIntegrityError,
    TokenizerMismatchError,
    TokenManifestError,
    TokenShardError,
)
from kiln_trainer.jsonfile import open_regular_file, parse_json, read_own_json
from kiln_trainer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ConcatenatedTokens",
    "TOKEN_MANIFEST_KIND",
    "TOKEN_MANIFEST_NAME",
    "LocalShardStore",
    "PackedTokens",
    "ShardStore",
    "TokenManifest",
    "TokenShardEntry",
    "TokenShardWriter",
    "check_compatible",
    "dtype_for_vocab",
    "iter_training_texts",
    "load_token_manifest",
    "pack_corpus",
    "pack_part",
    "pack_training_shards",
    "token_shards_key",
    "verify_token_shards",
    "write_token_manifest",
]

TOKEN_MANIFEST_KIND = "kiln.TokenManifest"
TOKEN_PART_KIND = "kiln.TokenPart"
TOKEN_MANIFEST_NAME = "token_manifest.json"
PACKED_FORMAT = 1
DEFAULT_SHARD_BYTES = 128 << 20
"""Large enough that per-file costs vanish (DVC, S3 requests), small enough to cache a window of them."""
SCAN_CHUNK_BYTES = 4 << 20
_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536), else uint32."""
    if vocab_size < 1 or vocab_size > 1 << 32:
        raise RecipeError(f"vocab_size = {vocab_size}: must be in [1, 2**32]")
    return _DTYPES["uint16"] if vocab_size <= 1 << 16 else _DTYPES["uint32"]


def _dtype_name(dtype: np.dtype) -> str:
    return next(name for name, d in _DTYPES.items() if d == dtype)


def token_shards_key(*, snapshot_id: str, tokenizer_sha256: str, eos_id: int, block_size: int) -> str:
    """The directory name of the packed shards of these inputs (content address, 32 hex chars)."""
    body = {
        "format": PACKED_FORMAT,
        "snapshot_id": snapshot_id,
        "tokenizer_sha256": tokenizer_sha256,
        "eos_id": eos_id,
        "block_size": block_size,
    }
    return hashlib.sha256(canonical_json(body)).hexdigest()[:32]


def _content_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(body)).hexdigest()


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenShardEntry:
    path: str
    """File name relative to the manifest's directory (or the remote prefix)."""
    sha256: str
    samples: int
    max_id: int
    """Largest token id in the shard, recorded by the writer (checked against the vocabulary)."""
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "samples": self.samples, "max_id": self.max_id, "bytes": self.bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenManifest:
    snapshot_id: str
    tokenizer: dict[str, Any]
    """``{"kind", "sha256", "vocab_size", "eos_id"}`` of the tokenizer that packed the shards."""
    block_size: int
    dtype: str
    shards: tuple[TokenShardEntry, ...]
    documents: int
    tokens: int
    dropped_tokens: int
    tokenizer_file: str = TOKENIZER_FILE
    sha256: str
    path: str = ""
    """The directory it was read from or written to, or its ``s3://`` prefix (not part of the content)."""

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def sample_tokens(self) -> int:
        return self.block_size + 1

    @property
    def numpy_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype]

    @property
    def sample_bytes(self) -> int:
        return self.sample_tokens * self.numpy_dtype.itemsize

    def body(self) -> dict[str, Any]:
        return {
            "format": PACKED_FORMAT,
            "snapshot_id": self.snapshot_id,
            "tokenizer": dict(self.tokenizer),
            "tokenizer_file": self.tokenizer_file,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "shards": [s.to_dict() for s in self.shards],
            "samples": self.samples,
            "tokens": self.tokens,
            "documents": self.documents,
            "dropped_tokens": self.dropped_tokens,
        }

    def to_json_bytes(self) -> bytes:
        doc = {"kind": TOKEN_MANIFEST_KIND, **self.body(), "sha256": self.sha256}
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8") + b"\n"


def _int_field(raw: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TokenManifestError(f"{where}: {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _shard_entries(raw: Any, where: str) -> tuple[TokenShardEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise TokenManifestError(f"{where}: 'shards' must be a non-empty list")
    entries = []
    for i, item in enumerate(raw):
        at = f"{where}: shards[{i}]"
        if not isinstance(item, dict):
            raise TokenManifestError(f"{at} must be an object")
        path, digest = item.get("path"), item.get("sha256")
        if not isinstance(path, str) or not path or "/" in path or path.startswith("."):
            raise TokenManifestError(f"{at}.path must be a plain file name, got {path!r}")
        if not isinstance(digest, str) or len(digest) != 64:
            raise TokenManifestError(f"{at}.sha256 must be 64 hex chars")
        entries.append(
            TokenShardEntry(
                path=path,
                sha256=digest,
                samples=_int_field(item, "samples", at, minimum=1),
                max_id=_int_field(item, "max_id", at),
                bytes=_int_field(item, "bytes", at, minimum=1),
            )
        )
    names = [e.path for e in entries]
    if len(set(names)) != len(names):
        raise TokenManifestError(f"{where}: a shard is listed twice")
    return tuple(entries)


def parse_token_manifest(raw_bytes: bytes, where: str) -> TokenManifest:
    """Parse and hash-check token manifest bytes (from a file or a remote object)."""
    data = parse_json(raw_bytes, where, TokenManifestError)
    if not isinstance(data, dict) or data.get("kind") != TOKEN_MANIFEST_KIND:
        raise TokenManifestError(f"{where}: kind is not {TOKEN_MANIFEST_KIND!r}")
    body = {k: v for k, v in data.items() if k not in ("kind", "sha256")}
    actual = _content_hash(body)
    if data.get("sha256") != actual:
        raise TokenManifestError(
            f"{where}: content hash mismatch (declared {data.get('sha256')}, computed {actual}); "
            "the token manifest was edited after it was written"
        )
    if body.get("format") != PACKED_FORMAT:
        raise TokenManifestError(f"{where}: unsupported packed format {body.get('format')!r}")
    tok = body.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str) or not isinstance(tok.get("kind"), str):
        raise TokenManifestError(f"{where}: 'tokenizer' must be an object with 'kind' and 'sha256'")
    vocab, eos = _int_field(tok, "vocab_size", f"{where}: tokenizer", 1), _int_field(tok, "eos_id", f"{where}: tokenizer")
    if body.get("dtype") not in _DTYPES or _DTYPES[body["dtype"]] != dtype_for_vocab(vocab):
        raise TokenManifestError(f"{where}: dtype {body.get('dtype')!r} does not fit vocab_size {vocab}")
    if not isinstance(body.get("snapshot_id"), str):
        raise TokenManifestError(f"{where}: 'snapshot_id' must be a string")
    shards = _shard_entries(body.get("shards"), where)
    manifest = TokenManifest(
        snapshot_id=body["snapshot_id"],
        tokenizer={"kind": tok["kind"], "sha256": tok["sha256"], "vocab_size": vocab, "eos_id": eos},
        tokenizer_file=str(body.get("tokenizer_file", TOKENIZER_FILE)),
        block_size=_int_field(body, "block_size", where, 1),
        dtype=body["dtype"],
        shards=shards,
        documents=_int_field(body, "documents", where),
        tokens=_int_field(body, "tokens", where),
        dropped_tokens=_int_field(body, "dropped_tokens", where),
        sha256=actual,
    )
    if _int_field(body, "samples", where) != manifest.samples:
        raise TokenManifestError(f"{where}: 'samples' is {body['samples']} but the shards hold {manifest.samples}")
    for entry in shards:
        if entry.bytes != entry.samples * manifest.sample_bytes:
            raise TokenManifestError(
                f"{where}: shard {entry.path}: {entry.bytes} bytes is not samples x (block_size+1) x itemsize "
                f"= {entry.samples} x {manifest.sample_tokens} x {manifest.numpy_dtype.itemsize}"
            )
    return manifest


def load_token_manifest(path: str | Path) -> TokenManifest:
    """Read ``token_manifest.json`` (or the directory holding it) and check its content hash."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKEN_MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TokenManifestError(f"{path}: cannot read token manifest: {exc}") from exc
    manifest = parse_token_manifest(raw, str(path))
    return _with_path(manifest, path.parent)


def _with_path(manifest: TokenManifest, root: Path) -> TokenManifest:
    return dataclasses.replace(manifest, path=str(root.resolve()))


def check_compatible(
    manifest: TokenManifest,
    *,
    tokenizer: Tokenizer | None = None,
    block_size: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Refuse, before step 1, shards that were packed for another tokenizer, block size or vocabulary.

    ``vocab_size`` is the model's (defaults to the tokenizer's, then the manifest's): every
    shard's recorded largest id must be below it.
    """
    where = manifest.path or "token manifest"
    if tokenizer is not None:
        if tokenizer.sha256 != manifest.tokenizer["sha256"]:
            raise TokenizerMismatchError(
                f"{where}: shards were packed with tokenizer sha256 {manifest.tokenizer['sha256']}, "
                f"but the tokenizer given has sha256 {tokenizer.sha256} ({tokenizer.kind}); re-tokenize or pass that tokenizer"
            )
        if tokenizer.eos_id != manifest.tokenizer["eos_id"]:
            raise TokenizerMismatchError(
                f"{where}: shards use EOS id {manifest.tokenizer['eos_id']}, the tokenizer given uses {tokenizer.eos_id}"
            )
    if block_size is not None and block_size != manifest.block_size:
        raise BlockSizeMismatchError(
            f"{where}: shards were packed with block_size {manifest.block_size} "
            f"(samples of {manifest.sample_tokens} tokens), the recipe asks for {block_size}; re-tokenize for it"
        )
    limit = vocab_size if vocab_size is not None else tokenizer.vocab_size if tokenizer else manifest.tokenizer["vocab_size"]
    for entry in manifest.shards:
        if entry.max_id >= limit:
            raise TokenShardError(
                f"{where}: shard {entry.path} holds token id {entry.max_id}, at or above the vocabulary size {limit}"
            )


def verify_token_shards(manifest: TokenManifest, root: str | Path | None = None, *, deep: bool = False) -> None:
    """Every listed shard exists with its listed size; ``deep`` also re-hashes and re-scans max ids.

    The size check is a ``stat`` per shard (catches truncation); ``deep`` costs one read of the corpus.
    """
    base = Path(root or manifest.path)
    for entry in manifest.shards:
        path = base / entry.path
        check_shard_size(path, entry, manifest)
        if deep:
            _scan_shard(path, entry, manifest, vocab_size=manifest.tokenizer["vocab_size"], check_sha256=True)
    tokenizer_path = base / manifest.tokenizer_file
    if deep and tokenizer_path.is_file() and sha256_file(tokenizer_path) != manifest.tokenizer["sha256"]:
        raise TokenShardError(f"{tokenizer_path}: tokenizer artifact sha256 differs from the token manifest's")


def check_shard_size(path: Path, entry: TokenShardEntry, manifest: TokenManifest) -> None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TokenShardError(f"token shard {path} listed in the token manifest is missing: {exc}") from exc
    if size % manifest.sample_bytes:
        raise TokenShardError(
            f"token shard {path} is truncated: {size} bytes is not a multiple of (block_size+1) x itemsize "
            f"= {manifest.sample_tokens} x {manifest.numpy_dtype.itemsize}"
        )
    if size != entry.bytes:
        raise TokenShardError(
            f"token shard {path} has {size // manifest.sample_bytes} samples ({size} bytes), "
            f"the token manifest says {entry.samples} ({entry.bytes} bytes)"
        )


def _scan_shard(path: Path, entry: TokenShardEntry, manifest: TokenManifest, *, vocab_size: int, check_sha256: bool) -> None:
    """One sequential read: the largest id must be the recorded one and below the vocabulary."""
    digest = hashlib.sha256()
    largest = -1
    dtype = manifest.numpy_dtype
    # One reused buffer: fresh multi-MiB blocks per read would stay in the malloc heap (RSS).
    buffer = np.empty(SCAN_CHUNK_BYTES // dtype.itemsize, dtype=dtype)
    view = buffer.data.cast("B")
    with open(path, "rb", buffering=0) as fh:
        while count := fh.readinto(view):
            if count % dtype.itemsize:
                raise TokenShardError(f"token shard {path}: size is not a whole number of {dtype.name} ids")
            if check_sha256:
                digest.update(view[:count])
            largest = max(largest, int(buffer[: count // dtype.itemsize].max()))
    if check_sha256 and digest.hexdigest() != entry.sha256:
        raise TokenShardError(f"token shard {path}: sha256 mismatch (manifest {entry.sha256}, on disk {digest.hexdigest()})")
    if largest >= vocab_size:
        raise TokenShardError(f"token shard {path} holds token id {largest}, at or above the vocabulary size {vocab_size}")
    if largest != entry.max_id:
        raise TokenShardError(f"token shard {path}: largest token id is {largest}, the token manifest says {entry.max_id}")


# --------------------------------------------------------------------------- writing


class TokenShardWriter:
    """Cuts a token stream into ``[samples, B+1]`` shards ``<prefix>-00000.bin``, ... (constant memory)."""

    def __init__(
        self, out_dir: str | Path, *, prefix: str, block_size: int, vocab_size: int, shard_bytes: int = DEFAULT_SHARD_BYTES
    ) -> None:
        if block_size < 1:
            raise RecipeError(f"block_size = {block_size}: must be >= 1")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        sample_bytes = (block_size + 1) * self.dtype.itemsize
        self.shard_samples = max(1, shard_bytes // sample_bytes)
        self.entries: list[TokenShardEntry] = []
        self.tokens = 0
        self._carry = np.empty(0, dtype=np.uint32)
        self._fh: Any = None
        self._tmp: Path | None = None
        self._rows = 0
        self._max = -1
        self._digest = hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens to the stream; whole samples go to disk at once, the rest waits."""
        stream = np.concatenate([self._carry, np.asarray(tokens, dtype=np.uint32)])
        width = self.block_size + 1
        count = (len(stream) - 1) // self.block_size if len(stream) >= width else 0
        if count:
            rows = np.lib.stride_tricks.sliding_window_view(stream, width)[:: self.block_size][:count]
            self._append_rows(rows)
            self.tokens += count * self.block_size
        # The last token of a sample is also the first of the next one.
        self._carry = stream[count * self.block_size :].copy()

    def _append_rows(self, rows: np.ndarray) -> None:
        while len(rows):
            if self._fh is None:
                self._open_shard()
            take = min(self.shard_samples - self._rows, len(rows))
            chunk = np.ascontiguousarray(rows[:take], dtype=self.dtype)
            top = int(rows[:take].max())
            if top >= self.vocab_size:
                raise TokenShardError(f"{self.out_dir}/{self.prefix}: token id {top} >= vocab_size {self.vocab_size}")
            data = chunk.tobytes()
            self._fh.write(data)
            self._digest.update(data)
            self._rows += take
            self._max = max(self._max, top)
            rows = rows[take:]
            if self._rows == self.shard_samples:
                self._commit_shard()

    def _shard_name(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}.bin"

    def _open_shard(self) -> None:
        name = self._shard_name(len(self.entries))
        self._tmp = self.out_dir / f".{name}.tmp"
        self._fh = open(self._tmp, "wb")  # noqa: SIM115 - a shard fills across calls; _commit_shard or abort closes it
        self._rows, self._max, self._digest = 0, -1, hashlib.sha256()

    def _commit_shard(self) -> None:
        assert self._fh is not None and self._tmp is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        name = self._shard_name(len(self.entries))
        os.replace(self._tmp, self.out_dir / name)
        size = self._rows * (self.block_size + 1) * self.dtype.itemsize
        self.entries.append(
            TokenShardEntry(path=name, sha256=self._digest.hexdigest(), samples=self._rows, max_id=self._max, bytes=size)
        )
        self._fh, self._tmp = None, None

    def close(self) -> list[TokenShardEntry]:
        """Commit the last, partial shard; the tail shorter than a sample is dropped (``dropped_tokens``)."""
        if self._fh is not None and self._rows:
            self._commit_shard()
        self.abort()
        fsync_dir(self.out_dir)
        return list(self.entries)

    @property
    def dropped_tokens(self) -> int:
        """Tokens after the last whole sample (the carried token already belongs to a sample)."""
        return max(0, len(self._carry) - 1) if self.tokens else len(self._carry)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._fh, self._tmp = None, None


def _part_name(part: int) -> str:
    return f"part-{part:05d}"


def _read_part(path: Path, *, tokenizer: Tokenizer, block_size: int) -> dict[str, Any] | None:
    """A committed part record that matches these inputs and whose shards are all there, or None."""
    try:
        doc = read_own_json(path)
    except (OSError, ValueError):
        return None
    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")} if isinstance(doc, dict) else {}
    if not body or doc.get("kind") != TOKEN_PART_KIND or doc.get("sha256") != _content_hash(body):
        return None
    if body.get("tokenizer_sha256") != tokenizer.sha256 or body.get("block_size") != block_size:
        return None
    for shard in body.get("shards", []):
        file = path.parent / shard["path"]
        if not file.is_file() or file.stat().st_size != shard["bytes"]:
            return None
    return body


def pack_part(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    part: int,
    block_size: int,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    docs_per_batch: int = 256,
) -> dict[str, Any]:
    """Pack one part's documents into ``out_dir`` (idempotent: a committed, matching part is reused).

    One mapped tokenize task is one part; ``write_token_manifest`` joins the parts in order.
    """
    out_dir = Path(out_dir)
    record_path = out_dir / f"{_part_name(part)}.json"
    done = _read_part(record_path, tokenizer=tokenizer, block_size=block_size)
    if done is not None:
        return done
    for stale in out_dir.glob(f".{_part_name(part)}-*.tmp"):
        stale.unlink()  # a crashed earlier attempt at this part
    writer = TokenShardWriter(
        out_dir, prefix=_part_name(part), block_size=block_size, vocab_size=tokenizer.vocab_size, shard_bytes=shard_bytes
    )
    documents = 0
    try:
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if len(batch) >= docs_per_batch:
                writer.write(tokenizer.encode_documents(batch))
                documents += len(batch)
                batch = []
        if batch:
            writer.write(tokenizer.encode_documents(batch))
            documents += len(batch)
        entries = writer.close()
    except BaseException:
        writer.abort()
        raise
    body = {
        "format": PACKED_FORMAT,
        "part": part,
        "tokenizer_sha256": tokenizer.sha256,
        "block_size": block_size,
        "dtype": _dtype_name(writer.dtype),
        "shards": [e.to_dict() for e in entries],
        "documents": documents,
        "tokens": writer.tokens + (1 if entries else 0),
        "dropped_tokens": writer.dropped_tokens,
    }
    doc = {"kind": TOKEN_PART_KIND, **body, "sha256": _content_hash(body)}
    atomic_write_bytes(record_path, json.dumps(doc, indent=1, sort_keys=True).encode("utf-8"))
    return body


def write_token_manifest(
    out_dir: str | Path, *, snapshot_id: str, tokenizer: Tokenizer, block_size: int, parts: int
) -> TokenManifest:
    """Join parts ``0..parts-1`` (all must be committed) into ``token_manifest.json``, written last."""
    out_dir = Path(out_dir)
    records = []
    for part in range(parts):
        record = _read_part(out_dir / f"{_part_name(part)}.json", tokenizer=tokenizer, block_size=block_size)
        if record is None:
            raise TokenManifestError(f"{out_dir}: part {part} of {parts} is missing, unfinished or for other inputs")
        records.append(record)
    shards = tuple(TokenShardEntry(**s) for r in records for s in r["shards"])
    if not shards:
        raise TokenManifestError(f"{out_dir}: the documents fill no sample of {block_size + 1} tokens: nothing to train on")
    tokenizer.save(out_dir / TOKENIZER_FILE)
    fields = {
        "snapshot_id": snapshot_id,
        "tokenizer": tokenizer.describe(),
        "block_size": block_size,
        "dtype": _dtype_name(dtype_for_vocab(tokenizer.vocab_size)),
        "shards": shards,
        "documents": sum(r["documents"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "dropped_tokens": sum(r["dropped_tokens"] for r in records),
    }
    draft = TokenManifest(**fields, sha256="")
    manifest = TokenManifest(**fields, sha256=_content_hash(draft.body()), path=str(out_dir.resolve()))
    atomic_write_bytes(out_dir / TOKEN_MANIFEST_NAME, manifest.to_json_bytes())  # LAST: the commit point
    return manifest


def pack_corpus(
    root: str | Path,
    *,
    snapshot_id: str,
    tokenizer: Tokenizer,
    block_size: int,
    parts: Sequence[Iterable[str]],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    deep_verify: bool = False,
) -> TokenManifest:
    """Packed shards of ``parts`` under ``root/<key>``, reused when committed.

    Reuse checks the manifest's hash, the tokenizer and block size, and every shard's size;
    ``deep_verify`` also re-hashes and re-scans every shard (one read of the packed corpus).
    """
    out_dir = Path(root) / token_shards_key(
        snapshot_id=snapshot_id, tokenizer_sha256=tokenizer.sha256, eos_id=tokenizer.eos_id, block_size=block_size
    )
    if (out_dir / TOKEN_MANIFEST_NAME).is_file():
        manifest = load_token_manifest(out_dir)
        check_compatible(manifest, tokenizer=tokenizer, block_size=block_size)
        verify_token_shards(manifest, deep=deep_verify)
        return manifest
    for index, texts in enumerate(parts):
        pack_part(texts, tokenizer, out_dir, part=index, block_size=block_size, shard_bytes=shard_bytes)
    return write_token_manifest(out_dir, snapshot_id=snapshot_id, tokenizer=tokenizer, block_size=block_size, parts=len(parts))


class _ParquetShard(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def sha256(self) -> str: ...

    @property
    def drop_rows(self) -> tuple[int, ...]: ...


def pack_training_shards(
    root: str | Path,
    *,
    snapshot_id: str,
    tokenizer: Tokenizer,
    block_size: int,
    shards: Sequence[_ParquetShard],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> TokenManifest:
    """``pack_corpus`` of a TrainingManifest's shards, one part per shard in manifest order.

    The partition is part of what the content address ``token_shards_key`` stands for (a part's
    tail shorter than a sample is dropped): whoever packs a snapshot's shards -- the tokenize
    stage, or the trainer for a manifest without ``tokens`` -- makes part ``i`` of shard ``i``, so the
    same key holds the same bytes. Each shard's file is sha256-checked before it is read.
    """
    parts = [iter_training_texts([entry]) for entry in shards]  # generators: read one at a time, when packed
    return pack_corpus(
        root, snapshot_id=snapshot_id, tokenizer=tokenizer, block_size=block_size, parts=parts, shard_bytes=shard_bytes
    )


def iter_training_texts(entries: Iterable[_ParquetShard], *, batch_rows: int = 1024) -> Iterator[str]:
    """The ``text`` column of TrainingManifest shards, streamed by record batch, each file sha256-checked
    first, without the rows the contract dropped (``drop_rows``): whoever packs -- the tokenize stage
    or the trainer's rank 0 -- reads a dropped document never.

    Each shard is opened once, as a regular file and not through a link (``open_regular_file``), and
    the bytes hashed are the bytes parsed: a file swapped in after the check is never read."""
    import hashlib

    import pyarrow.parquet as pq

    for entry in entries:
        path = Path(entry.path)
        try:
            fh = open_regular_file(path)
        except FileNotFoundError:
            raise ShardIntegrityError(f"shard {path} listed in the manifest does not exist") from None
        except OSError as exc:
            raise ShardIntegrityError(f"shard {path} listed in the manifest: {exc.strerror or exc}") from None
        with fh:
            digest = hashlib.sha256()
            while block := fh.read(1 << 20):
                digest.update(block)
            if digest.hexdigest() != entry.sha256:
                raise ShardIntegrityError(f"shard {path} sha256 mismatch (manifest {entry.sha256}, on disk "
                                          f"{digest.hexdigest()}); refusing to tokenize it")
            fh.seek(0)
            skip, row = frozenset(entry.drop_rows), 0
            try:
                for batch in pq.ParquetFile(fh).iter_batches(batch_size=batch_rows, columns=["text"]):
                    texts = batch.column(0).to_pylist()
                    yield from (t for i, t in enumerate(texts, row) if t is not None and i not in skip)
                    row += len(texts)
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise ShardIntegrityError(f"shard {path}: cannot read column 'text': {exc}") from exc


# --------------------------------------------------------------------------- reading


class ShardStore(Protocol):
    """Where a shard's bytes are: ``acquire`` gives a local, complete file until ``release``."""

    def acquire(self, entry: TokenShardEntry) -> Path: ...

    def release(self, entry: TokenShardEntry) -> None: ...


class LocalShardStore:
    """Shards on a local or shared filesystem, in the manifest's directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def acquire(self, entry: TokenShardEntry) -> Path:
        return self.root / entry.path

    def release(self, entry: TokenShardEntry) -> None:
        pass


def read_rows(path: Path, rows: np.ndarray, sample_tokens: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Rows ``rows`` (ascending) of the shard at ``path`` as int64 ``[len(rows), sample_tokens]``: one
    ``preadv`` per run of consecutive rows straight into the result, nothing mapped, so the pages read
    stay out of this process' RSS (in the page cache only). It replaced an ``np.memmap`` per call, whose
    set-up (a path resolve of several ``lstat``s) and unmapping were most of a training step's read:
    the loader thread's work between steps runs beside the training loop. ``TokenShardError`` for a
    shard shorter than its rows (changed since it was checked)."""
    out = np.empty((len(rows), sample_tokens), dtype=dtype)
    if not len(rows):
        return out.astype(np.int64)
    row_bytes = sample_tokens * dtype.itemsize
    starts = np.flatnonzero(np.diff(rows) != 1) + 1
    bounds = np.concatenate([[0], starts, [len(rows)]]).tolist()
    first = rows.tolist()
    view = out.data.cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=False):
            at, end, offset = lo * row_bytes, hi * row_bytes, first[lo] * row_bytes
            while at < end:  # a regular file reads whole, but a short read is legal: go on from there
                got = os.preadv(fd, [view[at:end]], offset)
                if got <= 0:
                    raise TokenShardError(
                        f"token shard {path} ends at byte {offset}: rows up to {first[hi - 1]} were asked for "
                        "(the shard changed after it was checked)")
                at, offset = at + got, offset + got
    finally:
        os.close(fd)
    return out.astype(np.int64)


def _read_by_shard(sample_ids: np.ndarray | Sequence[int], offsets: np.ndarray, sample_tokens: int,
                   rows_of: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """Samples ``sample_ids`` of an id space cut into shards at ``offsets`` (``offsets[-1]`` samples in
    all), as int64 ``[len(ids), sample_tokens]``: each shard touched is read once, its rows in
    ascending order, by ``rows_of(shard, rows within it)``."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= offsets[-1]):
        raise RecipeError(f"sample ids must be in [0, {int(offsets[-1])}), got {ids.min()}..{ids.max()}")
    out = np.empty((len(ids), sample_tokens), dtype=np.int64)
    shards = np.searchsorted(offsets, ids, side="right") - 1
    for shard in np.unique(shards):
        here = np.nonzero(shards == shard)[0]
        rows = ids[here] - offsets[shard]
        order = np.argsort(rows, kind="stable")  # ascending offsets: sequential-ish reads
        out[here[order]] = rows_of(int(shard), rows[order])
    return out


class PackedTokens:
    """One global sample index space over a token manifest's shards, read row by row.

    ``read(ids)`` returns the samples ``ids`` (global, in manifest order) as an int64
    ``[len(ids), block_size+1]`` array; each call reads the rows of the shards it touches with
    ``preadv`` (``read_rows``), nothing mapped, so resident memory does not grow with the corpus.
    """

    def __init__(
        self,
        manifest: TokenManifest,
        store: ShardStore | None = None,
        *,
        vocab_size: int | None = None,
        verify_sha256: bool = False,
    ) -> None:
        self.manifest = manifest
        self.store = store if store is not None else LocalShardStore(manifest.path)
        self.vocab_size = vocab_size if vocab_size is not None else manifest.tokenizer["vocab_size"]
        self.verify_sha256 = verify_sha256
        counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])
        self.sample_tokens = manifest.sample_tokens
        self._scanned: set[int] = set()
        self._lock = threading.Lock()
        if isinstance(self.store, LocalShardStore):
            verify_token_shards(manifest, self.store.root)  # sizes: a truncated shard fails before step 1

    @property
    def shard_samples(self) -> list[int]:
        return [s.samples for s in self.manifest.shards]

    def read(self, sample_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        return _read_by_shard(sample_ids, self.offsets, self.sample_tokens, self._rows)

    def _rows(self, shard: int, rows: np.ndarray) -> np.ndarray:
        entry = self.manifest.shards[shard]
        path = self.store.acquire(entry)
        try:
            with self._lock:
                if shard not in self._scanned:
                    check_shard_size(path, entry, self.manifest)
                    _scan_shard(path, entry, self.manifest, vocab_size=self.vocab_size, check_sha256=self.verify_sha256)
                    self._scanned.add(shard)
            return read_rows(path, rows, self.sample_tokens, self.manifest.numpy_dtype)
        finally:
            self.store.release(entry)


class ConcatenatedTokens:
    """Several ``PackedTokens`` (of one sample size) as one id space, in the given order: part ``j``'s
    sample ``i`` is id ``offsets_j + i``, what a mixture calls its global ids. ``read(ids)`` reads
    them as ``PackedTokens.read`` does, each shard touched once, in one call whatever the parts:
    a mixed loader's step costs what one corpus' does, not a read per source and a copy back."""

    def __init__(self, parts: Sequence[PackedTokens]) -> None:
        self.parts = tuple(parts)
        if not self.parts:
            raise RecipeError("ConcatenatedTokens needs at least one PackedTokens, got none")
        sizes = {p.sample_tokens for p in self.parts}
        if len(sizes) > 1:
            raise BlockSizeMismatchError(f"the parts' samples are of {sorted(sizes)} tokens: one id space needs one size")
        self.sample_tokens = self.parts[0].sample_tokens
        self.part_offsets = np.concatenate([[0], np.cumsum([p.num_samples for p in self.parts])]).astype(np.int64)
        self.num_samples = int(self.part_offsets[-1])
        self.offsets = np.concatenate(
            [[0], *(base + p.offsets[1:] for base, p in zip(self.part_offsets[:-1], self.parts, strict=True))]).astype(np.int64)
        self._owner = [(j, k) for j, p in enumerate(self.parts) for k in range(len(p.offsets) - 1)]

    def read(self, sample_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        return _read_by_shard(sample_ids, self.offsets, self.sample_tokens, self._rows)

    def _rows(self, shard: int, rows: np.ndarray) -> np.ndarray:
        part, local = self._owner[shard]
        return self.parts[part]._rows(local, rows)

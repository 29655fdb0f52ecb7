"""Packed token shards: layout, manifest hash, reuse, crash safety and every bad input named before step 1."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln_trainer.errors import (
    BlockSizeMismatchError,
    ShardIntegrityError,
    TokenizerMismatchError,
    TokenManifestError,
    TokenShardError,
)
from kiln_trainer.packed import (
    TOKEN_MANIFEST_NAME,
    PackedTokens,
    TokenShardWriter,
    check_compatible,
    dtype_for_vocab,
    iter_training_texts,
    load_token_manifest,
    pack_corpus,
    pack_part,
    token_shards_key,
    verify_token_shards,
    write_token_manifest,
)
from kiln_trainer.tokenizer import ByteTokenizer, Tokenizer

from trainer_fixtures import stdlib_sources, write_shard

DOCS = [text for _, text in stdlib_sources(60_000)]
SNAPSHOT = "0123456789abcdef0123456789abcdef.dir"
B = 32
SHARD_BYTES = 300 * (B + 1) * 2
"""Several shards per part, so shard boundaries fall inside every layout check."""


class WideTokenizer(Tokenizer):
    """A real tokenizer with a vocabulary past uint16: id = code point + 1000 (EOS 0)."""

    kind = "file"
    vocab_size = 0x110000 + 1000
    eos_id = 0

    def to_bytes(self) -> bytes:
        return b"wide-test-tokenizer"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(c) + 1000 for c in t] for t in texts]

    def decode(self, ids) -> str:
        return "".join(chr(i - 1000) for i in ids if i >= 1000)


def _pack(root: Path, tokenizer: Tokenizer | None = None, parts: Sequence[Sequence[str]] | None = None, **kw):
    return pack_corpus(
        root,
        snapshot_id=SNAPSHOT,
        tokenizer=tokenizer or ByteTokenizer(),
        block_size=kw.pop("block_size", B),
        parts=parts if parts is not None else [DOCS[: len(DOCS) // 2], DOCS[len(DOCS) // 2 :]],
        shard_bytes=kw.pop("shard_bytes", SHARD_BYTES),
        **kw,
    )


@pytest.fixture
def packed(tmp_path):
    return _pack(tmp_path / "tokens")


def test_samples_are_the_stream_cut_every_block_size_tokens_overlapping_by_one(packed):
    tok = ByteTokenizer()
    parts = [DOCS[: len(DOCS) // 2], DOCS[len(DOCS) // 2 :]]
    tokens = PackedTokens(packed)
    first = 0
    for part in parts:
        stream = tok.encode_documents(part)
        count = (len(stream) - 1) // B
        expected = np.stack([stream[k * B : k * B + B + 1] for k in range(count)])
        assert np.array_equal(tokens.read(np.arange(first, first + count)), expected)
        first += count
    assert first == packed.samples
    assert len(packed.shards) > 4  # several shards per part: shard boundaries are inside the check above


def test_manifest_counts_add_up(packed):
    tok = ByteTokenizer()
    streams = [len(tok.encode_documents(p)) for p in (DOCS[: len(DOCS) // 2], DOCS[len(DOCS) // 2 :])]
    assert packed.documents == len(DOCS)
    assert packed.tokens + packed.dropped_tokens == sum(streams)
    assert packed.dropped_tokens == sum((s - 1) % B for s in streams)  # each part drops its own tail
    assert packed.tokenizer == ByteTokenizer().describe()
    assert packed.dtype == "uint16"
    for entry in packed.shards:
        data = np.fromfile(Path(packed.path) / entry.path, dtype="<u2")
        assert entry.max_id == data.max() and entry.bytes == data.nbytes


def test_dtype_follows_the_vocabulary(tmp_path):
    assert dtype_for_vocab(257).name == "uint16" and dtype_for_vocab(65536).name == "uint16"
    assert dtype_for_vocab(65537).name == "uint32"
    wide = _pack(tmp_path, tokenizer=WideTokenizer(), parts=[["ünï 😀 " * 50]])
    assert wide.dtype == "uint32"
    row = PackedTokens(wide).read([0])[0]
    assert row.max() > 65535 and WideTokenizer().decode(row.tolist()).startswith("ünï 😀")


def test_manifest_hash_is_checked(packed):
    path = Path(packed.path) / TOKEN_MANIFEST_NAME
    doc = json.loads(path.read_text())
    assert load_token_manifest(path).sha256 == doc["sha256"] == packed.sha256
    doc["documents"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(TokenManifestError, match="content hash mismatch"):
        load_token_manifest(path)


def test_key_depends_on_every_input():
    base = {"snapshot_id": SNAPSHOT, "tokenizer_sha256": "a" * 64, "eos_id": 256, "block_size": 128}
    keys = {token_shards_key(**base)}
    for change in ({"snapshot_id": "x.dir"}, {"tokenizer_sha256": "b" * 64}, {"eos_id": 0}, {"block_size": 64}):
        keys.add(token_shards_key(**{**base, **change}))
    assert len(keys) == 5 and token_shards_key(**base) == token_shards_key(**base)


def test_committed_shards_are_reused_not_rewritten(tmp_path, packed):
    mtimes = {p.name: p.stat().st_mtime_ns for p in Path(packed.path).iterdir()}

    def never_read() -> Iterator[str]:
        raise AssertionError("the documents were read although the shards exist")
        yield ""

    again = _pack(tmp_path / "tokens", parts=[never_read(), never_read()])
    assert again.sha256 == packed.sha256
    assert {p.name: p.stat().st_mtime_ns for p in Path(packed.path).iterdir()} == mtimes


def test_reuse_refuses_shards_altered_since_they_were_packed(tmp_path, packed):
    entry = packed.shards[3]
    path = Path(packed.path) / entry.path
    data = np.fromfile(path, dtype="<u2")
    data[9] ^= 1
    data.tofile(path)
    assert _pack(tmp_path / "tokens").sha256 == packed.sha256  # the cheap reuse check sees sizes only
    with pytest.raises(TokenShardError, match=rf"{entry.path}: sha256 mismatch"):
        _pack(tmp_path / "tokens", deep_verify=True)


def test_packing_is_deterministic(tmp_path, packed):
    other = _pack(tmp_path / "elsewhere")
    assert other.sha256 == packed.sha256


def test_a_crash_mid_part_leaves_nothing_listed_and_a_rerun_matches(tmp_path, packed):
    out = tmp_path / "crash"

    def dies_half_way() -> Iterator[str]:
        yield from DOCS[:40]
        raise KeyboardInterrupt  # a SIGINT/OOM stand-in: any exception between two shard flushes

    with pytest.raises(KeyboardInterrupt):
        pack_part(dies_half_way(), ByteTokenizer(), out, part=0, block_size=B, shard_bytes=SHARD_BYTES)
    assert not (out / "part-00000.json").exists()
    assert not list(out.glob(".*.tmp"))
    with pytest.raises(TokenManifestError, match="part 0 of 1 is missing"):
        write_token_manifest(out, snapshot_id=SNAPSHOT, tokenizer=ByteTokenizer(), block_size=B, parts=1)
    # The rerun writes the same bytes as a run that never crashed.
    key_dir = tmp_path / "rerun"
    for index, part in enumerate([DOCS[: len(DOCS) // 2], DOCS[len(DOCS) // 2 :]]):
        pack_part(part, ByteTokenizer(), key_dir, part=index, block_size=B, shard_bytes=SHARD_BYTES)
    rerun = write_token_manifest(key_dir, snapshot_id=SNAPSHOT, tokenizer=ByteTokenizer(), block_size=B, parts=2)
    assert rerun.sha256 == packed.sha256


def test_writer_memory_is_one_sample_between_writes(tmp_path):
    writer = TokenShardWriter(tmp_path, prefix="p", block_size=B, vocab_size=257, shard_bytes=1 << 20)
    tok = ByteTokenizer()
    for doc in DOCS[:50]:
        writer.write(tok.encode_documents([doc]))
        assert len(writer._carry) <= B
    writer.close()


def test_empty_corpus_is_refused(tmp_path):
    with pytest.raises(TokenManifestError, match="nothing to train on"):
        _pack(tmp_path, parts=[["tiny"]])


# --------------------------------------------------------------------------- bad input, before step 1


def test_a_tokenizer_that_did_not_pack_the_shards_is_refused(packed):
    with pytest.raises(TokenizerMismatchError, match=packed.tokenizer["sha256"]):
        check_compatible(packed, tokenizer=ByteTokenizer(eos_id=0))
    check_compatible(packed, tokenizer=ByteTokenizer(), block_size=B)


def test_a_block_size_that_differs_from_the_shards_is_refused(packed):
    with pytest.raises(BlockSizeMismatchError, match=f"block_size {B}.*asks for 64"):
        check_compatible(packed, block_size=64)


def test_a_recorded_id_at_or_above_the_vocabulary_is_refused(packed):
    top = max(e.max_id for e in packed.shards)
    with pytest.raises(TokenShardError, match=f"token id {top}, at or above the vocabulary size {top}"):
        check_compatible(packed, vocab_size=top)


def test_a_shard_whose_bytes_hold_an_id_beyond_the_vocabulary_is_refused_when_first_opened(packed):
    entry = packed.shards[2]
    path = Path(packed.path) / entry.path
    data = np.fromfile(path, dtype="<u2")
    data[5] = 300  # >= 257, the manifest still says the old max id
    data.tofile(path)
    tokens = PackedTokens(packed)  # sizes are fine
    tokens.read([0])  # other shards still read
    with pytest.raises(TokenShardError, match=rf"{entry.path} holds token id 300, at or above the vocabulary size 257"):
        tokens.read([int(tokens.offsets[2])])


def test_an_altered_shard_is_refused_by_its_sha256_when_asked(packed):
    entry = packed.shards[0]
    path = Path(packed.path) / entry.path
    data = np.fromfile(path, dtype="<u2")
    data[0] ^= 1
    data.tofile(path)
    with pytest.raises(TokenShardError, match=rf"{entry.path}: sha256 mismatch"):
        PackedTokens(packed, verify_sha256=True).read([0])
    with pytest.raises(TokenShardError, match="sha256 mismatch"):
        verify_token_shards(packed, deep=True)


@pytest.mark.parametrize(("cut", "message"), [(3, "not a multiple of"), ((B + 1) * 2, "the token manifest says")])
def test_a_truncated_shard_is_refused_before_any_read(packed, cut, message):
    entry = packed.shards[-1]
    path = Path(packed.path) / entry.path
    os.truncate(path, entry.bytes - cut)
    with pytest.raises(TokenShardError, match=rf"{entry.path}.*{message}"):
        PackedTokens(packed)


def test_a_missing_shard_is_refused_before_any_read(packed):
    (Path(packed.path) / packed.shards[1].path).unlink()
    with pytest.raises(TokenShardError, match=f"{packed.shards[1].path} listed in the token manifest is missing"):
        PackedTokens(packed)


def test_reading_outside_the_index_space_is_refused(packed):
    with pytest.raises(ValueError, match="sample ids must be in"):
        PackedTokens(packed).read([packed.samples])


def test_training_texts_are_streamed_from_verified_parquet_shards(tmp_path):
    docs = stdlib_sources(30_000)
    entry = write_shard(tmp_path / "s.parquet", docs)

    class Entry:
        path, sha256, drop_rows = entry["path"], entry["sha256"], ()

    assert list(iter_training_texts([Entry], batch_rows=2)) == [t for _, t in docs]
    Entry.drop_rows = (0, 2, 3, len(docs) - 1)  # rows the contract dropped, across record batches of 2
    assert list(iter_training_texts([Entry], batch_rows=2)) == [t for i, (_, t) in enumerate(docs) if i not in
                                                                 Entry.drop_rows]
    Entry.sha256 = "0" * 64
    with pytest.raises(ShardIntegrityError, match="sha256 mismatch"):
        list(iter_training_texts([Entry]))


def test_the_data_path_imports_neither_torch_nor_kiln_nor_airflow():
    """The tokenize stage runs these on the orchestration side; tokenizers and boto3 load only when used."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kiln_trainer.tokenizer, kiln_trainer.packed, kiln_trainer.sample_order, kiln_trainer.loader,"
        " kiln_trainer.remote, kiln_trainer.data, kiln_trainer.config, kiln_trainer.training_manifest\n"
        "bad = sorted(m for m in ('torch', 'kiln', 'airflow', 'tokenizers', 'boto3') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_read_rows_equals_the_shard_indexed_and_names_a_shard_cut_after_its_check(tmp_path):
    """``read_rows`` (one ``preadv`` per run of consecutive rows) gives what indexing the whole shard
    gives, runs, gaps and repeats alike; a shard shorter than the rows asked for is named."""
    from kiln_trainer.packed import read_rows

    shard = np.arange(40 * 5, dtype="<u2").reshape(40, 5)
    path = tmp_path / "shard.bin"
    shard.tofile(path)
    for rows in ([0], [3, 4, 5, 9, 10, 39], [7, 7, 8], list(range(40)), []):
        got = read_rows(path, np.array(rows, dtype=np.int64), 5, np.dtype("<u2"))
        assert got.dtype == np.int64 and got.shape == (len(rows), 5)
        assert np.array_equal(got, shard[rows].astype(np.int64))
    path.write_bytes(shard[:20].tobytes())
    with pytest.raises(TokenShardError, match="shard.bin ends at byte 200: rows up to 20 "):
        read_rows(path, np.array([19, 20, 25], dtype=np.int64), 5, np.dtype("<u2"))

"""TrainingManifest parsing and hash check (with its optional ``tokens``), and a run's training data:
packing a manifest without tokens, opening named ones, and every mismatch refused before step 1."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kiln_trainer.config import load_recipe
from kiln_trainer.data import check_recipe_tokenizer, open_run_tokens, pack_run_tokens
from kiln_trainer.errors import (
    BlockSizeMismatchError,
    RecipeError,
    ShardIntegrityError,
    TokenizerMismatchError,
    TokenManifestError,
    TokenShardError,
    TrainingManifestError,
)
from kiln_trainer.packed import load_token_manifest
from kiln_trainer.tokenizer import ByteTokenizer, build_tokenizer
from kiln_trainer.training_manifest import TokensRef, load_training_manifest

from trainer_fixtures import TINY, canonical_json, stdlib_sources, write_shard, write_training_manifest


def test_manifest_loads_and_hash_matches(corpus: Path) -> None:
    m = load_training_manifest(corpus)
    assert m.snapshot_id.endswith(".dir") and len(m.shards) == 3 and len(m.eval_shards) == 1
    assert m.sha256 == json.loads(corpus.read_text())["sha256"]


def test_manifest_hash_mismatch_is_rejected(corpus: Path, tmp_path: Path) -> None:
    doc = json.loads(corpus.read_text())
    doc["shards"] = doc["shards"][:1]  # drop shards without re-issuing the hash
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    with pytest.raises(TrainingManifestError, match="content hash mismatch"):
        load_training_manifest(edited)


def _reissue(doc: dict, path: Path) -> Path:
    """Write ``doc`` with a correct content hash, as a (buggy) issuer would."""
    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")}
    doc["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(kind="kiln.Other"), "kind"),
        (lambda d: d.update(shards=[]), "empty"),
        (lambda d: d["shards"][0].update(path="relative.parquet"), "absolute"),
        (lambda d: d["shards"][0].pop("sha256"), "sha256"),
        (lambda d: d["shards"][0].update(rows=-1), "rows"),
        (lambda d: d.update(snapshot_id=3), "snapshot_id"),
        (lambda d: d.update(tokens={"manifest": "rel/token_manifest.json", "sha256": "0" * 64}), "tokens.manifest"),
        (lambda d: d.update(tokens={"manifest": "/t/token_manifest.json", "sha256": "xyz"}), "tokens.sha256"),
        (lambda d: d.update(tokens={"manifest": "/t/token_manifest.json"}), "'tokens'"),
    ],
)
def test_malformed_manifest_is_rejected(corpus: Path, tmp_path: Path, mutate, message: str) -> None:
    doc = json.loads(corpus.read_text())
    mutate(doc)
    with pytest.raises(TrainingManifestError, match=message):
        load_training_manifest(_reissue(doc, tmp_path / "m.json"))


def test_not_json_is_a_manifest_error(tmp_path: Path) -> None:
    bad = tmp_path / "m.json"
    bad.write_text("{nope")
    with pytest.raises(TrainingManifestError, match="not JSON"):
        load_training_manifest(bad)


def test_tokens_field_is_parsed_and_hashed_like_every_field(corpus: Path, tmp_path: Path) -> None:
    doc = json.loads(corpus.read_text())
    doc["tokens"] = {"manifest": "s3://bucket/tokens/token_manifest.json", "sha256": "a" * 64}
    manifest = load_training_manifest(_reissue(doc, tmp_path / "m.json"))
    assert manifest.tokens == TokensRef(manifest="s3://bucket/tokens/token_manifest.json", sha256="a" * 64)
    assert manifest.tokens.remote and manifest.sha256 != load_training_manifest(corpus).sha256
    doc["tokens"]["sha256"] = "b" * 64  # edited after issue: the content hash refuses it
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    with pytest.raises(TrainingManifestError, match="content hash mismatch"):
        load_training_manifest(tmp_path / "edited.json")
    assert load_training_manifest(corpus).tokens is None


# ----------------------------------------------------------------- the run's tokens

SHORT_DOCS = stdlib_sources(40_000)


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small-corpus")
    shards = [write_shard(root / f"train-{i}.parquet", SHORT_DOCS[i::2]) for i in range(2)]
    return write_training_manifest(root / "manifest.json", shards, [])


@pytest.fixture(scope="module")
def packed_ref(small_manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> TokensRef:
    return pack_run_tokens(load_training_manifest(small_manifest), load_recipe(TINY), run_dir=tmp_path_factory.mktemp("run"))


def test_pack_run_tokens_packs_one_part_per_shard_and_reuses_them(small_manifest: Path, packed_ref: TokensRef,
                                                                   tmp_path: Path) -> None:
    token_manifest = load_token_manifest(packed_ref.manifest)
    assert token_manifest.sha256 == packed_ref.sha256 and token_manifest.block_size == 64
    assert token_manifest.tokenizer == ByteTokenizer().describe() and token_manifest.documents == len(SHORT_DOCS)
    assert {s.path.split("-")[1] for s in token_manifest.shards} == {"00000", "00001"}  # part i = shard i
    run_dir = Path(packed_ref.manifest).parents[3]
    again = pack_run_tokens(load_training_manifest(small_manifest), load_recipe(TINY), run_dir=run_dir)
    assert again == packed_ref  # found, not packed again
    # Another run dir packs the same bytes (the content address holds).
    elsewhere = pack_run_tokens(load_training_manifest(small_manifest), load_recipe(TINY), run_dir=tmp_path)
    assert elsewhere.sha256 == packed_ref.sha256 and elsewhere.manifest != packed_ref.manifest


def test_shard_hash_mismatch_is_rejected(small_manifest: Path, tmp_path: Path) -> None:
    """A parquet shard swapped after validation is refused when the run's tokens are packed."""
    doc = json.loads(small_manifest.read_text())
    copy = tmp_path / "train-1.parquet"
    copy.write_bytes(Path(doc["shards"][1]["path"]).read_bytes() + b"\0")
    doc["shards"][1]["path"] = str(copy)
    manifest = load_training_manifest(_reissue(doc, tmp_path / "m.json"))
    with pytest.raises(ShardIntegrityError, match="sha256 mismatch"):
        pack_run_tokens(manifest, load_recipe(TINY), run_dir=tmp_path / "run")
    copy.unlink()
    with pytest.raises(ShardIntegrityError, match="does not exist"):
        pack_run_tokens(manifest, load_recipe(TINY), run_dir=tmp_path / "run")


def test_a_shard_is_never_read_through_a_link_or_from_a_special_file(small_manifest: Path, tmp_path: Path) -> None:
    """The shard a manifest names must be a regular file where it is: a link to the right bytes is
    refused too (the packer reads only its input), and so is a FIFO, which would block the read."""
    import os

    doc = json.loads(small_manifest.read_text())
    original = Path(doc["shards"][1]["path"])
    link = tmp_path / "train-1.parquet"
    link.symlink_to(original)
    doc["shards"][1]["path"] = str(link)
    manifest = load_training_manifest(_reissue(doc, tmp_path / "m.json"))
    with pytest.raises(ShardIntegrityError, match=f"shard {link} listed in the manifest: .*symlink"):
        pack_run_tokens(manifest, load_recipe(TINY), run_dir=tmp_path / "run")
    link.unlink()
    os.mkfifo(link)
    with pytest.raises(ShardIntegrityError, match=f"shard {link} listed in the manifest: .*FIFO, not a regular file"):
        pack_run_tokens(manifest, load_recipe(TINY), run_dir=tmp_path / "run")


def test_open_run_tokens_checks_the_named_sha256_and_the_recipe(packed_ref: TokensRef, tmp_path: Path) -> None:
    recipe = load_recipe(TINY)
    data = open_run_tokens(packed_ref, recipe, run_dir=tmp_path, rank=0)
    assert data.tokenizer.sha256 == ByteTokenizer().sha256 and data.tokens.num_samples == data.manifest.samples
    with pytest.raises(TokenManifestError, match="the training manifest names"):
        open_run_tokens(TokensRef(manifest=packed_ref.manifest, sha256="f" * 64), recipe, run_dir=tmp_path, rank=0)
    with pytest.raises(TokenizerMismatchError, match="tokenizer.eos_id = 0"):
        open_run_tokens(packed_ref, load_recipe(TINY, ["tokenizer.eos_id=0"]), run_dir=tmp_path, rank=0)
    with pytest.raises(BlockSizeMismatchError, match="asks for 32"):
        open_run_tokens(packed_ref, load_recipe(TINY, ["model.block_size=32"]), run_dir=tmp_path, rank=0)
    with pytest.raises(TokenizerMismatchError, match="tokenizer.kind = 'bpe'"):
        bpe = load_recipe(TINY, ["tokenizer.kind='bpe'", "tokenizer.vocab_size=300"])
        open_run_tokens(packed_ref, bpe, run_dir=tmp_path, rank=0)


def test_open_run_tokens_refuses_a_truncated_shard_and_a_foreign_tokenizer_artifact(packed_ref: TokensRef,
                                                                                      tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "tokens"
    shutil.copytree(Path(packed_ref.manifest).parent, copy)
    ref = TokensRef(manifest=str(copy / "token_manifest.json"), sha256=packed_ref.sha256)
    (copy / "tokenizer.json").write_bytes(ByteTokenizer(eos_id=0).to_bytes())
    with pytest.raises(TokenizerMismatchError, match="the token manifest says"):
        open_run_tokens(ref, load_recipe(TINY), run_dir=tmp_path, rank=0)
    (copy / "tokenizer.json").write_bytes(ByteTokenizer().to_bytes())
    shard = sorted(copy.glob("part-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(TokenShardError, match="truncated"):
        open_run_tokens(ref, load_recipe(TINY), run_dir=tmp_path, rank=0)


def test_an_id_at_or_above_the_vocabulary_is_refused(packed_ref: TokensRef, tmp_path: Path) -> None:
    """Shards of a 257-id byte tokenizer read by a recipe whose tokenizer has 256 ids: refused by the
    recorded max id before a row is read; an id written into a shard afterwards, on its first read."""
    import shutil

    copy = tmp_path / "tokens"
    shutil.copytree(Path(packed_ref.manifest).parent, copy)
    ref = TokensRef(manifest=str(copy / "token_manifest.json"), sha256=packed_ref.sha256)
    data = open_run_tokens(ref, load_recipe(TINY), run_dir=tmp_path, rank=0)
    shard = copy / data.manifest.shards[0].path
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = 300  # >= 257
    ids.tofile(shard)
    with pytest.raises(TokenShardError, match="at or above the vocabulary size 257"):
        data.tokens.read(np.arange(4))


def test_recipe_tokenizer_checks_name_what_differs(tmp_path: Path) -> None:
    cfg = load_recipe(None).tokenizer
    check_recipe_tokenizer(cfg, ByteTokenizer())
    with pytest.raises(TokenizerMismatchError, match="tokenizer.kind = 'byte', tokenizer.eos_id = 256"):
        check_recipe_tokenizer(cfg, ByteTokenizer(eos_id=0))
    bpe = build_tokenizer(load_recipe(None, ["tokenizer.kind=bpe", "tokenizer.vocab_size=300"]).tokenizer,
                          training_texts=lambda: [text for _, text in SHORT_DOCS])
    assert bpe.kind == "bpe" and bpe.vocab_size <= 300
    check_recipe_tokenizer(load_recipe(None, ["tokenizer.kind=bpe", "tokenizer.vocab_size=300"]).tokenizer, bpe)
    with pytest.raises(TokenizerMismatchError, match="tokenizer.vocab_size = 280"):
        check_recipe_tokenizer(load_recipe(None, ["tokenizer.kind=bpe", "tokenizer.vocab_size=280"]).tokenizer, bpe)
    path = tmp_path / "tok.json"
    bpe.save(path)
    file_cfg = load_recipe(None, ["tokenizer.kind=file", f"tokenizer.path='{path}'"]).tokenizer
    check_recipe_tokenizer(file_cfg, bpe)
    with pytest.raises(TokenizerMismatchError, match="tokenizer.kind = 'file'"):
        check_recipe_tokenizer(file_cfg, ByteTokenizer())
    with pytest.raises(RecipeError, match="model.vocab_size = 256 is smaller"):
        load_recipe(None, ["tokenizer.kind=file", f"tokenizer.path='{path}'", "model.vocab_size=256"])

"""A run's training data: the TrainingManifest's shards as packed tokens that every rank reads.

::

    ref = manifest.tokens or pack_run_tokens(manifest, recipe, run_dir=RUN, recipe_path=R)  # rank 0 packs
    data = open_run_tokens(ref, recipe, run_dir=RUN, rank=r, recipe_path=R)                 # every rank
    TokenLoader(data.tokens, ...)          data.tokenizer (its artifact goes into every checkpoint)

Two sources, one code path after them:

- the manifest's ``tokens`` names a token manifest made by the tokenize stage: an absolute path
  (``PackedTokens`` on a local or shared filesystem) or an ``s3://`` URL (``kiln_trainer.remote``:
  shards streamed into a bounded per-rank cache under ``KILN_TOKEN_CACHE_DIR`` or
  ``RUN/token-cache``, sized by ``data.cache_bytes`` or ``KILN_TOKEN_CACHE_BYTES``);
- without it (a manifest from ``kiln train --manifest``, the launcher tests, older stages), rank 0
  packs the listed, sha256-checked parquet shards with the recipe's tokenizer into
  ``RUN/tokens/<training manifest sha256[:16]>/<token_shards_key>/`` -- reused on a restart --
  while the other ranks wait (``kiln_trainer.train``), and then every rank opens that directory.

``open_run_tokens`` refuses, before step 1 (``TrainerError``: exit 2, nothing trained): a token
manifest whose sha256 is not the one named; a tokenizer artifact that does not hash to the token
manifest's; a tokenizer other than the recipe's (``TokenizerMismatchError``: byte with another EOS,
a file with other bytes, a bpe that is not kiln's within ``tokenizer.vocab_size``); a block size
other than ``model.block_size``; a shard whose recorded largest id is at or above the
vocabulary; a model vocabulary smaller than the tokenizer's; a truncated or missing local shard. A
shard whose bytes were altered after packing is refused on its first read (``PackedTokens``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from kiln_trainer.checkpoint_manifest import TOKEN_CACHE_SUBDIR, TOKENS_SUBDIR, canonical_json
from kiln_trainer.config import Recipe, TokenizerConfig, check_model_vocab
from kiln_trainer.errors import TokenizerMismatchError, TokenManifestError, naming_path
from kiln_trainer.packed import (
    TOKEN_MANIFEST_NAME,
    PackedTokens,
    TokenManifest,
    check_compatible,
    iter_training_texts,
    load_token_manifest,
    pack_training_shards,
)
from kiln_trainer.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
from kiln_trainer.training_manifest import TokensRef, TrainingManifest

__all__ = ["CACHE_DIR_ENV", "RunTokens", "check_recipe_tokenizer", "open_run_tokens", "pack_run_tokens"]

CACHE_DIR_ENV = "KILN_TOKEN_CACHE_DIR"
"""A node-local directory for the S3 token cache (default ``RUN/token-cache``); one subfolder per rank."""


@dataclass(frozen=True, slots=True)
class RunTokens:
    """The checked packed tokens of a run and the tokenizer they were packed with."""

    tokens: PackedTokens
    tokenizer: Tokenizer

    @property
    def manifest(self) -> TokenManifest:
        return self.tokens.manifest


# --------------------------------------------------------------------------- packing (rank 0)


def pack_run_tokens(
    manifest: TrainingManifest, recipe: Recipe, *, run_dir: str | Path, recipe_path: str | Path | None = None
) -> TokensRef:
    """Rank 0, for a manifest without ``tokens``: pack its shards under the run dir (or reuse them)."""
    root = Path(run_dir) / TOKENS_SUBDIR / manifest.sha256[:16]
    with naming_path(root):  # a failed write names no file: say where (a full disk under the run dir)
        tokenizer = _recipe_tokenizer(manifest, recipe.tokenizer, root, recipe_path)
        packed = pack_training_shards(
            root,
            snapshot_id=manifest.snapshot_id,
            tokenizer=tokenizer,
            block_size=recipe.model.block_size,
            shards=manifest.shards,
        )
    return TokensRef(manifest=str(Path(packed.path) / TOKEN_MANIFEST_NAME), sha256=packed.sha256)


def _recipe_tokenizer(manifest: TrainingManifest, cfg: TokenizerConfig, root: Path, recipe_path: str | Path | None) -> Tokenizer:
    """The recipe's tokenizer; a BPE trained here is kept next to the shards, so a restart reuses it."""
    if cfg.kind != "bpe":
        return build_tokenizer(cfg, recipe_path=recipe_path)
    inputs = {"training_manifest_sha256": manifest.sha256, "tokenizer": {
        "vocab_size": cfg.vocab_size, "eos_token": cfg.eos_token, "max_train_chars": cfg.max_train_chars}}
    cached = root / f"bpe-{hashlib.sha256(canonical_json(inputs)).hexdigest()[:32]}.json"
    if cached.is_file():
        return load_tokenizer(cached, eos_token=cfg.eos_token)
    tokenizer = build_tokenizer(cfg, training_texts=lambda: iter_training_texts(manifest.shards))
    tokenizer.save(cached)
    return tokenizer


# --------------------------------------------------------------------------- opening (every rank)


def open_run_tokens(
    ref: TokensRef, recipe: Recipe, *, run_dir: str | Path, rank: int, recipe_path: str | Path | None = None,
    cache_name: str = "",
) -> RunTokens:
    """The token shards ``ref`` names, checked against it and against the recipe (see the module docstring).
    ``cache_name``: a mixture's source name, so each source's S3 cache has a folder of its own."""
    if ref.remote:
        return _open_remote(ref, recipe, run_dir=Path(run_dir), rank=rank, recipe_path=recipe_path, cache_name=cache_name)
    manifest = load_token_manifest(ref.manifest)
    _check_named_sha256(manifest, ref)
    tokenizer = _shards_tokenizer(manifest, Path(manifest.path) / manifest.tokenizer_file, recipe.tokenizer)
    _check_for_recipe(manifest, tokenizer, recipe, recipe_path)
    return RunTokens(PackedTokens(manifest, vocab_size=tokenizer.vocab_size), tokenizer)


def _open_remote(ref: TokensRef, recipe: Recipe, *, run_dir: Path, rank: int, recipe_path: str | Path | None,
                 cache_name: str = "") -> RunTokens:
    from kiln_trainer.remote import S3ShardCache, cache_bytes_from_env, open_remote_tokens

    prefix = ref.manifest.removesuffix("/" + TOKEN_MANIFEST_NAME)
    cache_root = Path(os.environ.get(CACHE_DIR_ENV) or run_dir / TOKEN_CACHE_SUBDIR)
    remote = open_remote_tokens(
        prefix,
        # One cache per process and source: its accounting is in-process.
        cache_dir=cache_root / (f"rank-{rank:05d}" + (f"-{cache_name}" if cache_name else "")),
        cache_bytes=cache_bytes_from_env(recipe.data.cache_bytes),
        expected_manifest_sha256=ref.sha256,
    )
    manifest, store = remote.manifest, remote.store
    assert isinstance(store, S3ShardCache)
    artifact = store.fetch_file(manifest.tokenizer_file, manifest.tokenizer["sha256"])
    tokenizer = _shards_tokenizer(manifest, artifact, recipe.tokenizer)
    _check_for_recipe(manifest, tokenizer, recipe, recipe_path)
    return RunTokens(PackedTokens(manifest, store, vocab_size=tokenizer.vocab_size), tokenizer)


def _check_named_sha256(manifest: TokenManifest, ref: TokensRef) -> None:
    if manifest.sha256 != ref.sha256:
        raise TokenManifestError(
            f"{ref.manifest}: token manifest sha256 {manifest.sha256}, but the training manifest names {ref.sha256}"
        )


def _shards_tokenizer(manifest: TokenManifest, artifact: Path, cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer artifact stored with the shards, which must be the one the token manifest names."""
    tokenizer = load_tokenizer(artifact, eos_token=cfg.eos_token)
    named = manifest.tokenizer
    if tokenizer.sha256 != named["sha256"] or tokenizer.eos_id != named["eos_id"]:
        raise TokenizerMismatchError(
            f"{artifact}: tokenizer sha256 {tokenizer.sha256} (EOS id {tokenizer.eos_id}), but the token manifest "
            f"says sha256 {named['sha256']} (EOS id {named['eos_id']})"
        )
    return tokenizer


def check_recipe_tokenizer(cfg: TokenizerConfig, shards: Tokenizer, *, recipe_path: str | Path | None = None) -> None:
    """Refuse shards packed with a tokenizer other than the one the recipe's ``[tokenizer]`` asks for."""
    if cfg.kind == "bpe":
        if shards.kind != "bpe" or shards.vocab_size > cfg.vocab_size:
            raise TokenizerMismatchError(
                f"the recipe asks for {cfg.describe()}, but the token shards were packed with a {shards.kind} "
                f"tokenizer of {shards.vocab_size} ids (sha256 {shards.sha256}); re-tokenize for this recipe"
            )
        return
    expected = build_tokenizer(cfg, recipe_path=recipe_path)
    if expected.sha256 != shards.sha256:
        raise TokenizerMismatchError(
            f"the recipe asks for {cfg.describe()} (sha256 {expected.sha256}, EOS id {expected.eos_id}), but the "
            f"token shards were packed with a {shards.kind} tokenizer (sha256 {shards.sha256}, EOS id "
            f"{shards.eos_id}); re-tokenize for this recipe"
        )


def _check_for_recipe(manifest: TokenManifest, tokenizer: Tokenizer, recipe: Recipe, recipe_path: str | Path | None) -> None:
    check_recipe_tokenizer(recipe.tokenizer, tokenizer, recipe_path=recipe_path)
    check_model_vocab(recipe.model.vocab_size, tokenizer.vocab_size, recipe.tokenizer)
    check_compatible(manifest, tokenizer=tokenizer, block_size=recipe.model.block_size, vocab_size=tokenizer.vocab_size)

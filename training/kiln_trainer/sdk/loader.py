"""A session's streaming loader: the packed tokens the TrainingManifest names (or rank 0 packs them),
checked on every rank before step 1, read through ``TokenLoader`` -- global batches whose sample ids
depend only on the seed, the shards and the step, never on the world size; each rank reads its
contiguous ``1/W`` of each.

A manifest of several sources (format 2) opens each source's packed tokens, checked as one
source's are and against what the manifest says of them (tokenizer, block size), and mixes them
by weight (``TokenLoader`` over ``LoaderSource``s, ``kiln_trainer.mixture``). Its ``RunTokens`` is
then the first source's: the tokenizer is every source's; the loader holds every source's tokens
(``loader.sources``) and names the set (``loader.token_manifest_sha256``). A source's caps
(``max_epochs``, ``max_tokens``) go to its ``LoaderSource``: the loader says where they end the run
(``loader.cap_stop``)."""

from __future__ import annotations

from pathlib import Path

from kiln_trainer import errors as trainer_errors
from kiln_trainer.checkpoint_manifest import SAMPLE_LOG_SUBDIR
from kiln_trainer.config import Recipe
from kiln_trainer.data import RunTokens, open_run_tokens, pack_run_tokens
from kiln_trainer.distributed import DistEnv, broadcast_object
from kiln_trainer.errors import (
    STORAGE_ERRNOS,
    BlockSizeMismatchError,
    StorageError,
    TokenizerMismatchError,
    TrainerError,
    TrainingManifestError,
    os_error_text,
)
from kiln_trainer.loader import LoaderSource, TokenLoader
from kiln_trainer.packed import PackedTokens
from kiln_trainer.training_manifest import ManifestSource, TokensRef, TrainingManifest


def open_loader(
    manifest: TrainingManifest, recipe: Recipe, env: DistEnv, *, run_dir: Path, recipe_path: Path | None,
    sample_log: bool,
) -> tuple[RunTokens, TokenLoader]:
    """Every rank opens and checks the same packed tokens (rank 0 packs them first if the manifest
    names none), then reads only its part of each global batch."""
    log_path = run_dir / SAMPLE_LOG_SUBDIR / f"rank-{env.rank:05d}.jsonl" if sample_log else None
    tokens: PackedTokens | list[LoaderSource]
    unpacked = [s.name for s in manifest.sources if s.tokens is None]
    if unpacked:
        raise TrainingManifestError(
            f"training manifest {manifest.path or ''}: source(s) {', '.join(unpacked)} name no packed tokens; a "
            "mixture is packed by kiln's tokenize stage (one tokenizer for every source) before it is trained")
    if manifest.is_mixture:
        opened = [_open_source(source, recipe, run_dir=run_dir, rank=env.rank, recipe_path=recipe_path)
                  for source in manifest.data_sources]
        data = opened[0]
        tokens = [LoaderSource(s.name, s.weight, d.tokens, s.max_epochs, s.max_tokens)
                  for s, d in zip(manifest.data_sources, opened, strict=True)]
    else:
        ref = manifest.tokens or _pack_on_rank0(manifest, recipe, env, run_dir=run_dir, recipe_path=recipe_path)
        data = open_run_tokens(ref, recipe, run_dir=run_dir, rank=env.rank, recipe_path=recipe_path)
        only = manifest.data_sources[0]  # a format-2 manifest of one source may cap it; its order stays the plain one
        capped = only.max_epochs is not None or only.max_tokens is not None
        tokens = [LoaderSource(only.name, only.weight, data.tokens, only.max_epochs, only.max_tokens)] if capped else data.tokens
    loader = TokenLoader(
        tokens,
        global_batch_size=recipe.data.global_batch_size,
        micro_batch_size=recipe.data.micro_batch_size,
        rank=env.rank,
        world_size=env.world_size,
        seed=recipe.train.seed,
        window_shards=recipe.data.window_shards,
        prefetch_steps=recipe.data.prefetch_steps,
        sample_log=log_path,
    )
    return data, loader


def _open_source(source: ManifestSource, recipe: Recipe, *, run_dir: Path, rank: int, recipe_path: Path | None) -> RunTokens:
    """One source of a mixture: its packed tokens, checked as one source's are (the named sha256, the
    recipe's tokenizer and block size), and against the tokenizer and block size its entry names."""
    ref = source.tokens
    assert ref is not None, "open_loader refuses a mixture whose sources name no tokens"
    data = open_run_tokens(ref, recipe, run_dir=run_dir, rank=rank, recipe_path=recipe_path, cache_name=source.name)
    packed = data.manifest
    if packed.tokenizer["sha256"] != ref.tokenizer_sha256:
        raise TokenizerMismatchError(
            f"source {source.name!r}: its token manifest {ref.manifest} was packed with tokenizer sha256 "
            f"{packed.tokenizer['sha256']}, but the training manifest says {ref.tokenizer_sha256}")
    if packed.block_size != ref.block_size:
        raise BlockSizeMismatchError(
            f"source {source.name!r}: its token manifest {ref.manifest} has block size {packed.block_size}, but the "
            f"training manifest says {ref.block_size}")
    return data


def _pack_on_rank0(
    manifest: TrainingManifest, recipe: Recipe, env: DistEnv, *, run_dir: Path, recipe_path: Path | None
) -> TokensRef:
    """Rank 0 packs the manifest's shards under the run dir (or finds them packed); the others
    wait for the reference, or for the fault rank 0 met, which every rank then raises (exit 2)."""
    outcome: dict[str, str] | None = None
    if env.is_main:
        try:
            ref = pack_run_tokens(manifest, recipe, run_dir=run_dir, recipe_path=recipe_path)
            outcome = {"manifest": ref.manifest, "sha256": ref.sha256}
        except TrainerError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                raise
            outcome = {"error": StorageError.__name__, "message": f"packing token shards: {os_error_text(exc)}"}
    outcome = broadcast_object(outcome, env)
    assert outcome is not None
    if "error" in outcome:
        _raise_rank0_fault(outcome)
    return TokensRef(manifest=outcome["manifest"], sha256=outcome["sha256"])


def _raise_rank0_fault(outcome: dict[str, str]) -> None:
    """Re-raise, on every rank, the trainer fault rank 0 met (its class, by name, from the error tree)."""
    cls = getattr(trainer_errors, outcome["error"], TrainerError)
    if not (isinstance(cls, type) and issubclass(cls, TrainerError)):
        cls = TrainerError
    raise cls(outcome["message"])

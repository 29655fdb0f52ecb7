"""Save and resume for a session: kiln's committed checkpoints (``kiln_trainer.checkpoint``, format 2,
under ``ddp``; ``kiln_trainer.sharded_checkpoint``, format 3, under ``fsdp``), sealed manifest last,
with every rank's RNG, the loader's position and the ``TrainState``.

A resume starts from the newest committed checkpoint that every rank finds whole (each hashes its
share of the files), refuses one of another run (recipe, training manifest, token manifest), and
loads it whatever strategy and world size wrote it. Before the first commit of a fresh run the
step-0 state is kept in memory, so the guard can roll back to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kiln_trainer.checkpoint import (
    CheckpointIdentity,
    CheckpointWriter,
    capture_rng_state,
    gather_rng_bytes,
    load_side_state,
    restore_rng_state,
)
from kiln_trainer.checkpoint_manifest import (
    CHECKPOINTS_SUBDIR,
    CURRENT_FORMATS,
    checkpoint_dirs,
    latest_committed,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
)
from kiln_trainer.config import Recipe, resume_identity
from kiln_trainer.distributed import DistEnv, any_rank, broadcast_object, seed_rngs
from kiln_trainer.errors import CheckpointError, ResumeMismatchError
from kiln_trainer.loader import TokenLoader
from kiln_trainer.parallel import uses_fsdp
from kiln_trainer.sdk.state import TrainState, rank_rng_seed, recipe_changes
from kiln_trainer.sharded_checkpoint import ShardedCheckpointWriter, load_model_and_optimizer

# The run's log: one logger name for every line an operator (and the tests) read about a resume.
log = logging.getLogger("kiln_trainer.train")


class Scheduler(Protocol):
    """What a learning-rate scheduler must offer to be checkpointed (``torch.optim.lr_scheduler``'s)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class NoScheduler:
    """A session's scheduler when the trainer has none: nothing to save or restore."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore."""


@dataclass(kw_only=True)
class _InitialState:
    """In-memory step-0 state of a fresh run: the rollback target before the first checkpoint."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    train_state: dict[str, Any]
    loader: dict[str, Any]


@dataclass(kw_only=True, slots=True)
class Restored:
    """What a restore put back besides the model, optimizer and scheduler."""

    state: TrainState
    made_at_world_size: int


class Checkpointer:
    """This rank's part of a session's checkpoints: under fsdp a writer on every rank (each writes
    its own shards), under ddp only on rank 0 (which writes the whole replicated state)."""

    def __init__(
        self, *, run_dir: Path, env: DistEnv, recipe: Recipe, identity: CheckpointIdentity, threads: int,
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Scheduler, loader: TokenLoader,
    ) -> None:
        self.run_dir, self.env, self.recipe, self.identity, self.threads = run_dir, env, recipe, identity, threads
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.initial: _InitialState | None = None
        keep_last, async_save = recipe.checkpoint.keep_last, recipe.checkpoint.async_save
        self.writer: CheckpointWriter | ShardedCheckpointWriter | None = None
        if uses_fsdp(recipe):
            self.writer = ShardedCheckpointWriter(run_dir, identity, keep_last=keep_last, async_save=async_save, env=env)
        elif env.is_main:
            self.writer = CheckpointWriter(run_dir, identity, keep_last=keep_last, async_save=async_save)

    @property
    def last_committed_step(self) -> int | None:
        return self.writer.last_committed_step if self.writer is not None else None

    @property
    def blocking_s(self) -> float:
        """Seconds the loop has waited for saves in this invocation."""
        return self.writer.total_blocking_s if self.writer is not None else 0.0

    # ----------------------------------------------------------------- save

    def save(self, step: int, state: TrainState) -> float:
        """Every rank: checkpoint ``step`` (asynchronously when the recipe says); the seconds the loop
        was blocked."""
        rng_blobs = gather_rng_bytes(self.env.device)  # a collective: every rank, even without a writer
        if self.writer is None:
            return 0.0
        trainer_state = state.to_dict() | {"torch_threads": self.threads, "loader": self.loader.state_dict()}
        return self.writer.save(step=step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                trainer_state=trainer_state, rng_blobs=rng_blobs)

    def wait(self) -> Path | None:
        """Every rank: the save in flight committed (its error raised); the newest committed step dir."""
        return self.writer.wait() if self.writer is not None else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ----------------------------------------------------------------- resume

    def resume(self, fresh: TrainState) -> Restored | None:
        """The newest committed checkpoint restored into this rank, or None (and the step-0 state
        kept for a rollback) when there is none."""
        step_dir = self.newest_committed_step_dir()
        if step_dir is None:
            self._keep_initial_state(fresh)
            return None
        restored = self.restore_from(step_dir)
        if self.writer is not None:
            self.writer.last_committed_step = restored.state.step
            self.writer.last_committed_dir = step_dir
        log.info("resumed from %s (step %d)", step_dir, restored.state.step)
        return restored

    def newest_committed_step_dir(self) -> Path | None:
        """The newest committed checkpoint, verified by all ranks together: rank 0 names the
        candidates (newest first), each rank hashes its share of a candidate's bytes, and a candidate
        any rank finds damaged is skipped by all. (Alone, ``latest_committed``.)"""
        if not self.env.distributed:
            return latest_committed(self.run_dir)
        steps = [step for step, _ in reversed(checkpoint_dirs(self.run_dir))] if self.env.is_main else []
        for step in broadcast_object(steps, self.env):
            step_dir = self.run_dir / CHECKPOINTS_SUBDIR / step_dir_name(step)
            problem = ""
            try:
                verify_checkpoint(step_dir, share=(self.env.rank, self.env.world_size))
            except CheckpointError as exc:
                problem = str(exc)
                log.warning("ignoring checkpoint at step %d: %s", step, problem)
            if not any_rank(bool(problem), self.env):
                return step_dir
            if self.env.is_main and not problem:
                log.warning("ignoring checkpoint at step %d: another rank found it damaged (its log says why)", step)
        return None

    def restore_from(self, step_dir: Path) -> Restored:
        """Load the checkpoint (the ranks verified it) into this rank, whatever format, strategy and
        world size wrote it."""
        manifest = read_manifest(step_dir)
        self._refuse_a_checkpoint_of_another_run(manifest, step_dir)
        load_model_and_optimizer(step_dir, manifest, self.model, self.optimizer, sharded=uses_fsdp(self.recipe))
        ck = load_side_state(step_dir, manifest, rank=self.env.rank)
        self.scheduler.load_state_dict(ck.scheduler)
        state = TrainState.from_dict(ck.trainer_state)
        self.loader.load_state_dict(ck.trainer_state["loader"])
        saved_threads = ck.trainer_state.get("torch_threads")
        if saved_threads is not None and saved_threads != self.threads:
            # Intra-op reductions split work by thread count, so the bits differ (not the maths).
            log.warning(
                "resuming with %d torch threads per rank, the checkpoint was made with %s: "
                "the run continues correctly but not bit-identically",
                self.threads,
                saved_threads,
            )
        # Last, after everything that might draw random numbers while being set up.
        if ck.rng is not None:
            restore_rng_state(ck.rng)
        else:  # a rank the checkpoint's world did not have
            seed_rngs(rank_rng_seed(self.recipe.train.seed, self.env.rank, state.step))
        made_with = manifest.get("strategy", "ddp")
        if made_with != self.recipe.parallel.strategy:
            log.info("resumed a %s checkpoint into parallel.strategy = %r", made_with, self.recipe.parallel.strategy)
        return Restored(state=state, made_at_world_size=int(manifest["world_size"]))

    def _refuse_a_checkpoint_of_another_run(self, m: dict[str, Any], step_dir: Path) -> None:
        if m.get("format") not in CURRENT_FORMATS:
            raise ResumeMismatchError(
                f"cannot resume from {step_dir}: checkpoint format {m.get('format')} was written before the token "
                f"data path (no tokenizer, no loader state); this trainer reads formats {CURRENT_FORMATS}: use a new run dir"
            )
        ident = self.identity
        problems = []
        made, asked = resume_identity(m["recipe"]), resume_identity(ident.recipe)
        if made != asked:
            changed = recipe_changes(made, asked)
            problems.append(f"recipe_sha256 {m['recipe_sha256']} != this recipe's {ident.recipe_sha256} ({changed})")
        if m["training_manifest_sha256"] != ident.training_manifest_sha256:
            problems.append(f"training manifest {m['training_manifest_sha256']} != {ident.training_manifest_sha256}")
        if m["token_manifest_sha256"] != ident.token_manifest_sha256:
            problems.append(f"token_manifest_sha256 {m['token_manifest_sha256']} != {ident.token_manifest_sha256}")
        if problems:
            raise ResumeMismatchError(f"cannot resume from {step_dir}: " + "; ".join(problems))
        micro = (m["recipe"].get("data") or {}).get("micro_batch_size")
        if micro != self.recipe.data.micro_batch_size or m["world_size"] != self.env.world_size:
            # Same global batches, other reduction order: not bit-identical to an uninterrupted run.
            log.warning(
                "resuming with world size %d x data.micro_batch_size %d, the checkpoint was made with %d x %s: "
                "the same global batches, summed in another order",
                self.env.world_size,
                self.recipe.data.micro_batch_size,
                m["world_size"],
                micro,
            )

    # ----------------------------------------------------------------- rollback

    def _keep_initial_state(self, fresh: TrainState) -> None:
        self.initial = _InitialState(
            model={k: v.detach().clone() for k, v in self.model.state_dict().items()},
            optimizer=self.optimizer.state_dict(),  # empty state at step 0: nothing to alias
            scheduler=dict(self.scheduler.state_dict()),
            rng=capture_rng_state(),
            train_state=fresh.to_dict(),
            loader=self.loader.state_dict(),
        )

    def restore_last_committed(self) -> TrainState:
        """Every rank: the newest committed checkpoint, or before the first one the in-memory step-0
        state, back in place; the ``TrainState`` it holds."""
        self.wait()
        step_dir = self.newest_committed_step_dir()
        if step_dir is not None:
            return self.restore_from(step_dir).state
        assert self.initial is not None, "a resumed run always has a committed checkpoint"
        self.model.load_state_dict(self.initial.model)
        self.optimizer.load_state_dict(self.initial.optimizer)
        self.optimizer.state.clear()
        self.scheduler.load_state_dict(self.initial.scheduler)
        self.loader.load_state_dict(self.initial.loader)
        restore_rng_state(self.initial.rng)
        return TrainState.from_dict(self.initial.train_state)

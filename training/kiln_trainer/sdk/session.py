"""A training session: this rank's part of one invocation of an entry point, with every guarantee
kiln makes behind a few calls (the package docstring shows a whole loop).

``Session.start`` reads the recipe, initialises the process group from torchrun's environment,
sets threads per rank, opens the streaming loader (checked before step 1), opens rank 0's metrics
and seeds every rank alike, so each builds the same initial model. ``wrap`` puts the model in the
recipe's strategy and then seeds each rank for itself; ``resume`` restores the newest committed
checkpoint (or keeps the step-0 state); ``next_batch``, ``mean_loss``, ``rejects`` and ``report``
frame each step; ``finish`` writes ``result.json``; ``close`` releases everything.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kiln_trainer.checkpoint import CheckpointIdentity
from kiln_trainer.checkpoint_manifest import TRAINING_MANIFEST_COPY, atomic_write_bytes, latest_committed
from kiln_trainer.config import Recipe, load_recipe
from kiln_trainer.contract import METRICS_EVENT_KEY, ROLLBACK_EVENT, WORLD_SIZE_CHANGE_EVENT, TrainResultRecord
from kiln_trainer.data import RunTokens
from kiln_trainer.distributed import (
    DistEnv,
    average_across_ranks_,
    destroy_process_group,
    gather_node_names,
    init_distributed,
    seed_rngs,
    set_threads,
    wait_for_all_ranks,
)
from kiln_trainer.errors import TrainerError
from kiln_trainer.loader import StepBatch, TokenLoader
from kiln_trainer.metrics import MetricsHub
from kiln_trainer.sdk.checkpointing import Checkpointer, NoScheduler, Scheduler
from kiln_trainer.sdk.hooks import StepHook, StepStats, default_hooks
from kiln_trainer.sdk.loader import open_loader
from kiln_trainer.sdk.outputs import open_metrics, train_result, write_result
from kiln_trainer.sdk.state import TrainState
from kiln_trainer.sdk.strategy import Strategy
from kiln_trainer.timing import StepClock, StepMarks
from kiln_trainer.training_manifest import TrainingManifest, load_training_manifest

log = logging.getLogger("kiln_trainer.train")


class Session:
    """See the module docstring. Build one with ``Session.start`` (or ``kiln_trainer.sdk.start``)."""

    def __init__(
        self, *, manifest_path: Path, recipe_path: Path, run_dir: Path, overrides: Iterable[str] = (),
        max_steps: int | None = None, sample_log: bool = False, hooks: list[StepHook] | None = None,
    ) -> None:
        self.marks: dict[str, float] = {"run_init": time.time()}
        """Wall-clock phase ends of this invocation's start-up (the startup profile reads them)."""
        self.recipe: Recipe = load_recipe(recipe_path, list(overrides))
        self.run_dir = run_dir.resolve()
        self.hooks = default_hooks() if hooks is None else list(hooks)
        self.state = TrainState()
        self.resumed_from: int | None = None
        self.metrics = MetricsHub([])
        self.mlflow_run_id = ""
        self._strategy: Strategy | None = None
        self._checkpoints: Checkpointer | None = None
        self._loader: TokenLoader | None = None
        self._optimizer: torch.optim.Optimizer | None = None

        self.env: DistEnv = init_distributed(self.recipe)
        self.marks["dist_init"] = time.time()
        try:
            self._open(manifest_path, recipe_path, max_steps=max_steps, sample_log=sample_log)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.close()
            raise

    def _open(self, manifest_path: Path, recipe_path: Path, *, max_steps: int | None, sample_log: bool) -> None:
        """Everything after the process group: threads, nodes, the loader, rank 0's metrics, the seed."""
        self.threads = set_threads(self.env)
        self.nodes = gather_node_names(self.env)
        if self.env.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        cfg = self.recipe
        self.accum_steps = cfg.data.accum_steps(self.env.world_size)  # a geometry that does not divide: before any I/O
        self._asked_step = cfg.train.steps if max_steps is None else min(cfg.train.steps, max_steps)
        self.tokens_per_step = cfg.data.global_batch_size * cfg.model.block_size

        self.manifest: TrainingManifest = load_training_manifest(manifest_path)
        self._manifest_bytes = Path(manifest_path).read_bytes()
        self.data: RunTokens
        self.data, self._loader = open_loader(self.manifest, cfg, self.env, run_dir=self.run_dir,
                                              recipe_path=recipe_path, sample_log=sample_log)
        self.marks["data"] = time.time()
        self.identity = CheckpointIdentity(
            world_size=self.env.world_size,
            recipe=cfg.to_dict(),
            recipe_sha256=cfg.sha256,
            snapshot_id=self.manifest.snapshot_id,
            training_manifest_sha256=self.manifest.sha256,
            token_manifest_sha256=self.loader.token_manifest_sha256,  # one source's, or a mixture's set
            tokenizer=self.data.tokenizer,
        )
        """What every checkpoint of this session records besides the state itself."""
        if self.env.is_main:
            self.metrics, self.mlflow_run_id = open_metrics(self.run_dir, cfg, self.identity,
                                                            world_size=self.env.world_size)
        self.clock = StepClock(self.env.device)
        self._t_step = 0.0
        self._data_s = 0.0
        self._m_start: Any = None
        self._m_ready: Any = None
        self._m_reduced: Any = None
        self._loop_t0 = 0.0
        self._loop_tokens = 0
        # Same seed on every rank: each builds the same initial model (wrap then seeds each rank apart).
        seed_rngs(cfg.train.seed)

    @property
    def target_step(self) -> int:
        """This invocation ends after this step: ``train.steps``, or ``--max-steps`` when lower, or where
        a capped source of the mixture ends the run (``stopped_by_cap``) when sooner."""
        return min(self._asked_step, self.cap_target) if self.cap_target is not None else self._asked_step

    @property
    def cap_target(self) -> int | None:
        """The optimizer step at which a capped source ends the run (None: no cap): the loader's
        ``cap_stop.step`` less the global batches the guard skipped before it (each uses up draws)."""
        stop = self.loader.cap_stop
        if stop is None:
            return None
        return stop.step - sum(1 for b in set(self.state.skipped_batches) if b < stop.step)

    @property
    def stopped_by_cap(self) -> bool:
        """The run has reached the step where a capped source ends it: nothing is left to train."""
        return self.cap_target is not None and self.state.step >= self.cap_target

    @classmethod
    def start(cls, args: argparse.Namespace, *, hooks: list[StepHook] | None = None) -> Session:
        """A session from an entry point's parsed arguments (``kiln_trainer.sdk.parse_args``).
        ``hooks``: None gives kiln's (``hooks.default_hooks``)."""
        return cls(manifest_path=args.manifest, recipe_path=args.recipe, run_dir=args.run_dir,
                   overrides=args.overrides, max_steps=args.max_steps, sample_log=args.sample_log, hooks=hooks)

    # ----------------------------------------------------------------- where this rank is

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def step(self) -> int:
        """The last step applied (the resume point before the first one)."""
        return self.state.step

    @property
    def loader(self) -> TokenLoader:
        assert self._loader is not None
        return self._loader

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            raise TrainerError("the session has no model: call wrap(model) first")
        return self._strategy

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model itself (sharded in place under fsdp): what checkpoints hold."""
        return self.strategy.model

    @property
    def checkpoints(self) -> Checkpointer:
        if self._checkpoints is None:
            raise TrainerError("the session has no optimizer: call resume(optimizer, scheduler) first")
        return self._checkpoints

    @property
    def learning_rate(self) -> float:
        """The first parameter group's learning rate, as the last scheduler step set it."""
        assert self._optimizer is not None
        return float(self._optimizer.param_groups[0]["lr"])

    # ----------------------------------------------------------------- the model

    def wrap(self, model: torch.nn.Module, *, blocks: Iterable[torch.nn.Module] | None = None) -> torch.nn.Module:
        """``model`` in the recipe's strategy (``sdk.strategy``); returns what the loop calls. Build
        the optimizer after this, over ``model.parameters()`` (under fsdp they are the shards).
        ``blocks``: the layers fsdp shards one by one, always used when given. None: kiln's GPT's
        ``transformer.h``, or for another model the outermost submodules of the classes its
        ``_no_split_modules`` names (a ``transformers`` model's decoder layers, as transformers and
        accelerate auto-wrap them: ``parallel.fsdp_blocks``); any other model is refused under fsdp."""
        self._strategy = Strategy(model, self.recipe, self.env, self.clock, blocks=blocks)
        seed_rngs(self.recipe.train.seed + 1 + self.env.rank)  # dropout and the like differ per rank
        return self._strategy.train_model

    def autocast(self) -> Any:
        """The recipe's autocast for the forward (bfloat16 under ddp on CUDA; none on CPU or fsdp)."""
        return self.strategy.autocast

    def micro_batches(self, batch: StepBatch) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs, targets)`` on the device, micro-batch after micro-batch; run the backward inside
        the iteration (``Strategy.micro_batches``)."""
        return self.strategy.micro_batches(batch)

    # ----------------------------------------------------------------- resume

    def resume(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None) -> int:
        """Every rank: restore the newest committed checkpoint into the wrapped model, ``optimizer``,
        ``scheduler``, the loader and the RNGs (or keep the step-0 state of a fresh run); returns the
        step it resumes at (0 on a fresh start). Then every hook's ``on_start``."""
        self.marks["model"] = time.time()
        self._optimizer = optimizer
        self._checkpoints = Checkpointer(
            run_dir=self.run_dir, env=self.env, recipe=self.recipe, identity=self.identity, threads=self.threads,
            model=self.model, optimizer=optimizer, scheduler=scheduler or NoScheduler(), loader=self.loader,
        )
        restored = self._checkpoints.resume(self.state)
        if restored is not None:
            self.state = restored.state
            if restored.made_at_world_size != self.env.world_size:
                self._record_world_size_change(restored.made_at_world_size)
            self.resumed_from = self.state.step
        else:
            log.info("fresh start in %s", self.run_dir)
        if self.env.is_main:
            # After the resume check, so a refused manifest never replaces the run's own copy.
            atomic_write_bytes(self.run_dir / TRAINING_MANIFEST_COPY, self._manifest_bytes)
        self.marks["resumed"] = time.time()
        for hook in self.hooks:
            hook.on_start(self)
        self._loop_t0 = time.perf_counter()
        return self.state.step

    def _record_world_size_change(self, made_at: int) -> None:
        """A resume at another world size (a deliberate one, or an elastic shrink or grow after a lost
        node: the launcher says which): a log line, a ``world_size_change`` event in metrics.jsonl,
        every later checkpoint and result.json, and the MLflow tag ``kiln.world_size_change``."""
        step, world = self.state.step, self.env.world_size
        log.info("resumed at world size %d from a checkpoint of world size %d", world, made_at)
        event = {"kind": WORLD_SIZE_CHANGE_EVENT, "from_world_size": made_at, "to_world_size": world, "at_step": step,
                 "accum_steps": self.accum_steps}
        self.state.events = [*self.state.events, event]
        self.metrics.log(step, {METRICS_EVENT_KEY: WORLD_SIZE_CHANGE_EVENT, **event})
        self.metrics.tag({"kiln.world_size_change": f"{made_at} -> {world} ranks at step {step}"})

    def log_plan(self) -> None:
        """One log line: where this rank runs, the data, the batch geometry, the steps ahead."""
        cfg, tokens = self.recipe, self.data.manifest
        if self.loader.mixture is not None:
            log.info("mixture of %d sources: %s", len(self.loader.sources), ", ".join(
                f"{s.name} weight {s.weight:g} ({s.tokens.num_samples} samples, token manifest "
                f"{s.tokens.manifest.sha256[:12]})" for s in self.loader.sources))
        log.info(
            "rank %d/%d device %s threads %d | %.2fM params | %d samples of %d tokens (%s tokenizer %s, token "
            "manifest %s) | global batch %d = %d ranks x %d micro x %d accum | recipe %s | steps %d -> %d",
            self.env.rank,
            self.env.world_size,
            self.env.device,
            self.threads,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.loader.num_samples,
            tokens.sample_tokens,
            self.data.tokenizer.kind,
            self.data.tokenizer.sha256[:12],
            self.loader.token_manifest_sha256[:12],
            cfg.data.global_batch_size,
            self.env.world_size,
            cfg.data.micro_batch_size,
            self.accum_steps,
            self.identity.recipe_sha256[:12],
            self.state.step,
            self.target_step,
        )

    # ----------------------------------------------------------------- one step

    def next_batch(self) -> StepBatch:
        """This rank's part of the next global batch the guard has not skipped; starts the step's clock."""
        self._t_step = time.perf_counter()
        self._m_start = self.clock.mark()
        self.strategy.grad_ready.ready = None
        self.strategy.collective_wait.reset()
        skipped = self.state.skipped_batches
        while self.loader.step in skipped:
            self.loader.skip_step()
        batch = self.loader.next_step()
        self._data_s = time.perf_counter() - self._t_step
        for hook in self.hooks:
            hook.on_batch(self, self.state.step + 1)
        return batch

    def mean_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss over every rank: this rank's loss (summed over its micro-batches, each
        divided by ``accum_steps``) averaged across ranks, after every hook's ``on_loss``."""
        self._m_ready = self.strategy.grad_ready.ready
        if self._m_ready is None:
            self._m_ready = self.clock.mark()
        average_across_ranks_(loss_sum, self.env)
        value = float(loss_sum.item())
        self._m_reduced = self.clock.mark()
        for hook in self.hooks:
            value = hook.on_loss(self, self.state.step + 1, value)
        return value

    def rejects(self, loss: float, batch: StepBatch) -> bool:
        """True when a hook vetoes the step (kiln's guard: a non-finite or spiking loss): the session
        has then rolled back to its newest committed state and will skip ``batch`` on every rank."""
        step = self.state.step + 1
        for hook in self.hooks:
            reason = hook.veto(self, step, loss)
            if reason is not None:
                self.rollback(reason, loss, batch.step)
                return True
        return False

    def rollback(self, reason: str, loss: float, batch: int) -> None:
        """Return to the newest committed state (a checkpoint, or step 0 before the first) and skip
        global batch ``batch`` from now on; a ``rollback`` event in metrics.jsonl, every later
        checkpoint and result.json."""
        at_step = self.state.step + 1
        events, skipped = list(self.state.events), list(self.state.skipped_batches)
        self.state = self.checkpoints.restore_last_committed()
        assert self._optimizer is not None
        self._optimizer.zero_grad(set_to_none=True)
        event = {
            "kind": ROLLBACK_EVENT,
            "reason": reason,
            "at_step": at_step,
            "to_step": self.state.step,
            "loss": loss if math.isfinite(loss) else str(loss),
            "skipped_batch": batch,
        }
        self.state.events = events + [event]
        self.state.skipped_batches = skipped + [batch]
        log.warning(
            "guard: %s at step %d (loss %s): rolled back to step %d, skipping global batch %d",
            reason,
            at_step,
            loss,
            self.state.step,
            batch,
        )
        self.metrics.log(at_step, {METRICS_EVENT_KEY: ROLLBACK_EVENT, **event})
        for hook in self.hooks:
            hook.on_rollback(self, event)

    def report(self, step: int, loss: float, *, tokens: int | None = None) -> None:
        """Step ``step`` was applied with ``loss`` (``mean_loss``'s value) on ``tokens`` tokens (all
        ranks; default the recipe's global batch x block size): count it, checkpoint it when the
        recipe says (``checkpoint.every_steps`` and the last step), then every hook's ``on_step_end``
        -- the startup profile, the straggler window, the interval log."""
        marks = StepMarks(start=self._m_start, ready=self._m_ready, reduced=self._m_reduced, end=self.clock.mark(),
                          collective_s=self.strategy.collective_wait.seconds)
        step_s = time.perf_counter() - self._t_step
        tokens = self.tokens_per_step if tokens is None else tokens
        self.state.count_step(step, loss, tokens, step_s)
        self._loop_tokens += tokens
        ckpt_s = 0.0
        if step % self.recipe.checkpoint.every_steps == 0 or step == self.target_step:
            ckpt_s = self.save(step)
        stats = StepStats(step=step, loss=loss, tokens=tokens, data_s=self._data_s, step_s=step_s, ckpt_s=ckpt_s,
                          marks=marks)
        for hook in self.hooks:
            hook.on_step_end(self, stats)

    def save(self, step: int) -> float:
        """Every rank: checkpoint ``step`` now (sharded under fsdp; asynchronous when the recipe
        says; committed by the sealed manifest, written last); the seconds the loop was blocked."""
        blocked = self.checkpoints.save(step, self.state)
        self.state.wall_s += blocked
        for hook in self.hooks:
            hook.on_save(self, step, blocked)
        return blocked

    # ----------------------------------------------------------------- the end

    def finish(self) -> TrainResultRecord | None:
        """Rank 0 writes ``result.json`` for the newest committed checkpoint (and returns it); every
        rank waits for it (and, under fsdp, for its part of the last save)."""
        loop_s = time.perf_counter() - self._loop_t0
        result = None
        last_dir = self.checkpoints.wait()
        if self.checkpoints.writer is not None and self.env.is_main:
            if last_dir is None:
                # Nothing was run and nothing committed: e.g. --max-steps 0 on a fresh run dir.
                last_dir = latest_committed(self.run_dir)
            if last_dir is None:
                raise TrainerError(f"no committed checkpoint in {self.run_dir} to report")
            st = self.state
            tokens_per_s = (
                self._loop_tokens / loop_s
                if self._loop_tokens and loop_s > 0
                else (st.train_tokens / st.wall_s if st.wall_s > 0 else 0.0)
            )
            result = train_result(
                run_dir=self.run_dir, last_dir=last_dir, recipe=self.recipe, identity=self.identity, state=st,
                world_size=self.env.world_size, tokens_per_s=tokens_per_s,
                checkpoint_blocking_s=self.checkpoints.blocking_s, mlflow_run_id=self.mlflow_run_id,
                mixture=self.loader.mixture_report(st.skipped_batches),
                stop=self._cap_record(),
            )
            self.metrics.drain()  # metrics.prom is written off the loop's thread; result.json comes last
            path = write_result(self.run_dir, result)
            log.info(
                "result: step %d loss %s weights %s -> %s",
                result["step"],
                result["metrics"]["final_loss"],
                result["weights_sha256"][:16],
                path,
            )
        wait_for_all_ranks(self.env)
        return result

    def _cap_record(self) -> dict[str, Any] | None:
        """``result.json``'s ``stop`` when a capped source ended the run at the committed step."""
        stop = self.loader.cap_stop
        if stop is None or not self.stopped_by_cap:
            return None
        return {**stop.to_json(), "step": self.state.step}

    def close(self) -> None:
        """Stop the loader, wait for and close the checkpoint writer, flush the metrics, free DDP and
        the process group (also after a failure: each part that was opened)."""
        try:
            if self._loader is not None:
                self._loader.close()
            if self._checkpoints is not None:
                self._checkpoints.close()
        finally:
            self.metrics.close()
            if self._strategy is not None:
                self._strategy.release()
            destroy_process_group()

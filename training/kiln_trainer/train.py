"""Train the GPT on a TrainingManifest's packed tokens; resumable, checkpointed, deterministic.

Single process (world size 1, no torchrun needed)::

    python -m kiln_trainer.train --manifest M.json --recipe training/recipes/tiny.toml --run-dir RUN

One node, 2 ranks (gloo on CPU, NCCL + bf16 autocast on GPU)::

    torchrun --standalone --nproc-per-node=2 -m kiln_trainer.train \\
        --manifest M.json --recipe training/recipes/small.toml --run-dir RUN

Two nodes (run on each node; on one machine, two agents play the two nodes)::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=RUN_KEY \\
        -m kiln_trainer.train --manifest M.json --recipe R.toml --run-dir RUN

Options: ``--set section.key=value`` (repeatable, over the recipe), ``--max-steps N`` (stop this
invocation after step N, still checkpointed; a later start continues to ``train.steps``),
``--sample-log`` (or ``KILN_SAMPLE_LOG=1``: each rank appends the global sample ids it consumed per
step to ``RUN/sample-log/rank-NNNNN.jsonl``; off by default, and not part of the recipe, so it can
be switched on for a resume). ``RUN`` must be one directory every rank sees (a shared filesystem
across nodes).

Data (``kiln_trainer.data``, ``loader``): every rank opens the packed token shards the manifest's
``tokens`` names -- a local directory, or an ``s3://`` prefix streamed into a bounded per-rank cache
-- and checks them before step 1 (the token manifest's sha256, the recipe's tokenizer, block size,
vocabulary, shard sizes). A manifest without ``tokens`` is packed by rank 0 with the recipe's
tokenizer into ``RUN/tokens/`` (content-addressed, reused on a restart) while the other ranks wait.
The global batch of step ``s`` is ``data.global_batch_size`` samples whose ids depend only on the
seed, the shards and ``s`` (a seeded permutation per epoch: each sample once per epoch); rank ``r``
of ``W`` reads its contiguous ``1/W`` of it as ``data.global_batch_size / (W x data.micro_batch_size)``
micro-batches, accumulating gradients. So the world size may change between invocations: a
checkpoint of 2 ranks resumes on 1 (and back) and continues the same global sample sequence, with
the same global batch (a resume with another ``data.global_batch_size``, seed, training manifest or
token manifest is refused, naming it; ``data.micro_batch_size`` may change). The loss is the mean
over the global batch at any ``W``, so the training is the same up to float summation order: at the
same world size a resumed run is bit-identical, across a world-size change it ends within float
tolerance (``tests/integration/test_world_size_change.py`` measures it).

Rank and world size come from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE). Only rank 0 writes shared state: ``metrics.jsonl``, ``metrics.prom``,
``result.json``, and the checkpoints under ``parallel.strategy = "ddp"``; under ``"fsdp"`` (FSDP2,
``kiln_trainer.parallel``) every rank writes its own shards of each checkpoint and rank 0 commits it
(``kiln_trainer.sharded_checkpoint``). A checkpoint of either strategy resumes into either. Torch
uses ``max(1, cpus // LOCAL_WORLD_SIZE)`` threads per rank unless ``KILN_TORCH_THREADS`` says
otherwise (set it to 1 when several single-rank agents share a host).

A start resumes from the newest committed checkpoint in ``RUN/checkpoints`` (directories without a
valid manifest are ignored and logged; every rank hashes its share of a candidate's files); with
the same manifest, recipe, seed and world size the resumed run ends with the same
``weights_sha256`` as an uninterrupted one. At another world size it logs ``resumed at world size 1
from a checkpoint of world size 2``; ranks the checkpoint did not have seed their RNGs from (seed,
rank, step). At the end rank 0 writes ``RUN/result.json`` (kind ``kiln.TrainResult``). Exit status
2 means the trainer diagnosed a fault (bad recipe, tampered manifest/shard, mismatched tokens,
mismatched resume, divergence, a full or read-only run directory): retrying will not help. A
missing or corrupt object in the S3 token store exits 1, like a crash: the store may heal, and a
restart resumes.
Rank 0 also keeps a copy of the TrainingManifest as ``RUN/training_manifest.json``, so a checkpoint
can be evaluated without being told which manifest made it.

Loss guard (``[guard]`` in the recipe): a non-finite step loss, or one above ``spike_factor`` times
the mean of the recent losses, is never applied; the run rolls back to the newest committed
checkpoint, replays the same batches up to the offending one and skips that global batch on every
rank (``TokenLoader.skip_step``; the skipped batch indices are checkpointed, so a resume skips it
too), and records a ``rollback`` event (``metrics.jsonl``, every later checkpoint,
``result.json``). Past ``max_rollbacks`` it fails with exit status 2.

Fault injection, for chaos tests only (never set in production): ``kiln_trainer.faults``.

Stragglers and scaling (``[stragglers]`` in the recipe): every ``every_steps`` steps the ranks
all-gather their compute time per step (step time minus the time blocked in collectives); rank 0
records ``rank_step_times``, ``straggler_rank`` (-1 when none) and ``scaling_efficiency`` and flags a
rank slower than ``factor`` x the other ranks' median for ``windows`` windows (log line, a
``straggler`` event in metrics.jsonl, MLflow tags ``kiln.straggler_rank``/``kiln.straggler``).
Rank 0 also records where each invocation's start-up time went (``startup`` event and log line).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

_IMPORT_T0 = time.time()  # startup profile: the heavy imports below (absent when preloaded)

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln_trainer import errors as trainer_errors
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
    METRICS_JSONL,
    METRICS_PROM,
    RESULT_FILE,
    SAMPLE_LOG_SUBDIR,
    TRAINING_MANIFEST_COPY,
    atomic_write_bytes,
    checkpoint_dirs,
    latest_committed,
    manifest_sha256,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
)
from kiln_trainer.config import load_recipe, resume_identity
from kiln_trainer.contract import (
    EXIT_FATAL,
    EXIT_OK,
    EXIT_RETRYABLE,
    METRICS_EVENT_KEY,
    RANK_STEP_TIMES_KEY,
    ROLLBACK_EVENT,
    STARTUP_EVENT,
    STRAGGLER_CLEARED_EVENT,
    TRAIN_RESULT_KIND,
    WORLD_SIZE_CHANGE_EVENT,
    TrainResultRecord,
)
from kiln_trainer.data import open_run_tokens, pack_run_tokens
from kiln_trainer.distributed import (
    any_rank,
    average_across_ranks_,
    broadcast_object,
    destroy_process_group,
    env_int,
    gather_floats,
    gather_node_names,
    init_distributed,
    seed_rngs,
    set_threads,
    wait_for_all_ranks,
)
from kiln_trainer.errors import (
    STORAGE_ERRNOS,
    CheckpointError,
    ResumeMismatchError,
    StorageError,
    TrainerError,
    TrainingDivergedError,
    os_error_text,
)
from kiln_trainer.faults import injected_faults
from kiln_trainer.jsonfile import read_own_json
from kiln_trainer.loader import StepBatch, TokenLoader
from kiln_trainer.metrics import (
    JsonlSink,
    MetricsHub,
    MlflowSink,
    PrometheusTextfileSink,
    flatten_recipe,
    mlflow_target,
)
from kiln_trainer.model import GPT
from kiln_trainer.optim import make_optimizer, make_scheduler
from kiln_trainer.parallel import shard_model, training_autocast, uses_fsdp
from kiln_trainer.sharded_checkpoint import ShardedCheckpointWriter, load_model_and_optimizer
from kiln_trainer.stragglers import StragglerMonitor
from kiln_trainer.timing import GradReadyMark, StepClock, StepMarks, mfu, peak_flops, startup_profile
from kiln_trainer.training_manifest import TokensRef, load_training_manifest

_IMPORT_T1 = time.time()
log = logging.getLogger("kiln_trainer.train")

RESULT_KIND = TRAIN_RESULT_KIND
SAMPLE_LOG_ENV = "KILN_SAMPLE_LOG"
_RECENT_WINDOW = 20


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kiln_trainer.train", description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", required=True, type=Path, help="TrainingManifest JSON")
    parser.add_argument("--recipe", required=True, type=Path, help="recipe TOML (training/recipes/*.toml)")
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory (checkpoints, metrics, result)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe field (repeatable)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop this invocation after this step")
    parser.add_argument(
        "--sample-log",
        action="store_true",
        default=os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0"),
        help=f"log the global sample ids each rank consumes per step under RUN/{SAMPLE_LOG_SUBDIR}/ (or {SAMPLE_LOG_ENV}=1)",
    )
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- trainer state


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Everything the loop needs besides model/optimizer/scheduler/RNG; saved as trainer_state.pt."""

    step: int = 0
    skipped_batches: list[int] = field(default_factory=list)
    """Global batch indices the loss guard skipped (every rank skips them, and so does a resume)."""
    train_tokens: int = 0
    wall_s: float = 0.0
    last_loss: float = float("nan")
    recent_losses: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_batches": list(self.skipped_batches),
            "train_tokens": self.train_tokens,
            "wall_s": self.wall_s,
            "last_loss": self.last_loss,
            "recent_losses": list(self.recent_losses),
            "events": [dict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            step=int(d["step"]),
            skipped_batches=[int(b) for b in d["skipped_batches"]],
            train_tokens=int(d["train_tokens"]),
            wall_s=float(d["wall_s"]),
            last_loss=float(d["last_loss"]),
            recent_losses=[float(x) for x in d["recent_losses"]],
            events=[dict(e) for e in d["events"]],
        )


def recipe_changes(made: dict[str, Any], asked: dict[str, Any]) -> str:
    """``section.key: <checkpoint's> -> <this run's>`` for every recipe value that differs."""
    keys = sorted({(sec, k) for d in (made, asked) for sec, table in d.items() for k in (table or {})})
    changes = [
        f"{sec}.{k}: {made.get(sec, {}).get(k)!r} -> {asked.get(sec, {}).get(k)!r}"
        for sec, k in keys
        if made.get(sec, {}).get(k) != asked.get(sec, {}).get(k)
    ]
    return "; ".join(changes) or "same values, other encoding"


def guard_verdict(loss: float, recent_losses: list[float], spike_factor: float) -> str | None:
    """Why this step's (rank-averaged) loss must not be applied, or None if it may."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if spike_factor > 0 and len(recent_losses) >= 5:
        mean = sum(recent_losses) / len(recent_losses)
        if loss > spike_factor * mean:
            return f"loss spike ({loss:.4g} > {spike_factor} x recent mean {mean:.4g})"
    return None


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
class _LogInterval:
    """The steps since the last log line: what the next metrics record averages over."""

    t0: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_s: float = 0.0
    ckpt_s: float = 0.0
    tokens: int = 0

    def count(self, data_s: float, tokens: int) -> None:
        self.steps += 1
        self.data_s += data_s
        self.tokens += tokens


def rank_rng_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of a rank that a resumed checkpoint's world did not have (a pure function)."""
    digest = hashlib.sha256(f"kiln-rank-rng:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _raise_rank0_fault(outcome: dict[str, str]) -> None:
    """Re-raise, on every rank, the trainer fault rank 0 met (its class, by name, from the error tree)."""
    cls = getattr(trainer_errors, outcome["error"], TrainerError)
    if not (isinstance(cls, type) and issubclass(cls, TrainerError)):
        cls = TrainerError
    raise cls(outcome["message"])


# --------------------------------------------------------------------------- the run


class Run:
    """This rank's part of one invocation, built in the order it runs: config, distributed init,
    data, model, optimizer, outputs; then ``resume_or_start``, ``train``, ``finish``, ``close``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.startup: dict[str, float] = {"run_init": time.time()}
        self.args = args
        self.recipe = cfg = load_recipe(args.recipe, args.overrides)
        self.recipe_dict = self.recipe.to_dict()
        self.recipe_sha256 = self.recipe.sha256
        self.run_dir: Path = args.run_dir.resolve()

        self.env = init_distributed(self.recipe)
        self.startup["dist_init"] = time.time()
        self.threads = set_threads(self.env)
        self.nodes = gather_node_names(self.env)
        if self.env.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.accum_steps = cfg.data.accum_steps(self.env.world_size)  # a geometry that does not divide: before any I/O

        self._load_data(args.manifest)
        self.startup["data"] = time.time()
        self._build_model_and_optimizer()
        self.state = TrainState()
        self.resumed_from: int | None = None
        self.initial: _InitialState | None = None
        self.spike_fault, self.slow_fault = injected_faults(self.env.rank)
        self._wrap_for_training()
        self.stragglers = StragglerMonitor(
            factor=cfg.stragglers.factor, windows=cfg.stragglers.windows, nodes=list(self.nodes)
        )
        self._window: list[StepMarks] = []
        self.startup["model"] = time.time()

        self.autocast = training_autocast(cfg, self.env.device)
        self.tokens_per_step = cfg.data.global_batch_size * cfg.model.block_size
        self.writer: CheckpointWriter | ShardedCheckpointWriter | None = None
        self.metrics = MetricsHub([])
        self.mlflow_run_id = ""
        if self.env.is_main:
            self._open_outputs()
        self._open_checkpoints()

    def _load_data(self, manifest_path: Path) -> None:
        """Every rank opens and checks the same packed tokens (rank 0 packs them first if the
        manifest names none), then reads only its part of each global batch."""
        self.manifest = load_training_manifest(manifest_path)
        cfg = self.recipe
        ref = self.manifest.tokens or self._pack_on_rank0()
        self.data = open_run_tokens(ref, cfg, run_dir=self.run_dir, rank=self.env.rank, recipe_path=self.args.recipe)
        sample_log = None
        if self.args.sample_log:
            sample_log = self.run_dir / SAMPLE_LOG_SUBDIR / f"rank-{self.env.rank:05d}.jsonl"
        self.loader = TokenLoader(
            self.data.tokens,
            global_batch_size=cfg.data.global_batch_size,
            micro_batch_size=cfg.data.micro_batch_size,
            rank=self.env.rank,
            world_size=self.env.world_size,
            seed=cfg.train.seed,
            window_shards=cfg.data.window_shards,
            prefetch_steps=cfg.data.prefetch_steps,
            sample_log=sample_log,
        )

    def _pack_on_rank0(self) -> TokensRef:
        """Rank 0 packs the manifest's shards under the run dir (or finds them packed); the others
        wait for the reference, or for the fault rank 0 met, which every rank then raises (exit 2)."""
        outcome: dict[str, str] | None = None
        if self.env.is_main:
            try:
                ref = pack_run_tokens(self.manifest, self.recipe, run_dir=self.run_dir, recipe_path=self.args.recipe)
                outcome = {"manifest": ref.manifest, "sha256": ref.sha256}
            except TrainerError as exc:
                outcome = {"error": type(exc).__name__, "message": str(exc)}
            except OSError as exc:
                if exc.errno not in STORAGE_ERRNOS:
                    raise
                outcome = {"error": StorageError.__name__, "message": f"packing token shards: {os_error_text(exc)}"}
        outcome = broadcast_object(outcome, self.env)
        assert outcome is not None
        if "error" in outcome:
            _raise_rank0_fault(outcome)
        return TokensRef(manifest=outcome["manifest"], sha256=outcome["sha256"])

    def _build_model_and_optimizer(self) -> None:
        """Identical init on every rank (same seed), sharded under fsdp before the optimizer takes
        the parameters; then per-rank seeds for everything else."""
        cfg = self.recipe
        seed_rngs(cfg.train.seed)
        self.model = GPT(cfg.model).to(self.env.device)
        if uses_fsdp(cfg):
            shard_model(self.model, cfg, self.env)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        seed_rngs(cfg.train.seed + 1 + self.env.rank)

    def _wrap_for_training(self) -> None:
        """``train_model`` is what the loop calls: the model, compiled if asked, in DDP across ranks
        (whose gradient all-reduce marks when the gradients were ready, for the straggler window);
        under fsdp the sharded model itself (its blocks were compiled before sharding)."""
        cfg = self.recipe
        self.train_model: torch.nn.Module = self.model
        self.clock = StepClock(self.env.device)
        self.grad_ready = GradReadyMark(self.clock)
        self.ddp: DDP | None = None
        if uses_fsdp(cfg):
            return
        if cfg.train.compile:
            # A compiled Module is an OptimizedModule, itself a Module; torch.compile's annotation says Callable.
            self.train_model = cast(torch.nn.Module, torch.compile(self.model))
        if self.env.distributed:
            ddp_kwargs: dict[str, Any] = {}
            if self.env.device.type == "cuda":
                ddp_kwargs["device_ids"] = [self.env.local_rank]
            self.ddp = DDP(self.train_model, **ddp_kwargs)
            self.ddp.register_comm_hook(state=None, hook=self.grad_ready.hook)
            self.train_model = self.ddp

    def _open_checkpoints(self) -> None:
        """The checkpoint writer: under fsdp one on every rank (each writes its own shards), under
        ddp only on rank 0 (which writes the whole replicated state)."""
        cfg = self.recipe
        identity = CheckpointIdentity(
            world_size=self.env.world_size,
            recipe=self.recipe_dict,
            recipe_sha256=self.recipe_sha256,
            snapshot_id=self.manifest.snapshot_id,
            training_manifest_sha256=self.manifest.sha256,
            token_manifest_sha256=self.data.manifest.sha256,
            tokenizer=self.data.tokenizer,
        )
        keep_last, async_save = cfg.checkpoint.keep_last, cfg.checkpoint.async_save
        if uses_fsdp(cfg):
            self.writer = ShardedCheckpointWriter(self.run_dir, identity, keep_last=keep_last, async_save=async_save,
                                                  env=self.env)
        elif self.env.is_main:
            self.writer = CheckpointWriter(self.run_dir, identity, keep_last=keep_last, async_save=async_save)

    def _open_outputs(self) -> None:
        """Rank 0: the run dir and the metrics sinks (MLflow only when the launcher named a run)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sinks: list[Any] = [
            JsonlSink(self.run_dir / METRICS_JSONL),
            PrometheusTextfileSink(self.run_dir / METRICS_PROM, {"run_dir": str(self.run_dir)}),
        ]
        target = mlflow_target()
        if target is not None:
            # Params are immutable in an MLflow run: only what every invocation of the run shares (a
            # resume may change the world size and the micro batch). Those go in as tags, last one wins.
            sinks.append(
                MlflowSink(
                    target[0],
                    target[1],
                    flatten_recipe(resume_identity(self.recipe_dict))
                    | {
                        "kiln.training_manifest_sha256": self.manifest.sha256,
                        "kiln.token_manifest_sha256": self.data.manifest.sha256,
                        "kiln.tokenizer_sha256": self.data.tokenizer.sha256,
                    },
                )
            )
            self.mlflow_run_id = target[1]
        self.metrics = MetricsHub(sinks)
        if target is not None:
            self.metrics.tag({
                "kiln.recipe_sha256": self.recipe_sha256,
                "kiln.world_size": str(self.env.world_size),
                "kiln.micro_batch_size": str(self.recipe.data.micro_batch_size),
                "kiln.parallel_strategy": self.recipe.parallel.strategy,
            })

    # ----------------------------------------------------------------- resume / rollback

    def resume_or_start(self) -> None:
        step_dir = self._newest_committed_step_dir()
        if step_dir is not None:
            made_at = self._restore_from(step_dir)
            if self.writer is not None:
                self.writer.last_committed_step = self.state.step
                self.writer.last_committed_dir = step_dir
            log.info("resumed from %s (step %d)", step_dir, self.state.step)
            if made_at != self.env.world_size:
                self._record_world_size_change(made_at)
            self.resumed_from = self.state.step
        else:
            self._keep_initial_state()
            log.info("fresh start in %s", self.run_dir)
        if self.env.is_main:
            # After the resume check, so a refused manifest never replaces the run's own copy.
            atomic_write_bytes(self.run_dir / TRAINING_MANIFEST_COPY, Path(self.args.manifest).read_bytes())
        self.startup["resumed"] = time.time()

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

    def _newest_committed_step_dir(self) -> Path | None:
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

    def _restore_from(self, step_dir: Path) -> int:
        """Load the checkpoint (rank 0 verified it) into this rank, whatever format, strategy and
        world size wrote it; returns the world size it was written at."""
        manifest = read_manifest(step_dir)
        self._refuse_a_checkpoint_of_another_run(manifest, step_dir)
        load_model_and_optimizer(step_dir, manifest, self.model, self.optimizer,
                                 sharded=uses_fsdp(self.recipe))
        ck = load_side_state(step_dir, manifest, rank=self.env.rank)
        self.scheduler.load_state_dict(ck.scheduler)
        self.state = TrainState.from_dict(ck.trainer_state)
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
            seed_rngs(rank_rng_seed(self.recipe.train.seed, self.env.rank, self.state.step))
        made_with = manifest.get("strategy", "ddp")
        if made_with != self.recipe.parallel.strategy:
            log.info("resumed a %s checkpoint into parallel.strategy = %r", made_with, self.recipe.parallel.strategy)
        return int(manifest["world_size"])

    def _refuse_a_checkpoint_of_another_run(self, m: dict[str, Any], step_dir: Path) -> None:
        if m.get("format") not in CURRENT_FORMATS:
            raise ResumeMismatchError(
                f"cannot resume from {step_dir}: checkpoint format {m.get('format')} was written before the token "
                f"data path (no tokenizer, no loader state); this trainer reads formats {CURRENT_FORMATS}: use a new run dir"
            )
        problems = []
        made, asked = resume_identity(m["recipe"]), resume_identity(self.recipe_dict)
        if made != asked:
            changed = recipe_changes(made, asked)
            problems.append(f"recipe_sha256 {m['recipe_sha256']} != this recipe's {self.recipe_sha256} ({changed})")
        if m["training_manifest_sha256"] != self.manifest.sha256:
            problems.append(f"training manifest {m['training_manifest_sha256']} != {self.manifest.sha256}")
        if m["token_manifest_sha256"] != self.data.manifest.sha256:
            problems.append(f"token_manifest_sha256 {m['token_manifest_sha256']} != {self.data.manifest.sha256}")
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

    def _keep_initial_state(self) -> None:
        self.initial = _InitialState(
            model={k: v.detach().clone() for k, v in self.model.state_dict().items()},
            optimizer=self.optimizer.state_dict(),  # empty state at step 0: nothing to alias
            scheduler=dict(self.scheduler.state_dict()),
            rng=capture_rng_state(),
            train_state=self.state.to_dict(),
            loader=self.loader.state_dict(),
        )

    def rollback(self, reason: str, loss: float, batch: int) -> None:
        """Return to the last committed state and skip global batch ``batch`` (guard)."""
        at_step = self.state.step + 1
        self._refuse_past_the_rollback_budget(reason, loss, at_step)
        if self.writer is not None:
            self.writer.wait()
        events, skipped = list(self.state.events), list(self.state.skipped_batches)
        self._restore_last_committed_state()
        self.optimizer.zero_grad(set_to_none=True)
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

    def _refuse_past_the_rollback_budget(self, reason: str, loss: float, at_step: int) -> None:
        cfg = self.recipe.guard
        rollbacks = sum(1 for e in self.state.events if e.get("kind") == ROLLBACK_EVENT)
        if rollbacks >= cfg.max_rollbacks:
            raise TrainingDivergedError(
                f"{reason} at step {at_step} (loss {loss}); already rolled back {rollbacks} time(s), "
                f"guard.max_rollbacks = {cfg.max_rollbacks}"
            )

    def _restore_last_committed_state(self) -> None:
        """The newest committed checkpoint, or before the first one the in-memory step-0 state."""
        step_dir = self._newest_committed_step_dir()
        if step_dir is not None:
            self._restore_from(step_dir)
            return
        assert self.initial is not None, "a resumed run always has a committed checkpoint"
        self.model.load_state_dict(self.initial.model)
        self.optimizer.load_state_dict(self.initial.optimizer)
        self.optimizer.state.clear()
        self.scheduler.load_state_dict(self.initial.scheduler)
        self.state = TrainState.from_dict(self.initial.train_state)
        self.loader.load_state_dict(self.initial.loader)
        restore_rng_state(self.initial.rng)

    # ----------------------------------------------------------------- the loop

    def train(self) -> dict[str, Any]:
        cfg = self.recipe
        target = cfg.train.steps if self.args.max_steps is None else min(cfg.train.steps, self.args.max_steps)
        flops_per_token = self.model.flops_per_token()
        peak = peak_flops(self.env.device)
        self._log_plan(target)
        self.train_model.train()
        loop_t0 = time.perf_counter()
        loop_tokens = 0
        interval = _LogInterval()
        while self.state.step < target:
            step = self.state.step + 1
            t_step = time.perf_counter()
            m_start = self.clock.mark()
            self.grad_ready.ready = None
            batch = self._next_batch()
            data_s = time.perf_counter() - t_step
            if self.slow_fault is not None:
                self.slow_fault.apply(self.env.rank, step)
            loss_sum = self._forward_backward(batch)
            m_ready = self.grad_ready.ready if self.grad_ready.ready is not None else self.clock.mark()
            average_across_ranks_(loss_sum, self.env)
            loss_value = float(loss_sum.item())
            m_reduced = self.clock.mark()
            if self.spike_fault is not None:
                loss_value = self.spike_fault.apply(loss_value, step, len(self.state.skipped_batches))
            reason = guard_verdict(loss_value, self.state.recent_losses, cfg.guard.spike_factor)
            if reason is not None:
                self.rollback(reason, loss_value, batch.step)
                self._window.clear()
                continue
            self._apply_gradients()
            self._window.append(StepMarks(start=m_start, ready=m_ready, reduced=m_reduced, end=self.clock.mark()))
            self._count_step(step, loss_value, time.perf_counter() - t_step)
            loop_tokens += self.tokens_per_step
            interval.count(data_s, self.tokens_per_step)
            interval.ckpt_s += self._checkpoint_if_due(step, target)
            if "first_step" not in self.startup:
                self.startup["first_step"] = time.time()
                self._log_startup(step)
            if step % cfg.stragglers.every_steps == 0:
                self._straggler_window(step)
            if step % cfg.train.log_every == 0 or step == target:
                self._log_interval(step, target, loss_value, interval, flops_per_token, peak)
                interval = _LogInterval()
        loop_s = time.perf_counter() - loop_t0
        return {"target": target, "loop_tokens": loop_tokens, "loop_s": loop_s}

    def _log_plan(self, target: int) -> None:
        cfg, tokens = self.recipe, self.data.manifest
        log.info(
            "rank %d/%d device %s threads %d | %.2fM params | %d samples of %d tokens (%s tokenizer %s, token "
            "manifest %s) | global batch %d = %d ranks x %d micro x %d accum | recipe %s | steps %d -> %d",
            self.env.rank,
            self.env.world_size,
            self.env.device,
            self.threads,
            self.model.num_parameters() / 1e6,
            tokens.samples,
            tokens.sample_tokens,
            self.data.tokenizer.kind,
            self.data.tokenizer.sha256[:12],
            tokens.sha256[:12],
            cfg.data.global_batch_size,
            self.env.world_size,
            cfg.data.micro_batch_size,
            self.accum_steps,
            self.recipe_sha256[:12],
            self.state.step,
            target,
        )

    def _next_batch(self) -> StepBatch:
        """This rank's part of the next global batch the guard has not skipped."""
        skipped = self.state.skipped_batches
        while self.loader.step in skipped:
            self.loader.skip_step()
        return self.loader.next_step()

    def _forward_backward(self, batch: StepBatch) -> torch.Tensor:
        """This rank's loss summed over the step's micro-batches, its gradients accumulated."""
        accum = self.accum_steps
        loss_sum = torch.zeros((), device=self.env.device)
        for micro, rows in enumerate(batch.micro_batches):
            x, y = self._to_device(rows[:, :-1]), self._to_device(rows[:, 1:])
            # Gradients are all-reduced only on the last micro-batch of the step.
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if self.ddp is not None and micro < accum - 1:
                sync = self.ddp.no_sync()
            with sync:
                with self.autocast:
                    _, loss = self.train_model(x, y)
                    loss = loss / accum
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def _to_device(self, ids: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(ids))
        if self.env.device.type == "cuda":
            return t.pin_memory().to(self.env.device, non_blocking=True)
        return t

    def _apply_gradients(self) -> None:
        grad_clip = self.recipe.optim.grad_clip
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _count_step(self, step: int, loss_value: float, step_s: float) -> None:
        st = self.state
        st.step = step
        st.last_loss = loss_value
        st.recent_losses = (st.recent_losses + [loss_value])[-_RECENT_WINDOW:]
        st.train_tokens += self.tokens_per_step
        st.wall_s += step_s

    def _checkpoint_if_due(self, step: int, target: int) -> float:
        """Seconds the loop was blocked saving (0.0 when no checkpoint was due)."""
        if step % self.recipe.checkpoint.every_steps != 0 and step != target:
            return 0.0
        ckpt_s = self.save(step)
        self.state.wall_s += ckpt_s
        return ckpt_s

    def save(self, step: int) -> float:
        rng_blobs = gather_rng_bytes(self.env.device)  # a collective: every rank, even without a writer
        if self.writer is None:
            return 0.0
        trainer_state = self.state.to_dict() | {"torch_threads": self.threads, "loader": self.loader.state_dict()}
        return self.writer.save(
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=trainer_state,
            rng_blobs=rng_blobs,
        )

    def _log_interval(
        self, step: int, target: int, loss_value: float, interval: _LogInterval, flops_per_token: float, peak: float | None
    ) -> None:
        elapsed = time.perf_counter() - interval.t0
        tokens_per_s = interval.tokens / elapsed if elapsed > 0 else 0.0
        committed = self.writer.last_committed_step if self.writer else None
        record = {
            "loss": loss_value,
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s,
            "step_time": elapsed / max(1, interval.steps),
            "data_wait_frac": interval.data_s / elapsed if elapsed > 0 else 0.0,
            # Compute utilisation on CPU: the share of the interval not spent waiting for
            # data or blocked on a checkpoint (the signal behind the < 85% alert).
            "busy_frac": max(0.0, elapsed - interval.data_s - interval.ckpt_s) / elapsed if elapsed > 0 else 0.0,
            "ckpt_block_s": interval.ckpt_s,
            "checkpoint_lag_steps": step - (committed or 0),
            "world_size": self.env.world_size,
            "train_tokens": self.state.train_tokens,
        }
        if peak:
            record["mfu"] = mfu(flops_per_token, tokens_per_s, peak, self.env.world_size)
        self.metrics.log(step, record)
        log.info(
            "step %d/%d loss %.4f lr %.2e %.0f tok/s %.1f ms/step data %.1f%% ckpt %.1f ms lag %d",
            step,
            target,
            loss_value,
            record["lr"],
            tokens_per_s,
            1000 * record["step_time"],
            100 * record["data_wait_frac"],
            1000 * interval.ckpt_s,
            record["checkpoint_lag_steps"],
        )

    # ----------------------------------------------------------------- stragglers, startup

    def _straggler_window(self, step: int) -> None:
        """Every rank: gather [median compute, mean compute, mean wall] of its steps since the last
        window; rank 0 flags stragglers and reports per-rank times and scaling efficiency."""
        marks, self._window = self._window, []
        pairs = [m.compute_and_wall(self.clock) for m in marks] or [(0.0, 0.0)]
        compute = [c for c, _ in pairs]
        mine = [statistics.median(compute), statistics.fmean(compute), statistics.fmean(w for _, w in pairs)]
        rows = gather_floats(mine, self.env)
        if not self.env.is_main:
            return
        medians = [r[0] for r in rows]
        record: dict[str, Any] = {RANK_STEP_TIMES_KEY: medians, "straggler_rank": -1}
        if self.env.distributed:
            wall = statistics.fmean(r[2] for r in rows)
            # Weak scaling: a typical rank's compute per step (the lower median, so that with 2
            # ranks a straggler is not the reference) is what one rank alone would take for its
            # share; the rest of a step (waiting for peers, exposed all-reduce) is the price of
            # running N of them. 1.0 = linear scaling. See docs/scaling.md.
            typical = statistics.median_low(r[1] for r in rows)
            record["scaling_efficiency"] = min(1.0, typical / wall) if wall > 0 else 0.0
            self._flag_stragglers(step, medians)
            record["straggler_rank"] = self.stragglers.current
        self.metrics.log(step, record)

    def _flag_stragglers(self, step: int, medians: list[float]) -> None:
        """Rank 0: log, record and tag each rank that became or stopped being a straggler."""
        flags, cleared = self.stragglers.observe(step, medians)
        for flag in flags:
            log.warning("%s", flag.message)
            self.metrics.log(step, flag.to_event())
            self.metrics.tag({"kiln.straggler_rank": str(flag.rank), "kiln.straggler": flag.message})
        for rank in cleared:
            log.warning("straggler cleared: rank %d is back within %.2fx of the others at step %d",
                        rank, self.stragglers.factor, step)
            self.metrics.log(step, {METRICS_EVENT_KEY: STRAGGLER_CLEARED_EVENT, "rank": rank})
            if self.stragglers.current < 0:
                self.metrics.tag({"kiln.straggler_rank": "-1"})

    def _log_startup(self, step: int) -> None:
        """Rank 0, once per invocation: where the time from process start to the first step went."""
        if not self.env.is_main:
            return
        self.startup.setdefault("resumed", self.startup["model"])
        profile = startup_profile(self.startup, _IMPORT_T0, _IMPORT_T1)
        event = {
            METRICS_EVENT_KEY: STARTUP_EVENT,
            "restart_count": env_int("TORCHELASTIC_RESTART_COUNT", 0),
            "resumed_from_step": self.resumed_from,
            "first_step": step,
            **profile,
        }
        self.metrics.log(step, event)
        total = profile["process_to_first_step_s"]
        log.info(
            "startup: %s s from process start to step %d (%s)",
            "?" if total is None else f"{total:.2f}",
            step,
            ", ".join(f"{k[:-2]} {v:.2f}" for k, v in profile["phases_s"].items() if v is not None),
        )

    # ----------------------------------------------------------------- end of run

    def finish(self, summary: dict[str, Any]) -> TrainResultRecord | None:
        """Rank 0 writes ``result.json`` for the newest committed checkpoint; every rank waits for it
        (and, under fsdp, for its part of the last save)."""
        result = None
        if self.writer is not None:
            last_dir = self.writer.wait()
        if self.writer is not None and self.env.is_main:
            last_dir = self._last_committed_dir(last_dir)
            result = self._result(summary, last_dir, self.writer.total_blocking_s)
            atomic_write_bytes(
                self.run_dir / RESULT_FILE, (json.dumps(result, indent=1, sort_keys=True) + "\n").encode()
            )
            log.info(
                "result: step %d loss %s weights %s -> %s",
                result["step"],
                result["metrics"]["final_loss"],
                result["weights_sha256"][:16],
                self.run_dir / RESULT_FILE,
            )
        wait_for_all_ranks(self.env)
        return result

    def _last_committed_dir(self, last_dir: Path | None) -> Path:
        if last_dir is None:
            # Nothing was run and nothing committed: e.g. --max-steps 0 on a fresh run dir.
            last_dir = latest_committed(self.run_dir)
        if last_dir is None:
            raise TrainerError(f"no committed checkpoint in {self.run_dir} to report")
        return last_dir

    def _result(self, summary: dict[str, Any], last_dir: Path, checkpoint_blocking_s: float) -> TrainResultRecord:
        """The ``kiln.TrainResult`` of this invocation, naming its newest committed checkpoint."""
        ck_manifest = read_own_json(last_dir / "manifest.json")
        st = self.state
        tokens_per_s = (
            summary["loop_tokens"] / summary["loop_s"]
            if summary["loop_tokens"] and summary["loop_s"] > 0
            else (st.train_tokens / st.wall_s if st.wall_s > 0 else 0.0)
        )
        return {
            "kind": RESULT_KIND,
            "run_dir": str(self.run_dir),
            "checkpoint": str(last_dir.resolve()),
            "checkpoint_manifest_sha256": manifest_sha256(last_dir),
            "weights_sha256": ck_manifest["weights_sha256"],
            "step": ck_manifest["step"],
            "total_steps": self.recipe.train.steps,
            "completed": ck_manifest["step"] >= self.recipe.train.steps,
            "recipe_sha256": self.recipe_sha256,
            "training_manifest_sha256": self.manifest.sha256,
            "token_manifest_sha256": ck_manifest["token_manifest_sha256"],
            "tokenizer_sha256": ck_manifest["tokenizer_sha256"],
            "snapshot_id": self.manifest.snapshot_id,
            "world_size": self.env.world_size,
            "metrics": {
                "final_loss": st.last_loss if math.isfinite(st.last_loss) else None,
                "tokens_per_s": tokens_per_s,
                "steps": st.step,
                "wall_s": st.wall_s,
                "train_tokens": st.train_tokens,
                "checkpoint_blocking_s": checkpoint_blocking_s,
            },
            "events": st.events,
            "mlflow_run_id": self.mlflow_run_id,
        }

    def close(self) -> None:
        try:
            self.loader.close()
            if self.writer is not None:
                self.writer.close()
        finally:
            self.metrics.close()
            self._release_ddp()
            destroy_process_group()

    def _release_ddp(self) -> None:
        """Free DDP before the process group. Its Reducer holds the group and, freed last, destroys it
        holding the GIL; gloo's destructor then joins a worker that needs the GIL to free a finished
        collective's tensors, and the rank hangs at exit (pytorch#56297). Freed through
        ``destroy_process_group``, the group is destroyed with the GIL released."""
        if self.ddp is None:
            return
        alive = weakref.ref(self.ddp)
        self.ddp, self.train_model = None, self.model
        gc.collect()
        if alive() is not None:
            log.warning("DDP is still referenced at teardown; the process group may hang on exit")


def _setup_logging() -> None:
    rank = env_int("RANK", 0)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    args = parse_args(argv)
    run: Run | None = None
    try:
        run = Run(args)
        run.resume_or_start()
        summary = run.train()
        result = run.finish(summary)
        finished, run = run, None
        finished.close()  # a final write that fails (a full disk) fails the run too
        if result is not None:
            print(json.dumps(result, sort_keys=True))
        return EXIT_OK
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return EXIT_RETRYABLE if exc.retryable else EXIT_FATAL  # a remote store that may heal: a retry can succeed
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        log.error("StorageError: %s", os_error_text(exc))
        return EXIT_FATAL
    finally:
        if run is not None:
            _close_after_failure(run)


def _close_after_failure(run: Run) -> None:
    """Close a run that already failed: the first error is the one to report (closing on a full
    disk fails again, flushing the same metrics)."""
    try:
        run.close()
    except Exception as exc:
        log.warning("closing the failed run: %s: %s", type(exc).__name__, exc)


if __name__ == "__main__":
    sys.exit(main())

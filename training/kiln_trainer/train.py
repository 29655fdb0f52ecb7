"""Train the byte-level GPT on a TrainingManifest; resumable, checkpointed, deterministic.

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
invocation after step N, still checkpointed; a later start continues to ``train.steps``).
``RUN`` must be one directory every rank sees (a shared filesystem across nodes).

Rank and world size come from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE). Only rank 0 writes shared state: checkpoints, ``metrics.jsonl``, ``metrics.prom``,
``result.json``. Torch uses ``max(1, cpus // LOCAL_WORLD_SIZE)`` threads per rank unless
``KILN_TORCH_THREADS`` says otherwise (set it to 1 when several single-rank agents share a host).

A start resumes from the newest committed checkpoint in ``RUN/checkpoints`` (directories without a
valid manifest are ignored and logged); with the same manifest, recipe, seed and world size the
resumed run ends with the same ``weights_sha256`` as an uninterrupted one. At the end rank 0 writes
``RUN/result.json`` (kind ``kiln.TrainResult``). Exit status 2 means the trainer diagnosed a fault
(bad recipe, tampered manifest/shard, mismatched resume, divergence): retrying will not help.
Rank 0 also keeps a copy of the TrainingManifest as ``RUN/training_manifest.json``, so a checkpoint
can be evaluated without being told which manifest made it.

Loss guard (``[guard]`` in the recipe): a non-finite step loss, or one above ``spike_factor`` times
the mean of the recent losses, is never applied; the run rolls back to the newest committed
checkpoint, bumps the data salt so the offending windows are not drawn again, and records a
``rollback`` event (``metrics.jsonl``, every later checkpoint, ``result.json``). Past
``max_rollbacks`` it fails with exit status 2.

Fault injection, for chaos tests only (never set in production)::

    KILN_FAULT_SPIKE_AT_STEP=12 KILN_FAULT_SPIKE_TIMES=1 python -m kiln_trainer.train ...

poisons the batch window of step 12: its loss reads 1000x while the data salt is below
``KILN_FAULT_SPIKE_TIMES`` (default 1), i.e. the first ``TIMES`` draws of that window spike and a
rollback's fresh draw is clean. A large ``TIMES`` makes every retry spike, so the guard gives up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln_trainer.checkpoint import (
    CheckpointIdentity,
    CheckpointWriter,
    capture_rng_state,
    gather_rng_bytes,
    load_checkpoint,
    restore_rng_state,
)
from kiln_trainer.checkpoint_manifest import (
    CHECKPOINTS_SUBDIR,
    TRAINING_MANIFEST_COPY,
    atomic_write_bytes,
    latest_committed,
    manifest_sha256,
    step_dir_name,
)
from kiln_trainer.config import OptimConfig, Recipe, load_recipe
from kiln_trainer.data import WindowSampler, build_byte_stream, load_training_manifest, rank_slice
from kiln_trainer.errors import ResumeMismatchError, TrainerError, TrainingDivergedError
from kiln_trainer.metrics import (
    JsonlSink,
    MetricsHub,
    MlflowSink,
    PrometheusTextfileSink,
    flatten_recipe,
    mlflow_target,
)
from kiln_trainer.model import GPT

log = logging.getLogger("kiln_trainer.train")

RESULT_KIND = "kiln.TrainResult"
_THREADS_ENV = "KILN_TORCH_THREADS"
_FAULT_SPIKE_STEP_ENV = "KILN_FAULT_SPIKE_AT_STEP"
_FAULT_SPIKE_TIMES_ENV = "KILN_FAULT_SPIKE_TIMES"
_FAULT_SPIKE_FACTOR = 1000.0
# Peak dense bf16 FLOP/s per device, for MFU; override with KILN_PEAK_FLOPS.
_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


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
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- distributed setup


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


def init_distributed(recipe: Recipe) -> DistEnv:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    want = recipe.train.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise TrainerError("train.device = 'cuda' but no CUDA device is visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if use_cuda else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": dt.timedelta(minutes=10)}
        if use_cuda:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, device=device)


def set_threads(env: DistEnv) -> int:
    override = os.environ.get(_THREADS_ENV, "")
    if override:
        threads = max(1, int(override))
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cpus // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    return threads


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def broadcast_int(value: int, env: DistEnv) -> int:
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=env.device)
    dist.broadcast(t, src=0)
    return int(t.item())


# --------------------------------------------------------------------------- optimisation


def make_optimizer(model: GPT, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_multiplier(recipe: Recipe):  # type: ignore[no-untyped-def]
    """LambdaLR factor for 0-based scheduler index i (optimizer step i+1): warmup, then cosine."""
    opt, total = recipe.optim, recipe.train.steps

    def factor(i: int) -> float:
        if i < opt.warmup_steps:
            return (i + 1) / opt.warmup_steps
        span = max(1, total - opt.warmup_steps)
        progress = min(1.0, (i - opt.warmup_steps) / span)
        lr = opt.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (opt.lr - opt.min_lr)
        return lr / opt.lr

    return factor


# --------------------------------------------------------------------------- trainer state


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Everything the loop needs besides model/optimizer/scheduler/RNG; saved as trainer_state.pt."""

    step: int = 0
    data_salt: int = 0
    """Bumped by each guard rollback, so the skipped windows are not drawn again."""
    train_tokens: int = 0
    wall_s: float = 0.0
    last_loss: float = float("nan")
    recent_losses: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data_position": {"step": self.step, "data_salt": self.data_salt},
            "data_salt": self.data_salt,
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
            data_salt=int(d["data_salt"]),
            train_tokens=int(d["train_tokens"]),
            wall_s=float(d["wall_s"]),
            last_loss=float(d["last_loss"]),
            recent_losses=[float(x) for x in d["recent_losses"]],
            events=[dict(e) for e in d["events"]],
        )


def guard_verdict(loss: float, recent_losses: list[float], spike_factor: float) -> str | None:
    """Why this step's (rank-averaged) loss must not be applied, or None if it may."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if spike_factor > 0 and len(recent_losses) >= 5:
        mean = sum(recent_losses) / len(recent_losses)
        if loss > spike_factor * mean:
            return f"loss spike ({loss:.4g} > {spike_factor} x recent mean {mean:.4g})"
    return None


_RECENT_WINDOW = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class SpikeFault:
    """Chaos hook: the loss of ``step`` reads 1000x while the data salt is below ``times``.

    Keyed on the data salt (which is checkpointed) rather than an in-memory counter, so the fault
    behaves the same after a resume and models a bad batch window that a rollback's redraw skips.
    """

    step: int
    times: int = 1

    @classmethod
    def from_env(cls) -> SpikeFault | None:
        raw = os.environ.get(_FAULT_SPIKE_STEP_ENV, "")
        if not raw:
            return None
        try:
            step, times = int(raw), int(os.environ.get(_FAULT_SPIKE_TIMES_ENV, "") or 1)
        except ValueError as exc:
            raise TrainerError(f"{_FAULT_SPIKE_STEP_ENV}/{_FAULT_SPIKE_TIMES_ENV} must be integers: {exc}") from exc
        if step < 1 or times < 1:
            raise TrainerError(f"{_FAULT_SPIKE_STEP_ENV} and {_FAULT_SPIKE_TIMES_ENV} must be >= 1")
        return cls(step=step, times=times)

    def apply(self, loss: float, step: int, data_salt: int) -> float:
        return loss * _FAULT_SPIKE_FACTOR if step == self.step and data_salt < self.times else loss


@dataclass(kw_only=True)
class _InitialState:
    """In-memory step-0 state of a fresh run: the rollback target before the first checkpoint."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    train_state: dict[str, Any]


# --------------------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.recipe = load_recipe(args.recipe, args.overrides)
        self.recipe_dict = self.recipe.to_dict()
        self.recipe_sha256 = self.recipe.sha256
        self.run_dir: Path = args.run_dir.resolve()
        self.env = init_distributed(self.recipe)
        self.threads = set_threads(self.env)
        if self.env.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        # Data: every rank verifies and reads the same shards, then keeps its own slice.
        self.manifest = load_training_manifest(args.manifest)
        cfg = self.recipe
        stream = build_byte_stream(self.manifest.shards, cfg.data.doc_separator)
        self.sampler = WindowSampler(
            rank_slice(stream, self.env.rank, self.env.world_size),
            block_size=cfg.model.block_size,
            batch_size=cfg.data.batch_size,
            accum_steps=cfg.data.grad_accum_steps,
            seed=cfg.train.seed,
            rank=self.env.rank,
        )
        self.stream_bytes = len(stream)
        del stream

        # Model: identical init on every rank (same seed); then per-rank seeds for everything else.
        seed_rngs(cfg.train.seed)
        self.model = GPT(cfg.model).to(self.env.device)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(cfg))
        seed_rngs(cfg.train.seed + 1 + self.env.rank)
        self.state = TrainState()
        self.initial: _InitialState | None = None
        self.spike_fault = SpikeFault.from_env()
        if self.spike_fault is not None:
            log.warning("fault injection: %s", self.spike_fault)

        self.train_model: torch.nn.Module = self.model
        if cfg.train.compile:
            self.train_model = torch.compile(self.model)  # type: ignore[assignment]
        if self.env.distributed:
            ddp_kwargs: dict[str, Any] = {}
            if self.env.device.type == "cuda":
                ddp_kwargs["device_ids"] = [self.env.local_rank]
            self.train_model = DDP(self.train_model, **ddp_kwargs)

        dtype = cfg.train.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.env.device.type == "cuda" else "float32"
        self.autocast = (
            torch.autocast(device_type=self.env.device.type, dtype=torch.bfloat16)
            if dtype == "bfloat16"
            else contextlib.nullcontext()
        )
        self.tokens_per_step = (
            self.env.world_size * cfg.data.grad_accum_steps * cfg.data.batch_size * cfg.model.block_size
        )

        self.writer: CheckpointWriter | None = None
        self.metrics = MetricsHub([])
        self.mlflow_run_id = ""
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.writer = CheckpointWriter(
                self.run_dir,
                CheckpointIdentity(
                    world_size=self.env.world_size,
                    recipe=self.recipe_dict,
                    recipe_sha256=self.recipe_sha256,
                    snapshot_id=self.manifest.snapshot_id,
                    training_manifest_sha256=self.manifest.sha256,
                ),
                keep_last=cfg.checkpoint.keep_last,
                async_save=cfg.checkpoint.async_save,
            )
            sinks: list[Any] = [
                JsonlSink(self.run_dir / "metrics.jsonl"),
                PrometheusTextfileSink(self.run_dir / "metrics.prom", {"run_dir": str(self.run_dir)}),
            ]
            target = mlflow_target()
            if target is not None:
                sinks.append(
                    MlflowSink(
                        target[0],
                        target[1],
                        flatten_recipe(self.recipe_dict)
                        | {
                            "kiln.recipe_sha256": self.recipe_sha256,
                            "kiln.training_manifest_sha256": self.manifest.sha256,
                            "kiln.world_size": self.env.world_size,
                        },
                    )
                )
                self.mlflow_run_id = target[1]
            self.metrics = MetricsHub(sinks)

    # ----------------------------------------------------------------- resume / rollback

    def _newest_committed_step_dir(self) -> Path | None:
        """Rank 0 picks (and verifies) the newest committed checkpoint; every rank learns its path."""
        found = latest_committed(self.run_dir) if self.env.is_main else None
        step = broadcast_int(-1 if found is None else int(found.name.split("-")[1]), self.env)
        if step < 0:
            return None
        return self.run_dir / CHECKPOINTS_SUBDIR / step_dir_name(step)

    def _restore_from(self, step_dir: Path) -> None:
        ck = load_checkpoint(step_dir, rank=self.env.rank, verify=False)
        m = ck.manifest
        problems = []
        if m["recipe_sha256"] != self.recipe_sha256:
            problems.append(f"recipe_sha256 {m['recipe_sha256']} != this recipe's {self.recipe_sha256}")
        if m["world_size"] != self.env.world_size:
            problems.append(f"world_size {m['world_size']} != {self.env.world_size} (bit-exact resume needs the same)")
        if m["training_manifest_sha256"] != self.manifest.sha256:
            problems.append(f"training manifest {m['training_manifest_sha256']} != {self.manifest.sha256}")
        if problems:
            raise ResumeMismatchError(f"cannot resume from {step_dir}: " + "; ".join(problems))
        self.model.load_state_dict(ck.model)
        self.optimizer.load_state_dict(ck.optimizer)
        self.scheduler.load_state_dict(ck.scheduler)
        self.state = TrainState.from_dict(ck.trainer_state)
        saved_threads = ck.trainer_state.get("torch_threads")
        if saved_threads is not None and saved_threads != self.threads:
            # Intra-op reductions split work by thread count, so the bits differ (not the maths).
            log.warning(
                "resuming with %d torch threads per rank, the checkpoint was made with %s: "
                "the run continues correctly but not bit-identically",
                self.threads,
                saved_threads,
            )
        assert ck.rng is not None
        # Last, after everything that might draw random numbers while being set up.
        restore_rng_state(ck.rng)

    def resume_or_start(self) -> None:
        step_dir = self._newest_committed_step_dir()
        if step_dir is not None:
            self._restore_from(step_dir)
            if self.writer is not None:
                self.writer.last_committed_step = self.state.step
                self.writer.last_committed_dir = step_dir
            log.info("resumed from %s (step %d)", step_dir, self.state.step)
        else:
            self.initial = _InitialState(
                model={k: v.detach().clone() for k, v in self.model.state_dict().items()},
                optimizer=self.optimizer.state_dict(),  # empty state at step 0: nothing to alias
                scheduler=dict(self.scheduler.state_dict()),
                rng=capture_rng_state(),
                train_state=self.state.to_dict(),
            )
            log.info("fresh start in %s", self.run_dir)
        if self.env.is_main:
            # After the resume check, so a refused manifest never replaces the run's own copy.
            atomic_write_bytes(self.run_dir / TRAINING_MANIFEST_COPY, Path(self.args.manifest).read_bytes())

    def rollback(self, reason: str, loss: float) -> None:
        """Return to the last committed state and skip the offending windows (guard)."""
        cfg = self.recipe.guard
        rollbacks = sum(1 for e in self.state.events if e.get("kind") == "rollback")
        at_step = self.state.step + 1
        if rollbacks >= cfg.max_rollbacks:
            raise TrainingDivergedError(
                f"{reason} at step {at_step} (loss {loss}); already rolled back {rollbacks} time(s), "
                f"guard.max_rollbacks = {cfg.max_rollbacks}"
            )
        if self.writer is not None:
            self.writer.wait()
        events, salt = list(self.state.events), self.state.data_salt
        step_dir = self._newest_committed_step_dir()
        if step_dir is not None:
            self._restore_from(step_dir)
        else:
            assert self.initial is not None, "a resumed run always has a committed checkpoint"
            self.model.load_state_dict(self.initial.model)
            self.optimizer.load_state_dict(self.initial.optimizer)
            self.optimizer.state.clear()
            self.scheduler.load_state_dict(self.initial.scheduler)
            self.state = TrainState.from_dict(self.initial.train_state)
            restore_rng_state(self.initial.rng)
        self.optimizer.zero_grad(set_to_none=True)
        event = {
            "kind": "rollback",
            "reason": reason,
            "at_step": at_step,
            "to_step": self.state.step,
            "loss": loss if math.isfinite(loss) else str(loss),
            "data_salt": salt + 1,
        }
        self.state.events = events + [event]
        self.state.data_salt = salt + 1
        log.warning(
            "guard: %s at step %d (loss %s): rolled back to step %d, skipping its windows",
            reason,
            at_step,
            loss,
            self.state.step,
        )
        self.metrics.log(at_step, {"event": "rollback", **event})

    # ----------------------------------------------------------------- the loop

    def save(self, step: int) -> float:
        rng_blobs = gather_rng_bytes(self.env.device)
        if self.writer is None:
            return 0.0
        assert rng_blobs is not None
        trainer_state = self.state.to_dict() | {"torch_threads": self.threads}
        return self.writer.save(
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=trainer_state,
            rng_blobs=rng_blobs,
        )

    def train(self) -> dict[str, Any]:
        cfg = self.recipe
        target = cfg.train.steps if self.args.max_steps is None else min(cfg.train.steps, self.args.max_steps)
        accum = cfg.data.grad_accum_steps
        flops_per_token = self.model.flops_per_token()
        peak = _peak_flops(self.env.device)
        log.info(
            "rank %d/%d device %s threads %d | %.2fM params | %d bytes of training data | recipe %s | steps %d -> %d",
            self.env.rank,
            self.env.world_size,
            self.env.device,
            self.threads,
            self.model.num_parameters() / 1e6,
            self.stream_bytes,
            self.recipe_sha256[:12],
            self.state.step,
            target,
        )
        self.train_model.train()
        loop_t0 = time.perf_counter()
        loop_tokens = 0
        interval = {"t0": time.perf_counter(), "steps": 0, "data_s": 0.0, "ckpt_s": 0.0, "tokens": 0}
        while self.state.step < target:
            step = self.state.step + 1
            t_step = time.perf_counter()
            batches = self.sampler.step_batches(step, self.state.data_salt)
            data_s = time.perf_counter() - t_step
            loss_sum = torch.zeros((), device=self.env.device)
            for micro, (x, y) in enumerate(batches):
                x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)
                # Gradients are all-reduced only on the last micro-batch of the step.
                sync = contextlib.nullcontext()
                if self.env.distributed and micro < accum - 1:
                    sync = self.train_model.no_sync()  # type: ignore[operator]
                with sync:
                    with self.autocast:
                        _, loss = self.train_model(x, y)
                        loss = loss / accum
                    loss.backward()
                loss_sum += loss.detach()
            if self.env.distributed:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                loss_sum /= self.env.world_size
            loss_value = float(loss_sum.item())
            if self.spike_fault is not None:
                loss_value = self.spike_fault.apply(loss_value, step, self.state.data_salt)
            reason = guard_verdict(loss_value, self.state.recent_losses, cfg.guard.spike_factor)
            if reason is not None:
                self.rollback(reason, loss_value)
                continue
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

            step_s = time.perf_counter() - t_step
            st = self.state
            st.step = step
            st.last_loss = loss_value
            st.recent_losses = (st.recent_losses + [loss_value])[-_RECENT_WINDOW:]
            st.train_tokens += self.tokens_per_step
            st.wall_s += step_s
            loop_tokens += self.tokens_per_step
            interval["steps"] += 1
            interval["data_s"] += data_s
            interval["tokens"] += self.tokens_per_step

            ckpt_s = 0.0
            if step % cfg.checkpoint.every_steps == 0 or step == target:
                ckpt_s = self.save(step)
                st.wall_s += ckpt_s
            interval["ckpt_s"] += ckpt_s

            if step % cfg.train.log_every == 0 or step == target:
                elapsed = time.perf_counter() - interval["t0"]
                tokens_per_s = interval["tokens"] / elapsed if elapsed > 0 else 0.0
                committed = self.writer.last_committed_step if self.writer else None
                record = {
                    "loss": loss_value,
                    "lr": self.scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens_per_s,
                    "step_time": elapsed / max(1, interval["steps"]),
                    "data_wait_frac": interval["data_s"] / elapsed if elapsed > 0 else 0.0,
                    # Compute utilisation on CPU: the share of the interval not spent waiting for
                    # data or blocked on a checkpoint (the signal behind the < 85% alert).
                    "busy_frac": max(0.0, elapsed - interval["data_s"] - interval["ckpt_s"]) / elapsed if elapsed > 0 else 0.0,
                    "ckpt_block_s": interval["ckpt_s"],
                    "checkpoint_lag_steps": step - (committed or 0),
                    "train_tokens": st.train_tokens,
                }
                if peak:
                    record["mfu"] = flops_per_token * tokens_per_s / (peak * self.env.world_size)
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
                    1000 * interval["ckpt_s"],
                    record["checkpoint_lag_steps"],
                )
                interval = {"t0": time.perf_counter(), "steps": 0, "data_s": 0.0, "ckpt_s": 0.0, "tokens": 0}
        loop_s = time.perf_counter() - loop_t0
        return {"target": target, "loop_tokens": loop_tokens, "loop_s": loop_s}

    # ----------------------------------------------------------------- end of run

    def finish(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        result = None
        if self.writer is not None:
            last_dir = self.writer.wait()
            if last_dir is None:
                # Nothing was run and nothing committed: e.g. --max-steps 0 on a fresh run dir.
                last_dir = latest_committed(self.run_dir)
            if last_dir is None:
                raise TrainerError(f"no committed checkpoint in {self.run_dir} to report")
            ck_manifest = json.loads((last_dir / "manifest.json").read_text())
            st = self.state
            tokens_per_s = (
                summary["loop_tokens"] / summary["loop_s"]
                if summary["loop_tokens"] and summary["loop_s"] > 0
                else (st.train_tokens / st.wall_s if st.wall_s > 0 else 0.0)
            )
            result = {
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
                "snapshot_id": self.manifest.snapshot_id,
                "world_size": self.env.world_size,
                "metrics": {
                    "final_loss": st.last_loss if math.isfinite(st.last_loss) else None,
                    "tokens_per_s": tokens_per_s,
                    "steps": st.step,
                    "wall_s": st.wall_s,
                    "train_tokens": st.train_tokens,
                    "checkpoint_blocking_s": self.writer.total_blocking_s,
                },
                "events": st.events,
                "mlflow_run_id": self.mlflow_run_id,
            }
            atomic_write_bytes(
                self.run_dir / "result.json", (json.dumps(result, indent=1, sort_keys=True) + "\n").encode()
            )
            log.info(
                "result: step %d loss %s weights %s -> %s",
                result["step"],
                result["metrics"]["final_loss"],
                result["weights_sha256"][:16],
                self.run_dir / "result.json",
            )
        if self.env.distributed:
            dist.barrier()
        return result

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.metrics.close()
            if self.env.distributed and dist.is_initialized():
                dist.destroy_process_group()


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    override = os.environ.get("KILN_PEAK_FLOPS", "")
    if override:
        return float(override)
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def _setup_logging() -> None:
    rank = _env_int("RANK", 0)
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
        if result is not None:
            print(json.dumps(result, sort_keys=True))
        return 0
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    finally:
        if run is not None:
            run.close()


if __name__ == "__main__":
    sys.exit(main())

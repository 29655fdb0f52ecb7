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
``KILN_FAULT_SLOW_RANK=1 KILN_FAULT_SLOW_S=0.5 KILN_FAULT_SLOW_FROM_STEP=11`` makes rank 1 sleep
0.5 s inside every step's compute from step 11 on (a straggler). ``KILN_FAULT_SLOW_NODE=node2``
instead slows every rank on that node (a throttled node: after the launcher excludes it, the job on
the other nodes runs at full speed).

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
import datetime as dt
import json
import logging
import math
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_IMPORT_T0 = time.time()  # startup profile: the heavy imports below (absent when preloaded)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

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
from kiln_trainer.stragglers import StragglerMonitor

_IMPORT_T1 = time.time()
log = logging.getLogger("kiln_trainer.train")

RESULT_KIND = "kiln.TrainResult"
_THREADS_ENV = "KILN_TORCH_THREADS"
_FAULT_SPIKE_STEP_ENV = "KILN_FAULT_SPIKE_AT_STEP"
_FAULT_SPIKE_TIMES_ENV = "KILN_FAULT_SPIKE_TIMES"
_FAULT_SPIKE_FACTOR = 1000.0
_FAULT_SLOW_RANK_ENV = "KILN_FAULT_SLOW_RANK"
_FAULT_SLOW_NODE_ENV = "KILN_FAULT_SLOW_NODE"
_FAULT_SLOW_S_ENV = "KILN_FAULT_SLOW_S"
_FAULT_SLOW_FROM_ENV = "KILN_FAULT_SLOW_FROM_STEP"
_NODE_NAME_ENVS = ("KILN_NODE_NAME", "SLURMD_NODENAME")
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowRankFault:
    """Chaos hook: rank ``rank`` (or every rank on node ``node``) sleeps ``seconds`` inside every
    step's compute from ``from_step`` on.

    Models a throttled device or a noisy neighbour on one node: the other ranks wait for it at the
    gradient all-reduce, and the straggler detector must name it."""

    rank: int
    seconds: float = 0.2
    from_step: int = 1
    node: str = ""
    """Set: the fault follows the node (``node_name()``), whatever ranks land there; ``rank`` is -1."""

    @classmethod
    def from_env(cls) -> SlowRankFault | None:
        raw = os.environ.get(_FAULT_SLOW_RANK_ENV, "")
        node = os.environ.get(_FAULT_SLOW_NODE_ENV, "")
        if raw and node:
            raise TrainerError(f"set {_FAULT_SLOW_RANK_ENV} or {_FAULT_SLOW_NODE_ENV}, not both")
        if not raw and not node:
            return None
        try:
            rank = int(raw) if raw else -1
            seconds = float(os.environ.get(_FAULT_SLOW_S_ENV, "") or 0.2)
            from_step = int(os.environ.get(_FAULT_SLOW_FROM_ENV, "") or 1)
        except ValueError as exc:
            raise TrainerError(
                f"{_FAULT_SLOW_RANK_ENV} (int), {_FAULT_SLOW_S_ENV} (float), {_FAULT_SLOW_FROM_ENV} (int): {exc}"
            ) from exc
        if node:
            if not seconds > 0 or from_step < 1:
                raise TrainerError(f"{_FAULT_SLOW_S_ENV} must be > 0 and {_FAULT_SLOW_FROM_ENV} >= 1, got {seconds}, {from_step}")
            return cls(rank=-1, seconds=seconds, from_step=from_step, node=node)
        if rank < 0 or not seconds > 0 or from_step < 1:
            raise TrainerError(
                f"{_FAULT_SLOW_RANK_ENV} must be >= 0, {_FAULT_SLOW_S_ENV} > 0 and {_FAULT_SLOW_FROM_ENV} >= 1, "
                f"got {rank}, {seconds}, {from_step}"
            )
        return cls(rank=rank, seconds=seconds, from_step=from_step)

    def hits(self, rank: int) -> bool:
        return node_name() == self.node if self.node else rank == self.rank

    def apply(self, rank: int, step: int) -> None:
        if step >= self.from_step and self.hits(rank):
            time.sleep(self.seconds)


class StepClock:
    """Marks inside a step, resolved to seconds only at the end of a window.

    CPU: ``perf_counter``. CUDA: events on the current stream, so the durations are the device's
    timeline (a CPU timestamp would measure kernel launches, not compute, and the wait would land in
    whatever call synchronises first)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return float(end - start)


@dataclass(kw_only=True, slots=True)
class StepMarks:
    """One step's marks: start, last gradient bucket ready, loss all-reduced, end.

    compute = (ready - start) + (end - reduced); blocked in collectives = (reduced - ready): after
    the last bucket is handed to the all-reduce a rank only waits for its peers and the transfer."""

    start: Any
    ready: Any
    reduced: Any
    end: Any

    def compute_and_wall(self, clock: StepClock) -> tuple[float, float]:
        wall = clock.seconds(self.start, self.end)
        blocked = clock.seconds(self.ready, self.reduced)
        return max(0.0, wall - blocked), wall


def _process_start_unix() -> float | None:
    """When this process started (Linux /proc), for the startup profile; None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def node_name() -> str:
    """This rank's node, as a scheduler knows it: KILN_NODE_NAME (local launcher), SLURMD_NODENAME, host."""
    for name in _NODE_NAME_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return socket.gethostname()


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
        self.startup: dict[str, float] = {"run_init": time.time()}
        self.args = args
        self.recipe = load_recipe(args.recipe, args.overrides)
        self.recipe_dict = self.recipe.to_dict()
        self.recipe_sha256 = self.recipe.sha256
        self.run_dir: Path = args.run_dir.resolve()
        self.env = init_distributed(self.recipe)
        self.startup["dist_init"] = time.time()
        self.threads = set_threads(self.env)
        self.nodes = [node_name()]
        if self.env.distributed:
            gathered: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(gathered, self.nodes[0])
            self.nodes = [str(n) for n in gathered]
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
        self.startup["data"] = time.time()

        # Model: identical init on every rank (same seed); then per-rank seeds for everything else.
        seed_rngs(cfg.train.seed)
        self.model = GPT(cfg.model).to(self.env.device)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(cfg))
        seed_rngs(cfg.train.seed + 1 + self.env.rank)
        self.state = TrainState()
        self.resumed_from: int | None = None
        self.initial: _InitialState | None = None
        self.spike_fault = SpikeFault.from_env()
        if self.spike_fault is not None:
            log.warning("fault injection: %s", self.spike_fault)
        self.slow_fault = SlowRankFault.from_env()
        if self.slow_fault is not None and self.slow_fault.hits(self.env.rank):
            log.warning("fault injection on rank %d: %s", self.env.rank, self.slow_fault)

        self.train_model: torch.nn.Module = self.model
        if cfg.train.compile:
            self.train_model = torch.compile(self.model)  # type: ignore[assignment]
        if self.env.distributed:
            ddp_kwargs: dict[str, Any] = {}
            if self.env.device.type == "cuda":
                ddp_kwargs["device_ids"] = [self.env.local_rank]
            self.train_model = DDP(self.train_model, **ddp_kwargs)
            self.train_model.register_comm_hook(state=None, hook=self._timed_allreduce_hook)
        self.clock = StepClock(self.env.device)
        self._bucket_ready: Any = None
        self.stragglers = StragglerMonitor(
            factor=cfg.stragglers.factor, windows=cfg.stragglers.windows, nodes=list(self.nodes)
        )
        self._window: list[StepMarks] = []
        self.startup["model"] = time.time()

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
            self.resumed_from = self.state.step
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
        self.startup["resumed"] = time.time()

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
            m_start = self.clock.mark()
            self._bucket_ready = None
            batches = self.sampler.step_batches(step, self.state.data_salt)
            data_s = time.perf_counter() - t_step
            if self.slow_fault is not None:
                self.slow_fault.apply(self.env.rank, step)
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
            m_ready = self._bucket_ready if self._bucket_ready is not None else self.clock.mark()
            if self.env.distributed:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                loss_sum /= self.env.world_size
            loss_value = float(loss_sum.item())
            m_reduced = self.clock.mark()
            if self.spike_fault is not None:
                loss_value = self.spike_fault.apply(loss_value, step, self.state.data_salt)
            reason = guard_verdict(loss_value, self.state.recent_losses, cfg.guard.spike_factor)
            if reason is not None:
                self.rollback(reason, loss_value)
                self._window.clear()
                continue
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._window.append(StepMarks(start=m_start, ready=m_ready, reduced=m_reduced, end=self.clock.mark()))

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
            if "first_step" not in self.startup:
                self.startup["first_step"] = time.time()
                self._log_startup(step)
            if step % cfg.stragglers.every_steps == 0:
                self._straggler_window(step)

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

    # ----------------------------------------------------------------- timing, stragglers

    def _timed_allreduce_hook(self, process_group, bucket):  # type: ignore[no-untyped-def]
        """DDP's default all-reduce, noting when the (last) gradient bucket became ready: from then
        on until the loss all-reduce returns, this rank only waits for its peers and the transfer.
        (No annotations: DDP checks them, and postponed ones are strings it rejects.)"""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._bucket_ready = self.clock.mark()
        return allreduce_hook(process_group, bucket)

    def _straggler_window(self, step: int) -> None:
        """Every rank: gather [median compute, mean compute, mean wall] of its steps since the last
        window; rank 0 flags stragglers and reports per-rank times and scaling efficiency."""
        marks, self._window = self._window, []
        pairs = [m.compute_and_wall(self.clock) for m in marks] or [(0.0, 0.0)]
        compute = [c for c, _ in pairs]
        mine = [statistics.median(compute), statistics.fmean(compute), statistics.fmean(w for _, w in pairs)]
        rows = [mine]
        if self.env.distributed:
            local = torch.tensor(mine, dtype=torch.float64, device=self.env.device)
            out = [torch.zeros_like(local) for _ in range(self.env.world_size)]
            dist.all_gather(out, local)
            rows = [t.tolist() for t in out]
        if not self.env.is_main:
            return
        medians = [r[0] for r in rows]
        record: dict[str, Any] = {"rank_step_times": medians, "straggler_rank": -1}
        if self.env.distributed:
            wall = statistics.fmean(r[2] for r in rows)
            # Weak scaling: a typical rank's compute per step (the lower median, so that with 2
            # ranks a straggler is not the reference) is what one rank alone would take for its
            # share; the rest of a step (waiting for peers, exposed all-reduce) is the price of
            # running N of them. 1.0 = linear scaling. See docs/scaling.md.
            typical = statistics.median_low(r[1] for r in rows)
            record["scaling_efficiency"] = min(1.0, typical / wall) if wall > 0 else 0.0
            flags, cleared = self.stragglers.observe(step, medians)
            for flag in flags:
                log.warning("%s", flag.message)
                self.metrics.log(step, flag.to_event())
                self.metrics.tag({"kiln.straggler_rank": str(flag.rank), "kiln.straggler": flag.message})
            for rank in cleared:
                log.warning("straggler cleared: rank %d is back within %.2fx of the others at step %d",
                            rank, self.stragglers.factor, step)
                self.metrics.log(step, {"event": "straggler_cleared", "rank": rank})
                if self.stragglers.current < 0:
                    self.metrics.tag({"kiln.straggler_rank": "-1"})
            record["straggler_rank"] = self.stragglers.current
        self.metrics.log(step, record)

    def _log_startup(self, step: int) -> None:
        """Rank 0, once per invocation: where the time from process start to the first step went."""
        if not self.env.is_main:
            return
        t = self.startup
        t.setdefault("resumed", t["model"])
        born = _process_start_unix()
        # 0 when this process was forked from one that had already imported torch (a preloading agent).
        imports = _IMPORT_T1 - _IMPORT_T0 if born is None or _IMPORT_T0 >= born else 0.0
        phases = {
            "interpreter_s": (t["run_init"] - born - imports) if born else None,
            "imports_s": imports,
            "rendezvous_and_dist_init_s": t["dist_init"] - t["run_init"],
            "data_s": t["data"] - t["dist_init"],
            "model_s": t["model"] - t["data"],
            "resume_s": t["resumed"] - t["model"],
            "first_step_s": t["first_step"] - t["resumed"],
        }
        total = t["first_step"] - born if born else None
        event = {
            "event": "startup",
            "restart_count": _env_int("TORCHELASTIC_RESTART_COUNT", 0),
            "resumed_from_step": self.resumed_from,
            "first_step": step,
            "process_start_unix": born,
            "first_step_unix": t["first_step"],
            "process_to_first_step_s": total,
            "phases_s": phases,
        }
        self.metrics.log(step, event)
        log.info(
            "startup: %s s from process start to step %d (%s)",
            "?" if total is None else f"{total:.2f}",
            step,
            ", ".join(f"{k[:-2]} {v:.2f}" for k, v in phases.items() if v is not None),
        )

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

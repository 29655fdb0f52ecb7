"""A model in the recipe's strategy (``[parallel] strategy``): what the loop calls, and how a step's
micro-batches reach it.

``ddp``: the model (compiled when ``train.compile``) inside ``DistributedDataParallel`` across ranks,
whose gradient all-reduce runs as a comm hook that marks when the last bucket was ready (the
straggler window's compute time), and whose broadcast of a model's buffers at the forward is timed
on the CPU (``parallel.TimedBufferSyncDDP``: a rank waiting there for a slow peer is blocked).
``fsdp``: FSDP2 in place (``kiln_trainer.parallel.shard_model``: each of ``blocks``, then the
root), its all-gathers and reduce-scatters timed on the CPU (the time a rank waits there for its
peers is blocked, not compute); the caller builds the optimizer after this, over the sharded
parameters. Any ``torch.nn.Module`` works: the strategy never looks inside the model except at the
``blocks`` it is handed or, with none, to find them (``parallel.fsdp_blocks``: kiln's GPT's
``transformer.h``, or the outermost submodules of the classes the model's ``_no_split_modules``
names, as transformers and accelerate auto-wrap a ``PreTrainedModel``; any other model is refused).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, cast

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln_trainer.config import Recipe
from kiln_trainer.distributed import DistEnv
from kiln_trainer.loader import StepBatch
from kiln_trainer.parallel import TimedBufferSyncDDP, shard_model, training_autocast, uses_fsdp
from kiln_trainer.timing import CollectiveWait, GradReadyMark, StepClock

log = logging.getLogger(__name__)


class Strategy:
    """One model spread over the ranks as the recipe says (see the module docstring). ``blocks``: what
    fsdp shards one by one, always used when given; None: found in the model
    (``parallel.fsdp_blocks``). ddp ignores it."""

    def __init__(
        self, model: torch.nn.Module, recipe: Recipe, env: DistEnv, clock: StepClock,
        *, blocks: Iterable[torch.nn.Module] | None = None,
    ) -> None:
        self.model = model
        """The model itself (sharded in place under fsdp): what checkpoints save and load."""
        self.env = env
        self.accum_steps = recipe.data.accum_steps(env.world_size)
        self.grad_ready = GradReadyMark(clock)
        self.collective_wait = CollectiveWait()
        """Seconds in fsdp's all-gathers and reduce-scatters, or ddp's buffer broadcast, this step (on
        the CPU; the session resets it)."""
        self.ddp: DDP | None = None
        self.train_model: torch.nn.Module = model
        """What the loop calls: the model, or DDP around it (compiled under ddp when asked)."""
        self.autocast = training_autocast(recipe, env.device)
        if uses_fsdp(recipe):
            shard_model(model, recipe, env, blocks=blocks, wait=self.collective_wait)
            return
        if recipe.train.compile:
            # A compiled Module is an OptimizedModule, itself a Module; torch.compile's annotation says Callable.
            self.train_model = cast(torch.nn.Module, torch.compile(model))
        if env.distributed:
            ddp_kwargs: dict[str, Any] = {}
            if env.device.type == "cuda":
                ddp_kwargs["device_ids"] = [env.local_rank]
            wait = self.collective_wait if env.device.type == "cpu" else None
            self.ddp = TimedBufferSyncDDP(self.train_model, wait=wait, **ddp_kwargs)
            self.ddp.register_comm_hook(state=None, hook=self.grad_ready.hook)
            self.train_model = self.ddp

    def micro_batches(self, batch: StepBatch) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs, targets)`` on the device for each micro-batch of this rank's part of the step.
        Under ddp the gradients are all-reduced on the last one only: the caller's backward runs
        inside the iteration, under DDP's ``no_sync`` for the others."""
        for micro, rows in enumerate(batch.micro_batches):
            x, y = self._to_device(rows[:, :-1]), self._to_device(rows[:, 1:])
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if self.ddp is not None and micro < self.accum_steps - 1:
                sync = self.ddp.no_sync()
            with sync:
                yield x, y

    def _to_device(self, ids: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(ids))
        if self.env.device.type == "cuda":
            return t.pin_memory().to(self.env.device, non_blocking=True)
        return t

    def release(self) -> None:
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

"""How the model is spread over the ranks (``[parallel] strategy`` in the recipe).

``ddp``: every rank holds the whole model; ``DistributedDataParallel`` all-reduces the gradients on
the last micro-batch of a step. ``fsdp``: FSDP2 -- ``fully_shard`` on every transformer block, then
on the root (embeddings, final norm and the tied head, which share one parameter and so one group)
-- over a 1-D device mesh of all ranks: each rank keeps ``1/W`` of every parameter, gradient and
optimizer moment, gathers a block's parameters just before its forward (and again before its
backward when ``reshard_after_forward``) and reduce-scatters its gradients after the backward.
The blocks are the caller's (``blocks=``), or found in the model (``fsdp_blocks``): kiln's GPT's
``transformer.h``, or the submodules of the classes a model's ``_no_split_modules`` names (a
``transformers`` model's decoder layers, as transformers and accelerate auto-wrap them).

Both give the same training up to float summation order: the same initial weights (every rank
builds the whole model from the same seed before sharding it), the same global batch, the loss
averaged over it. Gradient accumulation under fsdp reduce-scatters every micro-batch (as torchtitan
does): skipping it would keep the unsharded gradients of the whole model on every rank, which is
what fsdp is for not doing.

The optimizer must be built after ``shard_model``: FSDP2 replaces the parameters with DTensors in
place, and the optimizer has to hold those.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kiln_trainer.config import Recipe
from kiln_trainer.distributed import DistEnv
from kiln_trainer.model import GPT
from kiln_trainer.timing import CollectiveWait

log = logging.getLogger(__name__)


def uses_fsdp(recipe: Recipe) -> bool:
    return recipe.parallel.strategy == "fsdp"


def fsdp_mixed_precision(recipe: Recipe, device: torch.device) -> Any | None:
    """FSDP2's policy on CUDA with bfloat16 (``train.dtype`` bfloat16 or auto): parameters gathered
    in bfloat16, gradients reduced in float32 (the sharded master weights and the optimizer stay
    float32). None elsewhere: CPU trains in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda" or recipe.train.dtype not in ("auto", "bfloat16"):
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``shard_model`` shards one by one when the caller names none.

    kiln's GPT: its ``transformer.h``. A model with a non-empty ``_no_split_modules`` (class names: a
    ``transformers`` ``PreTrainedModel``'s, e.g. ``["LlamaDecoderLayer"]``, what transformers' and
    accelerate's FSDP auto-wrap take): every submodule of such a class (by ``type(m).__name__``;
    not the root), in module order, outermost only (one inside another is sharded with it). A
    ``TypeError`` naming the model's class otherwise, or when no submodule matches."""
    if isinstance(model, GPT):
        return list(model.transformer.h)
    cls = type(model).__name__
    names = getattr(model, "_no_split_modules", None)
    if isinstance(names, str):
        names = [names]
    wanted = frozenset(names or ())
    if not wanted:
        raise TypeError(f"shard_model of a {cls}: name its blocks (blocks=model.layers, ...); it is not kiln's "
                        "GPT and has no _no_split_modules to find them by")
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():  # pre-order: an ancestor comes before what it holds
        if not name or type(module).__name__ not in wanted:
            continue
        if found and name.startswith(found[-1][0] + "."):
            continue  # inside the last match (its whole subtree follows it): sharded with it
        found.append((name, module))
    if not found:
        raise TypeError(f"shard_model of a {cls}: no submodule is of a class its _no_split_modules names "
                        f"({sorted(wanted)}); name its blocks (blocks=model.layers, ...)")
    return [module for _, module in found]


def shard_model(
    model: torch.nn.Module, recipe: Recipe, env: DistEnv, *, blocks: Iterable[torch.nn.Module] | None = None,
    wait: CollectiveWait | None = None,
) -> None:
    """FSDP2 in place: every block, then the root. ``train.compile`` compiles each block before it is
    sharded (``Module.compile``: in place, so the parameter names, which checkpoints key on, stay).
    ``blocks``: the modules sharded one by one (a transformer's layers), always used when given;
    None means ``fsdp_blocks(model)``: kiln's GPT's ``transformer.h``, or the outermost submodules
    of the classes the model's ``_no_split_modules`` names (a ``transformers`` model's decoder
    layers); a ``TypeError`` for any other model. ``wait``: on the CPU, every all-gather and
    reduce-scatter adds its seconds there (the straggler window's time blocked in collectives)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("fsdp needs a process group (init_distributed makes one, also for one rank)")
    if blocks is None:
        blocks = fsdp_blocks(model)
        if env.is_main and not isinstance(model, GPT):
            kinds = sorted({type(block).__name__ for block in blocks})
            log.info("fsdp: %d blocks of %s (the model's _no_split_modules), then the root", len(blocks), kinds)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": recipe.parallel.reshard_after_forward}
    policy = fsdp_mixed_precision(recipe, env.device)
    if policy is not None:
        kwargs["mp_policy"] = policy
    sharded = []
    for block in blocks:
        if recipe.train.compile:
            block.compile()
        sharded.append(fully_shard(block, **kwargs))
    sharded.append(fully_shard(model, **kwargs))
    if wait is not None and env.device.type == "cpu":
        all_gather, reduce_scatter = _timed_collectives(wait)
        for module in sharded:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)


def _timed_collectives(wait: CollectiveWait) -> tuple[Any, Any]:
    """FSDP2's own all-gather and reduce-scatter (the same calls, the same buffers), each adding the
    seconds it took to ``wait``."""
    import time

    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool = False) -> Any:
            started = time.perf_counter()
            try:
                return super().__call__(output_tensor, input_tensor, group, async_op)
            finally:
                wait.add(time.perf_counter() - started)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> Any:
            started = time.perf_counter()
            try:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            finally:
                wait.add(time.perf_counter() - started)

    return TimedAllGather(), TimedReduceScatter()


class TimedBufferSyncDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose buffer broadcast adds the seconds it took to ``wait``.

    DDP broadcasts rank 0's buffers (a norm layer's running statistics, a rotary embedding's
    frequencies: every ``register_buffer``) at the start of the forward of each step that will
    all-reduce its gradients (``_sync_buffers``). On the CPU (gloo) the broadcast returns only once
    every rank joined it, so a rank waiting there for a slow peer is blocked, not computing; untimed,
    that wait counted as compute, every rank's window held the slowest rank's time, and no straggler
    was flagged under ddp for a model with buffers. Timed, it is blocked (``StepMarks.collective_s``),
    as FSDP2's all-gathers and reduce-scatters are. The broadcast itself is DDP's, unchanged (the same
    bits). The gradient all-reduce needs nothing of this: its wait lies after the last bucket's
    ready mark (``GradReadyMark``), which ``StepMarks`` counts as blocked already.

    ``wait=None``: DDP as it is (on CUDA the broadcast is queued on the stream and returns at once;
    the strategy times nothing there). ``_sync_buffers`` is DDP's own method: a torch that renamed it
    would leave the broadcast untimed, which test_straggler_ddp_buffers catches."""

    _kiln_wait: CollectiveWait | None = None

    def __init__(self, module: torch.nn.Module, *args: Any, wait: CollectiveWait | None = None, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._kiln_wait = wait

    def _sync_buffers(self) -> None:
        wait = self._kiln_wait
        if wait is None:
            super()._sync_buffers()
            return
        started = time.perf_counter()
        try:
            super()._sync_buffers()
        finally:
            wait.add(time.perf_counter() - started)


def training_autocast(recipe: Recipe, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast for ddp on CUDA (``train.dtype`` auto or bfloat16); none for fsdp, whose
    mixed-precision policy casts the gathered parameters instead, and none on CPU in float32."""
    dtype = recipe.train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "bfloat16" and not (uses_fsdp(recipe) and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

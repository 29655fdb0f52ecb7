"""Where this rank is and how it talks to the others: rank and world from torchrun's environment,
the process group, threads per rank, RNG seeds and the few collectives the trainer runs itself.

A world of one needs no process group: every helper here is then a no-op or returns its input, so
``python -m kiln_trainer.train`` runs without torchrun.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kiln_trainer.config import Recipe
from kiln_trainer.contract import NODE_NAME_ENV, THREADS_ENV
from kiln_trainer.errors import TrainerError

NODE_NAME_ENVS = (NODE_NAME_ENV, "SLURMD_NODENAME")


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


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


def init_distributed(recipe: Recipe) -> DistEnv:
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", 1)
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
    elif recipe.parallel.strategy == "fsdp":
        # FSDP2 and DCP need a process group even alone (a run that resumes an fsdp checkpoint on one
        # rank): a group of one over an in-process store, no port and no torchrun.
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, device=device)


def set_threads(env: DistEnv) -> int:
    override = os.environ.get(THREADS_ENV, "")
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


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's ``obj`` (a small picklable value) on every rank; the others pass anything."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type == "cuda" else None)
    return box[0]


def node_name() -> str:
    """This rank's node, as a scheduler knows it: KILN_NODE_NAME (local launcher), SLURMD_NODENAME, host."""
    for name in NODE_NAME_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return socket.gethostname()


def gather_node_names(env: DistEnv) -> list[str]:
    """Every rank's node, indexed by rank (the straggler monitor names the node of a slow rank)."""
    nodes = [node_name()]
    if env.distributed:
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, nodes[0])
        nodes = [str(n) for n in gathered]
    return nodes


def gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), indexed by rank."""
    if not env.distributed:
        return [values]
    local = torch.tensor(values, dtype=torch.float64, device=env.device)
    out = [torch.zeros_like(local) for _ in range(env.world_size)]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank when ``flag`` is true on any rank."""
    if not env.distributed:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def average_across_ranks_(t: torch.Tensor, env: DistEnv) -> None:
    """In place: ``t`` becomes the mean of its values on all ranks."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size


def wait_for_all_ranks(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def destroy_process_group() -> None:
    """The process group, if there is one (a world of one has one too under fsdp)."""
    if dist.is_initialized():
        dist.destroy_process_group()

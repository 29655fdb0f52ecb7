"""Where a step's and a start's time goes: in-step marks (CPU clock or CUDA events), the mark of
the last gradient bucket DDP hands to the all-reduce, the start-up profile, and peak FLOP/s for MFU.

Annotations are not postponed here (no ``from __future__ import annotations``): DDP inspects its
comm hook's annotations when it is registered, and rejects one that is a string.
"""

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PEAK_FLOPS_ENV = "KILN_PEAK_FLOPS"
# Peak dense bf16 FLOP/s per device, for MFU; override with KILN_PEAK_FLOPS.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


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
    """One step's marks: start, last gradient bucket ready, loss all-reduced, end, and the seconds
    spent inside the strategy's own collectives before ``ready`` (``CollectiveWait``).

    compute = wall - blocked; blocked in collectives = (reduced - ready) + ``collective_s``: after
    the last bucket is handed to the all-reduce a rank only waits for its peers and the transfer, and
    under fsdp a rank also waits for them inside every all-gather and reduce-scatter of the step,
    under ddp inside the broadcast of the model's buffers at the forward (if it has any)."""

    start: Any
    ready: Any
    reduced: Any
    end: Any
    collective_s: float = 0.0

    def compute_and_wall(self, clock: StepClock) -> tuple[float, float]:
        wall = clock.seconds(self.start, self.end)
        blocked = clock.seconds(self.ready, self.reduced) + self.collective_s
        return max(0.0, wall - blocked), wall


class CollectiveWait:
    """Seconds this rank spent inside FSDP2's all-gathers and reduce-scatters, or DDP's broadcast of
    the model's buffers, since ``reset`` (the step's start). On the CPU (gloo) each call returns only
    once every rank has joined it, so a rank that waits there for a slow peer is blocked, not
    computing; without this, every rank's compute time held the slowest rank's and no straggler
    stood out. (On CUDA the calls are queued on their own stream and return at once:
    ``parallel.shard_model`` and ``parallel.TimedBufferSyncDDP`` do not time them there.)"""

    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


class GradReadyMark:
    """DDP's default all-reduce as a comm hook that marks when each gradient bucket became ready;
    after a backward pass ``ready`` is the mark of the last one (``None`` without DDP)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.ready: Any = None

    def hook(self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.ready = self.clock.mark()
        # None is the default group, which allreduce_hook handles; its annotation says ProcessGroup.
        return allreduce_hook(process_group, bucket)  # type: ignore[arg-type]


def process_start_unix() -> float | None:
    """When this process started (Linux /proc), for the startup profile; None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def startup_profile(marks: Mapping[str, float], import_t0: float, import_t1: float) -> dict[str, Any]:
    """Where the time from process start to the first step went, from the wall-clock ``marks`` a run
    takes at each phase's end (``run_init``, ``dist_init``, ``data``, ``model``, ``resumed``,
    ``first_step``) and the window of the heavy imports."""
    born = process_start_unix()
    # 0 when this process was forked from one that had already imported torch (a preloading agent).
    imports = import_t1 - import_t0 if born is None or import_t0 >= born else 0.0
    phases = {
        "interpreter_s": (marks["run_init"] - born - imports) if born else None,
        "imports_s": imports,
        "rendezvous_and_dist_init_s": marks["dist_init"] - marks["run_init"],
        "data_s": marks["data"] - marks["dist_init"],
        "model_s": marks["model"] - marks["data"],
        "resume_s": marks["resumed"] - marks["model"],
        "first_step_s": marks["first_step"] - marks["resumed"],
    }
    return {
        "process_start_unix": born,
        "first_step_unix": marks["first_step"],
        "process_to_first_step_s": marks["first_step"] - born if born else None,
        "phases_s": phases,
    }


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    override = os.environ.get(PEAK_FLOPS_ENV, "")
    if override:
        return float(override)
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, world_size: int) -> float:
    """Model FLOPs utilisation: the share of the ranks' peak FLOP/s the model's maths used."""
    return flops_per_token * tokens_per_s / (peak * world_size)

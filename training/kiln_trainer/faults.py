"""Fault injection for the chaos tests, switched on by environment variables that production never
sets; off, each hook is ``None`` and the loop pays one ``is None`` test per step::

    KILN_FAULT_SPIKE_AT_STEP=12 KILN_FAULT_SPIKE_TIMES=1 python -m kiln_trainer.train ...

poisons step 12: its loss reads 1000x while fewer than ``KILN_FAULT_SPIKE_TIMES`` (default 1)
global batches have been skipped by the loss guard, i.e. the first ``TIMES`` batches step 12 is
given spike and the next one is clean. A large ``TIMES`` makes every retry spike, so the guard
gives up.
``KILN_FAULT_SLOW_RANK=1 KILN_FAULT_SLOW_S=0.5 KILN_FAULT_SLOW_FROM_STEP=11`` makes rank 1 sleep
0.5 s inside every step's compute from step 11 on (a straggler). ``KILN_FAULT_SLOW_NODE=node2``
instead slows every rank on that node (a throttled node: after the launcher excludes it, the job on
the other nodes runs at full speed).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from kiln_trainer.contract import FAULT_SLOW_FROM_STEP_ENV as SLOW_FROM_ENV
from kiln_trainer.contract import FAULT_SLOW_RANK_ENV as SLOW_RANK_ENV
from kiln_trainer.contract import FAULT_SLOW_S_ENV as SLOW_S_ENV
from kiln_trainer.distributed import node_name
from kiln_trainer.errors import TrainerError

log = logging.getLogger(__name__)

SPIKE_STEP_ENV = "KILN_FAULT_SPIKE_AT_STEP"
SPIKE_TIMES_ENV = "KILN_FAULT_SPIKE_TIMES"
SPIKE_FACTOR = 1000.0
SLOW_NODE_ENV = "KILN_FAULT_SLOW_NODE"


@dataclass(frozen=True, kw_only=True, slots=True)
class SpikeFault:
    """Chaos hook: the loss of ``step`` reads 1000x while fewer than ``times`` global batches were skipped.

    Keyed on the guard's skipped batches (which are checkpointed) rather than an in-memory counter,
    so the fault behaves the same after a resume and models a bad batch that a rollback skips.
    """

    step: int
    times: int = 1

    @classmethod
    def from_env(cls) -> SpikeFault | None:
        raw = os.environ.get(SPIKE_STEP_ENV, "")
        if not raw:
            return None
        try:
            step, times = int(raw), int(os.environ.get(SPIKE_TIMES_ENV, "") or 1)
        except ValueError as exc:
            raise TrainerError(f"{SPIKE_STEP_ENV}/{SPIKE_TIMES_ENV} must be integers: {exc}") from exc
        if step < 1 or times < 1:
            raise TrainerError(f"{SPIKE_STEP_ENV} and {SPIKE_TIMES_ENV} must be >= 1")
        return cls(step=step, times=times)

    def apply(self, loss: float, step: int, skipped_batches: int) -> float:
        return loss * SPIKE_FACTOR if step == self.step and skipped_batches < self.times else loss


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
        raw = os.environ.get(SLOW_RANK_ENV, "")
        node = os.environ.get(SLOW_NODE_ENV, "")
        if raw and node:
            raise TrainerError(f"set {SLOW_RANK_ENV} or {SLOW_NODE_ENV}, not both")
        if not raw and not node:
            return None
        try:
            rank = int(raw) if raw else -1
            seconds = float(os.environ.get(SLOW_S_ENV, "") or 0.2)
            from_step = int(os.environ.get(SLOW_FROM_ENV, "") or 1)
        except ValueError as exc:
            raise TrainerError(f"{SLOW_RANK_ENV} (int), {SLOW_S_ENV} (float), {SLOW_FROM_ENV} (int): {exc}") from exc
        if node:
            if not seconds > 0 or from_step < 1:
                raise TrainerError(f"{SLOW_S_ENV} must be > 0 and {SLOW_FROM_ENV} >= 1, got {seconds}, {from_step}")
            return cls(rank=-1, seconds=seconds, from_step=from_step, node=node)
        if rank < 0 or not seconds > 0 or from_step < 1:
            raise TrainerError(
                f"{SLOW_RANK_ENV} must be >= 0, {SLOW_S_ENV} > 0 and {SLOW_FROM_ENV} >= 1, "
                f"got {rank}, {seconds}, {from_step}"
            )
        return cls(rank=rank, seconds=seconds, from_step=from_step)

    def hits(self, rank: int) -> bool:
        return node_name() == self.node if self.node else rank == self.rank

    def apply(self, rank: int, step: int) -> None:
        if step >= self.from_step and self.hits(rank):
            time.sleep(self.seconds)


def injected_faults(rank: int) -> tuple[SpikeFault | None, SlowRankFault | None]:
    """The faults the environment asks this rank to inject, each logged loudly (never in production)."""
    spike = SpikeFault.from_env()
    if spike is not None:
        log.warning("fault injection: %s", spike)
    slow = SlowRankFault.from_env()
    if slow is not None and slow.hits(rank):
        log.warning("fault injection on rank %d: %s", rank, slow)
    return spike, slow

"""Straggler detection on rank 0, torch-free: which rank keeps computing slower than the others.

Every ``stragglers.every_steps`` steps each rank contributes the median *compute* seconds of its
steps in that window (step wall time minus the time blocked in collectives, so a healthy rank that
waits for a slow one at the all-reduce does not look slow itself). Rank 0 feeds the gathered list
to a ``StragglerMonitor``::

    monitor = StragglerMonitor(factor=1.5, windows=3)
    flags, cleared = monitor.observe(step, [0.021, 0.094])   # seconds per step of rank 0, rank 1
    monitor.current                                          # flagged rank, -1 when none

A rank is slow in a window when its time exceeds ``factor`` x the median of the *other* ranks'
times (with 2 ranks the median of both would move with the straggler itself); it is flagged once
when its slow streak reaches ``windows`` consecutive windows, and cleared when a window is not slow.

The rule over one window, ``slow_ranks``, and the record's names are the trainer contract's
(``kiln_trainer.contract``): the orchestration side (``kiln.launchers.stragglers``) re-runs the same
rule offline and reads the ``straggler`` events the trainer writes to ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln_trainer.contract import METRICS_EVENT_KEY, STRAGGLER_EVENT, slow_ranks

__all__ = ["Flag", "StragglerMonitor", "slow_ranks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Flag:
    """A rank that has been slow for ``windows`` consecutive windows, as of ``step``."""

    rank: int
    step: int
    step_time_s: float
    reference_s: float
    windows: int
    node: str = ""

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.reference_s if self.reference_s > 0 else float("inf")

    @property
    def message(self) -> str:
        where = f" on node {self.node}" if self.node else ""
        return (
            f"straggler: rank {self.rank}{where} at step {self.step}: {1000 * self.step_time_s:.1f} ms/step of "
            f"compute is {self.ratio:.2f}x the other ranks' median ({1000 * self.reference_s:.1f} ms) for "
            f"{self.windows} consecutive windows"
        )

    def to_event(self) -> dict[str, object]:
        return {
            METRICS_EVENT_KEY: STRAGGLER_EVENT,
            "rank": self.rank,
            "node": self.node,
            "step_time_s": self.step_time_s,
            "reference_s": self.reference_s,
            "ratio": self.ratio,
            "windows": self.windows,
            "message": self.message,
        }


@dataclass(kw_only=True, slots=True)
class StragglerMonitor:
    factor: float
    windows: int
    nodes: list[str] = field(default_factory=list)
    """Node name of each rank (for messages and the Slurm exclude action); may be empty."""
    streaks: dict[int, int] = field(default_factory=dict)

    @property
    def current(self) -> int:
        """The flagged rank (the slowest streak if several), -1 when none."""
        flagged = [r for r, n in self.streaks.items() if n >= self.windows]
        return min(flagged, key=lambda r: (-self.streaks[r], r)) if flagged else -1

    def observe(self, step: int, times: Sequence[float]) -> tuple[list[Flag], list[int]]:
        """Feed one window; return (ranks flagged now, flagged ranks that recovered now)."""
        slow = {rank: (own, ref) for rank, own, ref in slow_ranks(times, self.factor)}
        flags, cleared = [], []
        for rank in range(len(times)):
            if rank in slow:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.windows:
                    own, ref = slow[rank]
                    node = self.nodes[rank] if rank < len(self.nodes) else ""
                    flags.append(Flag(rank=rank, step=step, step_time_s=own, reference_s=ref,
                                      windows=self.windows, node=node))
            else:
                if self.streaks.get(rank, 0) >= self.windows:
                    cleared.append(rank)
                self.streaks[rank] = 0
        return flags, cleared

    def reset(self) -> None:
        self.streaks.clear()

"""Straggler detection: a rank whose step time stays above the others' median by a factor.

Pure: it consumes per-rank step times (one window = one gather of every rank's mean step time,
every ``log_every`` steps) and returns flags; acting on a flag (alert, or on Slurm a resubmission
with ``exclude=`` the slow node) is the caller's, per policy.

    detector = StragglerDetector(StragglerPolicy(factor=1.5, windows=3))
    for step, times in windows:                   # times: [step seconds of rank 0, rank 1, ...]
        for flag in detector.observe(step, times):
            log.warning("%s", flag.message)

The reference is the median of the *other* ranks, so that with 2 ranks a slow rank is compared with
the healthy one (the median of both would move with the straggler itself).

``rank_step_times_from_metrics(RUN/metrics.jsonl)`` reads the windows a trainer records as
``{"step": N, "rank_step_times": [s0, s1, ...]}``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerPolicy:
    factor: float = 1.5
    """A rank is slow in a window when its step time exceeds ``factor`` x the other ranks' median."""
    windows: int = 3
    """Consecutive slow windows before the rank is flagged (one flag per slow streak)."""
    action: Literal["alert", "exclude_node"] = "alert"
    """What the caller does with a flag: log/metric/tag only, or (Slurm) resubmit without the node."""

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ConfigError(f"straggler factor must be > 1, got {self.factor}")
        if self.windows < 1:
            raise ConfigError(f"straggler windows must be >= 1, got {self.windows}")
        if self.action not in ("alert", "exclude_node"):
            raise ConfigError(f"straggler action must be 'alert' or 'exclude_node', got {self.action!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerFlag:
    rank: int
    step: int
    step_time_s: float
    reference_s: float
    """Median step time of the other ranks in the flagging window."""
    windows: int

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.reference_s if self.reference_s > 0 else float("inf")

    @property
    def message(self) -> str:
        return (f"straggler: rank {self.rank} at step {self.step}: {1000 * self.step_time_s:.1f} ms/step is "
                f"{self.ratio:.2f}x the other ranks' median ({1000 * self.reference_s:.1f} ms) for "
                f"{self.windows} consecutive windows")


@dataclass(kw_only=True, slots=True)
class StragglerDetector:
    policy: StragglerPolicy
    streaks: dict[int, int] = field(default_factory=dict)

    def observe(self, step: int, rank_step_times: Sequence[float]) -> list[StragglerFlag]:
        """Feed one window; return the ranks whose slow streak reaches ``policy.windows`` now."""
        times = [float(t) for t in rank_step_times]
        if len(times) < 2:
            return []
        flags = []
        for rank, own in enumerate(times):
            reference = statistics.median(times[:rank] + times[rank + 1:])
            if own > self.policy.factor * reference:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.policy.windows:
                    flags.append(StragglerFlag(rank=rank, step=step, step_time_s=own, reference_s=reference,
                                               windows=self.policy.windows))
            else:
                self.streaks[rank] = 0
        return flags


def rank_step_times_from_metrics(path: str | Path) -> Iterator[tuple[int, list[float]]]:
    """``(step, [seconds per step of each rank])`` from a metrics.jsonl, oldest first."""
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written
            times = record.get("rank_step_times")
            if isinstance(times, list) and "step" in record:
                yield int(record["step"]), [float(t) for t in times]


def detect(windows: Iterator[tuple[int, list[float]]] | Sequence[tuple[int, list[float]]],
           policy: StragglerPolicy) -> list[StragglerFlag]:
    detector = StragglerDetector(policy=policy)
    return [flag for step, times in windows for flag in detector.observe(step, times)]

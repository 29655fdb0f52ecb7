"""Stragglers on the orchestration side: offline detection, and the policy's action on a flag.

The trainer detects stragglers itself (every ``stragglers.every_steps`` steps, from every rank's
compute time per step) and writes what it finds to ``RUN/metrics.jsonl``:
``{"step", "rank_step_times": [...], "straggler_rank", "scaling_efficiency"}`` each window and a
``{"event": "straggler", "rank", "node", "ratio", "message", ...}`` record when a rank is flagged.
This module

* re-runs the same rule offline over recorded windows (``StragglerDetector``, ``detect``), and
* turns flag events into the policy's action (``StragglerWatch``): ``alert`` (the local backend:
  the launcher logs it; the trainer's metric, log line and MLflow tag are the alert) or
  ``exclude_node`` (Slurm: end the job and resubmit it with ``--exclude=<node>``; it resumes from
  the last committed checkpoint). The watch decides; the Slurm backend's
  ``resubmit_excluding(launcher, handle, node)`` carries it out.

    detector = StragglerDetector(StragglerPolicy(factor=1.5, windows=3))
    for step, times in windows:                   # times: [step seconds of rank 0, rank 1, ...]
        for flag in detector.observe(step, times):
            log.warning("%s", flag.message)

The reference is the median of the *other* ranks, so that with 2 ranks a slow rank is compared with
the healthy one (the median of both would move with the straggler itself). The rule over one window
(``slow_ranks``) and the record's names are the trainer contract's, so both sides apply the same rule.

``rank_step_times_from_metrics(RUN/metrics.jsonl)`` reads the windows a trainer records as
``{"step": N, "rank_step_times": [s0, s1, ...]}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln.errors import ConfigError
from kiln.runs import METRICS_JSONL
from kiln.util.fs import parse_own_json
from kiln_trainer.contract import METRICS_EVENT_KEY, METRICS_STEP_KEY, RANK_STEP_TIMES_KEY, STRAGGLER_EVENT, slow_ranks


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerPolicy:
    factor: float = 1.5
    """A rank is slow in a window when its step time exceeds ``factor`` x the other ranks' median."""
    windows: int = 3
    """Consecutive slow windows before the rank is flagged (one flag per slow streak)."""
    action: Literal["alert", "exclude_node"] = "alert"
    """What the caller does with a flag: log/metric/tag only, or (Slurm) resubmit without the node."""
    max_excluded: int = 2
    """``exclude_node``: at most this many nodes are excluded over a run; later flags only alert
    (a slow fabric makes every node look slow in turn: excluding them all would drain the cluster)."""

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ConfigError(f"straggler factor must be > 1, got {self.factor}")
        if self.windows < 1:
            raise ConfigError(f"straggler windows must be >= 1, got {self.windows}")
        if self.action not in ("alert", "exclude_node"):
            raise ConfigError(f"straggler action must be 'alert' or 'exclude_node', got {self.action!r}")
        if self.max_excluded < 0:
            raise ConfigError(f"straggler max_excluded must be >= 0, got {self.max_excluded}")


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
        slow = {rank: (own, ref) for rank, own, ref in slow_ranks(times, self.policy.factor)}
        flags = []
        for rank in range(len(times)):
            if rank in slow:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.policy.windows:
                    own, reference = slow[rank]
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
                record = parse_own_json(line, str(path))
            except ValueError:
                continue  # a line being written
            times = record.get(RANK_STEP_TIMES_KEY)
            if isinstance(times, list) and METRICS_STEP_KEY in record:
                yield int(record[METRICS_STEP_KEY]), [float(t) for t in times]


def detect(windows: Iterator[tuple[int, list[float]]] | Sequence[tuple[int, list[float]]],
           policy: StragglerPolicy) -> list[StragglerFlag]:
    detector = StragglerDetector(policy=policy)
    return [flag for step, times in windows for flag in detector.observe(step, times)]


# ------------------------------------------------------------------------------- acting on flags
@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerEvent:
    """A flag the trainer recorded (``{"event": "straggler", ...}`` in metrics.jsonl)."""

    step: int
    rank: int
    node: str
    ratio: float
    message: str

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StragglerEvent:
        return cls(step=int(record[METRICS_STEP_KEY]), rank=int(record["rank"]), node=str(record.get("node") or ""),
                   ratio=float(record.get("ratio") or 0.0), message=str(record.get("message") or ""))


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerAction:
    """What to do about one flag: ``alert``, or ``exclude_node`` with the node to leave out."""

    kind: Literal["alert", "exclude_node"]
    event: StragglerEvent
    node: str | None = None
    reason: str = ""

    @property
    def message(self) -> str:
        what = f"exclude node {self.node} and resubmit" if self.kind == "exclude_node" else "alert"
        return f"{self.event.message} -> policy action: {what}" + (f" ({self.reason})" if self.reason else "")


def straggler_events(path: str | Path, offset: int = 0) -> tuple[list[StragglerEvent], int]:
    """Straggler flags in ``metrics.jsonl`` after byte ``offset``, and the offset to read from next
    (whole lines only: a line being written is read on the next call)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return [], offset
    cut = data.rfind(b"\n") + 1
    events = []
    for line in data[:cut].splitlines():
        try:
            record = parse_own_json(line, "a straggler event")
        except ValueError:
            continue
        if isinstance(record, dict) and record.get(METRICS_EVENT_KEY) == STRAGGLER_EVENT:
            try:
                events.append(StragglerEvent.from_record(record))
            except (KeyError, TypeError, ValueError):
                continue
    return events, offset + cut


@dataclass(kw_only=True, slots=True)
class StragglerWatch:
    """Follows a run's metrics.jsonl and turns each new straggler flag into the policy's action.

    Local backend (the supervisor's loop): ``alert`` only, logged as a ``[launcher]`` line.
    Slurm (the hook): ``for a in watch.poll(): if a.kind == "exclude_node": launcher, handle =
    resubmit_excluding(launcher, handle, a.node)`` — the new job resumes from the last committed
    checkpoint on the other nodes."""

    run_dir: Path
    policy: StragglerPolicy
    offset: int = 0
    excluded: list[str] = field(default_factory=list)

    def poll(self) -> list[StragglerAction]:
        events, self.offset = straggler_events(Path(self.run_dir) / METRICS_JSONL, self.offset)
        return [self.decide(event) for event in events]

    def decide(self, event: StragglerEvent) -> StragglerAction:
        if self.policy.action == "alert":
            return StragglerAction(kind="alert", event=event)
        if not event.node:
            return StragglerAction(kind="alert", event=event, reason="the trainer did not name the rank's node")
        if event.node in self.excluded:
            return StragglerAction(kind="alert", event=event, reason=f"node {event.node} is already excluded")
        if len(self.excluded) >= self.policy.max_excluded:
            return StragglerAction(kind="alert", event=event, reason=(
                f"already excluded {len(self.excluded)} node(s) ({', '.join(self.excluded)}), "
                f"max_excluded={self.policy.max_excluded}: look for a shared cause (fabric, storage)"))
        self.excluded.append(event.node)
        return StragglerAction(kind="exclude_node", event=event, node=event.node)

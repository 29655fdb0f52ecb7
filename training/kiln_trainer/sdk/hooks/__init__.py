"""Step hooks: what runs around every step of a session without being part of the loop.

A hook subclasses ``StepHook`` and overrides the calls it needs; the session calls every hook in
order at each point. kiln's own, each in its module, are what ``default_hooks`` returns, in this order:

    faults.FaultInjection   chaos tests only: a slow rank or node, a poisoned loss (``kiln_trainer.faults``)
    guard.LossGuard         vetoes a non-finite or spiking loss: the session rolls back and skips the batch
    startup.StartupProfile  where the time from process start to the first step went (a ``startup`` event)
    stragglers.StragglerWatch  per-rank compute times, scaling efficiency, ``straggler`` events
    interval_log.IntervalLog   the log line and metrics record every ``train.log_every`` steps

Order matters where hooks meet: the fault poisons the loss before the guard reads it, and the
records of a step reach ``metrics.jsonl`` as startup, straggler window, interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session
    from kiln_trainer.timing import StepMarks

__all__ = ["StepHook", "StepStats", "default_hooks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """One applied step, as the session measured it."""

    step: int
    loss: float
    """The step's loss, averaged over every rank (the same value on each)."""
    tokens: int
    """Tokens the step trained on, all ranks together."""
    data_s: float
    """Seconds this rank waited for its batch."""
    step_s: float
    """Seconds from asking for the batch to the optimizer step done."""
    ckpt_s: float
    """Seconds the loop was blocked saving after this step (0.0 when no checkpoint was due)."""
    marks: StepMarks
    """In-step marks (``timing.StepMarks``): compute vs. time blocked in collectives."""


class StepHook:
    """No-op at every point; a hook overrides what it needs. Every rank calls every hook."""

    def on_start(self, session: Session) -> None:
        """After the resume (or fresh start), before the first step of this invocation."""

    def on_batch(self, session: Session, step: int) -> None:
        """Step ``step``'s batch has been read; its forward has not started."""

    def on_loss(self, session: Session, step: int, loss: float) -> float:
        """The loss every rank agrees on; returns the value the guard and the record see."""
        return loss

    def veto(self, session: Session, step: int, loss: float) -> str | None:
        """Why step ``step`` must not be applied (the session then rolls back), or None."""
        return None

    def on_rollback(self, session: Session, event: dict[str, Any]) -> None:
        """The session returned to its last committed state (``event``: the ``rollback`` record)."""

    def on_step_end(self, session: Session, stats: StepStats) -> None:
        """Step ``stats.step`` was applied, counted and (when due) checkpointed."""

    def on_save(self, session: Session, step: int, blocked_s: float) -> None:
        """A checkpoint of ``step`` was handed to the writer (committed later when asynchronous)."""


def default_hooks(*, import_window: tuple[float, float] | None = None) -> list[StepHook]:
    """kiln's hooks, in order (see the module docstring). ``import_window``: the wall-clock start and
    end of the trainer's heavy imports, for the startup profile."""
    from kiln_trainer.sdk.hooks.faults import FaultInjection
    from kiln_trainer.sdk.hooks.guard import LossGuard
    from kiln_trainer.sdk.hooks.interval_log import IntervalLog
    from kiln_trainer.sdk.hooks.startup import StartupProfile
    from kiln_trainer.sdk.hooks.stragglers import StragglerWatch

    return [FaultInjection(), LossGuard(), StartupProfile(import_window=import_window), StragglerWatch(), IntervalLog()]

"""Fault injection as a step hook, for the chaos tests only (never set in production): the faults
``kiln_trainer.faults`` reads from the environment. Off, it does nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln_trainer.faults import SlowRankFault, SpikeFault, injected_faults
from kiln_trainer.sdk.hooks import StepHook

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session


class FaultInjection(StepHook):
    """A slow rank or node sleeps inside each step's compute; a poisoned step's loss reads 1000x."""

    def __init__(self) -> None:
        self.spike: SpikeFault | None = None
        self.slow: SlowRankFault | None = None

    def on_start(self, session: Session) -> None:
        self.spike, self.slow = injected_faults(session.rank)

    def on_batch(self, session: Session, step: int) -> None:
        if self.slow is not None:
            self.slow.apply(session.rank, step)

    def on_loss(self, session: Session, step: int, loss: float) -> float:
        if self.spike is None:
            return loss
        return self.spike.apply(loss, step, len(session.state.skipped_batches))

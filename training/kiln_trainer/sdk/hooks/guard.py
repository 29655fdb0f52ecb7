"""The loss guard (``[guard]`` in the recipe) as a step hook: a non-finite step loss, or one above
``spike_factor`` times the mean of the recent losses, is never applied. The session rolls back to
its newest committed state, replays the same batches up to the offending one and skips that global
batch on every rank; past ``max_rollbacks`` rollbacks the run fails (``TrainingDivergedError``, exit 2)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kiln_trainer.contract import ROLLBACK_EVENT
from kiln_trainer.errors import TrainingDivergedError
from kiln_trainer.sdk.hooks import StepHook

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session


def guard_verdict(loss: float, recent_losses: list[float], spike_factor: float) -> str | None:
    """Why this step's (rank-averaged) loss must not be applied, or None if it may."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if spike_factor > 0 and len(recent_losses) >= 5:
        mean = sum(recent_losses) / len(recent_losses)
        if loss > spike_factor * mean:
            return f"loss spike ({loss:.4g} > {spike_factor} x recent mean {mean:.4g})"
    return None


class LossGuard(StepHook):
    """Vetoes a step ``guard_verdict`` refuses; refuses to roll back past ``guard.max_rollbacks``."""

    def veto(self, session: Session, step: int, loss: float) -> str | None:
        cfg = session.recipe.guard
        reason = guard_verdict(loss, session.state.recent_losses, cfg.spike_factor)
        if reason is None:
            return None
        rollbacks = sum(1 for e in session.state.events if e.get("kind") == ROLLBACK_EVENT)
        if rollbacks >= cfg.max_rollbacks:
            raise TrainingDivergedError(
                f"{reason} at step {step} (loss {loss}); already rolled back {rollbacks} time(s), "
                f"guard.max_rollbacks = {cfg.max_rollbacks}"
            )
        return reason

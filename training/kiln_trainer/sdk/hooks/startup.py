"""Where an invocation's start-up time went, as a step hook: rank 0 records a ``startup`` event (and a
log line) at the first step, from the session's phase marks (``Session.marks``) and the window of
the trainer's heavy imports."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kiln_trainer.contract import METRICS_EVENT_KEY, STARTUP_EVENT
from kiln_trainer.distributed import env_int
from kiln_trainer.sdk.hooks import StepHook, StepStats
from kiln_trainer.timing import startup_profile

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session

log = logging.getLogger("kiln_trainer.train")


class StartupProfile(StepHook):
    """Rank 0, once per invocation (see the module docstring)."""

    def __init__(self, *, import_window: tuple[float, float] | None = None) -> None:
        self.import_window = import_window
        self.done = False

    def on_step_end(self, session: Session, stats: StepStats) -> None:
        if self.done:
            return
        self.done = True
        marks = session.marks
        marks["first_step"] = time.time()
        if not session.is_main:
            return
        marks.setdefault("resumed", marks["model"])
        t0, t1 = self.import_window or (marks["run_init"], marks["run_init"])
        profile = startup_profile(marks, t0, t1)
        event = {
            METRICS_EVENT_KEY: STARTUP_EVENT,
            "restart_count": env_int("TORCHELASTIC_RESTART_COUNT", 0),
            "resumed_from_step": session.resumed_from,
            "first_step": stats.step,
            **profile,
        }
        session.metrics.log(stats.step, event)
        total = profile["process_to_first_step_s"]
        log.info(
            "startup: %s s from process start to step %d (%s)",
            "?" if total is None else f"{total:.2f}",
            stats.step,
            ", ".join(f"{k[:-2]} {v:.2f}" for k, v in profile["phases_s"].items() if v is not None),
        )

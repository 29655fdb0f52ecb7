"""Stragglers and scaling (``[stragglers]`` in the recipe) as a step hook: every ``every_steps``
steps the ranks all-gather their compute time per step (step time minus the time blocked in
collectives); rank 0 records ``rank_step_times``, ``straggler_rank`` (-1 when none) and
``scaling_efficiency`` and flags a rank slower than ``factor`` x the other ranks' median for
``windows`` windows (log line, a ``straggler`` event in metrics.jsonl, MLflow tags
``kiln.straggler_rank``/``kiln.straggler``). The rule is the contract's (``slow_ranks``), applied by
``kiln_trainer.stragglers.StragglerMonitor``."""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING, Any

from kiln_trainer.contract import METRICS_EVENT_KEY, RANK_STEP_TIMES_KEY, STRAGGLER_CLEARED_EVENT
from kiln_trainer.distributed import gather_floats
from kiln_trainer.sdk.hooks import StepHook, StepStats
from kiln_trainer.stragglers import StragglerMonitor
from kiln_trainer.timing import StepMarks

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session

log = logging.getLogger("kiln_trainer.train")


class StragglerWatch(StepHook):
    """Every rank gathers its window; rank 0 judges it (see the module docstring)."""

    def __init__(self) -> None:
        self.window: list[StepMarks] = []
        self.monitor: StragglerMonitor | None = None

    def on_start(self, session: Session) -> None:
        cfg = session.recipe.stragglers
        self.monitor = StragglerMonitor(factor=cfg.factor, windows=cfg.windows, nodes=list(session.nodes))

    def on_rollback(self, session: Session, event: dict[str, Any]) -> None:
        self.window.clear()

    def on_step_end(self, session: Session, stats: StepStats) -> None:
        self.window.append(stats.marks)
        if stats.step % session.recipe.stragglers.every_steps == 0:
            self._close_window(session, stats.step)

    def _close_window(self, session: Session, step: int) -> None:
        """Every rank: gather [median compute, mean compute, mean wall] of its steps since the last
        window; rank 0 flags stragglers and reports per-rank times and scaling efficiency."""
        marks, self.window = self.window, []
        pairs = [m.compute_and_wall(session.clock) for m in marks] or [(0.0, 0.0)]
        compute = [c for c, _ in pairs]
        mine = [statistics.median(compute), statistics.fmean(compute), statistics.fmean(w for _, w in pairs)]
        rows = gather_floats(mine, session.env)
        if not session.is_main:
            return
        medians = [r[0] for r in rows]
        record: dict[str, Any] = {RANK_STEP_TIMES_KEY: medians, "straggler_rank": -1}
        if session.env.distributed:
            assert self.monitor is not None
            wall = statistics.fmean(r[2] for r in rows)
            # Weak scaling: a typical rank's compute per step (the lower median, so that with 2
            # ranks a straggler is not the reference) is what one rank alone would take for its
            # share; the rest of a step (waiting for peers, exposed all-reduce) is the price of
            # running N of them. 1.0 = linear scaling. See docs/scaling.md.
            typical = statistics.median_low(r[1] for r in rows)
            record["scaling_efficiency"] = min(1.0, typical / wall) if wall > 0 else 0.0
            self._flag(session, self.monitor, step, medians)
            record["straggler_rank"] = self.monitor.current
        session.metrics.log(step, record)

    @staticmethod
    def _flag(session: Session, monitor: StragglerMonitor, step: int, medians: list[float]) -> None:
        """Rank 0: log, record and tag each rank that became or stopped being a straggler."""
        flags, cleared = monitor.observe(step, medians)
        for flag in flags:
            log.warning("%s", flag.message)
            session.metrics.log(step, flag.to_event())
            session.metrics.tag({"kiln.straggler_rank": str(flag.rank), "kiln.straggler": flag.message})
        for rank in cleared:
            log.warning("straggler cleared: rank %d is back within %.2fx of the others at step %d",
                        rank, monitor.factor, step)
            session.metrics.log(step, {METRICS_EVENT_KEY: STRAGGLER_CLEARED_EVENT, "rank": rank})
            if monitor.current < 0:
                session.metrics.tag({"kiln.straggler_rank": "-1"})

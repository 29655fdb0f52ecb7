"""Interval logging as a step hook: rank 0's log line and metrics record every ``train.log_every``
steps and at the last one (loss, learning rate, tokens/s, step time, data wait, time blocked on
checkpoints, checkpoint lag, MFU on CUDA), averaged over the steps since the previous record. The
record's mtime-fresh ``metrics.prom`` is the run's heartbeat."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln_trainer.sdk.hooks import StepHook, StepStats
from kiln_trainer.timing import mfu, peak_flops

if TYPE_CHECKING:
    from kiln_trainer.sdk.session import Session

log = logging.getLogger("kiln_trainer.train")


@dataclass(kw_only=True, slots=True)
class _Interval:
    """The steps since the last log line: what the next metrics record averages over."""

    t0: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_s: float = 0.0
    ckpt_s: float = 0.0
    tokens: int = 0


def flops_per_token(model: Any) -> float:
    """Training FLOPs per token: the model's own estimate (``flops_per_token()``, kiln's GPT has one)
    or 6 x its parameters."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own())
    return 6.0 * sum(p.numel() for p in model.parameters())


class IntervalLog(StepHook):
    """See the module docstring; the plan of the invocation is logged once at the start."""

    def __init__(self) -> None:
        self.interval = _Interval()
        self.flops_per_token = 0.0
        self.peak: float | None = None

    def on_start(self, session: Session) -> None:
        self.peak = peak_flops(session.device)
        self.flops_per_token = flops_per_token(session.model) if self.peak else 0.0
        session.log_plan()
        self.interval = _Interval()

    def on_step_end(self, session: Session, stats: StepStats) -> None:
        iv = self.interval
        iv.steps += 1
        iv.data_s += stats.data_s
        iv.tokens += stats.tokens
        iv.ckpt_s += stats.ckpt_s
        if stats.step % session.recipe.train.log_every == 0 or stats.step == session.target_step:
            self._log(session, stats.step, stats.loss)
            self.interval = _Interval()

    def _log(self, session: Session, step: int, loss: float) -> None:
        iv = self.interval
        elapsed = time.perf_counter() - iv.t0
        tokens_per_s = iv.tokens / elapsed if elapsed > 0 else 0.0
        committed = session.checkpoints.last_committed_step
        record = {
            "loss": loss,
            "lr": session.learning_rate,
            "tokens_per_s": tokens_per_s,
            "step_time": elapsed / max(1, iv.steps),
            "data_wait_frac": iv.data_s / elapsed if elapsed > 0 else 0.0,
            # Compute utilisation on CPU: the share of the interval not spent waiting for
            # data or blocked on a checkpoint (the signal behind the < 85% alert).
            "busy_frac": max(0.0, elapsed - iv.data_s - iv.ckpt_s) / elapsed if elapsed > 0 else 0.0,
            "ckpt_block_s": iv.ckpt_s,
            "checkpoint_lag_steps": step - (committed or 0),
            "world_size": session.world_size,
            "train_tokens": session.state.train_tokens,
            **session.loader.mixture_metrics(),  # a mixture's per-source draws, epochs and realized shares
        }
        if self.peak:
            record["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.peak, session.world_size)
        session.metrics.log(step, record)
        log.info(
            "step %d/%d loss %.4f lr %.2e %.0f tok/s %.1f ms/step data %.1f%% ckpt %.1f ms lag %d",
            step,
            session.target_step,
            loss,
            record["lr"],
            tokens_per_s,
            1000 * record["step_time"],
            100 * record["data_wait_frac"],
            1000 * iv.ckpt_s,
            record["checkpoint_lag_steps"],
        )

"""Deferrable waiting for a submitted training job: an Airflow trigger around ``Launcher.poll``.

The train task submits the job (slurm: ``sbatch``; kubernetes: a TrainJob), then defers on
``LaunchedJobTrigger`` and frees its worker slot: the triggerer polls the job with the backend's own
``poll`` (squeue/scontrol/sacct; the TrainJob's status conditions) in a thread, so the event loop
never blocks on a CLI or an API call, and fires one event when the job ends::

    {"state": "SUCCEEDED" | "FAILED" | "FATAL" | "CANCELLED", "reason": "...", "handle": {...},
     "log_tail": "last lines of the job log (on failure)"}

The task resumes in ``execute_complete`` and turns the event into the TrainResult or the launcher's
error (``kiln.launchers.base.result_for``). When a user kills the deferred task (mark failed, clear),
``on_kill`` cancels the job (scancel, TrainJob delete); a triggerer restart only moves the trigger.

Everything the trigger needs is in its kwargs (JSON-safe: the handle, the backend name and its
options), so any triggerer can rebuild it. This is the one module of ``kiln.launchers`` that
imports Airflow; nothing else imports it at module level.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from kiln.launchers.base import JobHandle, JobStatus, tail_text

CLASSPATH = "kiln.launchers.triggers.LaunchedJobTrigger"


class LaunchedJobTrigger(BaseTrigger):
    """Polls one submitted job every ``poll_s`` seconds until it ends; yields one event."""

    def __init__(self, *, handle: dict[str, Any], backend: str, options: dict[str, Any] | None = None,
                 poll_s: float = 5.0, max_poll_errors: int = 12) -> None:
        super().__init__()
        self.handle = dict(handle)
        self.backend = backend
        self.options = dict(options or {})
        self.poll_s = float(poll_s)
        self.max_poll_errors = int(max_poll_errors)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"handle": self.handle, "backend": self.backend, "options": self.options,
                           "poll_s": self.poll_s, "max_poll_errors": self.max_poll_errors}

    def _launcher(self):  # type: ignore[no-untyped-def]
        from kiln.launchers import get_launcher

        return get_launcher(self.backend, **self.options)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        launcher = self._launcher()
        handle = JobHandle.from_json(self.handle)
        errors = 0
        while True:
            try:
                # The Slurm CLIs and the kubernetes client block: poll in a thread.
                status: JobStatus = await asyncio.to_thread(launcher.poll, handle)
                errors = 0
            except Exception as exc:  # a controller restart or an API hiccup must not fail a long job
                errors += 1
                self.log.warning("polling %s job %s failed (%d/%d): %s", handle.backend, handle.job_id,
                                 errors, self.max_poll_errors, exc)
                if errors >= self.max_poll_errors:
                    yield TriggerEvent({"state": "FAILED", "handle": self.handle, "log_tail": "",
                                        "reason": f"could not poll the job {self.max_poll_errors} times in a row: {exc}"})
                    return
                await asyncio.sleep(self.poll_s)
                continue
            if status.done:
                log_tail = ""
                if status.state != "SUCCEEDED":
                    try:
                        text, _ = await asyncio.to_thread(launcher.logs, handle, 0)
                        log_tail = tail_text(text, 20)
                    except Exception:  # the reason alone still says what happened
                        log_tail = ""
                self.log.info("%s job %s ended: %s %s", handle.backend, handle.job_id, status.state, status.reason)
                yield TriggerEvent({"state": status.state, "reason": status.reason, "handle": self.handle,
                                    "log_tail": log_tail})
                return
            self.log.info("%s job %s: %s %s", handle.backend, handle.job_id, status.state, status.reason)
            await asyncio.sleep(self.poll_s)

    async def on_kill(self) -> None:
        """The user killed the deferred task: never leave the gang running behind it."""
        handle = JobHandle.from_json(self.handle)
        await asyncio.to_thread(self._launcher().cancel, handle)
        self.log.info("cancelled %s job %s", handle.backend, handle.job_id)

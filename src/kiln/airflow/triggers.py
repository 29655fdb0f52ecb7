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

Stragglers: with ``stragglers={"action", "max_excluded", "offset", "excluded"}`` the trigger also
follows the run's ``metrics.jsonl`` (``kiln.launchers.stragglers.StragglerWatch``) on each poll. An
``alert`` is logged here (the trainer's metric, log line and MLflow tag are the alert itself). An
``exclude_node`` action ends the wait early with one event::

    {"state": "STRAGGLER", "node": "node2", "reason": "straggler: rank 1 ... -> policy action: ...",
     "handle": {...}, "stragglers": {... "offset": <read so far>, "excluded": [...]}}

and the task resumes, resubmits the job without the node (``kiln.stages.exclude_straggler``) and
defers again on the new job: the trigger only observes; the task acts, in its own log.

Everything the trigger needs is in its kwargs (JSON-safe: the handle, the backend name and its
options), so any triggerer can rebuild it. This is the one module of ``kiln.launchers`` that
imports Airflow; nothing else imports it at module level.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from kiln.launchers.base import JobHandle, JobStatus, tail_text
from kiln.launchers.stragglers import StragglerPolicy, StragglerWatch

CLASSPATH = "kiln.airflow.triggers.LaunchedJobTrigger"


class LaunchedJobTrigger(BaseTrigger):
    """Polls one submitted job every ``poll_s`` seconds until it ends; yields one event."""

    def __init__(self, *, handle: dict[str, Any], backend: str, options: dict[str, Any] | None = None,
                 poll_s: float = 5.0, max_poll_errors: int = 12, stragglers: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.handle = dict(handle)
        self.backend = backend
        self.options = dict(options or {})
        self.poll_s = float(poll_s)
        self.max_poll_errors = int(max_poll_errors)
        self.stragglers = dict(stragglers) if stragglers else None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"handle": self.handle, "backend": self.backend, "options": self.options,
                           "poll_s": self.poll_s, "max_poll_errors": self.max_poll_errors,
                           "stragglers": self.stragglers}

    def _watch(self, handle: JobHandle) -> StragglerWatch | None:
        if not self.stragglers:
            return None
        policy = StragglerPolicy(action=self.stragglers.get("action", "alert"),
                                 max_excluded=int(self.stragglers.get("max_excluded", StragglerPolicy().max_excluded)))
        return StragglerWatch(run_dir=Path(handle.run_dir), policy=policy, offset=int(self.stragglers.get("offset", 0)),
                              excluded=list(self.stragglers.get("excluded", [])))

    def _launcher(self):
        from kiln.launchers import get_launcher

        return get_launcher(self.backend, **self.options)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        launcher = self._launcher()
        handle = JobHandle.from_json(self.handle)
        watch = self._watch(handle)
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
            if watch is not None:
                for action in await asyncio.to_thread(watch.poll):
                    self.log.warning("%s", action.message)
                    if action.kind == "exclude_node":
                        yield TriggerEvent({
                            "state": "STRAGGLER", "node": action.node, "reason": action.message,
                            "handle": self.handle, "log_tail": "",
                            "stragglers": {**(self.stragglers or {}), "offset": watch.offset,
                                           "excluded": list(watch.excluded)},
                        })
                        return
            await asyncio.sleep(self.poll_s)

    async def on_kill(self) -> None:
        """The user killed the deferred task: never leave the gang running behind it."""
        handle = JobHandle.from_json(self.handle)
        await asyncio.to_thread(self._launcher().cancel, handle)
        self.log.info("cancelled %s job %s", handle.backend, handle.job_id)

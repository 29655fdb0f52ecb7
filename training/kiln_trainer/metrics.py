"""Rank 0's metric sinks: ``metrics.jsonl``, a Prometheus textfile, and (optionally) MLflow.

Each sink has the same tiny interface, ``log(step, record)`` / ``drain()`` / ``close()``. MLflow is used only when
both ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` are set; it is imported lazily, so a run without
them makes no MLflow call at all. The trainer logs into the *existing* run through ``MlflowClient``
(rather than ``mlflow.start_run``) so that it never changes the run's status: the orchestration side
owns the run's lifecycle and keeps logging to it (evaluation, registration) after training.

``metrics.prom`` is written atomically (temporary file, fsync, rename, directory fsync: some
milliseconds a write on a loaded disk) by a thread of its own, ``LatestFileWriter``, so that the
training loop never waits for the disk: the loop renders the text and hands it over; a newer text
replaces one not yet written (the file only ever holds the latest values). ``metrics.jsonl`` stays
on the loop's thread: one ``write`` of a line to the page cache, no fsync, so every record is in the
file (for the straggler watch that follows it) by the time ``log`` returns. ``drain`` waits until
every record logged is on disk (``Session.finish`` drains before ``result.json``, written last of
all); ``close`` drains and stops the thread. A failed background write is raised on the loop's
thread at the next ``log``, ``drain`` or ``close``, as the write itself raised it before.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

from kiln_trainer.checkpoint_manifest import atomic_write_bytes
from kiln_trainer.contract import (
    METRICS_EVENT_KEY,
    MLFLOW_RUN_ID_ENV,
    MLFLOW_TRACKING_URI_ENV,
    PROM_PREFIX,
    PROM_STEP_SERIES,
)
from kiln_trainer.errors import naming_path

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...
    def tag(self, tags: dict[str, str]) -> None: ...
    def drain(self) -> None:
        """Return once every record logged so far is in the run directory."""
    def close(self) -> None: ...


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if _is_number(v) and k != "step"}


def _per_rank(record: dict[str, Any]) -> dict[str, list[float]]:
    """List-valued entries (one number per rank, e.g. ``rank_step_times``)."""
    return {
        k: [float(x) for x in v]
        for k, v in record.items()
        if isinstance(v, list) and v and all(_is_number(x) for x in v)
    }


class JsonlSink:
    """One JSON object per line in ``RUN_DIR/metrics.jsonl`` (appended across resumes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the sink owns it; close() closes it

    def log(self, step: int, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with naming_path(self.path):
            self._fh.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
            self._fh.flush()

    def tag(self, tags: dict[str, str]) -> None:
        pass  # tags reach metrics.jsonl as the events that set them

    def drain(self) -> None:
        pass  # each line is written before log returns

    def close(self) -> None:
        self._fh.close()


class LatestFileWriter:
    """Writes the latest bytes handed to it to ``path`` with ``atomic_write_bytes``, on a thread of
    its own (see the module docstring): ``submit`` returns at once, and bytes submitted while a write
    is under way replace any still waiting, so at most one write waits and memory stays bounded.
    A reader of ``path`` sees the old file or a whole new one, as with a write on the caller's thread.

    A failed write is kept and raised by the next ``submit``, ``drain`` or ``close`` (a later
    ``submit`` tries again, as a later write on the caller's thread would). The thread is a daemon
    (a process that never closes the writer still exits) and is drained at exit (``atexit`` runs
    after the main thread returns, before daemon threads stop); a process killed mid-write leaves
    the previous whole file and at most a stray temporary file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writes = 0
        """Files written (fewer than submits when newer bytes replaced waiting ones)."""
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kiln-metrics-writer:{path.name}", daemon=True)
        self._thread.start()
        self._at_exit = functools.partial(_drain_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    def submit(self, data: bytes) -> None:
        """Write ``data`` soon, in place of anything submitted and not yet written; raises a failed
        earlier write (and then drops ``data``)."""
        with self._cond:
            self._raise_failure()
            if self._closed:
                raise ValueError(f"the writer of {self.path} is closed")
            self._pending = data
            self._cond.notify_all()

    def drain(self) -> None:
        """Return once everything submitted is written; raises a failed write."""
        with self._cond:
            while (self._pending is not None or self._busy) and self._thread.is_alive():
                self._cond.wait(1.0)
            self._raise_failure()

    def close(self) -> None:
        """Write what is waiting and stop the thread; raises a failed write."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        atexit.unregister(self._at_exit)
        with self._cond:
            self._raise_failure()

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return  # closed, and everything written
                data, self._pending, self._busy = self._pending, None, True
            error: BaseException | None = None
            try:
                atomic_write_bytes(self.path, data)
            except BaseException as exc:  # raised on the caller's thread (submit, drain, close)
                error = exc
            with self._cond:
                if error is None:
                    self.writes += 1
                else:
                    self._error = self._error or error
                self._busy = False
                self._cond.notify_all()


def _drain_at_exit(ref: weakref.ref[LatestFileWriter]) -> None:
    writer = ref()
    if writer is not None:
        try:
            writer.drain()
        except Exception as exc:  # the process is ending: say what was not written
            log.warning("%s was not written at exit: %s", writer.path, exc)


class PrometheusTextfileSink:
    """The latest value of every metric as ``RUN_DIR/metrics.prom`` (node_exporter textfile format).

    Records come at different cadences (the log interval; straggler windows every
    ``stragglers.every_steps``), so the file keeps each metric's latest value rather than only the
    last record's. A per-rank list (``rank_step_times``) becomes one series per ``rank`` label.
    The text is rendered on the caller's thread and written atomically by a ``LatestFileWriter``."""

    def __init__(self, path: Path, labels: dict[str, str]) -> None:
        self.path = path
        self._labels = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        self._latest: dict[str, float] = {}
        self._ranks: dict[str, list[float]] = {}
        self.writer = LatestFileWriter(path)

    def log(self, step: int, record: dict[str, Any]) -> None:
        if record.get(METRICS_EVENT_KEY):
            return
        self._latest.update(_numeric(record))
        self._ranks.update(_per_rank(record))
        lines = [f"{PROM_STEP_SERIES}{{{self._labels}}} {step}"]
        for key, value in sorted(self._latest.items()):
            if math.isfinite(value):
                lines.append(f"{PROM_PREFIX}{key}{{{self._labels}}} {value!r}")
        sep = "," if self._labels else ""
        for key, values in sorted(self._ranks.items()):
            for rank, value in enumerate(values):
                if math.isfinite(value):
                    lines.append(f'{PROM_PREFIX}{key}{{{self._labels}{sep}rank="{rank}"}} {value!r}')
        self.writer.submit(("\n".join(lines) + "\n").encode("utf-8"))

    def tag(self, tags: dict[str, str]) -> None:
        pass

    def drain(self) -> None:
        self.writer.drain()

    def close(self) -> None:
        self.writer.close()


class MlflowSink:
    """Metrics to an existing MLflow run in batches (``log_batch``), flushed every ``flush_s`` and at close."""

    def __init__(self, tracking_uri: str, run_id: str, params: dict[str, Any], flush_s: float = 10.0) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id = run_id
        self.flush_s = flush_s
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()
        param_list = [Param(k, str(v)) for k, v in sorted(params.items())]
        # log_batch accepts at most 100 params per call.
        for i in range(0, len(param_list), 100):
            self.client.log_batch(run_id, params=param_list[i : i + 100])

    def log(self, step: int, record: dict[str, Any]) -> None:
        if record.get(METRICS_EVENT_KEY):
            return  # events (rollbacks) live in metrics.jsonl and result.json, not as metric series
        now_ms = int(time.time() * 1000)
        values = _numeric(record)
        for key, per_rank in _per_rank(record).items():
            values.update({f"{key}.rank{rank}": v for rank, v in enumerate(per_rank)})
        for key, value in values.items():
            if math.isfinite(value):
                self._buffer.append(self._Metric(key=key, value=value, timestamp=now_ms, step=step))
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        # log_batch accepts at most 1000 metrics per call.
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self.client.log_batch(self.run_id, metrics=chunk)
        self._last_flush = time.monotonic()

    def tag(self, tags: dict[str, str]) -> None:
        """Run tags (e.g. ``kiln.straggler_rank``) at once: a tag is a finding, not a series to batch."""
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def drain(self) -> None:
        pass  # the tracking server, not the run directory: batched every flush_s, sent at close

    def close(self) -> None:
        self.flush()


def flatten_recipe(recipe: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, table in recipe.items() for key, value in table.items()}


class MetricsHub:
    """Fan-out to every sink; rank 0 only (other ranks get a hub with no sinks)."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, record)

    def tag(self, tags: dict[str, str]) -> None:
        for sink in self.sinks:
            try:
                sink.tag(tags)
            except Exception as exc:  # a tracking-server hiccup must not kill training
                log.warning("could not set tags %s: %s", sorted(tags), exc)

    def drain(self) -> None:
        """Every record logged so far is in the run directory (``metrics.prom`` is written by a
        thread of its own): what ``result.json``, written last of all, must follow."""
        for sink in self.sinks:
            sink.drain()

    def close(self) -> None:
        """Close every sink (each one, even after one fails); raises the first failure."""
        failure: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


def mlflow_target() -> tuple[str, str] | None:
    uri, run_id = os.environ.get(MLFLOW_TRACKING_URI_ENV, ""), os.environ.get(MLFLOW_RUN_ID_ENV, "")
    return (uri, run_id) if uri and run_id else None

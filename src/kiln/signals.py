"""Operational signals: one Prometheus endpoint for everything that tells on-call the factory is sick.

The exporter reads files under ``KILN_HOME`` on every scrape and talks to nothing else (no Airflow,
no MLflow), so it cannot slow a training run or the scheduler down, and a scrape shows exactly what
is on disk::

    RUN/train/metrics.prom                      trainer rank 0, each log interval  -> kiln_train_*{dag,run}
    RUN/quarantine-report.json                  data gate                          -> kiln_quarantine_*{dag,run,snapshot}
    KILN_HOME/signals/queue-events.jsonl        Airflow listener (plugins/)        -> kiln_airflow_queue_latency_seconds
    kiln.policy                                                                    -> kiln_policy_max_quarantine_share

``RUN`` is a run directory of ``kiln.runs``; ``dag``/``run`` are the exact ids its ``run.json``
records (never read back from the directory's name).

Thresholds do not live here: they are Prometheus alert rules (``docker/prometheus/rules/``), each
with an entry in ``docs/runbook.md``. Only the quarantine threshold is exported as a series, because
it differs per policy and must come from ``kiln.policy`` rather than be copied into the rules.

Queue latency is *ready → running* of a task instance's first try: for a task with upstream tasks,
ready is the latest end of those upstream tasks in the same DAG run; for a root task it is the DAG
run's ``run_after`` (the trigger time of a manual run, the due time of a scheduled one). It covers
both waits a user feels — for a pool slot (scheduled) and for an executor slot (queued). Airflow's
own ``task.queued_duration`` timer goes to StatsD only and starts at *queued*, after the pool wait
that causes priority inversion; hence the listener. A latency whose ready time is unknown (an
upstream end was never recorded) is counted in ``kiln_airflow_queue_latency_unknown_total`` rather
than guessed, so a lost event can never page anyone.

Serve it with ``kiln signals serve`` (127.0.0.1:9469 by default; ``/metrics``, ``/healthz``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kiln import runs
from kiln import settings as kiln_settings
from kiln.errors import ConfigError, RunMismatchError
from kiln.policy import POLICIES
from kiln.runs import METRICS_JSONL, METRICS_PROM, QUARANTINE_HTML, QUARANTINE_JSON, RESULT_FILE, TRAIN_SUBDIR
from kiln.util.fs import atomic_write_text, parse_own_json, read_own_json
from kiln_trainer.contract import METRICS_EVENT_KEY, PROM_PREFIX

GPU_UTIL_SERIES = f"{PROM_PREFIX}gpu_util"
BUSY_FRAC_SERIES = f"{PROM_PREFIX}busy_frac"
DATA_WAIT_FRAC_SERIES = f"{PROM_PREFIX}data_wait_frac"
"""The trainer's series (``metrics.prom``) that utilisation is read from."""
TRAIN_UP_SERIES = f"{PROM_PREFIX}up"
TRAIN_METRICS_AGE_SERIES = f"{PROM_PREFIX}metrics_age_seconds"
TRAIN_UTILISATION_SERIES = f"{PROM_PREFIX}utilisation_ratio"
"""kiln's own series about a run, in the trainer's namespace (``PROM_PREFIX``) beside its gauges."""

log = logging.getLogger("kiln.signals")

DEFAULT_PORT = 9469
QUEUE_EVENTS = "queue-events.jsonl"
LATENCY_BUCKETS_S = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
"""Histogram bounds of queue latency; 45 s is a bound so that P99 > 45 s is read without interpolation error."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_TRAINER_LABELS_DROPPED = frozenset({"run_dir"})
"""The trainer labels its textfile with its run dir; the exporter replaces that with dag/run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SignalsConfig:
    """Where the exporter looks and what it still counts as current."""

    home: Path
    """``KILN_HOME``: runs under ``home/runs``, listener output under ``home/signals``."""
    stale_after_s: float = 600.0
    """A training run whose ``metrics.prom`` has not changed for this long is not active (crashed or
    paused agents); its series disappear instead of holding an alert open forever."""
    report_window_s: float = 6 * 3600.0
    """Quarantine reports written within this window are exported; older snapshots are history."""

    def __post_init__(self) -> None:
        if not self.stale_after_s > 0:
            raise ConfigError(f"signals.stale_after_s must be > 0, got {self.stale_after_s}")
        if not self.report_window_s > 0:
            raise ConfigError(f"signals.report_window_s must be > 0, got {self.report_window_s}")

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def signals_dir(self) -> Path:
        return self.home / "signals"

    @property
    def queue_events(self) -> Path:
        return self.signals_dir / QUEUE_EVENTS

    @classmethod
    def from_env(cls) -> SignalsConfig:
        def number(name: str, default: float) -> float:
            raw = os.environ.get(name)
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None

        return cls(
            home=kiln_settings.load().home,
            stale_after_s=number("KILN_SIGNALS_STALE_AFTER_S", 600.0),
            report_window_s=number("KILN_SIGNALS_REPORT_WINDOW_S", 6 * 3600.0),
        )


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def _labels(**labels: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


# ------------------------------------------------------------------------------ textfile parsing
def parse_textfile(text: str) -> tuple[list[Sample], int]:
    """Samples of a Prometheus text-format file, and the number of lines that could not be read.

    Comments and blank lines are skipped; a malformed line is counted, never fatal (a torn or
    hand-edited file must not take the whole endpoint down)."""
    samples, bad = [], 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            bad += 1
            continue
        name, label_text, value_text = m.groups()
        labels: list[tuple[str, str]] = []
        if label_text:
            pos = 0
            ok = True
            while pos < len(label_text):
                lm = _LABEL.match(label_text, pos)
                if not lm or lm.end() == pos:
                    ok = False
                    break
                labels.append((lm.group(1), lm.group(2)))
                pos = lm.end()
            if not ok:
                bad += 1
                continue
        try:
            value = float(value_text)
        except ValueError:
            bad += 1
            continue
        samples.append(Sample(name, tuple(sorted(labels)), value))
    return samples, bad


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_samples(samples: Iterable[Sample], help_text: Mapping[str, tuple[str, str]] | None = None) -> str:
    """Prometheus text format, one ``# HELP``/``# TYPE`` block per metric family, families sorted."""
    help_text = help_text or {}
    families: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        family = s.name
        for suffix in ("_bucket", "_sum", "_count"):
            if s.name.endswith(suffix) and s.name[: -len(suffix)] in help_text:
                family = s.name[: -len(suffix)]
        families[family].append(s)
    out = []
    for family in sorted(families):
        kind, text = help_text.get(family, ("gauge", ""))
        if text:
            out.append(f"# HELP {family} {text}")
        out.append(f"# TYPE {family} {kind}")
        for s in families[family]:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
            out.append(f"{s.name}{{{labels}}} {_fmt_value(s.value)}" if labels else f"{s.name} {_fmt_value(s.value)}")
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------- training
def _labelled_runs(runs_dir: Path) -> tuple[list[tuple[Path, dict[str, str]]], int]:
    """Every run directory with its ``dag``/``run`` labels (from its identity record), and the
    number of directories whose record could not be read."""
    found, bad = [], 0
    for path, identity in runs.iter_run_dirs(runs_dir):
        if isinstance(identity, RunMismatchError):
            bad += 1
            continue
        found.append((path, run_labels(identity)))
    return found, bad


def run_labels(identity: runs.RunIdentity) -> dict[str, str]:
    """``dag``/``run`` labels of a run: Airflow's exact ids."""
    return {"dag": identity.dag_id, "run": identity.run_id}


def utilisation(metrics: Mapping[str, float]) -> float | None:
    """Compute utilisation of a training run: GPU utilisation when the trainer measured it, else the
    busy fraction (time not spent waiting on data or blocked on checkpoints), else ``1 - data wait``."""
    for key in (GPU_UTIL_SERIES, BUSY_FRAC_SERIES):
        if key in metrics:
            value = metrics[key]
            return value / 100.0 if key == GPU_UTIL_SERIES and value > 1.0 else value
    if DATA_WAIT_FRAC_SERIES in metrics:
        return max(0.0, 1.0 - metrics[DATA_WAIT_FRAC_SERIES])
    return None


def training_samples(config: SignalsConfig, now: float) -> tuple[list[Sample], int]:
    """The trainer's textfile of every active run, relabelled ``dag``/``run``, plus derived series."""
    samples: list[Sample] = []
    labelled, bad = _labelled_runs(config.runs_dir)
    for run_path, base in labelled:
        train_dir = run_path / TRAIN_SUBDIR
        prom = train_dir / METRICS_PROM
        try:
            st = prom.stat()
            if (train_dir / RESULT_FILE).exists():
                continue  # finished: its last interval is history, not a live signal
            age = now - st.st_mtime
            if age > config.stale_after_s:
                continue
            text = prom.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        parsed, file_bad = parse_textfile(text)
        bad += file_bad
        latest: dict[str, float] = {}
        for s in parsed:
            labels = {k: v for k, v in s.labels if k not in _TRAINER_LABELS_DROPPED}
            samples.append(Sample(s.name, _labels(**{**labels, **base}), s.value))  # dag/run are ours
            latest.setdefault(s.name, s.value)
        samples.append(Sample(TRAIN_UP_SERIES, _labels(**base), 1.0))
        samples.append(Sample(TRAIN_METRICS_AGE_SERIES, _labels(**base), max(0.0, age)))
        util = utilisation(latest)
        if util is not None:
            samples.append(Sample(TRAIN_UTILISATION_SERIES, _labels(**base), util))
    return samples, bad


# ------------------------------------------------------------------------------------ validation
def quarantine_samples(config: SignalsConfig, now: float) -> tuple[list[Sample], int]:
    """Quarantine rate per snapshot (and run) from recent quarantine reports, and the policy ceilings."""
    samples = [
        Sample("kiln_policy_max_quarantine_share", _labels(policy=p.name, dag=p.dag_id), p.max_quarantine_share)
        for p in POLICIES.values()
    ]
    labelled, bad = _labelled_runs(config.runs_dir)
    for run_path, base in labelled:
        path = run_path / QUARANTINE_JSON
        try:
            if now - path.stat().st_mtime > config.report_window_s:
                continue
            body = read_own_json(path)
            share = float(body["quarantined_share"])
            shards = int(body["shards"])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            bad += 1
            continue
        labels = _labels(**base, snapshot=body.get("snapshot_id", ""))
        samples.append(Sample("kiln_quarantine_share", labels, share))
        samples.append(Sample("kiln_quarantine_shards", labels, shards))
        samples.append(Sample("kiln_quarantine_quarantined_shards", labels, len(body.get("quarantined", []))))
    return samples, bad


# -------------------------------------------------------------------------------- Airflow queues
def queue_event(kind: str, task_instance: Any, now: float | None = None) -> dict[str, Any]:
    """The JSON line the listener appends for a task instance that started (``running``) or ended
    (``finished``). Reads only what the Task SDK's ``RuntimeTaskInstance`` carries (no ORM)."""
    if kind not in ("running", "finished"):
        raise ValueError(f"queue event kind must be 'running' or 'finished', got {kind!r}")
    now = time.time() if now is None else now
    ti = task_instance
    task = getattr(ti, "task", None)
    event: dict[str, Any] = {
        "kind": kind,
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", None) is not None else -1),
        "try_number": int(getattr(ti, "try_number", 1) or 1),
        "at": now,
    }
    if kind == "running":
        dag_run = _dag_run_of(ti)
        start = getattr(ti, "start_date", None)
        event.update(
            {
                "pool": getattr(task, "pool", None) or "default_pool",
                "upstream": sorted(getattr(task, "upstream_task_ids", ()) or ()),
                "start": start.timestamp() if start is not None else now,
                "run_type": _run_type(dag_run),
                "run_after": _ts(getattr(dag_run, "run_after", None)),
                "clear_number": int(getattr(dag_run, "clear_number", 0) or 0),
            }
        )
    else:
        end = getattr(ti, "end_date", None)
        event["end"] = end.timestamp() if end is not None else now
    return event


def _run_type(dag_run: Any) -> str:
    run_type = getattr(dag_run, "run_type", None)  # an enum on the SDK's DagRun, a str in older payloads
    return str(getattr(run_type, "value", run_type) or "")


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None and hasattr(value, "timestamp") else None


def _dag_run_of(ti: Any) -> Any:
    ctx = getattr(ti, "_ti_context_from_server", None)
    if ctx is not None and getattr(ctx, "dag_run", None) is not None:
        return ctx.dag_run
    try:
        return ti.get_template_context().get("dag_run")
    except Exception:  # a TaskInstance from the API server has no runtime context
        return None


def append_queue_event(path: Path, event: Mapping[str, Any]) -> None:
    """One ``write`` of one line with ``O_APPEND``: concurrent task processes never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(event, sort_keys=True, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueLatency:
    dag_id: str
    pool: str
    run_type: str
    task_id: str
    seconds: float
    mapped: bool = False
    """One index of a mapped task: fan-out batches queue behind each other for their pool's slots
    by design (throughput), so alerts about waiting for *reserved* capacity leave them out."""


@dataclass(kw_only=True, slots=True)
class QueueLatencies:
    known: list[QueueLatency] = field(default_factory=list)
    unknown: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(dag, pool, run_type) → first tries whose ready time could not be established."""


def queue_latencies(events: Iterable[Mapping[str, Any]]) -> QueueLatencies:
    """Ready → running latency of every first try (see the module docstring for *ready*).

    Retries and cleared runs are left out: their ready time is a retry delay or a human's click,
    not queueing. Pure: the same events give the same result in any order."""
    ends: dict[tuple[str, str, str], float] = {}
    running: dict[tuple[str, str, str, int], Mapping[str, Any]] = {}
    for e in events:
        key3 = (e["dag_id"], e["run_id"], e["task_id"])
        if e["kind"] == "finished":
            ends[key3] = max(ends.get(key3, float("-inf")), float(e["end"]))
        elif e["kind"] == "running" and int(e.get("try_number", 1)) == 1 and not e.get("clear_number"):
            key4 = (*key3, int(e.get("map_index", -1)))
            # A deferred task (sensor, approval) reports "running" again when it resumes: the first
            # start is the one that ended its queueing.
            if key4 not in running or float(e["start"]) < float(running[key4]["start"]):
                running[key4] = e
    result = QueueLatencies()
    for (dag_id, run_id, task_id, map_index), e in sorted(running.items()):
        group = (dag_id, e.get("pool") or "default_pool", e.get("run_type") or "")
        upstream = e.get("upstream") or []
        if upstream:
            keys = [(dag_id, run_id, u) for u in upstream]
            ready = max(ends[k] for k in keys) if all(k in ends for k in keys) else None
        else:
            ready = e.get("run_after")
        if ready is None:
            result.unknown[group] = result.unknown.get(group, 0) + 1
            continue
        seconds = max(0.0, float(e["start"]) - float(ready))
        result.known.append(QueueLatency(dag_id=dag_id, pool=group[1], run_type=group[2], task_id=task_id, seconds=seconds,
                                         mapped=map_index >= 0))
    return result


def read_queue_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events of the listener's file, and the number of unreadable lines (a torn last line while a
    task is appending is counted, not fatal)."""
    events, bad = [], 0
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            e = parse_own_json(line, "an event line")
            if e.get("kind") in ("running", "finished") and all(k in e for k in ("dag_id", "run_id", "task_id")):
                events.append(e)
                continue
        except ValueError:
            pass
        bad += 1
    return events, bad


def queue_samples(config: SignalsConfig) -> tuple[list[Sample], int]:
    """Queue latency as a cumulative histogram per DAG, pool, run type and ``mapped`` (``"true"``
    for the indexes of a mapped task; P99 is computed by Prometheus with ``histogram_quantile``),
    and the count of latencies that could not be known."""
    events, bad = read_queue_events(config.queue_events)
    lat = queue_latencies(events)
    groups: dict[tuple[str, str, str, bool], list[float]] = defaultdict(list)
    for q in lat.known:
        groups[(q.dag_id, q.pool, q.run_type, q.mapped)].append(q.seconds)
    name = "kiln_airflow_queue_latency_seconds"
    samples: list[Sample] = []
    for (dag, pool, run_type, mapped), values in sorted(groups.items()):
        group = {"dag": dag, "pool": pool, "run_type": run_type, "mapped": str(mapped).lower()}
        for bound in (*LATENCY_BUCKETS_S, math.inf):
            samples.append(Sample(f"{name}_bucket", _labels(**group, le=_fmt_value(bound)), sum(v <= bound for v in values)))
        samples.append(Sample(f"{name}_sum", _labels(**group), sum(values)))
        samples.append(Sample(f"{name}_count", _labels(**group), len(values)))
    for (dag, pool, run_type), n in sorted(lat.unknown.items()):
        samples.append(Sample("kiln_airflow_queue_latency_unknown_total", _labels(dag=dag, pool=pool, run_type=run_type), n))
    return samples, bad


# -------------------------------------------------------------------------------------- endpoint
HELP: dict[str, tuple[str, str]] = {
    TRAIN_UP_SERIES: ("gauge", "1 for every active training run (metrics.prom fresh, no result.json)"),
    TRAIN_METRICS_AGE_SERIES: ("gauge", "seconds since the run's metrics.prom was last written"),
    TRAIN_UTILISATION_SERIES: ("gauge", "GPU utilisation, else busy fraction, else 1 - data-loader wait"),
    f"{PROM_PREFIX}checkpoint_lag_steps": ("gauge", "steps since the last committed checkpoint"),
    "kiln_quarantine_share": ("gauge", "quarantined share of a snapshot's shards"),
    "kiln_policy_max_quarantine_share": ("gauge", "kiln.policy data-gate ceiling on the quarantined share"),
    "kiln_airflow_queue_latency_seconds": ("histogram", "ready -> running of first tries, per DAG, pool, run type, mapped"),
    "kiln_airflow_queue_latency_unknown_total": ("counter", "first tries whose ready time was not recorded"),
    "kiln_signals_parse_errors": ("gauge", "unreadable lines/files in the last scrape, per source"),
}


def collect(config: SignalsConfig, now: float | None = None) -> list[Sample]:
    now = time.time() if now is None else now
    samples: list[Sample] = []
    for source, fn in (
        ("training", lambda: training_samples(config, now)),
        ("quarantine", lambda: quarantine_samples(config, now)),
        ("queue", lambda: queue_samples(config)),
    ):
        part, bad = fn()
        samples.extend(part)
        samples.append(Sample("kiln_signals_parse_errors", _labels(source=source), bad))
    return samples


def render(config: SignalsConfig, now: float | None = None) -> str:
    return render_samples(collect(config, now), HELP)


def make_server(config: SignalsConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> ThreadingHTTPServer:
    """An HTTP server with ``/metrics`` and ``/healthz``; ``port=0`` picks a free port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name is http.server's API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                try:
                    body, status = render(config).encode(), 200
                except Exception as exc:  # a scrape error must show up as up==0 upstream, not kill the server
                    log.exception("scrape failed")
                    body, status = f"scrape failed: {exc}\n".encode(), 500
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            elif path == "/healthz":
                body, status, ctype = b"ok\n", 200, "text/plain"
            else:
                body, status, ctype = b"not found: try /metrics\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)  # noqa: G003 - http.server's format and args, formatted lazily

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(config: SignalsConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start the exporter in a daemon thread (tests, embedding); returns the server and its URL."""
    server = make_server(config, host, port)
    threading.Thread(target=server.serve_forever, name="kiln-signals", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


def write_snapshot(config: SignalsConfig, path: Path) -> Path:
    """The current exposition as a textfile (node_exporter textfile collector, or a bug report)."""
    return atomic_write_text(path, render(config))


# -------------------------------------------------------------------------------------- run view
def run_directory(config: SignalsConfig, dag_id: str, run_id: str) -> Path:
    """The run directory of ``dag_id``/``run_id`` (``kiln.runs``); a ``ConfigError`` for ids that name
    none, a ``RunMismatchError`` when the directory there records another run. Writes nothing."""
    identity = runs.RunIdentity(dag_id, run_id)
    return runs.existing_run_dir(identity, config.runs_dir) or runs.run_dir_path(identity, config.runs_dir)


def mlflow_run_url(mlflow_uri: str, dag_id: str, run_id: str, timeout: float = 3.0) -> str | None:
    """The MLflow UI address of a DAG run's MLflow run (found by its ``kiln.run_key`` tag), or None.

    Plain REST calls (no mlflow import in the Airflow api-server); any failure is None, because a
    missing link must not break the page that explains the run (``kiln.links.find_mlflow_run``)."""
    from kiln.links import find_mlflow_run

    run = find_mlflow_run(None, dag_id, run_id, mlflow_uri=mlflow_uri, timeout=timeout)
    return run.url() if run else None


def _last_jsonl_record(path: Path, max_bytes: int = 65536) -> dict[str, Any] | None:
    """The last complete line of a (possibly large, possibly being appended) JSONL file."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = parse_own_json(line, "a metrics line")
        except ValueError:
            continue
        if isinstance(record, dict) and not record.get(METRICS_EVENT_KEY):
            return record
    return None


def run_view(config: SignalsConfig, dag_id: str, run_id: str) -> dict[str, Any]:
    """What on-call wants next to a DAG run: its quarantine report and its training metrics (files
    that exist, with the numbers that matter). JSON-safe; the MLflow link is looked up separately."""
    root = run_directory(config, dag_id, run_id)
    report = root / QUARANTINE_JSON
    quarantine: dict[str, Any] = {"json": str(report) if report.is_file() else None}
    html = root / QUARANTINE_HTML
    quarantine["html"] = str(html) if html.is_file() else None
    if report.is_file():
        try:
            body = read_own_json(report)
            quarantine.update(share=body.get("quarantined_share"), snapshot=body.get("snapshot_id"),
                              gate=body.get("gate"), shards=body.get("shards"))
        except ValueError:
            quarantine["error"] = "unreadable report"
    train = root / TRAIN_SUBDIR
    jsonl = train / METRICS_JSONL
    training = {
        "run_dir": str(train) if train.is_dir() else None,
        "metrics_jsonl": str(jsonl) if jsonl.is_file() else None,
        "finished": (train / RESULT_FILE).is_file(),
        "last": _last_jsonl_record(jsonl),
    }
    return {"dag_id": dag_id, "run_id": run_id, "run_dir": str(root), "quarantine": quarantine, "training": training}

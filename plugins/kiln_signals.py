"""kiln's Airflow plugin: a task-instance listener that records queue latency for the exporter.

Every task process (the Task SDK runner calls the listener hooks there) appends one JSON line per
event to ``$KILN_HOME/signals/queue-events.jsonl``: ``running`` (with the task's pool, its upstream
task ids, the DAG run's ``run_after`` and run type) and ``finished`` (success or failure, with the
end time). ``kiln signals serve`` turns them into the ``kiln_airflow_queue_latency_seconds``
histogram per DAG, pool and run type (see ``kiln.signals`` for how *ready* is defined).

A listener runs inside the task: it never raises (a metrics fault must not fail training) and
imports nothing heavy (``kiln.signals`` is standard library plus kiln's settings).

The same plugin adds a "kiln run" view to every DAG run in the Airflow UI (``external_views``,
destination ``dag_run``): a page served by the api-server under ``/kiln/runs/<dag>/<run>`` that
links the run's MLflow run, its quarantine report (HTML, served from the run directory) and its
training metrics (last interval, ``metrics.jsonl``). The FastAPI app is built on the first request,
so task processes that load this plugin for the listener never import FastAPI. Like every plugin
app it is not behind Airflow's login: it shows only what the run directory already holds (reports
are redacted when written), and the embedded stack binds 127.0.0.1.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.listeners import hookimpl
from airflow.plugins_manager import AirflowPlugin

log = logging.getLogger(__name__)


def _record(kind: str, task_instance: Any) -> None:
    try:
        from kiln.signals import SignalsConfig, append_queue_event, queue_event

        append_queue_event(SignalsConfig.from_env().queue_events, queue_event(kind, task_instance))
    except Exception:  # never let a signal fail the task it describes
        log.warning("kiln_signals: could not record %s event", kind, exc_info=True)


class QueueLatencyListener:
    """Hook implementations (Airflow 3 listener API, ``airflow.listeners.hookimpl``)."""

    @hookimpl
    def on_task_instance_running(self, previous_state: Any, task_instance: Any) -> None:
        _record("running", task_instance)

    @hookimpl
    def on_task_instance_success(self, previous_state: Any, task_instance: Any) -> None:
        _record("finished", task_instance)

    @hookimpl
    def on_task_instance_failed(self, previous_state: Any, task_instance: Any, error: Any) -> None:
        _record("finished", task_instance)

    @hookimpl
    def on_task_instance_skipped(self, previous_state: Any, task_instance: Any) -> None:
        _record("finished", task_instance)


RUN_VIEW_PREFIX = "/kiln"


def build_run_view_app() -> Any:
    """The FastAPI app behind the "kiln run" view (see the module docstring)."""
    from html import escape
    from urllib.parse import quote

    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse

    from kiln import settings as kiln_settings
    from kiln.errors import KilnError
    from kiln.runs import QUARANTINE_HTML
    from kiln.signals import SignalsConfig, mlflow_run_url, run_view

    app = FastAPI(title="kiln run view", docs_url=None, redoc_url=None, openapi_url=None)

    def _view(dag_id: str, run_id: str) -> dict[str, Any]:
        """What the run's directory holds (``kiln.signals.run_view``); 404 for ids that name no run."""
        try:
            return run_view(SignalsConfig.from_env(), dag_id, run_id)
        except KilnError as exc:  # ids that name no run directory, or one that records another run
            raise HTTPException(status_code=404, detail=str(exc)) from exc

    @app.get("/runs/{dag_id}/{run_id}/" + QUARANTINE_HTML)
    def quarantine_html(dag_id: str, run_id: str) -> Any:
        path = _view(dag_id, run_id)["quarantine"]["html"]
        if path is None:
            raise HTTPException(status_code=404, detail="no quarantine report for this run (yet)")
        return FileResponse(path, media_type="text/html")

    @app.get("/runs/{dag_id}/{run_id}/metrics.jsonl")
    def metrics_jsonl(dag_id: str, run_id: str) -> Any:
        path = _view(dag_id, run_id)["training"]["metrics_jsonl"]
        if path is None:
            raise HTTPException(status_code=404, detail="no training metrics for this run (yet)")
        return FileResponse(path, media_type="text/plain")

    @app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def page(dag_id: str, run_id: str) -> str:
        view = _view(dag_id, run_id)
        mlflow = mlflow_run_url(kiln_settings.load().mlflow_uri, dag_id, run_id)
        here = escape(f"{RUN_VIEW_PREFIX}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}")
        q, t = view["quarantine"], view["training"]
        rows = [
            ("MLflow run", f"<a href='{escape(mlflow)}' target='_blank'>{escape(mlflow)}</a>" if mlflow else "not found (yet)"),
            ("Quarantine report",
             f"<a href='{here}/{QUARANTINE_HTML}'>HTML</a> · share {q.get('share')} · gate {escape(str(q.get('gate')))}"
             f" · snapshot <code>{escape(str(q.get('snapshot')))}</code>" if q["html"] else "not written (yet)"),
            ("Training metrics",
             f"<a href='{here}/metrics.jsonl'>metrics.jsonl</a> · {'finished' if t['finished'] else 'running or stopped'}"
             if t["metrics_jsonl"] else "no training metrics (yet)"),
        ]
        last = t["last"] or {}
        metrics = "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in sorted(last.items()))
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>kiln run</title>"
            "<style>body{font-family:sans-serif;margin:1.5em}td{padding:3px 10px;border-bottom:1px solid #ddd}</style>"
            f"</head><body><h2>kiln run <code>{escape(dag_id)}/{escape(run_id)}</code></h2><table>"
            + "".join(f"<tr><th align='left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
            + "</table>"
            + (f"<h3>Last training interval</h3><table>{metrics}</table>" if metrics else "")
            + "</body></html>"
        )

    return app


class _LazyApp:
    """An ASGI app that builds the real one on its first request."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            self._app = build_run_view_app()
        await self._app(scope, receive, send)


class KilnSignalsPlugin(AirflowPlugin):
    name = "kiln_signals"
    listeners = [QueueLatencyListener()]
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": RUN_VIEW_PREFIX, "name": "kiln run view"}]
    external_views = [
        {
            "name": "kiln run",
            "href": RUN_VIEW_PREFIX + "/runs/{DAG_ID}/{RUN_ID}",
            "destination": "dag_run",
            "url_route": "kiln_run",
        }
    ]

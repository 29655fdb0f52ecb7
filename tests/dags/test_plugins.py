"""The plugins folder loads in Airflow without import errors, and the kiln_signals listener is
registered on both listener managers (core and Task SDK) and records what a task reports.

Runs in a subprocess: Airflow caches plugins and listener managers per process, and the plugins
folder must be set before Airflow reads its configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"

PROBE = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from airflow import plugins_manager
from airflow.listeners.listener import get_listener_manager as core_manager
from airflow.sdk.listener import get_listener_manager as sdk_manager

plugins, errors = plugins_manager._get_plugins()
out = {"errors": {k: str(v) for k, v in errors.items()}, "plugins": sorted(p.name for p in plugins)}
core, sdk = core_manager(), sdk_manager()  # pluggy validates hookimpl signatures against the specs here
out["core_has_listeners"] = core.has_listeners
out["sdk_has_listeners"] = sdk.has_listeners
views, _react = plugins_manager._get_ui_plugins()
apps, _middlewares = plugins_manager.get_fastapi_plugins()
out["external_views"] = [(v["name"], v["href"], v["destination"]) for v in views]
out["fastapi_prefixes"] = [a["url_prefix"] for a in apps]

t = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
dag_run = SimpleNamespace(run_type=SimpleNamespace(value="manual"), run_after=t, clear_number=0)
ti = SimpleNamespace(
    dag_id="kiln_sandbox", run_id="manual__1", task_id="snapshot", map_index=-1, try_number=1,
    start_date=t + timedelta(seconds=7), end_date=t + timedelta(seconds=20),
    task=SimpleNamespace(pool="kiln_sandbox", upstream_task_ids=set()),
    _ti_context_from_server=SimpleNamespace(dag_run=dag_run),
)
sdk.hook.on_task_instance_running(previous_state=None, task_instance=ti)
sdk.hook.on_task_instance_success(previous_state=None, task_instance=ti)
sdk.hook.on_task_instance_running(previous_state=None, task_instance=object())  # must not raise
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    home = tmp_path_factory.mktemp("kiln-home")
    env = {
        **os.environ,
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "KILN_HOME": str(home),
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), home


def test_plugins_folder_loads_without_import_errors(probe):
    out, _ = probe
    assert out["errors"] == {}
    assert "kiln_signals" in out["plugins"]


def test_listener_is_registered_on_core_and_task_sdk_managers(probe):
    out, _ = probe
    assert out["core_has_listeners"] and out["sdk_has_listeners"]


def test_dag_run_view_is_offered_in_the_ui(probe):
    out, _ = probe
    assert ["kiln run", "/kiln/runs/{DAG_ID}/{RUN_ID}", "dag_run"] in out["external_views"]
    assert "/kiln" in out["fastapi_prefixes"]


def test_listener_records_queue_latency_events(probe):
    from kiln.signals import SignalsConfig, queue_latencies, read_queue_events

    _, home = probe
    events, bad = read_queue_events(SignalsConfig(home=home).queue_events)
    assert bad == 0
    assert [e["kind"] for e in events] == ["running", "finished"], "a broken task instance records nothing"
    (latency,) = queue_latencies(events).known
    assert (latency.dag_id, latency.pool, latency.run_type, latency.seconds) == ("kiln_sandbox", "kiln_sandbox", "manual", 7.0)


# ------------------------------------------------------------------------------ the run view app
@pytest.fixture
def run_view_client(tmp_path, monkeypatch):
    import importlib.util

    from fastapi.testclient import TestClient

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: the link is "not found"
    spec = importlib.util.spec_from_file_location("kiln_signals_plugin_under_test", PLUGINS / "kiln_signals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return TestClient(module.build_run_view_app()), tmp_path / "runs"


def test_run_view_links_quarantine_report_and_training_metrics(run_view_client):
    from kiln.runs import run_dir

    client, runs = run_view_client
    run = run_dir("kiln_sandbox/manual__2026-11-29T12:00:00+00:00", runs)  # as the data gate makes it
    (run / "train").mkdir(parents=True)
    (run / "quarantine-report.json").write_text(
        json.dumps({"quarantined_share": 0.125, "snapshot_id": "abc.dir", "gate": "pass"})
    )
    (run / "quarantine-report.html").write_text("<html>report</html>")
    (run / "train" / "metrics.jsonl").write_text(
        '{"step": 20, "loss": 2.5, "checkpoint_lag_steps": 20}\n{"step": 20, "event": "rollback"}\n{"step": 40, "lo'
    )
    page = client.get("/runs/kiln_sandbox/manual__2026-11-29T12:00:00+00:00")  # the real run id, as the UI sends it
    assert page.status_code == 200
    assert "quarantine-report.html" in page.text and "share 0.125" in page.text and "abc.dir" in page.text
    assert "checkpoint_lag_steps" in page.text and "running or stopped" in page.text
    assert "MLflow run</th><td>not found (yet)" in page.text
    report = client.get("/runs/kiln_sandbox/manual__2026-11-29T12:00:00+00:00/quarantine-report.html")
    assert report.text == "<html>report</html>"
    assert client.get("/runs/kiln_sandbox/manual__2026-11-29T12:00:00+00:00/metrics.jsonl").status_code == 200


def test_run_view_of_one_run_never_shows_another_runs_report(run_view_client):
    from kiln.runs import run_dir

    client, _ = run_view_client
    for run_id in ("probe:col", "probe_col"):  # the directory the pipeline writes each run's report into
        home = run_dir(f"kiln_sandbox/{run_id}")
        home.mkdir(parents=True, exist_ok=True)
        (home / "quarantine-report.html").write_text(f"<html>{run_id}</html>")
    assert client.get("/runs/kiln_sandbox/probe:col/quarantine-report.html").text == "<html>probe:col</html>"
    assert client.get("/runs/kiln_sandbox/probe_col/quarantine-report.html").text == "<html>probe_col</html>"
    missing = client.get("/runs/kiln_sandbox/probe+col/quarantine-report.html")
    assert missing.status_code == 404 and "no quarantine report" in missing.text


def test_run_view_refuses_paths_outside_the_runs_directory(run_view_client):
    client, runs = run_view_client
    runs.mkdir(parents=True)
    assert client.get("/runs/../..").status_code == 404
    assert client.get("/runs/..%2F..%2Fetc/passwd/quarantine-report.html").status_code == 404
    missing = client.get("/runs/kiln_sandbox/never/quarantine-report.html")
    assert missing.status_code == 404 and "no quarantine report" in missing.text

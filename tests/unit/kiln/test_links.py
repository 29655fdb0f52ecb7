"""kiln.links without servers: plugin URLs from the configured Airflow URL, links from XCom, and
"" (never an exception) when MLflow cannot be reached."""

from __future__ import annotations

import pytest

from kiln import links


def test_plugin_urls_use_the_configured_airflow_url_and_quote_the_run_id(monkeypatch):
    monkeypatch.setenv("KILN_AIRFLOW_URL", "http://airflow.example:8080/")
    url = links.quarantine_report_url("kiln_sandbox", "manual__2026-11-29T12:00:00+00:00")
    assert url == "http://airflow.example:8080/kiln/runs/kiln_sandbox/manual__2026-11-29T12%3A00%3A00%2B00%3A00/quarantine-report.html"


def test_model_version_link_comes_from_the_tasks_xcom(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    xcom = {"register_candidate": {"model_name": "kiln-stdlib-lm.candidates", "version": "3"}}.get
    url = links.link_url("model_version", dag_id="kiln_production", run_id="r", task_id="register_candidate", xcom=xcom)
    assert url == "http://mlflow.example:5000/#/models/kiln-stdlib-lm.candidates/versions/3"
    assert links.link_url("model_version", dag_id="kiln_production", run_id="r", task_id="register_candidate",
                          xcom=lambda _: None) == ""


def test_unreachable_mlflow_gives_an_empty_link_not_an_error(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens
    xcom = {"train": {"mlflow_run_id": "abc"}}.get
    for kind in ("mlflow_run", "training_metrics", "evaluation_report"):
        assert links.safe_link_url(kind, dag_id="kiln_sandbox", run_id="r", task_id="train", xcom=xcom) == ""


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown link kind 'mlfow_run'"):
        links.link_url("mlfow_run", dag_id="d", run_id="r", task_id="t", xcom=lambda _: None)


def test_mlflow_run_tabs():
    run = links.MlflowRun("http://m:5000", "7", "abc")
    assert run.url("model-metrics") == "http://m:5000/#/experiments/7/runs/abc/model-metrics"
    assert run.artifact_url(links.QUARANTINE_ARTIFACT) == "http://m:5000/#/experiments/7/runs/abc/artifacts/quarantine/quarantine-report.html"


def test_a_run_id_mlflow_cannot_search_for_finds_no_run_rather_than_another(monkeypatch):
    """The filter grammar has no escape for quotes: a key with one must find nothing, never the
    run of the key with the quote dropped (``it's`` is not ``its``)."""
    import requests

    searched = []

    class Resp:
        status_code = 200

        def __init__(self, body):
            self._body = body

        def json(self):
            return self._body

    monkeypatch.setattr(requests, "get", lambda *a, **k: Resp({"experiment": {"experiment_id": "7"}}))
    monkeypatch.setattr(requests, "post", lambda url, json, **k: searched.append(json["filter"]) or Resp(
        {"runs": [{"info": {"run_id": "someone-elses"}}]}))
    assert links.find_mlflow_run(None, "kiln_sandbox", "it's", mlflow_uri="http://m:5000") is None
    assert searched == []
    found = links.find_mlflow_run(None, "kiln_sandbox", "its", mlflow_uri="http://m:5000")
    assert found is not None and searched == ["tags.`kiln.run_key` = 'kiln_sandbox/its'"]

"""The Airflow UI's extra links of a real DAG run, read back through the api-server's links endpoint
(what the UI's task page calls), and followed: the quarantine report the plugin serves, the MLflow
run, its metrics and artifacts, the model version. Hosts come from the stack's configuration."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

RUN_PAGE = re.compile(r"^#/experiments/(?P<exp>[^/]+)/runs/(?P<run>[^/]+)(?:/(?P<tab>.*))?$")


def _mlflow_run_of(url: str, mlflow: str) -> tuple[str, str, str]:
    """(experiment id, run id, tab) of an MLflow UI run link, after checking that it is on our server
    and that the run exists there in that experiment (the fragment never reaches the server)."""
    assert url.startswith(mlflow + "/#/"), url
    m = RUN_PAGE.match("#" + urlsplit(url).fragment)
    assert m, url
    run = requests.get(f"{mlflow}/api/2.0/mlflow/runs/get", params={"run_id": m["run"]}, timeout=10)
    assert run.status_code == 200, run.text
    assert run.json()["run"]["info"]["experiment_id"] == m["exp"]
    return m["exp"], m["run"], m["tab"] or ""


def _artifact(mlflow: str, run_id: str, path: str) -> str:
    resp = requests.get(f"{mlflow}/get-artifact", params={"path": path, "run_uuid": run_id}, timeout=10)
    assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
    return resp.text


def test_task_links_lead_to_the_quarantine_report_mlflow_run_and_metrics(stack, admin, llama_sandbox_run):
    """On the package's shared sandbox run (``llama_sandbox_run``: a team's own trainer; the links
    are the DAG's, whichever trainer trains)."""
    from kiln.policy import SANDBOX

    dag, run_id, poisoned = SANDBOX.dag_id, llama_sandbox_run["run_id"], llama_sandbox_run["poisoned"]

    def links(task_id: str, map_index: int = -1) -> dict[str, str | None]:
        body = admin.request("GET", f"/dags/{dag}/dagRuns/{run_id}/taskInstances/{task_id}/links",
                             params={"map_index": map_index})
        return body["extra_links"]

    airflow, mlflow = stack["airflow"], stack["mlflow"]
    gate = admin.xcom(dag, run_id, "data_gate")

    # Quarantine report: validate_shards (each mapped batch) and data_gate, served by the plugin.
    report_url = links("validate_shards", 0)["Quarantine report"]
    assert report_url and report_url.startswith(f"{airflow}/kiln/runs/{dag}/"), report_url
    page = requests.get(report_url, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == Path(gate["report_html"]).read_text() and poisoned in page.text
    gate_links = links("data_gate")
    assert gate_links["Quarantine report"] == report_url

    # The MLflow run of the DAG run (the data gate creates it; training logs into it).
    exp, mlflow_run, tab = _mlflow_run_of(gate_links["MLflow run"], mlflow)
    assert mlflow_run == gate["mlflow_run_id"] and tab == ""
    _, same, tab = _mlflow_run_of(gate_links["Quarantine report (MLflow)"], mlflow)
    assert same == mlflow_run and tab == "artifacts/quarantine/quarantine-report.html"
    assert poisoned in _artifact(mlflow, mlflow_run, "quarantine/quarantine-report.html")
    assert requests.get(f"{mlflow}/", timeout=10).status_code == 200, "the MLflow UI the fragments open in"

    train_links = links("train")
    assert _mlflow_run_of(train_links["MLflow run"], mlflow)[1] == admin.xcom(dag, run_id, "train")["mlflow_run_id"] == mlflow_run
    _, same, tab = _mlflow_run_of(train_links["Training metrics"], mlflow)
    assert (same, tab) == (mlflow_run, "model-metrics")
    metrics = requests.get(f"{mlflow}/api/2.0/mlflow/runs/get", params={"run_id": mlflow_run}, timeout=10).json()
    assert "loss" in {m["key"] for m in metrics["run"]["data"]["metrics"]}, "the metrics page has the training loss"
    view = requests.get(train_links["kiln run view"], timeout=10)
    assert view.status_code == 200 and "Training metrics" in view.text and mlflow_run in view.text

    assert links("evaluate")["MLflow run"] == train_links["MLflow run"]

    candidate = admin.xcom(dag, run_id, "register_candidate")
    reg_links = links("register_candidate")
    assert reg_links["Model version"] == f"{mlflow}/#/models/{candidate['model_name']}/versions/{candidate['version']}"
    version = requests.get(f"{mlflow}/api/2.0/mlflow/model-versions/get",
                           params={"name": candidate["model_name"], "version": candidate["version"]}, timeout=10)
    assert version.status_code == 200 and version.json()["model_version"]["run_id"] == mlflow_run
    _, same, tab = _mlflow_run_of(reg_links["Evaluation report"], mlflow)
    assert (same, tab) == (mlflow_run, "artifacts/evaluation/report.html")
    assert "<html" in _artifact(mlflow, mlflow_run, "evaluation/report.html").lower()

    assert links("snapshot") == {}, "tasks without links show none"

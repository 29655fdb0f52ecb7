"""Where the Airflow UI's extra links of a kiln task point, computed from the run's XCom and state.

Airflow 3 computes an operator's extra links *in the task process* when the task ends (success or
failure) and stores each as an XCom ``_link_kiln_<kind>``; the api-server only reads them back
(``GET /api/v2/dags/{dag}/dagRuns/{run}/taskInstances/{task}/links``). The link classes are in the
one Airflow adapter, ``kiln.airflow.dagfactory``; they call :func:`link_url` here. No Airflow import here.

Hosts are never hard-coded: MLflow links use the configured MLflow URL (``MLFLOW_TRACKING_URI``,
``kiln.settings``), links into the ``kiln_signals`` plugin (quarantine report, run view) the
configured Airflow URL (``KILN_AIRFLOW_URL``). Which run they name comes from XCom (the MLflow run
id the data gate / train stage returned, the model version register_candidate returned) and, when a
task failed before returning one, from run state (the MLflow run tagged ``kiln.run_key``; the run
directory the plugin serves). A link that cannot be resolved is ``""`` (Airflow shows it disabled):
a lookup fault must never fail the task it describes.

Links per task (``TASK_LINKS``)::

    validate_shards     Quarantine report                       (plugin: the run's HTML report)
    data_gate           Quarantine report, Quarantine report (MLflow), MLflow run
    train               MLflow run, Training metrics, kiln run view
    evaluate            MLflow run, Training metrics
    register_candidate  MLflow run, Model version, Evaluation report
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kiln import runs
from kiln import settings as kiln_settings
from kiln.errors import ConfigError

log = logging.getLogger("kiln.links")

RUN_VIEW_PREFIX = "/kiln"
"""Where ``plugins/kiln_signals.py`` mounts its run view app on the api-server."""
QUARANTINE_ARTIFACT = f"{runs.QUARANTINE_ARTIFACT_DIR}/{runs.QUARANTINE_HTML}"
"""Where the data gate logs the HTML quarantine report in the run's MLflow run."""
EVALUATION_ARTIFACT = "evaluation/report.html"
"""== ``kiln.registry.REPORT_DIR`` + ``report.html``."""

LINK_NAMES: dict[str, str] = {
    "quarantine_report": "Quarantine report",
    "quarantine_report_mlflow": "Quarantine report (MLflow)",
    "mlflow_run": "MLflow run",
    "training_metrics": "Training metrics",
    "run_view": "kiln run view",
    "model_version": "Model version",
    "evaluation_report": "Evaluation report",
}
"""Link kind → the button's name in the Airflow UI (and the key of the links endpoint's answer)."""

TASK_LINKS: dict[str, tuple[str, ...]] = {
    "validate_shards": ("quarantine_report",),
    "data_gate": ("quarantine_report", "quarantine_report_mlflow", "mlflow_run"),
    "train": ("mlflow_run", "training_metrics", "run_view"),
    "evaluate": ("mlflow_run", "training_metrics"),
    "register_candidate": ("mlflow_run", "model_version", "evaluation_report"),
}

XComPull = Callable[[str], Any]
"""``xcom(task_id)`` → that task's return value in the same DAG run (None when there is none)."""


def _airflow(airflow_url: str | None) -> str:
    return (airflow_url or kiln_settings.load().airflow_url).rstrip("/")


def run_view_url(dag_id: str, run_id: str, airflow_url: str | None = None) -> str:
    """The ``kiln run`` page of a DAG run (plugin view: MLflow run, quarantine report, metrics)."""
    return f"{_airflow(airflow_url)}{RUN_VIEW_PREFIX}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def quarantine_report_url(dag_id: str, run_id: str, airflow_url: str | None = None) -> str:
    """The run's quarantine report (HTML) as the plugin serves it from the run directory. It exists
    once the data gate has run (404 "no quarantine report for this run (yet)" before)."""
    return f"{run_view_url(dag_id, run_id, airflow_url)}/{runs.QUARANTINE_HTML}"


@dataclass(frozen=True, slots=True)
class MlflowRun:
    """An MLflow run and where its UI lives."""

    base: str
    experiment_id: str
    run_id: str

    def url(self, tab: str | None = None) -> str:
        """The run page (``tab``: ``model-metrics``, ``artifacts/<path>``, …) of MLflow's UI."""
        page = f"{self.base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{page}/{tab}" if tab else page

    def artifact_url(self, path: str) -> str:
        return self.url(f"artifacts/{path}")


def _mlflow_base(mlflow_uri: str | None) -> str:
    return (mlflow_uri or kiln_settings.load().mlflow_uri).rstrip("/")


def find_mlflow_run(
    mlflow_run_id: str | None, dag_id: str, run_id: str, *, mlflow_uri: str | None = None, timeout: float = 5.0
) -> MlflowRun | None:
    """The MLflow run of a DAG run: by id when XCom gave one, else by its ``kiln.run_key`` tag in
    the experiment of the DAG's policy. Plain REST (no mlflow import); None on any failure."""
    import requests

    from kiln.policy import POLICIES

    base = _mlflow_base(mlflow_uri)
    # The identity the task acts as (kiln.mlflow_auth.use_identity), when the server has basic-auth.
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    auth = (user, password or "") if user else None
    try:
        if mlflow_run_id:
            resp = requests.get(f"{base}/api/2.0/mlflow/runs/get", params={"run_id": mlflow_run_id}, timeout=timeout,
                                auth=auth)
            if resp.status_code != 200:
                return None
            info = resp.json()["run"]["info"]
            return MlflowRun(base, str(info["experiment_id"]), str(info["run_id"]))
        policy = next((p for p in POLICIES.values() if p.dag_id == dag_id), None)
        if policy is None:
            return None
        exp = requests.get(f"{base}/api/2.0/mlflow/experiments/get-by-name",
                           params={"experiment_name": runs.experiment_name(policy)}, timeout=timeout, auth=auth)
        if exp.status_code != 200:
            return None
        exp_id = str(exp.json()["experiment"]["experiment_id"])
        # Never an altered key (a quote dropped): that would name another run's MLflow run.
        found = requests.post(f"{base}/api/2.0/mlflow/runs/search", timeout=timeout, auth=auth, json={
            "experiment_ids": [exp_id], "filter": runs.run_key_filter(runs.run_key(dag_id, run_id)), "max_results": 1})
        hits = found.json().get("runs", []) if found.status_code == 200 else []
    except (requests.RequestException, ValueError, KeyError, TypeError, ConfigError):
        return None
    return MlflowRun(base, exp_id, str(hits[0]["info"]["run_id"])) if hits else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _mlflow_run_id_from_xcom(task_id: str, xcom: XComPull) -> str | None:
    """The MLflow run id a stage handed on: train's TrainResult, register_candidate's version
    (the run the model was logged into), else the data gate's (the run training logs into)."""
    own = _dict(xcom(task_id)) if task_id in ("train", "register_candidate", "data_gate") else {}
    for key in ("mlflow_run_id", "run_id"):
        if own.get(key):
            return str(own[key])
    for upstream in ("train", "data_gate"):
        value = _dict(xcom(upstream)).get("mlflow_run_id")
        if value:
            return str(value)
    return None


def link_url(
    kind: str, *, dag_id: str, run_id: str, task_id: str, xcom: XComPull,
    mlflow_uri: str | None = None, airflow_url: str | None = None,
) -> str:
    """The URL of one extra link of a task instance, or ``""`` when it cannot be resolved (yet)."""
    if kind not in LINK_NAMES:
        raise ValueError(f"unknown link kind {kind!r}; known: {', '.join(LINK_NAMES)}")
    if kind == "quarantine_report":
        return quarantine_report_url(dag_id, run_id, airflow_url)
    if kind == "run_view":
        return run_view_url(dag_id, run_id, airflow_url)
    if kind == "model_version":
        own = _dict(xcom(task_id))
        if own.get("model_name") and own.get("version"):
            return f"{_mlflow_base(mlflow_uri)}/#/models/{quote(str(own['model_name']), safe='')}/versions/{own['version']}"
        return ""
    run = find_mlflow_run(_mlflow_run_id_from_xcom(task_id, xcom), dag_id, run_id, mlflow_uri=mlflow_uri)
    if run is None:
        return ""
    if kind == "mlflow_run":
        return run.url()
    if kind == "training_metrics":
        return run.url("model-metrics")
    if kind == "quarantine_report_mlflow":
        return run.artifact_url(QUARANTINE_ARTIFACT)
    return run.artifact_url(EVALUATION_ARTIFACT)  # evaluation_report


def safe_link_url(kind: str, *, dag_id: str, run_id: str, task_id: str, xcom: XComPull) -> str:
    """:func:`link_url` that logs and returns ``""`` instead of raising (it runs inside the task)."""
    try:
        return link_url(kind, dag_id=dag_id, run_id=run_id, task_id=task_id, xcom=xcom)
    except Exception:
        log.warning("kiln link %s of %s/%s/%s could not be resolved", kind, dag_id, run_id, task_id, exc_info=True)
        return ""

"""No credential of a run may surface anywhere a person or another task can read it (issue 8).

After real runs on the e2e stack (the production and sandbox tests of this package run first; run
alone, this test starts a short sandbox run of its own), every credential the stack and its runs
used is looked for in:

* every file under the stack's state folder except the stores that are meant to hold them:
  Airflow task logs, the stack's service logs (scheduler, api-server, triggerer, MLflow server…),
  run directories (trainer logs, reports, summaries), the DVC workspace, MLflow's store and
  artifacts, the Airflow metadata database (XCom, rendered fields, HITL details, task logs' metadata);
* over the REST API: every XCom value, the rendered template fields and the HITL request (its
  rendered body) of every task instance of every run of the kiln DAGs;
* MLflow: the tags and params of every run and the tags of every model version.

Credentials: the Airflow users' passwords, the api-server secret key and JWT signing key, and —
when the stack runs MLflow with basic-auth (``KILN_MLFLOW_AUTH=basic``) — the admin's and each
policy identity's MLflow password and the MLflow Flask secret key; S3 keys from the environment
when set. A hit names the credential and the place, never the value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

SECRET_STORES = {"passwords.json", "secrets.json", "identities.json", "flask_secret_key"}
"""Files whose job is to hold a credential (mode 0600, outside the repository): not scanned."""
MAX_FILE_BYTES = 64 * 1024 * 1024
KILN_DAGS = ("kiln_production", "kiln_sandbox")


def credentials() -> dict[str, str]:
    """name → value of every credential the stack and its runs used (values never printed)."""
    from kiln import settings as kiln_settings
    from kiln.stack import embedded as kiln_stack

    s = kiln_settings.load()
    found = {f"airflow password of {user}": pw for user, pw in kiln_stack.passwords(s).items()}
    airflow_secrets = json.loads((kiln_stack.airflow_home(s) / "secrets.json").read_text())
    found |= {f"airflow {name}": value for name, value in airflow_secrets.items()}
    if kiln_stack.mlflow_auth_enabled():
        found |= {f"MLflow password of {user}": pw for user, pw in kiln_stack.mlflow_passwords(s).items()}
        found["MLflow flask secret key"] = (s.home / "mlflow" / "auth" / "flask_secret_key").read_text().strip()
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "KILN_MLFLOW_PRODUCTION_PASSWORD",
                "KILN_MLFLOW_SANDBOX_PASSWORD", "MLFLOW_TRACKING_PASSWORD"):
        if os.environ.get(var):
            found[f"${var}"] = os.environ[var]
    short = [name for name, value in found.items() if len(value) < 12]
    assert not short, f"credentials too short to scan for without false hits: {short}"
    return found


def _hits(text: bytes | str, secrets: dict[str, str], where: str) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [f"{name} in {where}" for name, value in secrets.items() if value.encode() in data]


def scan_files(root: Path, secrets: dict[str, str]) -> tuple[list[str], int]:
    hits, scanned = [], 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink() or path.name in SECRET_STORES:
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        hits += _hits(path.read_bytes(), secrets, str(path.relative_to(root)))
        scanned += 1
    return hits, scanned


def scan_airflow(admin, secrets: dict[str, str]) -> tuple[list[str], int]:
    """XCom values, rendered fields and HITL requests of every task instance of the kiln DAGs."""
    hits, runs = [], 0
    for dag_id in KILN_DAGS:
        dag_runs = admin.request("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100})["dag_runs"]
        for run in dag_runs:
            runs += 1
            run_id = run["dag_run_id"]
            hits += _hits(json.dumps(run.get("conf") or {}), secrets, f"{dag_id}/{run_id} conf")
            for ti in admin.task_instances(dag_id, run_id):
                where = f"{dag_id}/{run_id}/{ti['task_id']}[{ti.get('map_index', -1)}]"
                hits += _hits(json.dumps(ti.get("rendered_fields") or {}), secrets, f"{where} rendered fields")
                base = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}"
                entries = admin.request("GET", f"{base}/xcomEntries", params={"map_index": ti.get("map_index", -1)},
                                        ok=(200, 404))
                for entry in (entries or {}).get("xcom_entries", []):
                    value = admin.request("GET", f"{base}/xcomEntries/{entry['key']}",
                                          params={"map_index": ti.get("map_index", -1)}, ok=(200, 404))
                    hits += _hits(json.dumps(value, default=str), secrets, f"{where} XCom {entry['key']}")
                if ti["task_id"] == "approval":
                    detail = admin.request("GET", f"{base}/{ti.get('map_index', -1)}/hitlDetails", ok=(200, 404))
                    hits += _hits(json.dumps(detail or {}, default=str), secrets, f"{where} HITL request")
    return hits, runs


def scan_mlflow(secrets: dict[str, str]) -> tuple[list[str], int]:
    from mlflow import MlflowClient

    client = MlflowClient()
    hits, items = [], 0
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            items += 1
            hits += _hits(json.dumps({"tags": run.data.tags, "params": run.data.params}), secrets,
                          f"MLflow run {run.info.run_id} of {exp.name}")
    for mv in client.search_model_versions():
        items += 1
        hits += _hits(json.dumps(mv.tags), secrets, f"MLflow {mv.name} version {mv.version}")
    return hits, items


def _ensure_a_finished_run(admin) -> None:
    """Run alone, the package's other tests have left no run behind: make a short one."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX
    from kiln.stack.demo import follow_run

    for dag_id in KILN_DAGS:
        admin.wait_for_dag(dag_id)
        runs = admin.request("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100})["dag_runs"]
        if any(r["state"] in ("success", "failed") for r in runs):
            return
    s = kiln_settings.load()
    if not (s.corpus_root / SANDBOX.corpus).is_dir():
        build_corpus(s.corpus_root / SANDBOX.corpus, shards=4, seed=5, poison=("garbage_bytes",))
    admin.unpause(SANDBOX.dag_id)
    run = admin.trigger(SANDBOX.dag_id, conf={"recipe": "tiny.toml", "max_steps": 20})
    final = follow_run(admin, SANDBOX.dag_id, run["dag_run_id"], timeout=780, progress=print)
    assert final["state"] == "success"


def test_no_credential_in_logs_xcom_templates_or_mlflow(stack, monkeypatch):
    from kiln import settings as kiln_settings
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    # A long HTTP timeout: on a loaded 2-core machine the api-server has taken more than 30 s.
    admin = AirflowClient(stack["airflow"], "admin", kiln_stack.passwords()["admin"], timeout=180)

    _ensure_a_finished_run(admin)
    secrets = credentials()
    if kiln_stack.mlflow_auth_enabled():  # read MLflow as the admin (the test process only)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", kiln_stack.MLFLOW_ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secrets[f"MLflow password of {kiln_stack.MLFLOW_ADMIN}"])
    home = kiln_settings.load().home

    file_hits, files = scan_files(home, secrets)
    airflow_hits, runs = scan_airflow(admin, secrets)
    mlflow_hits, items = scan_mlflow(secrets)
    print(f"scanned {files} files, {runs} DAG runs, {items} MLflow runs/versions for {len(secrets)} credentials")

    # The scan must have seen what it claims to cover, or a pass would mean nothing.
    task_logs = list((kiln_stack.airflow_home(kiln_settings.load()) / "logs").rglob("*.log"))
    assert task_logs, "no Airflow task log on disk to scan"
    assert (home / "logs" / "scheduler.log").is_file() and (home / "logs" / "mlflow.log").is_file()
    assert runs >= 1 and items >= 1
    # ... and the scanner finds a credential where one is: a planted copy in a log is a hit.
    planted = home / "logs" / "planted-for-the-scan.log"
    name, value = next(iter(secrets.items()))
    planted.write_text(f"oops {value}\n")
    try:
        assert f"{name} in planted-for-the-scan.log" in scan_files(home / "logs", secrets)[0]
    finally:
        planted.unlink()

    leaks = file_hits + airflow_hits + mlflow_hits
    assert not leaks, "credentials found:\n" + "\n".join(leaks)

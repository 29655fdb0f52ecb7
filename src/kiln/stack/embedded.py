"""The embedded stack: Airflow (SQLite + LocalExecutor) and an MLflow server, in the background.

Everything lives under ``KILN_HOME`` (default ``.kiln/``): the Airflow home, the MLflow database and
artifacts, the DVC workspace and remote, pid files and logs. ``up`` is idempotent (a running service
is left alone), ``down`` stops exactly the processes whose pid files ``up`` wrote (each in its own
process group, so the scheduler's task processes go too). Every server binds 127.0.0.1 only; the
scheduler and triggerer skip their log servers (which would bind all interfaces) because the
api-server reads task logs straight from the shared log folder.

Logins are generated once per state folder (``airflow/passwords.json``, mode 0600) and printed by
``up``; nothing secret is tracked in git.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from kiln import settings as kiln_settings
from kiln.errors import StackError
from kiln.policy import POLICIES
from kiln.runs import ALLOWED_RUN_ID_PATTERN
from kiln.shipped import DAGS_DIR, PLUGINS_DIR
from kiln.stack.mlflow_server import server_command
from kiln.util.fs import read_own_json, write_private
from kiln.util.procs import end_recorded, record_start, recorded_pid

AIRFLOW_USERS = {
    "admin": "admin",
    # Reviewers (the demo's approver is an explicitly named one, never "admin") get the least role
    # that may answer an approval: "user" (PUT on DAGs). "op" would add Variables (a policy's
    # launcher and approval timeout), Connections (the MLflow identities) and pools.
    "demo-reviewer": "user",
    "reviewer": "user",
    "sandbox-user": "user",
}
"""SimpleAuthManager users and roles. Its roles are global: "user" may trigger, clear, mark task
states and write XComs in *every* DAG, production included, and no role can be narrowed to one DAG
(docs/separation.md, layer 3). kiln therefore never takes a task state or an XCom for an approval."""
POOL_SLOTS = {"kiln_sandbox": 2, "kiln_production": 2}
MLFLOW_AUTH_ENV = "KILN_MLFLOW_AUTH"
"""``basic``: run MLflow with basic-auth (production-like): an admin plus one identity per policy,
generated passwords, each DAG's tasks acting as their policy's identity through the Airflow
connections ``kiln_mlflow_<policy>``. Unset / ``off``: an open MLflow server (the default)."""
MLFLOW_ADMIN = "kiln-admin"
MLFLOW_IDENTITIES = {"production": "kiln-production", "sandbox": "kiln-sandbox"}
MLFLOW_READER = "kiln-reader"
"""basic-auth mode: the api-server's identity, READ on every policy's names (the "kiln run" view)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Service:
    name: str
    argv: list[str]
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def airflow_home(s: kiln_settings.Settings) -> Path:
    return s.home / "airflow"


def _generated(path: Path, names: list[str], nbytes: int) -> dict[str, str]:
    """``name -> secret`` kept in ``path``, 0600 from its first byte: made once, a secret for each new
    name added, the existing ones kept."""
    known = read_own_json(path) if path.is_file() else {}
    if set(known) != set(names):
        known = {name: known.get(name) or secrets.token_urlsafe(nbytes) for name in names}
        write_private(path, json.dumps(known, indent=2))
    return known


def _secrets(s: kiln_settings.Settings) -> dict[str, str]:
    """Per-install secrets: JWT signing key shared by all Airflow components, and user passwords."""
    home = airflow_home(s)
    home.mkdir(parents=True, exist_ok=True)
    _generated(home / "passwords.json", list(AIRFLOW_USERS), 12)
    return _generated(home / "secrets.json", ["jwt_secret", "secret_key"], 32)


def passwords(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    s = s or kiln_settings.load()
    _secrets(s)
    return read_own_json(airflow_home(s) / "passwords.json")


def mlflow_auth_enabled() -> bool:
    value = os.environ.get(MLFLOW_AUTH_ENV, "").strip().lower()
    if value not in ("", "off", "basic"):
        raise StackError(f"{MLFLOW_AUTH_ENV} must be 'basic' or 'off', got {value!r}")
    return value == "basic"


def mlflow_passwords(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    """MLflow user → password for the basic-auth mode, generated once per state folder
    (``mlflow/auth/identities.json``, 0600 in a 0700 folder; never printed but the admin's by ``up``)."""
    s = s or kiln_settings.load()
    auth_dir = s.home / "mlflow" / "auth"
    auth_dir.mkdir(parents=True, exist_ok=True)
    auth_dir.chmod(0o700)
    return _generated(auth_dir / "identities.json", [MLFLOW_ADMIN, MLFLOW_READER, *MLFLOW_IDENTITIES.values()], 18)


def mlflow_connections(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    """``AIRFLOW_CONN_KILN_MLFLOW_<POLICY>`` → JSON connection, for the scheduler (and so the
    tasks) only: each policy's MLflow identity as an Airflow connection (``Policy.mlflow_conn_id``)."""
    s = s or kiln_settings.load()
    pw = mlflow_passwords(s)
    conns = {}
    for policy in POLICIES.values():
        if not policy.mlflow_conn_id:
            continue
        user = MLFLOW_IDENTITIES[policy.name]
        conns[f"AIRFLOW_CONN_{policy.mlflow_conn_id.upper()}"] = json.dumps(
            {"conn_type": "http", "host": s.mlflow_uri, "login": user, "password": pw[user]}
        )
    return conns


def _mlflow_auth_server(s: kiln_settings.Settings) -> tuple[list[str], dict[str, str]]:
    """Extra server arguments and environment for basic-auth (writes the auth config once)."""
    from kiln import mlflow_auth

    admin_password = mlflow_passwords(s)[MLFLOW_ADMIN]
    mlflow_auth.write_auth_config(s.home / "mlflow", admin_password, admin_username=MLFLOW_ADMIN)
    return list(mlflow_auth.SERVER_ARGS), mlflow_auth.server_env(s.home / "mlflow", admin_password)


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1].split("/")[0]


def airflow_env(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    """The environment every Airflow process (and so every task) of the embedded stack runs with."""
    s = s or kiln_settings.load()
    sec = _secrets(s)
    home = airflow_home(s)
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_DIR),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS_DIR),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "6",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in AIRFLOW_USERS.items()),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            # Wait up to a minute for SQLite's one write lock, not sqlite3's 5 s (kiln.stack.sqlite).
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "kiln.stack.sqlite.SYNC",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": "kiln.stack.sqlite.ASYNC",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": _port(s.airflow_url),
            "AIRFLOW__API__BASE_URL": s.airflow_url,
            "AIRFLOW__API__SECRET_KEY": sec["secret_key"],
            "AIRFLOW__API_AUTH__JWT_SECRET": sec["jwt_secret"],
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{s.airflow_url}/execution/",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # Airflow's default. A file is parsed as soon as it is found (the folder is listed every 5 s);
            # after that, each re-parse of kiln's three DAG files is a new process importing kiln: every
            # 10 s that was about 15 % of a core per stack, for a change nobody made.
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # A scheduler that died with running tasks: its successor resets them at its next orphan
            # check (Airflow's default: every 300 s); 60 s bounds what a scheduler loss costs a run.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "60",
            # A run id Airflow cannot serve (".") gets HTTP 400 at trigger time, not a failed first task.
            "AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN": ALLOWED_RUN_ID_PATTERN,
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "KILN_HOME": str(s.home),
            "MLFLOW_TRACKING_URI": s.mlflow_uri,
            # kiln's registry retries whole operations with backoff (KILN_REGISTRY_RETRIES); keep
            # MLflow's own per-request retries short so kiln's budget is what bounds the wait.
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
            "DVC_NO_ANALYTICS": "1",
            "GIT_PYTHON_REFRESH": "quiet",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def services(s: kiln_settings.Settings) -> list[Service]:
    airflow = _bin("airflow")
    mlflow_home = s.home / "mlflow"
    auth_args: list[str] = []
    auth_env: dict[str, str] = {}
    task_conns: dict[str, str] = {}
    reader_env: dict[str, str] = {}
    if mlflow_auth_enabled():
        auth_args, auth_env = _mlflow_auth_server(s)
        task_conns = mlflow_connections(s)
        reader_env = {"MLFLOW_TRACKING_USERNAME": MLFLOW_READER, "MLFLOW_TRACKING_PASSWORD": mlflow_passwords(s)[MLFLOW_READER]}
    return [
        Service(
            name="mlflow",
            argv=server_command(
                mlflow_home, s.mlflow_port, f"sqlite:///{mlflow_home / 'mlflow.db'}", str(mlflow_home / "artifacts"), workers=1
            ) + auth_args,
            # Without this the server also starts a job runner with 8 workers (~2.5 GB).
            env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **auth_env},
            health_url=f"http://127.0.0.1:{s.mlflow_port}/health",
        ),
        Service(
            name="api-server",
            argv=[airflow, "api-server", "--host", "127.0.0.1", "--port", _port(s.airflow_url), "--workers", "1"],
            health_url=f"{s.airflow_url}/api/v2/monitor/health",
            env=reader_env,  # basic-auth: read-only, for the "kiln run" view's MLflow lookup
        ),
        Service(
            name="signals",  # Prometheus exporter of kiln's operational signals (docs/runbook.md)
            argv=[_bin("kiln"), "signals", "serve", "--port", str(s.signals_port)],
            health_url=f"http://127.0.0.1:{s.signals_port}/healthz",
        ),
        # The LocalExecutor runs tasks as children of the scheduler: only it gets the policies'
        # MLflow connections (dag-processor and triggerer never talk to MLflow; the api-server only reads).
        Service(name="scheduler", argv=[airflow, "scheduler", "--skip-serve-logs"], env=task_conns),
        Service(name="dag-processor", argv=[airflow, "dag-processor"]),
        Service(name="triggerer", argv=[airflow, "triggerer", "--skip-serve-logs"]),
    ]


def _pidfile(s: kiln_settings.Settings, name: str) -> Path:
    return s.home / "run" / f"{name}.pid"


def running_pid(s: kiln_settings.Settings, name: str) -> int | None:
    return recorded_pid(_pidfile(s, name))


def _run_airflow(args: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "ab") as fh:
        proc = subprocess.run([_bin("airflow"), *args], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise StackError(f"`airflow {' '.join(args)}` failed (exit {proc.returncode}); see {log}")


def _wait_healthy(url: str, name: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
    raise StackError(f"{name} did not become healthy at {url} within {timeout:.0f}s; log tail:\n{tail}")


def up(*, timeout: float = 180.0, quiet: bool = False) -> dict[str, str]:
    """Start whatever is not running yet; return the URLs. Safe to call again and again."""
    s = kiln_settings.load()
    env = airflow_env(s)
    logs = s.home / "logs"
    for d in (logs, s.home / "run", s.home / "mlflow", airflow_home(s)):
        d.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    from kiln.data.snapshot import ensure_workspace

    ensure_workspace(s)
    to_start = [svc for svc in services(s) if running_pid(s, svc.name) is None]
    if any(svc.name not in ("mlflow", "signals") for svc in to_start):
        say("kiln: migrating the Airflow metadata database (SQLite)")
        _run_airflow(["db", "migrate"], env, logs / "airflow-setup.log")
        for pool, slots in POOL_SLOTS.items():
            policy = next(p for p in POLICIES.values() if p.pool == pool)
            _run_airflow(["pools", "set", pool, str(slots), f"kiln {policy.name} runs"], env, logs / "airflow-setup.log")
    for svc in to_start:
        log = logs / f"{svc.name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                svc.argv, env={**env, **svc.env}, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=s.home, start_new_session=True,
            )
        record_start(_pidfile(s, svc.name), proc.pid, s.home)  # its processes run in KILN_HOME
        say(f"kiln: started {svc.name} (pid {proc.pid}, log {log})")
    for svc in services(s):
        if svc.health_url:
            _wait_healthy(svc.health_url, svc.name, logs / f"{svc.name}.log", timeout)
    if mlflow_auth_enabled():
        from kiln import mlflow_auth

        pw = mlflow_passwords(s)
        prod, sandbox = MLFLOW_IDENTITIES["production"], MLFLOW_IDENTITIES["sandbox"]
        mlflow_auth.provision_identities(s.mlflow_uri, MLFLOW_ADMIN, pw[MLFLOW_ADMIN], production_user=prod,
                                         production_password=pw[prod], sandbox_user=sandbox,
                                         sandbox_password=pw[sandbox], reader_user=MLFLOW_READER,
                                         reader_password=pw[MLFLOW_READER])
        say(f"kiln: MLflow basic-auth on; identities {prod} (production) and {sandbox} (sandbox) provisioned")
    info = {"airflow": s.airflow_url, "mlflow": s.mlflow_uri, "home": str(s.home)}
    if not quiet:
        pw = passwords(s)
        print(f"Airflow UI : {s.airflow_url}   (login admin / {pw['admin']}; reviewer demo-reviewer / {pw['demo-reviewer']})")
        auth = f"   (login {MLFLOW_ADMIN} / {mlflow_passwords(s)[MLFLOW_ADMIN]})" if mlflow_auth_enabled() else ""
        print(f"MLflow UI  : {s.mlflow_uri}{auth}")
        print(f"signals    : http://127.0.0.1:{s.signals_port}/metrics   (Prometheus format; rules in docker/prometheus/)")
        print(f"state      : {s.home}   (logs in {logs}; `make down` stops it)")
    return info


def down(*, timeout: float = 20.0) -> list[str]:
    """Stop exactly the processes ``up`` started (their whole process groups), and what a service
    that died left behind (a killed scheduler's executor workers: ``kiln.util.procs.record_start``)."""
    s = kiln_settings.load()
    stopped = []
    for svc in reversed(services(s)):
        # started with start_new_session: the pid is the pgid
        if end_recorded(_pidfile(s, svc.name), timeout, s.home):
            stopped.append(svc.name)
    return stopped


AIRFLOW_COMPONENTS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
"""Services whose health the api-server reports (``/api/v2/monitor/health``, from their heartbeats)."""


def _probe(url: str) -> tuple[str, Any]:
    """``("healthy", json body or None)`` when ``url`` answers 200, else ``("unhealthy: why", None)``."""
    try:
        answer = requests.get(url, timeout=2)
    except requests.RequestException as exc:
        return f"unhealthy: no answer at {url} ({type(exc).__name__})", None
    if answer.status_code != 200:
        return f"unhealthy: {url} answered HTTP {answer.status_code}", None
    try:
        return "healthy", answer.json()
    except ValueError:
        return "healthy", None


def service_report(
    svcs: list[Service], pid_of: Callable[[str], int | None], urls: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per service: ``pid`` (None: not running), ``health`` and ``url`` (what a person opens).

    ``health`` is ``down`` without a process; else the probe of the service's health URL; for
    Airflow's scheduler, dag-processor and triggerer, what the api-server's health endpoint says of
    their heartbeats; ``running`` for a service nothing can probe (a Celery worker)."""
    report: dict[str, dict[str, Any]] = {}
    airflow: dict[str, Any] = {}
    for svc in svcs:  # the api-server comes before the components it reports on
        pid = pid_of(svc.name)
        health = "down" if pid is None else "running"
        if pid is not None and svc.health_url:
            health, body = _probe(svc.health_url)
            if svc.name == "api-server" and isinstance(body, dict):
                airflow = body
        elif pid is not None and svc.name in AIRFLOW_COMPONENTS:
            info = airflow.get(AIRFLOW_COMPONENTS[svc.name])
            if isinstance(info, dict) and info.get("status"):
                beat = next((v for k, v in info.items() if k.endswith("heartbeat")), None)
                health = str(info["status"]) + (f" (last heartbeat {beat})" if beat else "")
            else:
                health = "running (health unknown: the api-server does not answer for it)"
        report[svc.name] = {"pid": pid, "health": health, "url": urls.get(svc.name)}
    return report


def status() -> dict[str, dict[str, Any]]:
    """Every service of the embedded stack: pid, health and URL (``service_report``)."""
    s = kiln_settings.load()
    urls = {"api-server": s.airflow_url, "mlflow": s.mlflow_uri, "signals": f"http://127.0.0.1:{s.signals_port}/metrics"}
    return service_report(services(s), lambda name: running_pid(s, name), urls)

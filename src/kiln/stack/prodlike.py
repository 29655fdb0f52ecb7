"""The production-like stack without containers: the topology of ``docker/compose.yaml`` as processes.

``kiln stack up --profile prodlike`` (or ``up()``) starts, under ``KILN_HOME/prodlike/``::

    PostgreSQL (the machine's, 127.0.0.1:5432)  one role + three databases per stack: <tag>_airflow
                                                (metadata + Celery results), <tag>_mlflow (tracking +
                                                registry), <tag>_mlflow_auth (MLflow basic-auth users)
    Redis (the machine's, 127.0.0.1:6379)       Celery broker: an empty DB index + key prefix per stack
    moto_server (S3 stand-in)                   buckets <tag>-dvc (DVC remote) and <tag>-mlflow (artifacts)
    mlflow server --app-name basic-auth         PostgreSQL backend, S3 artifacts (proxied), identities
                                                kiln-production (EDIT on production names) and
                                                kiln-sandbox (EDIT on sandbox names), see kiln.mlflow_auth
    airflow api-server (FAB auth manager)       per-DAG permissions, see kiln.airflow.fab_auth
    airflow scheduler, dag-processor, triggerer CeleryExecutor
    airflow celery worker × 2                   queue kiln-production (production MLflow identity and
                                                signing key) and queues kiln-sandbox,default (sandbox
                                                identity): a sandbox task process never holds
                                                production credentials
    kiln signals serve                          Prometheus exporter of kiln's operational signals

Every credential (PostgreSQL role password, S3 keys, Fernet/JWT/secret keys, Airflow and MLflow
passwords, production's private signing key) is generated at the first ``up`` into
``KILN_HOME/prodlike/state.json`` (mode 0600, outside git) and reaches each process through its
environment only — never its command line, a tracked file or a log line. Production's signing key
reaches the production worker alone, as the Airflow connection ``kiln_signing_production``; its
public half is in production's trusted set (``kiln.provenance.keys.trust_deployment_key``), and no
private key of production is written under ``KILN_HOME/keys``. ``down()`` stops the processes and drops what the stack created in
the shared services (databases, role, Redis keys); S3 lives in moto's memory and goes with it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln import settings as kiln_settings
from kiln.cluster_policy import QUEUES, task_policy  # noqa: F401  (re-exported: the stack's routing)
from kiln.errors import ConfigError, StackError
from kiln.policy import POLICIES
from kiln.runs import ALLOWED_RUN_ID_PATTERN
from kiln.shipped import DAGS_DIR, PLUGINS_DIR
from kiln.stack.embedded import POOL_SLOTS, Service, _bin, service_report
from kiln.util.fs import read_own_json, write_private
from kiln.util.net import free_port
from kiln.util.procs import end_recorded, record_start, recorded_pid

PROFILE = "prodlike"
PG_ADMIN_ENV = "KILN_PG_ADMIN_URI"
PG_ADMIN_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_ENV = "KILN_REDIS_URL"
REDIS_DEFAULT = "redis://127.0.0.1:6379"
AIRFLOW_USER_ROLES = {
    "admin": "Admin",
    "demo-reviewer": "kiln-reviewer",
    "reviewer": "kiln-reviewer",
    "sandbox-user": "kiln-sandbox",
    "corpus-publisher": "kiln-publisher",
}
"""Airflow (FAB) users of this stack and their roles; what each role may do: ``kiln.airflow.fab_auth``."""
MLFLOW_ADMIN = "admin"
MLFLOW_IDENTITIES = {"production": "kiln-production", "sandbox": "kiln-sandbox"}
MLFLOW_READER = "kiln-reader"
"""The api-server's MLflow identity: READ on every policy's names (the "kiln run" view's lookup)."""
WORKER_CONCURRENCY = {"production": 2, "sandbox": 2}
DEPLOYMENT_SIGNING_KEYS = ("production",)
"""Policies whose private signing key this stack keeps in its secrets (state.json) and gives to that
policy's worker only, as the Airflow connection ``Policy.signing_conn_id``; sandbox's stays under
``KILN_HOME/keys`` (``kiln.provenance.keys``)."""


def root(s: kiln_settings.Settings) -> Path:
    return s.home / PROFILE


def airflow_home(s: kiln_settings.Settings) -> Path:
    return root(s) / "airflow"


# ------------------------------------------------------------------------------------------ state
def _pw() -> str:
    return secrets.token_urlsafe(18)


def state(s: kiln_settings.Settings | None = None, *, create: bool = False) -> dict[str, Any]:
    """The stack's names, ports and generated credentials (``KILN_HOME/prodlike/state.json``)."""
    from cryptography.fernet import Fernet

    s = s or kiln_settings.load()
    path = root(s) / "state.json"
    if path.is_file():
        return read_own_json(path)
    if not create:
        raise ConfigError(f"no production-like stack under {root(s)}; start one with `kiln stack up --profile {PROFILE}`")
    tag = "kiln_" + secrets.token_hex(4)
    data = {
        "tag": tag,
        "pg_role": tag,
        "pg_password": _pw(),
        "databases": {"airflow": f"{tag}_airflow", "mlflow": f"{tag}_mlflow", "mlflow_auth": f"{tag}_mlflow_auth"},
        "redis_db": _free_redis_db(),
        "redis_prefix": f"{tag}:",
        "moto_port": free_port(),
        "buckets": {"dvc": f"{tag.replace('_', '-')}-dvc", "mlflow": f"{tag.replace('_', '-')}-mlflow"},
        "s3_access_key_id": "AKIA" + secrets.token_hex(8).upper(),
        "s3_secret_access_key": secrets.token_urlsafe(30),
        "fernet_key": Fernet.generate_key().decode(),
        "jwt_secret": secrets.token_urlsafe(32),
        "secret_key": secrets.token_urlsafe(32),
        "airflow_passwords": {user: _pw() for user in AIRFLOW_USER_ROLES},
        "mlflow_passwords": {MLFLOW_ADMIN: _pw(), MLFLOW_READER: _pw(),
                             **{ident: _pw() for ident in MLFLOW_IDENTITIES.values()}},
        "signing_keys": _new_signing_keys({}),
    }
    root(s).mkdir(parents=True, exist_ok=True)
    root(s).chmod(0o700)
    write_private(path, json.dumps(data, indent=2))
    return data


def _new_signing_keys(held: dict[str, str]) -> dict[str, str]:
    """``held`` with a new private key (PKCS #8 PEM) for each of ``DEPLOYMENT_SIGNING_KEYS`` it lacks."""
    from kiln.provenance.keys import generate_private_pem

    return {**held, **{p: generate_private_pem() for p in DEPLOYMENT_SIGNING_KEYS if p not in held}}


def provision_signing_keys(s: kiln_settings.Settings, st: dict[str, Any]) -> dict[str, str]:
    """Give each of ``DEPLOYMENT_SIGNING_KEYS`` its key in the stack's secrets (generated once into
    ``state.json``, a stack made before this had none) and trust its public half
    (``trust_deployment_key``: from then on kiln makes no key for that policy under ``KILN_HOME``).
    Returns ``policy -> key id``. Idempotent."""
    from kiln.provenance.keys import trust_deployment_key

    held = st.get("signing_keys") or {}
    if set(DEPLOYMENT_SIGNING_KEYS) - set(held):
        st["signing_keys"] = _new_signing_keys(held)
        write_private(root(s) / "state.json", json.dumps(st, indent=2))
    return {policy: trust_deployment_key(policy, st["signing_keys"][policy], s.home,
                                         source=f"connection {_signing_conn_id(policy)}")
            for policy in DEPLOYMENT_SIGNING_KEYS}


def rotate_signing_key(policy: str = "production") -> str:
    """A new private key for ``policy`` in the stack's secrets, its public half trusted beside the old
    ones (versions signed before still verify); returns its key id. The worker of ``policy`` signs with
    it from its next start (its environment carries the connection): stop it
    (``KILN_HOME/prodlike/run/worker-<policy>.pid``) and run ``up`` again."""
    from kiln.provenance.keys import generate_private_pem, trust_deployment_key

    if policy not in DEPLOYMENT_SIGNING_KEYS:
        raise ConfigError(f"this stack keeps no signing key of policy {policy!r} (only {', '.join(DEPLOYMENT_SIGNING_KEYS)})")
    s = kiln_settings.load()
    st = state(s)
    pem = generate_private_pem()
    kid = trust_deployment_key(policy, pem, s.home, source=f"connection {_signing_conn_id(policy)}")
    st["signing_keys"] = {**(st.get("signing_keys") or {}), policy: pem}
    write_private(root(s) / "state.json", json.dumps(st, indent=2))
    return kid


def passwords(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    """Airflow logins of the production-like stack (user -> password)."""
    return dict(state(s)["airflow_passwords"])


def _pg_uri(st: dict[str, Any], db: str, driver: str = "postgresql") -> str:
    return f"{driver}://{st['pg_role']}:{st['pg_password']}@127.0.0.1:5432/{st['databases'][db]}"


def _redis_base() -> str:
    return os.environ.get(REDIS_ENV, REDIS_DEFAULT).rstrip("/")


def _free_redis_db() -> int:
    """An empty Redis DB index (1–15): Celery's fanout channels are named per DB, so two stacks on
    one Redis do not hear each other's broadcasts; the key prefix separates the rest."""
    import redis

    base = _redis_base()
    for db in secrets.SystemRandom().sample(range(1, 16), 15):
        if redis.Redis.from_url(f"{base}/{db}").dbsize() == 0:
            return db
    raise StackError(f"no empty DB index on Redis {base}; stop another stack or set {REDIS_ENV}")


# ---------------------------------------------------------------------------- shared-service setup
def _pg_admin():
    import psycopg2

    conn = psycopg2.connect(os.environ.get(PG_ADMIN_ENV, PG_ADMIN_DEFAULT))
    conn.autocommit = True
    return conn


def _create_databases(st: dict[str, Any]) -> None:
    from psycopg2 import sql

    conn = _pg_admin()
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (st["pg_role"],))
        verb = "ALTER" if cur.fetchone() else "CREATE"
        cur.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(st["pg_role"])), (st["pg_password"],))
        for db in st["databases"].values():
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
            if not cur.fetchone():
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(db), sql.Identifier(st["pg_role"])))
    conn.close()


def _drop_databases(st: dict[str, Any]) -> list[str]:
    from psycopg2 import sql

    dropped = []
    conn = _pg_admin()
    with conn.cursor() as cur:
        for db in st["databases"].values():
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
            dropped.append(db)
        cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(st["pg_role"])))
    conn.close()
    return dropped


def _clear_redis(st: dict[str, Any]) -> int:
    import redis

    client = redis.Redis.from_url(f"{_redis_base()}/{st['redis_db']}")
    # kombu's global_keyprefix covers every key Celery writes (queues, bindings, unacked sets).
    keys = list(client.scan_iter(match=f"{st['redis_prefix']}*", count=500))
    return client.delete(*keys) if keys else 0


def _create_buckets(st: dict[str, Any]) -> None:
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=_s3_endpoint(st), region_name="us-east-1",
        aws_access_key_id=st["s3_access_key_id"], aws_secret_access_key=st["s3_secret_access_key"],
    )
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    for bucket in st["buckets"].values():
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)


def _s3_endpoint(st: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{st['moto_port']}"


# ---------------------------------------------------------------------------------- environments
def client_env(s: kiln_settings.Settings | None = None) -> dict[str, str]:
    """What a client process (a test, ``kiln snapshot create --announce``) sets to use this stack:
    the DVC remote on S3 and its keys, the service URLs. Holds secrets: environment only."""
    s = s or kiln_settings.load()
    st = state(s)
    return {
        "KILN_HOME": str(s.home),
        "KILN_AIRFLOW_URL": s.airflow_url,
        "KILN_DVC_REMOTE": f"s3://{st['buckets']['dvc']}/remote",
        "KILN_DVC_REMOTE_ENDPOINT": _s3_endpoint(st),
        "AWS_ACCESS_KEY_ID": st["s3_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": st["s3_secret_access_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{s.mlflow_port}",
    }


def airflow_env(s: kiln_settings.Settings, st: dict[str, Any]) -> dict[str, str]:
    """The environment of every Airflow process (and so every task) of this stack."""
    home = airflow_home(s)
    port = s.airflow_url.rsplit(":", 1)[1].split("/")[0]
    # Nor a signing key the caller's environment holds: that reaches one worker only (_worker_signing_env).
    signing = set(_signing_env_names())
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW__", "MLFLOW_TRACKING_")) and k not in signing}
    env.update(client_env(s))
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_DIR),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS_DIR),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__FERNET_KEY": st["fernet_key"],
            "AIRFLOW__CORE__AUTH_MANAGER": "kiln.airflow.fab_auth.KilnFabAuthManager",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _pg_uri(st, "airflow", "postgresql+psycopg2"),
            "AIRFLOW__CELERY__BROKER_URL": f"{_redis_base()}/{st['redis_db']}",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + _pg_uri(st, "airflow", "postgresql+psycopg2"),
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__GLOBAL_KEYPREFIX": st["redis_prefix"],
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "86400",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
            "AIRFLOW__OPERATORS__DEFAULT_QUEUE": "default",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": port,
            "AIRFLOW__API__BASE_URL": s.airflow_url,
            "AIRFLOW__API__SECRET_KEY": st["secret_key"],
            "AIRFLOW__API_AUTH__JWT_SECRET": st["jwt_secret"],
            "AIRFLOW__FAB__SESSION_BACKEND": "securecookie",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{s.airflow_url}/execution/",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # Airflow's default. A file is parsed as soon as it is found (the folder is listed every 5 s);
            # after that, each re-parse of kiln's three DAG files is a new process importing kiln: every
            # 10 s that was about 15 % of a core per stack, for a change nobody made.
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            # A loaded 2-core machine parses a DAG file in well over the default 50 s/30 s limits.
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "300",
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "240",
            # Tasks call the api-server's execution API; its 5 s default timed out (and the task was
            # lost) with one busy api-server worker on a loaded machine.
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # A scheduler that died with running tasks: its successor resets them at its next orphan
            # check (Airflow's default: every 300 s); 60 s bounds what a scheduler loss costs a run.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "60",
            # A run id Airflow cannot serve (".") gets HTTP 400 at trigger time, not a failed first task.
            "AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN": ALLOWED_RUN_ID_PATTERN,
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
            "DVC_NO_ANALYTICS": "1",
            "GIT_PYTHON_REFRESH": "quiet",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _worker_env(st: dict[str, Any], policy: str, mlflow_uri: str) -> dict[str, str]:
    """A worker talks to MLflow as its policy's identity, and only that one."""
    ident = MLFLOW_IDENTITIES[policy]
    password = st["mlflow_passwords"][ident]
    conn_id = getattr(POLICIES[policy], "mlflow_conn_id", None) or f"kiln_mlflow_{policy}"
    conn = {"conn_type": "http", "host": mlflow_uri, "login": ident, "password": password}
    return {
        # The policy's Airflow connection (how kiln's tasks pick their MLflow identity) …
        f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(conn),
        # … and MLflow's own client variables, for anything that reads only those (the trainer).
        "MLFLOW_TRACKING_USERNAME": ident,
        "MLFLOW_TRACKING_PASSWORD": password,
    }


def _signing_conn_id(policy: str) -> str:
    return POLICIES[policy].signing_conn_id or f"kiln_signing_{policy}"


def _signing_env_names() -> list[str]:
    """Every variable that can carry a policy's private signing key into a process."""
    from kiln.provenance.keys import signing_key_env_names

    return [name for p in POLICIES for name in (*signing_key_env_names(p), f"AIRFLOW_CONN_{_signing_conn_id(p).upper()}")]


def _worker_signing_env(st: dict[str, Any], policy: str) -> dict[str, str]:
    """The policy's private signing key as its Airflow connection (PEM in the password), for that policy's
    worker alone; nothing for a policy whose key is not the stack's (``DEPLOYMENT_SIGNING_KEYS``)."""
    pem = (st.get("signing_keys") or {}).get(policy) if policy in DEPLOYMENT_SIGNING_KEYS else None
    if not pem:
        return {}
    conn = {"conn_type": "generic", "description": f"kiln: policy {policy}'s private signing key", "password": pem}
    return {f"AIRFLOW_CONN_{_signing_conn_id(policy).upper()}": json.dumps(conn)}


LOCAL_SETTINGS = '''"""Written by kiln.stack.prodlike: route kiln's DAGs to per-policy Celery queues."""
from kiln.cluster_policy import task_policy  # noqa: F401
'''


def services(s: kiln_settings.Settings, st: dict[str, Any]) -> list[Service]:
    from kiln.mlflow_auth import SERVER_ARGS, server_env

    airflow = _bin("airflow")
    mlflow_home = root(s) / "mlflow"
    port = s.airflow_url.rsplit(":", 1)[1].split("/")[0]
    s3_env = {
        "AWS_ACCESS_KEY_ID": st["s3_access_key_id"], "AWS_SECRET_ACCESS_KEY": st["s3_secret_access_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    mlflow_env: dict[str, str] = {}
    if (mlflow_home / "auth" / "basic_auth.ini").is_file():
        mlflow_env = server_env(mlflow_home, st["mlflow_passwords"][MLFLOW_ADMIN])
    workers = [
        Service(
            name=f"worker-{policy}",
            argv=[airflow, "celery", "worker", "--skip-serve-logs", "--concurrency", str(WORKER_CONCURRENCY[policy]),
                  "--queues", QUEUES[POLICIES[policy].dag_id] + (",default" if policy == "sandbox" else ""),
                  "--celery-hostname", f"{policy}.{st['tag']}@%h"],
            env={**_worker_env(st, policy, f"http://127.0.0.1:{s.mlflow_port}"), **_worker_signing_env(st, policy)},
        )
        for policy in ("production", "sandbox")
    ]
    return [
        Service(name="moto", argv=[_bin("moto_server"), "-H", "127.0.0.1", "-p", str(st["moto_port"])],
                env=s3_env, health_url=f"{_s3_endpoint(st)}/moto-api/"),
        Service(
            name="mlflow",
            argv=[_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(s.mlflow_port),
                  "--artifacts-destination", f"s3://{st['buckets']['mlflow']}/artifacts", "--serve-artifacts",
                  "--workers", "1", *SERVER_ARGS],
            env={
                # The backend URI carries the role's password: environment, not argv.
                "MLFLOW_BACKEND_STORE_URI": _pg_uri(st, "mlflow", "postgresql+psycopg2"),
                "MLFLOW_S3_ENDPOINT_URL": _s3_endpoint(st),
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                **s3_env,
                **mlflow_env,
            },
            health_url=f"http://127.0.0.1:{s.mlflow_port}/health",
        ),
        Service(name="api-server", argv=[airflow, "api-server", "--host", "127.0.0.1", "--port", port, "--workers", "1"],
                health_url=f"{s.airflow_url}/api/v2/monitor/health",
                # read-only: the "kiln run" view finds a run's MLflow run (no policy identity here)
                env={"MLFLOW_TRACKING_USERNAME": MLFLOW_READER,
                     "MLFLOW_TRACKING_PASSWORD": st["mlflow_passwords"][MLFLOW_READER]}),
        Service(name="signals", argv=[_bin("kiln"), "signals", "serve", "--port", str(s.signals_port)],
                health_url=f"http://127.0.0.1:{s.signals_port}/healthz"),
        Service(name="scheduler", argv=[airflow, "scheduler", "--skip-serve-logs"]),
        Service(name="dag-processor", argv=[airflow, "dag-processor"]),
        Service(name="triggerer", argv=[airflow, "triggerer", "--skip-serve-logs"]),
        *workers,
    ]


# ------------------------------------------------------------------------------------- processes
def _pidfile(s: kiln_settings.Settings, name: str) -> Path:
    return root(s) / "run" / f"{name}.pid"


def running_pid(s: kiln_settings.Settings, name: str) -> int | None:
    return recorded_pid(_pidfile(s, name))


def _start(s: kiln_settings.Settings, svc: Service, env: dict[str, str]) -> int:
    log = root(s) / "logs" / f"{svc.name}.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(svc.argv, env={**env, **svc.env}, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=root(s), start_new_session=True)
    record_start(_pidfile(s, svc.name), proc.pid, s.home)  # its processes run under KILN_HOME
    return proc.pid


def _wait_healthy(url: str, name: str, log: Path, timeout: float, alive: Callable[[], bool]) -> None:
    """Poll ``url`` until it answers 200; fail at once (with the log tail) when the process died."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        dead = not alive()
        if dead or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
            why = "exited" if dead else f"did not become healthy at {url} within {timeout:.0f}s"
            raise StackError(f"{name} {why}; log tail:\n{tail}")
        time.sleep(0.5)


def _run(args: list[str], env: dict[str, str], log: Path, what: str) -> None:
    with open(log, "ab") as fh:
        proc = subprocess.run(args, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise StackError(f"{what} failed (exit {proc.returncode}); see {log}")


def up(*, timeout: float = 300.0, quiet: bool = False) -> dict[str, str]:
    """Start whatever is not running yet (idempotent); return the URLs."""
    from kiln.mlflow_auth import provision_identities, write_auth_config
    from kiln.stack import embedded as embedded

    s = kiln_settings.load()
    if any(embedded.running_pid(s, svc.name) for svc in embedded.services(s)):
        raise StackError(f"the embedded stack runs under {s.home}; `kiln stack down` first or use another KILN_HOME")
    st = state(s, create=True)
    ports = {"airflow_url": s.airflow_url, "mlflow_port": s.mlflow_port, "signals_port": s.signals_port}
    if st.get("ports", ports) != ports and any(running_pid(s, svc.name) for svc in services(s, st)):
        raise StackError(f"the production-like stack under {root(s)} runs on {st['ports']}, not {ports}: "
                         "use the same KILN_*_PORT settings, or stop it first")
    if st.get("ports") != ports:
        st["ports"] = ports
        write_private(root(s) / "state.json", json.dumps(st, indent=2))
    for d in ("logs", "run", "mlflow", "airflow/config"):
        (root(s) / d).mkdir(parents=True, exist_ok=True)
    logs = root(s) / "logs"
    setup_log = logs / "setup.log"

    def say(msg: str) -> None:
        if not quiet:
            print(f"kiln prodlike: {msg}", file=sys.stderr, flush=True)

    def start(name: str) -> None:
        svc = next(x for x in services(s, st) if x.name == name)
        if running_pid(s, name) is None:
            say(f"started {name} (pid {_start(s, svc, env)}, log {logs / (name + '.log')})")
        if svc.health_url:
            _wait_healthy(svc.health_url, name, logs / f"{name}.log", timeout, lambda: running_pid(s, name) is not None)

    provision_signing_keys(s, st)  # before any worker starts: it signs with the key it finds
    env = airflow_env(s, st)
    _create_databases(st)
    start("moto")
    _create_buckets(st)

    mlflow_home = root(s) / "mlflow"
    admin_pw = st["mlflow_passwords"][MLFLOW_ADMIN]
    write_auth_config(mlflow_home, admin_pw, admin_username=MLFLOW_ADMIN,
                      database_uri=_pg_uri(st, "mlflow_auth", "postgresql+psycopg2"))
    start("mlflow")
    mlflow_uri = f"http://127.0.0.1:{s.mlflow_port}"
    provision_identities(
        mlflow_uri, MLFLOW_ADMIN, admin_pw,
        production_user=MLFLOW_IDENTITIES["production"],
        production_password=st["mlflow_passwords"][MLFLOW_IDENTITIES["production"]],
        sandbox_user=MLFLOW_IDENTITIES["sandbox"], sandbox_password=st["mlflow_passwords"][MLFLOW_IDENTITIES["sandbox"]],
        reader_user=MLFLOW_READER, reader_password=st["mlflow_passwords"][MLFLOW_READER],
    )

    from kiln.data.snapshot import ensure_workspace

    ensure_workspace(s)
    airflow_names = ("api-server", "scheduler", "dag-processor", "triggerer", "worker-production", "worker-sandbox")
    (airflow_home(s) / "config" / "airflow_local_settings.py").write_text(LOCAL_SETTINGS)
    if not st.get("airflow_ready"):  # once per stack: a restart of one component skips it
        say("migrating the Airflow metadata database (PostgreSQL) and provisioning roles/users (FAB)")
        _run([_bin("airflow"), "db", "migrate"], env, setup_log, "airflow db migrate")
        pw_file = root(s) / "airflow-passwords.json"
        write_private(pw_file, json.dumps(st["airflow_passwords"]))
        try:
            _run([sys.executable, "-m", "kiln.airflow.fab_auth", "provision", str(pw_file)], env, setup_log, "FAB provisioning")
        finally:
            pw_file.unlink(missing_ok=True)
        for pool, slots in POOL_SLOTS.items():
            policy = next(p for p in POLICIES.values() if p.pool == pool)
            _run([_bin("airflow"), "pools", "set", pool, str(slots), f"kiln {policy.name} runs"], env, setup_log,
                 f"airflow pools set {pool}")
        st["airflow_ready"] = True
        write_private(root(s) / "state.json", json.dumps(st, indent=2))
    for name in ("signals", *airflow_names):
        start(name)
    info = {"airflow": s.airflow_url, "mlflow": mlflow_uri, "s3": _s3_endpoint(st), "home": str(root(s))}
    if not quiet:
        print(f"Airflow UI : {s.airflow_url}   (FAB logins: see {root(s) / 'state.json'}, airflow_passwords)")
        print(f"MLflow UI  : {mlflow_uri}   (basic-auth; identities kiln-production / kiln-sandbox)")
        print(f"S3 (moto)  : {_s3_endpoint(st)}   buckets {', '.join(st['buckets'].values())}")
        print(f"state      : {root(s)}   (logs in {logs}; `kiln stack down --profile {PROFILE}` stops it)")
    return info


def down(*, timeout: float = 30.0, keep_data: bool = False) -> list[str]:
    """Stop the processes ``up`` started; then (unless ``keep_data``) drop the stack's databases,
    role and Redis keys and forget its state, so the next ``up`` is a fresh stack."""
    s = kiln_settings.load()
    path = root(s) / "state.json"
    if not path.is_file():
        return []
    st = state(s)
    stopped = []
    for svc in reversed(services(s, st)):
        if end_recorded(_pidfile(s, svc.name), timeout, s.home):
            stopped.append(svc.name)
    if not keep_data:
        _clear_redis(st)
        _drop_databases(st)
        path.unlink()
        stopped.append("data")
    return stopped


def status() -> dict[str, dict[str, Any]]:
    """Every service of the production-like stack: pid, health and URL (``kiln.stack.embedded.service_report``)."""
    s = kiln_settings.load()
    st = state(s)
    urls = {"api-server": s.airflow_url, "mlflow": f"http://127.0.0.1:{s.mlflow_port}",
            "signals": f"http://127.0.0.1:{s.signals_port}/metrics", "moto": _s3_endpoint(st)}
    return service_report(services(s, st), lambda name: running_pid(s, name), urls)

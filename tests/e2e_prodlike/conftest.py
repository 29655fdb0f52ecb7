"""The production-like stack (``kiln.stack.prodlike``) for this package: PostgreSQL metadata, Celery
over Redis with two real workers, MLflow on PostgreSQL + S3 (moto) with basic-auth, the FAB auth
manager — started once under a throwaway KILN_HOME on free ports, and torn down after the package
(processes stopped, databases and role dropped, Redis keys deleted)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.settings import restore_environ
from kiln.util.net import free_port

PRODUCTION_CONFIG = Path(__file__).resolve().parent / "production.toml"
"""The test deployment's reviewed production config: the shipped one with a team's own model pinned,
the worked example's 60-step Hugging Face staging recipe (``tests/e2e`` deploys kiln's own)."""

ENV_KEYS = ("KILN_HOME", "KILN_AIRFLOW_PORT", "KILN_AIRFLOW_URL", "KILN_MLFLOW_PORT", "KILN_SIGNALS_PORT",
            "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "KILN_DVC_REMOTE",
            "KILN_DVC_REMOTE_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "KILN_PRODUCTION_CONFIG")


def _services_reachable() -> str | None:
    import psycopg2
    import redis

    from kiln.stack import prodlike as prodlike_stack

    try:
        psycopg2.connect(os.environ.get(prodlike_stack.PG_ADMIN_ENV, prodlike_stack.PG_ADMIN_DEFAULT), connect_timeout=3).close()
        redis.Redis.from_url(os.environ.get(prodlike_stack.REDIS_ENV, prodlike_stack.REDIS_DEFAULT), socket_timeout=3).ping()
    except Exception as exc:  # any failure means: this machine lacks the shared services
        return f"PostgreSQL/Redis for the production-like stack not reachable: {exc}"
    return None


@pytest.fixture(scope="package")
def prodlike(tmp_path_factory) -> Iterator[dict[str, str]]:
    from kiln.stack import prodlike as prodlike_stack

    missing = _services_reachable()
    if missing:
        pytest.skip(missing)
    home: Path = tmp_path_factory.mktemp("e2e-prodlike") / "kiln"
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    os.environ["KILN_HOME"] = str(home)
    os.environ["KILN_AIRFLOW_PORT"] = str(free_port())
    os.environ["KILN_MLFLOW_PORT"] = str(free_port())
    os.environ["KILN_SIGNALS_PORT"] = str(free_port())
    os.environ["KILN_PRODUCTION_CONFIG"] = str(PRODUCTION_CONFIG)  # the HF staging recipe
    try:
        info = prodlike_stack.up(timeout=420, quiet=True)
        os.environ.update(prodlike_stack.client_env())  # this process snapshots to the S3 remote too
        yield info
    finally:
        try:
            prodlike_stack.down()
        finally:
            restore_environ(saved)


@pytest.fixture(scope="package")
def login(prodlike):
    """``login(user)`` -> an AirflowClient for one of the stack's FAB users."""
    from kiln.stack import prodlike as prodlike_stack
    from kiln.stack.airflow_client import AirflowClient

    pw = prodlike_stack.passwords()
    # A generous read timeout: one api-server worker on a loaded 2-core machine answers slowly.
    return lambda user: AirflowClient(prodlike["airflow"], user, pw[user], timeout=120)

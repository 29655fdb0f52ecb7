"""Integration fixtures: a real ``mlflow server`` (SQLite + local artifacts) on a free port.

``mlflow_server`` starts one server per test session under a tmp dir (≈5 s on 2 cores);
``mlflow_uri`` points this process at it (``MLFLOW_TRACKING_URI`` + mlflow's global URI) for one
test. Tests share the server, so each uses its own registered-model names (``unique_name``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kiln.errors import ConfigError
from kiln.mlflow_server import MlflowServer, free_port, start_server, stop_server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    home = tmp_path_factory.mktemp("mlflow")
    for attempt in range(3):
        try:
            handle = start_server(home, free_port())
            break
        except ConfigError:  # another process took the free port between probe and bind
            if attempt == 2:
                raise
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture
def mlflow_uri(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    # Fail fast instead of mlflow's default minutes of retries when a test breaks the server.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(mlflow_server.url)
    try:
        yield mlflow_server.url
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(previous)


@pytest.fixture
def unique_name() -> str:
    """A short suffix that keeps one test's registered models apart from another's."""
    return uuid.uuid4().hex[:8]

"""Integration fixtures: a real ``mlflow server`` (SQLite + local artifacts) on a free port, and a
local moto_server standing in for S3 (``moto_endpoint``).

``mlflow_server`` starts one server per test session under a tmp dir (≈5 s on 2 cores);
``mlflow_uri`` points this process at it (``MLFLOW_TRACKING_URI`` + mlflow's global URI) for one
test. Tests share the server, so each uses its own registered-model names (``unique_name``).

For the registry tests: ``logged_models`` stands in for the trainer's model export, and
``RecordingClient`` / ``writes`` record every registry write the code under test sends, in order
(with optional hooks before / after each write, to crash the server at an exact point).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln import registry
from kiln.errors import ConfigError
from kiln.stack.mlflow_server import MlflowServer, free_port, start_server, stop_server
from kiln_devtools.moto import MotoServer


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
    # kiln's own retry loop: short waits, so a test that breaks the server fails in seconds.
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "2")
    monkeypatch.setenv("KILN_REGISTRY_BACKOFF_S", "0.1")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(mlflow_server.url)
    try:
        yield mlflow_server.url
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(previous)


@pytest.fixture
def client(mlflow_uri: str) -> Any:
    """An MlflowClient of the test server (the registry tests' view of what was written)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_uri)


@pytest.fixture
def unique_name() -> str:
    """A short suffix that keeps one test's registered models apart from another's."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def logged_models(monkeypatch) -> list[str]:
    """Stand-in for kiln_trainer.export.log_model: a tiny real pyfunc model in the active run, signed by
    registration's signer before upload like the real one."""
    import mlflow

    class ByteEcho(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input: list[str], params=None) -> list[str]:
            return model_input

    calls: list[str] = []

    class SavedThenSigned:
        """Saves the pyfunc, then signs the directory before Model.log uploads it, as the trainer's export does."""

        def __init__(self, sign: Callable[[Path], None]) -> None:
            self.sign = sign

        def save_model(self, *, path: str, mlflow_model: Any, **kwargs: Any) -> None:
            mlflow.pyfunc.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
            self.sign(Path(path))

    def log_tiny_model(step_dir: str, sign: Callable[[Path], None]) -> str:
        calls.append(step_dir)
        info = mlflow.models.Model.log(artifact_path=None, name=registry.MODEL_ARTIFACT_NAME,
                                       flavor=SavedThenSigned(sign), flavor_name="python_function",
                                       python_model=ByteEcho(), pip_requirements=[])
        return info.model_uri

    monkeypatch.setattr(registry.register, "_log_checkpoint_model", log_tiny_model)
    return calls


Hook = Callable[[str, tuple[str, ...]], None]


class RecordingClient:
    """Wraps the registry's MlflowClient and records every registry write, in order.

    ``before`` / ``after`` (optional) are called with ``(method, args)`` around each write.
    """

    WRITES = ("set_model_version_tag", "set_registered_model_alias", "copy_model_version",
              "create_model_version", "delete_registered_model_alias", "delete_model_version",
              "update_model_version")

    def __init__(self, inner: Any, log: list[tuple], *, before: Hook | None = None, after: Hook | None = None) -> None:
        self._inner, self._log, self._before, self._after = inner, log, before, after

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.WRITES:
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            call = tuple(map(str, args))
            if self._before:
                self._before(name, call)
            self._log.append((name, *call))
            result = attr(*args, **kwargs)
            if self._after:
                self._after(name, call)
            return result

        return recorded


@pytest.fixture
def writes(monkeypatch) -> list[tuple]:
    log: list[tuple] = []
    real_client = registry.mlflow_io._client
    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: RecordingClient(real_client(), log))
    return log


@pytest.fixture
def recording_client() -> type[RecordingClient]:
    """The ``RecordingClient`` class, for tests that wrap the client with hooks of their own."""
    return RecordingClient


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local moto_server standing in for S3, one per test module: its endpoint URL."""
    moto = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield moto.url
    finally:
        moto.stop()

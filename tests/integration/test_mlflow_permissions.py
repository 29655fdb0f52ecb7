"""MLflow basic-auth separation: a sandbox identity cannot write production names (issue 8).

One real ``mlflow server --app-name basic-auth`` (its own, not the session's open server) in a tmp
dir, provisioned by ``kiln.mlflow_auth``; then each identity talks to it through a plain
``MlflowClient`` with its credentials in ``MLFLOW_TRACKING_USERNAME/PASSWORD``, as a task would.
The last test proves the library refuses before any request: no HTTP request leaves the process.

Passwords are generated per test session (``secrets``), never taken from a tracked file.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln import mlflow_auth, registry
from kiln.errors import ConfigError, PolicyError
from kiln.mlflow_server import MlflowServer, free_port, log_tail, server_command, stop_server
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX
from kiln.refs import Decision

pytestmark = pytest.mark.slow

ADMIN, PROD_USER, SANDBOX_USER = "kiln-admin", "kiln-production", "kiln-sandbox"
SOURCE = "s3://kiln-test-bucket/model"
"""Model-version source: only metadata here, nothing reads it."""


def _password() -> str:
    return secrets.token_urlsafe(18)


@dataclasses.dataclass
class AuthServer:
    handle: MlflowServer
    url: str
    passwords: dict[str, str]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:  # noqa: S310 (loopback)
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    # Started here, not with kiln.mlflow_server.start_server: that takes no extra arguments or
    # environment yet (see docs/separation.md, "changes needed elsewhere").
    home = tmp_path_factory.mktemp("mlflow-auth")
    passwords = {ADMIN: _password(), PROD_USER: _password(), SANDBOX_USER: _password()}
    mlflow_auth.write_auth_config(home, passwords[ADMIN], admin_username=ADMIN)
    port = free_port()
    artifacts = home / "artifacts"
    artifacts.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env |= {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PYTHONUNBUFFERED": "1",
            **mlflow_auth.server_env(home, passwords[ADMIN])}  # fmt: skip
    log_path = home / "mlflow.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 (closed by stop_server)
    cmd = [*server_command(home, port, f"sqlite:///{home / 'mlflow.db'}", str(artifacts), 1),
           *mlflow_auth.SERVER_ARGS]  # fmt: skip
    process = subprocess.Popen(cmd, cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    handle = MlflowServer(process=process, url=f"http://127.0.0.1:{port}", home=home, log_path=log_path,
                          port=port, _log_file=log_file)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not _healthy(handle.url):
            assert process.poll() is None, f"mlflow server exited:\n{log_tail(log_path)}"
            assert time.monotonic() < deadline, f"mlflow server not healthy:\n{log_tail(log_path)}"
            time.sleep(0.25)
        yield AuthServer(handle=handle, url=handle.url, passwords=passwords)
    finally:
        stop_server(handle)
    # Nothing this module wrote may hold a credential.
    for path in home.rglob("*"):
        if path.is_file() and path.suffix in (".ini", ".log", "") and path.stat().st_size < 10_000_000:
            text = path.read_bytes()
            for password in passwords.values():
                assert password.encode() not in text, f"a password leaked into {path}"


@pytest.fixture(scope="module")
def provisioned(auth_server: AuthServer) -> AuthServer:
    pw = auth_server.passwords
    kwargs = dict(production_user=PROD_USER, production_password=pw[PROD_USER],
                  sandbox_user=SANDBOX_USER, sandbox_password=pw[SANDBOX_USER])  # fmt: skip
    first = mlflow_auth.provision_identities(auth_server.url, ADMIN, pw[ADMIN], **kwargs)
    second = mlflow_auth.provision_identities(auth_server.url, ADMIN, pw[ADMIN], **kwargs)  # idempotent
    assert first == second
    return auth_server


@pytest.fixture
def as_user(provisioned: AuthServer, monkeypatch: pytest.MonkeyPatch) -> Callable:
    """``with as_user(name) as client``: an MlflowClient that sends ``name``'s credentials."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

    @contextmanager
    def use(username: str) -> Iterator[MlflowClient]:
        with monkeypatch.context() as m:
            m.setenv("MLFLOW_TRACKING_USERNAME", username)
            m.setenv("MLFLOW_TRACKING_PASSWORD", provisioned.passwords[username])
            yield MlflowClient(tracking_uri=provisioned.url, registry_uri=provisioned.url)

    return use


def _denied(call: Callable[[], object]) -> None:
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as info:
        call()
    assert info.value.error_code == "PERMISSION_DENIED", info.value
    assert info.value.get_http_status_code() == 403


def test_auth_config_holds_no_credential(tmp_path: Path) -> None:
    password = _password()
    path = mlflow_auth.write_auth_config(tmp_path, password)
    text = path.read_text()
    assert password not in text
    assert "default_permission = READ" in text and "auth_cache_ttl_seconds = 60" in text
    assert path.stat().st_mode & 0o077 == 0 and path.parent.stat().st_mode & 0o077 == 0
    env = mlflow_auth.server_env(tmp_path, password)
    key_file = path.parent / mlflow_auth.SECRET_KEY_NAME
    assert key_file.stat().st_mode & 0o077 == 0
    mlflow_auth.write_auth_config(tmp_path, password)  # per install: the key survives a rewrite
    assert mlflow_auth.server_env(tmp_path, password) == env
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == key_file.read_text().strip()
    assert len(env["MLFLOW_FLASK_SERVER_SECRET_KEY"]) >= 64
    with pytest.raises(ConfigError):
        mlflow_auth.write_auth_config(tmp_path, "short")
    with pytest.raises(ConfigError):
        mlflow_auth.provision_identities("http://127.0.0.1:9", "admin", password, production_user="same",
                                         production_password=password, sandbox_user="same",
                                         sandbox_password=password)  # fmt: skip


def test_provisioned_permissions(provisioned: AuthServer) -> None:
    url, admin_pw = provisioned.url, provisioned.passwords[ADMIN]
    for model in PRODUCTION.writable_models:
        assert mlflow_auth.effective_permission(url, ADMIN, admin_pw, PROD_USER, model) == "EDIT"
        assert mlflow_auth.effective_permission(url, ADMIN, admin_pw, SANDBOX_USER, model) == "READ"
    for model in SANDBOX.writable_models:
        assert mlflow_auth.effective_permission(url, ADMIN, admin_pw, SANDBOX_USER, model) == "EDIT"


def test_sandbox_identity_cannot_write_production(as_user: Callable) -> None:
    with as_user(PROD_USER) as prod:  # a champion to protect
        champion = prod.create_model_version(PRODUCTION_MODEL, SOURCE)
        prod.set_registered_model_alias(PRODUCTION_MODEL, PRODUCTION.alias, champion.version)

    with as_user(SANDBOX_USER) as sandbox:
        # Reads work: the sandbox compares itself against the production champion.
        assert sandbox.get_registered_model(PRODUCTION_MODEL).name == PRODUCTION_MODEL
        assert sandbox.get_model_version_by_alias(PRODUCTION_MODEL, PRODUCTION.alias).version == champion.version
        # Every write on a production name is refused by the server.
        for model in PRODUCTION.writable_models:
            _denied(lambda m=model: sandbox.create_model_version(m, SOURCE))
        _denied(lambda: sandbox.set_registered_model_alias(PRODUCTION_MODEL, PRODUCTION.alias, champion.version))
        _denied(lambda: sandbox.delete_registered_model_alias(PRODUCTION_MODEL, PRODUCTION.alias))
        _denied(lambda: sandbox.set_model_version_tag(PRODUCTION_MODEL, champion.version, "kiln.review", "approved"))
        _denied(lambda: sandbox.set_registered_model_tag(PRODUCTION_MODEL, "owner", "sandbox"))
        _denied(lambda: sandbox.delete_model_version(PRODUCTION_MODEL, champion.version))
        _denied(lambda: sandbox.rename_registered_model(PRODUCTION_MODEL, "stolen"))
        # Its own model is writable.
        own = sandbox.create_model_version(SANDBOX.target_model, SOURCE)
        sandbox.set_model_version_tag(SANDBOX.target_model, own.version, "kiln.policy", "sandbox")
        sandbox.set_registered_model_alias(SANDBOX.target_model, SANDBOX.alias, own.version)
        assert sandbox.get_model_version_by_alias(SANDBOX.target_model, SANDBOX.alias).version == own.version

    with as_user(PROD_USER) as prod:  # nothing moved; the production identity still writes
        assert prod.get_model_version_by_alias(PRODUCTION_MODEL, PRODUCTION.alias).version == champion.version
        candidate = prod.create_model_version(PRODUCTION.candidate_model, SOURCE)
        prod.set_model_version_tag(PRODUCTION.candidate_model, candidate.version, "kiln.review", "approved")
        nxt = prod.create_model_version(PRODUCTION_MODEL, SOURCE)
        prod.set_registered_model_alias(PRODUCTION_MODEL, PRODUCTION.alias, nxt.version)
        assert prod.get_model_version_by_alias(PRODUCTION_MODEL, PRODUCTION.alias).version == nxt.version
        # ... but not the sandbox's model beyond reading it (default READ).
        _denied(lambda: prod.create_model_version(SANDBOX.target_model, SOURCE))


def test_sandbox_identity_cannot_squat_or_regain_production(provisioned: AuthServer, as_user: Callable) -> None:
    with as_user(SANDBOX_USER) as sandbox:
        from mlflow.exceptions import MlflowException

        # The names exist (the admin created them), so the sandbox cannot create them and own them.
        with pytest.raises(MlflowException) as info:
            sandbox.create_registered_model(PRODUCTION_MODEL)
        assert info.value.error_code in ("RESOURCE_ALREADY_EXISTS", "PERMISSION_DENIED")
        # Nor grant itself more.
        from mlflow.server.auth.client import AuthServiceClient

        _denied(lambda: AuthServiceClient(provisioned.url).grant_user_permission(
            SANDBOX_USER, "registered_model", PRODUCTION_MODEL, "MANAGE"))  # fmt: skip
    # A wrong password gets nothing.
    with as_user(SANDBOX_USER) as sandbox, pytest.MonkeyPatch.context() as m:
        m.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
        from mlflow.exceptions import MlflowException

        with pytest.raises(MlflowException) as info:
            sandbox.get_registered_model(PRODUCTION_MODEL)
        assert info.value.get_http_status_code() == 401


def test_provisioning_repairs_drift(provisioned: AuthServer) -> None:
    """A sandbox identity that somehow holds MANAGE on a production name loses it on the next run."""
    url, pw = provisioned.url, provisioned.passwords
    admin = mlflow_auth._admin_client(url, ADMIN, pw[ADMIN])
    admin.revoke_user_permission(SANDBOX_USER, "registered_model", PRODUCTION_MODEL)
    admin.grant_user_permission(SANDBOX_USER, "registered_model", PRODUCTION_MODEL, "MANAGE")
    assert mlflow_auth.effective_permission(url, ADMIN, pw[ADMIN], SANDBOX_USER, PRODUCTION_MODEL) == "MANAGE"
    mlflow_auth.provision_identities(url, ADMIN, pw[ADMIN], production_user=PROD_USER,
                                     production_password=pw[PROD_USER], sandbox_user=SANDBOX_USER,
                                     sandbox_password=pw[SANDBOX_USER])  # fmt: skip
    assert mlflow_auth.effective_permission(url, ADMIN, pw[ADMIN], SANDBOX_USER, PRODUCTION_MODEL) == "READ"


def test_library_refuses_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox policy raises PolicyError with no request sent (no client, no HTTP)."""
    import requests

    sent: list[str] = []
    monkeypatch.setattr(requests.Session, "request", lambda self, method, url, *a, **k: sent.append(url))
    monkeypatch.setattr(registry, "_client", lambda: sent.append("registry._client") or pytest.fail("client made"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # a request would not reach a server anyway

    # The policy object itself cannot name a production model...
    with pytest.raises(PolicyError):
        dataclasses.replace(SANDBOX, target_model=PRODUCTION_MODEL)
    with pytest.raises(PolicyError):
        dataclasses.replace(SANDBOX, writable_models=(*SANDBOX.writable_models, PRODUCTION_MODEL))
    # ... and a forged one (construction checks bypassed) is still refused at the write.
    forged = copy.copy(SANDBOX)
    object.__setattr__(forged, "target_model", PRODUCTION_MODEL)
    decision = Decision(action="promote", reasons=["forged"], candidate_bits_per_byte=1.0)
    with pytest.raises(PolicyError, match="may not write registered model 'kiln-stdlib-lm'"):
        registry.promote(policy=forged, candidate_version="1", decision=decision, approver="mallory",
                         run_key="kiln_sandbox/forged")  # fmt: skip
    for model in PRODUCTION.writable_models:
        with pytest.raises(PolicyError):
            registry.rollback(model, SANDBOX, actor="mallory")
        with pytest.raises(PolicyError):
            SANDBOX.check_model_write(model)
    forged_candidate = copy.copy(SANDBOX)
    object.__setattr__(forged_candidate, "candidate_model", PRODUCTION.candidate_model)
    with pytest.raises(PolicyError):
        registry.record_review(policy=forged_candidate, candidate_version="1", outcome="approved",
                               reviewer="mallory", at="2026-01-01T00:00:00Z")  # fmt: skip
    assert PolicyError.retryable is False
    assert sent == []

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln import mlflow_auth, registry
from kiln.errors import ConfigError, PolicyError
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX
from kiln.refs import Decision
from kiln.runs import RUN_KEY_TAG, experiment_name
from kiln.stack.mlflow_server import MlflowServer, free_port, start_server, stop_server

pytestmark = pytest.mark.slow

ADMIN, PROD_USER, SANDBOX_USER, READER = "kiln-admin", "kiln-production", "kiln-sandbox", "kiln-reader"
SOURCE = "s3://kiln-test-bucket/model"
"""Model-version source: only metadata here, nothing reads it."""


def _password() -> str:
    return secrets.token_urlsafe(18)


@dataclasses.dataclass
class AuthServer:
    handle: MlflowServer
    url: str
    passwords: dict[str, str]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    home = tmp_path_factory.mktemp("mlflow-auth")
    passwords = {ADMIN: _password(), PROD_USER: _password(), SANDBOX_USER: _password(), READER: _password()}
    mlflow_auth.write_auth_config(home, passwords[ADMIN], admin_username=ADMIN)
    handle = start_server(home, free_port(), timeout_s=300, extra_args=mlflow_auth.SERVER_ARGS,
                          extra_env=mlflow_auth.server_env(home, passwords[ADMIN]))
    assert passwords[ADMIN] not in repr(handle), "the handle's repr must not show the server's secrets"
    try:
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
    kwargs = {"production_user": PROD_USER, "production_password": pw[PROD_USER],
              "sandbox_user": SANDBOX_USER, "sandbox_password": pw[SANDBOX_USER],
              "reader_user": READER, "reader_password": pw[READER]}
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
                                         sandbox_password=password)


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


def test_reader_identity_reads_every_policy_and_writes_nothing_of_kiln(provisioned: AuthServer, as_user: Callable) -> None:
    """The api-server's identity (the "kiln run" view looks a DAG run's MLflow run up): READ only."""
    url, admin_pw = provisioned.url, provisioned.passwords[ADMIN]
    for model in (*PRODUCTION.writable_models, *SANDBOX.writable_models):
        assert mlflow_auth.effective_permission(url, ADMIN, admin_pw, READER, model) == "READ"
    with as_user(PROD_USER) as prod:
        experiment = prod.get_experiment_by_name(experiment_name(PRODUCTION))
        run = prod.create_run(experiment.experiment_id, tags={RUN_KEY_TAG: "kiln_production/r"})
    with as_user(READER) as reader:
        found = reader.search_runs([experiment.experiment_id],
                                   filter_string=f"tags.`{RUN_KEY_TAG}` = 'kiln_production/r'")
        assert [r.info.run_id for r in found] == [run.info.run_id]
        assert reader.get_registered_model(PRODUCTION_MODEL).name == PRODUCTION_MODEL
        _denied(lambda: reader.create_run(experiment.experiment_id))
        _denied(lambda: reader.set_tag(run.info.run_id, "kiln.review", "approved"))
        for model in (*PRODUCTION.writable_models, *SANDBOX.writable_models):
            _denied(lambda m=model: reader.create_model_version(m, SOURCE))
    with pytest.raises(ConfigError, match="different users"):
        mlflow_auth.provision_identities(url, ADMIN, admin_pw, production_user=PROD_USER,
                                         production_password=provisioned.passwords[PROD_USER],
                                         sandbox_user=SANDBOX_USER, sandbox_password=provisioned.passwords[SANDBOX_USER],
                                         reader_user=SANDBOX_USER, reader_password=provisioned.passwords[SANDBOX_USER])


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
            SANDBOX_USER, "registered_model", PRODUCTION_MODEL, "MANAGE"))
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
                                     sandbox_password=pw[SANDBOX_USER])
    assert mlflow_auth.effective_permission(url, ADMIN, pw[ADMIN], SANDBOX_USER, PRODUCTION_MODEL) == "READ"


def test_library_refuses_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox policy raises PolicyError with no request sent (no client, no HTTP)."""
    import requests

    sent: list[str] = []
    monkeypatch.setattr(requests.Session, "request", lambda self, method, url, *a, **k: sent.append(url))
    monkeypatch.setattr(registry.mlflow_io, "_client",
                        lambda: sent.append("registry.mlflow_io._client") or pytest.fail("client made"))
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
        registry.promote(policy=forged, candidate_version="1", decision=decision, run_key="kiln_sandbox/forged",
                         manual_approver="mallory")
    for model in PRODUCTION.writable_models:
        with pytest.raises(PolicyError):
            registry.rollback(model, SANDBOX, actor="mallory", reason="forged")
        with pytest.raises(PolicyError):
            SANDBOX.check_model_write(model)
    forged_candidate = copy.copy(SANDBOX)
    object.__setattr__(forged_candidate, "candidate_model", PRODUCTION.candidate_model)
    with pytest.raises(PolicyError):
        registry.record_review(policy=forged_candidate, candidate_version="1", run_key="kiln_sandbox/forged",
                               outcome="rejected", reviewer="mallory", at="2026-01-01T00:00:00Z")
    assert PolicyError.retryable is False
    assert sent == []


def _kiln_version(client, model: str, bits_per_byte: float, run_key: str, decision=None):
    """A version with the tags kiln's registry reads (run key, evaluation; the gate's decision, as
    registration records it on a candidate), made by ``client``."""
    tags = {RUN_KEY_TAG: run_key, **registry.tags._eval_tags(_report(bits_per_byte)),
            **(registry.tags._decision_tags(decision) if decision is not None else {})}
    return client.create_model_version(model, SOURCE, tags=tags)


def _report(bits_per_byte: float):
    from kiln.refs import EvalReport

    return EvalReport(checkpoint="/ckpt", weights_sha256="0" * 64, split="eval", bits_per_byte=bits_per_byte,
                      loss=bits_per_byte * 0.69, tokens=4096)


def test_library_acting_as_each_policys_identity(provisioned: AuthServer, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path, logged_models: list[str]) -> None:
    """Through kiln's own registry calls: with the code guards forged away (the policy's names, and its
    name too, so that the candidate verifies with the keys that signed it), the sandbox identity is
    still refused by the server (PolicyError, never retried) on production names — no version
    created, no alias moved, no tag written — while the production identity does the same calls.

    The candidate is registered by ``register_candidate`` (signed before upload, through the auth
    server's artifact proxy), since ``promote`` verifies a candidate's files and signatures before
    its first write; so is the version ``previous`` names, which ``rollback`` verifies before its first."""
    from mlflow import MlflowClient

    from kiln.mlflow_auth import MlflowIdentity, use_identity

    from test_registry_mlflow import make_candidate  # tests/integration is on sys.path

    pw = provisioned.passwords
    monkeypatch.setenv("MLFLOW_TRACKING_URI", provisioned.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "3")
    waits: list[float] = []
    monkeypatch.setattr(registry.mlflow_io, "_sleep", waits.append)
    production = MlflowIdentity(PROD_USER, pw[PROD_USER], source="test")
    sandbox = MlflowIdentity(SANDBOX_USER, pw[SANDBOX_USER], source="test")
    assert pw[SANDBOX_USER] not in repr(sandbox)
    key = f"kiln_production/identity-{secrets.token_hex(4)}"

    with use_identity(production):
        client = MlflowClient(tracking_uri=provisioned.url, registry_uri=provisioned.url)
        current = _kiln_version(client, PRODUCTION_MODEL, 2.9, f"{key}-current")
        client.set_registered_model_alias(PRODUCTION_MODEL, PRODUCTION.alias, current.version)
        # the version a rollback restores is verified first (and its rollback signed): registered and signed,
        # then copied into the production model as promote copies a candidate
        old_cand = make_candidate(tmp_path, "old", 3.0)
        old_ref = registry.register_candidate(policy=PRODUCTION, run_key=f"{key}-old", **old_cand.kwargs())
        old = client.copy_model_version(f"models:/{PRODUCTION.candidate_model}/{old_ref['version']}", PRODUCTION_MODEL)
        client.set_registered_model_alias(PRODUCTION_MODEL, registry.PREVIOUS_ALIAS, old.version)
        cand = make_candidate(tmp_path, "candidate", 2.8)
        decision = registry.decide(cand.eval_report, _report(2.9), PRODUCTION.gate)
        assert decision.action == "promote"
        ref = registry.register_candidate(policy=PRODUCTION, run_key=key, decision=decision, **cand.kwargs())
        assert logged_models, "registered through kiln's registration (signed before upload)"
        candidate = client.get_model_version(PRODUCTION.candidate_model, ref["version"])
        count_before = len(client.search_model_versions(f"name = '{PRODUCTION_MODEL}'"))

    forged = copy.copy(SANDBOX)  # the code guards bypassed: only the server stands in the way
    for name in ("name", "writable_models", "candidate_model", "target_model", "alias"):
        object.__setattr__(forged, name, getattr(PRODUCTION, name))
    with use_identity(sandbox):
        with pytest.raises(PolicyError, match=f"{SANDBOX_USER}.*403"):
            registry.promote(policy=forged, candidate_version=candidate.version, decision=decision,
                             run_key="kiln_sandbox/forged", manual_approver="mallory")
        with pytest.raises(PolicyError, match="403"):
            registry.rollback(PRODUCTION_MODEL, forged, "mallory", reason="forged")
        with pytest.raises(PolicyError, match="403"):
            registry.record_review(policy=forged, candidate_version=candidate.version, run_key=key,
                                   outcome="rejected", reviewer="mallory", at="2026-01-01T00:00:00+00:00")
    assert waits == [], "a refusal by the server is not retried"

    with use_identity(production):
        client = MlflowClient(tracking_uri=provisioned.url, registry_uri=provisioned.url)
        assert client.get_model_version_by_alias(PRODUCTION_MODEL, PRODUCTION.alias).version == current.version
        assert client.get_model_version_by_alias(PRODUCTION_MODEL, registry.PREVIOUS_ALIAS).version == old.version
        assert len(client.search_model_versions(f"name = '{PRODUCTION_MODEL}'")) == count_before
        assert "kiln.review" not in client.get_model_version(PRODUCTION.candidate_model, candidate.version).tags
        # The same calls as the production identity go through (the review as the approval task records it).
        registry.record_review(policy=PRODUCTION, candidate_version=candidate.version, run_key=key,
                               outcome="approved", reviewer="reviewer", at=registry.utc_now())
        record = registry.promote(policy=PRODUCTION, candidate_version=candidate.version, decision=decision,
                                  run_key=key)
        assert client.get_model_version_by_alias(PRODUCTION_MODEL, PRODUCTION.alias).version == record.version
        assert record.previous_version == current.version
    # Outside the block the process is anonymous again: a write is refused as unauthenticated.
    assert "MLFLOW_TRACKING_USERNAME" not in os.environ
    with pytest.raises(ConfigError, match="401"):
        registry.record_review(policy=PRODUCTION, candidate_version=candidate.version, run_key=key,
                               outcome="rejected", reviewer="nobody", at="2026-01-01T00:00:00+00:00")

"""MLflow basic-auth for the production-like stack: config, server environment, identities.

The MLflow layer of the sandbox/production separation (``docs/separation.md``). The server runs
``mlflow server --app-name basic-auth`` (``SERVER_ARGS``) with the environment from
``server_env``; then ``provision_identities`` (as the admin) makes the registry look like this::

    registered model / experiment            production identity   sandbox identity
    PRODUCTION.writable_models               EDIT                  READ (explicit grant)
    SANDBOX.writable_models                  READ (default)        EDIT
    experiment kiln-production               EDIT                  READ (explicit grant)
    experiment kiln-sandbox                  READ (default)        EDIT
    anything else                            READ (default_permission)

Every name a policy may write is created by the admin *before* any identity can touch it: the
creator of a registered model or experiment gets MANAGE on it, so a sandbox identity that got to
a production name first would own it. Provisioning also overwrites any grant an identity already
holds (a MANAGE from an earlier create becomes READ), so running it again repairs drift.

Credentials: passwords come from the caller (environment, Airflow connection, secrets backend)
and are never written to disk by this module. The admin password reaches the server as
``MLFLOW_AUTH_ADMIN_PASSWORD`` (only read to create the admin on first start); the auth config
file holds no credential. The Flask secret key (CSRF) is generated once per install into
``HOME/auth/flask_secret_key`` (mode 0600) unless ``KILN_MLFLOW_SECRET_KEY`` provides one.
Clients authenticate with ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``.

Per-policy client identity (``MlflowIdentity``): every task of a DAG talks to MLflow as its
policy's identity, taken from the Airflow connection ``Policy.mlflow_conn_id`` (resolved by the
Airflow adapter, ``kiln.airflow.dagfactory``) or from ``KILN_MLFLOW_<POLICY>_USERNAME`` / ``_PASSWORD``;
``use_identity`` puts it into ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` for the duration of one
task (the task's own process and the trainer it launches), and removes any other identity the
worker's environment carried, so a sandbox task can never act with production credentials that
happen to be in the worker's environment.

Importing this module is cheap: mlflow is imported inside the functions.
"""

from __future__ import annotations

import configparser
import contextlib
import logging
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError, RegistryError
from kiln.policy import POLICIES, Policy
from kiln.settings import restore_environ
from kiln.util.fs import write_private

if TYPE_CHECKING:
    from mlflow.server.auth.client import AuthServiceClient

log = logging.getLogger(__name__)

APP_NAME = "basic-auth"
SERVER_ARGS = ("--app-name", APP_NAME)
"""Extra ``mlflow server`` arguments that switch the auth app on."""
AUTH_DIR = "auth"
CONFIG_NAME = "basic_auth.ini"
SECRET_KEY_NAME = "flask_secret_key"
SECRET_KEY_ENV = "KILN_MLFLOW_SECRET_KEY"
"""Optional: the Flask secret key from a secrets backend (must be equal on every server replica)."""
DEFAULT_PERMISSION = "READ"
AUTH_CACHE_TTL_S = 60
"""Credential cache per worker: without it each request pays a PBKDF2 check (~0.4 s on 2 cores)."""
MIN_PASSWORD_LEN = 12
"""mlflow's own password policy (``mlflow.utils.validation._validate_password``)."""
REGISTERED_MODEL = "registered_model"
EXPERIMENT = "experiment"
WRITE_PERMISSIONS = ("EDIT", "MANAGE")


def _check_password(what: str, password: str | None) -> str:
    if not password or len(password) < MIN_PASSWORD_LEN:
        raise ConfigError(f"{what} must be at least {MIN_PASSWORD_LEN} characters (take it from the environment "
                          "or a secrets backend)")
    if password == "password":  # the legacy default mlflow refuses; named for the error
        raise ConfigError(f"{what} is mlflow's old default password")
    return password


def write_auth_config(home: Path, admin_password: str, *, admin_username: str = "admin",
                      database_uri: str | None = None, auth_cache_ttl_seconds: int = AUTH_CACHE_TTL_S) -> Path:
    """Write ``HOME/auth/basic_auth.ini`` (and the per-install secret key) and return its path.

    ``default_permission = READ``; the user store is ``database_uri`` (default
    ``sqlite:///HOME/auth/basic_auth.db``; a PostgreSQL URI with a password makes this file a
    secret too: it is written 0600 in a 0700 folder outside the repository either way). The admin
    password is only checked here (mlflow refuses short ones at start, with a less clear error)
    and is NOT written: pass it to the server with ``server_env``. Idempotent: the secret key of
    an install is kept, so a restart keeps sessions valid.
    """
    _check_password("the MLflow admin password", admin_password)
    auth_dir = Path(home).resolve() / AUTH_DIR
    auth_dir.mkdir(parents=True, exist_ok=True)
    auth_dir.chmod(0o700)
    _secret_key(auth_dir)
    config = configparser.ConfigParser()
    config["mlflow"] = {
        "default_permission": DEFAULT_PERMISSION,
        "database_uri": database_uri or f"sqlite:///{auth_dir / 'basic_auth.db'}",
        "admin_username": admin_username,
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
        "grant_default_workspace_access": "false",
        "auth_cache_ttl_seconds": str(auth_cache_ttl_seconds),
    }
    path = auth_dir / CONFIG_NAME
    lines = ["# Written by kiln.mlflow_auth.write_auth_config. No admin password here: it",
             "# comes from MLFLOW_AUTH_ADMIN_PASSWORD (server_env), the secret key from flask_secret_key."]
    body = "\n".join(f"{k} = {v}" for k, v in config["mlflow"].items())
    write_private(path, "\n".join(lines) + "\n[mlflow]\n" + body + "\n")
    return path


def _secret_key(auth_dir: Path) -> str:
    from_env = os.environ.get(SECRET_KEY_ENV)
    if from_env:
        return from_env
    path = auth_dir / SECRET_KEY_NAME
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key:
        key = secrets.token_hex(32)
        write_private(path, key + "\n")
    return key


def server_env(home: Path, admin_password: str) -> dict[str, str]:
    """Environment additions for ``mlflow server --app-name basic-auth`` (config, admin, secret key).

    Call ``write_auth_config`` first. The result holds secrets: put it in the server's
    environment only, never in a log or a file.
    """
    auth_dir = Path(home).resolve() / AUTH_DIR
    config = auth_dir / CONFIG_NAME
    if not config.is_file():
        raise ConfigError(f"no MLflow auth config at {config}; call write_auth_config first")
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": _check_password("the MLflow admin password", admin_password),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret_key(auth_dir),
    }


# ------------------------------------------------------------------------------ provisioning


def _admin_client(tracking_uri: str, username: str, password: str) -> AuthServiceClient:
    """mlflow's basic-auth client (``get_app_client``) that sends the admin's credentials.

    The stock client reads ``MLFLOW_TRACKING_USERNAME/PASSWORD`` from the process environment;
    here the credentials are bound to this one client, so provisioning never changes the
    environment the caller's other clients (or child processes) see.
    """
    from mlflow.server import get_app_client
    from mlflow.utils.credentials import MlflowHostCreds
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    client = get_app_client(APP_NAME, tracking_uri=tracking_uri)
    creds = MlflowHostCreds(tracking_uri, username=username, password=password)

    def request(endpoint: str, method: str, *, expected_status: int = 200, **kwargs: Any) -> dict[str, Any]:
        resp = verify_rest_response(http_request(creds, endpoint, method, **kwargs), endpoint,
                                    expected_status=expected_status)
        return {} if resp.status_code == 204 or not resp.content else resp.json()

    client._request = request
    return client


def _error_code(exc: Exception) -> str | None:
    return getattr(exc, "error_code", None)


@dataclass(frozen=True, slots=True)
class Grant:
    username: str
    resource_type: str
    """``registered_model`` or ``experiment``."""
    resource: str
    """Registered-model name or experiment name (granted on its id)."""
    permission: str


def planned_grants(policies: Iterable[Policy], owners: dict[str, str], readers: Iterable[str] = ()) -> list[Grant]:
    """The grants that make each policy's names writable only by its own identity.

    ``owners`` maps policy name → username. The owner of a policy gets EDIT on its writable
    models and its experiment; every other identity gets an explicit READ on the production
    policy's names (explicit so that it overrides any MANAGE/EDIT the identity held before).
    Each of ``readers`` (e.g. the Airflow api-server's run view) gets an explicit READ on every
    policy's names and nothing else.
    """
    from kiln.runs import experiment_name  # the experiment every stage of a run logs into

    grants: list[Grant] = []
    for policy in policies:
        owner = owners[policy.name]
        names = [(REGISTERED_MODEL, m) for m in policy.writable_models] + [(EXPERIMENT, experiment_name(policy))]
        for rtype, name in names:
            grants.append(Grant(owner, rtype, name, "EDIT"))
            if policy.name == "production":
                grants += [Grant(other, rtype, name, "READ") for other in owners.values() if other != owner]
            grants += [Grant(reader, rtype, name, "READ") for reader in readers]
    return grants


def provision_identities(
    tracking_uri: str,
    admin_user: str,
    admin_password: str,
    *,
    production_user: str,
    production_password: str,
    sandbox_user: str,
    sandbox_password: str,
    reader_user: str | None = None,
    reader_password: str | None = None,
    policies: Iterable[Policy] | None = None,
) -> list[Grant]:
    """Create (or update) the production and sandbox identities and grant per-model permissions.

    ``reader_user`` (optional): a read-only identity (READ on every policy's models and
    experiment, no write grant on any kiln name) for processes that only look things up, such as
    the Airflow api-server's "kiln run" view.

    Idempotent: existing users get the given password (so this also rotates), existing grants
    are changed to the planned permission. Refuses (``ConfigError``) identities that share a
    name, that are the admin, or that are MLflow admins (an admin bypasses every permission).
    Returns the grants in force. ``RegistryError`` when the server refuses a step.
    """
    from mlflow.exceptions import MlflowException

    policies = list(POLICIES.values() if policies is None else policies)
    users = {production_user: production_password, sandbox_user: sandbox_password}
    readers = [reader_user] if reader_user else []
    if reader_user:
        users[reader_user] = reader_password or ""
    if len(users) != 2 + len(readers) or admin_user in users:
        raise ConfigError("the production, sandbox, reader and admin MLflow identities must be different users")
    for user, password in users.items():
        _check_password(f"the password of MLflow user {user!r}", password)
    owners = {"production": production_user, "sandbox": sandbox_user}
    unknown = [p.name for p in policies if p.name not in owners]
    if unknown:
        raise ConfigError(f"no MLflow identity for policies {unknown}")

    auth = _admin_client(tracking_uri, admin_user, admin_password)
    step = "connecting"
    try:
        for user, password in users.items():
            step = f"provisioning user {user!r}"
            try:
                existing = auth.get_user(user)
            except MlflowException as exc:
                if _error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
                    raise
                auth.create_user(user, password)
                log.info("created MLflow user %s", user)
            else:
                if existing.is_admin:
                    raise ConfigError(f"MLflow user {user!r} is an admin: it would bypass every permission")
                auth.update_user_password(user, password)

        ids = _ensure_resources(auth, policies)
        grants = planned_grants(policies, owners, readers)
        for grant in grants:
            step = f"granting {grant}"
            _set_permission(auth, grant.username, grant.resource_type, ids[grant.resource_type, grant.resource],
                            grant.permission)
    except MlflowException as exc:
        raise RegistryError(f"MLflow auth provisioning failed while {step}: {exc}") from exc
    return grants


def _ensure_resources(auth: AuthServiceClient, policies: list[Policy]) -> dict[tuple[str, str], str]:
    """Create, as the admin, every registered model and experiment the policies write.

    Returns ``(resource_type, name) → resource id`` (models are keyed by name, experiments by id).
    """
    from mlflow.exceptions import MlflowException

    from kiln.runs import experiment_name

    ids: dict[tuple[str, str], str] = {}
    request = auth._request
    for policy in policies:
        for model in policy.writable_models:
            try:
                request("/api/2.0/mlflow/registered-models/create", "POST", json={"name": model})
                log.info("created registered model %s", model)
            except MlflowException as exc:
                if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                    raise
            ids[REGISTERED_MODEL, model] = model
        name = experiment_name(policy)
        try:
            found = request("/api/2.0/mlflow/experiments/get-by-name", "GET", params={"experiment_name": name})
            ids[EXPERIMENT, name] = found["experiment"]["experiment_id"]
        except MlflowException as exc:
            if _error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
                raise
            created = request("/api/2.0/mlflow/experiments/create", "POST", json={"name": name})
            ids[EXPERIMENT, name] = created["experiment_id"]
            log.info("created experiment %s", name)
    return ids


def _set_permission(auth: AuthServiceClient, username: str, resource_type: str, resource_id: str,
                    permission: str) -> None:
    """Grant ``permission`` exactly (insert, or replace a different existing grant)."""
    from mlflow.exceptions import MlflowException

    try:
        auth.grant_user_permission(username, resource_type, resource_id, permission)
        return
    except MlflowException as exc:
        if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
    if auth.get_user_permission(username, resource_type, resource_id).permission == permission:
        return
    auth.revoke_user_permission(username, resource_type, resource_id)
    auth.grant_user_permission(username, resource_type, resource_id, permission)


def effective_permission(tracking_uri: str, admin_user: str, admin_password: str, username: str,
                         model: str) -> str:
    """What the server resolves for ``username`` on registered model ``model`` (e.g. ``READ``)."""
    auth = _admin_client(tracking_uri, admin_user, admin_password)
    return str(auth.get_user_permission(username, REGISTERED_MODEL, model).permission)


# ------------------------------------------------------------------------- client identities

USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"  # a variable name, not a password


@dataclass(frozen=True, slots=True)
class MlflowIdentity:
    """Who a task is to MLflow. The password never appears in ``repr`` (logs, tracebacks)."""

    username: str
    password: str = field(repr=False)
    source: str = ""
    """Where it came from, for messages: ``connection kiln_mlflow_production``, ``environment``."""

    def __post_init__(self) -> None:
        if not self.username or not self.password:
            raise ConfigError(f"MLflow identity from {self.source or 'unknown source'} needs a login and a password")


def identity_env_names(policy: Policy) -> tuple[str, str]:
    """``KILN_MLFLOW_<POLICY>_USERNAME`` / ``_PASSWORD``: the identity without an Airflow connection."""
    prefix = f"KILN_MLFLOW_{policy.name.upper()}"
    return f"{prefix}_USERNAME", f"{prefix}_PASSWORD"


def identity_from_env(policy: Policy, environ: dict[str, str] | None = None) -> MlflowIdentity | None:
    """The policy's identity from ``KILN_MLFLOW_<POLICY>_USERNAME/PASSWORD``; None when unset.

    Half a pair (a username without password or the reverse) is a ``ConfigError``, not a silent
    anonymous client.
    """
    env = os.environ if environ is None else environ
    user_var, password_var = identity_env_names(policy)
    user, password = env.get(user_var, ""), env.get(password_var, "")
    if not user and not password:
        return None
    if not (user and password):
        raise ConfigError(f"set both {user_var} and {password_var} (or neither)")
    return MlflowIdentity(user, password, source="environment")


@contextlib.contextmanager
def use_identity(identity: MlflowIdentity | None) -> Iterator[None]:
    """Act as ``identity`` towards MLflow (this process and children) until the block ends.

    ``None`` means anonymous: any ``MLFLOW_TRACKING_USERNAME/PASSWORD`` inherited from the worker
    is removed for the block, so a task never borrows another policy's identity. The previous
    values come back afterwards.
    """
    saved = {key: os.environ.get(key) for key in (USERNAME_ENV, PASSWORD_ENV)}
    try:
        for key in saved:
            os.environ.pop(key, None)
        if identity is not None:
            os.environ[USERNAME_ENV] = identity.username
            os.environ[PASSWORD_ENV] = identity.password
        yield
    finally:
        restore_environ(saved)

"""The MLflow boundary: the client, retries with backoff, and MLflow errors translated to kiln errors."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kiln.errors import ConfigError, KilnError, PolicyError, RegistryError

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion


log = logging.getLogger("kiln.registry")

T = TypeVar("T")
# ------------------------------------------------------------------------------- MLflow plumbing


@contextlib.contextmanager
def _translated(action: str) -> Iterator[None]:
    """Turn third-party failures into ``RegistryError``; kiln's own errors pass through."""
    try:
        yield
    except KilnError:
        raise
    except Exception as exc:  # mlflow raises MlflowException, requests' errors, OSError, boto's, …
        from mlflow.exceptions import MlflowException

        refusal = _refusal(exc)
        if refusal is not None:
            raise refusal from exc
        if isinstance(exc, MlflowException | OSError) or type(exc).__module__.startswith(
                ("requests", "urllib3", "botocore", "boto3")):  # an S3 artifact store unreadable
            raise RegistryError(f"{action}: {exc}") from exc
        raise


# The auth app answers some refusals with a plain-text body, which mlflow reports only in words
# (and copy_model_version wraps once more): match the message as well as the error code.
_UNAUTHENTICATED = re.compile(r"error code 401\b|\b401 Client Error|UNAUTHENTICATED")
_FORBIDDEN = re.compile(r"error code 403\b|\b403 Client Error|PERMISSION_DENIED")


def _refusal(exc: BaseException) -> KilnError | None:
    """MLflow's auth said no: 403 → ``PolicyError``, 401 → ``ConfigError``; neither is retried.

    A permission the identity lacks does not appear on a retry; the server's refusal is the second
    line of the separation, behind ``Policy.check_model_write``.
    """
    from mlflow.exceptions import MlflowException, RestException

    who = os.environ.get("MLFLOW_TRACKING_USERNAME") or "anonymous"
    if not isinstance(exc, MlflowException):
        # an artifact upload through the server's proxy (log_artifact) fails as requests' HTTPError
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if not type(exc).__module__.startswith("requests") or status not in (401, 403):
            return None
        if status == 403:
            return PolicyError(f"MLflow refused MLflow identity {who!r} (403 PERMISSION_DENIED): {exc}")
        return ConfigError(
            f"MLflow did not accept the credentials of identity {who!r} (401); check the policy's MLflow "
            "connection (Policy.mlflow_conn_id) or KILN_MLFLOW_<POLICY>_USERNAME/PASSWORD")
    status = exc.get_http_status_code() if isinstance(exc, RestException) else None
    if exc.error_code == "PERMISSION_DENIED" or status == 403 or _FORBIDDEN.search(str(exc)):
        return PolicyError(f"MLflow refused MLflow identity {who!r} (403 PERMISSION_DENIED): {exc.message}")
    if status == 401 or _UNAUTHENTICATED.search(str(exc)):
        return ConfigError(
            f"MLflow did not accept the credentials of identity {who!r} (401); check the policy's MLflow "
            "connection (Policy.mlflow_conn_id) or KILN_MLFLOW_<POLICY>_USERNAME/PASSWORD"
        )
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How long registry calls keep trying an unreachable MLflow server before giving up."""

    retries: int = 3
    """Attempts after the first (``KILN_REGISTRY_RETRIES``); 0 = fail on the first transient error."""
    backoff_s: float = 2.0
    """Wait before the first retry (``KILN_REGISTRY_BACKOFF_S``); doubled for each further retry."""
    backoff_max_s: float = 30.0
    """Upper bound of one wait (``KILN_REGISTRY_BACKOFF_MAX_S``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.retries <= 20:
            raise ConfigError(f"KILN_REGISTRY_RETRIES must be 0..20, got {self.retries}")
        if not (math.isfinite(self.backoff_s) and self.backoff_s >= 0):
            raise ConfigError(f"KILN_REGISTRY_BACKOFF_S must be a finite number >= 0, got {self.backoff_s}")
        if not (math.isfinite(self.backoff_max_s) and self.backoff_max_s >= self.backoff_s):
            raise ConfigError(
                f"KILN_REGISTRY_BACKOFF_MAX_S must be >= KILN_REGISTRY_BACKOFF_S ({self.backoff_s}), "
                f"got {self.backoff_max_s}"
            )

    def delays(self) -> list[float]:
        """The waits before retry 1, 2, …: ``backoff_s * 2**i``, capped at ``backoff_max_s``."""
        return [min(self.backoff_s * 2**i, self.backoff_max_s) for i in range(self.retries)]

    @classmethod
    def from_env(cls) -> RetryPolicy:
        def read(name: str, kind: type, default: Any) -> Any:
            raw = os.environ.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError as exc:
                raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from exc

        defaults = cls()
        return cls(
            retries=read("KILN_REGISTRY_RETRIES", int, defaults.retries),
            backoff_s=read("KILN_REGISTRY_BACKOFF_S", float, defaults.backoff_s),
            backoff_max_s=read("KILN_REGISTRY_BACKOFF_MAX_S", float, defaults.backoff_max_s),
        )


_TRANSIENT_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED"})
# mlflow's rest_utils wraps transport failures in a plain MlflowException (no __cause__), so the
# message is all there is to tell "server unreachable" from "server said no".
_TRANSPORT_MESSAGE = re.compile(
    r"API request to .* failed with (exception|timeout exception|error code (5\d\d|429))", re.DOTALL
)


def is_transient(exc: BaseException) -> bool:
    """True for failures a later attempt can cure: unreachable server, timeout, HTTP 5xx / 429.

    A refusal by a healthy server (not found, invalid parameter, permission denied) is not.
    """
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__
    if module.startswith("urllib3"):
        return True
    if module.startswith("requests"):
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        return status is None or status >= 500 or status == 429
    if isinstance(exc, MlflowException):
        if exc.error_code in _TRANSIENT_CODES:
            return True
        if isinstance(exc, RestException) and exc.get_http_status_code() >= 500:
            return True  # the server answered with an internal error (e.g. its database was busy)
        return bool(_TRANSPORT_MESSAGE.search(str(exc)))
    return False


def _sleep(seconds: float) -> None:
    """The backoff wait (a seam: tests record the waits instead of sleeping)."""
    time.sleep(seconds)


def _with_retries(action: str, body: Callable[[], T]) -> T:
    """Run ``body`` (a whole idempotent registry operation), retrying transient MLflow failures.

    Third-party errors leave as ``RegistryError``; kiln's own errors (``PolicyError``…) pass at once.
    After the last attempt the error is a retryable ``RegistryError`` naming the attempts.
    """
    policy = RetryPolicy.from_env()
    delays = policy.delays()
    for attempt in range(len(delays) + 1):
        try:
            with _translated(action):
                return body()
        except RegistryError as err:
            cause = err.__cause__
            if cause is None or not is_transient(cause):
                raise
            if attempt == len(delays):
                raise RegistryError(
                    f"{action}: MLflow still unreachable after {attempt + 1} attempt(s) "
                    f"(KILN_REGISTRY_RETRIES={policy.retries}); a re-run completes what this one "
                    f"started: {cause}"
                ) from cause
            log.warning("%s: transient MLflow failure (attempt %d of %d), retrying in %.1fs: %s",
                        action, attempt + 1, len(delays) + 1, delays[attempt], cause)
            _sleep(delays[attempt])
    raise AssertionError("unreachable")  # pragma: no cover (the loop returns or raises)


def _client() -> MlflowClient:
    import mlflow
    from mlflow import MlflowClient

    from kiln.settings import load

    uri = load().mlflow_uri
    # The fluent API (start_run, log_model in the trainer's export) reads the global URI.
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _is_not_found(exc: Exception) -> bool:
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST"


def _version_by_alias(client: MlflowClient, model: str, alias: str) -> ModelVersion | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model, alias)
    except MlflowException as exc:
        # Both "no such registered model" and "no such alias" mean: nobody holds it yet.
        if _is_not_found(exc) or "not found" in str(exc).lower():
            return None
        raise


def version_by_ref(client: MlflowClient, model: str, kind: str, name: str) -> ModelVersion:
    """The version a ``MODEL@ALIAS`` (``kind`` ``"alias"``) or ``MODEL/VERSION`` reference names;
    ``RegistryError`` when no version holds the alias (MLflow's own error for a missing version)."""
    if kind == "alias":
        found = _version_by_alias(client, model, name)
        if found is None:
            raise RegistryError(f"{model} has no version with alias {name!r}")
        return found
    return client.get_model_version(model, name)


def _quote(value: str, what: str) -> str:
    # MLflow's filter grammar has no escape for quotes; refuse rather than build a wrong query.
    if "'" in value or "\\" in value:
        raise ConfigError(f"{what} {value!r} may not contain quotes or backslashes")
    return f"'{value}'"


def _versions_with_tag(client: MlflowClient, model: str, key: str, value: str) -> list[ModelVersion]:
    found = client.search_model_versions(
        f"name = {_quote(model, 'model name')} AND tags.`{key}` = {_quote(value, key)}"
    )
    return sorted(found, key=lambda mv: int(mv.version))


def _one_version_with_tag(client: MlflowClient, model: str, key: str, value: str) -> ModelVersion | None:
    """The version of ``model`` tagged ``key == value`` (the lowest), after removing duplicates.

    mlflow retries a POST whose response was lost, so a create that reached the server can be made
    twice; the duplicate carries the same run key. A duplicate that holds an alias is someone's
    choice and is kept (and logged); one that holds none is deleted, so the run key names one version.
    """
    found = _versions_with_tag(client, model, key, value)
    if not found:
        return None
    keep, *extra = found
    for dup in extra:
        current = client.get_model_version(model, str(dup.version))
        if current.aliases:
            log.warning("%s version %s duplicates version %s (%s=%s) but holds aliases %s; kept",
                        model, dup.version, keep.version, key, value, current.aliases)
            continue
        log.warning("%s version %s duplicates version %s (%s=%s), left by a retried request; deleting it",
                    model, dup.version, keep.version, key, value)
        client.delete_model_version(model, str(dup.version))
    return keep



"""The promotion gate and the MLflow registry writes: register, decide, promote, roll back.

The *decision* is pure (``decide``: metrics in, ``Decision`` out, no I/O); the *writes* are the
other functions here, each idempotent and keyed by the Airflow run (``run_key`` =
``"<dag_id>/<run_id>"``)::

    register_candidate(...)      verify checkpoint → policy check → find-or-create a version in
                                 policy.candidate_model, tagged with its lineage
    champion_report(policy)      EvalReport of the version holding policy.alias (None: first model)
    decide(cand, champ, gate)    Decision("promote" | "hold", reasons)
    promote(...)                 (gate again if the champion changed since the decision) → copy
                                 into policy.target_model → all tags → ``previous`` alias →
                                 policy.alias LAST, so readers never see a half-promoted model
    rollback(model, policy, …)   policy.alias back to the version holding ``previous`` (audited)
    record_review(...)           the human review's outcome (approved / rejected / timed out) as
                                 tags on the candidate; never moves an alias

Every version this module writes carries its facts as tags prefixed ``kiln.`` (see ``TAGS``), so
a reviewer reads the lineage in the MLflow UI and ``champion_report`` reads the champion's metrics
back without any other store. mlflow is imported inside the functions (importing this module stays
cheap) and its errors are translated here: ``raise RegistryError(...) from exc``.

An unreachable or overloaded server (connection refused, timeout, HTTP 5xx/429) is retried with
exponential backoff, bounded by ``KILN_REGISTRY_RETRIES`` (default 3 retries),
``KILN_REGISTRY_BACKOFF_S`` (first wait, default 2 s, doubled each time) and
``KILN_REGISTRY_BACKOFF_MAX_S`` (cap, default 30 s); then the call raises a retryable
``RegistryError`` and the Airflow task retries. Each retry re-runs the *whole* operation from its
first read: that is safe only because every write here is find-or-create keyed by the run, so a
half-done attempt is completed, never repeated. (mlflow's own per-request retries,
``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, run inside each attempt and also retry POSTs: a lost response
to a create can leave a second version with the same run key, which the next find removes.)

Reviewers read, in the MLflow UI: the version's description (gate, metrics against the champion,
lineage summary), the run's ``evaluation/report.html`` (self-contained: loss curve, metrics against
the champion, gate reasons, lineage), ``evaluation/report.md`` and ``evaluation/loss_curve.png``
(``.svg`` when matplotlib is not installed).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import html
import json
import logging
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kiln.errors import ConfigError, KilnError, ManifestError, PolicyError, RegistryError
from kiln.policy import REPO_ROOT, GatePolicy, Policy
from kiln.refs import (
    Decision,
    EvalReport,
    PromotionRecord,
    SnapshotRef,
    TrainingManifest,
    TrainResult,
    sha256_file,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)
T = TypeVar("T")

EVAL_SPLIT = "eval"
PREVIOUS_ALIAS = "previous"
MODEL_ARTIFACT_NAME = "model"
CHECKPOINT_MANIFEST_NAME = "manifest.json"
"""The trainer's commit record inside a step directory (``kiln_trainer.checkpoint_manifest``)."""

# Tag keys. Every kiln tag starts with "kiln." so that kiln's facts never collide with a user's.
RUN_KEY_TAG = "kiln.run_key"
"""The Airflow run that registered a version: the idempotency key (copied along on promotion)."""
TAGS = {
    "policy": "kiln.policy",
    "snapshot_id": "kiln.snapshot_id",
    "corpus": "kiln.corpus",
    "dvc": "kiln.dvc",
    "dvc_remote": "kiln.dvc_remote",
    "training_manifest_sha256": "kiln.training_manifest_sha256",
    "contract": "kiln.contract",
    "quarantined_shards": "kiln.quarantined_shards",
    "recipe_sha256": "kiln.recipe_sha256",
    "git_sha": "kiln.git_sha",
    "dag_id": "kiln.airflow.dag_id",
    "run_id": "kiln.airflow.run_id",
    "weights_sha256": "kiln.weights_sha256",
    "checkpoint": "kiln.checkpoint",
    "checkpoint_step": "kiln.checkpoint.step",
    "checkpoint_manifest_sha256": "kiln.checkpoint.manifest_sha256",
    "world_size": "kiln.checkpoint.world_size",
    "train_completed": "kiln.train.completed",
    "train_steps": "kiln.train.steps",
    "eval_split": "kiln.eval.split",
    "eval_bits_per_byte": "kiln.eval.bits_per_byte",
    "eval_loss": "kiln.eval.loss",
    "eval_tokens": "kiln.eval.tokens",
    "decision": "kiln.decision",
    "decision_reasons": "kiln.decision.reasons",
    "decision_champion_bits_per_byte": "kiln.decision.champion_bits_per_byte",
    "decision_champion_version": "kiln.decision.champion_version",
    "source_version": "kiln.source_version",
    "promotion_run_key": "kiln.promotion.run_key",
    "approver": "kiln.promotion.approver",
    "approved_at": "kiln.promotion.approved_at",
    "previous_version": "kiln.promotion.previous_version",
    "rollback_actor": "kiln.rollback.actor",
    "rollback_at": "kiln.rollback.at",
    "rollback_from_version": "kiln.rollback.from_version",
    "rollback_reason": "kiln.rollback.reason",
    "rolled_back_by": "kiln.rolled_back.by",
    "rolled_back_at": "kiln.rolled_back.at",
    "rolled_back_reason": "kiln.rolled_back.reason",
    "review": "kiln.review",
    "reviewer": "kiln.review.by",
    "reviewed_at": "kiln.review.at",
    "review_comment": "kiln.review.comment",
}
RUN_MODEL_URI_TAG = "kiln.model_uri"
"""Run tag: the model already logged into this run for ``kiln.run_key`` (retries reuse it)."""
RUN_STATUS_TAG = "kiln.register.run_status"
"""Run tag: the run's status before registration first resumed it (restored after every attempt)."""
REVIEW_OUTCOMES = ("approved", "rejected", "timed out")
REPORT_DIR = "evaluation"
LOSS_METRIC = "loss"
"""The trainer's per-step training loss (MLflow metric and ``metrics.jsonl`` key)."""


# --------------------------------------------------------------------------------------- the gate


def decide(candidate: EvalReport, champion: EvalReport | None, gate: GatePolicy) -> Decision:
    """Promote or hold, with one reason per check (passed or failed), in a fixed order.

    Checks: sanity (evaluated on the held-out ``eval`` split, finite metrics, some tokens seen),
    the absolute ceiling ``gate.max_bits_per_byte``, and no regression against the champion by more
    than ``gate.max_regression`` bits per byte. No champion (first model) passes the last check.
    Pure: no I/O, same inputs → same Decision.
    """
    reasons: list[str] = []
    held = False

    def check(ok: bool, name: str, detail: str) -> None:
        nonlocal held
        held = held or not ok
        reasons.append(f"{name} {'passed' if ok else 'FAILED'}: {detail}")

    bpb = candidate.bits_per_byte
    check(candidate.split == EVAL_SPLIT, "sanity.split",
          f"evaluated on split {candidate.split!r} (required {EVAL_SPLIT!r})")  # fmt: skip
    finite = all(math.isfinite(v) for v in (candidate.bits_per_byte, candidate.loss))
    check(finite, "sanity.finite",
          f"bits_per_byte={candidate.bits_per_byte!r} loss={candidate.loss!r} must be finite")  # fmt: skip
    check(candidate.tokens > 0, "sanity.tokens", f"{candidate.tokens} evaluation tokens (required > 0)")
    bpb_finite = math.isfinite(bpb)
    check(bpb_finite and bpb <= gate.max_bits_per_byte, "threshold",
          f"bits_per_byte {bpb:.4f} vs maximum {gate.max_bits_per_byte:.4f}")  # fmt: skip

    champion_bpb: float | None = None
    if champion is None:
        check(True, "regression", "no champion yet: this is the first model")
    elif champion.split != EVAL_SPLIT or not math.isfinite(champion.bits_per_byte):
        # A broken champion record must not block every future candidate; say so and compare nothing.
        check(True, "regression",
              f"champion record unusable (split {champion.split!r}, bits_per_byte "
              f"{champion.bits_per_byte!r}); not compared")  # fmt: skip
    else:
        champion_bpb = champion.bits_per_byte
        delta = bpb - champion_bpb
        check(bpb_finite and delta <= gate.max_regression, "regression",
              f"bits_per_byte {bpb:.4f} vs champion {champion_bpb:.4f} (change {delta:+.4f}, "
              f"tolerance +{gate.max_regression:.4f})")  # fmt: skip

    return Decision(
        action="hold" if held else "promote",
        reasons=reasons,
        candidate_bits_per_byte=bpb,
        champion_bits_per_byte=champion_bpb,
    )


# ------------------------------------------------------------------------------- MLflow plumbing


@contextlib.contextmanager
def _translated(action: str) -> Iterator[None]:
    """Turn third-party failures into ``RegistryError``; kiln's own errors pass through."""
    try:
        yield
    except KilnError:
        raise
    except Exception as exc:  # mlflow raises MlflowException, requests' errors, OSError, …
        from mlflow.exceptions import MlflowException

        refusal = _refusal(exc)
        if refusal is not None:
            raise refusal from exc
        if isinstance(exc, MlflowException | OSError) or type(exc).__module__.startswith(("requests", "urllib3")):
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

    if not isinstance(exc, MlflowException):
        return None
    who = os.environ.get("MLFLOW_TRACKING_USERNAME") or "anonymous"
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
                        action, attempt + 1, len(delays) + 1, delays[attempt], cause)  # fmt: skip
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
                        model, dup.version, keep.version, key, value, current.aliases)  # fmt: skip
            continue
        log.warning("%s version %s duplicates version %s (%s=%s), left by a retried request; deleting it",
                    model, dup.version, keep.version, key, value)  # fmt: skip
        client.delete_model_version(model, str(dup.version))
    return keep


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def utc_now() -> str:
    """Now, ISO 8601 in UTC with microseconds: for times that are compared with each other
    (an approval against a rollback), where whole seconds could tie."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def split_run_key(run_key: str) -> tuple[str, str]:
    """``"dag_id/run_id"`` → ``(dag_id, run_id)`` (dag ids never contain ``/``)."""
    dag_id, sep, run_id = run_key.partition("/")
    if not sep or not dag_id or not run_id:
        raise ConfigError(f"run_key must be '<dag_id>/<run_id>', got {run_key!r}")
    return dag_id, run_id


def _eval_tags(report: EvalReport) -> dict[str, str]:
    return {
        TAGS["eval_split"]: report.split,
        TAGS["eval_bits_per_byte"]: repr(float(report.bits_per_byte)),
        TAGS["eval_loss"]: repr(float(report.loss)),
        TAGS["eval_tokens"]: str(int(report.tokens)),
    }


def _decision_tags(decision: Decision) -> dict[str, str]:
    champion = decision.champion_bits_per_byte
    return {
        TAGS["decision"]: decision.action,
        TAGS["decision_reasons"]: json.dumps(decision.reasons),
        TAGS["decision_champion_bits_per_byte"]: "" if champion is None else repr(float(champion)),
    }


def _decision_from_tags(tags: dict[str, str], candidate_bits_per_byte: float) -> Decision:
    champion = tags.get(TAGS["decision_champion_bits_per_byte"], "")
    return Decision(
        action="promote" if tags.get(TAGS["decision"]) == "promote" else "hold",
        reasons=json.loads(tags.get(TAGS["decision_reasons"], "[]")),
        candidate_bits_per_byte=candidate_bits_per_byte,
        champion_bits_per_byte=float(champion) if champion else None,
    )


def _version_ref(mv: ModelVersion) -> dict[str, Any]:
    return {
        "model_name": mv.name,
        "version": str(mv.version),
        "run_id": mv.run_id or "",
        "model_uri": f"models:/{mv.name}/{mv.version}",
        "source": mv.source or "",
    }


# ------------------------------------------------------------------------------ checkpoint checks


def _verify_checkpoint(step_dir: str) -> dict[str, Any]:
    """The trainer's own manifest check (per-file sha256, committed-last manifest)."""
    try:
        from kiln_trainer.checkpoint_manifest import verify_checkpoint
    except ImportError as exc:
        raise ManifestError(f"cannot verify checkpoint {step_dir}: the trainer package is missing ({exc})") from exc
    try:
        return verify_checkpoint(step_dir)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        raise ManifestError(f"checkpoint {step_dir} refused: {exc}") from exc


def _log_checkpoint_model(step_dir: str) -> str:
    """Log the checkpoint as an ``mlflow.pytorch`` model into the active run; returns its URI."""
    from kiln_trainer.export import log_model

    return log_model(step_dir, name=MODEL_ARTIFACT_NAME)


def _check_consistency(
    verified: dict[str, Any], train: TrainResult, eval_report: EvalReport, snapshot: SnapshotRef,
    manifest: TrainingManifest,
) -> None:  # fmt: skip
    """Every ref handed in must describe the checkpoint on disk, or the lineage would lie."""
    expected = {
        "weights_sha256 (TrainResult)": (verified.get("weights_sha256"), train.weights_sha256),
        "weights_sha256 (EvalReport)": (verified.get("weights_sha256"), eval_report.weights_sha256),
        "snapshot_id": (verified.get("snapshot_id"), snapshot.id),
        "training_manifest_sha256": (verified.get("training_manifest_sha256"), manifest.sha256),
    }
    # Newer TrainResults carry the trainer's own view of these too; when present they must agree.
    for field_name in ("recipe_sha256", "snapshot_id", "training_manifest_sha256"):
        claimed = getattr(train, field_name)
        if claimed:
            expected[f"{field_name} (TrainResult)"] = (verified.get(field_name), claimed)
    manifest_file = Path(train.checkpoint) / CHECKPOINT_MANIFEST_NAME
    expected["checkpoint_manifest_sha256 (TrainResult)"] = (sha256_file(manifest_file), train.checkpoint_manifest_sha256)
    for what, (on_disk, claimed) in expected.items():
        if on_disk != claimed:
            raise ManifestError(
                f"checkpoint {train.checkpoint} does not match the refs: {what} on disk {on_disk!r}, "
                f"claimed {claimed!r}"
            )
    if manifest.snapshot_id != snapshot.id:
        raise ManifestError(f"TrainingManifest is of snapshot {manifest.snapshot_id!r}, not {snapshot.id!r}")


# ------------------------------------------------------------------------------ register candidate


def lineage_tags(
    *, policy: Policy, train: TrainResult, eval_report: EvalReport, snapshot: SnapshotRef,
    manifest: TrainingManifest, run_key: str, verified: dict[str, Any], lineage: dict[str, str],
) -> dict[str, str]:  # fmt: skip
    """All tags a candidate version is created with (strings; keys prefixed ``kiln.``)."""
    dag_id, run_id = split_run_key(run_key)
    tags = {
        RUN_KEY_TAG: run_key,
        TAGS["policy"]: policy.name,
        TAGS["snapshot_id"]: snapshot.id,
        TAGS["corpus"]: snapshot.corpus,
        TAGS["dvc"]: snapshot.dvc,
        TAGS["dvc_remote"]: snapshot.remote,
        TAGS["training_manifest_sha256"]: manifest.sha256,
        TAGS["contract"]: manifest.contract,
        TAGS["quarantined_shards"]: str(len(manifest.quarantined)),
        TAGS["recipe_sha256"]: str(verified.get("recipe_sha256", "")),
        TAGS["git_sha"]: _git_sha(),
        TAGS["dag_id"]: dag_id,
        TAGS["run_id"]: run_id,
        TAGS["weights_sha256"]: train.weights_sha256,
        TAGS["checkpoint"]: train.checkpoint,
        TAGS["checkpoint_step"]: str(verified.get("step", train.step)),
        TAGS["checkpoint_manifest_sha256"]: train.checkpoint_manifest_sha256,
        TAGS["world_size"]: str(verified.get("world_size", "")),
        TAGS["train_completed"]: str(train.completed).lower(),
        TAGS["train_steps"]: f"{train.step}/{train.total_steps or train.step}",
        **_eval_tags(eval_report),
    }
    for key, value in lineage.items():
        full = key if key.startswith("kiln.") else f"kiln.{key}"
        if full == RUN_KEY_TAG:
            raise ConfigError(f"lineage may not override {RUN_KEY_TAG}")
        tags[full] = str(value)
    return tags


# ----------------------------------------------------------------------------- evaluation report


@dataclass(frozen=True, kw_only=True, slots=True)
class LossCurve:
    """The training loss per step, as a reviewer should read it (last value logged for each step)."""

    points: list[tuple[int, float]]
    """``(step, loss)`` sorted by step; a resumed run's re-logged steps keep their latest value."""
    source: str
    """Where the points came from, for the report ("MLflow metric `loss` of run …", a file path, "none")."""
    rollbacks: list[int]
    """Steps where the trainer's loss guard rolled back (drawn as markers)."""


def read_loss_jsonl(path: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` from the trainer's ``metrics.jsonl``; events, non-finite and torn lines skipped."""
    by_step: dict[int, float] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write; the rest of the file is still good
        if not isinstance(record, dict) or record.get("event"):
            continue
        step, loss = record.get("step"), record.get(LOSS_METRIC)
        if isinstance(step, int) and isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss):
            by_step[step] = float(loss)  # later lines (after a resume) replace earlier ones
    return sorted(by_step.items())


def loss_curve(client: MlflowClient, run_id: str, train: TrainResult) -> LossCurve:
    """The training run's ``loss`` history from MLflow, else the trainer's ``RUN_DIR/metrics.jsonl``."""
    rollbacks = sorted({int(e["at_step"]) for e in train.events
                        if e.get("kind") == "rollback" and isinstance(e.get("at_step"), int)})  # fmt: skip
    by_step: dict[int, float] = {}
    if train.mlflow_run_id:
        for metric in sorted(client.get_metric_history(run_id, LOSS_METRIC), key=lambda m: (m.timestamp, m.step)):
            if math.isfinite(metric.value):
                by_step[int(metric.step)] = float(metric.value)
    if by_step:
        return LossCurve(points=sorted(by_step.items()), source=f"MLflow metric `{LOSS_METRIC}` of run {run_id}",
                         rollbacks=rollbacks)  # fmt: skip
    jsonl = Path(train.run_dir) / "metrics.jsonl"
    points = read_loss_jsonl(jsonl) if train.run_dir else []
    return LossCurve(points=points, source=str(jsonl) if points else "none (no loss was logged)", rollbacks=rollbacks)


def loss_curve_png(curve: LossCurve, references: dict[str, float]) -> bytes | None:
    """The curve as a PNG (matplotlib, headless), with ``references`` as horizontal lines; None
    when matplotlib is not installed or there is nothing to draw."""
    if not curve.points:
        return None
    try:
        from matplotlib.figure import Figure  # the OO API: no pyplot global state, no display needed
    except ImportError:
        return None
    import io

    steps, losses = zip(*curve.points, strict=True)
    fig = Figure(figsize=(7.5, 3.6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="tab:blue", linewidth=1.4, marker="o" if len(steps) <= 30 else None,
            markersize=3, label=f"training {LOSS_METRIC}")  # fmt: skip
    for (label, value), color in zip(references.items(), ("tab:green", "tab:orange"), strict=False):
        ax.axhline(value, color=color, linestyle=":", linewidth=1.2, label=label)
    for i, step in enumerate(curve.rollbacks):
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="guard rollback" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def loss_curve_svg(curve: LossCurve, references: dict[str, float], width: int = 720, height: int = 320) -> str:
    """The curve as a standalone SVG (no dependency): polyline, axis extremes, reference lines."""
    left, right, top, bottom = 64, 16, 28, 40
    if not curve.points:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60">'
                f'<text x="8" y="30" font-family="sans-serif" font-size="13">no training loss logged</text></svg>')  # fmt: skip
    steps = [s for s, _ in curve.points]
    values = [v for _, v in curve.points] + list(references.values())
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def x(step: float) -> float:
        return left + (step - x0) / (x1 - x0) * (width - left - right)

    def y(value: float) -> float:
        return top + (y1 - value) / (y1 - y0) * (height - top - bottom)

    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in curve.points)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="13">Training loss</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
        f'fill="none" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y1:.3f}</text>',
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{y0:.3f}</text>',
        f'<text x="{left}" y="{height - bottom + 14}" text-anchor="middle">{x0}</text>',
        f'<text x="{width - right}" y="{height - bottom + 14}" text-anchor="middle">{x1}</text>',
        f'<text x="{width / 2:.0f}" y="{height - 8}" text-anchor="middle">step</text>',
    ]
    for (label, value), color in zip(references.items(), ("#2ca02c", "#ff7f0e"), strict=False):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                     f'stroke="{color}" stroke-dasharray="2,3"/>')  # fmt: skip
        parts.append(f'<text x="{width - right - 4}" y="{y(value) - 3:.1f}" text-anchor="end" fill="{color}">'
                     f"{html.escape(label)} {value:.3f}</text>")  # fmt: skip
    for step in curve.rollbacks:
        parts.append(f'<line x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{top}" y2="{height - bottom}" '
                     f'stroke="#d62728" stroke-dasharray="5,3"/>')  # fmt: skip
    parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def _metric_rows(eval_report: EvalReport, champion: EvalReport | None) -> list[tuple[str, str, str, str]]:
    """(metric, candidate, champion, change) — change is candidate minus champion."""
    rows = []
    for label, attr in (("bits per byte", "bits_per_byte"), ("loss", "loss"), ("tokens", "tokens"), ("split", "split")):
        cand = getattr(eval_report, attr)
        champ = getattr(champion, attr) if champion else None
        if isinstance(cand, float):
            text = f"{cand:.4f}"
            champ_text = "—" if champ is None else f"{champ:.4f}"
            change = f"{cand - champ:+.4f}" if isinstance(champ, float) and math.isfinite(cand - champ) else "—"
        else:
            text, champ_text, change = str(cand), "—" if champ is None else str(champ), "—"
        rows.append((label, text, champ_text, change))
    return rows


def _champion_title(tags: dict[str, str]) -> str:
    version = tags.get(TAGS["decision_champion_version"], "")
    return f"champion (v{version})" if version else "champion (none: first model)"


def report_markdown(eval_report: EvalReport, champion: EvalReport | None, decision: Decision,
                    tags: dict[str, str], curve: LossCurve, plot_name: str | None) -> str:  # fmt: skip
    table = "\n".join(f"| {' | '.join(row)} |" for row in _metric_rows(eval_report, champion))
    lineage = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(tags.items()) if k != TAGS["dvc"])
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    plot = (f"![training loss]({plot_name})\n\nSource: {curve.source}; {len(curve.points)} steps"
            + (f"; guard rollbacks at steps {curve.rollbacks}" if curve.rollbacks else "")) if plot_name else (
        f"No loss curve: {curve.source}.")  # fmt: skip
    return (
        f"# Evaluation report — {tags[RUN_KEY_TAG]}\n\n"
        f"## Candidate vs {_champion_title(tags)}\n\n| metric | candidate | champion | change |\n|---|---|---|---|\n"
        f"{table}\n\n"
        f"## Gate decision: {decision.action}\n\n{reasons}\n\n"
        f"## Training loss\n\n{plot}\n\n"
        f"## Lineage\n\n| tag | value |\n|---|---|\n{lineage}\n\n"
        f"## DVC snapshot\n\n```yaml\n{tags[TAGS['dvc']]}\n```\n"
    )


def report_html(eval_report: EvalReport, champion: EvalReport | None, decision: Decision,
                tags: dict[str, str], curve: LossCurve, png: bytes | None, svg: str | None) -> str:  # fmt: skip
    """A self-contained page (the plot inlined), so the MLflow UI's artifact view shows it whole."""
    e = html.escape
    rows = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                     for row in _metric_rows(eval_report, champion))  # fmt: skip
    reasons = "\n".join(f'<li class="{"fail" if " FAILED: " in r else "pass"}">{e(r)}</li>' for r in decision.reasons)
    lineage = "\n".join(f"<tr><td><code>{e(k)}</code></td><td><code>{e(v)}</code></td></tr>"
                        for k, v in sorted(tags.items()) if k != TAGS["dvc"])  # fmt: skip
    if png:
        plot = f'<img alt="training loss" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'
    elif svg:
        plot = svg
    else:
        plot = ""
    note = (f"Source: {e(curve.source)}; {len(curve.points)} steps"
            + (f"; guard rollbacks at steps {e(str(curve.rollbacks))}" if curve.rollbacks else "")
            if curve.points else f"No loss curve: {e(curve.source)}.")  # fmt: skip
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Evaluation report — {e(tags[RUN_KEY_TAG])}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:60em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}.fail{{color:#b00}}.pass{{color:#070}}
code{{font-size:90%}}</style></head><body>
<h1>Evaluation report — {e(tags[RUN_KEY_TAG])}</h1>
<h2>Gate decision: {e(decision.action)}</h2>
<ul>{reasons}</ul>
<h2>Candidate vs {e(_champion_title(tags))}</h2>
<table><tr><th>metric</th><th>candidate</th><th>champion</th><th>change</th></tr>
{rows}</table>
<h2>Training loss</h2>
{plot}
<p>{note}</p>
<h2>Lineage</h2>
<table>{lineage}</table>
<h2>DVC snapshot</h2>
<pre>{e(tags[TAGS["dvc"]])}</pre>
</body></html>
"""


def _description(tags: dict[str, str], decision: Decision, run_id: str) -> str:
    """The version's description, from its tags alone (so a retry rebuilds exactly the same text)."""
    champion_bpb = tags.get(TAGS["decision_champion_bits_per_byte"], "")
    bpb = float(tags[TAGS["eval_bits_per_byte"]])
    if champion_bpb:
        champ = f"{float(champion_bpb):.4f} ({_champion_title(tags)}; change {bpb - float(champion_bpb):+.4f})"
    else:
        champ = _champion_title(tags).removeprefix("champion ")
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    return (
        f"kiln candidate from Airflow run `{tags[RUN_KEY_TAG]}` (policy `{tags[TAGS['policy']]}`), "
        f"MLflow run `{run_id}`.\n\n"
        f"Gate: **{decision.action}**\n\n{reasons}\n\n"
        f"| | value |\n|---|---|\n"
        f"| eval bits/byte | {bpb:.4f} |\n"
        f"| champion bits/byte | {champ} |\n"
        f"| eval loss / tokens | {float(tags[TAGS['eval_loss']]):.4f} / {tags[TAGS['eval_tokens']]} "
        f"(split `{tags[TAGS['eval_split']]}`) |\n"
        f"| training | step {tags[TAGS['train_steps']]}, completed {tags[TAGS['train_completed']]} |\n"
        f"| snapshot | `{tags[TAGS['snapshot_id']]}` ({tags[TAGS['corpus']]}) |\n"
        f"| contract | `{tags[TAGS['contract']]}` (quarantined shards: {tags[TAGS['quarantined_shards']]}) |\n"
        f"| recipe sha256 | `{tags[TAGS['recipe_sha256']]}` |\n"
        f"| weights sha256 | `{tags[TAGS['weights_sha256']]}` |\n"
        f"| git | `{tags[TAGS['git_sha']]}` |\n\n"
        f"Evaluation report (loss curve, metrics against the champion, full lineage): artifacts of run "
        f"`{run_id}`, `{REPORT_DIR}/report.html` (also `report.md`, `eval_report.json`, `decision.json`)."
    )


def experiment_name(policy: Policy) -> str:
    return f"kiln-{policy.name}"


def _find_or_start_run(client: MlflowClient, policy: Policy, train: TrainResult, run_key: str) -> tuple[str, bool]:
    """The run to log into, and whether registration owns it (and so ends it)."""
    if train.mlflow_run_id:
        return train.mlflow_run_id, False
    # No training run to attach to: one registration run per run_key in the policy's experiment
    # (the one the train stage uses), found again on retry.
    name = experiment_name(policy)
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = {_quote(run_key, 'run_key')}", max_results=1
    )
    if runs:
        return runs[0].info.run_id, True
    run = client.create_run(experiment_id, tags={RUN_KEY_TAG: run_key, "mlflow.runName": f"register {run_key}"})
    return run.info.run_id, True


def register_candidate(
    *,
    policy: Policy,
    train: TrainResult,
    eval_report: EvalReport,
    snapshot: SnapshotRef,
    manifest: TrainingManifest,
    run_key: str,
    lineage: dict[str, str] | None = None,
    decision: Decision | None = None,
) -> dict[str, Any]:
    """Create (once per ``run_key``) a version of ``policy.candidate_model`` for this checkpoint.

    Order, so that nothing is written for a checkpoint that is not what it claims to be:
    1. ``verify_checkpoint`` (every file's sha256; a tampered, partial or uncommitted checkpoint
       raises ``ManifestError`` naming the reason) and a cross-check of the refs against it;
    2. ``policy.check_model_write`` (``PolicyError`` before any request);
    3. an existing version tagged ``kiln.run_key == run_key`` is a retry: what an interrupted
       attempt left undone (description, run status) is completed and the version returned;
    4. otherwise the model is logged into the training run (``train.mlflow_run_id``; a run of
       experiment ``kiln-<policy>`` keyed by ``run_key`` when empty) with the eval metrics, the
       evaluation report (HTML + Markdown with the loss curve and the metrics against the
       champion, JSON) and the decision as artifacts, and the version is created with all lineage
       tags in the same request, then described.

    ``decision`` defaults to ``decide(eval_report, champion_report(policy), policy.gate)``.
    Transient MLflow failures are retried (see the module docstring). Returns ``{"model_name",
    "version", "run_id", "model_uri", "source", "decision", "created", "report_uri"}`` (JSON-safe;
    ``created`` is False on a retry that found the version).
    """
    verified = _verify_checkpoint(train.checkpoint)
    _check_consistency(verified, train, eval_report, snapshot, manifest)
    manifest.verify()
    policy.check_model_write(policy.candidate_model)
    tags = lineage_tags(policy=policy, train=train, eval_report=eval_report, snapshot=snapshot,
                        manifest=manifest, run_key=run_key, verified=verified, lineage=lineage or {})  # fmt: skip
    model = policy.candidate_model

    def attempt() -> dict[str, Any]:
        client = _client()
        mv = _one_version_with_tag(client, model, RUN_KEY_TAG, run_key)
        if mv is not None:
            stored = _decision_from_tags(mv.tags, eval_report.bits_per_byte)
            _finish_version(client, mv, stored)
            _settle_run(client, mv.run_id, own_run=not train.mlflow_run_id)
            return {**_version_ref(mv), "decision": stored.to_json(), "created": False,
                    "report_uri": f"runs:/{mv.run_id}/{REPORT_DIR}/report.html"}  # fmt: skip

        champion_mv = _version_by_alias(client, policy.target_model, policy.alias)
        champion = None if champion_mv is None else _report_from_tags(champion_mv)
        chosen = decision if decision is not None else decide(eval_report, champion, policy.gate)
        version_tags = {**tags, **_decision_tags(chosen),
                        TAGS["decision_champion_version"]: "" if champion_mv is None else str(champion_mv.version)}  # fmt: skip
        run_id, own_run = _find_or_start_run(client, policy, train, run_key)
        model_uri = _log_into_run(client, run_id, run_key, train, eval_report, champion, chosen, version_tags)

        import mlflow

        mv = mlflow.register_model(model_uri, model, tags=version_tags)
        _finish_version(client, mv, chosen)
        _settle_run(client, run_id, own_run=own_run)
        return {**_version_ref(mv), "decision": chosen.to_json(), "created": True,
                "report_uri": f"runs:/{run_id}/{REPORT_DIR}/report.html"}  # fmt: skip

    return _with_retries(f"registering {model} for {run_key}", attempt)


def _finish_version(client: MlflowClient, mv: ModelVersion, decision: Decision) -> None:
    """Give the version its description (rebuilt from its tags, so a retry writes the same text)."""
    description = _description(mv.tags, decision, mv.run_id or "")
    if (mv.description or "") != description:
        client.update_model_version(mv.name, str(mv.version), description=description)


def _settle_run(client: MlflowClient, run_id: str | None, *, own_run: bool) -> None:
    """Leave the run in the status it should have after registration: FINISHED for a run that
    registration created, otherwise the status it had before registration resumed it."""
    if not run_id:
        return
    run = client.get_run(run_id)
    wanted = "FINISHED" if own_run else run.data.tags.get(RUN_STATUS_TAG, run.info.status)
    if run.info.status != wanted:
        if wanted == "FINISHED":
            client.set_terminated(run_id, "FINISHED")
        else:
            client.update_run(run_id, status=wanted)


def _log_into_run(
    client: MlflowClient, run_id: str, run_key: str, train: TrainResult, eval_report: EvalReport,
    champion: EvalReport | None, decision: Decision, tags: dict[str, str],
) -> str:  # fmt: skip
    import mlflow

    run = client.get_run(run_id)
    already = run.data.tags.get(RUN_MODEL_URI_TAG)
    if already and run.data.tags.get(RUN_KEY_TAG) == run_key:
        return already  # a retry after the model was logged: never log a second copy
    client.set_tag(run_id, RUN_KEY_TAG, run_key)
    if RUN_STATUS_TAG not in run.data.tags:
        # start_run/end_run below change the run's status, which the DAG owns; remember it once, so
        # that even a retry after an attempt that died inside start_run puts back the right one.
        client.set_tag(run_id, RUN_STATUS_TAG, run.info.status)
    for name, value in (("eval_bits_per_byte", eval_report.bits_per_byte), ("eval_loss", eval_report.loss),
                        ("eval_tokens", float(eval_report.tokens))):  # fmt: skip
        if math.isfinite(value):
            client.log_metric(run_id, name, value)
    client.log_dict(run_id, eval_report.to_json(), f"{REPORT_DIR}/eval_report.json")
    client.log_dict(run_id, decision.to_json(), f"{REPORT_DIR}/decision.json")
    if champion is not None:
        client.log_dict(run_id, champion.to_json(), f"{REPORT_DIR}/champion_eval_report.json")
    _log_report(client, run_id, train, eval_report, champion, decision, tags)
    # log_model writes into the *active* run: resume the run just for that call (_settle_run puts
    # the status back afterwards).
    with mlflow.start_run(run_id=run_id):
        model_uri = _log_checkpoint_model(train.checkpoint)
    client.set_tag(run_id, RUN_MODEL_URI_TAG, model_uri)
    return model_uri


def _log_report(
    client: MlflowClient, run_id: str, train: TrainResult, eval_report: EvalReport, champion: EvalReport | None,
    decision: Decision, tags: dict[str, str],
) -> None:  # fmt: skip
    """The reviewer's report: ``report.html`` (self-contained), ``report.md`` and the loss-curve image."""
    curve = loss_curve(client, run_id, train)
    references = {"candidate eval loss": eval_report.loss}
    if champion is not None and math.isfinite(champion.loss):
        references["champion eval loss"] = champion.loss
    references = {k: v for k, v in references.items() if math.isfinite(v)}
    png = loss_curve_png(curve, references)
    svg = None if png or not curve.points else loss_curve_svg(curve, references)
    plot_name = "loss_curve.png" if png else "loss_curve.svg" if svg else None
    with tempfile.TemporaryDirectory(prefix="kiln-report-") as tmp:
        if png:
            (Path(tmp) / "loss_curve.png").write_bytes(png)
            client.log_artifact(run_id, str(Path(tmp) / "loss_curve.png"), REPORT_DIR)
    if svg:
        client.log_text(run_id, svg, f"{REPORT_DIR}/loss_curve.svg")
    client.log_text(run_id, report_markdown(eval_report, champion, decision, tags, curve, plot_name),
                    f"{REPORT_DIR}/report.md")  # fmt: skip
    client.log_text(run_id, report_html(eval_report, champion, decision, tags, curve, png, svg),
                    f"{REPORT_DIR}/report.html")  # fmt: skip


# ----------------------------------------------------------------------------------------- champion


def _report_from_tags(mv: ModelVersion) -> EvalReport:
    tags = mv.tags
    try:
        return EvalReport(
            checkpoint=tags.get(TAGS["checkpoint"], ""),
            weights_sha256=tags.get(TAGS["weights_sha256"], ""),
            split=tags[TAGS["eval_split"]],
            bits_per_byte=float(tags[TAGS["eval_bits_per_byte"]]),
            loss=float(tags[TAGS["eval_loss"]]),
            tokens=int(tags[TAGS["eval_tokens"]]),
            snapshot_id=tags.get(TAGS["snapshot_id"], ""),
        )
    except (KeyError, ValueError) as exc:
        raise RegistryError(
            f"{mv.name} version {mv.version} has no readable kiln eval tags ({exc}); "
            "it was not registered by kiln — tag it or roll the alias back"
        ) from exc


def version_report(model: str, version: str) -> EvalReport:
    """The evaluation a kiln-registered version carries in its tags (``RegistryError`` if none)."""
    return _with_retries(f"reading {model}/{version}",
                         lambda: _report_from_tags(_client().get_model_version(model, str(version))))  # fmt: skip


def champion_report(policy: Policy) -> EvalReport | None:
    """The evaluation of the version holding ``policy.alias`` on ``policy.target_model``.

    ``None`` when nobody holds the alias yet (the first model). Read-only.
    """
    def attempt() -> EvalReport | None:
        mv = _version_by_alias(_client(), policy.target_model, policy.alias)
        return None if mv is None else _report_from_tags(mv)

    return _with_retries(f"reading {policy.target_model}@{policy.alias}", attempt)


# ------------------------------------------------------------------------------------------ promote


def _existing_target_version(client: MlflowClient, policy: Policy, candidate: ModelVersion) -> ModelVersion | None:
    """The version of the target model this candidate became (None: never copied yet)."""
    if policy.candidate_model == policy.target_model:
        return candidate
    # copy_model_version carries the candidate's tags, kiln.run_key included, in the same request
    # that creates the copy — so this lookup finds a copy even if we crashed right after making it.
    copies = _versions_with_tag(client, policy.target_model, RUN_KEY_TAG, candidate.tags[RUN_KEY_TAG])
    return copies[0] if copies else None


def _target_version(client: MlflowClient, policy: Policy, candidate: ModelVersion, run_key: str) -> ModelVersion:
    found = _existing_target_version(client, policy, candidate)
    if found is not None:
        return found
    return client.copy_model_version(f"models:/{candidate.name}/{candidate.version}", policy.target_model)


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _utc_iso(value: str | dt.datetime) -> str:
    """An approval time as kiln writes it: ISO 8601 in UTC (sub-second precision kept)."""
    parsed = value if isinstance(value, dt.datetime) else _parse_time(value)
    if parsed is None:
        raise ConfigError(f"approved_at must be an ISO 8601 time, got {value!r}")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.astimezone(dt.UTC).isoformat()


def _refuse_if_rolled_back(mv: ModelVersion, approved_at: str | None) -> None:
    """The re-run rule: a version that was rolled back moves back only on an approval given after
    the rollback. Clearing an old promote task in Airflow re-sends the *old* approval, so it is
    refused here (``PolicyError``, no retry) instead of silently undoing the rollback."""
    rolled_back_at = mv.tags.get(TAGS["rolled_back_at"])
    if not rolled_back_at:
        return
    approved, rolled = _parse_time(approved_at), _parse_time(rolled_back_at)
    if approved is not None and rolled is not None and approved > rolled:
        return
    by = mv.tags.get(TAGS["rolled_back_by"], "?")
    why = mv.tags.get(TAGS["rolled_back_reason"], "")
    raise PolicyError(
        f"{mv.name} version {mv.version} was rolled back by {by} at {rolled_back_at}"
        f"{f' ({why})' if why else ''}; it moves back to champion only on an approval given after that "
        f"(this promotion's approval: {approved_at or 'none'}). Start a new run for a fresh review, or "
        f"`kiln promote {mv.name} {mv.version} --approver NAME` after reviewing it again."
    )


def _record_of(mv: ModelVersion, policy: Policy, approver: str) -> PromotionRecord:
    """The promotion a version's tags record (for a re-run that finds the alias already there)."""
    return PromotionRecord(
        registered_model=mv.name, version=str(mv.version), alias=policy.alias,
        approver=mv.tags.get(TAGS["approver"], approver), at=mv.tags.get(TAGS["approved_at"], ""),
        previous_version=mv.tags.get(TAGS["previous_version"]) or None,
    )  # fmt: skip


def _decision_still_valid(
    decision: Decision, candidate: ModelVersion, holder: ModelVersion | None, policy: Policy
) -> Decision:
    """The decision to promote on: the caller's, or — when the champion changed since it was made
    (another run was promoted while this one waited for its review) — the gate run again against
    the current champion. ``PolicyError`` when the gate now holds."""
    current = None if holder is None else _report_from_tags(holder)
    then, now = decision.champion_bits_per_byte, None if current is None else current.bits_per_byte
    if then is None and now is None:
        return decision
    if then is not None and now is not None and math.isclose(then, now, rel_tol=1e-9, abs_tol=1e-12):
        return decision
    fresh = decide(_report_from_tags(candidate), current, policy.gate)
    if fresh.action != "promote":
        raise PolicyError(
            f"the champion changed since the gate decided (bits_per_byte then {then!r}, now {now!r} on "
            f"{policy.target_model} version {holder.version if holder else '-'}); against it the gate holds "
            f"{candidate.name} version {candidate.version}: {'; '.join(r for r in fresh.reasons if 'FAILED' in r)}"
        )
    return fresh


def promote(
    *, policy: Policy, candidate_version: str, decision: Decision, approver: str, run_key: str,
    approved_at: str | dt.datetime | None = None,
) -> PromotionRecord:
    """Give ``policy.alias`` on ``policy.target_model`` to the candidate — at most once per run.

    Refuses (``PolicyError``) a ``hold`` decision, an empty approver, a model the policy may not
    write, a version kiln did not register and a decision about other metrics than the version's.
    Order: copy into the target model when it differs from the candidate model (found again by
    its ``kiln.run_key`` tag on retry) → approver, time, decision and reasons as tags, and an audit
    event (``kiln.audit.*``) → the old holder gets alias ``previous`` → ``policy.alias`` moves LAST.
    A re-run after success finds the alias already on the version and writes nothing. When the
    champion changed since ``decision`` was made (e.g. during a 24 h review), the gate runs again
    against the current champion and a hold is refused (``PolicyError``) before anything moves.

    ``approved_at`` is when the approver decided (the review's answer; None: now, for a policy
    without human approval). A version that was rolled back is promoted again only on an
    approval given after the rollback: an Airflow re-run of an old promote task is refused
    (``PolicyError``), never a silent undo of the rollback. Transient MLflow failures are retried
    with backoff; a retry (or a re-run) completes a half-done promotion without a second copy.
    """
    if decision.action != "promote":
        raise PolicyError(f"the gate held this candidate; not promoting: {'; '.join(decision.reasons)}")
    if not approver.strip():
        raise PolicyError("promotion needs a named approver")
    policy.check_model_write(policy.target_model)
    policy.check_model_write(policy.candidate_model)
    target = policy.target_model
    approval_time = _utc_iso(approved_at) if approved_at else None

    def attempt() -> PromotionRecord:
        client = _client()
        candidate = client.get_model_version(policy.candidate_model, str(candidate_version))
        if RUN_KEY_TAG not in candidate.tags or TAGS["eval_bits_per_byte"] not in candidate.tags:
            raise PolicyError(f"{candidate.name} version {candidate.version} was not registered by kiln (no lineage)")
        tagged_bpb = float(candidate.tags[TAGS["eval_bits_per_byte"]])
        if not math.isclose(tagged_bpb, decision.candidate_bits_per_byte, rel_tol=1e-9, abs_tol=1e-12):
            raise PolicyError(
                f"decision is about bits_per_byte {decision.candidate_bits_per_byte!r}, but "
                f"{candidate.name} version {candidate.version} was evaluated at {tagged_bpb!r}"
            )

        holder = _version_by_alias(client, target, policy.alias)
        if holder is not None and holder.tags.get(RUN_KEY_TAG) == candidate.tags[RUN_KEY_TAG]:
            # Already promoted (this run or an earlier one; the copy carries the candidate's run
            # key): change nothing, report what is there.
            return _record_of(holder, policy, approver)
        existing = _existing_target_version(client, policy, candidate)
        if existing is not None:
            _refuse_if_rolled_back(existing, approval_time)
        # Before the copy: a candidate the gate now holds leaves nothing in the target model.
        chosen = _decision_still_valid(decision, candidate, holder, policy)
        mv = existing if existing is not None else _target_version(client, policy, candidate, run_key)
        version = str(mv.version)
        if holder is not None and str(holder.version) == version:
            return _record_of(holder, policy, approver)
        previous = str(holder.version) if holder is not None else None
        same_run = mv.tags.get(TAGS["promotion_run_key"]) == run_key
        if approval_time:
            at = approval_time
        elif same_run and mv.tags.get(TAGS["approved_at"]):
            at = mv.tags[TAGS["approved_at"]]  # a retry: keep the first attempt's time (and audit key)
        else:
            at = _now()
        tags = {
            TAGS["promotion_run_key"]: run_key,
            TAGS["approver"]: approver,
            TAGS["approved_at"]: at,
            TAGS["previous_version"]: previous or "",
            TAGS["source_version"]: f"{candidate.name}/{candidate.version}",
            **_decision_tags(chosen),
            **audit_tag("promotion", at, actor=approver, model=target, version=version,
                        from_version=previous or "", to_version=version, run_key=run_key,
                        decision=chosen.action),  # fmt: skip
        }
        for key, value in tags.items():
            if mv.tags.get(key) != value:
                client.set_model_version_tag(target, version, key, value)
        if previous is not None:
            client.set_registered_model_alias(target, PREVIOUS_ALIAS, previous)
        client.set_registered_model_alias(target, policy.alias, version)  # LAST: the commit point
        log.info("promoted %s/%s to %s@%s (version %s, previous %s), approved by %s at %s",
                 candidate.name, candidate.version, target, policy.alias, version, previous or "-", approver, at)  # fmt: skip
        return PromotionRecord(
            registered_model=target, version=version, alias=policy.alias, approver=approver, at=at,
            previous_version=previous,
        )  # fmt: skip

    return _with_retries(f"promoting {policy.candidate_model}/{candidate_version} to {target}@{policy.alias}", attempt)


def rollback(model: str, policy: Policy, actor: str, *, reason: str) -> PromotionRecord:
    """Move ``policy.alias`` back to the version holding ``previous``, with audit tags (who, when, why).

    Afterwards both aliases name the restored version, so a second rollback changes nothing (it
    does not flip back). The rolled-back version is marked (``kiln.rolled_back.*``): a later
    promotion of it needs an approval given after this moment (see ``promote``).
    ``RegistryError`` when there is nothing to roll back to.
    """
    if not actor.strip():
        raise PolicyError("rollback needs a named actor")
    if not reason.strip():
        raise PolicyError("rollback needs a reason (it goes into the audit trail)")
    policy.check_model_write(model)

    def attempt() -> PromotionRecord:
        client = _client()
        previous = _version_by_alias(client, model, PREVIOUS_ALIAS)
        if previous is None:
            raise RegistryError(f"{model} has no version with alias {PREVIOUS_ALIAS!r}: nothing to roll back to")
        current = _version_by_alias(client, model, policy.alias)
        version = str(previous.version)
        if current is not None and str(current.version) == version:
            return PromotionRecord(
                registered_model=model, version=version, alias=policy.alias,
                approver=previous.tags.get(TAGS["rollback_actor"], actor),
                at=previous.tags.get(TAGS["rollback_at"], ""),
                previous_version=previous.tags.get(TAGS["rollback_from_version"]) or None,
            )  # fmt: skip
        from_version = str(current.version) if current is not None else ""
        at = _pending_rollback_time(previous, current) or utc_now()
        for key, value in {TAGS["rollback_actor"]: actor, TAGS["rollback_at"]: at,
                           TAGS["rollback_from_version"]: from_version, TAGS["rollback_reason"]: reason,
                           **audit_tag("rollback", at, actor=actor, model=model, version=version,
                                       from_version=from_version, to_version=version, reason=reason)}.items():  # fmt: skip
            if previous.tags.get(key) != value:
                client.set_model_version_tag(model, version, key, value)
        if current is not None:
            for key, value in {TAGS["rolled_back_by"]: actor, TAGS["rolled_back_at"]: at,
                               TAGS["rolled_back_reason"]: reason}.items():  # fmt: skip
                client.set_model_version_tag(model, from_version, key, value)
        client.set_registered_model_alias(model, policy.alias, version)  # LAST
        log.info("rolled back %s@%s from version %s to %s by %s at %s: %s",
                 model, policy.alias, from_version or "-", version, actor, at, reason)  # fmt: skip
        return PromotionRecord(
            registered_model=model, version=version, alias=policy.alias, approver=actor, at=at,
            previous_version=from_version or None,
        )  # fmt: skip

    return _with_retries(f"rolling back {model}@{policy.alias}", attempt)


def _pending_rollback_time(previous: ModelVersion, current: ModelVersion | None) -> str | None:
    """The time of a rollback from ``current`` to ``previous`` that an earlier attempt started but
    did not finish (tags written, alias not moved), so the retry completes that one audit event
    instead of recording a second."""
    at = previous.tags.get(TAGS["rollback_at"])
    if current is None or not at or previous.tags.get(TAGS["rollback_from_version"]) != str(current.version):
        return None
    if current.tags.get(TAGS["rolled_back_at"]) not in (None, at):
        return None
    promoted, started = _parse_time(current.tags.get(TAGS["approved_at"])), _parse_time(at)
    if promoted is not None and started is not None and promoted > started:
        return None  # current was promoted again after that rollback: this is a new one
    return at


def record_review(
    *, policy: Policy, candidate_version: str, outcome: str, reviewer: str, at: str, comment: str = ""
) -> None:
    """Tag a candidate version with the human review's outcome (``approved``/``rejected``/``timed out``).

    Only tags: nothing is copied and no alias moves, whatever the outcome. Idempotent (a re-run
    writes the same values, and skips the ones already there). Promotion writes its own approver
    tags on the promoted version; this records every review, including the ones that stopped a
    promotion (a rejection, or nobody answering within the policy's approval timeout), on the
    candidate that was reviewed, plus one audit event per review. For a timeout, ``reviewer``
    names who was asked (e.g. the policy's reviewers) and ``at`` when the wait ended.
    """
    if outcome not in REVIEW_OUTCOMES:
        raise ConfigError(f"review outcome must be one of {REVIEW_OUTCOMES}, got {outcome!r}")
    policy.check_model_write(policy.candidate_model)
    when = _utc_iso(at) if _parse_time(at) else _now()
    wanted = {TAGS["review"]: outcome, TAGS["reviewer"]: reviewer, TAGS["reviewed_at"]: at}
    if comment:
        wanted[TAGS["review_comment"]] = comment[:AUDIT_TEXT_MAX]

    def attempt() -> None:
        client = _client()
        mv = client.get_model_version(policy.candidate_model, str(candidate_version))
        event = audit_tag("review", when, actor=reviewer, model=policy.candidate_model, version=str(candidate_version),
                          decision=outcome, comment=comment, run_key=mv.tags.get(RUN_KEY_TAG, ""))  # fmt: skip
        for key, value in {**wanted, **event}.items():
            if mv.tags.get(key) != value:
                client.set_model_version_tag(policy.candidate_model, str(candidate_version), key, value)

    _with_retries(f"recording the review of {policy.candidate_model} v{candidate_version}", attempt)


# -------------------------------------------------------------------------------------------- audit

AUDIT_PREFIX = "kiln.audit."
"""Version tags ``kiln.audit.<YYYYmmddTHHMMSSZ>.<event>`` = JSON: one per approval/review,
promotion and rollback. The other ``kiln.*`` tags say how things stand; these say what happened,
and are never overwritten by a later event."""
AUDIT_EVENTS = ("review", "promotion", "rollback")
AUDIT_TEXT_MAX = 1000
"""Longest reason/comment kept (MLflow tag values are bounded)."""


def audit_tag(event: str, at: str, **fields: str) -> dict[str, str]:
    """One audit event as a version tag: the key holds time and kind (so retries write the same key)."""
    if event not in AUDIT_EVENTS:
        raise ConfigError(f"audit event must be one of {AUDIT_EVENTS}, got {event!r}")
    when = _parse_time(at)
    if when is None:
        raise ConfigError(f"audit time must be ISO 8601, got {at!r}")
    stamp = when.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    body = {"event": event, "at": at, **{k: (v[:AUDIT_TEXT_MAX] if isinstance(v, str) else v) for k, v in fields.items()}}
    return {f"{AUDIT_PREFIX}{stamp}.{event}": json.dumps(body, sort_keys=True)}


def _events_of(mv: ModelVersion) -> list[dict[str, Any]]:
    events = []
    for key, value in mv.tags.items():
        if not key.startswith(AUDIT_PREFIX):
            continue
        try:
            event = json.loads(value)
        except ValueError:
            log.warning("%s version %s: unreadable audit tag %s", mv.name, mv.version, key)
            continue
        if isinstance(event, dict) and event.get("event") in AUDIT_EVENTS:
            events.append(event)
    if events:
        return events
    # Versions written before audit events existed: what their state tags still tell.
    tags = mv.tags
    if tags.get(TAGS["review"]):
        events.append({"event": "review", "at": tags.get(TAGS["reviewed_at"], ""), "actor": tags.get(TAGS["reviewer"], ""),
                       "model": mv.name, "version": str(mv.version), "decision": tags[TAGS["review"]],
                       "comment": tags.get(TAGS["review_comment"], "")})  # fmt: skip
    if tags.get(TAGS["approver"]):
        events.append({"event": "promotion", "at": tags.get(TAGS["approved_at"], ""), "actor": tags[TAGS["approver"]],
                       "model": mv.name, "version": str(mv.version), "from_version": tags.get(TAGS["previous_version"], ""),
                       "to_version": str(mv.version), "run_key": tags.get(TAGS["promotion_run_key"], "")})  # fmt: skip
    if tags.get(TAGS["rollback_actor"]):
        events.append({"event": "rollback", "at": tags.get(TAGS["rollback_at"], ""), "actor": tags[TAGS["rollback_actor"]],
                       "model": mv.name, "version": str(mv.version), "from_version": tags.get(TAGS["rollback_from_version"], ""),
                       "to_version": str(mv.version), "reason": tags.get(TAGS["rollback_reason"], "")})  # fmt: skip
    return events


def audit_history(model: str, policy: Policy | None = None) -> list[dict[str, Any]]:
    """Every review, promotion and rollback recorded on ``model``'s versions, oldest first.

    When ``model`` is ``policy``'s target model, the reviews on its candidate model are included
    (a rejected or timed-out candidate never reaches the target model). Read-only: any identity
    with READ may audit.
    """
    models = [model]
    if policy is not None and model == policy.target_model and policy.candidate_model != model:
        models.append(policy.candidate_model)

    def attempt() -> list[dict[str, Any]]:
        client = _client()
        events: list[dict[str, Any]] = []
        for name in models:
            try:
                client.get_registered_model(name)
            except Exception as exc:
                if _is_not_found(exc):
                    if name == model:
                        raise RegistryError(f"registered model {model!r} does not exist") from exc
                    continue
                raise
            for mv in client.search_model_versions(f"name = {_quote(name, 'model name')}"):
                for event in _events_of(mv):
                    if name != model and event["event"] != "review":
                        continue
                    events.append({"model": mv.name, "version": str(mv.version), **event})
        # A promoted copy carries its candidate's tags: the same event twice is one event.
        unique = {json.dumps(e, sort_keys=True): e for e in events}
        events = list(unique.values())
        far_past = dt.datetime.min.replace(tzinfo=dt.UTC)
        return sorted(events, key=lambda e: (_parse_time(e.get("at")) or far_past, e["event"], int(e["version"])))

    return _with_retries(f"reading the audit trail of {model}", attempt)

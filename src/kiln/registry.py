"""The promotion gate and the MLflow registry writes: register, decide, promote, roll back.

The *decision* is pure (``decide``: metrics in, ``Decision`` out, no I/O); the *writes* are the
other functions here, each idempotent and keyed by the Airflow run (``run_key`` =
``"<dag_id>/<run_id>"``)::

    register_candidate(...)      verify checkpoint → policy check → find-or-create a version in
                                 policy.candidate_model, tagged with its lineage
    champion_report(policy)      EvalReport of the version holding policy.alias (None: first model)
    decide(cand, champ, gate)    Decision("promote" | "hold", reasons)
    promote(...)                 copy into policy.target_model → all tags → ``previous`` alias →
                                 policy.alias LAST, so readers never see a half-promoted model
    rollback(model, policy, …)   policy.alias back to the version holding ``previous`` (audited)

Every version this module writes carries its facts as tags prefixed ``kiln.`` (see ``TAGS``), so
a reviewer reads the lineage in the MLflow UI and ``champion_report`` reads the champion's metrics
back without any other store. mlflow is imported inside the functions (importing this module stays
cheap) and its errors are translated here: ``raise RegistryError(...) from exc``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    "source_version": "kiln.source_version",
    "promotion_run_key": "kiln.promotion.run_key",
    "approver": "kiln.promotion.approver",
    "approved_at": "kiln.promotion.approved_at",
    "previous_version": "kiln.promotion.previous_version",
    "rollback_actor": "kiln.rollback.actor",
    "rollback_at": "kiln.rollback.at",
    "rollback_from_version": "kiln.rollback.from_version",
    "rolled_back_by": "kiln.rolled_back.by",
    "rolled_back_at": "kiln.rolled_back.at",
    "review": "kiln.review",
    "reviewer": "kiln.review.by",
    "reviewed_at": "kiln.review.at",
}
RUN_MODEL_URI_TAG = "kiln.model_uri"
"""Run tag: the model already logged into this run for ``kiln.run_key`` (retries reuse it)."""


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

        if isinstance(exc, MlflowException | OSError) or type(exc).__module__.startswith(("requests", "urllib3")):
            raise RegistryError(f"{action}: {exc}") from exc
        raise


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


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


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


def _description(tags: dict[str, str], decision: Decision, champion: EvalReport | None) -> str:
    champ = f"{champion.bits_per_byte:.4f}" if champion else "none (first model)"
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    return (
        f"kiln candidate from `{tags[RUN_KEY_TAG]}` (policy `{tags[TAGS['policy']]}`).\n\n"
        f"| | value |\n|---|---|\n"
        f"| eval bits/byte | {float(tags[TAGS['eval_bits_per_byte']]):.4f} |\n"
        f"| champion bits/byte | {champ} |\n"
        f"| snapshot | `{tags[TAGS['snapshot_id']]}` |\n"
        f"| contract | `{tags[TAGS['contract']]}` (quarantined shards: {tags[TAGS['quarantined_shards']]}) |\n"
        f"| weights sha256 | `{tags[TAGS['weights_sha256']]}` |\n"
        f"| git | `{tags[TAGS['git_sha']]}` |\n\n"
        f"Gate: **{decision.action}**\n\n{reasons}\n\n"
        f"Evaluation report: run artifacts `evaluation/report.md`, `evaluation/eval_report.json`."
    )


def _report_markdown(eval_report: EvalReport, champion: EvalReport | None, decision: Decision,
                     tags: dict[str, str]) -> str:  # fmt: skip
    rows = [("bits per byte", "bits_per_byte"), ("loss", "loss"), ("tokens", "tokens"), ("split", "split")]
    table = "\n".join(
        f"| {label} | {getattr(eval_report, attr)} | {getattr(champion, attr) if champion else '—'} |"
        for label, attr in rows
    )
    lineage = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(tags.items()) if k != TAGS["dvc"])
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    return (
        f"# Evaluation report — {tags[RUN_KEY_TAG]}\n\n"
        f"## Candidate vs champion\n\n| metric | candidate | champion |\n|---|---|---|\n{table}\n\n"
        f"## Gate decision: {decision.action}\n\n{reasons}\n\n"
        f"The loss curve: the training metrics of this run (Model metrics tab).\n\n"
        f"## Lineage\n\n| tag | value |\n|---|---|\n{lineage}\n\n"
        f"## DVC snapshot\n\n```yaml\n{tags[TAGS['dvc']]}\n```\n"
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
    3. an existing version tagged ``kiln.run_key == run_key`` is returned as is (a retry);
    4. otherwise the model is logged into the training run (``train.mlflow_run_id``; a run of
       experiment ``kiln-<policy>`` keyed by ``run_key`` when empty) with the eval metrics, the
       eval report (JSON + Markdown) and the decision as artifacts, and the version is created
       with all lineage tags in the same request.

    ``decision`` defaults to ``decide(eval_report, champion_report(policy), policy.gate)``.
    Returns ``{"model_name", "version", "run_id", "model_uri", "source", "decision",
    "created"}`` (JSON-safe; ``created`` is False on a retry that found the version).
    """
    verified = _verify_checkpoint(train.checkpoint)
    _check_consistency(verified, train, eval_report, snapshot, manifest)
    manifest.verify()
    policy.check_model_write(policy.candidate_model)
    tags = lineage_tags(policy=policy, train=train, eval_report=eval_report, snapshot=snapshot,
                        manifest=manifest, run_key=run_key, verified=verified, lineage=lineage or {})  # fmt: skip
    model = policy.candidate_model

    with _translated(f"registering {model} for {run_key}"):
        client = _client()
        existing = _versions_with_tag(client, model, RUN_KEY_TAG, run_key)
        if existing:
            mv = existing[0]
            stored = _decision_from_tags(mv.tags, eval_report.bits_per_byte)
            return {**_version_ref(mv), "decision": stored.to_json(), "created": False}

        champion = champion_report(policy)
        if decision is None:
            decision = decide(eval_report, champion, policy.gate)
        tags.update(_decision_tags(decision))
        run_id, own_run = _find_or_start_run(client, policy, train, run_key)
        model_uri = _log_into_run(client, run_id, run_key, train, eval_report, champion, decision, tags)

        import mlflow

        mv = mlflow.register_model(model_uri, model, tags=tags)
        client.update_model_version(model, mv.version, description=_description(tags, decision, champion))
        if own_run:
            client.set_terminated(run_id, "FINISHED")
        return {**_version_ref(mv), "decision": decision.to_json(), "created": True}


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
    for name, value in (("eval_bits_per_byte", eval_report.bits_per_byte), ("eval_loss", eval_report.loss),
                        ("eval_tokens", float(eval_report.tokens))):  # fmt: skip
        if math.isfinite(value):
            client.log_metric(run_id, name, value)
    client.log_dict(run_id, eval_report.to_json(), "evaluation/eval_report.json")
    client.log_dict(run_id, decision.to_json(), "evaluation/decision.json")
    if champion is not None:
        client.log_dict(run_id, champion.to_json(), "evaluation/champion_eval_report.json")
    client.log_text(run_id, _report_markdown(eval_report, champion, decision, tags), "evaluation/report.md")
    # log_model writes into the *active* run: resume the run just for that call. start_run/end_run
    # change the run's status, which the DAG owns, so put back whatever status it had.
    status = run.info.status
    with mlflow.start_run(run_id=run_id):
        model_uri = _log_checkpoint_model(train.checkpoint)
    if status != "FINISHED":
        client.update_run(run_id, status=status)
    client.set_tag(run_id, RUN_MODEL_URI_TAG, model_uri)
    return model_uri


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
        )
    except (KeyError, ValueError) as exc:
        raise RegistryError(
            f"{mv.name} version {mv.version} has no readable kiln eval tags ({exc}); "
            "it was not registered by kiln — tag it or roll the alias back"
        ) from exc


def version_report(model: str, version: str) -> EvalReport:
    """The evaluation a kiln-registered version carries in its tags (``RegistryError`` if none)."""
    with _translated(f"reading {model}/{version}"):
        return _report_from_tags(_client().get_model_version(model, str(version)))


def champion_report(policy: Policy) -> EvalReport | None:
    """The evaluation of the version holding ``policy.alias`` on ``policy.target_model``.

    ``None`` when nobody holds the alias yet (the first model). Read-only.
    """
    with _translated(f"reading {policy.target_model}@{policy.alias}"):
        mv = _version_by_alias(_client(), policy.target_model, policy.alias)
        return None if mv is None else _report_from_tags(mv)


# ------------------------------------------------------------------------------------------ promote


def _target_version(client: MlflowClient, policy: Policy, candidate: ModelVersion, run_key: str) -> ModelVersion:
    if policy.candidate_model == policy.target_model:
        return candidate
    # copy_model_version carries the candidate's tags, kiln.run_key included, in the same request
    # that creates the copy — so this lookup finds a copy even if we crashed right after making it.
    source_key = candidate.tags[RUN_KEY_TAG]
    copies = _versions_with_tag(client, policy.target_model, RUN_KEY_TAG, source_key)
    if copies:
        return copies[0]
    return client.copy_model_version(f"models:/{candidate.name}/{candidate.version}", policy.target_model)


def promote(
    *, policy: Policy, candidate_version: str, decision: Decision, approver: str, run_key: str
) -> PromotionRecord:
    """Give ``policy.alias`` on ``policy.target_model`` to the candidate — at most once per run.

    Refuses (``PolicyError``) a ``hold`` decision, an empty approver, a model the policy may not
    write, a version kiln did not register and a decision about other metrics than the version's.
    Order: copy into the target model when it differs from the candidate model (found again by
    its ``kiln.run_key`` tag on retry) → approver, time, decision and reasons as tags → the old
    holder gets alias ``previous`` → ``policy.alias`` moves LAST. A re-run after success finds the
    alias already on the version and writes nothing.
    """
    if decision.action != "promote":
        raise PolicyError(f"the gate held this candidate; not promoting: {'; '.join(decision.reasons)}")
    if not approver.strip():
        raise PolicyError("promotion needs a named approver")
    policy.check_model_write(policy.target_model)
    policy.check_model_write(policy.candidate_model)
    target = policy.target_model

    with _translated(f"promoting {policy.candidate_model}/{candidate_version} to {target}@{policy.alias}"):
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

        mv = _target_version(client, policy, candidate, run_key)
        version = str(mv.version)
        holder = _version_by_alias(client, target, policy.alias)
        if holder is not None and str(holder.version) == version:
            # Already promoted (this run or an earlier one): change nothing, report what is there.
            return PromotionRecord(
                registered_model=target, version=version, alias=policy.alias,
                approver=mv.tags.get(TAGS["approver"], approver),
                at=mv.tags.get(TAGS["approved_at"], ""),
                previous_version=mv.tags.get(TAGS["previous_version"]) or None,
            )  # fmt: skip

        previous = str(holder.version) if holder is not None else None
        same_run = mv.tags.get(TAGS["promotion_run_key"]) == run_key
        at = mv.tags.get(TAGS["approved_at"]) if same_run and mv.tags.get(TAGS["approved_at"]) else _now()
        tags = {
            TAGS["promotion_run_key"]: run_key,
            TAGS["approver"]: approver,
            TAGS["approved_at"]: at,
            TAGS["previous_version"]: previous or "",
            TAGS["source_version"]: f"{candidate.name}/{candidate.version}",
            **_decision_tags(decision),
        }
        for key, value in tags.items():
            if mv.tags.get(key) != value:
                client.set_model_version_tag(target, version, key, value)
        if previous is not None:
            client.set_registered_model_alias(target, PREVIOUS_ALIAS, previous)
        client.set_registered_model_alias(target, policy.alias, version)  # LAST: the commit point
        return PromotionRecord(
            registered_model=target, version=version, alias=policy.alias, approver=approver, at=at,
            previous_version=previous,
        )  # fmt: skip


def rollback(model: str, policy: Policy, actor: str) -> PromotionRecord:
    """Move ``policy.alias`` back to the version holding ``previous``, with audit tags.

    Afterwards both aliases name the restored version, so a second rollback changes nothing (it
    does not flip back). ``RegistryError`` when there is nothing to roll back to.
    """
    if not actor.strip():
        raise PolicyError("rollback needs a named actor")
    policy.check_model_write(model)
    with _translated(f"rolling back {model}@{policy.alias}"):
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
        at = _now()
        from_version = str(current.version) if current is not None else ""
        for key, value in {TAGS["rollback_actor"]: actor, TAGS["rollback_at"]: at,
                           TAGS["rollback_from_version"]: from_version}.items():  # fmt: skip
            client.set_model_version_tag(model, version, key, value)
        if current is not None:
            client.set_model_version_tag(model, from_version, TAGS["rolled_back_by"], actor)
            client.set_model_version_tag(model, from_version, TAGS["rolled_back_at"], at)
        client.set_registered_model_alias(model, policy.alias, version)  # LAST
        return PromotionRecord(
            registered_model=model, version=version, alias=policy.alias, approver=actor, at=at,
            previous_version=from_version or None,
        )  # fmt: skip


def record_review(*, policy: Policy, candidate_version: str, outcome: str, reviewer: str, at: str) -> None:
    """Tag a candidate version with the human review's outcome (``approved``/``rejected``/``timed out``).

    Idempotent (tags are overwritten with the same values on a re-run). Promotion writes its own
    approver tags on the promoted version; this records every review, including the ones that
    stopped a promotion, on the candidate that was reviewed.
    """
    policy.check_model_write(policy.candidate_model)
    with _translated(f"recording the review of {policy.candidate_model} v{candidate_version}"):
        client = _client()
        for key, value in {TAGS["review"]: outcome, TAGS["reviewer"]: reviewer, TAGS["reviewed_at"]: at}.items():
            client.set_model_version_tag(policy.candidate_model, candidate_version, key, value)

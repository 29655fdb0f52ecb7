"""The tag keys kiln writes on model versions and runs, and the pure conversions between tags and refs."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError
from kiln.refs import (
    Decision,
    EvalReport,
    ReviewOutcome,
)
from kiln.shipped import CHECKOUT
from kiln.util.fs import parse_own_json
from kiln_trainer.contract import MANIFEST_NAME

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion




EVAL_SPLIT = "eval"
PREVIOUS_ALIAS = "previous"
MODEL_ARTIFACT_NAME = "model"
CHECKPOINT_MANIFEST_NAME = MANIFEST_NAME
"""The trainer's commit record inside a step directory (the contract's ``MANIFEST_NAME``)."""

# Tag keys. Every kiln tag starts with "kiln." so that kiln's facts never collide with a user's.
TAGS = {
    "policy": "kiln.policy",
    "policy_config": "kiln.policy.config",
    "policy_config_sha256": "kiln.policy.config_sha256",
    "snapshot_id": "kiln.snapshot_id",
    "corpus": "kiln.corpus",
    "dvc": "kiln.dvc",
    "dvc_remote": "kiln.dvc_remote",
    "training_manifest_sha256": "kiln.training_manifest_sha256",
    "tokenizer_sha256": "kiln.tokenizer_sha256",
    "tokenizer": "kiln.tokenizer",
    "token_manifest_sha256": "kiln.token_manifest_sha256",
    "contract": "kiln.contract",
    "quarantined_shards": "kiln.quarantined_shards",
    "recipe_sha256": "kiln.recipe_sha256",
    "trainer": "kiln.trainer",
    "trainer_distribution": "kiln.trainer.distribution",
    "trainer_version": "kiln.trainer.version",
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
    # why a completed training ended before its recipe's steps (a mixture's capped source); absent otherwise
    "train_stop": "kiln.train.stop",
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
    # the signed rollback attestation (kiln.provenance.approval) in the restored version's run, and its sha256
    "rollback_attestation": "kiln.rollback.attestation",
    "rollback_attestation_sha256": "kiln.rollback.attestation_sha256",
    "rolled_back_by": "kiln.rolled_back.by",
    "rolled_back_at": "kiln.rolled_back.at",
    "rolled_back_reason": "kiln.rolled_back.reason",
    # kiln reproduce's verdict on the version (kiln.provenance.reproduce): reproduced | differs | refused
    "reproduction_verdict": "kiln.reproduction.verdict",
    "reproduction_detail": "kiln.reproduction.detail",
    "reproduction_at": "kiln.reproduction.at",
    "reproduction_attestation": "kiln.reproduction.attestation",
    "reproduction_attestation_sha256": "kiln.reproduction.attestation_sha256",
    # the world size it trained at; at another than the recorded one, the bound and the largest weight difference
    "reproduction_world_size": "kiln.reproduction.world_size",
    "reproduction_weights_compared": "kiln.reproduction.weights_compared",
    "reproduction_tolerance": "kiln.reproduction.tolerance",
    "reproduction_max_abs_diff": "kiln.reproduction.max_abs_diff",
    "promotion_approval": "kiln.promotion.approval",
    # the signed approval attestation (kiln.provenance.approval) in the version's run, and its sha256
    "promotion_attestation": "kiln.promotion.attestation",
    "promotion_attestation_sha256": "kiln.promotion.attestation_sha256",
    "review": "kiln.review",
    "reviewer": "kiln.review.by",
    "reviewed_at": "kiln.review.at",
    "review_comment": "kiln.review.comment",
    "review_run_key": "kiln.review.run_key",
    "review_subject": "kiln.review.subject",
    "rollback_review": "kiln.rollback_review",
    "rollback_reviewer": "kiln.rollback_review.by",
    "rollback_reviewed_at": "kiln.rollback_review.at",
    "rollback_review_comment": "kiln.rollback_review.comment",
    "rollback_review_run_key": "kiln.rollback_review.run_key",
    "rollback_review_subject": "kiln.rollback_review.subject",
}
RUN_MODEL_URI_TAG = "kiln.model_uri"
"""Run tag: the model already logged into this run for ``kiln.run_key`` (retries reuse it)."""
RUN_STATUS_TAG = "kiln.register.run_status"
"""Run tag: the run's status before registration first resumed it (restored after every attempt)."""
REVIEW_OUTCOMES: tuple[ReviewOutcome, ...] = ("approved", "rejected", "timed out")
REVIEW_TAGS = {
    "promotion": {"outcome": TAGS["review"], "reviewer": TAGS["reviewer"], "at": TAGS["reviewed_at"],
                  "comment": TAGS["review_comment"], "run_key": TAGS["review_run_key"],
                  "subject": TAGS["review_subject"]},
    "rollback": {"outcome": TAGS["rollback_review"], "reviewer": TAGS["rollback_reviewer"],
                 "at": TAGS["rollback_reviewed_at"], "comment": TAGS["rollback_review_comment"],
                 "run_key": TAGS["rollback_review_run_key"], "subject": TAGS["rollback_review_subject"]},
}
"""Where a review is recorded, per kind: a promotion's on the candidate version, a rollback's on the
version that would lose the alias. Kept apart because a promoted copy carries its candidate's tags."""
APPROVAL_REVIEW, APPROVAL_MANUAL, APPROVAL_NOT_REQUIRED = "review", "manual", "not required"
"""How a promotion was approved (``kiln.promotion.approval``, and in its audit event): a reviewer's
answer recorded by the run's approval task; a named person's ``kiln promote``; a policy that needs none."""
REPORT_DIR = "evaluation"
LOSS_METRIC = "loss"
"""The trainer's per-step training loss (MLflow metric and ``metrics.jsonl`` key)."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def utc_now() -> str:
    """Now, ISO 8601 in UTC with microseconds: for times that are compared with each other
    (an approval against a rollback), where whole seconds could tie."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


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
        reasons=parse_own_json(tags.get(TAGS["decision_reasons"], "[]"), TAGS["decision_reasons"]),
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

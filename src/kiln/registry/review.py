"""Reviews: a run's human answer recorded as tags on the candidate, and the approval promotion asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard

from kiln.errors import ConfigError, PolicyError
from kiln.policy import Policy
from kiln.refs import (
    Review,
    ReviewOutcome,
)
from kiln.runs import RUN_KEY_TAG, split_run_key

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

from kiln.registry import mlflow_io
from kiln.registry.audit import AUDIT_TEXT_MAX, audit_tag
from kiln.registry.mlflow_io import _with_retries
from kiln.registry.tags import APPROVAL_NOT_REQUIRED, APPROVAL_REVIEW, REVIEW_OUTCOMES, REVIEW_TAGS, _now, _parse_time, _utc_iso


def promotion_subject(model: str, version: str) -> str:
    """What a promotion review asks about, exactly (recorded with the answer and checked on use)."""
    return f"promote {model} version {version}"


def rollback_subject(model: str, alias: str, from_version: str, to_version: str) -> str:
    """What a rollback review asks about, exactly: which alias, from which version to which."""
    return f"roll {model}@{alias} back from version {from_version} to version {to_version}"


def record_review(
    *, policy: Policy, candidate_version: str, run_key: str, outcome: str, reviewer: str, at: str, comment: str = "",
) -> Review:
    """Record run ``run_key``'s review of its candidate (``approved``/``rejected``/``timed out``) on it.

    Called by the run's approval task with the answer Airflow recorded for its HITL request: the
    only evidence of a human approval that no Airflow user can forge (task states and XComs can be
    set by anyone with the role "user"), written through the policy's MLflow identity. ``promote``
    reads it back. Refuses (``PolicyError``, nothing written) an approval by someone who is not one
    of ``policy.reviewers`` and a version another run registered. Only tags (the review's state
    ``kiln.review*`` and one audit event): nothing is copied and no alias moves. Idempotent; a later
    review of the same run (the approval task asked again) replaces the earlier state. For a
    timeout, ``reviewer`` names who was asked and ``at`` when the wait ended.
    """
    version = str(candidate_version)

    def registered_by_this_run(mv: ModelVersion) -> None:
        if mv.tags.get(RUN_KEY_TAG) != run_key:
            raise PolicyError(
                f"{mv.name} version {mv.version} was registered by run {mv.tags.get(RUN_KEY_TAG)!r}, not by "
                f"{run_key!r}: a run's approval task reviews only its own candidate"
            )

    return _record_review(
        policy, "promotion", policy.candidate_model, version, promotion_subject(policy.candidate_model, version),
        run_key=run_key, outcome=outcome, reviewer=reviewer, at=at, comment=comment, check=registered_by_this_run,
    )


def record_rollback_review(
    *, policy: Policy, from_version: str, to_version: str, run_key: str, outcome: str, reviewer: str, at: str,
    comment: str = "",
) -> Review:
    """Record a champion watch run's review of its proposed rollback on the version that would lose
    ``policy.alias``; the same rules as ``record_review`` (``rollback_approval`` reads it back)."""
    subject = rollback_subject(policy.target_model, policy.alias, str(from_version), str(to_version))
    return _record_review(policy, "rollback", policy.target_model, str(from_version), subject, run_key=run_key,
                          outcome=outcome, reviewer=reviewer, at=at, comment=comment)


def _record_review(
    policy: Policy, kind: str, model: str, version: str, subject: str, *, run_key: str, outcome: str, reviewer: str,
    at: str, comment: str, check: Callable[[ModelVersion], None] | None = None,
) -> Review:
    if not _is_review_outcome(outcome):
        raise ConfigError(f"review outcome must be one of {REVIEW_OUTCOMES}, got {outcome!r}")
    split_run_key(run_key)
    if outcome == "approved":
        if reviewer not in policy.reviewers:
            raise PolicyError(
                f"{reviewer!r} answered Approve, but is not one of policy {policy.name!r}'s reviewers "
                f"({', '.join(policy.reviewers) or 'none'}): not recorded as an approval"
            )
        if _parse_time(at) is None:
            raise ConfigError(f"an approval needs the time it was given (ISO 8601), got {at!r}")
    policy.check_model_write(model)
    review = Review(subject=subject, outcome=outcome, reviewer=reviewer, at=at, run_key=run_key,
                    comment=comment[:AUDIT_TEXT_MAX])
    keys = REVIEW_TAGS[kind]
    wanted = {keys["outcome"]: outcome, keys["reviewer"]: reviewer, keys["at"]: at, keys["run_key"]: run_key,
              keys["subject"]: subject}
    if comment:
        wanted[keys["comment"]] = review.comment
    event = audit_tag("review", _utc_iso(at) if _parse_time(at) else _now(), actor=reviewer, model=model,
                      version=version, decision=outcome, comment=comment, run_key=run_key, subject=subject)

    def attempt() -> Review:
        client = mlflow_io._client()
        mv = client.get_model_version(model, version)
        if check is not None:
            check(mv)
        for key, value in {**wanted, **event}.items():
            if mv.tags.get(key) != value:
                client.set_model_version_tag(model, version, key, value)
        return review

    return _with_retries(f"recording the review of {model} v{version} ({run_key})", attempt)


def _is_review_outcome(value: object) -> TypeGuard[ReviewOutcome]:
    return value in REVIEW_OUTCOMES


def _review_on(mv: ModelVersion, kind: str) -> Review | None:
    """The review of ``kind`` recorded on ``mv`` (None: none recorded)."""
    keys, tags = REVIEW_TAGS[kind], mv.tags
    outcome = tags.get(keys["outcome"])
    if not _is_review_outcome(outcome):
        return None
    return Review(subject=tags.get(keys["subject"], ""), outcome=outcome, reviewer=tags.get(keys["reviewer"], ""),
                  at=tags.get(keys["at"], ""), run_key=tags.get(keys["run_key"], ""),
                  comment=tags.get(keys["comment"], ""))


def _approved_review(mv: ModelVersion, kind: str, subject: str, run_key: str, policy: Policy) -> Review:
    """The approval of exactly ``subject`` given in run ``run_key`` by one of the policy's reviewers,
    as recorded on ``mv``; ``PolicyError`` naming what is missing otherwise. Only an approval task
    writes one: a task marked success by hand, or an XCom, never counts."""
    review = _review_on(mv, kind)
    asked = f"policy {policy.name!r} requires a reviewer's approval to {subject} (run {run_key})"
    if kind == "promotion":
        again = ("Clear the run's approval task to ask again, or promote by hand after reviewing it: "
                 f"`kiln promote {mv.name} {mv.version} --approver NAME`.")
    else:
        again = "The next champion watch run re-evaluates and may propose it again."
    if review is None:
        problem = f"no review is recorded on {mv.name} version {mv.version} (a task marked success is no approval)"
    elif review.run_key != run_key:
        problem = f"the review recorded on {mv.name} version {mv.version} was given in run {review.run_key or '?'}"
    elif review.subject != subject:
        problem = f"the review recorded in this run was about {review.subject!r}"
    elif review.outcome != "approved":
        problem = (f"the review recorded in this run says {review.outcome!r} "
                   f"({review.reviewer or '?'}, {review.at or '?'})")
    elif review.reviewer not in policy.reviewers:
        problem = f"it was approved by {review.reviewer!r}, who is not a reviewer ({', '.join(policy.reviewers)})"
    elif _parse_time(review.at) is None:
        problem = f"the recorded approval has no valid time ({review.at!r})"
    else:
        return review
    raise PolicyError(f"{asked}: {problem}; not moving anything. {again}")


def _approval_of_run(candidate: ModelVersion, policy: Policy, run_key: str) -> tuple[str, str | None, str]:
    """``(approver, approved_at, how)`` of run ``run_key``'s promotion of ``candidate``.

    ``PolicyError`` when that run may not promote it: the candidate is another run's (a forged
    ``register_candidate`` XCom), or the policy requires approval and no reviewer's approval of
    this version in this run is recorded on it."""
    registered_by = candidate.tags.get(RUN_KEY_TAG)
    if registered_by != run_key:
        raise PolicyError(
            f"run {run_key!r} promotes only the candidate it registered; {candidate.name} version "
            f"{candidate.version} was registered by run {registered_by!r}"
        )
    if not policy.requires_approval:
        return f"policy:{policy.name} (no human approval required)", None, APPROVAL_NOT_REQUIRED
    subject = promotion_subject(candidate.name, str(candidate.version))
    review = _approved_review(candidate, "promotion", subject, run_key, policy)
    return review.reviewer, _utc_iso(review.at), APPROVAL_REVIEW


def recorded_review(policy: Policy, version: str, run_key: str, *, kind: str = "promotion") -> Review | None:
    """Run ``run_key``'s review as recorded on ``version`` (of the candidate model for a promotion,
    of the target model for a rollback); None: none, or another run's. Read-only."""
    model = policy.candidate_model if kind == "promotion" else policy.target_model

    def attempt() -> Review | None:
        review = _review_on(mlflow_io._client().get_model_version(model, str(version)), kind)
        return review if review is not None and review.run_key == run_key else None

    return _with_retries(f"reading the review of {model} v{version}", attempt)


def rollback_approval(policy: Policy, from_version: str, to_version: str, run_key: str) -> Review:
    """The approval, recorded by champion watch run ``run_key``'s review task, to roll ``policy.alias``
    back from ``from_version`` to ``to_version``; ``PolicyError`` when there is none. Read-only."""
    subject = rollback_subject(policy.target_model, policy.alias, str(from_version), str(to_version))

    def attempt() -> Review:
        mv = mlflow_io._client().get_model_version(policy.target_model, str(from_version))
        return _approved_review(mv, "rollback", subject, run_key, policy)

    return _with_retries(f"reading the rollback review of {policy.target_model} v{from_version}", attempt)



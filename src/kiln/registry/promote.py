"""Promotion and rollback: the recorded decision and approval, the copy, ``previous``, the alias moved last."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from kiln.errors import PolicyError, RegistryError
from kiln.policy import Policy
from kiln.refs import (
    Decision,
    PromotionRecord,
)
from kiln.runs import RUN_KEY_TAG, split_run_key

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from kiln.registry.verify import AttestationKind

from kiln.registry import mlflow_io
from kiln.registry.audit import audit_tag
from kiln.registry.gate import decide
from kiln.registry.mlflow_io import _version_by_alias, _versions_with_tag, _with_retries
from kiln.registry.register import _report_from_tags
from kiln.registry.review import _approval_of_run
from kiln.registry.tags import (
    APPROVAL_MANUAL,
    PREVIOUS_ALIAS,
    TAGS,
    _decision_from_tags,
    _decision_tags,
    _now,
    _parse_time,
    utc_now,
)
from kiln.registry.verify import verify_version

log = logging.getLogger("kiln.registry")

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
    )


def _recorded_decision(mv: ModelVersion) -> Decision:
    """The gate's decision kiln recorded on ``mv`` when it registered it (``kiln.decision*`` tags):
    the one a run promotes on. ``PolicyError`` when none is readable (fail closed)."""
    tags = mv.tags
    action = tags.get(TAGS["decision"])
    if action not in ("promote", "hold"):
        raise PolicyError(f"{mv.name} version {mv.version} records no gate decision ({TAGS['decision']} = {action!r}); "
                          "not promoting")
    try:
        return _decision_from_tags(tags, float(tags[TAGS["eval_bits_per_byte"]]))
    except (KeyError, ValueError) as exc:
        raise PolicyError(f"{mv.name} version {mv.version}: its recorded gate decision is unreadable ({exc!r}); "
                          "not promoting") from exc


def _refuse_unless_recorded(claimed: Decision, recorded: Decision, mv: ModelVersion) -> None:
    """A run promotes only what the gate said at registration: a caller's decision (an XCom anyone
    with the role "user" may write) that says otherwise is refused, not believed."""
    if claimed.action == recorded.action == "promote":
        return
    failed = "; ".join(r for r in recorded.reasons if "FAILED" in r) or "; ".join(recorded.reasons)
    raise PolicyError(
        f"the decision handed to promote says {claimed.action!r}, but the gate recorded {recorded.action!r} "
        f"on {mv.name} version {mv.version} when it was registered ({failed}); not moving anything. "
        f"A run promotes only on the decision its registration recorded; after a fresh review, "
        f"`kiln promote {mv.name} {mv.version} --approver NAME` runs the gate again against today's champion."
    )


def _gate_now(candidate: ModelVersion, holder: ModelVersion | None, policy: Policy) -> Decision:
    """The gate run now, on the candidate's recorded metrics against the current champion (a manual
    promotion's decision); ``PolicyError`` when it holds."""
    fresh = decide(_report_from_tags(candidate), None if holder is None else _report_from_tags(holder), policy.gate)
    if fresh.action != "promote":
        raise PolicyError(
            f"against {policy.target_model} version {holder.version if holder else '-'} the gate holds "
            f"{candidate.name} version {candidate.version}: {'; '.join(r for r in fresh.reasons if 'FAILED' in r)}"
        )
    return fresh


def _decision_still_valid(
    decision: Decision, candidate: ModelVersion, holder: ModelVersion | None, policy: Policy
) -> Decision:
    """The decision to promote on: the one recorded at registration, or — when the champion changed
    since it was made (another run was promoted while this one waited for its review) — the gate run
    again against the current champion. ``PolicyError`` when the gate now holds."""
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
    *, policy: Policy, candidate_version: str, decision: Decision, run_key: str, manual_approver: str | None = None,
) -> PromotionRecord:
    """Give ``policy.alias`` on ``policy.target_model`` to the candidate — at most once per run.

    Who approved is never the caller's word. Under a policy that requires approval, the approval is
    the review that run ``run_key``'s approval task recorded on this candidate version
    (``record_review``: "approved", by one of ``policy.reviewers``, about this version, in this
    run); without one the promotion is refused (``PolicyError``, nothing written). The one other
    path is ``manual_approver``: a named person's explicit ``kiln promote``, approved now and
    audited as manual. A policy that requires no approval records that instead.

    Nor is the gate's decision the caller's word: ``decision`` (the model gate's XCom, which any
    Airflow user may write) is only checked. A run promotes on the decision its registration
    recorded on the version (``kiln.decision``); a manual promotion on the gate run now against the
    current champion. Refuses (``PolicyError``, nothing written) a ``hold`` decision, a caller's
    decision that disagrees with the recorded one, a model the policy may not write, a version kiln
    did not register, another run's candidate (unless manual) and a decision about other metrics
    than the version's. Order: copy into the target model when it differs from the candidate model
    (found again by its ``kiln.run_key`` tag on retry) → approver, time, how approved, decision and
    reasons as tags, and an audit event (``kiln.audit.*``) → the old holder gets alias ``previous``
    → ``policy.alias`` moves LAST. A re-run after success finds the alias already on the version
    and writes nothing. When the champion changed since ``decision`` was made (e.g. during a 24 h
    review), the gate runs again against the current champion and a hold is refused
    (``PolicyError``) before anything moves.

    A version that was rolled back is promoted again only on an approval given after the rollback:
    an Airflow re-run of an old promote task (its run's old review) is refused (``PolicyError``),
    never a silent undo of the rollback. Nor is a candidate promoted that does not verify
    (``kiln.registry.verify.verify_version``): its whole model directory is downloaded and checked
    against its two signatures with the keys ``policy`` trusts (a sandbox-signed candidate never
    verifies as production), every file's bytes against the signed statement, and the statement
    against the version's tags and logged model; any difference is a ``ProvenanceError`` naming it,
    before anything is written. Transient MLflow failures are retried with backoff; a
    retry (or a re-run) completes a half-done promotion without a second copy.
    """
    if decision.action != "promote":
        raise PolicyError(f"the gate held this candidate; not promoting: {'; '.join(decision.reasons)}")
    if manual_approver is not None and not manual_approver.strip():
        raise PolicyError("a manual promotion needs a named approver")
    split_run_key(run_key)
    policy.check_model_write(policy.target_model)
    policy.check_model_write(policy.candidate_model)
    target = policy.target_model
    manual_at = utc_now() if manual_approver is not None else None  # once: every retry is the same approval

    def attempt() -> PromotionRecord:
        client = mlflow_io._client()
        candidate = client.get_model_version(policy.candidate_model, str(candidate_version))
        if RUN_KEY_TAG not in candidate.tags or TAGS["eval_bits_per_byte"] not in candidate.tags:
            raise PolicyError(f"{candidate.name} version {candidate.version} was not registered by kiln (no lineage)")
        tagged_bpb = float(candidate.tags[TAGS["eval_bits_per_byte"]])
        if not math.isclose(tagged_bpb, decision.candidate_bits_per_byte, rel_tol=1e-9, abs_tol=1e-12):
            raise PolicyError(
                f"decision is about bits_per_byte {decision.candidate_bits_per_byte!r}, but "
                f"{candidate.name} version {candidate.version} was evaluated at {tagged_bpb!r}"
            )
        recorded = None
        if manual_approver is not None:
            approver, approval_time, how = manual_approver.strip(), manual_at, APPROVAL_MANUAL
        else:
            recorded = _recorded_decision(candidate)
            _refuse_unless_recorded(decision, recorded, candidate)
            approver, approval_time, how = _approval_of_run(candidate, policy, run_key)
        # Fail closed, before anything moves: the candidate's files, both signatures (with the keys
        # this policy trusts) and its records must agree (ProvenanceError names what differs). Not the
        # attestations it may name: it is about to be approved afresh (and a half-written earlier attempt's
        # tags must not block its own retry).
        verified = verify_version(client, candidate, policy.name, attestations=())

        holder = _version_by_alias(client, target, policy.alias)
        if holder is not None and holder.tags.get(RUN_KEY_TAG) == candidate.tags[RUN_KEY_TAG]:
            # Already promoted (this run or an earlier one; the copy carries the candidate's run
            # key): change nothing, report what is there.
            return _record_of(holder, policy, approver)
        existing = _existing_target_version(client, policy, candidate)
        if existing is not None:
            _refuse_if_rolled_back(existing, approval_time)
        # Before the copy: a candidate the gate now holds leaves nothing in the target model.
        if recorded is None:
            chosen = _gate_now(candidate, holder, policy)
        else:
            chosen = _decision_still_valid(recorded, candidate, holder, policy)
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
            TAGS["promotion_approval"]: how,
            **_decision_tags(chosen),
            **audit_tag("promotion", at, actor=approver, model=target, version=version,
                        from_version=previous or "", to_version=version, run_key=run_key,
                        decision=chosen.action, approval=how),
        }
        # the approval, signed (it names the verified statement), and the run's datasheet made again with it
        tags |= _attest_approval(client, policy, candidate, mv, verified.statement, tags, chosen)
        for key, value in tags.items():
            if mv.tags.get(key) != value:
                client.set_model_version_tag(target, version, key, value)
        if previous is not None:
            client.set_registered_model_alias(target, PREVIOUS_ALIAS, previous)
        client.set_registered_model_alias(target, policy.alias, version)  # LAST: the commit point
        log.info("promoted %s/%s to %s@%s (version %s, previous %s), approved by %s (%s) at %s",
                 candidate.name, candidate.version, target, policy.alias, version, previous or "-", approver, how, at)
        return PromotionRecord(
            registered_model=target, version=version, alias=policy.alias, approver=approver, at=at,
            previous_version=previous,
        )

    return _with_retries(f"promoting {policy.candidate_model}/{candidate_version} to {target}@{policy.alias}", attempt)


def _attest_approval(client: MlflowClient, policy: Policy, candidate: ModelVersion, mv: ModelVersion,
                     statement: dict[str, Any], tags: dict[str, str], decision: Decision) -> dict[str, str]:
    """Sign the approval ``tags`` record as an approval attestation of the candidate's verified ``statement``
    with ``policy``'s key (``kiln.provenance.approval``), log it to the version's run under ``approval/`` and
    publish the run's datasheet again with it (the signed approval in "Who approved it"). Returns the tags
    that name it on the promoted version. Idempotent but for the signature's bytes (a retry signs again,
    the tags then name the new file's sha256)."""
    import dataclasses
    import hashlib
    import tempfile
    from pathlib import Path

    from kiln.provenance.approval import APPROVAL_DIR, approval_statement, attestation_name, sign_approval, verify_approval
    from kiln.provenance.datasheet import approval_tags
    from kiln.provenance.datasheet_sources import publish_datasheet, run_sources

    target = f"{mv.name}/{mv.version}"
    approval = approval_statement(
        statement, policy=policy.name, candidate=f"{candidate.name}/{candidate.version}", target=target,
        alias=policy.alias, previous=tags[TAGS["previous_version"]], approver=tags[TAGS["approver"]],
        approved_at=tags[TAGS["approved_at"]], approval=tags[TAGS["promotion_approval"]],
        run_key=tags[TAGS["promotion_run_key"]], decision=decision.to_json())
    envelope = sign_approval(approval, policy.name)
    name = attestation_name(target, tags[TAGS["approved_at"]])
    run_id = str(candidate.run_id or mv.run_id or "")
    if not run_id:
        raise RegistryError(f"{candidate.name} version {candidate.version} names no run to log its approval to")
    with tempfile.TemporaryDirectory(prefix="kiln-approval-") as tmp:
        local = Path(tmp) / name
        local.write_bytes(envelope)
        predicate = verify_approval(local, statement)  # what is logged verifies, or nothing is
        client.log_artifact(run_id, str(local), APPROVAL_DIR)
    named = {TAGS["promotion_attestation"]: f"runs:/{run_id}/{APPROVAL_DIR}/{name}",
             TAGS["promotion_attestation_sha256"]: hashlib.sha256(envelope).hexdigest()}
    sources = run_sources(run_id, statement, model_version=target,
                          approval_tags=approval_tags({**(mv.tags or {}), **tags, **named}))
    publish_datasheet(client, run_id, statement, dataclasses.replace(sources, approval=predicate))
    return named


def rollback(model: str, policy: Policy, actor: str, *, reason: str) -> PromotionRecord:
    """Move ``policy.alias`` back to the version holding ``previous``, with audit tags (who, when, why).

    Afterwards both aliases name the restored version, so a second rollback changes nothing (it
    does not flip back). The rolled-back version is marked (``kiln.rolled_back.*``): a later
    promotion of it needs an approval given after this moment (see ``promote``).
    ``RegistryError`` when there is nothing to roll back to.

    Signed, as a promotion is: before anything is written, the restored version is verified for
    ``policy`` as ``kiln verify`` does (its files, signatures, records and its approval attestation;
    ``ProvenanceError`` naming what differs, and nothing moves), then a rollback attestation naming its
    statement by sha256, the version rolled back from, ``actor``, ``reason`` and the time is signed with
    ``policy``'s key, logged to its run under ``approval/`` and named by ``kiln.rollback.attestation``
    and ``_sha256`` on it (``_attest_rollback``); the alias moves last.
    """
    if not actor.strip():
        raise PolicyError("rollback needs a named actor")
    if not reason.strip():
        raise PolicyError("rollback needs a reason (it goes into the audit trail)")
    policy.check_model_write(model)

    def attempt() -> PromotionRecord:
        client = mlflow_io._client()
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
            )
        from_version = str(current.version) if current is not None else ""
        at = _pending_rollback_time(previous, current) or utc_now()
        # Fail closed, before anything moves: the version restored verifies, its approval included (not
        # its own rollback attestation, which this rollback (or its retry) is about to write again).
        approval_only: tuple[AttestationKind, ...] = ("approval",)
        restored = verify_version(client, previous, policy.name, attestations=approval_only)
        tags = {TAGS["rollback_actor"]: actor, TAGS["rollback_at"]: at,
                TAGS["rollback_from_version"]: from_version, TAGS["rollback_reason"]: reason,
                **audit_tag("rollback", at, actor=actor, model=model, version=version,
                            from_version=from_version, to_version=version, reason=reason)}
        tags |= _attest_rollback(client, policy, previous, restored.statement, from_version, actor, at, reason)
        for key, value in tags.items():  # the attestation's tags last: until they are written, the old ones fail
            if previous.tags.get(key) != value:
                client.set_model_version_tag(model, version, key, value)
        if current is not None:
            for key, value in {TAGS["rolled_back_by"]: actor, TAGS["rolled_back_at"]: at,
                               TAGS["rolled_back_reason"]: reason}.items():
                client.set_model_version_tag(model, from_version, key, value)
        client.set_registered_model_alias(model, policy.alias, version)  # LAST
        log.info("rolled back %s@%s from version %s to %s by %s at %s: %s",
                 model, policy.alias, from_version or "-", version, actor, at, reason)
        return PromotionRecord(
            registered_model=model, version=version, alias=policy.alias, approver=actor, at=at,
            previous_version=from_version or None,
        )

    return _with_retries(f"rolling back {model}@{policy.alias}", attempt)


def _attest_rollback(client: MlflowClient, policy: Policy, restored: ModelVersion, statement: dict[str, Any],
                     from_version: str, actor: str, at: str, reason: str) -> dict[str, str]:
    """Sign the rollback to ``restored`` (whose verified provenance is ``statement``) with ``policy``'s key
    (``kiln.provenance.approval.rollback_statement``), log it to the version's run under ``approval/`` and
    return the tags that name it. A retry of the same rollback (same time, actor, reason, from version)
    whose attestation is already named and verifies reuses it: no second file, no tag rewritten."""
    import hashlib
    import tempfile
    from pathlib import Path

    from kiln.provenance.approval import (
        APPROVAL_DIR,
        rollback_attestation_name,
        rollback_statement,
        sign_attestation,
        verify_rollback,
    )
    from kiln.registry.verify import ATTESTATION_TAGS, attestation_checks

    target = f"{restored.name}/{restored.version}"
    uri_tag, sha_tag, _ = ATTESTATION_TAGS["rollback"]
    if restored.tags.get(uri_tag):
        rollback_only: tuple[AttestationKind, ...] = ("rollback",)
        (done,) = attestation_checks(restored, statement, policy.name, rollback_only) or (None,)
        if done is not None and done.status == "verifies" and (
                done.predicate.get("rolledBackAt"), done.predicate.get("actor"), done.predicate.get("reason"),
                done.predicate.get("fromVersion")) == (at, actor, reason, from_version):
            return {uri_tag: done.uri, sha_tag: done.sha256}
    attestation = rollback_statement(statement, policy=policy.name, target=target, from_version=from_version,
                                     alias=policy.alias, actor=actor, rolled_back_at=at, reason=reason)
    envelope = sign_attestation(attestation, policy.name)
    name = rollback_attestation_name(target, at)
    run_id = str(restored.run_id or "")
    if not run_id:
        raise RegistryError(f"{restored.name} version {restored.version} names no run to log its rollback to")
    with tempfile.TemporaryDirectory(prefix="kiln-rollback-") as tmp:
        local = Path(tmp) / name
        local.write_bytes(envelope)
        verify_rollback(local, statement)  # what is logged verifies, or nothing is
        client.log_artifact(run_id, str(local), APPROVAL_DIR)
    return {TAGS["rollback_attestation"]: f"runs:/{run_id}/{APPROVAL_DIR}/{name}",
            TAGS["rollback_attestation_sha256"]: hashlib.sha256(envelope).hexdigest()}


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

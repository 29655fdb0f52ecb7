"""The audit trail: review, promotion and rollback events as tags, and their history.

Besides the events written as ``kiln.audit.*`` tags, the history shows a ``config`` event where the
reviewed production config a candidate ran under (``kiln.policy.config`` / ``_sha256``, recorded at
registration) differs from the one of the version before it: when a change of corpus, contract or
model took effect, and what it changed. It is read from the versions' lineage tags, not written.

``provenance_checks`` verifies every version the history reads against its signed statement
(``kiln.registry.verify.check_version``): a tag someone edited after registration is reported with
both values, a version registered before kiln signed versions as unsigned. The same check covers the
signed approval and rollback attestations each version names (``VersionCheck.attestations``);
``attested_events`` puts each one's verdict on the promotion or rollback event it records.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError, RegistryError
from kiln.policy import Policy

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

    from kiln.registry.verify import AttestationCheck, AttestationKind, VersionCheck

from kiln.registry import mlflow_io
from kiln.registry.mlflow_io import _is_not_found, _quote, _with_retries
from kiln.registry.tags import TAGS, _parse_time
from kiln.util.fs import parse_own_json

log = logging.getLogger("kiln.registry")

# -------------------------------------------------------------------------------------------- audit

AUDIT_PREFIX = "kiln.audit."
"""Version tags ``kiln.audit.<YYYYmmddTHHMMSSZ>.<event>`` = JSON: one per approval/review,
promotion and rollback. The other ``kiln.*`` tags say how things stand; these say what happened,
and are never overwritten by a later event."""
AUDIT_EVENTS = ("review", "promotion", "rollback")
CONFIG_EVENT = "config"
"""A change of the reviewed production config, found between two versions' lineage tags."""
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
            event = parse_own_json(value, key)
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
                       "comment": tags.get(TAGS["review_comment"], "")})
    if tags.get(TAGS["approver"]):
        events.append({"event": "promotion", "at": tags.get(TAGS["approved_at"], ""), "actor": tags[TAGS["approver"]],
                       "model": mv.name, "version": str(mv.version), "from_version": tags.get(TAGS["previous_version"], ""),
                       "to_version": str(mv.version), "run_key": tags.get(TAGS["promotion_run_key"], "")})
    if tags.get(TAGS["rollback_actor"]):
        events.append({"event": "rollback", "at": tags.get(TAGS["rollback_at"], ""), "actor": tags[TAGS["rollback_actor"]],
                       "model": mv.name, "version": str(mv.version), "from_version": tags.get(TAGS["rollback_from_version"], ""),
                       "to_version": str(mv.version), "reason": tags.get(TAGS["rollback_reason"], "")})
    return events


def config_events(versions: list[ModelVersion]) -> list[dict[str, Any]]:
    """A ``config`` event at each version whose recorded production config differs from that of the
    version before it (by version number); versions that recorded none are passed over."""
    events: list[dict[str, Any]] = []
    before: tuple[str, dict[str, Any]] | None = None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        sha = mv.tags.get(TAGS["policy_config_sha256"])
        if not sha:
            continue
        try:
            values = parse_own_json(mv.tags.get(TAGS["policy_config"], "{}"), TAGS["policy_config"])
        except ValueError:
            values = {}
        if before is not None and before[0] != sha:
            old = before[1]
            changed = [f"{k} {old.get(k, '?')} -> {values.get(k, '?')}" for k in sorted(set(old) | set(values))
                       if old.get(k) != values.get(k)] or ["file edited, same values"]
            at = dt.datetime.fromtimestamp((mv.creation_timestamp or 0) / 1000, dt.UTC).isoformat(timespec="seconds")
            commit = mv.tags.get(TAGS["git_sha"], "")
            events.append({"event": CONFIG_EVENT, "at": at, "actor": f"git {commit[:12]}" if commit else "",
                           "model": mv.name, "version": str(mv.version), "from_sha256": before[0], "to_sha256": sha,
                           "changes": "; ".join(changed)})
        before = (sha, values)
    return events


def _audited_models(model: str, policy: Policy | None) -> list[str]:
    """``model``, and the candidate model whose reviews its history includes (``audit_history``)."""
    if policy is not None and model == policy.target_model and policy.candidate_model != model:
        return [model, policy.candidate_model]
    return [model]


def _versions_of(client: Any, name: str, audited: str) -> list[ModelVersion] | None:
    """The versions of registered model ``name``; ``None`` when it does not exist, which is an error
    (``RegistryError``) only when it is the ``audited`` model itself."""
    try:
        client.get_registered_model(name)
    except Exception as exc:
        if _is_not_found(exc):
            if name == audited:
                raise RegistryError(f"registered model {audited!r} does not exist") from exc
            return None
        raise
    return list(client.search_model_versions(f"name = {_quote(name, 'model name')}"))


def audit_history(model: str, policy: Policy | None = None) -> list[dict[str, Any]]:
    """Every review, promotion and rollback recorded on ``model``'s versions, oldest first.

    When ``model`` is ``policy``'s target model, the reviews on its candidate model are included
    (a rejected or timed-out candidate never reaches the target model). Read-only: any identity
    with READ may audit.
    """
    models = _audited_models(model, policy)

    def attempt() -> list[dict[str, Any]]:
        client = mlflow_io._client()
        events: list[dict[str, Any]] = []
        for name in models:
            found = _versions_of(client, name, model)
            if found is None:
                continue
            for mv in found:
                for event in _events_of(mv):
                    if name != model and event["event"] != "review":
                        continue
                    events.append({"model": mv.name, "version": str(mv.version), **event})
            # Config changes from every trained candidate (the last model listed): a promoted copy
            # carries its candidate's tags, and a candidate that was never promoted ran too.
            if name == models[-1]:
                events.extend(config_events(found))
        # A promoted copy carries its candidate's tags: the same event twice is one event.
        unique = {json.dumps(e, sort_keys=True): e for e in events}
        events = list(unique.values())
        far_past = dt.datetime.min.replace(tzinfo=dt.UTC)
        return sorted(events, key=lambda e: (_parse_time(e.get("at")) or far_past, e["event"], int(e["version"])))

    return _with_retries(f"reading the audit trail of {model}", attempt)


def provenance_checks(model: str, policy: Policy) -> list[VersionCheck]:
    """Every version ``audit_history(model, policy)`` reads, each verified for ``policy`` against its
    signed statement (``kiln.registry.verify.check_version``: files, signatures, and its tags and
    logged model compared with the statement), by model then version number. An unsigned version or
    one that disagrees is a result, not an error; ``RegistryError`` when a version cannot be read.
    Downloads each version's whole model directory, one at a time."""
    from kiln.registry.verify import check_version

    def listing() -> list[ModelVersion]:
        client = mlflow_io._client()
        found: list[ModelVersion] = []
        for name in _audited_models(model, policy):
            found.extend(sorted(_versions_of(client, name, model) or [], key=lambda v: int(v.version)))
        return found

    checks = []
    for mv in _with_retries(f"listing the versions of {model}", listing):
        checks.append(_with_retries(f"verifying {mv.name} version {mv.version}",
                                    functools.partial(check_version, mv, policy.name)))
    return checks


ATTESTED_EVENTS: dict[str, AttestationKind] = {"promotion": "approval", "rollback": "rollback"}
"""The audit events a signed attestation records, and its kind (``kiln.registry.verify.ATTESTATION_KINDS``)."""


def attested_events(events: list[dict[str, Any]], checks: list[VersionCheck]) -> list[dict[str, Any]]:
    """``events`` (``audit_history``), each promotion and rollback with an ``attestation`` entry: the
    verdict on the signed attestation that records it (``checks``: ``provenance_checks`` of the same
    model). ``status`` is that of the version's check of it (``verifies``, ``fails``, ``missing``) when
    the version's tags name it for this event (same time), with who, the decision (a promotion's) and the
    time as signed. An earlier event of a version promoted or rolled back to again (its tags name the
    latest only) is checked from the file promote or rollback logged for it (``event_attestation``: the
    event's fields against the signed predicate). ``unchecked`` and why otherwise: the version was not
    checked or does not verify, or no attestation was logged for that event (one from before they were
    signed). Reads the earlier events' files from the registry (``RegistryError`` when it cannot)."""
    from kiln.registry.verify import event_attestation

    by_version = {(c.model, c.version): c for c in checks}
    out = []
    for event in events:
        kind = ATTESTED_EVENTS.get(event["event"])
        if kind is None:
            out.append(event)
            continue
        check = by_version.get((event.get("model", ""), str(event.get("version", ""))))
        if check is None:
            entry = {"kind": kind, "status": "unchecked", "problem": "the version's provenance was not checked"}
        elif check.verified is None:
            entry = {"kind": kind, "status": "unchecked",
                     "problem": f"the version's provenance {check.status.replace('-', ' ')}: no statement to check it with"}
        else:
            found = check.attestation(kind)
            if found is None or found.at != event.get("at"):
                found = _with_retries(f"reading the {kind} attestation of {check.model}/{check.version} at "
                                      f"{event.get('at')}", functools.partial(event_attestation, check, kind, event))
            entry = _attestation_entry(found) if found is not None else {
                "kind": kind, "status": "unchecked",
                "problem": f"no {kind} attestation was logged for this {event['event']} in the version's run "
                           "(made before kiln signed them)"}
        out.append({**event, "attestation": entry})
    return out


def _attestation_entry(check: AttestationCheck) -> dict[str, Any]:
    """What ``kiln audit`` says of one checked attestation: status, the signed who, decision and time."""
    entry: dict[str, Any] = {"kind": check.kind, "status": check.status, "uri": check.uri, "sha256": check.sha256}
    p = check.predicate
    if check.status == "verifies" and check.kind == "approval":
        decision = p.get("decision") if isinstance(p.get("decision"), dict) else {}
        entry |= {"approver": p.get("approver"), "approval": p.get("approval"), "approved_at": p.get("approvedAt"),
                  "decision": (decision or {}).get("action")}
    elif check.status == "verifies":
        entry |= {"actor": p.get("actor"), "rolled_back_at": p.get("rolledBackAt"),
                  "from_version": p.get("fromVersion"), "reason": p.get("reason")}
    else:
        entry["problem"] = str(check)
    return entry

"""A promotion's approval, signed: an attestation that names the version's provenance statement.

The provenance statement is made and signed at registration, before anyone reviews the version, so it
can never say who approved it; the approval tags (``kiln.promotion.*``) are written later and are not
signed. When ``promote`` moves the alias, it signs an approval attestation with the promoting policy's
key (the key that signed the statement: promotion stays within one policy):

    an in-toto Statement v1 whose subject is the candidate's provenance statement (the sha256 of its
    canonical JSON, the bytes its DSSE envelope signed) and whose predicate (``APPROVAL_PREDICATE_TYPE``)
    says who approved it, when and how (a reviewer's answer in the run, a named person's ``kiln
    promote``, or a policy that needs none), the gate decision promoted on, the candidate and the
    version it became, the alias and the version that held it before.

It is a DSSE envelope like ``provenance.dsse.json``, logged to the version's MLflow run under
``approval/`` (beside the model directory, never in it: that is signed and unchanged), and named on the
promoted version by ``kiln.promotion.attestation`` (its ``runs:/`` URI) and
``kiln.promotion.attestation_sha256``. The run's datasheet is made again with it, so its "Who approved
it" section shows the signed approval instead of saying there is none.

``verify_approval`` checks one: signed by a key the statement's policy trusts, of this predicate type,
and naming exactly this statement (an approval of another version, or of an edited statement, is
refused).

A rollback is signed the same way (``rollback_statement``, predicate ``ROLLBACK_PREDICATE_TYPE``): its
subject is the provenance statement of the version the alias goes back to, its predicate who rolled back,
when, why, and from which version. ``rollback`` logs it beside the approvals of the restored version's run
and names it by ``kiln.rollback.attestation`` and ``_sha256``; ``verify_rollback`` checks one.
``kiln.registry.verify`` checks both kinds on every version that names one (``kiln verify``, ``kiln audit``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ProvenanceError
from kiln.provenance.statement import STATEMENT_TYPE, statement_bytes

APPROVAL_PREDICATE_TYPE = "urn:kiln:approval:v1"
"""The predicate of an approval attestation: who approved which version, when, how, on which decision."""
ROLLBACK_PREDICATE_TYPE = "urn:kiln:rollback:v1"
"""The predicate of a rollback attestation: who moved the alias back to which version, from which, when, why."""
APPROVAL_DIR = "approval"
"""Where in the version's run the attestations are logged (one file per approval)."""
STATEMENT_SUBJECT = "provenance statement"
"""The subject's name suffix: ``models:/<candidate>/<version> provenance statement``."""


def statement_sha256(statement: Mapping[str, Any]) -> str:
    """The sha256 of a provenance statement's canonical JSON: the payload its DSSE envelope signed."""
    return hashlib.sha256(statement_bytes(statement)).hexdigest()


def _statement_subject(version: str, statement: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An attestation's subject: the provenance ``statement`` of ``version`` (``MODEL/VERSION``), by sha256."""
    return [{"name": f"models:/{version} {STATEMENT_SUBJECT}", "digest": {"sha256": statement_sha256(statement)}}]


def approval_statement(statement: Mapping[str, Any], *, policy: str, candidate: str, target: str, alias: str,
                       previous: str, approver: str, approved_at: str, approval: str, run_key: str,
                       decision: Mapping[str, Any]) -> dict[str, Any]:
    """The in-toto statement of one approval of the version whose provenance ``statement`` is given.
    ``candidate`` and ``target`` are ``MODEL/VERSION`` (the same when the policy promotes in place);
    ``approval`` how it was approved (``kiln.registry.tags.APPROVAL_*``); ``run_key`` the promoting run."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": _statement_subject(candidate, statement),
        "predicateType": APPROVAL_PREDICATE_TYPE,
        "predicate": {"policy": policy, "approver": approver, "approvedAt": approved_at, "approval": approval,
                      "runKey": run_key, "decision": dict(decision), "candidate": candidate, "target": target,
                      "alias": alias, "previousVersion": previous},
    }


def attestation_name(target: str, approved_at: str) -> str:
    """The file an approval is logged as under ``APPROVAL_DIR``: one per promoted version and approval time
    (a version rolled back and approved again gets a second one; the version's tags name the latest)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{target}-{approved_at}") + ".dsse.json"


def sign_approval(approval: Mapping[str, Any], policy: str, *, home: str | Path | None = None) -> bytes:
    """``approval`` as a DSSE envelope signed with ``policy``'s key (canonical JSON and a newline)."""
    from kiln.provenance.keys import signing_key
    from kiln.provenance.sign import dsse_envelope
    from kiln_trainer.contract import canonical_json

    return canonical_json(dsse_envelope(statement_bytes(approval), signing_key(policy, home))) + b"\n"


def rollback_statement(statement: Mapping[str, Any], *, policy: str, target: str, from_version: str, alias: str,
                       actor: str, rolled_back_at: str, reason: str) -> dict[str, Any]:
    """The in-toto statement of one rollback of ``alias`` to ``target`` (``MODEL/VERSION``), the version whose
    provenance ``statement`` is given, from version ``from_version`` of the same model ("" when none held it)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": _statement_subject(target, statement),
        "predicateType": ROLLBACK_PREDICATE_TYPE,
        "predicate": {"policy": policy, "actor": actor, "rolledBackAt": rolled_back_at, "reason": reason,
                      "target": target, "fromVersion": from_version, "alias": alias},
    }


def rollback_attestation_name(target: str, rolled_back_at: str) -> str:
    """The file a rollback is logged as under ``APPROVAL_DIR`` (beside the version's approvals)."""
    return "rollback-" + attestation_name(target, rolled_back_at)


def sign_attestation(attestation: Mapping[str, Any], policy: str, *, home: str | Path | None = None) -> bytes:
    """An approval or rollback statement as a DSSE envelope signed with ``policy``'s key (``sign_approval``)."""
    return sign_approval(attestation, policy, home=home)


def verify_approval(path: str | Path, statement: Mapping[str, Any], *,
                    home: str | Path | None = None) -> dict[str, Any]:
    """The predicate of the approval attestation at ``path`` when it is signed by a key that the policy of
    ``statement`` (a verified provenance statement) trusts and names exactly that statement;
    ``ProvenanceError`` naming what is wrong otherwise."""
    return _verify(path, statement, APPROVAL_PREDICATE_TYPE, "approval", home)


def verify_rollback(path: str | Path, statement: Mapping[str, Any], *,
                    home: str | Path | None = None) -> dict[str, Any]:
    """``verify_approval`` for a rollback attestation: signed by a key the statement's policy trusts, of
    ``ROLLBACK_PREDICATE_TYPE``, naming exactly ``statement`` (the restored version's)."""
    return _verify(path, statement, ROLLBACK_PREDICATE_TYPE, "rollback", home)


def _verify(path: str | Path, statement: Mapping[str, Any], predicate_type: str, kind: str,
            home: str | Path | None) -> dict[str, Any]:
    from kiln.provenance.keys import trusted_keys
    from kiln.provenance.verify import _open_envelope

    name = Path(path).name
    try:
        policy = str(statement["predicate"]["buildDefinition"]["internalParameters"]["policy"])
    except (KeyError, TypeError) as exc:
        raise ProvenanceError(f"provenance statement: no policy to verify an {kind} with ({exc!r})") from exc
    try:
        attested, _kid = _open_envelope(Path(path), policy, trusted_keys(policy, home), home)
    except ProvenanceError as exc:
        raise ProvenanceError(f"{kind} attestation {name}: {exc}") from exc
    if not isinstance(attested, dict) or attested.get("_type") != STATEMENT_TYPE \
            or attested.get("predicateType") != predicate_type or not isinstance(attested.get("predicate"), dict):
        raise ProvenanceError(f"{kind} attestation {name}: not a kiln {kind} attestation "
                              f"(predicate type {attested.get('predicateType') if isinstance(attested, dict) else None!r}, "
                              f"expected {predicate_type!r})")
    named = [s.get("digest", {}).get("sha256") for s in attested.get("subject") or [] if isinstance(s, dict)]
    expected = statement_sha256(statement)
    verb = "approves" if kind == "approval" else "restores"
    if named != [expected]:
        raise ProvenanceError(f"{kind} attestation {name} {verb} statement sha256 "
                              f"{', '.join(map(str, named)) or 'none'}, not this version's {expected}")
    if attested["predicate"].get("policy") != policy:
        raise ProvenanceError(f"{kind} attestation {name} says policy "
                              f"{attested['predicate'].get('policy')!r}, the statement {policy!r}")
    return dict(attested["predicate"])

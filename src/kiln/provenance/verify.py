"""Verifying a signed model artifact directory for a policy, failing closed.

``verify_artifact(dir, policy)`` checks, in this order, and stops at the first that fails with a
``ProvenanceError`` naming what differs:

1. both signature files are there (``provenance.dsse.json``, ``model.sig``);
2. the DSSE envelope is signed by a key the policy trusts (a key of another policy, or of none, is
   named as such), and its signature verifies over the statement's bytes;
3. the statement is kiln's (in-toto Statement v1, SLSA Provenance v1) and says the same policy;
4. the statement's subjects are the directory's files with the same sha256: each changed, missing or
   added file is named;
5. ``model.sig`` is signed by a key the policy trusts and model-signing verifies it against the
   directory (its own per-file digests, the envelope file included).

It returns the verified statement.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from kiln.errors import ProvenanceError
from kiln.provenance.keys import public_pem, trusted_dir, trusted_key_file, trusted_keys, trusting_policy
from kiln.provenance.sign import PAYLOAD_TYPE, model_signing_hashing, pae
from kiln.provenance.statement import (
    MODEL_SIGNATURE_FILE,
    PREDICATE_TYPE,
    PROVENANCE_FILE,
    STATEMENT_TYPE,
    artifact_files,
    subjects,
)
from kiln.util.fs import load_json, parse_json

SIGNATURE_MAX_BYTES = 64 << 20
"""The largest signature file read (a statement of a few hundred thousand files)."""


@dataclass(frozen=True, slots=True)
class VerifiedArtifact:
    """A directory that verified for ``policy``: its statement and the keys of its two signatures."""

    directory: Path
    policy: str
    statement: dict[str, Any]
    statement_key_id: str
    model_sig_key_id: str


def _untrusted(what: str, kid: str, policy: str, home: str | Path | None) -> ProvenanceError:
    owner = trusting_policy(kid, home)
    whose = f"a key of policy {owner}" if owner else "a key no policy trusts"
    return ProvenanceError(f"{what} is signed by key {kid} ({whose}), which policy {policy} does not trust")


def _open_envelope(path: Path, policy: str, trusted: dict[str, ec.EllipticCurvePublicKey],
                   home: str | Path | None) -> tuple[dict[str, Any], str]:
    envelope = load_json(path, "a DSSE envelope", ProvenanceError, max_bytes=SIGNATURE_MAX_BYTES, follow_link=False)
    try:
        payload = base64.b64decode(envelope["payload"], validate=True)
        payload_type = envelope["payloadType"]
        signatures = list(envelope["signatures"])
        named = [(str(s["keyid"]), base64.b64decode(s["sig"], validate=True)) for s in signatures]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ProvenanceError(f"{PROVENANCE_FILE}: not a DSSE envelope ({exc!r})") from exc
    if payload_type != PAYLOAD_TYPE:
        raise ProvenanceError(f"{PROVENANCE_FILE}: payloadType is {payload_type!r}, not {PAYLOAD_TYPE!r}")
    if not named:
        raise ProvenanceError(f"{PROVENANCE_FILE}: holds no signature")
    ours = [(kid, sig) for kid, sig in named if kid in trusted]
    if not ours:
        raise _untrusted(PROVENANCE_FILE, named[0][0], policy, home)
    kid, sig = ours[0]
    try:
        trusted[kid].verify(sig, pae(payload_type, payload), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ProvenanceError(
            f"{PROVENANCE_FILE}: the signature by key {kid} (policy {policy}) does not verify: the statement "
            "or the signature was changed after signing") from None
    return parse_json(payload, f"{PROVENANCE_FILE}'s signed payload", ProvenanceError), kid


def _check_statement(statement: Any, policy: str) -> None:
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise ProvenanceError(f"{PROVENANCE_FILE}: the signed payload is not an in-toto Statement v1")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise ProvenanceError(f"{PROVENANCE_FILE}: predicateType is {statement.get('predicateType')!r}, "
                              f"not {PREDICATE_TYPE!r}")
    try:
        stated = statement["predicate"]["buildDefinition"]["internalParameters"]["policy"]
    except (KeyError, TypeError):
        raise ProvenanceError(f"{PROVENANCE_FILE}: the statement names no policy") from None
    if stated != policy:
        raise ProvenanceError(f"{PROVENANCE_FILE}: the statement is of a {stated} build, verified as {policy}")


def compare_files(signed: dict[str, str], on_disk: dict[str, str], signer: str = "the signed statement") -> list[str]:
    """What differs between the files ``signer`` lists and a directory's, in words (empty: nothing)."""
    changed = [f"{name} changed (signed sha256 {signed[name]}, now {on_disk[name]})"
               for name in sorted(signed.keys() & on_disk.keys()) if signed[name] != on_disk[name]]
    missing = [f"{name} missing" for name in sorted(signed.keys() - on_disk.keys())]
    added = [f"{name} added (not in {signer})" for name in sorted(on_disk.keys() - signed.keys())]
    return changed + missing + added


def _verify_model_sig(directory: Path, policy: str, trusted: dict[str, ec.EllipticCurvePublicKey],
                      home: str | Path | None) -> str:
    from model_signing import verifying

    path = directory / MODEL_SIGNATURE_FILE
    bundle = load_json(path, "a model-signing bundle", ProvenanceError, max_bytes=SIGNATURE_MAX_BYTES, follow_link=False)
    try:
        hint = bundle["verificationMaterial"]["publicKey"]["hint"]
    except (KeyError, TypeError) as exc:
        raise ProvenanceError(f"{MODEL_SIGNATURE_FILE}: not a model-signing bundle with a public key hint ({exc!r})") from exc
    # model-signing names its key by the sha256 of the public key's PEM; kiln's key id is of its DER
    by_hint = {hashlib.sha256(public_pem(key)).hexdigest(): kid for kid, key in trusted.items()}
    kid = by_hint.get(hint)
    if kid is None:
        from kiln.policy import POLICIES

        for other in POLICIES:
            if other != policy:
                for other_kid, key in trusted_keys(other, home).items():
                    if hashlib.sha256(public_pem(key)).hexdigest() == hint:
                        raise _untrusted(MODEL_SIGNATURE_FILE, other_kid, policy, home)
        raise ProvenanceError(f"{MODEL_SIGNATURE_FILE} is signed by a key no policy trusts (model-signing key hint "
                              f"{hint}), which policy {policy} does not trust")
    key_file = trusted_key_file(policy, kid, home)
    try:
        (verifying.Config().use_elliptic_key_verifier(public_key=key_file)
         .set_hashing_config(model_signing_hashing()).verify(directory, path))
    except InvalidSignature:
        raise ProvenanceError(f"{MODEL_SIGNATURE_FILE}: the signature by key {kid} (policy {policy}) does not "
                              "verify: the bundle was changed after signing") from None
    except ValueError as exc:
        differences = _model_sig_differences(directory, path) if str(exc).startswith("Signature mismatch") else []
        if not differences:
            raise ProvenanceError(f"{MODEL_SIGNATURE_FILE}: model-signing refused it with key {kid} (policy {policy}): "
                                  f"{_one_line(exc)}") from exc
        raise ProvenanceError(f"{MODEL_SIGNATURE_FILE} (key {kid}, policy {policy}) does not match the files of "
                              f"{directory}: {'; '.join(differences)}") from exc
    except Exception as exc:  # fail closed: whatever else a malformed bundle makes the library raise
        raise ProvenanceError(f"{MODEL_SIGNATURE_FILE}: not a valid model-signing bundle "
                              f"({type(exc).__name__}: {_one_line(exc)})") from exc
    return kid


def _one_line(exc: BaseException) -> str:
    """A library's message on one line (pydantic's span several)."""
    return " ".join(str(exc).split())


def _model_sig_differences(directory: Path, path: Path) -> list[str]:
    """What differs between the files a model.sig signs and the directory, in words. Only called once
    model-signing has verified the bundle's signature and found the digests differ."""
    try:
        bundle = load_json(path, "a model-signing bundle", ProvenanceError, max_bytes=SIGNATURE_MAX_BYTES,
                           follow_link=False)
        payload = parse_json(base64.b64decode(bundle["dsseEnvelope"]["payload"]), "model.sig's payload", ProvenanceError)
        signed = {r["name"]: r["digest"] for r in payload["predicate"]["resources"]}
    except (ProvenanceError, KeyError, TypeError, binascii.Error):
        return []
    on_disk = artifact_files(directory)
    envelope = directory / PROVENANCE_FILE
    on_disk[PROVENANCE_FILE] = hashlib.sha256(envelope.read_bytes()).hexdigest()
    return compare_files(signed, on_disk, MODEL_SIGNATURE_FILE)


def verify_artifact(artifact_dir: str | Path, policy: str, *, home: str | Path | None = None) -> VerifiedArtifact:
    """Verify ``artifact_dir`` for ``policy`` (see the module docstring); ``ProvenanceError`` names what differs."""
    directory = Path(artifact_dir)
    if not directory.is_dir():
        raise ProvenanceError(f"{directory}: not a directory")
    missing = [name for name in (PROVENANCE_FILE, MODEL_SIGNATURE_FILE) if not (directory / name).is_file()]
    if missing:
        raise ProvenanceError(f"{directory}: unsigned: {' and '.join(missing)} missing")
    trusted = trusted_keys(policy, home)
    if not trusted:
        raise ProvenanceError(f"policy {policy} trusts no key: {trusted_dir(policy, home)} holds no public key")
    statement, statement_kid = _open_envelope(directory / PROVENANCE_FILE, policy, trusted, home)
    _check_statement(statement, policy)
    differences = compare_files(subjects(statement), artifact_files(directory))
    if differences:
        raise ProvenanceError(f"{directory} does not match its signed statement: " + "; ".join(differences))
    model_sig_kid = _verify_model_sig(directory, policy, trusted, home)
    return VerifiedArtifact(directory=directory, policy=policy, statement=statement,
                            statement_key_id=statement_kid, model_sig_key_id=model_sig_kid)

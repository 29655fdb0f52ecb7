"""Signing a model artifact directory for a policy: kiln's provenance statement as a DSSE envelope
(``provenance.dsse.json``), then the whole directory with model-signing (``model.sig``).

Order matters: the envelope is written first, so ``model.sig`` (every file of the directory but
itself) covers it too; the statement's subjects are every file but the two signature files.

DSSE (https://github.com/secure-systems-lab/dsse, protocol v1): the signature is ECDSA P-256 with
SHA-256 (DER, base64) over ``PAE(payloadType, payload)``::

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

with LEN the byte length in ASCII decimal. The envelope::

    {"payload": base64(statement bytes), "payloadType": "application/vnd.in-toto+json",
     "signatures": [{"keyid": "<sha256 of the DER public key>", "sig": base64(signature)}]}
"""

from __future__ import annotations

import base64
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from kiln.errors import ProvenanceError
from kiln.provenance.keys import SigningKey, signing_key
from kiln.provenance.statement import (
    MODEL_SIGNATURE_FILE,
    PROVENANCE_FILE,
    ProvenanceInputs,
    build_statement,
    statement_bytes,
)
from kiln.util.fs import atomic_write_bytes
from kiln_trainer.contract import canonical_json

PAYLOAD_TYPE = "application/vnd.in-toto+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature is over."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def dsse_envelope(payload: bytes, key: SigningKey) -> dict[str, Any]:
    """``payload`` (an in-toto statement's bytes) signed with ``key`` as a DSSE envelope."""
    signature = key.load().sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
    return {"payload": base64.b64encode(payload).decode("ascii"), "payloadType": PAYLOAD_TYPE,
            "signatures": [{"keyid": key.key_id, "sig": base64.b64encode(signature).decode("ascii")}]}


def model_signing_hashing() -> Any:
    """model-signing's hashing for kiln's artifacts: one sha256 per file, every file but ``model.sig``
    (git's files too: an artifact is not a checkout), no symbolic links."""
    from model_signing import hashing

    return (hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
            .set_ignored_paths(paths=[MODEL_SIGNATURE_FILE], ignore_git_paths=False))


@dataclass(frozen=True, slots=True)
class SignedArtifact:
    """What ``sign_artifact`` wrote: the statement and the key that signed it."""

    directory: Path
    statement: dict[str, Any]
    key_id: str
    policy: str


def sign_artifact(artifact_dir: str | Path, inputs: ProvenanceInputs, *, home: str | Path | None = None) -> SignedArtifact:
    """Sign ``artifact_dir`` for ``inputs.policy``: write ``provenance.dsse.json`` (the statement of its
    files made from ``inputs``, signed) and ``model.sig`` (model-signing over every file, the envelope
    included), both with the policy's key (made on first use under ``home``'s ``keys/``).

    The entry point of registration: call it on the model directory once every other file of it is
    written and before it is uploaded; a file written after it fails verification."""
    directory = Path(artifact_dir)
    statement = build_statement(directory, inputs)
    key = signing_key(inputs.policy, home)
    envelope = dsse_envelope(statement_bytes(statement), key)
    atomic_write_bytes(directory / PROVENANCE_FILE, canonical_json(envelope) + b"\n")
    _model_sign(directory, key)
    return SignedArtifact(directory=directory, statement=statement, key_id=key.key_id, policy=inputs.policy)


def _model_sign(directory: Path, key: SigningKey) -> None:
    from model_signing import signing

    with tempfile.TemporaryDirectory(prefix="kiln-sign-") as tmp:
        out = Path(tmp) / MODEL_SIGNATURE_FILE
        try:
            with key.as_file() as private_key:  # a key from the deployment: a memory file, never on disk
                signing.Config().set_hashing_config(model_signing_hashing()).use_elliptic_key_signer(
                    private_key=private_key).sign(directory, out)
        except (ValueError, OSError) as exc:
            raise ProvenanceError(f"{directory}: model-signing could not sign it: {exc}") from exc
        atomic_write_bytes(directory / MODEL_SIGNATURE_FILE, out.read_bytes())

"""Signed provenance of model artifacts (docs/provenance.md).

    from kiln.provenance import from_registration, sign_artifact, verify_artifact
    inputs = from_registration(policy="production", run_key=..., train=..., ...)   # a ProvenanceInputs
    sign_artifact(model_dir, inputs)              # writes provenance.dsse.json, then model.sig
    verify_artifact(model_dir, "production")      # the verified statement, or ProvenanceError naming what differs

``statement`` builds the in-toto Statement v1 with its SLSA Provenance v1 predicate, ``keys`` holds the
per-policy ECDSA P-256 keys and trusted sets, ``sign`` and ``verify`` write and check the DSSE envelope
and model-signing's ``model.sig``.
"""

from kiln.provenance.sign import SignedArtifact, sign_artifact
from kiln.provenance.statement import ProvenanceInputs, TrainerIdentity, build_statement, from_registration
from kiln.provenance.verify import VerifiedArtifact, verify_artifact

__all__ = ["ProvenanceInputs", "SignedArtifact", "TrainerIdentity", "VerifiedArtifact", "build_statement",
           "from_registration", "sign_artifact", "verify_artifact"]

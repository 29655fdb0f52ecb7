"""Verifying a registered version before use: its model directory against its signatures, and its
signed statement against the version's own records (docs/provenance.md).

    verify_version(client, mv, "production")   # a VerifiedVersion, or ProvenanceError naming what differs
    check_version(mv, "production")            # the same checks reported, not raised: a VersionCheck
    check_model_dir(mv, local_dir, "production")   # the same on a directory already downloaded (then load it)

Order, stopping at the first failure with a ``ProvenanceError``:

1. download the version's whole MLflow model directory (every file is hashed: a signature over
   files says nothing about files not read), less ``registered_model_meta``, which MLflow writes
   after upload when it registers the version;
2. ``kiln.provenance.verify_artifact`` with the policy's trusted keys: both signature files there,
   signed by a key the policy trusts, every file's bytes the signed ones;
3. the statement and the signed files against the version's records: the run key, policy, DAG and
   run, snapshot, training manifest, tokenizer, token manifest, checkpoint manifest, weights sha256,
   recipe, world size, evaluation and gate decision tags, and the MLflow run and logged model the
   signed ``MLmodel`` names (a statement and files of another version name another). Each
   disagreement is named with both values.

Tags are a view of the statement: when they disagree, the statement (signed) is what was made, and
the version is refused until someone finds out who edited what. ``check_version`` reports the same
outcome as a value (``kiln audit`` lists every version's): ``agrees``, ``disagrees`` (each record
with both values), ``unsigned`` (neither signature file: registered before kiln signed versions, or
both files removed since) or ``does-not-verify`` (what failed).

Then the signed attestations the version names (``kiln.provenance.approval``; ``attestation_checks``):
its approval (``kiln.promotion.attestation`` / ``_sha256``) and its latest rollback to it
(``kiln.rollback.attestation`` / ``_sha256``). Each must be the file its sha256 tag says, signed by a key
the policy trusts, name this version's statement by its sha256, name this version, and agree with the
version's approval (or rollback) tags; otherwise it ``fails``, naming what is wrong. Under a policy that
requires approval, a version that was promoted (``kiln.promotion.*`` tags, or it holds the policy's
alias) but names no approval attestation, or was rolled back to (``kiln.rollback.*``) but names no
rollback attestation, is ``missing`` one. ``verify_version`` refuses both; ``check_version`` reports them
(``VersionCheck.attestations``), and ``kiln audit`` fails on ``fails`` (on ``missing`` with
``--require-signed``, as for an unsigned version).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.errors import ProvenanceError
from kiln.registry.tags import TAGS
from kiln.runs import RUN_KEY_TAG
from kiln.util.fs import load_json

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from kiln.provenance.verify import VerifiedArtifact

REGISTRY_RECORD = "registered_model_meta"
"""The one file MLflow writes into the model directory after upload (``register_model`` records the
model name and version there): it cannot be signed, holds no model bytes, and is set aside before
verifying."""
SIGNED_CHECKPOINT_MANIFEST = "artifacts/checkpoint_manifest.json"
"""The checkpoint manifest inside the model directory (a signed subject): weights, recipe, snapshot."""


@dataclass(frozen=True, slots=True)
class VerifiedVersion:
    """A registered version whose files, signatures and records agree, for ``policy``."""

    model: str
    version: str
    policy: str
    statement: dict[str, Any]
    statement_key_id: str
    model_sig_key_id: str
    attestations: tuple[AttestationCheck, ...] = ()
    """The attestations checked (each ``verifies``: ``verify_version`` refuses the others)."""


LOGGED_MODEL_RECORD = "logged model"
RUN_RECORD = "run"
"""``RecordMismatch.record`` for the logged model and the run the signed ``MLmodel`` names (any other
record is a tag key, ``kiln.*``)."""

VersionStatus = Literal["agrees", "disagrees", "unsigned", "does-not-verify"]


@dataclass(frozen=True, slots=True)
class RecordMismatch:
    """One record of a version that disagrees with its signed statement or files: the tag key (or
    ``LOGGED_MODEL_RECORD`` / ``RUN_RECORD``), what the version says (None: no such tag) and what
    was signed."""

    record: str
    version_says: str | None
    signed_says: str
    signed_by: str = "statement"
    """What signed ``signed_says``: the provenance ``statement``, or an ``approval`` or ``rollback`` attestation."""

    def __str__(self) -> str:
        if self.record in (LOGGED_MODEL_RECORD, RUN_RECORD):
            return f"the signed MLmodel is of {self.record} {self.signed_says}, the version's is {self.version_says}"
        return f"tag {self.record} is {self.version_says!r}, the signed {self.signed_by} says {self.signed_says!r}"

    def to_json(self) -> dict[str, Any]:
        return {"record": self.record, "version_says": self.version_says, "signed_says": self.signed_says,
                "text": str(self)}


AttestationKind = Literal["approval", "rollback"]
ATTESTATION_KINDS: tuple[AttestationKind, ...] = ("approval", "rollback")
AttestationStatus = Literal["verifies", "fails", "missing"]
ATTESTATION_TAGS: dict[str, tuple[str, str, str]] = {
    "approval": (TAGS["promotion_attestation"], TAGS["promotion_attestation_sha256"], TAGS["approved_at"]),
    "rollback": (TAGS["rollback_attestation"], TAGS["rollback_attestation_sha256"], TAGS["rollback_at"]),
}
"""Per kind: the tag naming the attestation (its ``runs:/`` URI), the tag with its sha256, the tag with its time."""


@dataclass(frozen=True, slots=True)
class AttestationCheck:
    """One signed attestation a version names (or lacks), checked against its verified statement:
    ``verifies``, ``fails`` (``problem`` and ``mismatches`` say why) or ``missing`` (the policy requires
    one and the version names none). ``at`` is the time the version's tags give it (the approval's or the
    rollback's); ``predicate`` the signed predicate once it verified as a signature."""

    kind: AttestationKind
    status: AttestationStatus
    uri: str = ""
    sha256: str = ""
    at: str = ""
    problem: str = ""
    mismatches: tuple[RecordMismatch, ...] = ()
    predicate: dict[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        if self.status == "missing":
            return f"no signed {self.kind}: {self.problem}"
        if self.status == "verifies":
            return f"{self.kind} attestation {self.uri} verifies"
        why = "; ".join(([self.problem] if self.problem else []) + [str(m) for m in self.mismatches])
        return f"{self.kind} attestation {self.uri or '(none named)'} fails: {why}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "status": self.status, "uri": self.uri, "sha256": self.sha256, "at": self.at,
                "problem": self.problem, "mismatches": [m.to_json() for m in self.mismatches],
                "predicate": self.predicate, "text": str(self)}


@dataclass(frozen=True, slots=True)
class VersionCheck:
    """The outcome of verifying one registered version for ``policy``, as a value (module docstring).
    ``problem`` says why it is unsigned or does not verify; ``mismatches`` are its records that
    disagree with the signed statement; ``verified`` is set when the signatures verified."""

    model: str
    version: str
    policy: str
    status: VersionStatus
    mismatches: tuple[RecordMismatch, ...] = ()
    problem: str = ""
    verified: VerifiedArtifact | None = field(default=None, compare=False, repr=False)
    cause: ProvenanceError | None = field(default=None, compare=False, repr=False)
    attestations: tuple[AttestationCheck, ...] = ()
    """The attestations the version names or lacks (``attestation_checks``; none when it did not verify)."""
    run_id: str = field(default="", compare=False)
    """The version's MLflow run (where its attestations are logged)."""

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "policy": self.policy, "status": self.status,
                "mismatches": [m.to_json() for m in self.mismatches], "problem": self.problem,
                "attestations": [a.to_json() for a in self.attestations]}

    def attestation(self, kind: AttestationKind) -> AttestationCheck | None:
        """The check of the version's ``kind`` attestation (None: it names none and needs none)."""
        return next((a for a in self.attestations if a.kind == kind), None)

    def require_attested(self) -> None:
        """``ProvenanceError`` naming each attestation that fails or is missing (none: nothing raised)."""
        bad = [a for a in self.attestations if a.status != "verifies"]
        if bad:
            raise ProvenanceError(f"{self.model} version {self.version}: " + "; ".join(str(a) for a in bad))

    def require_verified(self) -> VerifiedVersion:
        """The verified version, or ``ProvenanceError`` naming what differs (unsigned included)."""
        if self.verified is None:
            raise ProvenanceError(f"{self.model} version {self.version} does not verify for policy {self.policy}: "
                                  f"{self.problem}") from self.cause
        if self.mismatches:
            raise ProvenanceError(f"{self.model} version {self.version}: its records disagree with its signed "
                                  "statement: " + "; ".join(str(m) for m in self.mismatches))
        return VerifiedVersion(model=self.model, version=self.version, policy=self.policy,
                               statement=self.verified.statement, statement_key_id=self.verified.statement_key_id,
                               model_sig_key_id=self.verified.model_sig_key_id, attestations=self.attestations)


def download_model_dir(mv: ModelVersion, into: Path) -> Path:
    """The version's whole MLflow model directory under ``into`` (``RegistryError`` when it cannot be read)."""
    import mlflow

    from kiln.registry.mlflow_io import _translated

    with _translated(f"downloading models:/{mv.name}/{mv.version}"):
        return Path(mlflow.artifacts.download_artifacts(f"models:/{mv.name}/{mv.version}", dst_path=str(into)))


def verify_version(client: MlflowClient, mv: ModelVersion, policy: str, *, home: str | Path | None = None,
                   attestations: Collection[AttestationKind] = ATTESTATION_KINDS) -> VerifiedVersion:
    """Download ``mv``, verify it for ``policy``, compare its records with its statement and check the
    ``attestations`` it names or lacks (module docstring); ``ProvenanceError`` naming what differs, an
    unsigned version, an attestation that fails and a missing one included. ``promote`` checks none of
    the candidate's (it is about to sign a new approval), ``rollback`` only the restored version's approval."""
    check = check_version(mv, policy, home=home, attestations=attestations)
    verified = check.require_verified()
    check.require_attested()
    return verified


def check_version(mv: ModelVersion, policy: str, *, home: str | Path | None = None,
                  attestations: Collection[AttestationKind] = ATTESTATION_KINDS) -> VersionCheck:
    """``verify_version``'s checks on a fresh download of ``mv``, reported as a ``VersionCheck``
    (``RegistryError`` only when the version or an attestation cannot be downloaded)."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        return check_model_dir(mv, download_model_dir(mv, Path(tmp)), policy, home=home, attestations=attestations)


def check_model_dir(mv: ModelVersion, local: Path, policy: str, *, home: str | Path | None = None,
                    attestations: Collection[AttestationKind] = ATTESTATION_KINDS) -> VersionCheck:
    """Verify ``local``, the model directory of ``mv`` just downloaded (``download_model_dir``), for
    ``policy``, compare ``mv``'s records with its signed statement and, when it verified, check the
    ``attestations`` it names or lacks (``attestation_checks``). ``REGISTRY_RECORD`` is removed
    from ``local``; the rest is left as verified, so a caller that then reads from ``local`` reads
    the verified bytes."""
    from kiln.provenance.statement import MODEL_SIGNATURE_FILE, PROVENANCE_FILE
    from kiln.provenance.verify import verify_artifact

    name, version = mv.name, str(mv.version)

    def outcome(status: VersionStatus, exc: ProvenanceError) -> VersionCheck:
        # The download folder is gone when the caller reads this: name the version instead.
        problem = str(exc).replace(str(local), f"models:/{name}/{version}")
        return VersionCheck(model=name, version=version, policy=policy, status=status, problem=problem, cause=exc)

    record = local / REGISTRY_RECORD
    if record.is_file() and not record.is_symlink():
        record.unlink()
    if not any(os.path.lexists(local / f) for f in (PROVENANCE_FILE, MODEL_SIGNATURE_FILE)):
        return outcome("unsigned", ProvenanceError(
            f"unsigned: {PROVENANCE_FILE} and {MODEL_SIGNATURE_FILE} missing (registered before kiln signed "
            "every version, or both removed since): nothing binds its tags or bytes to a signed statement"))
    try:
        verified = verify_artifact(local, policy, home=home)
        mismatches = record_mismatches(mv, verified.statement, local)
    except ProvenanceError as exc:
        return outcome("does-not-verify", exc)
    attested = attestation_checks(mv, verified.statement, policy, attestations, home=home)
    return VersionCheck(model=name, version=version, policy=policy, status="disagrees" if mismatches else "agrees",
                        mismatches=tuple(mismatches), verified=verified, attestations=attested,
                        run_id=str(mv.run_id or ""))


def _required_because(mv: ModelVersion, kind: AttestationKind, policy: str) -> str:
    """Why ``mv`` must name a signed ``kind`` under ``policy`` ("" when it need not): the policy requires
    approval and the version was promoted (its approval) or rolled back to (its rollback)."""
    from kiln.policy import POLICIES

    owner = POLICIES.get(policy)
    if owner is None or not owner.requires_approval:
        return ""
    tags = mv.tags or {}
    if kind == "rollback":
        recorded = [t for t in (TAGS["rollback_actor"], TAGS["rollback_at"]) if t in tags]
        return f"it records a rollback to it ({', '.join(recorded)})" if recorded else ""
    recorded = [t for t in (TAGS["promotion_run_key"], TAGS["approver"], TAGS["approved_at"]) if t in tags]
    if recorded:
        return f"it records a promotion ({', '.join(recorded)})"
    if owner.alias in (getattr(mv, "aliases", None) or []):
        return f"it holds alias {owner.alias!r}"
    return ""


def _expected_records(mv: ModelVersion, kind: AttestationKind, predicate: Mapping[str, Any]) -> list[RecordMismatch]:
    """Each of ``mv``'s approval (or rollback) tags that disagrees with the signed ``predicate``."""
    import json

    tags = mv.tags or {}
    if kind == "approval":
        decision = predicate.get("decision")
        if not isinstance(decision, dict):
            decision = {}
        signed = {TAGS["approver"]: predicate.get("approver"), TAGS["approved_at"]: predicate.get("approvedAt"),
                  TAGS["promotion_approval"]: predicate.get("approval"), TAGS["promotion_run_key"]: predicate.get("runKey"),
                  TAGS["previous_version"]: predicate.get("previousVersion"),
                  TAGS["source_version"]: predicate.get("candidate"), TAGS["decision"]: decision.get("action"),
                  TAGS["decision_reasons"]: json.dumps(decision.get("reasons"))}
    else:
        signed = {TAGS["rollback_actor"]: predicate.get("actor"), TAGS["rollback_at"]: predicate.get("rolledBackAt"),
                  TAGS["rollback_from_version"]: predicate.get("fromVersion"),
                  TAGS["rollback_reason"]: predicate.get("reason")}
    return [RecordMismatch(tag, tags.get(tag), str(value), signed_by=kind)
            for tag, value in signed.items() if tags.get(tag) != str(value)]


def attestation_checks(mv: ModelVersion, statement: Mapping[str, Any], policy: str,
                       kinds: Collection[AttestationKind] = ATTESTATION_KINDS, *,
                       home: str | Path | None = None) -> tuple[AttestationCheck, ...]:
    """Check each of ``kinds`` of signed attestation that ``mv`` names (module docstring) against its
    verified ``statement`` and ``policy``'s trusted keys; a kind it names none of is left out unless the
    policy requires it (``missing``). ``RegistryError`` only when the registry cannot be read (retry)."""
    out = []
    for kind in ATTESTATION_KINDS:
        if kind not in kinds:
            continue
        uri_tag, sha_tag, at_tag = ATTESTATION_TAGS[kind]
        tags = mv.tags or {}
        uri, sha, at = tags.get(uri_tag, ""), tags.get(sha_tag, ""), tags.get(at_tag, "")
        if not uri and not sha:
            why = _required_because(mv, kind, policy)
            if why:
                out.append(AttestationCheck(kind, "missing", at=at, problem=(
                    f"{why} under policy {policy}, which requires approval, but names no {kind} attestation "
                    f"({uri_tag} is not set)")))
            continue
        out.append(_check_one(mv, kind, uri, sha, at, statement, home))
    return tuple(out)


def _check_one(mv: ModelVersion, kind: AttestationKind, uri: str, sha: str, at: str,
               statement: Mapping[str, Any], home: str | Path | None) -> AttestationCheck:
    import hashlib

    from kiln.provenance.approval import verify_approval, verify_rollback

    uri_tag, sha_tag, _ = ATTESTATION_TAGS[kind]

    def fails(problem: str, mismatches: tuple[RecordMismatch, ...] = (), predicate: dict | None = None) -> AttestationCheck:
        return AttestationCheck(kind, "fails", uri=uri, sha256=sha, at=at, problem=problem, mismatches=mismatches,
                                predicate=predicate or {})

    if not uri or not sha:
        return fails(f"{uri_tag if not uri else sha_tag} is not set (the other is): "
                     "the attestation cannot be named and checked")
    with tempfile.TemporaryDirectory(prefix="kiln-attestation-") as tmp:
        path = _download_attestation(uri, Path(tmp))
        if path is None:
            return fails(f"{uri} (tag {uri_tag}) is not in the artifact store")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != sha:
            return fails(f"the logged file {uri} has sha256 {actual}, tag {sha_tag} says {sha}")
        try:
            predicate = (verify_approval if kind == "approval" else verify_rollback)(path, statement, home=home)
        except ProvenanceError as exc:
            return fails(str(exc))
    this = f"{mv.name}/{mv.version}"
    named = {str(predicate.get("target")), str(predicate.get("candidate"))} if kind == "approval" else {
        str(predicate.get("target"))}
    if this not in named:
        return fails(f"the signed {kind} is of {' and '.join(sorted(named))}, not this version {this}",
                     predicate=predicate)
    mismatches = tuple(_expected_records(mv, kind, predicate))
    if mismatches:
        return fails("", mismatches, predicate)
    return AttestationCheck(kind, "verifies", uri=uri, sha256=sha, at=at, predicate=predicate)


EVENT_FIELDS: dict[str, dict[str, str]] = {
    "approval": {"actor": "approver", "at": "approvedAt", "approval": "approval", "run_key": "runKey",
                 "from_version": "previousVersion"},
    "rollback": {"actor": "actor", "at": "rolledBackAt", "from_version": "fromVersion", "reason": "reason"},
}
"""An audit event's fields (``kiln.registry.audit``) and the signed predicate's that must say the same."""


def event_attestation(check: VersionCheck, kind: AttestationKind, event: Mapping[str, Any], *,
                      home: str | Path | None = None) -> AttestationCheck | None:
    """The attestation an earlier promotion (``kind`` approval) or rollback ``event`` of the verified version
    ``check`` was signed as, found where promote and rollback log it (the version's run, ``approval/``, named by
    the version and the event's time) and checked as ``attestation_checks`` checks one, with the event's
    fields against the signed predicate instead of the tags; None when that file does not exist (an event
    from before attestations were signed) or the version did not verify."""
    import hashlib

    from kiln.provenance.approval import (
        APPROVAL_DIR,
        attestation_name,
        rollback_attestation_name,
        verify_approval,
        verify_rollback,
    )
    from kiln.registry.audit import AUDIT_TEXT_MAX

    if check.verified is None or not check.run_id:
        return None
    at, target = str(event.get("at", "")), f"{check.model}/{check.version}"
    name = (attestation_name if kind == "approval" else rollback_attestation_name)(target, at)
    uri = f"runs:/{check.run_id}/{APPROVAL_DIR}/{name}"
    with tempfile.TemporaryDirectory(prefix="kiln-attestation-") as tmp:
        path = _download_attestation(uri, Path(tmp))
        if path is None:
            return None
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            predicate = (verify_approval if kind == "approval" else verify_rollback)(
                path, check.verified.statement, home=home)
        except ProvenanceError as exc:
            return AttestationCheck(kind, "fails", uri=uri, sha256=sha, at=at, problem=str(exc))
    said = {field_: str(event[field_]) for field_ in EVENT_FIELDS[kind] if field_ in event}
    signed = {field_: str(predicate.get(key) or "")[:AUDIT_TEXT_MAX] for field_, key in EVENT_FIELDS[kind].items()}
    if kind == "approval" and "decision" in event:
        said["decision"] = str(event["decision"])
        decision = predicate.get("decision")
        signed["decision"] = str(decision.get("action")) if isinstance(decision, dict) else ""
    differ = [f"the event's {f} is {v!r}, the signed {kind} says {signed[f]!r}" for f, v in said.items() if v != signed[f]]
    if str(predicate.get("target")) != target:
        differ.insert(0, f"the signed {kind} is of {predicate.get('target')}, not this version {target}")
    return AttestationCheck(kind, "fails" if differ else "verifies", uri=uri, sha256=sha, at=at,
                            problem="; ".join(differ), predicate=predicate)


def _download_attestation(uri: str, into: Path) -> Path | None:
    """The attestation file ``uri`` names, downloaded into ``into``; None when the store has no such file
    (``RegistryError`` when the store cannot be read: a retry may)."""
    import mlflow

    from kiln.registry.mlflow_io import _is_not_found, _translated

    with _translated(f"downloading {uri}"):
        try:
            path = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(into)))
        except Exception as exc:
            if _is_not_found(exc) or isinstance(exc, FileNotFoundError):
                return None
            raise
    return path if path.is_file() else None


def _deps(statement: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    build = statement["predicate"]["buildDefinition"]
    return {d["name"].split(":", 1)[0]: d for d in build["resolvedDependencies"]}


def _byproduct(statement: Mapping[str, Any], name: str) -> dict[str, Any]:
    for b in statement["predicate"]["runDetails"].get("byproducts", []):
        if b.get("name") == name:
            return dict(b)
    return {}


def stated_records(statement: Mapping[str, Any], model_dir: Path, *, promoted: bool = False) -> dict[str, str]:
    """What the signed statement and the signed files say, keyed by the tag that should say the same
    (``promoted``: a version promotion wrote its own decision tags on)."""
    try:
        internal = statement["predicate"]["buildDefinition"]["internalParameters"]
        external = statement["predicate"]["buildDefinition"]["externalParameters"]
        deps = _deps(statement)
        eval_report = _byproduct(statement, "evaluation-report").get("annotations", {}).get("content") or {}
        decision = _byproduct(statement, "gate-decision").get("annotations", {}).get("content") or {}
        stated = {
            RUN_KEY_TAG: statement["predicate"]["runDetails"]["metadata"]["invocationId"],
            TAGS["policy"]: internal["policy"],
            TAGS["dag_id"]: internal["dag_id"],
            TAGS["run_id"]: internal["run_id"],
            TAGS["snapshot_id"]: deps["snapshot"]["annotations"]["dvc_id"],
            TAGS["training_manifest_sha256"]: deps["training-manifest"]["digest"]["sha256"],
            TAGS["tokenizer_sha256"]: deps["tokenizer"]["digest"].get("sha256", ""),
            TAGS["checkpoint_manifest_sha256"]: _byproduct(statement, "checkpoint-manifest")["digest"]["sha256"],
            TAGS["world_size"]: str(external["world_size"]),
            TAGS["weights_sha256"]: str(eval_report["weights_sha256"]),
        }
        if not promoted:  # promotion records the decision it promoted on (a manual one: the gate run then)
            stated[TAGS["decision"]] = str(decision["action"])
        if "token-manifest" in deps:
            stated[TAGS["token_manifest_sha256"]] = deps["token-manifest"]["digest"]["sha256"]
        if "gitCommit" in deps["code"]["digest"]:
            stated[TAGS["git_sha"]] = deps["code"]["digest"]["gitCommit"]
        stated[TAGS["eval_bits_per_byte"]] = repr(float(eval_report["bits_per_byte"]))
        stated |= _stated_sources(statement)
        from kiln.registry.register import source_eval_tags

        stated |= source_eval_tags(eval_report.get("sources"))  # a mixture's score per source, as signed
    except (KeyError, TypeError, ValueError) as exc:
        raise ProvenanceError(f"the signed statement lacks a record kiln compares with the tags ({exc!r})") from exc
    manifest_file = model_dir / SIGNED_CHECKPOINT_MANIFEST
    if manifest_file.is_file():  # signed (a subject): verify_artifact has checked its bytes
        manifest = load_json(manifest_file, "the signed checkpoint manifest", ProvenanceError, follow_link=False)
        try:
            stated[TAGS["recipe_sha256"]] = str(manifest["recipe_sha256"])
            weights = str(manifest["weights_sha256"])
            snapshot = str(manifest["snapshot_id"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProvenanceError(f"{SIGNED_CHECKPOINT_MANIFEST}: unreadable ({exc!r})") from exc
        if weights != stated[TAGS["weights_sha256"]]:
            raise ProvenanceError(f"the signed statement's weights sha256 {stated[TAGS['weights_sha256']]} is not "
                                  f"the signed {SIGNED_CHECKPOINT_MANIFEST}'s {weights}")
        if snapshot != stated[TAGS["snapshot_id"]]:
            raise ProvenanceError(f"the signed statement's snapshot {stated[TAGS['snapshot_id']]} is not "
                                  f"the signed {SIGNED_CHECKPOINT_MANIFEST}'s {snapshot}")
    return stated


def _stated_sources(statement: Mapping[str, Any]) -> dict[str, str]:
    """A mixture's per-source tags (``kiln.registry.register.source_tags``) as its statement's ``source:``
    dependencies say them (empty for a run of one corpus)."""
    from kiln.registry.register import MIXTURE_SOURCES_TAG, SOURCE_TAG_FACTS, SOURCE_TAG_PREFIX

    stated: dict[str, str] = {}
    names = []
    for dep in statement["predicate"]["buildDefinition"]["resolvedDependencies"]:
        if not str(dep.get("name", "")).startswith("source:"):
            continue
        name = dep["name"].split(":", 1)[1]
        names.append(name)
        facts = {**dep["annotations"], "snapshot_id": dep["annotations"]["dvc_id"]}
        stated |= {f"{SOURCE_TAG_PREFIX}{name}.{fact}": str(facts[fact]) for fact in SOURCE_TAG_FACTS}
    if names:
        stated[MIXTURE_SOURCES_TAG] = ",".join(names)
    return stated


def _mlmodel_ids(model_dir: Path) -> dict[str, str]:
    """The MLflow run and logged model the signed ``MLmodel`` was written for."""
    path = model_dir / "MLmodel"
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProvenanceError(f"MLmodel: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise ProvenanceError("MLmodel: not a mapping")
    return {k: str(data[k]) for k in ("run_id", "model_id") if data.get(k)}


def logged_model_id(mv: ModelVersion) -> str:
    """The logged model a version was registered from: its ``model_id``, else the one its source names
    (``models:/m-...``); "" when neither says."""
    model_id = getattr(mv, "model_id", None) or ""
    source = mv.source or ""
    if not model_id and source.startswith("models:/m-") and "/" not in source[len("models:/"):]:
        model_id = source[len("models:/"):]
    return str(model_id)


def record_mismatches(mv: ModelVersion, statement: Mapping[str, Any], model_dir: Path) -> list[RecordMismatch]:
    """Each record of ``mv`` that disagrees with its signed statement or files, with both values
    (empty: none). ``ProvenanceError`` when the statement lacks a record it should hold."""
    tags = mv.tags or {}
    out = []
    promoted = TAGS["promotion_run_key"] in tags
    for tag, stated in stated_records(statement, model_dir, promoted=promoted).items():
        have = tags.get(tag)
        if tag == TAGS["eval_bits_per_byte"] and have is not None:
            try:
                if math.isclose(float(have), float(stated), rel_tol=1e-9, abs_tol=1e-12):
                    continue
            except ValueError:
                pass
        if have != stated:
            out.append(RecordMismatch(tag, have, stated))
    ids = _mlmodel_ids(model_dir)
    model_id = logged_model_id(mv)
    if ids.get("model_id") and model_id and ids["model_id"] != model_id:
        out.append(RecordMismatch(LOGGED_MODEL_RECORD, model_id, ids["model_id"]))
    if ids.get("run_id") and mv.run_id and ids["run_id"] != mv.run_id:
        out.append(RecordMismatch(RUN_RECORD, mv.run_id, ids["run_id"]))
    return out

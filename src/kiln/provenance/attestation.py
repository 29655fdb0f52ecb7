"""A reproduction's verdict, recorded: ``kiln.reproduction.*`` tags on the version and a signed attestation.

The attestation is an in-toto Statement v1 whose subjects are the version's signed provenance envelope
(``provenance.dsse.json``, by sha256) and, when training ran, the re-derived weights; its predicate
(``REPRODUCTION_PREDICATE_TYPE``) holds the verdict, every comparison, the code drift and who reproduced.
It is a DSSE envelope signed with the reproducer's key (sandbox's: reproduction runs in sandbox capacity)
and logged to the reproduction's MLflow run in the sandbox experiment; ``verify_attestation`` checks one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import ProvenanceError
from kiln.provenance.statement import PROVENANCE_FILE, STATEMENT_TYPE, statement_bytes
from kiln.util.fs import atomic_write_text

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

    from kiln.provenance.reproduce import Reproduction

REPRODUCTION_PREDICATE_TYPE = "urn:kiln:reproduction:v1"
"""The predicate of a reproduction attestation: the verdict, each comparison, the code drift, who reproduced."""
REPRODUCER_POLICY = "sandbox"
"""Whose key signs an attestation: reproduction runs in sandbox capacity (it writes no production name)."""
ATTESTATION_FILE = "reproduction.dsse.json"
SIZE_TAGS = ("reproduction_world_size", "reproduction_weights_compared", "reproduction_tolerance",
             "reproduction_max_abs_diff")
"""``verdict_size_tags``' tags (names in ``kiln.registry.tags.TAGS``): removed from the version when a later
verdict does not set them, so that the tags always describe the latest verdict."""


def attestation_statement(outcome: Reproduction, envelope_sha256: str) -> dict[str, Any]:
    """The in-toto statement of a verdict: its subject is the version's signed provenance envelope (and the
    re-derived weights, when training ran), its predicate the verdict and every comparison."""
    from kiln import __version__
    from kiln.provenance.statement import code_sha256

    subject = [{"name": f"models:/{outcome.model}/{outcome.version}/{PROVENANCE_FILE}",
                "digest": {"sha256": envelope_sha256}}]
    weights = next((c for c in outcome.comparisons if c.step == "train" and c.input.startswith("weights")), None)
    if weights is not None:
        subject.append({"name": "weights", "digest": {"sha256": weights.derived}})
    elif outcome.weights is not None and outcome.weights.derived_weights_sha256:
        subject.append({"name": "weights", "digest": {"sha256": outcome.weights.derived_weights_sha256}})
    return {
        "_type": STATEMENT_TYPE, "subject": subject, "predicateType": REPRODUCTION_PREDICATE_TYPE,
        "predicate": {"verdict": outcome.verdict, "reason": outcome.reason, "verifiedFor": outcome.policy,
                      "comparisons": [c.to_json() for c in outcome.comparisons], "codeDrift": list(outcome.code_drift),
                      "notes": list(outcome.notes),
                      "reproducer": {"policy": REPRODUCER_POLICY, "kiln": __version__, "code_sha256": code_sha256()},
                      "startedOn": outcome.started_on, "finishedOn": outcome.finished_on,
                      # at another world size than the recorded one: the weights within a bound, not bitwise
                      "worldSize": outcome.world_size, "recordedWorldSize": outcome.recorded_world_size,
                      "weightsCompared": outcome.weights_compared, "tolerance": outcome.tolerance,
                      "weights": None if outcome.weights is None else outcome.weights.to_json()},
    }


def verdict_size_tags(outcome: Reproduction) -> dict[str, str]:
    """The world size a verdict was reached at and, at another world size than the recorded one, how the
    weights compared: ``kiln.reproduction.world_size``, ``.weights_compared`` (``bitwise`` or ``tolerance``),
    ``.tolerance`` and ``.max_abs_diff`` (each only where the verdict has it)."""
    from kiln.registry.tags import TAGS

    tags = {}
    if outcome.world_size:
        tags[TAGS["reproduction_world_size"]] = str(outcome.world_size)
    if outcome.recorded_world_size:
        tags[TAGS["reproduction_weights_compared"]] = outcome.weights_compared
    if outcome.tolerance is not None:
        tags[TAGS["reproduction_tolerance"]] = repr(outcome.tolerance)
    if outcome.weights is not None and not outcome.weights.problem:
        tags[TAGS["reproduction_max_abs_diff"]] = repr(outcome.weights.max_abs_diff)
    return tags


def record_verdict(mv: ModelVersion, outcome: Reproduction, model_dir: Path, run_key: str) -> Reproduction:
    """Sign the verdict as an attestation (the reproducer's key), log it to the reproduction's MLflow run
    (sandbox experiment, ``run_key``) and tag the version with the verdict and the attestation's URI and
    sha256. Returns ``outcome`` with the attestation named."""
    from mlflow.exceptions import MlflowException

    from kiln import tracking
    from kiln.policy import POLICIES
    from kiln.provenance.keys import signing_key
    from kiln.provenance.sign import dsse_envelope
    from kiln.registry import mlflow_io
    from kiln.registry.tags import TAGS
    from kiln_trainer.contract import canonical_json

    envelope_file = model_dir / PROVENANCE_FILE
    envelope_sha256 = hashlib.sha256(envelope_file.read_bytes()).hexdigest() if envelope_file.is_file() else ""
    tags = {TAGS["reproduction_verdict"]: outcome.verdict, TAGS["reproduction_at"]: outcome.finished_on,
            TAGS["reproduction_detail"]: outcome.summary[:4000]} | verdict_size_tags(outcome)
    if envelope_sha256:  # an attestation needs a subject: a version without a statement gets the tags only
        envelope = canonical_json(dsse_envelope(statement_bytes(attestation_statement(outcome, envelope_sha256)),
                                                signing_key(REPRODUCER_POLICY))) + b"\n"
        local = Path(outcome.workdir) / ATTESTATION_FILE
        atomic_write_text(local, envelope.decode("utf-8"))
        sha = hashlib.sha256(envelope).hexdigest()

        def log_attestation() -> str:
            client = mlflow_io._client()
            run_id, _created = tracking.find_or_create_run(
                client, POLICIES[REPRODUCER_POLICY], run_key, run_name=f"reproduce {outcome.model}/{outcome.version}",
                tags={TAGS["reproduction_verdict"]: outcome.verdict, "kiln.reproduction.of": f"{mv.name}/{mv.version}"})
            client.log_artifact(run_id, str(local), "reproduction")
            with contextlib.redirect_stdout(sys.stderr):  # MLflow prints the run's link; stdout is the command's answer
                tracking.set_run_status(client, run_id, "FINISHED")
            return f"runs:/{run_id}/reproduction/{ATTESTATION_FILE}"

        uri = mlflow_io._with_retries(f"logging the reproduction attestation of {mv.name}/{mv.version}", log_attestation)
        outcome = dataclasses.replace(outcome, attestation_uri=uri, attestation_sha256=sha)
        tags |= {TAGS["reproduction_attestation"]: uri, TAGS["reproduction_attestation_sha256"]: sha}

    # the tags hold the latest verdict: a world size or bound of an earlier one that this one has not goes
    stale = [TAGS[name] for name in SIZE_TAGS if TAGS[name] not in tags and TAGS[name] in (mv.tags or {})]

    def tag() -> None:
        client = mlflow_io._client()
        for key, value in tags.items():
            client.set_model_version_tag(mv.name, str(mv.version), key, value)
        for key in stale:
            try:
                client.delete_model_version_tag(mv.name, str(mv.version), key)
            except MlflowException as exc:  # gone already (a retry, or another reproducer): that is the aim
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise

    mlflow_io._with_retries(f"recording the reproduction verdict on {mv.name}/{mv.version}", tag)
    return outcome


def verify_attestation(path: str | Path, *, home: str | Path | None = None) -> dict[str, Any]:
    """The verified statement of a reproduction attestation file (signed by a key the reproducer's policy
    trusts); ``ProvenanceError`` naming what is wrong."""
    from kiln.provenance.keys import trusted_keys
    from kiln.provenance.verify import _open_envelope

    statement, _kid = _open_envelope(Path(path), REPRODUCER_POLICY, trusted_keys(REPRODUCER_POLICY, home), home)
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE \
            or statement.get("predicateType") != REPRODUCTION_PREDICATE_TYPE:
        raise ProvenanceError(f"{path}: not a kiln reproduction attestation")
    return statement

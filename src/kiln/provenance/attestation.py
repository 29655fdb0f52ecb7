"""A reproduction's verdict, recorded: ``kiln.reproduction.*`` tags on the version and a signed attestation.

The attestation is an in-toto Statement v1 whose subjects are the version's signed provenance envelope
(``provenance.dsse.json``, by sha256) and, when training ran, the re-derived weights; its predicate
(``REPRODUCTION_PREDICATE_TYPE``) holds the verdict, every comparison, the code drift and who reproduced.
It is a DSSE envelope signed with the reproducer's key (sandbox's: reproduction runs in sandbox capacity)
and logged to the reproduction's MLflow run in the sandbox experiment, tagged ``kiln.reproduction.of =
MODEL/VERSION``; ``verify_attestation`` checks one.

Where the verdict is recorded: always in that run (the attestation, and the verdict as run tags); on the
version's ``kiln.reproduction.*`` tags when the reproducer's MLflow identity may write them. Under MLflow's
basic auth the sandbox identity only reads production's registered models: the registry refuses the tags
(403, ``PolicyError``), the reproduction does not fail, and its outcome says, in a note starting with
``NOT_ON_VERSION``, which run holds the verdict. ``reproductions_of`` finds a version's reproductions
there, and ``verdict_lines`` says in words where the version's latest verdict is recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import PolicyError, ProvenanceError
from kiln.provenance.statement import PROVENANCE_FILE, STATEMENT_TYPE, statement_bytes
from kiln.util.fs import atomic_write_text

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from kiln.provenance.reproduce import Reproduction

REPRODUCTION_PREDICATE_TYPE = "urn:kiln:reproduction:v1"
"""The predicate of a reproduction attestation: the verdict, each comparison, the code drift, who reproduced."""
REPRODUCER_POLICY = "sandbox"
"""Whose key signs an attestation: reproduction runs in sandbox capacity (it writes no production name)."""
ATTESTATION_FILE = "reproduction.dsse.json"
REPRODUCTION_OF_TAG = "kiln.reproduction.of"
"""On a reproduction's MLflow run: ``MODEL/VERSION`` it reproduced (``reproductions_of`` searches it)."""
NOT_ON_VERSION = "the verdict is not on the version's tags"
"""How the outcome's note begins when the registry refused the version's tags (the reproducer's identity may
only read the version's model); the note names the run that holds the verdict."""
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
    (sandbox experiment, ``run_key``, tagged with the verdict and ``REPRODUCTION_OF_TAG``) and tag the version
    with the verdict and the attestation's URI and sha256, which its description (the version page) then says
    in words (``kiln.registry.report.with_reproduction``). Returns ``outcome`` with the attestation named.
    A retry with the same ``run_key`` finds the same run and logs the attestation over the earlier one.

    The run is logged first, with the verdict as run tags (and without an attestation for a version without a
    statement). When the registry then refuses the version's tags (403: the identity may only read the
    version's model, as the sandbox identity reads production's under MLflow's basic auth), the reproduction
    does not fail: the outcome gets a note (``NOT_ON_VERSION``) naming the run that holds the verdict."""
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
    run_tags = {TAGS[name]: tags[TAGS[name]] for name in _RUN_TAGS} | {REPRODUCTION_OF_TAG: f"{mv.name}/{mv.version}"}
    local, sha = Path(outcome.workdir) / ATTESTATION_FILE, ""
    if envelope_sha256:  # an attestation needs a subject: a version without a statement gets the tags only
        envelope = canonical_json(dsse_envelope(statement_bytes(attestation_statement(outcome, envelope_sha256)),
                                                signing_key(REPRODUCER_POLICY))) + b"\n"
        atomic_write_text(local, envelope.decode("utf-8"))
        sha = hashlib.sha256(envelope).hexdigest()
        run_tags[TAGS["reproduction_attestation_sha256"]] = sha

    def log_run() -> str:
        client = mlflow_io._client()
        run_id, _created = tracking.find_or_create_run(
            client, POLICIES[REPRODUCER_POLICY], run_key, run_name=f"reproduce {outcome.model}/{outcome.version}",
            tags=run_tags)
        if sha:
            client.log_artifact(run_id, str(local), "reproduction")
        with contextlib.redirect_stdout(sys.stderr):  # MLflow prints the run's link; stdout is the command's answer
            tracking.set_run_status(client, run_id, "FINISHED")
        return run_id

    run_id = mlflow_io._with_retries(f"logging the reproduction of {mv.name}/{mv.version}", log_run)
    if sha:
        uri = _attestation_uri(run_id)
        outcome = dataclasses.replace(outcome, attestation_uri=uri, attestation_sha256=sha)
        tags |= {TAGS["reproduction_attestation"]: uri, TAGS["reproduction_attestation_sha256"]: sha}

    # the tags hold the latest verdict: a world size or bound of an earlier one that this one has not goes
    stale = [TAGS[name] for name in SIZE_TAGS if TAGS[name] not in tags and TAGS[name] in (mv.tags or {})]

    def tag() -> None:
        from kiln.registry.report import with_reproduction

        client = mlflow_io._client()
        for key, value in tags.items():
            client.set_model_version_tag(mv.name, str(mv.version), key, value)
        for key in stale:
            try:
                client.delete_model_version_tag(mv.name, str(mv.version), key)
            except MlflowException as exc:  # gone already (a retry, or another reproducer): that is the aim
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
        # the version page: its description's reproduction section says the latest verdict, from the tags
        now = client.get_model_version(mv.name, str(mv.version))
        page = with_reproduction(now.description or "", dict(now.tags or {}))
        if page != (now.description or ""):
            client.update_model_version(mv.name, str(mv.version), description=page)

    try:
        mlflow_io._with_retries(f"recording the reproduction verdict on {mv.name}/{mv.version}", tag)
    except PolicyError as exc:  # the registry's 403 (mlflow_io._refusal): this identity may not write the version
        signed = ", with its signed attestation," if sha else ""
        note = (f"{NOT_ON_VERSION}: {exc}. It is recorded{signed} in MLflow run {run_id} of experiment "
                f"{reproducer_experiment()} (tag {REPRODUCTION_OF_TAG} = {mv.name}/{mv.version}), and linked from "
                "there, not from the version")
        outcome = dataclasses.replace(outcome, notes=(*outcome.notes, note))
    return outcome


_RUN_TAGS = ("reproduction_verdict", "reproduction_at", "reproduction_detail")
"""The version's verdict tags (``TAGS`` names) that the reproduction's run carries too, under the same keys."""


def _attestation_uri(run_id: str) -> str:
    return f"runs:/{run_id}/reproduction/{ATTESTATION_FILE}"


@dataclass(frozen=True, slots=True)
class RecordedReproduction:
    """A reproduction of a version as its MLflow run in the reproducer's experiment records it (run tags:
    what the reproducer said; the attestation file is the signed record, ``verify_attestation``)."""

    run_id: str
    verdict: str
    at: str
    detail: str
    attestation_uri: str
    attestation_sha256: str


def reproductions_of(client: MlflowClient, model: str, version: str) -> list[RecordedReproduction]:
    """Every reproduction of ``model`` version ``version`` logged to the reproducer's experiment (runs tagged
    ``REPRODUCTION_OF_TAG``), the latest first; none when the experiment does not exist."""
    from kiln.registry.tags import TAGS
    from kiln.runs import mlflow_filter_value

    experiment = client.get_experiment_by_name(reproducer_experiment())
    if experiment is None:
        return []
    found = client.search_runs([experiment.experiment_id],
                               filter_string=f"tags.`{REPRODUCTION_OF_TAG}` = {mlflow_filter_value(f'{model}/{version}')}",
                               order_by=["attributes.start_time DESC"], max_results=1000)
    out = []
    for run in found:
        t = run.data.tags
        out.append(RecordedReproduction(
            run_id=run.info.run_id, verdict=t.get(TAGS["reproduction_verdict"], ""),
            at=t.get(TAGS["reproduction_at"], ""), detail=t.get(TAGS["reproduction_detail"], ""),
            attestation_uri=_attestation_uri(run.info.run_id) if t.get(TAGS["reproduction_attestation_sha256"]) else "",
            attestation_sha256=t.get(TAGS["reproduction_attestation_sha256"], "")))
    return out


def verdict_lines(client: MlflowClient, mv: ModelVersion) -> list[str]:
    """Where the version's latest reproduction verdict is recorded, in words: its ``kiln.reproduction.*`` tags,
    else the latest reproduction run in the reproducer's experiment (``reproductions_of``: the tags were
    refused or removed), else that none is. What the records say, unchecked (``verify_attestation`` checks
    an attestation file)."""
    from kiln.registry.tags import TAGS

    tags = mv.tags or {}
    if tags.get(TAGS["reproduction_verdict"]):
        return [f"reproduction (version tags, not checked here): {tags[TAGS['reproduction_verdict']]} at "
                f"{tags.get(TAGS['reproduction_at'], '?')}: {tags.get(TAGS['reproduction_detail'], '')}; signed "
                f"attestation {tags.get(TAGS['reproduction_attestation']) or 'none'}"]
    found = reproductions_of(client, mv.name, str(mv.version))
    where = f"experiment {reproducer_experiment()}"
    if not found:
        return [f"reproduction: none recorded (no {TAGS['reproduction_verdict']} tag, no run of {where} tagged "
                f"{REPRODUCTION_OF_TAG} = {mv.name}/{mv.version})"]
    latest = found[0]
    more = f"; {len(found) - 1} earlier" if len(found) > 1 else ""
    return [f"reproduction (MLflow run {latest.run_id} of {where}, not on the version's tags; not checked here): "
            f"{latest.verdict} at {latest.at}: {latest.detail}; signed attestation {latest.attestation_uri or 'none'}{more}"]


def reproducer_experiment() -> str:
    """The MLflow experiment reproductions are logged to (the reproducer policy's)."""
    from kiln.policy import POLICIES
    from kiln.runs import experiment_name

    return experiment_name(POLICIES[REPRODUCER_POLICY])


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

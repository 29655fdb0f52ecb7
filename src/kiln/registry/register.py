"""Registering a candidate: checkpoint checks, lineage tags, find-or-create the version, the champion's report."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import tracking
from kiln.errors import ConfigError, ManifestError, RegistryError, RunMismatchError
from kiln.policy import Policy
from kiln.refs import (
    Decision,
    EvalReport,
    SnapshotRef,
    TrainingManifest,
    TrainResult,
    sha256_file,
)
from kiln.runs import RUN_KEY_TAG, split_run_key
from kiln_trainer.contract.training_manifest import metric_name

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

from kiln.registry import mlflow_io
from kiln.registry.gate import decide
from kiln.registry.mlflow_io import _one_version_with_tag, _version_by_alias, _with_retries
from kiln.registry.report import _description, loss_curve, loss_curve_png, loss_curve_svg, report_html, report_markdown
from kiln.registry.tags import (
    CHECKPOINT_MANIFEST_NAME,
    MODEL_ARTIFACT_NAME,
    REPORT_DIR,
    RUN_MODEL_URI_TAG,
    RUN_STATUS_TAG,
    TAGS,
    _decision_from_tags,
    _decision_tags,
    _eval_tags,
    _git_sha,
    _version_ref,
)

# ------------------------------------------------------------------------------ checkpoint checks


def _verify_checkpoint(step_dir: str) -> dict[str, Any]:
    """The trainer's own manifest check (per-file sha256, committed-last manifest)."""
    try:
        from kiln_trainer.contract.checkpoint_manifest import verify_checkpoint
    except ImportError as exc:
        raise ManifestError(f"cannot verify checkpoint {step_dir}: the trainer package is missing ({exc})") from exc
    try:
        return verify_checkpoint(step_dir)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        raise ManifestError(f"checkpoint {step_dir} refused: {exc}") from exc


def _log_checkpoint_model(step_dir: str, sign: Callable[[Path], None]) -> str:
    """Log the checkpoint as a text model (``kiln_trainer.serving``) into the active run; returns its URI.
    The model carries the checkpoint as a Hugging Face folder (``kiln.registry.export.HF_FOLDER``:
    safetensors weights, tokenizer files) that the text model generates from and ``kiln export`` writes out.
    ``sign`` is called on the finished model directory before it is uploaded."""
    from kiln_trainer.export import log_model

    return log_model(step_dir, name=MODEL_ARTIFACT_NAME, before_upload=sign)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecords:
    """What the stages before registration recorded that the refs do not carry, for the provenance
    statement. Each is "" / empty when not recorded; the statement then lists it as unrecorded rather
    than guessing (docs/provenance.md)."""

    quarantine_report: str = ""
    """Path of the run's quarantine report (its sha256 goes into the statement)."""
    contract_suite_sha256: str = ""
    """The contract suite's sha256 as the data gate recorded it in the quarantine report."""
    launcher: str = ""
    """The launcher backend; "" means the policy's."""
    nodes: tuple[str, ...] = ()
    started_on: str = ""
    finished_on: str = ""
    sources: tuple[dict[str, Any], ...] = ()
    """A mixture's sources (``kiln.provenance.statement.SOURCE_LINEAGE_KEYS`` each), in declared order:
    tagged per source (``source_tags``) and listed in the statement; empty for a run of one corpus."""


def _signer(
    *, policy: Policy, run_key: str, train: TrainResult, eval_report: EvalReport, snapshot: SnapshotRef,
    manifest: TrainingManifest, verified: dict[str, Any], decision: Decision, records: RunRecords, git_commit: str,
    after_signing: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[Path], None]:
    """The call that signs the model directory for ``policy`` (``kiln.provenance.sign_artifact``) with the
    statement of this registration, then hands the signed statement to ``after_signing`` (registration
    publishes the datasheet there: before the upload, so that a logged model always has one)."""
    from kiln.provenance import from_registration, sign_artifact

    inputs = from_registration(
        policy=policy.name, run_key=run_key, train=train, eval_report=eval_report, snapshot=snapshot,
        manifest=manifest, verified=verified, decision=decision,
        contract_suite_sha256=records.contract_suite_sha256, quarantine_report=records.quarantine_report or None,
        launcher=records.launcher or policy.launcher, nodes=records.nodes, started_on=records.started_on,
        finished_on=records.finished_on, git_commit=git_commit, sources=records.sources,
    )

    def sign(model_dir: Path) -> None:
        signed = sign_artifact(model_dir, inputs)
        if after_signing is not None:
            after_signing(signed.statement)

    return sign


def _publish_datasheet(client: MlflowClient, run_id: str, statement: dict[str, Any]) -> None:
    """The datasheet of the version being registered, from its signed statement and the files the
    statement names (the quarantine report, the snapshot copy's corpus.json), logged to the run under
    ``datasheet/``: beside the model directory, never in it (that is the signed artifact)."""
    from kiln.provenance.datasheet_sources import local_sources, publish_datasheet

    publish_datasheet(client, run_id, statement, local_sources(statement))


def _check_consistency(
    verified: dict[str, Any], train: TrainResult, eval_report: EvalReport, snapshot: SnapshotRef,
    manifest: TrainingManifest,
) -> None:
    """Every ref handed in must describe the checkpoint on disk, or the lineage would lie."""
    expected = {
        "weights_sha256 (TrainResult)": (verified.get("weights_sha256"), train.weights_sha256),
        "weights_sha256 (EvalReport)": (verified.get("weights_sha256"), eval_report.weights_sha256),
        "snapshot_id": (verified.get("snapshot_id"), snapshot.id),
        "training_manifest_sha256": (verified.get("training_manifest_sha256"), manifest.sha256),
    }
    # Newer TrainResults carry the trainer's own view of these too; when present they must agree.
    for field_name in ("recipe_sha256", "snapshot_id", "training_manifest_sha256"):
        claimed = getattr(train, field_name)
        if claimed:
            expected[f"{field_name} (TrainResult)"] = (verified.get(field_name), claimed)
    if manifest.packed:  # trained on the packed tokens the manifest names (a mixture: all of them), not others
        expected["token_manifest_sha256"] = (verified.get("token_manifest_sha256"), str(manifest.tokens_sha256()))
    manifest_file = Path(train.checkpoint) / CHECKPOINT_MANIFEST_NAME
    expected["checkpoint_manifest_sha256 (TrainResult)"] = (sha256_file(manifest_file), train.checkpoint_manifest_sha256)
    for what, (on_disk, claimed) in expected.items():
        if on_disk != claimed:
            raise ManifestError(
                f"checkpoint {train.checkpoint} does not match the refs: {what} on disk {on_disk!r}, "
                f"claimed {claimed!r}"
            )
    if manifest.snapshot_id != snapshot.id:
        raise ManifestError(f"TrainingManifest is of snapshot {manifest.snapshot_id!r}, not {snapshot.id!r}")


# ------------------------------------------------------------------------------ register candidate


def lineage_tags(
    *, policy: Policy, train: TrainResult, eval_report: EvalReport, snapshot: SnapshotRef,
    manifest: TrainingManifest, run_key: str, verified: dict[str, Any], lineage: dict[str, str],
) -> dict[str, str]:
    """All tags a candidate version is created with (strings; keys prefixed ``kiln.``)."""
    dag_id, run_id = split_run_key(run_key)
    tags = {
        RUN_KEY_TAG: run_key,
        TAGS["policy"]: policy.name,
        TAGS["snapshot_id"]: snapshot.id,
        TAGS["corpus"]: snapshot.corpus,
        TAGS["dvc"]: snapshot.dvc,
        TAGS["dvc_remote"]: snapshot.remote,
        TAGS["training_manifest_sha256"]: manifest.sha256,
        TAGS["contract"]: manifest.contract,
        TAGS["quarantined_shards"]: str(len(manifest.quarantined)),
        TAGS["recipe_sha256"]: str(verified.get("recipe_sha256", "")),
        # The checkpoint's own record of what its token ids mean and which packed shards it read
        # (empty for a checkpoint of the byte stream before tokenizers).
        TAGS["tokenizer_sha256"]: str(verified.get("tokenizer_sha256", "")),
        TAGS["tokenizer"]: str((verified.get("tokenizer") or {}).get("kind", "")),
        TAGS["token_manifest_sha256"]: str(verified.get("token_manifest_sha256", "")),
        **trainer_tags(verified),
        TAGS["git_sha"]: _git_sha(),
        TAGS["dag_id"]: dag_id,
        TAGS["run_id"]: run_id,
        TAGS["weights_sha256"]: train.weights_sha256,
        TAGS["checkpoint"]: train.checkpoint,
        TAGS["checkpoint_step"]: str(verified.get("step", train.step)),
        TAGS["checkpoint_manifest_sha256"]: train.checkpoint_manifest_sha256,
        TAGS["world_size"]: str(verified.get("world_size", "")),
        TAGS["train_completed"]: str(train.completed).lower(),
        TAGS["train_steps"]: f"{train.step}/{train.total_steps or train.step}",
        **_eval_tags(eval_report),
        **train_stop_tags(train),
    }
    if policy.config is not None:  # the reviewed inputs it ran under: `kiln audit` shows where they change
        tags[TAGS["policy_config"]] = json.dumps(policy.config.values(), sort_keys=True)
        tags[TAGS["policy_config_sha256"]] = policy.config.sha256
    for key, value in lineage.items():
        full = key if key.startswith("kiln.") else f"kiln.{key}"
        if full == RUN_KEY_TAG:
            raise ConfigError(f"lineage may not override {RUN_KEY_TAG}")
        tags[full] = str(value)
    return tags


def trainer_tags(verified: dict[str, Any]) -> dict[str, str]:
    """Which trainer made the weights, from the checkpoint's own record (its sealed ``trainer``):
    ``kiln.trainer`` (``kiln`` or the entry point), ``kiln.trainer.distribution`` and
    ``kiln.trainer.version``. A checkpoint sealed before the record existed is kiln's trainer's, of
    a version it did not record (both empty)."""
    record = verified.get("trainer") or {}
    return {TAGS["trainer"]: str(record.get("spec") or "kiln"),
            TAGS["trainer_distribution"]: str(record.get("distribution") or ""),
            TAGS["trainer_version"]: str(record.get("version") or "")}


SOURCE_TAG_PREFIX = "kiln.source."
"""A mixture's per-source tags: ``kiln.source.<name>.<fact>`` (``source_tags``)."""
SOURCE_TAG_FACTS = ("corpus", "snapshot_id", "contract", "weight", "share", "tokens")
MIXTURE_SOURCES_TAG = "kiln.mixture.sources"


def source_tags(sources: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """A mixture's lineage per source, as tags (a view of the signed statement, which lists the same):
    ``kiln.mixture.sources`` (the names in declared order) and, for each source, its corpus, snapshot
    id, contract, declared weight, realized share of the samples trained and tokens seen. Empty for a run
    of one corpus."""
    if not sources:
        return {}
    tags = {MIXTURE_SOURCES_TAG: ",".join(str(src["name"]) for src in sources)}
    for src in sources:
        tags |= {f"{SOURCE_TAG_PREFIX}{src['name']}.{fact}": str(src[fact]) for fact in SOURCE_TAG_FACTS}
    return tags


def train_stop_tags(train: TrainResult) -> dict[str, str]:
    """``kiln.train.stop``: why a completed training ended before its recipe's steps, in words (a
    mixture's source reaching its cap); no tag when it ran them all."""
    stop = train.stop
    if not stop:
        return {}
    if stop.get("reason") == "mixture_cap":
        said = (f"mixture_cap: source {stop.get('source')!r} reached {stop.get('limit')} after {stop.get('draws')} "
                f"draws; stopped at step {stop.get('step')} of {train.total_steps}")
    else:
        said = json.dumps(stop, sort_keys=True)
    return {TAGS["train_stop"]: said}


SOURCE_EVAL_FACT = "eval_bits_per_byte"
"""A mixture's held-out bits per byte of one source (``kiln.source.<name>.eval_bits_per_byte``): the
version's ``kiln.eval_bits_per_byte`` is their mean weighted by the declared weights."""


def source_eval_tags(sources: list[dict[str, Any]] | None) -> dict[str, str]:
    """Each source's held-out score as a tag (the evaluation report's ``sources``; "" for a source
    without held-out shards). Empty for a run of one corpus."""
    return {f"{SOURCE_TAG_PREFIX}{src['name']}.{SOURCE_EVAL_FACT}":
            "" if src.get("bits_per_byte") is None else repr(float(src["bits_per_byte"])) for src in sources or ()}


def _find_or_start_run(client: MlflowClient, policy: Policy, train: TrainResult, run_key: str) -> tuple[str, bool]:
    """The run to log into, and whether registration owns it (and so ends it)."""
    if train.mlflow_run_id:
        return train.mlflow_run_id, False
    # No training run to attach to: the run key's run in the policy's experiment (the one the train
    # stage uses), made by registration and found again on retry.
    run_id, _created = tracking.find_or_create_run(client, policy, run_key, run_name=f"register {run_key}")
    return run_id, True


def register_candidate(
    *,
    policy: Policy,
    train: TrainResult,
    eval_report: EvalReport,
    snapshot: SnapshotRef,
    manifest: TrainingManifest,
    run_key: str,
    lineage: dict[str, str] | None = None,
    decision: Decision | None = None,
    records: RunRecords | None = None,
) -> dict[str, Any]:
    """Create (once per ``run_key``) a version of ``policy.candidate_model`` for this checkpoint.

    Order, so that nothing is written for a checkpoint that is not what it claims to be:
    1. ``verify_checkpoint`` (every file's sha256; a tampered, partial or uncommitted checkpoint
       raises ``ManifestError`` naming the reason) and a cross-check of the refs against it;
    2. ``policy.check_model_write`` (``PolicyError`` before any request);
    3. an existing version tagged ``kiln.run_key == run_key`` is a retry: what an interrupted
       attempt left undone (description, run status) is completed and the version returned;
    4. otherwise the model is logged into the training run (``train.mlflow_run_id``; a run of
       experiment ``kiln-<policy>`` keyed by ``run_key`` when empty) with the eval metrics, the
       evaluation report (HTML + Markdown with the loss curve and the metrics against the
       champion, JSON) and the decision as artifacts, and the version is created with all lineage
       tags in the same request, then described. The model directory is signed for the policy
       before it is uploaded (``provenance.dsse.json``: the provenance statement made from the refs,
       ``verified`` and ``records``; ``model.sig``: every file), so every version carries both.

    ``decision`` defaults to ``decide(eval_report, champion_report(policy), policy.gate)``.
    Transient MLflow failures are retried (see the module docstring). Returns ``{"model_name",
    "version", "run_id", "model_uri", "source", "decision", "created", "report_uri"}`` (JSON-safe;
    ``created`` is False on a retry that found the version).
    """
    verified = _verify_checkpoint(train.checkpoint)
    _check_consistency(verified, train, eval_report, snapshot, manifest)
    manifest.verify()
    policy.check_model_write(policy.candidate_model)
    tags = lineage_tags(policy=policy, train=train, eval_report=eval_report, snapshot=snapshot,
                        manifest=manifest, run_key=run_key, verified=verified, lineage=lineage or {})
    tags |= source_tags((records or RunRecords()).sources)
    tags |= source_eval_tags(eval_report.sources)
    model = policy.candidate_model

    def attempt() -> dict[str, Any]:
        client = mlflow_io._client()
        mv = _one_version_with_tag(client, model, RUN_KEY_TAG, run_key)
        if mv is not None:
            _refuse_version_of_other_inputs(mv, tags)
            stored = _decision_from_tags(mv.tags, eval_report.bits_per_byte)
            _finish_version(client, mv, stored)
            _settle_run(client, mv.run_id, own_run=not train.mlflow_run_id)
            return {**_version_ref(mv), "decision": stored.to_json(), "created": False,
                    "report_uri": f"runs:/{mv.run_id}/{REPORT_DIR}/report.html"}

        champion_mv = _version_by_alias(client, policy.target_model, policy.alias)
        champion = None if champion_mv is None else _report_from_tags(champion_mv)
        chosen = decision if decision is not None else decide(eval_report, champion, policy.gate)
        version_tags = {**tags, **_decision_tags(chosen),
                        TAGS["decision_champion_version"]: "" if champion_mv is None else str(champion_mv.version)}
        run_id, own_run = _find_or_start_run(client, policy, train, run_key)
        sign = _signer(policy=policy, run_key=run_key, train=train, eval_report=eval_report, snapshot=snapshot,
                       manifest=manifest, verified=verified, decision=chosen, records=records or RunRecords(),
                       git_commit=tags[TAGS["git_sha"]],
                       after_signing=lambda statement: _publish_datasheet(client, run_id, statement))
        model_uri = _log_into_run(client, run_id, run_key, train, eval_report, champion, chosen, version_tags, sign)

        import mlflow

        mv = mlflow.register_model(model_uri, model, tags=version_tags)
        _finish_version(client, mv, chosen)
        _settle_run(client, run_id, own_run=own_run)
        return {**_version_ref(mv), "decision": chosen.to_json(), "created": True,
                "report_uri": f"runs:/{run_id}/{REPORT_DIR}/report.html"}

    return _with_retries(f"registering {model} for {run_key}", attempt)


_MADE_FROM = ("weights_sha256", "checkpoint", "checkpoint_step", "checkpoint_manifest_sha256", "world_size",
              "train_steps", "recipe_sha256", "snapshot_id", "training_manifest_sha256")
"""The lineage tags that say what a version was made from: a retry reuses a version only if all agree."""


def _refuse_version_of_other_inputs(mv: ModelVersion, tags: dict[str, str]) -> None:
    """The version this run registered before must be of this checkpoint, recipe and data."""
    differing = [TAGS[name] for name in _MADE_FROM if mv.tags.get(TAGS[name]) != tags[TAGS[name]]]
    if differing:
        raise RunMismatchError(
            f"{mv.name} version {mv.version} was registered for run {tags[RUN_KEY_TAG]} from other inputs than this "
            "registration: " + "; ".join(f"{t}: registered {mv.tags.get(t)!r}, now {tags[t]!r}" for t in differing)
            + " (not reusing it)"
        )


def _finish_version(client: MlflowClient, mv: ModelVersion, decision: Decision) -> None:
    """Give the version its description (rebuilt from its tags, so a retry writes the same text)."""
    experiment_id = client.get_run(mv.run_id).info.experiment_id if mv.run_id else ""
    description = _description(mv.tags, decision, mv.run_id or "", experiment_id)
    if (mv.description or "") != description:
        client.update_model_version(mv.name, str(mv.version), description=description)


def _settle_run(client: MlflowClient, run_id: str | None, *, own_run: bool) -> None:
    """Leave the run in the status it should have after registration: FINISHED for a run that
    registration created, otherwise the status it had before registration resumed it."""
    if not run_id:
        return
    run = client.get_run(run_id)
    wanted = "FINISHED" if own_run else run.data.tags.get(RUN_STATUS_TAG, run.info.status)
    if run.info.status != wanted:
        tracking.set_run_status(client, run_id, wanted)


def _log_into_run(
    client: MlflowClient, run_id: str, run_key: str, train: TrainResult, eval_report: EvalReport,
    champion: EvalReport | None, decision: Decision, tags: dict[str, str], sign: Callable[[Path], None],
) -> str:

    run = client.get_run(run_id)
    already = run.data.tags.get(RUN_MODEL_URI_TAG)
    if already and run.data.tags.get(RUN_KEY_TAG) == run_key:
        return already  # a retry after the model was logged: never log a second copy
    client.set_tag(run_id, RUN_KEY_TAG, run_key)
    if RUN_STATUS_TAG not in run.data.tags:
        # start_run/end_run below change the run's status, which the DAG owns; remember it once, so
        # that even a retry after an attempt that died inside start_run puts back the right one.
        client.set_tag(run_id, RUN_STATUS_TAG, run.info.status)
    for name, value in (("eval_bits_per_byte", eval_report.bits_per_byte), ("eval_loss", eval_report.loss),
                        ("eval_tokens", float(eval_report.tokens))):
        if math.isfinite(value):
            client.log_metric(run_id, name, value)
    for src in eval_report.sources or ():  # a mixture's score per source, next to the weighted one
        if src.get("bits_per_byte") is not None and math.isfinite(src["bits_per_byte"]):
            client.log_metric(run_id, f"eval_bits_per_byte_{metric_name(src['name'])}", float(src["bits_per_byte"]))
    client.log_dict(run_id, eval_report.to_json(), f"{REPORT_DIR}/eval_report.json")
    client.log_dict(run_id, decision.to_json(), f"{REPORT_DIR}/decision.json")
    if champion is not None:
        client.log_dict(run_id, champion.to_json(), f"{REPORT_DIR}/champion_eval_report.json")
    _log_report(client, run_id, train, eval_report, champion, decision, tags)
    # log_model writes into the *active* run: resume the run just for that call (_settle_run puts
    # the status back afterwards).
    with tracking.resumed(run_id):
        model_uri = _log_checkpoint_model(train.checkpoint, sign)
    client.set_tag(run_id, RUN_MODEL_URI_TAG, model_uri)
    return model_uri


def _log_report(
    client: MlflowClient, run_id: str, train: TrainResult, eval_report: EvalReport, champion: EvalReport | None,
    decision: Decision, tags: dict[str, str],
) -> None:
    """The reviewer's report: ``report.html`` (self-contained), ``report.md`` and the loss-curve image."""
    curve = loss_curve(client, run_id, train)
    references = {"candidate eval loss": eval_report.loss}
    if champion is not None and math.isfinite(champion.loss):
        references["champion eval loss"] = champion.loss
    references = {k: v for k, v in references.items() if math.isfinite(v)}
    png = loss_curve_png(curve, references)
    svg = None if png or not curve.points else loss_curve_svg(curve, references)
    plot_name = "loss_curve.png" if png else "loss_curve.svg" if svg else None
    with tempfile.TemporaryDirectory(prefix="kiln-report-") as tmp:
        if png:
            (Path(tmp) / "loss_curve.png").write_bytes(png)
            client.log_artifact(run_id, str(Path(tmp) / "loss_curve.png"), REPORT_DIR)
    if svg:
        client.log_text(run_id, svg, f"{REPORT_DIR}/loss_curve.svg")
    client.log_text(run_id, report_markdown(eval_report, champion, decision, tags, curve, plot_name),
                    f"{REPORT_DIR}/report.md")
    client.log_text(run_id, report_html(eval_report, champion, decision, tags, curve, png, svg),
                    f"{REPORT_DIR}/report.html")


# ----------------------------------------------------------------------------------------- champion


def _report_from_tags(mv: ModelVersion) -> EvalReport:
    tags = mv.tags
    try:
        return EvalReport(
            checkpoint=tags.get(TAGS["checkpoint"], ""),
            weights_sha256=tags.get(TAGS["weights_sha256"], ""),
            split=tags[TAGS["eval_split"]],
            bits_per_byte=float(tags[TAGS["eval_bits_per_byte"]]),
            loss=float(tags[TAGS["eval_loss"]]),
            tokens=int(tags[TAGS["eval_tokens"]]),
            snapshot_id=tags.get(TAGS["snapshot_id"], ""),
        )
    except (KeyError, ValueError) as exc:
        raise RegistryError(
            f"{mv.name} version {mv.version} has no readable kiln eval tags ({exc}); "
            "it was not registered by kiln — tag it or roll the alias back"
        ) from exc


def version_report(model: str, version: str) -> EvalReport:
    """The evaluation a kiln-registered version carries in its tags (``RegistryError`` if none)."""
    return _with_retries(f"reading {model}/{version}",
                         lambda: _report_from_tags(mlflow_io._client().get_model_version(model, str(version))))


def champion_report(policy: Policy) -> EvalReport | None:
    """The evaluation of the version holding ``policy.alias`` on ``policy.target_model``.

    ``None`` when nobody holds the alias yet (the first model). Read-only.
    """
    def attempt() -> EvalReport | None:
        mv = _version_by_alias(mlflow_io._client(), policy.target_model, policy.alias)
        return None if mv is None else _report_from_tags(mv)

    return _with_retries(f"reading {policy.target_model}@{policy.alias}", attempt)



"""The train stage: plan, submit (or resume, or hand back a finished result), follow, finish."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import runs, tracking
from kiln import settings as kiln_settings
from kiln.errors import LaunchError, ManifestError, RunMismatchError
from kiln.policy import Policy
from kiln.refs import (
    DataGateResult,
    JobEnded,
    PinnedMixture,
    PinnedSnapshot,
    StragglerWatchPlan,
    TrainingManifest,
    TrainResult,
)
from kiln.runs import existing_run_dir, run_dir
from kiln.stages.inputs import load_run_recipe, train_inputs
from kiln.stages.records import mlflow_run_of, own_training_manifest, refuse_other_inputs
from kiln.util.fs import atomic_write_text, read_own_json
from kiln_trainer.contract import MLFLOW_RUN_ID_ENV, MLFLOW_TRACKING_URI_ENV

if TYPE_CHECKING:
    from kiln.launchers import JobHandle, LaunchPlan


def prepare_train(
    policy: Policy, snapshot: PinnedSnapshot | PinnedMixture, data: DataGateResult, params: dict[str, Any], key: str,
) -> TrainResult | LaunchPlan:
    """Everything before the launch: the ``TrainResult`` when this run's training already finished
    from what it asks for (a retry hands back what was committed), else the ``LaunchPlan`` for
    ``submit_train``/``finish_train`` (or ``train_stage``). A finished result made from other inputs
    is refused (``RunMismatchError``)."""
    from kiln.launchers import LaunchPlan, LaunchSpec, read_result

    manifest_path, manifest = own_training_manifest(key, data)
    recipe, nodes, overrides = train_inputs(policy, params)
    spec_dir = run_dir(key) / runs.TRAIN_SUBDIR
    if (spec_dir / runs.RESULT_FILE).is_file():  # a retry after a finished run: hand back what was committed
        result = read_result(spec_dir)
        made = _made_training(spec_dir, result, _verify_checkpoint(result.checkpoint))
        asked = _asked_training(recipe, overrides, nodes * policy.nproc_per_node, manifest)
        if made["world_size"] in _shrunk_world_sizes(spec_dir, policy.nproc_per_node):
            asked["world_size"] = made["world_size"]  # it lost a node and went on smaller, as the policy allows
        refuse_other_inputs(f"training result {spec_dir / runs.RESULT_FILE} of run {key}", made, asked)
        return result
    mlflow_run_id = mlflow_run_of(
        policy, key,
        {"kiln.snapshot_id": manifest.snapshot_id, "kiln.policy": policy.name, "kiln.recipe": str(recipe.name),
         "kiln.training_manifest_sha256": manifest.sha256, "kiln.launcher": policy.launcher},
    )
    s = kiln_settings.load()
    spec = LaunchSpec(
        run_dir=spec_dir, manifest=manifest_path, recipe=recipe, run_key=key, nodes=nodes,
        nproc_per_node=policy.nproc_per_node, max_restarts=policy.max_restarts, overrides=tuple(overrides),
        # A run asking for fewer nodes than the policy's min_nodes simply cannot shrink.
        min_nodes=None if policy.min_nodes is None else min(policy.min_nodes, nodes),
        replacement_timeout_s=policy.replacement_timeout_s, spare_nodes=policy.spare_nodes,
        env={MLFLOW_RUN_ID_ENV: mlflow_run_id, MLFLOW_TRACKING_URI_ENV: s.mlflow_uri,
             # Packed tokens named by an s3:// URL (KILN_TOKENS_REMOTE) are on the S3 service DVC uses.
             **({"AWS_ENDPOINT_URL": s.dvc_remote_endpoint}
                if s.dvc_remote_endpoint and any(loc.startswith("s3://") for loc in _token_locations(manifest)) else {})},
    )
    return LaunchPlan(spec=spec, backend=policy.launcher, options=policy.launcher_options(shared_root=s.home),
                      mlflow_run_id=mlflow_run_id)


def _token_locations(manifest: TrainingManifest) -> list[str]:
    """Where the packed tokens a manifest names are: its one token manifest, or each source's."""
    if manifest.sources:
        return [str(src["tokens"]["manifest"]) for src in manifest.sources if src.get("tokens")]
    return [str(manifest.tokens["manifest"])] if manifest.tokens else []


def _asked_training(recipe: Path, overrides: list[str], world_size: int, manifest: TrainingManifest) -> dict[str, Any]:
    """What this run asks training to be made from, in the terms a checkpoint records."""
    resolved = load_run_recipe(recipe, overrides)
    return {
        "recipe_sha256": resolved.sha256,
        "seed": resolved.train.seed,
        "total_steps": resolved.train.steps,
        "world_size": world_size,
        "training_manifest_sha256": manifest.sha256,
        "snapshot_id": manifest.snapshot_id,
    }


def _shrunk_world_sizes(train_dir: Path, nproc_per_node: int) -> set[int]:
    """World sizes this run's job went on at after an elastic shrink (its launcher's record)."""
    from kiln.launchers.elastic import recorded_shrinks

    return {s.to_nodes * nproc_per_node for s in recorded_shrinks(train_dir)}


def _made_training(train_dir: Path, result: TrainResult, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a finished training was made from, as its sealed checkpoint manifest records it; the
    checkpoint must be one of this run's own."""
    if train_dir.resolve() not in Path(result.checkpoint).resolve().parents:
        raise RunMismatchError(f"training result {train_dir / runs.RESULT_FILE} names checkpoint {result.checkpoint}, "
                               f"which is not in this run's training directory {train_dir}")
    train_config = (checkpoint.get("recipe") or {}).get("train") or {}
    return {
        "recipe_sha256": checkpoint.get("recipe_sha256"),
        "seed": train_config.get("seed"),
        "total_steps": train_config.get("steps"),
        "world_size": checkpoint.get("world_size"),
        "training_manifest_sha256": checkpoint.get("training_manifest_sha256"),
        "snapshot_id": checkpoint.get("snapshot_id"),
    }


def _record_job(plan: LaunchPlan, handle: JobHandle) -> None:
    """Remember the submitted job where ``cancel_live_job`` finds it without the task: the backend,
    its options and the handle of the run's last submitted job, in the launch folder."""
    record = {"backend": plan.backend, "options": plan.options, "handle": handle.to_json()}
    atomic_write_text(plan.spec.launch_dir / runs.JOB_RECORD, json.dumps(record, indent=2, sort_keys=True))


def submit_train(plan: LaunchPlan) -> JobHandle:
    """Submit the planned job (or re-attach to it); the handle a trigger polls."""
    handle = plan.launcher().submit(plan.spec)
    _record_job(plan, handle)
    return handle


def cancel_live_job(key: str) -> str | None:
    """Cancel the run's submitted training job if it is still queued or running; what was done.

    For a run that failed while its job lives on without a task: the trigger's ``on_kill`` only runs
    in a triggerer that has picked the trigger up, so a deferred task killed in the seconds before
    that leaves nobody to end the job. The DAG's failure callback calls this."""
    from kiln.launchers import JobHandle, get_launcher

    home = existing_run_dir(key)
    if home is None:
        return None  # the run failed before it had a directory: nothing was submitted
    path = home / runs.TRAIN_SUBDIR / runs.LAUNCH_SUBDIR / runs.JOB_RECORD
    try:
        record = read_own_json(path)
        launcher, handle = get_launcher(record["backend"], **record["options"]), JobHandle.from_json(record["handle"])
    except FileNotFoundError:
        return None  # nothing was submitted (local launcher, or the run failed before training)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LaunchError(f"job record {path} is unreadable: {exc!r}") from exc
    if launcher.poll(handle).done:
        return None
    launcher.cancel(handle)
    return f"cancelled {record['backend']} job {handle.job_id}: run {key} ended without it"


def straggler_watch(policy: Policy, plan: LaunchPlan) -> StragglerWatchPlan:
    """How the trigger follows a planned job's stragglers: the policy's action, reading the run's
    metrics.jsonl from its current end (flags of an earlier attempt were already acted on)."""
    from kiln.launchers.slurm import excluded_nodes

    run = plan.spec.run_dir
    try:
        offset = (run / runs.METRICS_JSONL).stat().st_size
    except OSError:
        offset = 0
    excluded = list(excluded_nodes(run)) if plan.backend == "slurm" else []
    return StragglerWatchPlan(action=policy.straggler_action, offset=offset, excluded=excluded)


def exclude_straggler(
    policy: Policy, plan: LaunchPlan, handle: JobHandle, node: str,
) -> tuple[LaunchPlan, JobHandle, StragglerWatchPlan]:
    """The ``exclude_node`` action for a trigger's STRAGGLER event naming ``node``: end the Slurm job,
    submit it again without the node (it resumes from the last committed checkpoint), tag the
    policy's MLflow run (``kiln.straggler.excluded_nodes``). Returns the new plan, its job's handle
    and the straggler watch to defer on."""
    from kiln.launchers import SlurmLauncher
    from kiln.launchers.slurm import resubmit_excluding

    launcher = plan.launcher() if plan.backend == "slurm" else None
    if not isinstance(launcher, SlurmLauncher):
        raise LaunchError(f"straggler action exclude_node needs the slurm launcher, not {plan.backend!r}")
    moved, new = resubmit_excluding(launcher, handle, node)
    new_plan = plan.with_options(exclude=list(moved.exclude))
    _record_job(new_plan, new)
    tracking.tracking_client().set_tag(plan.mlflow_run_id, "kiln.straggler.excluded_nodes", ",".join(moved.exclude))
    return new_plan, new, straggler_watch(policy, new_plan)


def finish_train(policy: Policy, plan: LaunchPlan, handle: JobHandle, ended: JobEnded | None = None) -> TrainResult:
    """The TrainResult of a finished job (checkpoint verified, the policy's MLflow run closed), or the
    launcher's error for it. ``ended``: how the job ended, as a deferrable trigger's event or the
    in-task wait saw it; without it the job is polled once more."""
    from kiln.launchers import JobStatus
    from kiln.launchers.base import result_for

    client = tracking.tracking_client()
    _tag_elastic_shrinks(client, plan)
    try:
        if ended is None:
            result = plan.launcher().result(handle)
        else:
            result = result_for(JobStatus(state=ended.state, reason=ended.reason), handle, ended.log_tail)
        _verify_checkpoint(result.checkpoint)
    except BaseException:
        tracking.set_run_status(client, plan.mlflow_run_id, "FAILED")
        raise
    tracking.set_run_status(client, plan.mlflow_run_id, "FINISHED")
    if not result.mlflow_run_id:
        result = dataclasses.replace(result, mlflow_run_id=plan.mlflow_run_id)
    return result


ELASTIC_TAG = "kiln.elastic_shrink"
"""MLflow run tag: the launcher's reason for each elastic shrink of the run's training jobs."""
ELASTIC_METRIC = "elastic_shrinks"
"""MLflow run metric: how many times the run's training went on with fewer nodes (0: never)."""


def _tag_elastic_shrinks(client: Any, plan: LaunchPlan) -> None:
    """The run's elastic shrinks on its MLflow run: the launcher's words as a tag, the count as a
    metric. A record that cannot be read is tagged as such: the training result does not hang on it."""
    from kiln.errors import LaunchError
    from kiln.launchers.elastic import recorded_shrinks, shrinks_in_words

    if not plan.mlflow_run_id:
        return
    try:
        shrinks = recorded_shrinks(plan.spec.run_dir)
    except LaunchError as exc:
        client.set_tag(plan.mlflow_run_id, ELASTIC_TAG, f"unknown: {exc}"[:5000])
        return
    if shrinks:
        client.set_tag(plan.mlflow_run_id, ELASTIC_TAG, shrinks_in_words(shrinks)[:5000])
    client.log_metric(plan.mlflow_run_id, ELASTIC_METRIC, len(shrinks))


def train_stage(
    policy: Policy, snapshot: PinnedSnapshot | PinnedMixture, data: DataGateResult, params: dict[str, Any], key: str,
    *, log_line: Callable[[str], None] = print,
) -> TrainResult:
    """Train on the manifest's healthy shards with the policy's launcher, in this process: submit,
    stream the job's log through ``log_line`` until it ends, verify; resume if interrupted.

    A trainer fault (exit 2: tampered data, divergence) raises a non-retryable TrainingFaultError."""
    from kiln.launchers import wait

    plan = prepare_train(policy, snapshot, data, params, key)
    if isinstance(plan, TrainResult):
        return plan
    launcher = plan.launcher()
    handle = submit_train(plan)
    try:
        status = wait(launcher, handle, log=log_line, poll_s=1.0)
    except BaseException:
        tracking.set_run_status(tracking.tracking_client(), plan.mlflow_run_id, "FAILED")
        raise
    log_tail = ""
    if status.state != "SUCCEEDED":
        from kiln.launchers.base import tail_text

        log_tail = tail_text(launcher.logs(handle, 0)[0])
    return finish_train(policy, plan, handle, JobEnded(state=status.state, reason=status.reason, log_tail=log_tail))


def _verify_checkpoint(step_dir: str) -> dict[str, Any]:
    from kiln_trainer.contract.checkpoint_manifest import verify_checkpoint

    try:
        return verify_checkpoint(step_dir)
    except (ValueError, OSError) as exc:
        raise ManifestError(f"checkpoint {step_dir} is not a whole, committed checkpoint: {exc}") from exc

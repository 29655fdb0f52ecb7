"""The stages of a kiln run as plain functions: JSON-safe references in, JSON-safe references out.

Each DAG task calls exactly one of these (``kiln.dagfactory`` is only wiring), and each is a
transaction keyed by the run: calling it again with the same inputs changes nothing the second time
(the snapshot id is content-derived, training resumes from its committed checkpoint or returns the
finished result, registration and promotion look up what they wrote before).

No Airflow here. Heavy libraries (dvc, great_expectations, mlflow, torch) load inside the stages.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from kiln import settings as kiln_settings
from kiln.errors import ConfigError, DataGateError, LaunchError, ManifestError, SnapshotMismatchError
from kiln.fsutil import atomic_write_text
from kiln.policy import Policy
from kiln.refs import EvalReport, ShardReport, SnapshotRef, TrainingManifest, TrainResult, sha256_file

log = logging.getLogger("kiln.pipeline")

RUN_KEY_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def run_key(dag_id: str, run_id: str) -> str:
    return f"{dag_id}/{run_id}"


def run_dir(key: str) -> Path:
    """Working directory of one DAG run (reports, manifest, training run)."""
    s = kiln_settings.load()
    dag_id, _, run_id = key.partition("/")
    return s.runs_dir / RUN_KEY_SAFE.sub("_", dag_id) / RUN_KEY_SAFE.sub("_", run_id)


# ------------------------------------------------------------------------------------ run inputs
def check_run_conf(policy: Policy, conf: dict[str, Any], allowed: set[str]) -> None:
    """Refuse run configuration keys the DAG's form does not define.

    Airflow validates the values of known params but accepts unknown keys; a typo (``max_step``)
    or an attempt to override a pinned input (``recipe`` on production) must not pass silently.
    """
    unknown = sorted(set(conf or {}) - allowed)
    if unknown:
        raise ConfigError(
            f"{policy.dag_id} does not take run parameter(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed)) or 'none'}"
        )


# --------------------------------------------------------------------------------------- snapshot
def snapshot_stage(policy: Policy, corpus: str | None = None, expected_ids: list[str] | None = None) -> dict[str, Any]:
    """Snapshot the corpus with DVC and pin the run to an immutable, verified copy of those bytes.

    Production snapshots only its registered corpus; when the run was triggered by corpus asset
    events, the bytes found must be the ones those events announced, or the run fails (no retry).
    """
    from kiln.snapshot import checkout_snapshot, create_snapshot

    name = corpus or policy.corpus
    if policy.pinned_inputs and name != policy.corpus:
        raise ConfigError(f"{policy.name} runs snapshot only the registered corpus {policy.corpus!r}, not {name!r}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", name):
        raise ConfigError(f"corpus name {name!r} is not a valid corpus name ([a-z0-9][a-z0-9_.-]*)")
    s = kiln_settings.load()
    corpus_dir = s.corpus_root / name
    if not corpus_dir.is_dir():
        raise ConfigError(f"corpus {name!r} not found at {corpus_dir}; build it with `kiln corpus build --out {corpus_dir}`")
    ref = create_snapshot(corpus_dir)
    if expected_ids and ref.id not in expected_ids:
        raise SnapshotMismatchError(
            f"run was triggered for corpus snapshot(s) {', '.join(expected_ids)} but the registered corpus "
            f"is now {ref.id}: refusing to train on other bytes than announced"
        )
    pinned = checkout_snapshot(ref.id)
    root = Path(pinned.path)
    shards = sorted(str(p.relative_to(root)) for p in (root / "train").iterdir() if p.is_file())
    if not shards:
        raise ConfigError(f"snapshot {ref.id} of corpus {name!r} has no training shards under train/")
    return {**pinned.to_json(), "shards": shards}


def _snapshot_ref(snapshot: dict[str, Any]) -> SnapshotRef:
    return SnapshotRef.from_json({k: v for k, v in snapshot.items() if k != "shards"})


# ------------------------------------------------------------------------------------- validation
def shard_batches(policy: Policy, snapshot: dict[str, Any]) -> list[list[str]]:
    """The snapshot's shards cut into the batches the mapped validation tasks take, in order."""
    shards = list(snapshot["shards"])
    size = max(policy.validation_batch_shards, -(-len(shards) // policy.validation_max_tasks))
    return [shards[i : i + size] for i in range(0, len(shards), size)]


def validate_stage(policy: Policy, snapshot: dict[str, Any], shards: list[str]) -> list[dict[str, Any]]:
    """Check a batch of shards against the policy's contract in one process (one GE context).

    Never raises for bad data: a quarantined shard is a report, not an exception."""
    from kiln.contracts import load_contract
    from kiln.validation import load_eval_doc_hashes, validate_shards

    root = Path(snapshot["path"])
    reports = validate_shards([root / s for s in shards], load_contract(policy.contract), load_eval_doc_hashes(root))
    return [r.to_json() for r in reports]


def data_gate_stage(
    policy: Policy, snapshot: dict[str, Any], batches: list[list[dict[str, Any]]], key: str
) -> dict[str, Any]:
    """Cross-shard checks, the quarantine report, the gate, and the TrainingManifest (healthy shards only).

    Fails (no retry) when a shard of the snapshot has no report: a run never trains past shards
    that were not validated."""
    from kiln.contracts import load_contract
    from kiln.validation import build_training_manifest, cross_shard_duplicates, gate, publish_quarantine_report

    out = run_dir(key)
    out.mkdir(parents=True, exist_ok=True)
    reports = [ShardReport.from_json(r) for batch in batches for r in batch]
    root = Path(snapshot["path"])
    missing = sorted({str(root / s) for s in snapshot["shards"]} - {r.path for r in reports})
    if missing:
        raise DataGateError(f"{len(missing)} shard(s) of snapshot {snapshot['id']} were never validated: {missing[:5]}")
    shard_reports = cross_shard_duplicates(reports)
    # Published before the gate (on-call needs it most when the gate fails): JSON + an HTML page in
    # the run dir, and both as artifacts of the run's MLflow run (the one training will log into).
    mlflow_run_id = _mlflow_run(policy, key, {"kiln.snapshot_id": snapshot["id"], "kiln.policy": policy.name})
    published = publish_quarantine_report(
        shard_reports, out, snapshot_id=snapshot["id"], contract=load_contract(policy.contract),
        max_quarantine_share=policy.max_quarantine_share, mlflow_run_id=mlflow_run_id,
    )
    quarantined = [r for r in shard_reports if r.verdict == "quarantined"]
    rate = len(quarantined) / len(shard_reports) if shard_reports else 1.0
    gate(shard_reports, policy.max_quarantine_share)
    eval_shards = [
        {"path": str(p), "sha256": sha256_file(p), "rows": _parquet_rows(p)} for p in sorted((root / "eval").glob("*.parquet"))
    ]
    if not eval_shards:
        raise ConfigError(f"snapshot {snapshot['id']} has no held-out eval split under eval/")
    manifest = build_training_manifest(snapshot["id"], snapshot["corpus"], policy.contract, shard_reports, eval_shards)
    manifest_path = manifest.write(out / "training-manifest.json")
    return {
        "manifest": str(manifest_path),
        "manifest_sha256": manifest.sha256,
        "healthy": len(manifest.shards),
        "quarantined": [{"path": Path(r.path).name, "reasons": _short_reasons(r)} for r in quarantined],
        "quarantine_rate": round(rate, 4),
        "report": published["json"],
        "report_html": published["html"],
        "report_html_uri": published.get("html_uri", ""),
        "mlflow_run_id": mlflow_run_id,
        "contract": policy.contract,
    }


def _short_reasons(report: ShardReport) -> list[str]:
    return [r.get("error") or f"{r.get('expectation')} ({r.get('unexpected_count', '?')} rows)" for r in report.reasons]


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_metadata(path).num_rows)


# --------------------------------------------------------------------------------------- training
def _mlflow_run(policy: Policy, key: str, tags: dict[str, str]) -> str:
    """The MLflow run of this DAG run (quarantine report, training metrics, model), created once and
    found again by run key (retries, later stages)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=kiln_settings.load().mlflow_uri)
    name = f"kiln-{policy.name}"
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name)
    found = client.search_runs([exp_id], filter_string=f"tags.`kiln.run_key` = '{key}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        for k, v in tags.items():  # later stages add what they know (idempotent)
            client.set_tag(run_id, k, v)
        return run_id
    run = client.create_run(exp_id, run_name=key.replace("/", " "), tags={"kiln.run_key": key, **tags})
    return run.info.run_id


def prepare_train(
    policy: Policy, snapshot: dict[str, Any], data: dict[str, Any], params: dict[str, Any], key: str,
) -> dict[str, Any]:
    """Everything before the launch, as a JSON-safe plan: ``{"done": TrainResult}`` when this run's
    training already finished (a retry hands back what was committed), else ``{"spec", "backend",
    "options", "mlflow_run_id"}`` for ``submit_train``/``finish_train`` (or ``train_stage``)."""
    from kiln.launchers import LaunchSpec, read_result

    manifest = TrainingManifest.read(data["manifest"])
    if manifest.sha256 != data["manifest_sha256"]:
        raise ManifestError(f"training manifest {data['manifest']} changed since the data gate wrote it")
    recipe = policy.resolve_recipe(params.get("recipe"))
    nodes = int(params.get("nodes") or policy.nodes)
    spec_dir = run_dir(key) / "train"
    result_file = spec_dir / "result.json"
    if result_file.is_file():  # a retry after a finished run: hand back what was committed
        result = read_result(spec_dir)
        _verify_checkpoint(result.checkpoint)
        return {"done": result.to_json()}
    overrides = []
    if params.get("seed") is not None:
        overrides.append(f"train.seed={int(params['seed'])}")
    if params.get("max_steps") is not None:
        overrides.append(f"train.steps={int(params['max_steps'])}")
    mlflow_run_id = _mlflow_run(
        policy, key,
        {"kiln.snapshot_id": snapshot["id"], "kiln.policy": policy.name, "kiln.recipe": str(recipe.name),
         "kiln.training_manifest_sha256": manifest.sha256, "kiln.launcher": policy.launcher},
    )
    s = kiln_settings.load()
    spec = LaunchSpec(
        run_dir=spec_dir, manifest=Path(data["manifest"]), recipe=recipe, run_key=key, nodes=nodes,
        nproc_per_node=policy.nproc_per_node, max_restarts=policy.max_restarts, overrides=tuple(overrides),
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": s.mlflow_uri},
    )
    return {"spec": spec.to_json(), "backend": policy.launcher, "options": policy.launcher_options(shared_root=s.home),
            "mlflow_run_id": mlflow_run_id}


def plan_launcher(plan: dict[str, Any]):  # -> kiln.launchers.Launcher
    from kiln.launchers import get_launcher

    return get_launcher(plan["backend"], **plan["options"])


JOB_RECORD = "job.json"
"""In the launch folder: the backend, its options and the handle of the run's last submitted job."""


def _record_job(plan: dict[str, Any], handle: dict[str, Any]) -> None:
    """Remember the submitted job where ``cancel_live_job`` finds it without the task."""
    from kiln.launchers import LaunchSpec

    record = {"backend": plan["backend"], "options": plan["options"], "handle": handle}
    atomic_write_text(LaunchSpec.from_json(plan["spec"]).launch_dir / JOB_RECORD, json.dumps(record, indent=2, sort_keys=True))


def submit_train(plan: dict[str, Any]) -> dict[str, Any]:
    """Submit the planned job (or re-attach to it); the JSON handle a trigger polls."""
    from kiln.launchers import LaunchSpec

    handle = plan_launcher(plan).submit(LaunchSpec.from_json(plan["spec"])).to_json()
    _record_job(plan, handle)
    return handle


def cancel_live_job(key: str) -> str | None:
    """Cancel the run's submitted training job if it is still queued or running; what was done.

    For a run that failed while its job lives on without a task: the trigger's ``on_kill`` only runs
    in a triggerer that has picked the trigger up, so a deferred task killed in the seconds before
    that leaves nobody to end the job. The DAG's failure callback calls this."""
    from kiln.launchers import JobHandle
    from kiln.launchers.base import LAUNCH_SUBDIR

    path = run_dir(key) / "train" / LAUNCH_SUBDIR / JOB_RECORD
    try:
        record = json.loads(path.read_text())
        launcher, handle = plan_launcher(record), JobHandle.from_json(record["handle"])
    except FileNotFoundError:
        return None  # nothing was submitted (local launcher, or the run failed before training)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LaunchError(f"job record {path} is unreadable: {exc!r}") from exc
    if launcher.poll(handle).done:
        return None
    launcher.cancel(handle)
    return f"cancelled {record['backend']} job {handle.job_id}: run {key} ended without it"


def straggler_watch(policy: Policy, plan: dict[str, Any]) -> dict[str, Any]:
    """The trigger's ``stragglers`` kwarg for a planned job: the policy's action, reading the run's
    metrics.jsonl from its current end (flags of an earlier attempt were already acted on)."""
    from kiln.launchers import LaunchSpec
    from kiln.launchers.slurm import excluded_nodes

    run = LaunchSpec.from_json(plan["spec"]).run_dir
    try:
        offset = (run / "metrics.jsonl").stat().st_size
    except OSError:
        offset = 0
    excluded = list(excluded_nodes(run)) if plan["backend"] == "slurm" else []
    return {"action": policy.straggler_action, "offset": offset, "excluded": excluded}


def exclude_straggler(policy: Policy, plan: dict[str, Any], handle: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """The ``exclude_node`` action for a trigger's STRAGGLER event: end the Slurm job, submit it again
    without the node (it resumes from the last committed checkpoint), tag the policy's MLflow run
    (``kiln.straggler.excluded_nodes``). Returns ``{"plan", "handle", "stragglers"}`` to defer on."""
    import mlflow

    from kiln.launchers import JobHandle
    from kiln.launchers.slurm import resubmit_excluding

    if plan["backend"] != "slurm":
        raise LaunchError(f"straggler action exclude_node needs the slurm launcher, not {plan['backend']!r}")
    moved, new = resubmit_excluding(plan_launcher(plan), JobHandle.from_json(handle), str(event["node"]))
    new_plan = {**plan, "options": {**plan["options"], "exclude": list(moved.exclude)}}
    _record_job(new_plan, new.to_json())
    mlflow.MlflowClient(tracking_uri=kiln_settings.load().mlflow_uri).set_tag(
        plan["mlflow_run_id"], "kiln.straggler.excluded_nodes", ",".join(moved.exclude))
    return {"plan": new_plan, "handle": new.to_json(), "stragglers": straggler_watch(policy, new_plan)}


def finish_train(
    policy: Policy, plan: dict[str, Any], handle: dict[str, Any], outcome: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The TrainResult of a finished job (checkpoint verified, the policy's MLflow run closed), or the
    launcher's error for it. ``outcome`` is a deferrable trigger's event (state, reason, log tail);
    without it the job is polled once more."""
    import mlflow

    from kiln.launchers import JobHandle, JobStatus
    from kiln.launchers.base import result_for

    job = JobHandle.from_json(handle)
    runs = mlflow.MlflowClient(tracking_uri=kiln_settings.load().mlflow_uri)
    try:
        if outcome is None:
            result = plan_launcher(plan).result(job)
        else:
            status = JobStatus(state=outcome["state"], reason=str(outcome.get("reason") or ""))
            result = result_for(status, job, str(outcome.get("log_tail") or ""))
        _verify_checkpoint(result.checkpoint)
    except BaseException:
        runs.set_terminated(plan["mlflow_run_id"], "FAILED")
        raise
    runs.set_terminated(plan["mlflow_run_id"], "FINISHED")
    if not result.mlflow_run_id:
        result = TrainResult(**{**result.to_json(), "mlflow_run_id": plan["mlflow_run_id"]})
    return result.to_json()


def train_stage(
    policy: Policy, snapshot: dict[str, Any], data: dict[str, Any], params: dict[str, Any], key: str,
    *, log_line=print,
) -> dict[str, Any]:
    """Train on the manifest's healthy shards with the policy's launcher, in this process: submit,
    stream the job's log through ``log_line`` until it ends, verify; resume if interrupted.

    A trainer fault (exit 2: tampered data, divergence) raises a non-retryable TrainingFaultError."""
    from kiln.launchers import JobHandle, wait

    plan = prepare_train(policy, snapshot, data, params, key)
    if "done" in plan:
        return plan["done"]
    launcher = plan_launcher(plan)
    handle = submit_train(plan)
    try:
        status = wait(launcher, JobHandle.from_json(handle), log=log_line, poll_s=1.0)
    except BaseException:
        import mlflow

        mlflow.MlflowClient(tracking_uri=kiln_settings.load().mlflow_uri).set_terminated(plan["mlflow_run_id"], "FAILED")
        raise
    log_tail = ""
    if status.state != "SUCCEEDED":
        from kiln.launchers.base import tail_text

        log_tail = tail_text(launcher.logs(JobHandle.from_json(handle), 0)[0])
    return finish_train(policy, plan, handle, {"state": status.state, "reason": status.reason, "log_tail": log_tail})


def _verify_checkpoint(step_dir: str) -> dict[str, Any]:
    from kiln_trainer.checkpoint_manifest import verify_checkpoint

    try:
        return verify_checkpoint(step_dir)
    except (ValueError, OSError) as exc:
        raise ManifestError(f"checkpoint {step_dir} is not a whole, committed checkpoint: {exc}") from exc


# ------------------------------------------------------------------------------------- evaluation
def evaluate_stage(train: dict[str, Any], data: dict[str, Any], key: str) -> dict[str, Any]:
    """Held-out bits per byte of the last committed checkpoint (the trainer's evaluate entry point)."""
    result = TrainResult.from_json(train)
    out = run_dir(key) / "eval-report.json"
    if not out.is_file():
        proc = subprocess.run(
            [sys.executable, "-m", "kiln_trainer.evaluate", "--checkpoint", result.checkpoint,
             "--manifest", data["manifest"], "--out", str(out)],
            capture_output=True, text=True,
        )
        for line in (proc.stdout + proc.stderr).splitlines()[-20:]:
            log.info("[evaluate] %s", line)
        if proc.returncode != 0:
            raise LaunchError(f"evaluation of {result.checkpoint} failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    report = EvalReport.from_json(json.loads(out.read_text()))
    if report.weights_sha256 != result.weights_sha256:
        raise ManifestError("evaluation report is for other weights than the trained checkpoint")
    return report.to_json()


# ------------------------------------------------------------------------------- registry / gates
def register_stage(
    policy: Policy, snapshot: dict[str, Any], data: dict[str, Any], train: dict[str, Any],
    evaluation: dict[str, Any], key: str, lineage: dict[str, str],
) -> dict[str, Any]:
    from kiln.registry import register_candidate

    candidate = register_candidate(
        policy=policy,
        train=TrainResult.from_json(train),
        eval_report=EvalReport.from_json(evaluation),
        snapshot=_snapshot_ref(snapshot),
        manifest=TrainingManifest.read(data["manifest"]),
        run_key=key,
        lineage={
            "quarantine_report": data["report"],
            "quarantine_rate": str(data["quarantine_rate"]),
            **lineage,
        },
    )
    ui = kiln_settings.load().mlflow_uri
    return {**candidate, "ui_url": f"{ui}/#/models/{candidate['model_name']}/versions/{candidate['version']}"}


def model_gate_stage(candidate: dict[str, Any]) -> dict[str, Any]:
    """The promotion decision (a value, not an error): the one ``decide`` made against the champion
    when the candidate was registered, and that is tagged on its model version."""
    from kiln.refs import Decision

    return Decision.from_json(candidate["decision"]).to_json()


def promote_stage(
    policy: Policy, candidate: dict[str, Any], decision: dict[str, Any], approver: str, key: str,
    approved_at: str | None = None,
) -> dict[str, Any]:
    """Promote with the approval this run got (``approved_at``: when the reviewer answered; None
    without human approval). A re-run after a rollback of this version is refused by the registry."""
    from kiln.refs import Decision
    from kiln.registry import promote

    record = promote(
        policy=policy, candidate_version=str(candidate["version"]), decision=Decision.from_json(decision),
        approver=approver, run_key=key, approved_at=approved_at or None,
    )
    return record.to_json()


def outcome_stage(
    policy: Policy, candidate: dict[str, Any], approval: dict[str, Any] | None, promotion: dict[str, Any] | None,
    key: str,
) -> dict[str, Any]:
    """Say how the run ended for the model: promoted (where, by whom) or not (and why).

    Records a human review's outcome on the candidate version (approved or rejected, by whom, when).
    """
    from kiln.registry import record_review

    decision = candidate["decision"]
    outcome: dict[str, Any] = {
        "candidate_model": candidate["model_name"], "candidate_version": str(candidate["version"]),
        "decision": decision["action"], "decision_reasons": decision["reasons"],
    }
    if approval:
        user = approval.get("responded_by_user") or {}
        chosen = (approval.get("chosen_options") or ["?"])[0]
        if approval.get("timed_out"):
            review, reviewer = "timed out", f"nobody (assigned: {', '.join(policy.reviewers)})"
        else:
            review = "approved" if chosen == "Approve" else "rejected"
            reviewer = user.get("name") or user.get("id") or "unknown"
        at = str(approval.get("responded_at") or "")
        comment = str(approval.get("comment") or "")
        record_review(policy=policy, candidate_version=str(candidate["version"]), outcome=review, reviewer=reviewer,
                      at=at, comment=comment)  # fmt: skip
        outcome.update(review=review, reviewer=reviewer, reviewed_at=at, review_comment=comment)
    if promotion:
        outcome.update(promoted=True, model=promotion["registered_model"], version=promotion["version"],
                       alias=promotion["alias"], approver=promotion["approver"])
        outcome["message"] = (f"promoted {candidate['model_name']} v{candidate['version']} to "
                              f"{promotion['registered_model']}@{promotion['alias']} (version {promotion['version']})")
    else:
        if decision["action"] != "promote":
            why = f"the model gate said hold: {'; '.join(decision['reasons'])}"
        elif outcome.get("review") == "timed out":
            why = (f"the review timed out: {outcome['reviewer']} answered within "
                   f"{policy.approval_timeout_s} s, so the default (Reject) applied")
        else:
            why = f"the review was {outcome.get('review', 'not given')} by {outcome.get('reviewer', 'nobody')}"
        outcome.update(promoted=False, message=f"NOT promoted: {why}")
    write_summary(key, outcome)
    return outcome


def write_summary(key: str, summary: dict[str, Any]) -> Path:
    return atomic_write_text(run_dir(key) / "summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")

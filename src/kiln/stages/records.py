"""What a writing stage trusts: the run's own records (files kiln wrote in the run directory, kiln's snapshot
records), never an XCom's word.

XComs are references that any Airflow user with the role "user" can rewrite (REST: POST/PATCH
.../xcomEntries). A stage that writes takes its inputs from the run's own records and refuses, naming
each field, an XCom that disagrees (``RunMismatchError``, no retry). Also here, shared by the stages
that write: the run's MLflow run and the made/asked comparison of a result an earlier try left.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln import runs, tracking
from kiln.errors import RunMismatchError
from kiln.policy import Policy
from kiln.refs import DataGateResult, EvalReport, Ref, SnapshotRef, TrainingManifest, TrainResult
from kiln.runs import run_dir
from kiln.util.fs import read_own_json


def recorded_snapshot(snapshot_id: str) -> SnapshotRef:
    """The pinned copy of a snapshot as kiln recorded it (path, ``.dvc`` text, remote), by id alone."""
    from kiln.data.snapshot import checkout_snapshot

    return checkout_snapshot(snapshot_id)


def refuse_a_disagreeing_xcom(task: str, key: str, record: Path, own: Mapping[str, Any], xcom: Ref,
                              fields: tuple[str, ...]) -> None:
    """Refuse (``RunMismatchError``, naming each field) the ref ``task``'s XCom carried when it says
    otherwise than the run's own ``record`` (``own``: the record's facts) on any of ``fields``."""
    claimed = xcom.to_json()
    differing = [f for f in fields if claimed.get(f) != own.get(f)]
    if differing:
        raise RunMismatchError(
            f"the {task} task's XCom of run {key} disagrees with the run's own record {record}: "
            + "; ".join(f"{f}: XCom {claimed.get(f)!r}, record {own.get(f)!r}" for f in differing)
            + " (an XCom is only a reference; refusing)"
        )


def own_training_manifest(key: str, data: DataGateResult) -> tuple[Path, TrainingManifest]:
    """The training manifest this run's data gate wrote, which ``data`` (its XCom) must name."""
    path = run_dir(key) / runs.TRAINING_MANIFEST
    if not path.is_file():
        raise RunMismatchError(f"run {key} has no training manifest {path}: its data gate never passed")
    manifest = TrainingManifest.read(path)
    # Once the tokenize stage has packed its shards, the record names them (a new hash); the data
    # gate's own XCom, which the tokenize tasks take, names the manifest as the gate made it.
    made = manifest.without_tokens() if data.tokens is None else manifest
    own = {"manifest": str(path), "manifest_sha256": made.sha256}
    refuse_a_disagreeing_xcom("data_gate", key, path, own, data, ("manifest", "manifest_sha256"))
    return path, manifest


_TRAIN_RESULT_FIELDS = ("run_dir", "checkpoint", "checkpoint_manifest_sha256", "weights_sha256", "step", "world_size",
                        "total_steps", "completed", "recipe_sha256", "snapshot_id", "training_manifest_sha256")


def own_train_result(key: str, train: TrainResult) -> TrainResult:
    """The result this run's trainer wrote (``train/result.json``), which ``train`` must agree with."""
    from kiln.launchers import read_result

    train_dir = run_dir(key) / runs.TRAIN_SUBDIR
    own = read_result(train_dir)
    refuse_a_disagreeing_xcom("train", key, train_dir / runs.RESULT_FILE, own.to_json(), train, _TRAIN_RESULT_FIELDS)
    return own


def own_eval_report(key: str, evaluation: EvalReport) -> EvalReport:
    """The evaluation this run's evaluate task wrote, which ``evaluation`` must agree with."""
    path = run_dir(key) / runs.EVAL_REPORT
    try:
        own = EvalReport.from_json(read_own_json(path))
    except (OSError, ValueError) as exc:
        raise RunMismatchError(f"run {key} has no readable evaluation report {path}: {exc}") from exc
    fields = tuple(own.to_json())
    refuse_a_disagreeing_xcom("evaluate", key, path, own.to_json(), evaluation, fields)
    return own


def differing_fields(made: dict[str, Any], asked: dict[str, Any], skip: frozenset[str] = frozenset()) -> list[str]:
    return sorted(k for k in set(made) | set(asked) if k not in skip and made.get(k) != asked.get(k))


def mlflow_run_of(policy: Policy, key: str, tags: dict[str, str]) -> str:
    """The MLflow run of this DAG run (quarantine report, training metrics, model), created once and
    found again by run key (retries, later stages), with ``tags`` added."""
    run_id, _created = tracking.find_or_create_run(tracking.tracking_client(), policy, key,
                                                   run_name=key.replace("/", " "), tags=tags)
    return run_id


def refuse_other_inputs(what: str, made: dict[str, Any], asked: dict[str, Any]) -> None:
    """Reuse only what was made from exactly what is asked; name every field that differs."""
    differing = differing_fields(made, asked)
    if differing:
        raise RunMismatchError(
            f"{what} was made from other inputs than this run asks for: "
            + "; ".join(f"{k}: made {made.get(k)!r}, asked {asked.get(k)!r}" for k in differing)
            + " (not reusing it)"
        )

"""What a session gives back in the run directory besides checkpoints (rank 0 only): the metrics
record (``metrics.jsonl``, ``metrics.prom``, MLflow when the launcher named a run) and ``result.json``,
the contract's TrainResult."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln_trainer.checkpoint import CheckpointIdentity
from kiln_trainer.checkpoint_manifest import METRICS_JSONL, METRICS_PROM, RESULT_FILE, atomic_write_bytes, manifest_sha256
from kiln_trainer.config import Recipe, resume_identity
from kiln_trainer.contract import MANIFEST_NAME, TRAIN_RESULT_KIND, TrainResultRecord
from kiln_trainer.jsonfile import read_own_json
from kiln_trainer.metrics import (
    JsonlSink,
    MetricsHub,
    MetricSink,
    MlflowSink,
    PrometheusTextfileSink,
    flatten_recipe,
    mlflow_target,
)
from kiln_trainer.sdk.state import TrainState


def open_metrics(run_dir: Path, recipe: Recipe, identity: CheckpointIdentity, *, world_size: int) -> tuple[MetricsHub, str]:
    """Rank 0: the run dir and the metrics sinks; the MLflow run id ("" without one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = [
        JsonlSink(run_dir / METRICS_JSONL),
        PrometheusTextfileSink(run_dir / METRICS_PROM, {"run_dir": str(run_dir)}),
    ]
    target = mlflow_target()
    if target is None:
        return MetricsHub(sinks), ""
    # Params are immutable in an MLflow run: only what every invocation of the run shares (a
    # resume may change the world size and the micro batch). Those go in as tags, last one wins.
    params = flatten_recipe(resume_identity(identity.recipe)) | {
        "kiln.training_manifest_sha256": identity.training_manifest_sha256,
        "kiln.token_manifest_sha256": identity.token_manifest_sha256,
        "kiln.tokenizer_sha256": identity.tokenizer.sha256,
    }
    sinks.append(MlflowSink(target[0], target[1], params))
    hub = MetricsHub(sinks)
    hub.tag({
        "kiln.recipe_sha256": identity.recipe_sha256,
        "kiln.world_size": str(world_size),
        "kiln.micro_batch_size": str(recipe.data.micro_batch_size),
        "kiln.parallel_strategy": recipe.parallel.strategy,
    })
    return hub, target[1]


def train_result(
    *, run_dir: Path, last_dir: Path, recipe: Recipe, identity: CheckpointIdentity, state: TrainState,
    world_size: int, tokens_per_s: float, checkpoint_blocking_s: float, mlflow_run_id: str,
    mixture: list[dict[str, Any]] | None = None, stop: dict[str, Any] | None = None,
) -> TrainResultRecord:
    """The ``kiln.TrainResult`` of this invocation, naming its newest committed checkpoint; with
    ``mixture`` (``TokenLoader.mixture_report``: what each source gave) for a run of several sources,
    and ``stop`` when a capped source ended the run before ``train.steps`` (then ``completed`` too:
    nothing is left to train)."""
    ck_manifest = read_own_json(last_dir / MANIFEST_NAME)
    result: TrainResultRecord = {
        "kind": TRAIN_RESULT_KIND,
        "run_dir": str(run_dir),
        "checkpoint": str(last_dir.resolve()),
        "checkpoint_manifest_sha256": manifest_sha256(last_dir),
        "weights_sha256": ck_manifest["weights_sha256"],
        "step": ck_manifest["step"],
        "total_steps": recipe.train.steps,
        "completed": ck_manifest["step"] >= recipe.train.steps or (stop is not None and ck_manifest["step"] == stop["step"]),
        "recipe_sha256": identity.recipe_sha256,
        "training_manifest_sha256": identity.training_manifest_sha256,
        "token_manifest_sha256": ck_manifest["token_manifest_sha256"],
        "tokenizer_sha256": ck_manifest["tokenizer_sha256"],
        "snapshot_id": identity.snapshot_id,
        "world_size": world_size,
        "metrics": {
            "final_loss": state.last_loss if math.isfinite(state.last_loss) else None,
            "tokens_per_s": tokens_per_s,
            "steps": state.step,
            "wall_s": state.wall_s,
            "train_tokens": state.train_tokens,
            "checkpoint_blocking_s": checkpoint_blocking_s,
        },
        "events": state.events,
        "mlflow_run_id": mlflow_run_id,
    }
    if mixture is not None:
        result["mixture"] = mixture
    if stop is not None and ck_manifest["step"] == stop["step"]:
        result["stop"] = stop
    return result


def write_result(run_dir: Path, result: TrainResultRecord | dict[str, Any]) -> Path:
    """``RUN/result.json``, atomically: written last of all."""
    path = run_dir / RESULT_FILE
    atomic_write_bytes(path, (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    return path

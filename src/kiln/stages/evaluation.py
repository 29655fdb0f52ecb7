"""The evaluate stage: the committed checkpoint scored on the held-out split."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from kiln import runs
from kiln.errors import LaunchError
from kiln.refs import DataGateResult, EvalReport, TrainResult
from kiln.runs import run_dir
from kiln.stages.records import own_train_result, own_training_manifest, refuse_other_inputs
from kiln.util.fs import read_own_json

log = logging.getLogger("kiln.stages.evaluation")

_EVALUATED_FROM = ("checkpoint", "weights_sha256", "checkpoint_manifest_sha256", "step", "training_manifest_sha256",
                   "snapshot_id")
"""The facts of an EvalReport that say which checkpoint, on which data, it measured."""


def run_evaluation(checkpoint: str, manifest: str | Path, out: str | Path) -> subprocess.CompletedProcess[str]:
    """kiln's evaluation of ``checkpoint`` on ``manifest``'s eval shards, written to ``out``: the trainer's
    evaluate entry point in a process of its own (nothing of the caller's, its torch threads included,
    changes a float), its output captured. The evaluate stage and ``kiln reproduce`` both run it."""
    return subprocess.run([sys.executable, "-m", "kiln_trainer.evaluate", "--checkpoint", str(checkpoint),
                           "--manifest", str(manifest), "--out", str(out)], capture_output=True, text=True)


def evaluate_stage(train: TrainResult, data: DataGateResult, key: str) -> EvalReport:
    """Held-out bits per byte of the run's last committed checkpoint (the trainer's evaluate entry
    point), as the run's own records name it; ``train`` and ``data`` must agree with them.

    A report an earlier try left is reused only if it is of this checkpoint on this manifest."""
    result = own_train_result(key, train)
    manifest_path, manifest = own_training_manifest(key, data)
    out = run_dir(key) / runs.EVAL_REPORT
    if not out.is_file():
        proc = run_evaluation(result.checkpoint, manifest_path, out)
        for line in (proc.stdout + proc.stderr).splitlines()[-20:]:
            log.info("[evaluate] %s", line)
        if proc.returncode != 0:
            raise LaunchError(f"evaluation of {result.checkpoint} failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    report = EvalReport.from_json(read_own_json(out))
    made = {k: getattr(report, k) for k in _EVALUATED_FROM}
    asked = {
        "checkpoint": result.checkpoint,
        "weights_sha256": result.weights_sha256,
        "checkpoint_manifest_sha256": result.checkpoint_manifest_sha256,
        "step": result.step,
        "training_manifest_sha256": manifest.sha256,
        "snapshot_id": manifest.snapshot_id,
    }
    refuse_other_inputs(f"evaluation report {out} of run {key}", made, asked)
    return report

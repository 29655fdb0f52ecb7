"""Bits-per-byte of a committed checkpoint on the held-out split of a TrainingManifest.

    python -m kiln_trainer.evaluate --checkpoint RUN/checkpoints/step-00000300 \\
        [--manifest M.json] --out eval.json [--max-windows N] [--device cpu]

Without ``--manifest`` the run's own copy, ``RUN/training_manifest.json`` (written by the trainer),
is used, and only if its content hash is the one the checkpoint was trained on.

The checkpoint is verified first (``verify_checkpoint``); the eval shards are hash-checked like the
training shards. Windows are the first ``eval.max_windows`` non-overlapping ``block_size`` windows
of the eval stream, evaluated in float32, so the report is deterministic. Since a token is a byte,
bits-per-byte = mean cross-entropy (nats) / ln 2.

Report (``kind == "kiln.EvalReport"``)::

    {"kind": "kiln.EvalReport", "checkpoint": "/abs/step-dir", "weights_sha256": "<hex>",
     "split": "eval", "bits_per_byte": 2.31, "loss": 1.60, "tokens": 8192, "windows": 64,
     "step": 300, "checkpoint_manifest_sha256": "<hex>", "training_manifest_sha256": "<hex>",
     "snapshot_id": "<md5>.dir"}
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln_trainer.checkpoint import load_model_weights, weights_sha256
from kiln_trainer.checkpoint_manifest import TRAINING_MANIFEST_COPY, atomic_write_bytes, manifest_sha256
from kiln_trainer.config import Recipe
from kiln_trainer.data import build_byte_stream, eval_windows, load_training_manifest
from kiln_trainer.errors import CheckpointError, ManifestError, TrainerError
from kiln_trainer.model import GPT

log = logging.getLogger("kiln_trainer.evaluate")

EVAL_KIND = "kiln.EvalReport"


def load_checkpoint_model(step_dir: str | Path, device: str = "cpu") -> tuple[GPT, dict[str, Any]]:
    """The model of a verified checkpoint (eval mode) and its manifest."""
    manifest, state = load_model_weights(step_dir)
    if weights_sha256(state) != manifest["weights_sha256"]:
        raise CheckpointError(f"{step_dir}: model.pt does not hash to the manifest's weights_sha256")
    recipe = Recipe.from_dict(manifest["recipe"])
    model = GPT(recipe.model)
    model.load_state_dict(state)
    model.to(device).eval()
    return model, manifest


def run_training_manifest(step_dir: str | Path, ck_manifest: dict[str, Any]) -> Path:
    """The TrainingManifest copy in the checkpoint's run dir, checked against the checkpoint."""
    path = Path(step_dir).resolve().parent.parent / TRAINING_MANIFEST_COPY
    if not path.is_file():
        raise ManifestError(f"no --manifest given and {path} does not exist; pass the TrainingManifest explicitly")
    found = load_training_manifest(path).sha256
    if found != ck_manifest["training_manifest_sha256"]:
        raise ManifestError(
            f"{path} has content hash {found}, but {step_dir} was trained on "
            f"{ck_manifest['training_manifest_sha256']}; pass the right --manifest"
        )
    return path


@torch.no_grad()
def evaluate_checkpoint(
    step_dir: str | Path,
    manifest_path: str | Path | None = None,
    *,
    max_windows: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Compute the EvalReport dict for one committed checkpoint (see module docstring)."""
    step_dir = Path(step_dir).resolve()
    model, ck_manifest = load_checkpoint_model(step_dir, device)
    recipe = Recipe.from_dict(ck_manifest["recipe"])
    if manifest_path is None:
        manifest_path = run_training_manifest(step_dir, ck_manifest)
    training_manifest = load_training_manifest(manifest_path)
    if not training_manifest.eval_shards:
        raise ManifestError(f"{manifest_path}: no eval_shards to evaluate on")
    stream = build_byte_stream(training_manifest.eval_shards, recipe.data.doc_separator)
    windows = eval_windows(stream, recipe.model.block_size, max_windows or recipe.eval.max_windows)
    batch = batch_size or recipe.eval.batch_size
    total_nats, total_tokens = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(device)
        logits, _ = model(chunk[:, :-1])
        nats = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1), reduction="sum")
        total_nats += float(nats.item())
        total_tokens += chunk[:, 1:].numel()
    loss = total_nats / total_tokens
    if not math.isfinite(loss):
        raise TrainerError(f"{step_dir}: evaluation loss is not finite ({loss})")
    return {
        "kind": EVAL_KIND,
        "checkpoint": str(step_dir),
        "weights_sha256": ck_manifest["weights_sha256"],
        "split": "eval",
        "bits_per_byte": loss / math.log(2),
        "loss": loss,
        "tokens": total_tokens,
        "windows": len(windows),
        "step": ck_manifest["step"],
        "checkpoint_manifest_sha256": manifest_sha256(step_dir),
        "training_manifest_sha256": training_manifest.sha256,
        "snapshot_id": training_manifest.snapshot_id,
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m kiln_trainer.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="a committed step directory")
    parser.add_argument(
        "--manifest", type=Path, default=None, help="TrainingManifest JSON (uses eval_shards); default: the run's copy"
    )
    parser.add_argument("--out", required=True, type=Path, help="where to write the EvalReport JSON")
    parser.add_argument("--max-windows", type=int, default=None, help="override eval.max_windows of the recipe")
    parser.add_argument("--device", default="cpu", help="cpu (default, deterministic) or cuda")
    args = parser.parse_args(argv)
    try:
        report = evaluate_checkpoint(args.checkpoint, args.manifest, max_windows=args.max_windows, device=args.device)
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    atomic_write_bytes(args.out, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    log.info(
        "bits/byte %.4f (loss %.4f over %d bytes) -> %s",
        report["bits_per_byte"],
        report["loss"],
        report["tokens"],
        args.out,
    )
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Log a committed checkpoint as an MLflow PyTorch model into the active MLflow run.

    import mlflow
    from kiln_trainer.export import log_model
    with mlflow.start_run(run_id=run_id):
        uri = log_model("RUN/checkpoints/step-00000300")
    model = mlflow.pytorch.load_model(uri)
    model.generate(b"def ", max_new_tokens=64)   # -> bytes

Why the pickled-module format: mlflow 3.17's ``log_model`` defaults to ``torch.export`` (pt2),
which needs an ``input_example`` with fixed shapes, and ``load_model`` of a pt2 model returns the
exported graph's ``.module()`` (a ``GraphModule``) that has ``forward`` only: ``generate`` and the
model's config would be gone. ``serialization_format="pickle"`` stores the ``GPT`` module itself, so
``load_model`` returns a ``GPT`` with ``generate``. Pickle names the class
``kiln_trainer.model.GPT``; the package source is shipped with the model (``code_paths``) so the
model loads where ``kiln_trainer`` is not installed. Loading a pickle runs code: load models only
from a registry you trust (the registry's permissions are the control, see docs/operations).

The model carries, as MLmodel metadata and as files next to it (``extra_files``): the tokenizer
facts (byte-level, vocabulary 256), the resolved recipe, and the checkpoint manifest, under
``extra_files/`` in the model directory (lineage:
weights/recipe/training-manifest hashes, snapshot id, step).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from kiln_trainer import BYTE_VOCAB_SIZE
from kiln_trainer.checkpoint_manifest import manifest_sha256
from kiln_trainer.errors import TrainerError

TOKENIZER = {
    "type": "bytes",
    "vocab_size": BYTE_VOCAB_SIZE,
    "description": "token id == byte value; text is encoded as UTF-8; generate() returns bytes",
}


def model_metadata(manifest: dict[str, Any], step_dir: Path) -> dict[str, Any]:
    """MLmodel metadata: flat strings/ints that the MLflow UI shows and lineage checks read."""
    return {
        "kiln.tokenizer": TOKENIZER["type"],
        "kiln.vocab_size": BYTE_VOCAB_SIZE,
        "kiln.doc_separator": manifest["recipe"]["data"]["doc_separator"],
        "kiln.block_size": manifest["recipe"]["model"]["block_size"],
        "kiln.step": manifest["step"],
        "kiln.weights_sha256": manifest["weights_sha256"],
        "kiln.recipe_sha256": manifest["recipe_sha256"],
        "kiln.training_manifest_sha256": manifest["training_manifest_sha256"],
        "kiln.snapshot_id": manifest["snapshot_id"],
        "kiln.checkpoint_manifest_sha256": manifest_sha256(step_dir),
    }


def log_model(step_dir: str | Path, name: str = "model", **log_model_kwargs: Any) -> str:
    """Verify the checkpoint, rebuild the model and log it to the active run; return the model URI.

    Extra keyword arguments go to ``mlflow.pytorch.log_model`` (e.g. ``registered_model_name``).
    """
    import mlflow
    import mlflow.pytorch

    from kiln_trainer.evaluate import load_checkpoint_model

    if mlflow.active_run() is None:
        raise TrainerError("log_model needs an active MLflow run (mlflow.start_run(run_id=...))")
    step_dir = Path(step_dir).resolve()
    model, manifest = load_checkpoint_model(step_dir, device="cpu")
    import torch

    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        extra = {
            "tokenizer.json": TOKENIZER | {"doc_separator": manifest["recipe"]["data"]["doc_separator"]},
            "recipe.json": manifest["recipe"],
            "checkpoint_manifest.json": manifest,
        }
        extra_files = []
        for filename, content in extra.items():
            path = Path(tmp) / filename
            path.write_text(json.dumps(content, indent=1, sort_keys=True))
            extra_files.append(str(path))
        info = mlflow.pytorch.log_model(
            model,
            name=name,
            serialization_format="pickle",
            code_paths=[str(Path(__file__).resolve().parent)],
            extra_files=extra_files,
            metadata=model_metadata(manifest, step_dir),
            # Pinned to this process's versions; inferring them would import-scan in a subprocess.
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "cloudpickle", "numpy", "pyarrow"],
            **log_model_kwargs,
        )
    return info.model_uri

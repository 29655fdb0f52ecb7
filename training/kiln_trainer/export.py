"""Log a committed checkpoint as an MLflow text model (``python_function``) into the active run.

    import mlflow
    from kiln_trainer.export import log_model
    with mlflow.start_run(run_id=run_id):
        uri = log_model("RUN/checkpoints/step-00000300")
    mlflow.pyfunc.load_model(uri).predict(["def main("])   # -> ["<generated text>"]

The served model is ``kiln_trainer.serving.TextGenerator`` (see that module for the request
format and ``mlflow models serve``). Why a pyfunc and not ``mlflow.pytorch``: the PyTorch flavor
predicts on tensors or frames of numbers, never on text, and a pickled module would make loading
a model run pickled code. The version holds a Hugging Face model folder (``artifacts/hf_model``,
``kiln_trainer.hf``: ``config.json``, ``model.safetensors``, the tokenizer files,
``generation_config.json``) that ``transformers`` loads and the served model generates from, the
tokenizer artifact the checkpoint was trained with, and the trainer package as code
(``code_paths``), so it loads where kiln is not installed. Nothing in it is a pickle: the weights
are safetensors and the model is logged as code (``mlflow_model.py``), not as a pickled instance.

The model also carries, as MLmodel metadata (flat values the MLflow UI shows and lineage checks
read) and as files (``artifacts/``): the resolved recipe and the checkpoint manifest (weights,
recipe, training-manifest and tokenizer hashes, snapshot id, step).
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln_trainer.checkpoint_manifest import TOKENIZER_FILE, manifest_sha256
from kiln_trainer.errors import TrainerError
from kiln_trainer.tokenizer import EOS_TOKEN, ByteTokenizer, Tokenizer, load_tokenizer


def checkpoint_tokenizer(step_dir: Path, manifest: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: its ``tokenizer.json`` (format 2, listed and
    hash-checked in the manifest; EOS the recipe's ``tokenizer.eos_token``), or for a format-1
    checkpoint of the byte stream before tokenizers, the byte tokenizer with that recipe's separator byte."""
    path = step_dir / TOKENIZER_FILE
    if path.is_file():
        tokenizer = load_tokenizer(path, eos_token=manifest["recipe"].get("tokenizer", {}).get("eos_token", EOS_TOKEN))
        recorded = manifest.get("tokenizer_sha256")
        if recorded and tokenizer.sha256 != recorded:
            raise TrainerError(f"{path}: hashes to {tokenizer.sha256}, the checkpoint was trained with {recorded}")
        return tokenizer
    return ByteTokenizer(eos_id=int(manifest["recipe"].get("data", {}).get("doc_separator", 0)))


def model_metadata(manifest: dict[str, Any], step_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """MLmodel metadata: flat strings/ints that the MLflow UI shows and lineage checks read."""
    return {
        "kiln.tokenizer": tokenizer.kind,
        "kiln.tokenizer_sha256": tokenizer.sha256,
        "kiln.vocab_size": tokenizer.vocab_size,
        "kiln.eos_id": tokenizer.eos_id,
        "kiln.block_size": manifest["recipe"]["model"]["block_size"],
        "kiln.step": manifest["step"],
        "kiln.weights_sha256": manifest["weights_sha256"],
        "kiln.recipe_sha256": manifest["recipe_sha256"],
        "kiln.training_manifest_sha256": manifest["training_manifest_sha256"],
        "kiln.token_manifest_sha256": manifest.get("token_manifest_sha256", ""),
        "kiln.snapshot_id": manifest["snapshot_id"],
        "kiln.checkpoint_manifest_sha256": manifest_sha256(step_dir),
    }


class _SavedThenSigned:
    """The flavor ``log_model`` hands ``Model.log``: its ``save_model`` writes the model's files
    (``save_model`` below, with the ``MLmodel`` that ``Model.log`` made for the logged model, so its
    model id and run are final), then calls ``before_upload`` on the finished directory (registration
    signs it there), all before ``Model.log`` uploads the directory. It also takes the
    ``validate_serving_input`` keyword that ``Model.log`` passes on and ``mlflow.pyfunc.save_model``
    does not accept."""

    def __init__(self, step_dir: Path, before_upload: Callable[[Path], None] | None) -> None:
        self.step_dir, self.before_upload = step_dir, before_upload

    def save_model(self, *, path: str, mlflow_model: Any, validate_serving_input: bool = True, **kwargs: Any) -> None:
        save_model(self.step_dir, path, mlflow_model=mlflow_model, **kwargs)
        if self.before_upload is not None:
            self.before_upload(Path(path))


def save_model(step_dir: str | Path, path: str | Path, *, mlflow_model: Any = None, **save_kwargs: Any) -> Path:
    """Verify the checkpoint and write the served model's MLflow model directory at ``path`` (which must
    not exist): what ``mlflow.pyfunc.save_model`` writes for it, the model as code, the Hugging Face
    folder and the other artifacts, the signature and the input example; never a pickle. Nothing is
    loaded back or predicted. ``__pycache__`` folders that saving may leave are removed, so the
    directory is final (what is signed is what is uploaded). Returns ``path``."""
    import shutil

    import mlflow.pyfunc
    import safetensors
    import tokenizers
    import torch

    from kiln_trainer import hf, serving

    step_dir, path = Path(step_dir).resolve(), Path(path)
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        files = Path(tmp)
        # verifies every file and the weights' hash, then writes the Hugging Face folder
        written = hf.write_checkpoint_folder(step_dir, files / serving.HF_ARTIFACT)
        manifest, tokenizer = written.manifest, written.tokenizer
        tokenizer.save(files / TOKENIZER_FILE)  # the very artifact: its sha256 is the one trained with
        (files / "recipe.json").write_text(json.dumps(manifest["recipe"], indent=1, sort_keys=True))
        (files / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        artifacts = {key: str(files / filename) for key, filename in (
            (serving.HF_ARTIFACT, serving.HF_ARTIFACT), ("tokenizer", TOKENIZER_FILE), ("recipe", "recipe.json"),
            ("checkpoint_manifest", "checkpoint_manifest.json"))}
        code = str(Path(__file__).resolve().parent / "mlflow_model.py")
        mlflow.pyfunc.save_model(
            path=str(path),
            mlflow_model=mlflow_model,
            # models from code: MLflow stores this file, not a pickled TextGenerator
            python_model=code,
            artifacts=artifacts,
            code_paths=[str(Path(__file__).resolve().parent)],
            signature=serving.signature(),
            input_example=(["def main("], {"max_new_tokens": 8}),
            metadata=model_metadata(manifest, step_dir, tokenizer),
            # Pinned to this process's versions; inferring them would import-scan in a subprocess.
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"tokenizers=={tokenizers.__version__}",
                              f"transformers=={importlib.metadata.version('transformers')}",
                              f"safetensors=={safetensors.__version__}", "numpy"],
            **save_kwargs,
        )
    for pycache in sorted(path.rglob("__pycache__")):
        shutil.rmtree(pycache, ignore_errors=True)
    return path


def log_model(step_dir: str | Path, name: str = "model", *, before_upload: Callable[[Path], None] | None = None,
              **log_model_kwargs: Any) -> str:
    """Verify the checkpoint, write the served model's directory (``save_model``), hand it to
    ``before_upload`` (registration signs it: ``model.sig`` and ``provenance.dsse.json`` are written
    into it) and log it to the active run as a logged model; return the model URI. Extra keyword
    arguments go to ``mlflow.models.Model.log`` (e.g. ``registered_model_name``)."""
    import mlflow
    import mlflow.models
    import mlflow.pyfunc

    if mlflow.active_run() is None:
        raise TrainerError("log_model needs an active MLflow run (mlflow.start_run(run_id=...))")
    code = str(Path(__file__).resolve().parent / "mlflow_model.py")
    # What mlflow.pyfunc.log_model does (it calls Model.log with the pyfunc flavor), less one step:
    # with an input example, Model.log loads the model it has just written (transformers' GPT-2
    # and the weights) and predicts the example, only to log a warning if that fails. That was
    # about a third of a registration. Model.log skips it for validate_serving_input=False, which
    # it also hands to the flavor's save_model, and pyfunc's save_model refuses unknown keywords:
    # _SavedThenSigned drops it there. The example and the signature are saved as before;
    # test_export loads a logged model and predicts, and holds that this step stays off. Model.log
    # writes nothing into the directory after save_model returns (it would rewrite MLmodel only for
    # environment variables found by that skipped check), so what before_upload signed is uploaded.
    info = mlflow.models.Model.log(
        artifact_path=None,
        name=name,
        flavor=_SavedThenSigned(Path(step_dir).resolve(), before_upload),
        flavor_name=mlflow.pyfunc._get_pyfunc_model_flavor_name(code),
        validate_serving_input=False,
        **log_model_kwargs,
    )
    return info.model_uri

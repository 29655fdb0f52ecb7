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

Which trainer made the checkpoint decides who writes the folder (its sealed ``trainer`` record): for
kiln's trainer, ``kiln_trainer.hf`` (kiln's GPT as a ``GPT2LMHeadModel``); for a trainer of the
user's own, its ``export`` entry point (``[trainer] export = "my_lm.export:main"``), called in this
process as ``main(["--checkpoint", STEP_DIR, "--out", DIR])``. kiln then checks what it wrote
(``check_user_folder``): a ``config.json`` of an architecture ``transformers`` ships (nothing that
needs the folder's own code), safetensors weights, no file in a pickle format, no link, and a
tokenizer that ``AutoTokenizer`` loads and that gives the ids the weights were trained on. A user
trainer's checkpoint without an export entry point is refused, naming the trainer. The rest of the
version (the served model, artifacts, metadata, signing) is the same for both.

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

from kiln_trainer.checkpoint_manifest import TOKENIZER_FILE, manifest_sha256, read_manifest, verify_checkpoint
from kiln_trainer.contract.checkpoint_manifest import TRAINER_KEY
from kiln_trainer.contract.entrypoint import KILN_TRAINER, load_entrypoint
from kiln_trainer.errors import TrainerError
from kiln_trainer.jsonfile import load_json
from kiln_trainer.tokenizer import EOS_TOKEN, ByteTokenizer, Tokenizer, load_tokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Files a user's export may not write: formats ``torch.load`` or ``pickle`` read, which run code on load."""
TOKENIZER_PROBE = "def main(argv):\n    return 0  # é, 中文\n\n"
"""Text the exported tokenizer must encode to the checkpoint's ids (code, spaces, non-ASCII, a blank line)."""


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


def write_model_folder(step_dir: str | Path, out_dir: str | Path) -> tuple[dict[str, Any], Tokenizer]:
    """Verify the committed checkpoint ``step_dir`` and write its Hugging Face model folder at ``out_dir``
    (which must not exist): ``kiln_trainer.hf``'s for kiln's trainer, the trainer's ``export`` entry
    point's (then checked, ``check_user_folder``) for a trainer of the user's own. Returns the verified
    manifest and the checkpoint's tokenizer."""
    from kiln_trainer import hf

    step_dir, out = Path(step_dir).resolve(), Path(out_dir)
    record = read_manifest(step_dir).get(TRAINER_KEY) or {}  # sealed; the files are hashed below
    made_by = str(record.get("spec") or KILN_TRAINER)
    if made_by == KILN_TRAINER:
        written = hf.write_checkpoint_folder(step_dir, out)  # verifies every file and the weights' hash
        return written.manifest, written.tokenizer
    exporter = str(record.get("export") or "")
    if not exporter:
        raise TrainerError(
            f"{step_dir}: made by trainer {made_by!r}, whose recipe names no export entry point; kiln exports only "
            "its own GPT, so name the function that writes this trainer's checkpoint as a Hugging Face folder "
            "([trainer] export = 'package.module:function', docs/trainer-contract.md)"
        )
    manifest = verify_checkpoint(step_dir)
    tokenizer = checkpoint_tokenizer(step_dir, manifest)
    main = load_entrypoint(exporter, "trainer.export")
    try:
        code = main(["--checkpoint", str(step_dir), "--out", str(out)])
    except SystemExit as exc:  # argparse, or an entry point that exits instead of returning
        code = exc.code
    except TrainerError:
        raise
    except Exception as exc:  # the user's export failed: name it and what it raised
        raise TrainerError(f"{step_dir}: trainer.export = {exporter!r} failed: {type(exc).__name__}: {exc}") from exc
    if code not in (0, None):
        raise TrainerError(f"{step_dir}: trainer.export = {exporter!r} exited {code!r} (its log says why)")
    check_user_folder(out, tokenizer, where=f"trainer.export = {exporter!r}")
    return manifest, tokenizer


def check_user_folder(folder: Path, tokenizer: Tokenizer, *, where: str) -> None:
    """``TrainerError`` naming ``where`` and the file unless ``folder`` is a Hugging Face causal LM folder
    kiln can register: regular files only (no link), none in a pickle format (``PICKLE_SUFFIXES``),
    ``config.json`` of an architecture ``transformers`` ships (no ``auto_map``: loading would run the
    folder's own code), weights in safetensors, a tokenizer that encodes ``TOKENIZER_PROBE`` to
    ``tokenizer``'s ids, and ``tokenizer``'s EOS as the folder's (its tokenizer's, and generation's: the
    served model stops there)."""
    from kiln_trainer import hf

    if not folder.is_dir() or folder.is_symlink():
        raise TrainerError(f"{where} wrote no folder at {folder}")
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder)
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise TrainerError(f"{where}: {name} in the exported folder is a link or not a regular file")
        if path.suffix in PICKLE_SUFFIXES:
            raise TrainerError(f"{where}: {name} in the exported folder is a pickle format ({path.suffix}); "
                               "write weights as safetensors only (save_pretrained does)")
    for required in (hf.CONFIG_FILE, hf.TOKENIZER_JSON):
        if not (folder / required).is_file():
            raise TrainerError(f"{where}: the exported folder has no {required}")
    if not any(folder.glob("*.safetensors")):
        raise TrainerError(f"{where}: the exported folder has no *.safetensors weights")
    config = load_json(folder / hf.CONFIG_FILE, f"{where}'s {hf.CONFIG_FILE}", TrainerError, follow_link=False)
    if not isinstance(config, dict) or "auto_map" in config:
        raise TrainerError(f"{where}: the exported {hf.CONFIG_FILE} is not a plain config object or names code of "
                           "its own (auto_map); kiln serves only architectures transformers ships")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        model_config = AutoConfig.from_pretrained(folder)
        generation = (GenerationConfig.from_pretrained(folder) if (folder / hf.GENERATION_CONFIG_FILE).is_file()
                      else GenerationConfig.from_model_config(model_config))
        exported = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise TrainerError(f"{where}: transformers cannot load the exported folder: {exc}") from exc
    ids = exported(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    trained = tokenizer.encode_batch([TOKENIZER_PROBE])[0]
    eos = {"the tokenizer's": exported.convert_tokens_to_ids(exported.eos_token) if exported.eos_token else None,
           "generation's": generation.eos_token_id}
    if ids != trained or any(found != tokenizer.eos_id for found in eos.values()):
        raise TrainerError(
            f"{where}: the exported tokenizer encodes {TOKENIZER_PROBE!r} as {ids}, with EOS "
            + ", ".join(f"{what} {found!r}" for what, found in eos.items())
            + f"; the checkpoint's tokenizer as {trained}, EOS {tokenizer.eos_id}: write the checkpoint's "
            "(kiln_trainer.hf.tokenizer_files, generation_config)"
        )


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

    from kiln_trainer import serving

    step_dir, path = Path(step_dir).resolve(), Path(path)
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        files = Path(tmp)
        # verifies every file, then writes the Hugging Face folder (kiln's, or the trainer's export)
        manifest, tokenizer = write_model_folder(step_dir, files / serving.HF_ARTIFACT)
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

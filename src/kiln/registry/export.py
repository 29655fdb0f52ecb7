"""A registered version's Hugging Face model folder, downloaded from the registry into a directory.

::

    export_hf_folder("kiln-stdlib-lm@champion", Path("out/"))
    # out/: config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Every version kiln registers carries the folder under ``artifacts/hf_model`` of its MLflow model
(written at registration by the trainer's export). The folder is downloaded next to ``out`` and
renamed onto it: a reader of ``out`` sees the whole folder or none, and an ``out`` that holds
anything is refused before any request, so nothing is ever overwritten. Read-only on the
registry: any MLflow identity with READ may run it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, RegistryError
from kiln.registry import mlflow_io
from kiln.registry.mlflow_io import _translated, _version_by_alias, _with_retries
from kiln.registry.tags import TAGS
from kiln.util.fs import unusable_target_reason

HF_FOLDER = "artifacts/hf_model"
"""Where the trainer's export puts the folder inside a version's MLflow model."""
HF_FOLDER_REQUIRED = ("config.json", "model.safetensors")
"""What a folder must hold for ``transformers`` to load a model from it."""


def parse_alias_ref(ref: str) -> tuple[str, str]:
    """``MODEL@ALIAS`` -> (model, alias); ``ConfigError`` naming the reference otherwise."""
    model, sep, alias = ref.rpartition("@")
    if not sep or not model or not alias:
        raise ConfigError(f"{ref!r} is not MODEL@ALIAS (e.g. kiln-stdlib-lm@champion)")
    return model, alias


def refuse_occupied_out(out: Path) -> None:
    """``ConfigError`` when ``out`` cannot take the folder: not a writable directory path, or a
    directory that already holds something."""
    reason = unusable_target_reason(out, directory=True)
    if reason:
        raise ConfigError(f"--out {out}: {reason}")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: kiln export writes a whole folder and replaces nothing "
                          "(give a new or an empty directory)")


def export_hf_folder(ref: str, out: Path) -> dict[str, Any]:
    """Download the Hugging Face folder of the version ``ref`` (``MODEL@ALIAS``) into ``out`` (new or
    empty), atomically. Returns ``{"model", "alias", "version", "run_id", "weights_sha256", "out",
    "files"}`` (JSON-safe). Raises ``ConfigError`` for a bad reference or an occupied ``out`` (before
    any request), ``RegistryError`` for an alias nobody holds or a version without the folder."""
    model, alias = parse_alias_ref(ref)
    out = Path(out).absolute()
    refuse_occupied_out(out)

    def resolve() -> Any:
        mv = _version_by_alias(mlflow_io._client(), model, alias)
        if mv is None:
            raise RegistryError(f"no version of {model!r} holds alias {alias!r}")
        return mv

    mv = _with_retries(f"reading {ref}", resolve)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.kiln-export-", dir=out.parent))
    try:
        folder = _with_retries(f"downloading {model} version {mv.version}'s {HF_FOLDER}",
                               lambda: _download(model, str(mv.version), staging))
        missing = [name for name in HF_FOLDER_REQUIRED if not (folder / name).is_file()]
        if missing:
            raise RegistryError(f"{model} version {mv.version} ({ref}) has no Hugging Face model folder "
                                f"({HF_FOLDER} lacks {missing}); it was registered before versions carried one")
        files = sorted(p.name for p in folder.iterdir())
        # LAST: the commit point. rename() onto an empty directory replaces it; onto one that
        # gained entries since the check, it fails and nothing is overwritten.
        os.rename(folder, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"model": model, "alias": alias, "version": str(mv.version), "run_id": mv.run_id or "",
            "weights_sha256": mv.tags.get(TAGS["weights_sha256"], ""), "out": str(out), "files": files}


def _download(model: str, version: str, staging: Path) -> Path:
    """The version's folder, downloaded under ``staging`` (emptied first: a retry starts over)."""
    import mlflow.artifacts

    for stale in staging.iterdir():
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    target = staging / "download"
    target.mkdir()
    with _translated(f"downloading models:/{model}/{version}/{HF_FOLDER}"):
        try:
            local = mlflow.artifacts.download_artifacts(f"models:/{model}/{version}/{HF_FOLDER}", dst_path=str(target))
        except Exception as exc:
            if _is_missing(exc):
                raise RegistryError(f"{model} version {version} has no {HF_FOLDER}: it was registered before "
                                    "versions carried a Hugging Face model folder") from exc
            raise
    return Path(local)


def _is_missing(exc: Exception) -> bool:
    """The artifact path is not in the version's model (the stores answer in different words)."""
    from mlflow.exceptions import MlflowException

    text = str(exc).lower()
    return isinstance(exc, MlflowException | OSError) and (
        "not found" in text or "no such file" in text or "does not exist" in text)

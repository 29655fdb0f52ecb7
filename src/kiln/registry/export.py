"""A registered version's Hugging Face model folder, verified, then written from the registry into a directory.

::

    export_hf_folder("kiln-stdlib-lm@champion", Path("out/"))
    # out/: config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Every version kiln registers carries the folder under ``artifacts/hf_model`` of its MLflow model
(written at registration by the trainer's export). The version is verified before anything is
written (``kiln.registry.verify.check_model_dir``, with the trusted keys of the policy that owns the
model): its whole model directory is downloaded next to ``out``, both signatures and every file's
bytes are checked, and its tags and logged model are compared with the signed statement. A version
that is unsigned, does not verify or disagrees is refused with a ``ProvenanceError`` naming what
differs, and nothing is written. The folder ``out`` receives is the one just verified, renamed out
of that download (never a second download): a reader of ``out`` sees the whole folder or none, and
an ``out`` that holds anything is refused before any request, so nothing is ever overwritten.
Read-only on the registry: any MLflow identity with READ may run it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, RegistryError
from kiln.policy import Policy, get_policy, owning_policy
from kiln.registry import mlflow_io
from kiln.registry.mlflow_io import _version_by_alias, _with_retries
from kiln.registry.tags import TAGS
from kiln.registry.verify import check_model_dir, download_model_dir
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


def verifying_policy(model: str, name: str | None = None) -> Policy:
    """The policy whose trusted keys ``model``'s versions must verify with: the one that owns
    ``model``, or ``name`` for a model no policy owns. ``ConfigError`` when ``name`` is not the
    owner's (a version of a production model verifies as production only) or nobody names one."""
    owner = owning_policy(model)
    if owner is not None:
        if name is not None and name != owner.name:
            raise ConfigError(f"--policy {name}: {model} belongs to policy {owner.name}, and its versions verify "
                              f"only with {owner.name}'s keys")
        return owner
    if name is None:
        raise ConfigError(f"no policy owns {model}: give --policy production|sandbox (whose keys its versions "
                          "must be signed with)")
    return get_policy(name)


def export_hf_folder(ref: str, out: Path, policy: str | None = None) -> dict[str, Any]:
    """Verify the version ``ref`` (``MODEL@ALIAS``) for the policy that owns MODEL (``policy`` for a
    model no policy owns), then write its Hugging Face folder into ``out`` (new or empty),
    atomically. Returns ``{"model", "alias", "version", "run_id", "weights_sha256", "policy",
    "statement_key_id", "model_sig_key_id", "out", "files"}`` (JSON-safe). Raises ``ConfigError``
    for a bad reference, policy or ``out`` (before any request), ``RegistryError`` for an alias
    nobody holds or a version without the folder, ``ProvenanceError`` for a version that is
    unsigned, does not verify or whose records disagree with its signed statement."""
    model, alias = parse_alias_ref(ref)
    out = Path(out).absolute()
    refuse_occupied_out(out)
    verify_as = verifying_policy(model, policy).name

    def resolve() -> Any:
        mv = _version_by_alias(mlflow_io._client(), model, alias)
        if mv is None:
            raise RegistryError(f"no version of {model!r} holds alias {alias!r}")
        return mv

    mv = _with_retries(f"reading {ref}", resolve)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.kiln-export-", dir=out.parent))
    try:
        local = _with_retries(f"downloading {model} version {mv.version}", lambda: _download(mv, staging))
        # Verified in place: the folder renamed onto out below is these bytes.
        verified = check_model_dir(mv, local, verify_as).require_verified()
        folder = local / HF_FOLDER
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
            "weights_sha256": mv.tags.get(TAGS["weights_sha256"], ""), "policy": verify_as,
            "statement_key_id": verified.statement_key_id, "model_sig_key_id": verified.model_sig_key_id,
            "out": str(out), "files": files}


def _download(mv: Any, staging: Path) -> Path:
    """The version's whole model directory, downloaded under ``staging`` (emptied first: a retry starts over)."""
    for stale in staging.iterdir():
        shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
    target = staging / "download"
    target.mkdir()
    return download_model_dir(mv, target)

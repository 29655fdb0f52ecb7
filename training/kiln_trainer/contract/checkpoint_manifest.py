"""The checkpoint commit protocol, readable without torch (standard library only).

A checkpoint is one directory per step, ``RUN_DIR/checkpoints/step-00000050/``. Format 2 (the
``ddp`` strategy: replicated state, rank 0 writes all of it) holds::

    model.pt            state_dict of the bare model (plain tensors)
    optimizer.pt        full optimizer state_dict (tensors, ints, floats, lists, dicts)
    scheduler.pt        lr scheduler state_dict
    trainer_state.pt    step, loader state (consumed samples + order identity), token counters, guard events
    rng-rank00000.pt    python / numpy / torch CPU / CUDA RNG states of rank 0 (one file per rank)
    tokenizer.json      the tokenizer artifact the model was trained with (a checkpoint alone evaluates and serves)
    manifest.json       written LAST, atomically: the commit record

Format 3 (the ``fsdp`` strategy: sharded state, ``torch.distributed.checkpoint``) holds instead of
``model.pt`` and ``optimizer.pt``::

    __0_0.distcp ...    each rank's shards of the model and optimizer state, written by that rank
    .metadata           DCP's index of the shards (written by rank 0 once every rank has written)
    scheduler.pt, trainer_state.pt, rng-rankNNNNN.pt, tokenizer.json, manifest.json   as in format 2

and its manifest says ``"strategy": "fsdp"``. The DCP files are listed in ``files`` with their
sha256 like every other file, so the commit rule is the same: DCP's ``.metadata`` is not the
commit, kiln's sealed manifest written last is. Both formats load at any world size and into
either strategy (``kiln_trainer.sharded_checkpoint``).

``manifest.json`` (``kind == "kiln.CheckpointManifest"``)::

    {"kind": "kiln.CheckpointManifest", "format": 2, "step": 50, "world_size": 2,
     "recipe_sha256": "<hex>", "recipe": {...resolved recipe...},
     "snapshot_id": "<md5>.dir", "training_manifest_sha256": "<hex>",
     "token_manifest_sha256": "<hex>", "tokenizer_sha256": "<hex>",
     "tokenizer": {"kind": "byte", "sha256": "<hex>", "vocab_size": 257, "eos_id": 256},
     "files": {"model.pt": "<sha256>", ..., "tokenizer.json": "<sha256>"}, "weights_sha256": "<hex>",
     "created_at": "2026-11-29T17:00:00+00:00",
     "trainer": {"spec": "kiln", "distribution": "kiln-trainer", "version": "0.1.0"}, "seal_sha256": "<hex>"}

``trainer`` says which trainer made the weights, and which version of its distribution
(``kiln_trainer.contract.entrypoint.trainer_record``): ``seal`` adds it when the manifest has none,
from the trainer the manifest's recipe names, resolved in the sealing process (the trainer's own).
Checkpoints sealed before the field existed have none and still verify (kiln's trainer made them).

``world_size`` is the world size the checkpoint was written at (one RNG file per rank); the model
and optimizer state load at any world size (format 2: replicated; format 3: DCP reshards).
``weights_sha256`` is the hash of the whole model state dict in both formats (``weights_sha256`` in
``kiln_trainer.checkpoint``), so a ddp and an fsdp checkpoint of the same weights carry the same
hash. Format 1 (before the token data path: no tokenizer, no loader state) still verifies, so older
checkpoints keep their lineage; the trainer and evaluation refuse it.

``seal_sha256`` is the sha256 of the canonical JSON of every other field (``seal``): the files'
hashes cover the state, the seal covers the manifest itself, so no byte of a committed checkpoint
can change unnoticed (a flipped bit in ``created_at`` or in the recipe is refused like one in
``model.pt``).

A directory is *committed* only if its manifest parses, is sealed, lists exactly the files the protocol
requires for its format and world size (format 3: at least one DCP data file, each named for a rank
of that world), every listed file exists with the listed sha256, and nothing else is in the
directory. Anything else (a crash mid-save, a truncated file, an edited byte, a stray file) is
not a checkpoint: readers ignore it and say why.

Part of the trainer contract (``kiln_trainer.contract``): kiln verifies a trainer's checkpoints with
it (``verify_checkpoint``, ``latest_committed``, ``manifest_sha256``), and the trainer seals and finds
them with it. The run directory's names and the atomic write it re-exports are the contract's.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln_trainer.contract import (  # the run directory's names and the atomic write: the contract's
    CHECKPOINT_KIND,
    CHECKPOINTS_SUBDIR,
    MANIFEST_NAME,
    METRICS_JSONL,
    METRICS_PROM,
    RESULT_FILE,
    SAMPLE_LOG_SUBDIR,
    TOKEN_CACHE_SUBDIR,
    TOKENIZER_FILE,
    TOKENS_SUBDIR,
    TRAINING_MANIFEST_COPY,
    atomic_write_bytes,
    canonical_json,
    fsync_dir,
    sha256_file,
    step_dir_name,
)
from kiln_trainer.contract.entrypoint import parse_trainer, trainer_record
from kiln_trainer.errors import CheckpointError
from kiln_trainer.jsonfile import load_json

__all__ = [
    "CHECKPOINTS_SUBDIR",
    "CHECKPOINT_KIND",
    "CURRENT_FORMATS",
    "CheckpointError",
    "DCP_METADATA",
    "FORMAT_VERSION",
    "FULL_STATE_FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "METRICS_JSONL",
    "METRICS_PROM",
    "READABLE_FORMATS",
    "RESULT_FILE",
    "SAMPLE_LOG_SUBDIR",
    "SEAL_KEY",
    "SHARDED_FORMAT",
    "TOKENIZER_FILE",
    "TOKENS_SUBDIR",
    "TOKEN_CACHE_SUBDIR",
    "TRAINING_MANIFEST_COPY",
    "atomic_write_bytes",
    "canonical_json",
    "checkpoint_dirs",
    "dcp_data_files",
    "expected_files",
    "fsync_dir",
    "latest_committed",
    "manifest_sha256",
    "read_manifest",
    "rng_file_name",
    "seal",
    "sha256_file",
    "step_dir_name",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

FULL_STATE_FORMAT = 2
"""The ``ddp`` strategy's checkpoints: rank 0's ``torch.save`` files of the whole state."""
SHARDED_FORMAT = 3
"""The ``fsdp`` strategy's checkpoints: every rank's shards through ``torch.distributed.checkpoint``."""
FORMAT_VERSION = FULL_STATE_FORMAT
"""The format of a ``ddp`` checkpoint (kept under this name for the tools that write test checkpoints)."""
CURRENT_FORMATS = (FULL_STATE_FORMAT, SHARDED_FORMAT)
"""Formats the trainer writes and resumes from, and evaluation and export read."""
READABLE_FORMATS = (1, *CURRENT_FORMATS)
"""Formats ``verify_checkpoint`` accepts; only ``CURRENT_FORMATS`` can be resumed or evaluated."""
DCP_METADATA = ".metadata"
"""``torch.distributed.checkpoint``'s index of a format-3 checkpoint's shards."""
_DCP_DATA_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_STEP_DIR_RE = re.compile(r"^step-(\d{8})$")

_REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "world_size": int,
    "recipe_sha256": str,
    "recipe": dict,
    "snapshot_id": str,
    "training_manifest_sha256": str,
    "files": dict,
    "weights_sha256": str,
    "created_at": str,
    "seal_sha256": str,
}
_REQUIRED_FROM_FORMAT_2: dict[str, type] = {"token_manifest_sha256": str, "tokenizer_sha256": str, "tokenizer": dict}
_REQUIRED_FROM_FORMAT_3: dict[str, type] = {"strategy": str}
SEAL_KEY = "seal_sha256"
TRAINER_KEY = "trainer"
"""The trainer record: ``{"spec", "distribution", "version"}`` (``trainer_record``); absent in
checkpoints sealed before it existed."""
MAX_MANIFEST_BYTES = 64 << 20
"""A checkpoint manifest lists the checkpoint's files and hashes: kilobytes, never this many bytes."""


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its trainer record (``TRAINER_KEY``; when it has none: the trainer its
    ``recipe`` names, ``trainer_record``) and ``seal_sha256``: the sha256 of the canonical JSON of
    every other field."""
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    if TRAINER_KEY not in body:
        recipe = body.get("recipe")
        body[TRAINER_KEY] = trainer_record(parse_trainer((recipe if isinstance(recipe, dict) else {}).get(TRAINER_KEY)))
    return {**body, SEAL_KEY: _seal_sha256(body)}


def _seal_sha256(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in body.items() if k != SEAL_KEY})).hexdigest()


def rng_file_name(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def expected_files(world_size: int, format_version: int = FORMAT_VERSION, dcp_files: Iterable[str] = ()) -> set[str]:
    """The files a committed checkpoint of this world size holds, besides ``manifest.json``; for
    format 3 with the DCP data files its manifest lists (``dcp_data_files``)."""
    if format_version >= SHARDED_FORMAT:
        base = {DCP_METADATA, *dcp_files, "scheduler.pt", "trainer_state.pt"}
    else:
        base = {"model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"}
    if format_version >= 2:
        base.add(TOKENIZER_FILE)
    return base | {rng_file_name(rank) for rank in range(world_size)}


def dcp_data_files(names: Iterable[str], world_size: int) -> set[str]:
    """The names among ``names`` that are DCP data files of a rank of this world (``__R_N.distcp``)."""
    found = set()
    for name in names:
        match = _DCP_DATA_RE.fullmatch(name)
        if match and int(match.group(1)) < world_size:
            found.add(name)
    return found


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-XXXXXXXX`` directory under ``RUN_DIR/checkpoints``, committed or not, by step."""
    root = Path(run_dir) / CHECKPOINTS_SUBDIR
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """Parse and shape-check ``manifest.json`` without re-hashing files (cheap; see verify_checkpoint)."""
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST_NAME
    if not step_dir.is_dir():
        raise CheckpointError(f"{step_dir}: not a directory")
    if not path.is_file():
        raise CheckpointError(f"{step_dir}: no {MANIFEST_NAME} (never committed or save interrupted)")
    try:
        manifest = load_json(path, "checkpoint manifest", CheckpointError, max_bytes=MAX_MANIFEST_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(f"unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != CHECKPOINT_KIND:
        raise CheckpointError(f"{path}: kind is not {CHECKPOINT_KIND!r}")
    version = manifest.get("format", 1)
    if version not in READABLE_FORMATS or isinstance(version, bool):
        raise CheckpointError(f"{path}: unsupported checkpoint format {manifest.get('format')!r}")
    required = (_REQUIRED_KEYS | (_REQUIRED_FROM_FORMAT_2 if version >= 2 else {})
                | (_REQUIRED_FROM_FORMAT_3 if version >= SHARDED_FORMAT else {}))
    for key, typ in required.items():
        value = manifest.get(key)
        # bool is an int subclass; a step of `true` is a corrupt manifest, not step 1.
        if not isinstance(value, typ) or isinstance(value, bool):
            raise CheckpointError(f"{path}: field {key!r} missing or not {getattr(typ, '__name__', typ)}")
    if manifest["world_size"] < 1:
        raise CheckpointError(f"{path}: field 'world_size' must be >= 1")
    match = _STEP_DIR_RE.fullmatch(step_dir.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise CheckpointError(f"{path}: field 'step' is {manifest['step']} but the directory is {step_dir.name}")
    trainer = manifest.get(TRAINER_KEY)
    if trainer is not None and not (isinstance(trainer, dict) and all(
            isinstance(trainer.get(k), str) for k in ("spec", "distribution", "version"))):
        raise CheckpointError(f"{path}: field {TRAINER_KEY!r} must be an object with string spec, distribution, version")
    if _seal_sha256(manifest) != manifest[SEAL_KEY]:
        raise CheckpointError(f"{path}: seal mismatch: the manifest was changed after it was written")
    return manifest


def verify_checkpoint(step_dir: str | Path, *, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Return the manifest of a whole, committed checkpoint, or raise ``CheckpointError`` saying why.

    Re-hashes every file, so the cost is one sequential read of the checkpoint. ``share=(rank,
    world)``: everything but the hashing, and the hashing of this rank's share of the bytes only (the
    files dealt to ``world`` ranks by size, the same deal on every rank); a checkpoint is whole when
    every rank's share verifies.
    """
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    listed: dict[str, Any] = manifest["files"]
    version = manifest.get("format", 1)
    shards = dcp_data_files(listed, manifest["world_size"]) if version >= SHARDED_FORMAT else set()
    if version >= SHARDED_FORMAT and not shards:
        raise CheckpointError(f"{step_dir}: partial state, manifest lists no DCP data file (__R_N.distcp)")
    required = expected_files(manifest["world_size"], version, shards)
    missing_from_manifest = required - set(listed)
    if missing_from_manifest:
        raise CheckpointError(f"{step_dir}: partial state, manifest does not list {sorted(missing_from_manifest)}")
    unknown_listed = set(listed) - required
    if unknown_listed:
        raise CheckpointError(f"{step_dir}: manifest lists unexpected files {sorted(unknown_listed)}")
    present = {entry.name for entry in step_dir.iterdir()} - {MANIFEST_NAME}
    extra = present - set(listed)
    if extra:
        raise CheckpointError(f"{step_dir}: extra files not in the manifest {sorted(extra)}")
    for name in sorted(listed):
        if not (step_dir / name).is_file():
            raise CheckpointError(f"{step_dir}: file {name!r} listed in the manifest is missing")
    for name in sorted(_dealt(step_dir, listed, share)):
        expected = listed[name]
        actual = sha256_file(step_dir / name)
        if actual != expected:
            raise CheckpointError(f"{step_dir}: file {name!r} sha256 mismatch (manifest {expected}, on disk {actual})")
    return manifest


def _dealt(step_dir: Path, names: Iterable[str], share: tuple[int, int]) -> set[str]:
    """The files rank ``share[0]`` of ``share[1]`` hashes: largest first, each to the rank with the
    fewest bytes so far (ties to the lowest rank), so the ranks read about equal shares."""
    rank, world = share
    if world == 1:
        return set(names)
    sizes = {name: (step_dir / name).stat().st_size for name in names}
    load, mine = [0] * world, set()
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = load.index(min(load))
        load[least] += sizes[name]
        if least == rank:
            mine.add(name)
    return mine


def manifest_sha256(step_dir: str | Path) -> str:
    """sha256 of the ``manifest.json`` file bytes: the identity of a committed checkpoint."""
    return sha256_file(Path(step_dir) / MANIFEST_NAME)


def latest_committed(run_dir: str | Path) -> Path | None:
    """The newest step directory that passes ``verify_checkpoint``; invalid ones are logged and skipped."""
    for step, step_dir in reversed(checkpoint_dirs(run_dir)):
        try:
            verify_checkpoint(step_dir)
        except CheckpointError as exc:
            log.warning("ignoring checkpoint at step %d: %s", step, exc)
            continue
        return step_dir
    return None

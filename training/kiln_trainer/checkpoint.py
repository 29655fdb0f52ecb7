"""Saving and restoring the full training state (model, optimizer, scheduler, loader position, RNGs),
with the tokenizer artifact the model was trained with: the ``ddp`` strategy's checkpoints (format
2, this module) and what both formats share (``prepare_step_dir``, ``write_side_state``,
``commit``, ``load_side_state``, ``weights_sha256``). The ``fsdp`` strategy's sharded checkpoints
(format 3) are ``kiln_trainer.sharded_checkpoint``.

Save protocol of format 2 (see ``checkpoint_manifest`` for the on-disk format and the commit rule):

1. Every rank serialises its RNG states (``torch.save`` of plain tensors/ints) and the bytes are
   gathered on rank 0 with a collective. Gathering avoids the trap where per-rank state written
   under one key collapses to rank 0's, and it means only rank 0 ever writes shared state.
2. Rank 0 copies model/optimizer/scheduler state to CPU (the only part training waits for) and
   hands the copy to one background writer thread.
3. The writer writes and fsyncs every file, hashes them, writes ``manifest.json`` last and
   atomically (tmp + fsync + rename + directory fsync), then applies keep-last-K retention.

At most one save is in flight: the next save (or the end of the run) first waits for the previous
one, and re-raises its error, so a failed write never goes unnoticed.

The model, optimizer and scheduler state are DDP's replicated state, so a checkpoint loads at any
world size; RNG state is per rank (``load_checkpoint(rank=r)``: a rank the checkpoint's world did not have
gets ``None`` and is seeded deterministically by the trainer).

Loading uses ``torch.load(..., weights_only=True)`` only: no arbitrary object is ever unpickled.
The optimizer is restored with ``load_state_dict`` of the *saved* full state dict (the Adam moments
come from the file, not from a fresh optimizer's empty state).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import io
import json
import logging
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kiln_trainer.checkpoint_manifest import (
    CHECKPOINT_KIND,
    CHECKPOINTS_SUBDIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARDED_FORMAT,
    TOKENIZER_FILE,
    atomic_write_bytes,
    checkpoint_dirs,
    fsync_dir,
    read_manifest,
    rng_file_name,
    seal,
    step_dir_name,
    verify_checkpoint,
)
from kiln_trainer.contract import CHECKPOINT_WRITE_DELAY_ENV
from kiln_trainer.errors import CheckpointError, StorageError, naming_path, os_error_text
from kiln_trainer.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Deterministic hash of model weights: sorted keys, each with dtype, shape and raw bytes.

    Identical weights give the identical hash regardless of device or memory layout.
    """
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu").contiguous()
        digest.update(key.encode("utf-8"))
        digest.update(str(tensor.dtype).encode("ascii"))
        digest.update(json.dumps(list(tensor.shape)).encode("ascii"))
        # A uint8 view gives the raw bytes for every dtype, bfloat16 included (numpy has no bf16).
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the loop can touch, as plain tensors / ints / floats (weights_only-loadable)."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python_version": int(py_version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_name": str(np_name),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch_cpu": torch.get_rng_state(),
        "cuda": [s.cpu() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(
        (state["python_version"], tuple(int(x) for x in state["python_state"].tolist()), state["python_gauss"])
    )
    np.random.set_state(
        (
            state["numpy_name"],
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def gather_rng_bytes(device: torch.device) -> list[bytes] | None:
    """Each rank's serialised RNG state, gathered on rank 0 (None on other ranks)."""
    blob = _torch_save_bytes(capture_rng_state())
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [blob]
    world = dist.get_world_size()
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    if dist.get_rank() != 0:
        return None
    return [bytes(g.cpu()[: int(s.item())].numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)]


# --------------------------------------------------------------------------- snapshot + writer


def _to_cpu_copy(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU: the state the writer thread may use while training continues."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointIdentity:
    """What every manifest of this run records besides the state itself."""

    world_size: int
    recipe: dict[str, Any]
    recipe_sha256: str
    snapshot_id: str
    training_manifest_sha256: str
    token_manifest_sha256: str = ""
    """The packed token shards trained on ("" only in tests that write checkpoints without a run)."""
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    """Its artifact is written into every checkpoint as ``tokenizer.json``."""


@dataclass(kw_only=True, slots=True)
class _Snapshot:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_blobs: list[bytes]


def _write_file(path: Path, data: bytes) -> str:
    with naming_path(path), open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(data).hexdigest()


def _is_committed_cheap(step_dir: Path) -> bool:
    try:
        read_manifest(step_dir)
    except CheckpointError:
        return False
    return True


def apply_retention(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and uncommitted leftovers
    older than the newest committed one. The newest committed checkpoint is never deleted."""
    dirs = checkpoint_dirs(run_dir)
    committed = [(s, d) for s, d in dirs if _is_committed_cheap(d)]
    if not committed:
        return []
    newest_step = committed[-1][0]
    keep = {d for _, d in committed[-max(1, keep_last) :]}
    removed = []
    for step, step_dir in dirs:
        if step_dir in keep or step > newest_step:
            continue
        shutil.rmtree(step_dir, ignore_errors=True)
        removed.append(step_dir)
    if removed:
        fsync_dir(Path(run_dir) / CHECKPOINTS_SUBDIR)
    return removed


class CheckpointWriter:
    """Rank 0's checkpoint writer: synchronous state copy, file writes in one background thread."""

    def __init__(self, run_dir: Path, identity: CheckpointIdentity, *, keep_last: int, async_save: bool) -> None:
        self.run_dir = Path(run_dir)
        self.identity = identity
        self.keep_last = keep_last
        self.async_save = async_save
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer") if async_save else None
        self._pending: Future[Path] | None = None
        self._lock = threading.Lock()
        self.last_committed_step: int | None = None
        self.last_committed_dir: Path | None = None
        self.last_weights_sha256: str | None = None
        self.total_blocking_s = 0.0

    def wait(self) -> Path | None:
        """Block until the in-flight save (if any) is committed; re-raise its failure."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        return self.last_committed_dir

    def save(
        self,
        *,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trainer_state: dict[str, Any],
        rng_blobs: list[bytes] | None,
    ) -> float:
        """Snapshot the state and write it (in the background when async). Returns the blocking seconds."""
        if rng_blobs is None:
            raise CheckpointError("the format-2 writer runs on rank 0, which has every rank's RNG state")
        t0 = time.perf_counter()
        self.wait()
        snapshot = _Snapshot(
            step=step,
            model=_to_cpu_copy(model.state_dict()),
            optimizer=_to_cpu_copy(optimizer.state_dict()),
            scheduler=_to_cpu_copy(scheduler.state_dict()),
            trainer_state=_to_cpu_copy(trainer_state),
            rng_blobs=list(rng_blobs),
        )
        if self._executor is not None:
            self._pending = self._executor.submit(self._write, snapshot)
        else:
            self._write(snapshot)
        blocked = time.perf_counter() - t0
        self.total_blocking_s += blocked
        return blocked

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _write(self, snap: _Snapshot) -> Path:
        step_dir = self.run_dir / CHECKPOINTS_SUBDIR / step_dir_name(snap.step)
        try:
            return self._write_step(snap, step_dir)
        except OSError as exc:
            if not (step_dir / MANIFEST_NAME).exists():
                # Never committed, so never a checkpoint: remove it now (on a full disk, its
                # partial files are the space the next attempt needs).
                shutil.rmtree(step_dir, ignore_errors=True)
            raise StorageError(f"checkpoint of step {snap.step} not written: {os_error_text(exc)}") from exc

    def _write_step(self, snap: _Snapshot, step_dir: Path) -> Path:
        prepare_step_dir(step_dir)
        files = {
            name: _write_file(step_dir / name, _torch_save_bytes(obj))
            for name, obj in (("model.pt", snap.model), ("optimizer.pt", snap.optimizer))
        }
        files |= write_side_state(step_dir, self.identity, scheduler=snap.scheduler,
                                  trainer_state=snap.trainer_state, rng_blobs=snap.rng_blobs)
        weights = weights_sha256(snap.model)
        commit(step_dir, self.identity, step=snap.step, files=files, weights=weights, strategy="ddp",
               format_version=FORMAT_VERSION)
        with self._lock:
            self.last_committed_step = snap.step
            self.last_committed_dir = step_dir
            self.last_weights_sha256 = weights
        for removed in apply_retention(self.run_dir, self.keep_last):
            log.info("retention removed %s", removed)
        return step_dir


# --------------------------------------------------------------------------- the steps of a save, both formats


def prepare_step_dir(step_dir: Path) -> None:
    """Rank 0, before a checkpoint of this step is written: an empty ``step_dir``. A leftover of a
    save interrupted before its commit is removed (never a checkpoint); a committed one that fails
    verification (resume passed over it) is moved aside, kept for forensics out of the
    step-NNNNNNNN namespace that resume, retention and promotion read; a whole committed one is
    never overwritten (CheckpointError)."""
    root = step_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    if step_dir.exists():
        if _is_committed_cheap(step_dir):
            try:
                verify_checkpoint(step_dir)
            except CheckpointError as exc:
                stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%f")
                aside = root / f"{step_dir.name}.damaged-{stamp}"
                log.warning("%s fails verification (%s); moved aside to %s, writing its step again",
                            step_dir, exc, aside.name)
                os.replace(step_dir, aside)
                fsync_dir(root)
            else:
                raise CheckpointError(f"{step_dir} is already committed; refusing to overwrite it")
        else:
            shutil.rmtree(step_dir)
    step_dir.mkdir()


def write_side_state(
    step_dir: Path, ident: CheckpointIdentity, *, scheduler: dict[str, Any], trainer_state: dict[str, Any],
    rng_blobs: list[bytes],
) -> dict[str, str]:
    """Rank 0: the files besides the model and optimizer state, the same in both formats (scheduler,
    trainer state, every rank's RNG, the tokenizer); returns their sha256 by name."""
    if len(rng_blobs) != ident.world_size:
        raise CheckpointError(f"got RNG state of {len(rng_blobs)} ranks, world size is {ident.world_size}")
    files = {
        "scheduler.pt": _write_file(step_dir / "scheduler.pt", _torch_save_bytes(scheduler)),
        "trainer_state.pt": _write_file(step_dir / "trainer_state.pt", _torch_save_bytes(trainer_state)),
    }
    for rank, blob in enumerate(rng_blobs):
        files[rng_file_name(rank)] = _write_file(step_dir / rng_file_name(rank), blob)
    files[TOKENIZER_FILE] = _write_file(step_dir / TOKENIZER_FILE, ident.tokenizer.to_bytes())
    return files


def commit(
    step_dir: Path, ident: CheckpointIdentity, *, step: int, files: dict[str, str], weights: str, strategy: str,
    format_version: int,
) -> None:
    """Rank 0, once every file of the step is written and synced: the sealed manifest, written last
    and atomically -- the commit point of the checkpoint."""
    # Fault injection (kiln's conformance kit, the chaos suite): a wider window for a kill mid-save.
    delay = float(os.environ.get(CHECKPOINT_WRITE_DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    manifest = {
        "kind": CHECKPOINT_KIND,
        "format": format_version,
        "strategy": strategy,
        "step": step,
        "world_size": ident.world_size,
        "recipe_sha256": ident.recipe_sha256,
        "recipe": ident.recipe,
        "snapshot_id": ident.snapshot_id,
        "training_manifest_sha256": ident.training_manifest_sha256,
        "token_manifest_sha256": ident.token_manifest_sha256,
        "tokenizer_sha256": ident.tokenizer.sha256,
        "tokenizer": ident.tokenizer.describe(),
        "files": files,
        "weights_sha256": weights,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    fsync_dir(step_dir)
    # LAST: the commit point.
    atomic_write_bytes(step_dir / MANIFEST_NAME, json.dumps(seal(manifest), indent=1, sort_keys=True).encode("utf-8"))


# --------------------------------------------------------------------------- loading


@dataclass(kw_only=True, slots=True)
class LoadedCheckpoint:
    step_dir: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    trainer_state: dict[str, Any]
    rng: dict[str, Any] | None


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(step_dir: str | Path, *, rank: int | None, verify: bool = True) -> LoadedCheckpoint:
    """Read a committed checkpoint (verified unless the caller already did). ``rank=None`` skips RNG;
    a rank at or past the checkpoint's world size gets ``rng=None``."""
    step_dir = Path(step_dir)
    manifest = verify_checkpoint(step_dir) if verify else read_manifest(step_dir)
    rng = None
    if rank is not None and rank < manifest["world_size"]:
        rng = _load(step_dir / rng_file_name(rank))
    return LoadedCheckpoint(
        step_dir=step_dir,
        manifest=manifest,
        model=_load(step_dir / "model.pt"),
        optimizer=_load(step_dir / "optimizer.pt"),
        scheduler=_load(step_dir / "scheduler.pt"),
        trainer_state=_load(step_dir / "trainer_state.pt"),
        rng=rng,
    )


@dataclass(kw_only=True, slots=True)
class SideState:
    """What a checkpoint holds besides the model and optimizer state, the same in both formats."""

    scheduler: dict[str, Any]
    trainer_state: dict[str, Any]
    rng: dict[str, Any] | None
    """This rank's RNG state; None for a rank the checkpoint's world did not have."""


def load_side_state(step_dir: Path, manifest: dict[str, Any], *, rank: int) -> SideState:
    rng = _load(step_dir / rng_file_name(rank)) if rank < manifest["world_size"] else None
    return SideState(scheduler=_load(step_dir / "scheduler.pt"), trainer_state=_load(step_dir / "trainer_state.pt"),
                     rng=rng)


def load_model_weights(step_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(verified manifest, the whole model state_dict) for evaluation and export, in one process:
    ``model.pt`` of a format-2 checkpoint, or a format-3 checkpoint's shards consolidated."""
    manifest = verify_checkpoint(step_dir)
    if manifest.get("format") == SHARDED_FORMAT:
        from kiln_trainer.sharded_checkpoint import load_full_model_state

        return manifest, load_full_model_state(Path(step_dir))
    return manifest, _load(Path(step_dir) / "model.pt")

"""Sharded checkpoints (format 3, the ``fsdp`` strategy) through ``torch.distributed.checkpoint``
(DCP), and loading either format into either strategy at any world size.

Save (``ShardedCheckpointWriter.save``, every rank at the same step):

1. rank 0 makes the step directory ready (``checkpoint.prepare_step_dir``: the leftover of an
   interrupted save removed, a damaged committed one moved aside) and tells the others;
2. every rank hands its shards of the model and optimizer state (``get_state_dict``: DTensors keyed
   by parameter name) to ``dcp.async_save``. The loop waits only while they are copied to host
   memory (staging, ``_HostCopyStager``); a background thread writes this rank's ``__R_0.distcp``, and rank 0 writes
   DCP's ``.metadata`` once every rank has written. DCP's collectives run on a gloo group of their
   own (``dist.new_group``): on the training's group a collective of the writer thread and one of
   the loop could interleave and deadlock (and async save needs a CPU backend, also under NCCL);
3. each rank hashes its own data files and rank 0 gathers the hashes (no rank reads another's
   shards to hash them); rank 0 writes the scheduler, trainer state, every rank's RNG (gathered as
   for format 2) and the tokenizer, reads the model back from the shards to hash it
   (``weights_sha256``: the hash a ddp checkpoint of the same weights has, and a read-back check of
   what was written), and writes the sealed ``manifest.json`` LAST: kiln's commit rule, unchanged.
   DCP's ``.metadata`` alone never makes a checkpoint. Then keep-last-K.

At most one save is in flight: the next save, a rollback and the end of the run first wait for it,
and every rank then learns whether any rank's part failed (an error can surface on one rank only,
e.g. rank 0's manifest on a full disk), so all of them stop together.

Loading executes no pickled code. DCP itself unpickles ``.metadata`` with ``pickle.load`` and its
default load planner reads non-tensor values with torch's full unpickler (``weights_only`` off);
kiln closes both: (a) rank 0 verifies the sealed manifest -- every file's sha256, ``.metadata``
included -- before any rank reads a byte (``verify_checkpoint``), and (b) DCP reads only through
``SafeReader`` (``.metadata`` unpickled against an allow-list: DCP's own metadata dataclasses,
``torch.Size``, dtypes, layouts, paths) and ``SafeLoadPlanner`` (non-tensor values through the
weights-only unpickler; tensors DCP already reads that way). A file that would need anything else
is refused with ``CheckpointError``, so even a forged checkpoint with a matching manifest runs no code.

Loading (``load_model_and_optimizer``), on every rank:

- format 3, either strategy: the load target is ``get_state_dict(model, optimizer)`` of this run
  (DTensor shards under fsdp, whole tensors under ddp); ``dcp.load`` fills it from the shards of
  whatever world size wrote them (resharding) and ``set_state_dict`` puts it in place;
- format 2 into fsdp: the whole state (``torch.load(weights_only=True)``), its optimizer state
  keyed by parameter name (positions are this run's optimizer's parameters, named by the model),
  is scattered into this rank's shards (``set_state_dict(..., full_state_dict=True)``);
- format 2 into ddp: ``load_state_dict``, as before.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kiln_trainer.checkpoint import (
    CheckpointIdentity,
    _load,
    _to_cpu_copy,
    apply_retention,
    commit,
    prepare_step_dir,
    weights_sha256,
    write_side_state,
)
from kiln_trainer.checkpoint_manifest import (
    CHECKPOINTS_SUBDIR,
    DCP_METADATA,
    MANIFEST_NAME,
    SHARDED_FORMAT,
    dcp_data_files,
    sha256_file,
    step_dir_name,
)
from kiln_trainer.distributed import DistEnv, any_rank, broadcast_object
from kiln_trainer.errors import STORAGE_ERRNOS, CheckpointError, StorageError, TrainerError, os_error_text

log = logging.getLogger(__name__)
_MODEL_KEY = "model"
"""The model's state under this key in every format-3 checkpoint (the optimizer's under ``optim``)."""
# dcp.load(no_dist=True) in a process that has a group (rank 0 hashing what it wrote) warns that it
# "assumes the intent is to load in a single process": that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning)

# --------------------------------------------------------------------------- reading without running code

_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("collections", "OrderedDict")}
)
"""Every global DCP's ``.metadata`` pickle refers to (torch 2.13): constructors of plain data."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not a type of DCP's checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` unpickled against an allow-list (``_METADATA_GLOBALS``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values (optimizer hyper-parameters, step
    counts) are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions a DCP ``CheckpointException`` carries, or the exception itself."""
    if isinstance(exc, CheckpointException):
        return [cause for cause, _trace in exc.failures.values()]
    return [exc]


def _translated(exc: BaseException, what: str) -> BaseException:
    """A DCP failure as kiln's error tree: a refused unpickle or malformed file -> CheckpointError
    (exit 2), a full or read-only disk -> StorageError (exit 2); anything else (a peer that died
    mid-collective) stays a crash, which torchrun's restart answers."""
    for cause in _causes(exc):
        if isinstance(cause, TrainerError):
            return cause
        if isinstance(cause, pickle.UnpicklingError):
            return CheckpointError(f"{what}: {cause}")
        if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS:
            return StorageError(f"{what}: {os_error_text(cause)}")
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"{what}: {exc}")


def _dcp_load(state: dict[str, Any], step_dir: Path, *, no_dist: bool, partial: bool = False) -> None:
    # The index is read once before DCP reads it: a refusal inside dcp.load reaches us only as text
    # in DCP's own AssertionError, this one as the CheckpointError it is.
    try:
        SafeReader(step_dir).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{step_dir / DCP_METADATA}: not a readable DCP index: {exc}") from exc
    try:
        dcp.load(state, storage_reader=SafeReader(step_dir), planner=SafeLoadPlanner(allow_partial_load=partial),
                 no_dist=no_dist)
    except (Exception, CheckpointException) as exc:
        raise _translated(exc, f"loading {step_dir}") from exc


# --------------------------------------------------------------------------- loading


def load_full_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a format-3 checkpoint, in this process alone (no collective):
    for evaluation, export and the weights hash. The shards of any world size are consolidated; the
    names, shapes and dtypes come from the checkpoint's own index (DCP's ``.metadata``, read through
    ``SafeReader``), so any model's checkpoint loads without building the model."""
    step_dir = Path(step_dir)
    try:
        index = SafeReader(step_dir).read_metadata().state_dict_metadata
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{step_dir / DCP_METADATA}: not a readable DCP index: {exc}") from exc
    prefix = f"{_MODEL_KEY}."
    model = {
        key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in index.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"{step_dir / DCP_METADATA}: no model tensors (no key under {prefix!r})")
    state = {_MODEL_KEY: model}
    _dcp_load(state, step_dir, no_dist=True, partial=False)
    return state[_MODEL_KEY]


def load_model_and_optimizer(
    step_dir: Path, manifest: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
    sharded: bool,
) -> None:
    """Every rank (a collective for format 3 when a process group exists): this run's model and
    optimizer take the checkpoint's state, whatever format, strategy and world size wrote it.
    ``sharded``: ``model`` is FSDP2-sharded (its parameters are DTensors)."""
    if manifest.get("format") == SHARDED_FORMAT:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # dcp.load fills these dicts in place (tensors copied into, other values replaced).
        _dcp_load({"model": model_sd, "optim": optim_sd}, step_dir, no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    whole_model, whole_optim = _load(step_dir / "model.pt"), _load(step_dir / "optimizer.pt")
    if not sharded:
        model.load_state_dict(whole_model)
        optimizer.load_state_dict(whole_optim)
        return
    set_state_dict(model, optimizer, model_state_dict=whole_model,
                   optim_state_dict=_keyed_by_name(whole_optim, model, optimizer),
                   options=StateDictOptions(full_state_dict=True))


def _keyed_by_name(
    whole_optim: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """A saved ``Optimizer.state_dict`` (state keyed by parameter position) keyed by parameter name,
    as ``set_state_dict`` takes it. Position ``i`` is the ``i``-th parameter of ``optimizer``'s
    groups: this run built its optimizer as the saving run did, over the same parameters (FSDP2 keeps
    their names)."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    try:
        return {
            "state": {order[int(i)]: v for i, v in whole_optim["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[int(i)] for i in g["params"]]}
                             for g in whole_optim["param_groups"]],
        }
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this optimizer's "
                              f"{len(order)} parameters: {exc!r}") from exc


# --------------------------------------------------------------------------- saving


class _HostCopyStager(AsyncStager):
    """Staging for ``dcp.async_save``: every tensor (a DTensor keeps its sharding) copied to host
    memory, nothing else. DCP's default stager deep-copies each DTensor first, which measured 5-30x
    slower here than the copy itself (tiny recipe, 2 ranks on CPU: 15-80 ms against 2-12 ms per save)
    -- time the loop waits."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged: dict[str, Any] = _to_cpu_copy(state_dict)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns when the copy is done."""

    def close(self) -> None:
        """No buffers are kept between saves."""


def _done(value: Any = None, error: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
    return future


class ShardedCheckpointWriter:
    """Every rank's part of format-3 saves (see the module docstring)."""

    def __init__(
        self, run_dir: Path, identity: CheckpointIdentity, *, keep_last: int, async_save: bool, env: DistEnv
    ) -> None:
        self.run_dir = Path(run_dir)
        self.identity = identity
        self.keep_last = keep_last
        self.async_save = async_save
        self.env = env
        self.group = dist.new_group(backend="gloo")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-shards")
        self._stager = _HostCopyStager()
        self._pending: Future[Path | None] | None = None
        self._pending_step = 0
        self._lock = threading.Lock()
        self.last_committed_step: int | None = None
        self.last_committed_dir: Path | None = None
        self.last_weights_sha256: str | None = None
        self.total_blocking_s = 0.0

    def save(
        self, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
        trainer_state: dict[str, Any], rng_blobs: list[bytes] | None,
    ) -> float:
        """Stage this rank's shards and write them (in the background when async); returns the
        seconds the loop was blocked. ``rng_blobs``: every rank's RNG state on rank 0, None elsewhere."""
        t0 = time.perf_counter()
        self.wait()
        step_dir = self.run_dir / CHECKPOINTS_SUBDIR / step_dir_name(step)
        self._ready_on_every_rank(step_dir, step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        storage = FileSystemWriter(step_dir, sync_files=True, overwrite=False)
        side = None
        if self.env.is_main:
            assert rng_blobs is not None
            side = (_to_cpu_copy(scheduler.state_dict()), _to_cpu_copy(trainer_state), list(rng_blobs))
        self._pending_step = step
        try:
            if self.async_save:
                shards = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=storage,
                                        process_group=self.group, async_stager=self._stager)
                assert isinstance(shards, Future)  # a blocking stager: no separate staging future
                self._pending = self._executor.submit(self._finish, shards, step, step_dir, side)
            else:
                dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=storage, process_group=self.group)
                try:
                    self._pending = _done(self._finish(_done(), step, step_dir, side))
                except (Exception, CheckpointException) as exc:
                    self._pending = _done(error=exc)
                self.wait()
        except (Exception, CheckpointException) as exc:
            self._discard_uncommitted(step_dir)
            raise _translated(exc, f"checkpoint of step {step} not written") from exc
        blocked = time.perf_counter() - t0
        self.total_blocking_s += blocked
        return blocked

    def _ready_on_every_rank(self, step_dir: Path, step: int) -> None:
        """Rank 0 empties the step directory; every rank learns whether it could (or raises its fault)."""
        problem: tuple[str, str] | None = None
        if self.env.is_main:
            try:
                prepare_step_dir(step_dir)
            except CheckpointError as exc:
                problem = ("CheckpointError", str(exc))
            except OSError as exc:
                if exc.errno not in STORAGE_ERRNOS:
                    raise
                problem = ("StorageError", f"checkpoint of step {step} not written: {os_error_text(exc)}")
        problem = broadcast_object(problem, self.env)
        if problem is not None:
            raise (StorageError if problem[0] == "StorageError" else CheckpointError)(problem[1])

    def _finish(self, shards: Future[Any], step: int, step_dir: Path,
                side: tuple[dict[str, Any], dict[str, Any], list[bytes]] | None) -> Path | None:
        """Every rank, once its DCP write is done: report its data files' sha256 (or its error) to
        rank 0, which commits the step."""
        error: BaseException | None = None
        mine: dict[str, str] = {}
        try:
            shards.result()
            mine = {p.name: sha256_file(p) for p in sorted(step_dir.glob(f"__{self.env.rank}_*.distcp"))}
        except (Exception, CheckpointException) as exc:
            error = _translated(exc, f"checkpoint of step {step} not written")
        reports: list[Any] | None = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object({"files": mine, "error": None if error is None else f"{type(error).__name__}: {error}"},
                           reports, dst=0, group=self.group)
        failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports or []) if rep["error"]]
        if error is not None or failed:
            self._discard_uncommitted(step_dir)  # every rank has reported: nobody writes there any more
        if error is not None:
            raise error
        if reports is None:
            return None
        if failed:
            raise RuntimeError(f"checkpoint of step {step} not written: " + "; ".join(failed))
        assert side is not None
        try:
            return self._commit(step, step_dir, {k: v for rep in reports for k, v in rep["files"].items()}, side)
        except OSError as exc:
            self._discard_uncommitted(step_dir)
            raise StorageError(f"checkpoint of step {step} not written: {os_error_text(exc)}") from exc

    def _discard_uncommitted(self, step_dir: Path) -> None:
        """Rank 0, after a failed save: a step directory without a manifest was never a checkpoint;
        on a full disk its partial files are the space the next attempt needs."""
        if self.env.is_main and not (step_dir / MANIFEST_NAME).exists():
            shutil.rmtree(step_dir, ignore_errors=True)

    def _commit(self, step: int, step_dir: Path, shard_files: dict[str, str],
                side: tuple[dict[str, Any], dict[str, Any], list[bytes]]) -> Path:
        ident = self.identity
        on_disk = dcp_data_files(os.listdir(step_dir), ident.world_size)
        if on_disk != set(shard_files):
            raise CheckpointError(f"{step_dir}: the ranks reported {sorted(shard_files)} but the directory holds "
                                  f"{sorted(on_disk)}")
        scheduler, trainer_state, rng_blobs = side
        files = {**shard_files, DCP_METADATA: sha256_file(step_dir / DCP_METADATA)}
        files |= write_side_state(step_dir, ident, scheduler=scheduler, trainer_state=trainer_state,
                                  rng_blobs=rng_blobs)
        weights = weights_sha256(load_full_model_state(step_dir))
        commit(step_dir, ident, step=step, files=files, weights=weights, strategy="fsdp", format_version=SHARDED_FORMAT)
        with self._lock:
            self.last_committed_step = step
            self.last_committed_dir = step_dir
            self.last_weights_sha256 = weights
        for removed in apply_retention(self.run_dir, self.keep_last):
            log.info("retention removed %s", removed)
        return step_dir

    def wait(self, *, agree: bool = True) -> Path | None:
        """Block until the save in flight (if any) is committed; raise if it failed on any rank
        (``agree``: a collective on the training's group, so every rank calls it at the same point)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self.last_committed_dir
        error: BaseException | None = None
        try:
            pending.result()
        except (Exception, CheckpointException) as exc:
            error = exc
        if agree and any_rank(error is not None, self.env) and error is None:
            error = RuntimeError(f"the checkpoint of step {self._pending_step} failed on another rank (its log says why)")
        if error is not None:
            raise error
        return self.last_committed_dir

    def close(self) -> None:
        try:
            self.wait(agree=False)
        finally:
            self._executor.shutdown(wait=True)

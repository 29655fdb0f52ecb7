"""The trainer contract: what kiln and a trainer agree on, written once. Standard library only.

Both sides import this package: the orchestration side (``kiln``) imports nothing else of the
trainer package for these facts, and the trainer (``kiln_trainer``) takes its names from here.
``docs/trainer-contract.md`` is the prose of the same contract: what kiln hands an entry point
under torchrun, and what the entry point gives back.

This module owns:

* the run directory's names (``RUN/result.json``, ``RUN/checkpoints/step-00000050/manifest.json``, ...);
* the TrainingManifest wire schema: its ``kind`` and its content hash (``training_manifest_sha256``
  over ``canonical_json``);
* the TrainResult schema (``TrainResultRecord``: what ``result.json`` holds);
* the environment kiln sets for the ranks (``THREADS_ENV``, ``NODE_NAME_ENV``, the MLflow run), and
  the fault-injection switches its conformance kit and chaos suite set (``FAULT_SLOW_RANK_ENV``, ...);
* the recipe's parallel strategies (``PARALLEL_STRATEGIES``);
* the trainer's exit codes (``EXIT_OK``, ``EXIT_RETRYABLE``, ``EXIT_FATAL``) and the error tree they
  map from (``kiln_trainer.errors``, re-exported: a ``TrainerError`` is a fault a retry repeats,
  unless its class says ``retryable``);
* the metrics record (``metrics.jsonl``'s lines, their ``event`` names), the straggler rule both
  sides apply (``slow_ranks``) and the heartbeat (``metrics.prom``, rewritten every log interval);
* the atomic write (``atomic_write_bytes``) and the bounded JSON reader (``kiln_trainer.jsonfile``,
  re-exported).

Its modules own the two documents that cross between the sides:

* ``kiln_trainer.contract.training_manifest``: the TrainingManifest as both sides read it
  (``load_training_manifest``);
* ``kiln_trainer.contract.checkpoint_manifest``: the checkpoint commit protocol (``seal``,
  ``verify_checkpoint``, ``latest_committed``, ``manifest_sha256``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NotRequired, TypedDict

from kiln_trainer.errors import (
    STORAGE_ERRNOS,
    BlockSizeMismatchError,
    CheckpointError,
    RecipeError,
    RemoteObjectError,
    ResumeMismatchError,
    ShardIntegrityError,
    StorageError,
    TokenizerError,
    TokenizerMismatchError,
    TokenManifestError,
    TokenShardError,
    TrainerError,
    TrainingDivergedError,
    TrainingManifestError,
    naming_path,
    os_error_text,
)
from kiln_trainer.jsonfile import (
    DEFAULT_MAX_BYTES,
    JSONDocumentError,
    file_kind,
    load_json,
    open_regular_file,
    parse_json,
    parse_own_json,
    read_bounded,
    read_json,
    read_own_json,
)

__all__ = [
    "BlockSizeMismatchError",
    "CHECKPOINTS_SUBDIR",
    "CHECKPOINT_KIND",
    "CHECKPOINT_WRITE_DELAY_ENV",
    "CheckpointError",
    "DEFAULT_MAX_BYTES",
    "EXIT_FATAL",
    "EXIT_OK",
    "EXIT_RETRYABLE",
    "FATAL_SUBDIR",
    "FAULT_SLOW_FROM_STEP_ENV",
    "FAULT_SLOW_RANK_ENV",
    "FAULT_SLOW_S_ENV",
    "HEARTBEAT_FILE",
    "JSONDocumentError",
    "LAUNCH_SUBDIR",
    "MANIFEST_NAME",
    "METRICS_EVENT_KEY",
    "METRICS_JSONL",
    "METRICS_PROM",
    "METRICS_STEP_KEY",
    "MLFLOW_RUN_ID_ENV",
    "MLFLOW_TRACKING_URI_ENV",
    "NODE_NAME_ENV",
    "PARALLEL_STRATEGIES",
    "PROM_PREFIX",
    "PROM_STEP_SERIES",
    "RANK_STEP_TIMES_KEY",
    "RESULT_FILE",
    "ROLLBACK_EVENT",
    "RecipeError",
    "RemoteObjectError",
    "ResumeMismatchError",
    "SAMPLE_LOG_SUBDIR",
    "STARTUP_EVENT",
    "STORAGE_ERRNOS",
    "STRAGGLER_CLEARED_EVENT",
    "STRAGGLER_EVENT",
    "ShardIntegrityError",
    "StorageError",
    "THREADS_ENV",
    "TOKENIZER_FILE",
    "TOKENS_SUBDIR",
    "TOKEN_CACHE_SUBDIR",
    "TRAINING_MANIFEST_COPY",
    "TRAINING_MANIFEST_KIND",
    "TRAINING_MANIFEST_UNHASHED_KEYS",
    "TRAIN_RESULT_KIND",
    "TokenManifestError",
    "TokenShardError",
    "TokenizerError",
    "TokenizerMismatchError",
    "TrainResultMetrics",
    "TrainResultRecord",
    "TrainerError",
    "TrainingDivergedError",
    "TrainingManifestError",
    "WORLD_SIZE_CHANGE_EVENT",
    "atomic_write_bytes",
    "canonical_json",
    "file_kind",
    "fsync_dir",
    "load_json",
    "naming_path",
    "open_regular_file",
    "os_error_text",
    "parse_json",
    "parse_own_json",
    "read_bounded",
    "read_json",
    "read_own_json",
    "sha256_file",
    "slow_ranks",
    "step_dir_name",
    "training_manifest_sha256",
]

# -- the run directory ------------------------------------------------------------------------------
#
#   RUN/
#     training_manifest.json     TRAINING_MANIFEST_COPY   the trainer's copy of the manifest it trained on
#     checkpoints/               CHECKPOINTS_SUBDIR
#       step-00000050/           step_dir_name(50)        one committed checkpoint ...
#         tokenizer.json         TOKENIZER_FILE
#         manifest.json          MANIFEST_NAME            ... committed by this file, written last
#     metrics.jsonl              METRICS_JSONL            every logged step and event (the metrics record)
#     metrics.prom               METRICS_PROM             the latest gauges (the heartbeat)
#     result.json                RESULT_FILE              the TrainResult, written last of all
#     tokens/  token-cache/  sample-log/                  the trainer's own data (TOKENS_SUBDIR, ...)
#     .launch/                   LAUNCH_SUBDIR            the launchers' state: a trainer never writes here
#       fatal/rank-N.json        FATAL_SUBDIR             a rank that exited EXIT_FATAL (written by kiln's worker)

CHECKPOINTS_SUBDIR: Final = "checkpoints"
"""Every checkpoint of the run, one ``step-NNNNNNNN`` directory each (``step_dir_name``)."""
MANIFEST_NAME: Final = "manifest.json"
"""A checkpoint's commit record (kind ``CHECKPOINT_KIND``), written last, atomically."""
CHECKPOINT_KIND: Final = "kiln.CheckpointManifest"
TOKENIZER_FILE: Final = "tokenizer.json"
"""The tokenizer artifact, in a checkpoint and in a packed token directory."""
TRAINING_MANIFEST_COPY: Final = "training_manifest.json"
"""The trainer's copy of its TrainingManifest in the run dir (``evaluate`` finds it by itself)."""
RESULT_FILE: Final = "result.json"
"""The run's TrainResult (``TrainResultRecord``), written by rank 0 when the run ends (last, after the final commit)."""
METRICS_JSONL: Final = "metrics.jsonl"
"""Every logged step and event, one JSON object a line (rank 0): the metrics record."""
METRICS_PROM: Final = "metrics.prom"
"""The latest training gauges in Prometheus' text format (rank 0; the signals exporter reads it)."""
HEARTBEAT_FILE: Final = METRICS_PROM
"""A live run rewrites ``metrics.prom`` every log interval: its mtime is the run's heartbeat."""
TOKENS_SUBDIR: Final = "tokens"
"""Packed token shards the trainer made itself (a manifest without ``tokens``), one content-addressed folder each."""
TOKEN_CACHE_SUBDIR: Final = "token-cache"
"""Per-rank caches of token shards streamed from S3 (unless ``KILN_TOKEN_CACHE_DIR`` names another place)."""
SAMPLE_LOG_SUBDIR: Final = "sample-log"
"""``rank-NNNNN.jsonl``: the global sample ids each rank consumed per step (``--sample-log``)."""
LAUNCH_SUBDIR: Final = ".launch"
"""The launchers' state under the run dir (job log, status, agent pids, fatal markers): not the trainer's."""
FATAL_SUBDIR: Final = "fatal"
"""Under ``LAUNCH_SUBDIR``: ``rank-N.json`` markers of ranks that exited ``EXIT_FATAL``."""


def step_dir_name(step: int) -> str:
    """The checkpoint directory of ``step`` under ``CHECKPOINTS_SUBDIR``: ``step-00000050``."""
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"step-{step:08d}"


# -- exit codes -------------------------------------------------------------------------------------

EXIT_OK: Final = 0
"""The run reached its step (or ``--max-steps``) and wrote ``result.json``."""
EXIT_RETRYABLE: Final = 1
"""A crash, or a fault a retry can fix (a remote store that may heal): torchrun may restart, Airflow may retry."""
EXIT_FATAL: Final = 2
"""A fault the trainer diagnosed that a retry repeats (bad recipe, tampered manifest or shard, mismatched
resume, divergence, a full or read-only run dir): the launcher ends the job at once and fails it without retry."""


# -- what kiln hands the entry point besides its arguments ------------------------------------------

THREADS_ENV: Final = "KILN_TORCH_THREADS"
"""Intra-op threads per rank; the local launcher splits the host's cores among its ranks (results
depend on the thread count, so a spec that sets it wins)."""
NODE_NAME_ENV: Final = "KILN_NODE_NAME"
"""This rank's node, set by the local launcher (on Slurm the trainer reads ``SLURMD_NODENAME``)."""
MLFLOW_TRACKING_URI_ENV: Final = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID_ENV: Final = "MLFLOW_RUN_ID"
"""The MLflow run the train stage opened for this run: the entry point logs into it and never ends it."""
PARALLEL_STRATEGIES: Final = ("ddp", "fsdp")
"""The values of the recipe's ``parallel.strategy`` (and of a run's ``strategy`` parameter)."""


# -- fault injection: switches kiln's conformance kit and chaos suite set; never set in production --

CHECKPOINT_WRITE_DELAY_ENV: Final = "KILN_CKPT_WRITE_DELAY_S"
"""Seconds rank 0 waits between a checkpoint's files and its sealed manifest: widens the window in
which a kill lands mid-save (the SDK's checkpoint writer honours it)."""
FAULT_SLOW_RANK_ENV: Final = "KILN_FAULT_SLOW_RANK"
"""A straggler: this rank sleeps ``FAULT_SLOW_S_ENV`` seconds (default 0.2) in every step from step
``FAULT_SLOW_FROM_STEP_ENV`` (default 1) on (the SDK's fault-injection hook, ``kiln_trainer.faults``)."""
FAULT_SLOW_S_ENV: Final = "KILN_FAULT_SLOW_S"
FAULT_SLOW_FROM_STEP_ENV: Final = "KILN_FAULT_SLOW_FROM_STEP"


# -- the metrics record and the heartbeat -----------------------------------------------------------

METRICS_STEP_KEY: Final = "step"
"""Every line of ``metrics.jsonl`` has the step it was logged at."""
METRICS_EVENT_KEY: Final = "event"
"""A line with this key is an event (named below), not a metrics sample; samples never have it."""
STRAGGLER_EVENT: Final = "straggler"
"""``{"event": "straggler", "rank", "node", "ratio", "message", ...}``: a rank was flagged slow."""
STRAGGLER_CLEARED_EVENT: Final = "straggler_cleared"
RANK_STEP_TIMES_KEY: Final = "rank_step_times"
"""Once a straggler window: ``{"step", "rank_step_times": [median compute seconds of rank 0, 1, ...],
"straggler_rank", "scaling_efficiency"}`` (``slow_ranks`` is the rule over one window)."""
ROLLBACK_EVENT: Final = "rollback"
"""The loss guard rolled back to the newest committed checkpoint (also in ``result.json``'s ``events``)."""
WORLD_SIZE_CHANGE_EVENT: Final = "world_size_change"
STARTUP_EVENT: Final = "startup"
"""Where an invocation's start-up time went, up to its first step."""
PROM_PREFIX: Final = "kiln_train_"
"""Every series in ``metrics.prom`` is named ``kiln_train_<metric>``."""
PROM_STEP_SERIES: Final = f"{PROM_PREFIX}{METRICS_STEP_KEY}"
"""The step of the latest record, in every ``metrics.prom``."""


def slow_ranks(times: Sequence[float], factor: float) -> list[tuple[int, float, float]]:
    """``(rank, own seconds, reference seconds)`` of every rank slower than ``factor`` x the median
    of the other ranks in one window; empty for fewer than 2 ranks. The trainer flags stragglers
    with it as it trains, kiln re-runs it offline over the recorded windows."""
    values = [float(t) for t in times]
    if len(values) < 2:
        return []
    out = []
    for rank, own in enumerate(values):
        reference = statistics.median(values[:rank] + values[rank + 1 :])
        if own > factor * reference:
            out.append((rank, own, reference))
    return out


# -- canonical JSON and the TrainingManifest's content hash -----------------------------------------

TRAINING_MANIFEST_KIND: Final = "kiln.TrainingManifest"
TRAINING_MANIFEST_UNHASHED_KEYS: Final = frozenset({"kind", "sha256"})
"""The keys the content hash leaves out; every other key on the wire is in it (an absent ``tokens`` is
simply absent, so a manifest without tokens keeps the hash it always had)."""


def canonical_json(obj: Any) -> bytes:
    """The bytes every content hash of kiln and its trainer is taken over: sorted keys, no spaces, UTF-8.

    A ``UnicodeEncodeError`` for a string holding a lone surrogate (which no UTF-8 file holds)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def training_manifest_sha256(wire: Mapping[str, Any]) -> str:
    """The content hash of a TrainingManifest's wire form (``kind`` and ``sha256`` may be in it or not):
    the sha256 of ``canonical_json`` of every key but ``TRAINING_MANIFEST_UNHASHED_KEYS``."""
    body = {k: v for k, v in wire.items() if k not in TRAINING_MANIFEST_UNHASHED_KEYS}
    return hashlib.sha256(canonical_json(body)).hexdigest()


# -- the TrainResult --------------------------------------------------------------------------------

TRAIN_RESULT_KIND: Final = "kiln.TrainResult"


class TrainResultMetrics(TypedDict):
    final_loss: float | None
    """``None`` when the last loss was not finite."""
    tokens_per_s: float
    steps: int
    wall_s: float
    train_tokens: int
    checkpoint_blocking_s: float


class TrainResultRecord(TypedDict):
    """What ``RUN/result.json`` holds (kiln reads it as ``kiln.refs.TrainResult``, which ignores keys it
    does not know). Every path is absolute; every hash is 64 lowercase hex digits."""

    kind: str
    """``TRAIN_RESULT_KIND``."""
    run_dir: str
    checkpoint: str
    """The newest committed checkpoint's directory."""
    checkpoint_manifest_sha256: str
    """sha256 of that checkpoint's ``manifest.json`` bytes: its identity."""
    weights_sha256: str
    step: int
    """The checkpoint's step."""
    total_steps: int
    """Steps the recipe asks for; ``step == total_steps`` when ``completed``, unless ``stop`` says a
    capped source ended the run sooner."""
    completed: bool
    """Nothing is left to train: the recipe's steps are done, or a capped source ended the run (``stop``)."""
    recipe_sha256: str
    training_manifest_sha256: str
    token_manifest_sha256: str
    tokenizer_sha256: str
    snapshot_id: str
    world_size: int
    """The world size of this invocation."""
    metrics: TrainResultMetrics
    events: list[dict[str, Any]]
    """Notable events, in order: ``{"kind": ROLLBACK_EVENT, ...}``, ``{"kind": WORLD_SIZE_CHANGE_EVENT, ...}``."""
    mlflow_run_id: str
    mixture: NotRequired[list[dict[str, Any]]]
    """A run of several sources only (a format-2 TrainingManifest): per source, in declared order, ``name``,
    ``weight``, ``weight_share`` (its share of the weights), ``drawn`` (samples drawn from it, the guard's
    skipped batches included), ``epoch`` (of its next draw), ``share`` (realized: drawn over all drawn),
    ``trained_samples`` and ``tokens`` (without the skipped batches), ``token_manifest_sha256``."""
    stop: NotRequired[dict[str, Any]]
    """Only when a capped source ended the run at ``step`` (< ``total_steps``): ``reason``
    (``"mixture_cap"``), ``source`` (its name), ``limit`` (``"max_epochs = 2"`` or ``"max_tokens = N"``),
    ``draws`` (the samples of it the cap allows), ``loader_step`` (the first global batch that would have
    drawn past it) and ``step``; ``mixture`` holds the realized shares up to there."""


# -- writing and hashing files ----------------------------------------------------------------------


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, mode: int = 0o644) -> Path:
    """Readers see the old file or the whole new one, never a torn write (tmp, fsync, rename, dir fsync)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; checkpoints and results are read by other users (orchestration).
        os.fchmod(fd, mode)
        with naming_path(target), os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target

"""One home for a run: its key, its directory under ``KILN_HOME/runs`` and the names of the files in it.

Airflow names a DAG run by ``(dag_id, run_id)``; kiln keys everything it keeps for the run by it::

    run key   "<dag_id>/<run_id>"          MLflow tag ``kiln.run_key``, the registry's idempotency key
    run dir   RUNS/<dag name>/<run name>/
                run.json                   the exact dag_id and run_id (written when the directory is made)
                quarantine-report.json     data gate (and quarantine-report.html)
                training-manifest.json     data gate: the shards training may read
                train/                     the trainer's run dir; its own names, re-exported here:
                  result.json, metrics.jsonl, metrics.prom, training_manifest.json, checkpoints/
                  .launch/                 the launchers' state: spec.json, status.json, job.log,
                                           job.json, supervisor.pid, fatal/rank-N.json, …
                eval-report.json           evaluate
                summary.json               how the run ended
                heldout-manifest.json      champion watch (with eval-v<N>.json, reevaluation.json)

A name is a readable prefix of the id (characters outside ``[A-Za-z0-9_.-]`` become ``_``, at most
64 of them, never a leading ``.`` or ``-``) and 16 hex digits of the sha256 of the exact id: two ids
never share a directory, and every name is one short, plain path component. Labels are never parsed
back from a name: readers take them from ``run.json``, and every writer checks it, so a directory
made for one run is never used by another.

Standard library only (with the trainer contract, ``kiln_trainer.contract``): the signals exporter
and the Airflow plugin import this. No other module of kiln spells a file name of a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, RunMismatchError
from kiln.util.fs import fsync_dir, parse_own_json
from kiln_trainer.contract import (  # the trainer contract's names of a run dir (standard library only)
    CHECKPOINTS_SUBDIR,
    METRICS_JSONL,
    METRICS_PROM,
    RESULT_FILE,
    TRAINING_MANIFEST_COPY,
)
from kiln_trainer.contract import (
    FATAL_SUBDIR as FATAL_SUBDIR,
)
from kiln_trainer.contract import (
    LAUNCH_SUBDIR as LAUNCH_SUBDIR,
)

RUN_RECORD = "run.json"
RUN_RECORD_KIND = "kiln.Run"
QUARANTINE_JSON = "quarantine-report.json"
QUARANTINE_HTML = "quarantine-report.html"
QUARANTINE_ARTIFACT_DIR = "quarantine"
"""Where the data gate logs both quarantine report files in the run's MLflow run."""
VALIDATION_SUBDIR = "validation"
"""One record per validated batch of shards (``batch-<digest>.json``): what the data gate trusts."""
VALIDATION_BATCH_KIND = "kiln.ValidationBatch"
VALIDATION_SIGNATURES_SUBDIR = "signatures"
"""Under ``VALIDATION_SUBDIR``: each healthy shard's MinHash signatures (``<shard sha256>-<settings>.minhash.npy``),
written by the validation tasks for the data gate's near-duplicate removal."""
TRAINING_MANIFEST = "training-manifest.json"
TRAIN_SUBDIR = "train"
"""The trainer's run directory; the names inside it are the trainer's (``kiln_trainer``)."""
EVAL_REPORT = "eval-report.json"
SUMMARY = "summary.json"
HELDOUT_MANIFEST = "heldout-manifest.json"
REEVALUATION = "reevaluation.json"


# The trainer's run directory (``train/``, or any run dir a launcher is given). Its names (the
# trainer's result, metrics and checkpoints, the launchers' ``.launch/`` and its ``fatal/`` markers)
# are the trainer contract's (``kiln_trainer.contract``, which never imports kiln), re-exported here;
# the files inside ``.launch/`` besides ``fatal/`` are kiln's alone.
TRAINER_FILES = (RESULT_FILE, METRICS_JSONL, METRICS_PROM, TRAINING_MANIFEST_COPY, CHECKPOINTS_SUBDIR)
LAUNCH_SPEC = "spec.json"
"""The LaunchSpec a job was submitted with (a resubmission of the same spec re-attaches)."""
LAUNCH_STATUS = "status.json"
"""The local launcher's supervisor: state, restarts, agents' pids."""
LAUNCH_LOG = "job.log"
LAUNCH_PREVIOUS_LOG = "job.previous.log"
"""The log of the attempt before a resubmission (each attempt streams only its own lines)."""
SUPERVISOR_PID = "supervisor.pid"
JOB_RECORD = "job.json"
"""The launched job (backend, options, handle), for the DAG's failure callback to cancel it."""
SLURM_EXCLUDED_NODES = "slurm-excluded-nodes.json"
ELASTIC_RECORD = "elastic.json"
"""Every elastic shrink of the run's jobs (a lost node not replaced in time: the job went on with fewer
nodes), kept across resubmissions: ``kiln.launchers.elastic``."""
SLURM_SCRIPT = "job.sbatch"
SLURM_JOB_ID = "slurm-job-id"
CANCELLED_MARK = "cancelled"
"""Written when kiln cancels a Kubernetes job (a deleted TrainJob otherwise reads as vanished)."""
K8S_LOG = "k8s.log"


def slurm_log(job_id: str) -> str:
    return f"slurm-{job_id}.log"


def validation_batch(shards: list[str]) -> str:
    """The record of the validated batch of exactly these shards (in this order)."""
    digest = hashlib.sha256("\n".join(shards).encode("utf-8")).hexdigest()[:DIGEST_HEX]
    return f"batch-{digest}.json"


def version_eval_report(version: str) -> str:
    """The champion watch's evaluation of one registered version (``eval-v<N>.json``)."""
    if not str(version).isdigit():
        raise ConfigError(f"a model version is a number, got {version!r}")
    return f"eval-v{version}.json"

PREFIX_MAX = 64
DIGEST_HEX = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

AIRFLOW_ID_MAX = 250
"""Airflow's ``ID_LEN``: the longest dag_id / run_id its metadata database stores."""
ALLOWED_RUN_ID_PATTERN = r"^(?!\.\Z)[A-Za-z0-9_.~:+-]{1,250}\Z"
"""``[scheduler] allowed_run_id_pattern`` of every Airflow that kiln configures (embedded stack,
production-like stack, docker compose). Airflow's default character set, less what Airflow itself
cannot serve: a run id of ``.`` (the Task SDK's HTTP client drops a ``.`` path segment, so the first
task's XCom push fails with a 307 "API_SERVER_ERROR"), ids longer than the database column, and a
trailing newline (``$`` would accept one). A trigger with such an id gets HTTP 400 naming the pattern.
Every run id Airflow generates itself matches it."""


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """Which DAG run a key, a directory or a record belongs to: Airflow's exact ids."""

    dag_id: str
    run_id: str

    def __post_init__(self) -> None:
        for field_name, value in (("dag_id", self.dag_id), ("run_id", self.run_id)):
            if not value:
                raise ConfigError(f"a run needs a non-empty {field_name}, got {value!r}")
            if value in (".", "..") or "/" in value:
                # Airflow's task API carries both ids as URL path segments; these do not survive that.
                raise ConfigError(
                    f"dag {self.dag_id!r} / run {self.run_id!r} does not name a run directory: a {field_name} may "
                    "not be '.' or '..' or contain '/'"
                )

    @property
    def key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"

    @classmethod
    def from_key(cls, key: str) -> RunIdentity:
        """``"dag_id/run_id"`` → the identity (dag ids never contain ``/``; run ids may not either)."""
        dag_id, sep, run_id = key.partition("/") if isinstance(key, str) else ("", "", "")
        if not sep or not dag_id or not run_id:
            raise ConfigError(f"run_key must be '<dag_id>/<run_id>', got {key!r}")
        return cls(dag_id, run_id)

    def to_json(self) -> dict[str, str]:
        return {"kind": RUN_RECORD_KIND, "dag_id": self.dag_id, "run_id": self.run_id, "run_key": self.key}

    @classmethod
    def from_json(cls, data: Any) -> RunIdentity:
        if not isinstance(data, dict) or data.get("kind") != RUN_RECORD_KIND:
            raise ConfigError(f"not a {RUN_RECORD_KIND} record: {str(data)[:200]!r}")
        dag_id, run_id = data.get("dag_id"), data.get("run_id")
        if not isinstance(dag_id, str) or not isinstance(run_id, str):
            raise ConfigError(f"a {RUN_RECORD_KIND} record needs string dag_id and run_id: {str(data)[:200]!r}")
        return cls(dag_id, run_id)


def run_key(dag_id: str, run_id: str) -> str:
    return RunIdentity(dag_id, run_id).key


def split_run_key(key: str) -> tuple[str, str]:
    """``"dag_id/run_id"`` → ``(dag_id, run_id)``; a ``ConfigError`` naming the key otherwise."""
    identity = RunIdentity.from_key(key)
    return identity.dag_id, identity.run_id


RUN_KEY_TAG = "kiln.run_key"
"""The MLflow tag naming the DAG run of an MLflow run or a model version: how stages, retries and the
registry find what a run already made (copied along when a version is promoted)."""


def experiment_name(policy: Any) -> str:
    """The MLflow experiment a policy's runs log into (``policy``: a ``kiln.policy.Policy``)."""
    return f"kiln-{policy.name}"


def run_key_filter(key: str) -> str:
    """MLflow's search filter for what the run with this key made (``mlflow_filter_value``)."""
    return f"tags.`{RUN_KEY_TAG}` = {mlflow_filter_value(key)}"


def mlflow_filter_value(key: str) -> str:
    """The run key as a string literal of MLflow's search grammar (``tags.`kiln.run_key` = …``).

    The grammar has no escape for quotes, so a key holding one is refused, never altered: an
    altered key would find another run's MLflow run."""
    if "'" in key or "\\" in key:
        raise ConfigError(f"run key {key!r} may not contain quotes or backslashes (MLflow cannot search for it)")
    return f"'{key}'"


def dir_name(name: str) -> str:
    """The path component for one id: readable prefix, ``-``, 16 hex digits of sha256(exact id)."""
    prefix = _UNSAFE.sub("_", name)[:PREFIX_MAX]
    if prefix[0] in ".-":  # never a hidden directory, never an option-like name
        prefix = "_" + prefix[1:]
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_HEX]
    return f"{prefix}-{digest}"


def _identity(run: str | RunIdentity) -> RunIdentity:
    return run if isinstance(run, RunIdentity) else RunIdentity.from_key(run)


def _runs_root(runs_root: Path | None) -> Path:
    if runs_root is not None:
        return Path(runs_root)
    from kiln import settings as kiln_settings

    return kiln_settings.load().runs_dir


def run_dir_path(run: str | RunIdentity, runs_root: Path | None = None) -> Path:
    """Where a run's directory is (no I/O): ``RUNS/dir_name(dag_id)/dir_name(run_id)``."""
    identity = _identity(run)
    return _runs_root(runs_root) / dir_name(identity.dag_id) / dir_name(identity.run_id)


def read_identity(path: Path) -> RunIdentity | None:
    """The run a directory's ``run.json`` names; None when it has none (not made by kiln)."""
    record = Path(path) / RUN_RECORD
    try:
        text = record.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunMismatchError(f"cannot read the identity record {record}: {exc}") from exc
    try:
        return RunIdentity.from_json(parse_own_json(text, str(record)))
    except (ValueError, ConfigError) as exc:
        raise RunMismatchError(f"identity record {record} is unreadable: {exc}") from exc


def _check_identity(path: Path, identity: RunIdentity) -> None:
    found = read_identity(path)
    if found is not None and found != identity:
        raise RunMismatchError(
            f"run directory {path} belongs to run {found.key!r}, not {identity.key!r}: refusing to share it"
        )


def _create_once(path: Path, text: str) -> bool:
    """Write ``path`` whole if it does not exist yet (a hard link never replaces a file); False if it did."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        fsync_dir(path.parent)
        return True
    finally:
        os.unlink(tmp)


def run_dir(run: str | RunIdentity, runs_root: Path | None = None) -> Path:
    """The run's directory, made with its identity record when missing and checked to be this run's
    otherwise (``RunMismatchError``, no retry): for every stage that writes into it."""
    identity = _identity(run)
    path = run_dir_path(identity, runs_root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        record = json.dumps(identity.to_json(), indent=2, sort_keys=True) + "\n"
        if _create_once(path / RUN_RECORD, record):
            return path
    except OSError as exc:
        raise ConfigError(f"cannot make the run directory {path} of {identity.key!r}: {exc}") from exc
    _check_identity(path, identity)
    return path


def existing_run_dir(run: str | RunIdentity, runs_root: Path | None = None) -> Path | None:
    """The run's directory if it was made (checked to be this run's), else None; writes nothing."""
    identity = _identity(run)
    path = run_dir_path(identity, runs_root)
    if not path.is_dir():
        return None
    _check_identity(path, identity)
    return path


def iter_run_dirs(runs_root: Path | None = None) -> Iterator[tuple[Path, RunIdentity | RunMismatchError]]:
    """Every run directory under the runs folder with the identity its record names (or the error
    reading it); directories without a record are not kiln's runs and are left out."""
    root = _runs_root(runs_root)
    try:
        dag_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return
    for dag_dir in dag_dirs:
        try:
            run_dirs = sorted(p for p in dag_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for path in run_dirs:
            try:
                identity = read_identity(path)
            except RunMismatchError as exc:
                yield path, exc
                continue
            if identity is not None:
                yield path, identity

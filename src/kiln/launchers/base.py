"""What every launcher backend shares: the job spec, the job handle and status, the interface.

A backend turns a ``LaunchSpec`` into one gang of torchrun agents (one per node) and reports on it::

    handle = launcher.submit(spec)          # returns at once; JSON-safe, survives the process
    status = launcher.poll(handle)          # PENDING | RUNNING | SUCCEEDED | FAILED | FATAL | CANCELLED
    launcher.logs(handle, offset)           # (new text, next offset): streamable into a task log
    launcher.cancel(handle)                 # ends every agent and worker of the job
    result = launcher.result(handle)        # TrainResult, or the error the final status calls for

``wait`` (poll until terminal, streaming logs) is shared. Everything a backend needs to find its job
again lives in the handle and in ``RUN/.launch/``, so a deferrable Airflow trigger can poll from
another process.

Fatal trainer faults: every worker runs ``kiln.launchers.worker``, which calls the trainer the recipe
names (its ``trainer``: ``kiln`` or the user's entry point) and, when it
exits 2 (a fault a retry cannot fix), drops ``RUN/.launch/fatal/rank-N.json``. Backends check for that
marker on each poll and end the whole job at once, so neither torchrun's restarts nor Airflow's
retries repeat a run that must fail the same way: the status is FATAL and ``result`` raises
``TrainingFaultError`` (``retryable = False``).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from kiln.errors import ConfigError, LaunchError, ManifestError, TrainingFaultError
from kiln.refs import TrainResult
from kiln.runs import FATAL_SUBDIR, LAUNCH_STATUS, LAUNCH_SUBDIR, RESULT_FILE
from kiln.util.fs import read_own_json
from kiln_trainer.contract import EXIT_FATAL

FATAL_LINE = "[kiln fatal] "
"""Prefix of the line a rank prints on stderr as it exits 2: ``[kiln fatal] rank N: <error>``. The
local launcher reads it from the agent's output, which needs no disk (the marker file may not fit
on a full one)."""
WORKER_MODULE = "kiln.launchers.worker"

State = Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "FATAL", "CANCELLED"]
TERMINAL_STATES: frozenset[str] = frozenset({"SUCCEEDED", "FAILED", "FATAL", "CANCELLED"})


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """One training job: what to run, on how many nodes, and where it writes."""

    run_dir: Path
    """Shared by every node (checkpoints, metrics, result.json, ``.launch/``)."""
    manifest: Path
    recipe: Path
    run_key: str
    """Stable id of the job (DAG id + run id): the rendezvous id and the MLflow run key."""
    nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    """Whole-group restarts torchrun may make after a worker fails; on the local backend also the
    number of lost agents (nodes) the launcher replaces."""
    overrides: tuple[str, ...] = ()
    """``section.key=value`` recipe overrides (run params win over the recipe)."""
    max_steps: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    min_nodes: int | None = None
    """Elastic shrink: the fewest nodes the job may go on with after losing a node that is not
    replaced within ``replacement_timeout_s`` (the global batch stays; gradient accumulation takes
    up the change). None: ``nodes``, never shrink (a lost node is replaced, or the job fails)."""
    replacement_timeout_s: int = 60
    """How long, after a node is lost, the job waits for a replacement before it goes on with the
    nodes left (whole seconds, as torch's rendezvous timeouts are). Only matters with ``min_nodes``."""
    spare_nodes: int | None = None
    """Local backend: node slots that can stand in for lost nodes (a lost node's own slot is gone).
    None: a replacement is always there (a scheduler that brings the node back), within
    ``max_restarts``. The Slurm backend asks Slurm which nodes are up instead."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ConfigError(f"nodes must be within [1, 64], got {self.nodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"min_nodes must be within [1, nodes={self.nodes}], got {self.min_nodes}")
        if isinstance(self.replacement_timeout_s, bool) or not isinstance(self.replacement_timeout_s, int) \
                or self.replacement_timeout_s < 0:
            raise ConfigError(f"replacement_timeout_s must be a whole number of seconds >= 0, "
                              f"got {self.replacement_timeout_s!r}")
        if self.spare_nodes is not None and self.spare_nodes < 0:
            raise ConfigError(f"spare_nodes must be >= 0 (or None: always a replacement), got {self.spare_nodes}")
        if not 1 <= self.nproc_per_node <= 64:
            raise ConfigError(f"nproc_per_node must be within [1, 64], got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")

    @property
    def launch_dir(self) -> Path:
        return Path(self.run_dir) / LAUNCH_SUBDIR

    @property
    def least_nodes(self) -> int:
        """``min_nodes``, or ``nodes`` when the job may not shrink."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def rdzv_id(self) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.run_key)[-64:]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(run_dir=str(self.run_dir), manifest=str(self.manifest), recipe=str(self.recipe),
                 overrides=list(self.overrides))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LaunchSpec:
        return cls(**{**d, "run_dir": Path(d["run_dir"]), "manifest": Path(d["manifest"]),
                      "recipe": Path(d["recipe"]), "overrides": tuple(d.get("overrides", ()))})


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """A planned training job: what to run (``spec``), on which backend with which options, and the
    MLflow run it logs into. The train stage makes one, submits it and carries it across a deferral
    as JSON: ``{"spec", "backend", "options", "mlflow_run_id"}``."""

    spec: LaunchSpec
    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    """The backend's constructor options (Slurm partition, Kubernetes namespace, ...)."""
    mlflow_run_id: str = ""

    def launcher(self) -> Launcher:
        from kiln.launchers import get_launcher  # the backends' registry (it imports this module)

        return get_launcher(self.backend, **self.options)

    def with_options(self, **changed: Any) -> LaunchPlan:
        return replace(self, options={**self.options, **changed})

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "backend": self.backend, "options": dict(self.options),
                "mlflow_run_id": self.mlflow_run_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LaunchPlan:
        try:
            return cls(spec=LaunchSpec.from_json(d["spec"]), backend=str(d["backend"]),
                       options=dict(d.get("options") or {}), mlflow_run_id=str(d.get("mlflow_run_id") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise LaunchError(f"not a launch plan ({{spec, backend, options, mlflow_run_id}}): {exc!r}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class JobHandle:
    """Finds a submitted job again, from any process: ``{"backend", "job_id", "run_dir"}``."""

    backend: str
    job_id: str
    run_dir: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobHandle:
        return cls(backend=str(d["backend"]), job_id=str(d["job_id"]), run_dir=str(d["run_dir"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStatus:
    state: State
    reason: str = ""
    """Why the job is not (yet) a success: names the node, exit code or fatal rank."""
    restarts: int = 0
    """Lost nodes the launcher replaced (local backend); torchrun's own restarts are in the log."""
    shrinks: tuple[str, ...] = ()
    """Each elastic shrink of this run's jobs so far, in words (``kiln.launchers.elastic``)."""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


class Launcher(Protocol):
    name: str

    def submit(self, spec: LaunchSpec) -> JobHandle: ...
    def poll(self, handle: JobHandle) -> JobStatus: ...
    def cancel(self, handle: JobHandle) -> None: ...
    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]: ...
    def result(self, handle: JobHandle) -> TrainResult: ...


def trainer_args(spec: LaunchSpec) -> list[str]:
    """The worker's own arguments (after ``-m kiln.launchers.worker``)."""
    argv = ["--manifest", str(spec.manifest), "--recipe", str(spec.recipe), "--run-dir", str(spec.run_dir)]
    for item in spec.overrides:
        argv += ["--set", item]
    if spec.max_steps is not None:
        argv += ["--max-steps", str(spec.max_steps)]
    return argv


def torchrun_argv(spec: LaunchSpec, endpoint: str, *, python: str = sys.executable,
                  node_rank: int | None = None, rdzv_conf: str | None = None, nnodes: str | None = None) -> list[str]:
    """One node's torchrun agent: c10d rendezvous at ``endpoint``, the worker shim as entry point.
    ``nnodes``: torchrun's ``--nnodes`` when not ``spec.nodes`` (an elastic ``MIN:MAX``)."""
    argv = [
        python, "-m", "torch.distributed.run",
        f"--nnodes={nnodes or spec.nodes}", f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={spec.rdzv_id}",
        f"--max-restarts={spec.max_restarts}", "--monitor-interval=1",
    ]
    if node_rank is not None:
        argv.insert(5, f"--node-rank={node_rank}")
    if rdzv_conf:
        argv.append(f"--rdzv-conf={rdzv_conf}")
    return argv + ["-m", WORKER_MODULE, *trainer_args(spec)]


def fatal_markers(run_dir: str | Path) -> list[dict[str, Any]]:
    """Markers the worker shim left for ranks that exited 2 (oldest first)."""
    folder = Path(run_dir) / LAUNCH_SUBDIR / FATAL_SUBDIR
    found = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            found.append(read_own_json(path))
        except OSError:
            continue
        except ValueError:  # written whole or not at all, so this is the empty marker of a full disk
            found.append({"rank": path.stem.removeprefix("rank-"), "exit_code": EXIT_FATAL, "error": ""})
    return found


def fatal_reason(markers: list[dict[str, Any]]) -> str:
    m = markers[0]
    return f"rank {m.get('rank')} exited 2 (trainer fault, not retried): {m.get('error') or 'see the job log'}"


def check_recipe(spec: LaunchSpec) -> None:
    """Refuse a recipe the trainer would refuse (unknown section or key, wrong type, bad ``--set``),
    and a trainer entry point that does not resolve (``kiln_trainer.contract.entrypoint``: no such
    module, no such function, not a function of ``argv``, kiln's own source tree), before any worker
    starts: ``ConfigError`` naming the recipe file and the field or spec, not a trainer fault after
    torchrun's start-up on every node."""
    from kiln_trainer.config import load_recipe  # torch-free
    from kiln_trainer.contract import RecipeError
    from kiln_trainer.contract.entrypoint import validate_trainer

    try:
        validate_trainer(load_recipe(spec.recipe, spec.overrides).trainer)
    except RecipeError as exc:
        raise ConfigError(f"recipe {spec.recipe}: {exc}") from exc


def check_manifest(spec: LaunchSpec) -> None:
    """Refuse a TrainingManifest the trainer would refuse (unreadable, not JSON, edited after kiln
    issued it, a malformed shard list) before any worker starts: ``ManifestError`` naming the file.
    The shards' bytes are the trainer's to hash, on every rank."""
    from kiln_trainer.contract import TrainingManifestError
    from kiln_trainer.contract.training_manifest import load_training_manifest

    try:
        load_training_manifest(spec.manifest)
    except TrainingManifestError as exc:
        raise ManifestError(str(exc)) from exc


def clear_launch_state(spec: LaunchSpec) -> Path:
    """Before a (re)submission: forget the previous attempt's fatal markers and status."""
    folder = spec.launch_dir
    (folder / FATAL_SUBDIR).mkdir(parents=True, exist_ok=True)
    for path in (folder / FATAL_SUBDIR).glob("rank-*.json"):
        path.unlink(missing_ok=True)
    (folder / LAUNCH_STATUS).unlink(missing_ok=True)
    return folder


def wait(launcher: Launcher, handle: JobHandle, *, log: Callable[[str], None] = print,
         poll_s: float = 0.5) -> JobStatus:
    """Poll until the job ends, passing every new log line to ``log``; cancel if interrupted."""
    offset = 0
    pending = ""
    try:
        while True:
            status = launcher.poll(handle)
            text, offset = launcher.logs(handle, offset)
            pending += text
            *lines, pending = pending.split("\n")
            for line in lines:
                log(line)
            if status.done:
                text, offset = launcher.logs(handle, offset)
                for line in (pending + text).splitlines():
                    log(line)
                return status
            time.sleep(poll_s)
    except BaseException:
        # The caller is going away (task killed, Ctrl-C): never leave a gang running behind it.
        launcher.cancel(handle)
        raise


def result_for(status: JobStatus, handle: JobHandle, log_tail: str = "") -> TrainResult:
    """The TrainResult of a finished job, or the error its status calls for."""
    if status.state == "SUCCEEDED":
        return read_result(Path(handle.run_dir))
    where = f"{handle.backend} job {handle.job_id}"
    tail = f"\nlast log lines:\n{log_tail}" if log_tail else ""
    if status.state == "FATAL":
        raise TrainingFaultError(f"{where}: {status.reason}{tail}")
    if status.state == "CANCELLED":
        raise LaunchError(f"{where} was cancelled: {status.reason}{tail}")
    if status.state == "FAILED":
        raise LaunchError(f"{where} failed: {status.reason}{tail}")
    raise LaunchError(f"{where} has not finished (state {status.state})")


def read_result(run_dir: Path) -> TrainResult:
    path = Path(run_dir) / RESULT_FILE
    try:
        data = read_own_json(path)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"training finished without a readable {path}: {exc}") from exc
    return TrainResult.from_json(data)


def tail_text(text: str, lines: int = 12) -> str:
    return "\n".join(text.splitlines()[-lines:])

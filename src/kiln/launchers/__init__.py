"""Launch the trainer as one gang of torchrun agents (one per node) and hand back its TrainResult.

Backends share one interface (``kiln.launchers.base``): ``submit(spec) -> JobHandle``, ``poll``,
``logs``, ``cancel``, ``result``; ``wait`` streams logs until the job ends.

* ``local`` (embedded default, ``kiln.launchers.local``): N agents on this machine, supervised:
  lost agents replaced, the rendezvous store outlives any node.
* ``slurm`` (``kiln.launchers.slurm``): ``sbatch -N<nodes>`` with ``srun torchrun`` on each node,
  state from squeue/scontrol/sacct, ``scancel``; partition and QoS from the policy.
* ``kubernetes`` (``kiln.launchers.kubernetes``): a Kubeflow Trainer ``TrainJob`` with Kueue queue and
  priority labels (gang admission); state from its status conditions, cancel deletes it.

Inside Airflow, slurm and kubernetes jobs are waited for by a deferrable trigger
(``kiln.airflow.triggers.LaunchedJobTrigger``); the local backend runs in the task (its agents are
the task's children and stream into its log).

``launch(spec, backend=...)`` and ``launch_local(spec, log=...)`` run a job to completion. A worker
exiting 2 (a trainer fault) ends the whole job at once with ``TrainingFaultError`` (not retryable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.errors import ConfigError
from kiln.launchers.base import (
    JobHandle,
    JobStatus,
    Launcher,
    LaunchPlan,
    LaunchSpec,
    TrainingFaultError,
    read_result,
    torchrun_argv,
    wait,
)
from kiln.launchers.kubernetes import KubernetesLauncher, render_trainjob
from kiln.launchers.local import LocalLauncher, agent_argv, cancel, launch_local
from kiln.launchers.slurm import SlurmLauncher, render_sbatch
from kiln.refs import TrainResult

BACKENDS = ("local", "slurm", "kubernetes")

__all__ = [
    "BACKENDS",
    "JobHandle",
    "JobStatus",
    "KubernetesLauncher",
    "LaunchPlan",
    "LaunchSpec",
    "Launcher",
    "LocalLauncher",
    "SlurmLauncher",
    "TrainingFaultError",
    "agent_argv",
    "cancel",
    "get_launcher",
    "launch",
    "launch_local",
    "read_result",
    "render_sbatch",
    "render_trainjob",
    "torchrun_argv",
    "wait",
]


def get_launcher(backend: str, **options: Any) -> Launcher:
    """The backend by name; ``options`` go to its constructor (slurm: partition, qos, ...;
    kubernetes: namespace, queue, shared_root, checkpoint_claim, ...)."""
    if backend == "local":
        if options:
            raise ConfigError(f"launcher 'local' takes no options, got {sorted(options)}")
        return LocalLauncher()
    if backend == "slurm":
        return SlurmLauncher(**options)
    if backend == "kubernetes":
        return KubernetesLauncher(**options)
    raise ConfigError(f"launcher backend must be one of {BACKENDS}, got {backend!r}")


def launch(spec: LaunchSpec, *, backend: str = "local", log: Callable[[str], None] = print,
           poll_s: float = 1.0, **options: Any) -> TrainResult:
    """Submit, stream the job's log through ``log`` until it ends, return its TrainResult."""
    launcher = get_launcher(backend, **options)
    handle = launcher.submit(spec)
    wait(launcher, handle, log=log, poll_s=poll_s)
    return launcher.result(handle)

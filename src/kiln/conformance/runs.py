"""The kit's runs: the trainer a recipe names, run the way kiln runs it, with kiln's faults injected.

Every run goes through kiln's own launch path: ``kiln.launchers.local`` (a torchrun agent per
"node" on this machine, kiln's worker on every rank, the supervisor, the straggler watch, the
elastic shrink after a lost node), except
the bad-manifest run, whose manifest that launcher would refuse before any worker starts: it runs
the launchers' torchrun line (``torchrun_argv``, what the Slurm backend runs on each node) directly,
so the refusal under test is the trainer's own. Faults come from the trainer contract's switches
(``CHECKPOINT_WRITE_DELAY_ENV``, ``FAULT_SLOW_*``), which the SDK honours, and SIGKILLs from here
(a worker mid-save; a whole node, agent and worker, mid-training).

Every rank gets one thread and the sample log (``KILN_SAMPLE_LOG=1``), and never an MLflow run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from kiln.conformance.checks import KillRecord, NodeLossRecord, RunOutcome
from kiln.errors import ConfigError
from kiln.launchers.base import JobHandle, LaunchSpec, torchrun_argv
from kiln.launchers.local import NODE_TAG_ENV, LocalLauncher, agent_env, agent_pids, kill_tagged, worker_pid
from kiln.runs import CHECKPOINTS_SUBDIR, LAUNCH_SUBDIR, RESULT_FILE
from kiln.util.fs import atomic_write_bytes, parse_own_json, read_own_json
from kiln.util.net import free_port
from kiln_trainer.contract import (
    CHECKPOINT_WRITE_DELAY_ENV,
    FAULT_SLOW_FROM_STEP_ENV,
    FAULT_SLOW_RANK_ENV,
    FAULT_SLOW_S_ENV,
    MANIFEST_NAME,
    MLFLOW_RUN_ID_ENV,
    MLFLOW_TRACKING_URI_ENV,
    SAMPLE_LOG_SUBDIR,
    THREADS_ENV,
    step_dir_name,
)
from kiln_trainer.contract.checkpoint_manifest import checkpoint_dirs
from kiln_trainer.contract.entrypoint import SAMPLE_LOG_ENV

R = TypeVar("R")
"""The record a strike returns (``KillRecord``, ``NodeLossRecord``)."""

RANK_ENV: dict[str, str] = {
    THREADS_ENV: "1",
    "OMP_NUM_THREADS": "1",
    SAMPLE_LOG_ENV: "1",
    MLFLOW_TRACKING_URI_ENV: "",
    MLFLOW_RUN_ID_ENV: "",
}
"""What every rank of every run gets: one thread (the same in every run, which bitwise identity
needs), the sample log (which samples each rank trained on), and no MLflow run to log into."""
POLL_S = 0.02
KILLED_NODE = 0
"""(a) kills this node's worker: any rank's death mid-save tears the save (rank 0 seals it; under
fsdp every rank writes its own shards). (e) loses this node whole: the first node, which on a naive
setup would take the rendezvous with it (kiln's supervisor hosts it)."""


class Runner:
    """Starts the kit's runs of one recipe and manifest, each in its own folder under ``work_dir``."""

    def __init__(self, *, recipe: Path, manifest: Path, work_dir: Path, overrides: tuple[str, ...],
                 env: Mapping[str, str], timeout_s: float) -> None:
        self.recipe = recipe
        self.manifest = manifest
        self.work_dir = work_dir
        self.overrides = overrides
        self.env = {**RANK_ENV, **env}
        self.timeout_s = timeout_s
        self._key = hashlib.sha256(str(work_dir).encode()).hexdigest()[:10]

    def spec(self, name: str, *, nodes: int, env: Mapping[str, str] | None = None, max_restarts: int = 0,
             manifest: Path | None = None, min_nodes: int | None = None, replacement_timeout_s: int = 60,
             spare_nodes: int | None = None) -> LaunchSpec:
        """The run ``name`` (its folder under ``work_dir``) on ``nodes`` one-rank nodes (``min_nodes``,
        ``replacement_timeout_s``, ``spare_nodes``: the launcher's elastic policy, ``LaunchSpec``)."""
        return LaunchSpec(run_dir=self.work_dir / name, manifest=manifest or self.manifest, recipe=self.recipe,
                          run_key=f"conformance-{name}-{self._key}", nodes=nodes, nproc_per_node=1,
                          max_restarts=max_restarts, overrides=self.overrides, env={**self.env, **(env or {})},
                          min_nodes=min_nodes, replacement_timeout_s=replacement_timeout_s, spare_nodes=spare_nodes)

    # -- through kiln's local launcher ---------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> RunOutcome:
        """Run ``spec`` to its end through the local launcher (cancelled after ``timeout_s``)."""
        started = time.monotonic()
        launcher = LocalLauncher()
        handle = launcher.submit(spec)
        return self._follow(launcher, handle, spec.run_dir, started)

    def _follow(self, launcher: LocalLauncher, handle: JobHandle, run_dir: Path, started: float) -> RunOutcome:
        deadline = started + self.timeout_s
        try:
            while not (status := launcher.poll(handle)).done:
                if time.monotonic() > deadline:
                    launcher.cancel(handle)
                    status = launcher.poll(handle)
                    break
                time.sleep(0.2)
        except BaseException:  # the kit is going away (Ctrl-C): never leave a gang running behind it
            launcher.cancel(handle)
            raise
        log, _ = launcher.logs(handle, 0)
        reason = status.reason or ("" if status.state != "CANCELLED" else f"cancelled after {self.timeout_s:.0f} s")
        return RunOutcome(run_dir=run_dir, state=status.state, reason=reason, log=log,
                          seconds=time.monotonic() - started)

    def _launch_and_strike(self, spec: LaunchSpec, strike: Callable[[], R | None]) -> tuple[RunOutcome, R | None]:
        """Run ``spec`` with the local launcher, calling ``strike`` every ``POLL_S`` until it returns a
        record (it has done its harm) or the job ends; then follow the job to its end."""
        started = time.monotonic()
        launcher = LocalLauncher()
        handle = launcher.submit(spec)
        struck: R | None = None
        deadline = started + self.timeout_s
        try:
            while time.monotonic() < deadline and not launcher.poll(handle).done:
                struck = strike()
                if struck is not None:
                    break
                time.sleep(POLL_S)
        except BaseException:  # the kit is going away (Ctrl-C): never leave a gang running behind it
            launcher.cancel(handle)
            raise
        return self._follow(launcher, handle, spec.run_dir, started), struck

    def launch_and_kill_mid_save(self, spec: LaunchSpec, *, committed_step: int, save_step: int) -> tuple[RunOutcome, KillRecord]:
        """Run ``spec`` (which widens the save window and allows one restart); once step
        ``committed_step`` is committed and the save of ``save_step`` has files but no manifest,
        SIGKILL node ``KILLED_NODE``'s worker, then follow the job (torchrun's restart) to its end."""
        run_dir = spec.run_dir
        committed = run_dir / CHECKPOINTS_SUBDIR / step_dir_name(committed_step) / MANIFEST_NAME
        saving = run_dir / CHECKPOINTS_SUBDIR / step_dir_name(save_step)

        def strike() -> KillRecord | None:
            if not (committed.exists() and _holds_files(saving) and not (saving / MANIFEST_NAME).exists()):
                return None
            pid = _worker_of_node(run_dir, KILLED_NODE, spec.nodes)
            if pid is None:
                return None
            os.kill(pid, signal.SIGKILL)
            torn = not (saving / MANIFEST_NAME).exists()  # else it committed first: inconclusive
            return KillRecord(save_step=save_step, torn=torn, node=KILLED_NODE, pid=pid,
                              committed_step=_newest_sealed(run_dir))

        outcome, kill = self._launch_and_strike(spec, strike)
        if kill is None:  # the moment never came: the judge reports it inconclusive
            kill = KillRecord(save_step=save_step, torn=False, committed_step=None, node=KILLED_NODE, pid=None)
        return outcome, kill

    def launch_and_lose_node(self, spec: LaunchSpec, *, committed_step: int) -> tuple[RunOutcome, NodeLossRecord]:
        """Run ``spec`` (an elastic one, nothing to replace a lost node, training kept going by a slowed
        rank); once every node's agent and worker are up and step ``committed_step`` is committed, while
        training goes on, SIGKILL node ``KILLED_NODE`` whole (its agent and its worker, at once), then
        follow the job (the launcher's shrink, the survivors' restart) to its end."""
        run_dir = spec.run_dir
        committed = run_dir / CHECKPOINTS_SUBDIR / step_dir_name(committed_step) / MANIFEST_NAME

        def strike() -> NodeLossRecord | None:
            if not committed.exists() or (run_dir / RESULT_FILE).exists():
                return None
            pids = _node_pids(run_dir, KILLED_NODE, spec.nodes)
            if pids is None:
                return None
            # The newest commit as the node goes (read first: a save the survivors seal after the kill
            # only moves the resume point later).
            sealed = _newest_sealed(run_dir)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return NodeLossRecord(node=KILLED_NODE, agent_pid=pids[0], worker_pid=pids[1], committed_step=sealed)

        outcome, loss = self._launch_and_strike(spec, strike)
        if loss is None:  # the moment never came: the judge reports it inconclusive
            loss = NodeLossRecord(node=KILLED_NODE, agent_pid=None, worker_pid=None, committed_step=None)
        return outcome, loss

    # -- torchrun directly ---------------------------------------------------------------------------

    def torchrun(self, spec: LaunchSpec) -> RunOutcome:
        """One node's torchrun line as the launchers write it, run here to its end (its processes
        tagged as the local launcher tags a node's, so a run past ``timeout_s`` is ended whole)."""
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = spec.run_dir.parent / f"{spec.run_dir.name}.log"
        tag = f"{spec.rdzv_id}.torchrun"
        started = time.monotonic()
        with open(log_path, "w") as log_file:
            try:
                done = subprocess.run(torchrun_argv(spec, f"127.0.0.1:{free_port()}"), stdin=subprocess.DEVNULL,
                                      stdout=log_file, stderr=subprocess.STDOUT, env={**agent_env(spec), NODE_TAG_ENV: tag},
                                      cwd=spec.run_dir, timeout=self.timeout_s, check=False)
                state, reason = f"EXITED {done.returncode}", ""
            except subprocess.TimeoutExpired:
                kill_tagged(tag)
                state, reason = "CANCELLED", f"cancelled after {self.timeout_s:.0f} s"
        return RunOutcome(run_dir=spec.run_dir, state=state, reason=reason, log=log_path.read_text(errors="replace"),
                          seconds=time.monotonic() - started)


def _holds_files(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def _node_pids(run_dir: Path, node: int, nodes: int) -> tuple[int, int] | None:
    """Node ``node``'s agent and worker pids, once every node's agent and worker are up."""
    worker = _worker_of_node(run_dir, node, nodes)
    agent = agent_pids(run_dir).get(str(node))
    return None if worker is None or agent is None else (agent, worker)


def _newest_sealed(run_dir: Path) -> int | None:
    """The newest step whose checkpoint manifest is written (committed), or None."""
    return max((step for step, step_dir in checkpoint_dirs(run_dir) if (step_dir / MANIFEST_NAME).exists()),
               default=None)


def _worker_of_node(run_dir: Path, node: int, nodes: int) -> int | None:
    """The pid of node ``node``'s worker, once every node's agent and worker are up. (Its rank is
    not known here: workers are forked from the agent, so their /proc environment is the agent's.)"""
    agents = agent_pids(run_dir)
    if len(agents) < nodes:
        return None
    workers = [worker_pid(pid) for pid in agents.values()]
    if any(pid is None for pid in workers):
        return None
    return worker_pid(agents[str(node)])


def resumable_copy(source: Path, target: Path, at_step: int) -> Path:
    """``source`` as it was right after its step-``at_step`` checkpoint: later checkpoints, the result,
    the launchers' state and the sample-log lines of later steps left out."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(LAUNCH_SUBDIR))
    for step_dir in (target / CHECKPOINTS_SUBDIR).glob("step-*"):
        if step_dir.name > step_dir_name(at_step):
            shutil.rmtree(step_dir)
    (target / RESULT_FILE).unlink(missing_ok=True)
    for log in (target / SAMPLE_LOG_SUBDIR).glob("*.jsonl"):
        kept = [line for line in log.read_text(encoding="utf-8").splitlines()
                if line.strip() and int(parse_own_json(line, str(log))["step"]) < at_step]
        log.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    return target


def edited_manifest(manifest: Path, target: Path) -> Path:
    """A copy of ``manifest`` whose snapshot id was changed after it was issued: its declared
    ``sha256`` no longer matches its content."""
    body = read_own_json(manifest)
    if not isinstance(body, dict) or "snapshot_id" not in body or "sha256" not in body:
        raise ConfigError(f"{manifest} is not a TrainingManifest (no snapshot_id or sha256)")
    body["snapshot_id"] = f"edited-{body['snapshot_id']}"
    atomic_write_bytes(target, json.dumps(body, indent=1).encode("utf-8"))
    return target


def slow_rank_env(rank: int, seconds: float, from_step: int) -> dict[str, str]:
    return {FAULT_SLOW_RANK_ENV: str(rank), FAULT_SLOW_S_ENV: str(seconds), FAULT_SLOW_FROM_STEP_ENV: str(from_step)}


def write_delay_env(seconds: float) -> dict[str, str]:
    return {CHECKPOINT_WRITE_DELAY_ENV: str(seconds)}

"""The slurm backend against a real 3-node Slurm cluster on localhost (kiln_devtools.slurm_cluster).

Needs Debian's slurm-wlm + munge (``make system-deps``) and root; skipped, with that reason, where
``slurm_unavailable()`` names one.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.errors import TrainingFaultError
from kiln.launchers import JobHandle, LaunchPlan, LaunchSpec, SlurmLauncher, get_launcher, launch, wait
from kiln_devtools.slurm_cluster import PARTITION, SlurmCluster, slurm_unavailable, start_cluster, stop_cluster

from training_manifests import stdlib_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(slurm_unavailable() is not None, reason=f"no local Slurm: {slurm_unavailable()}"),
]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_manifest(tmp_path_factory.mktemp("corpus"), max_chars=200_000)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    # Three nodes: 2-node jobs, and a spare node for a job that excludes a straggler's node.
    handle = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        yield handle
    finally:
        stop_cluster(handle)


def _launcher(cluster: SlurmCluster) -> SlurmLauncher:
    return get_launcher("slurm", partition=PARTITION, env={**cluster.env})  # type: ignore[return-value]


def _spec(run_dir: Path, manifest: Path, *overrides: str) -> LaunchSpec:
    return LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=TINY, run_key=f"slurm-{run_dir.parent.name}",
                      nodes=2, max_restarts=1,
                      overrides=("train.steps=60", "checkpoint.every_steps=10", "train.log_every=10", *overrides),
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def uninterrupted(cluster, manifest, tmp_path_factory) -> tuple[object, list[str], Path]:
    run_dir = tmp_path_factory.mktemp("slurm-ref") / "run"
    lines: list[str] = []
    result = launch(_spec(run_dir, manifest), backend="slurm", log=lines.append, poll_s=0.5,
                    partition=PARTITION, env=cluster.env)
    return result, lines, run_dir


def test_two_node_job_runs_through_the_slurm_backend(uninterrupted):
    from kiln_trainer.checkpoint_manifest import verify_checkpoint

    result, lines, run_dir = uninterrupted
    assert result.completed and result.step == 60 and result.world_size == 2
    verify_checkpoint(result.checkpoint)
    log_text = "\n".join(lines)
    assert "on node[1-2]" in log_text, log_text[-2000:]  # one agent on each Slurm node
    script = (run_dir / ".launch" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"#SBATCH --partition={PARTITION}" in script


def _job_rank_workers(cluster: SlurmCluster, job_id: str) -> dict[int, int]:
    """Rank -> pid of the job's trainer processes: the children of its torchrun agents. A job is
    known by its id and its cluster's ``SLURM_CONF`` (job ids of two test clusters overlap).

    Not "the highest pid whose command line names kiln.launchers.worker": the job's srun and its
    torchrun agents name that module too (it is torchrun's entry point), and pids wrap at
    ``kernel.pid_max`` (32768 on the test machines; a whole ``make test`` starts more processes than
    that), so the highest pid was at times an agent. A SIGKILLed agent ends its srun task
    ("srun: error: node2: task 1: Killed"), ``--kill-on-bad-exit`` cancels the step and the job
    ends FAILED: a lost node, not the lost worker this test is about."""
    procs: dict[int, tuple[int, bytes, bytes]] = {}  # pid -> (parent, cmdline, environ)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes() + b"\0"
                tags = (f"SLURM_JOB_ID={job_id}\0".encode(), f"SLURM_CONF={cluster.conf}\0".encode())
                if not all(tag in environ for tag in tags):
                    continue
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                procs[int(entry.name)] = (parent, (entry / "cmdline").read_bytes(), environ)
            except (OSError, ValueError, IndexError):
                continue
    agents = {pid for pid, (_, cmdline, _) in procs.items() if b"torch.distributed.run" in cmdline}
    workers: dict[int, int] = {}
    for pid, (parent, cmdline, environ) in procs.items():
        if parent in agents and pid not in agents and b"kiln.launchers.worker" in cmdline:
            rank = next(v for k, _, v in (kv.partition(b"=") for kv in environ.split(b"\0")) if k == b"RANK")
            workers[int(rank)] = pid
    return workers


def _submitted_past_first_checkpoint(cluster: SlurmCluster, manifest: Path, run_dir: Path):
    """A 60-step 2-node job, submitted and followed until its step-10 checkpoint is committed (the
    trigger of the kills below: a checkpoint on disk, never elapsed time)."""
    launcher = _launcher(cluster)
    spec = _spec(run_dir, manifest)
    handle = launcher.submit(spec)
    deadline = time.monotonic() + 120  # safety net, not a timing assertion
    while not (spec.run_dir / "checkpoints" / "step-00000010" / "manifest.json").exists():
        assert time.monotonic() < deadline and not launcher.poll(handle).done, launcher.logs(handle)[0][-2000:]
        time.sleep(0.02)
    return launcher, spec, handle


def test_worker_killed_in_a_slurm_job_restarts_the_group_to_identical_weights(uninterrupted, cluster, manifest, tmp_path):
    import os
    import signal

    reference = uninterrupted[0]
    launcher, spec, handle = _submitted_past_first_checkpoint(cluster, manifest, tmp_path / "run")
    workers = _job_rank_workers(cluster, handle.job_id)
    assert sorted(workers) == [0, 1], workers  # one trainer per node, each under its node's torchrun agent
    os.kill(workers[1], signal.SIGKILL)
    lines: list[str] = []
    status = wait(launcher, handle, log=lines.append, poll_s=0.5)
    assert status.state == "SUCCEEDED", "\n".join(lines)[-3000:]
    assert "resumed from" in "\n".join(lines)
    assert launcher.result(handle).weights_sha256 == reference.weights_sha256


def _trigger(cluster: SlurmCluster, handle, poll_s: float = 0.5):
    from kiln.airflow.triggers import LaunchedJobTrigger

    # Only SLURM_CONF, as a DAG's trigger carries it (the tools get it added to their environment).
    return LaunchedJobTrigger(handle=handle.to_json(), backend="slurm", poll_s=poll_s,
                              options={"partition": PARTITION, "env": {"SLURM_CONF": str(cluster.conf)}})


def _first_event(trigger) -> dict:
    import asyncio

    async def first():
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout=300))  # safety net, not a timing assertion


def test_killing_the_deferred_task_cancels_the_job_with_scancel(cluster, manifest, tmp_path):
    """The trigger's on_kill (a user kills the deferred train task) ends the Slurm job."""
    import asyncio

    launcher = _launcher(cluster)
    spec = _spec(tmp_path / "run", manifest, "train.steps=100000")
    handle = launcher.submit(spec)
    deadline = time.monotonic() + 120  # safety net, not a timing assertion
    while not list((spec.run_dir / "checkpoints").glob("step-*/manifest.json")):
        assert time.monotonic() < deadline, launcher.logs(handle)[0][-2000:]
        assert not launcher.poll(handle).done, launcher.logs(handle)[0][-2000:]
        time.sleep(0.2)
    asyncio.run(_trigger(cluster, handle).on_kill())
    status = wait(launcher, handle, log=lambda _line: None, poll_s=0.5)
    assert status.state == "CANCELLED", status
    queue = subprocess.run(["squeue", "-h", "-j", handle.job_id], capture_output=True, text=True, env=cluster.env)
    assert queue.stdout.strip() == ""


def test_a_failed_runs_live_job_is_cancelled_by_the_dag_failure_callback(cluster, manifest):
    """A deferred task killed before a triggerer picked its trigger up gets no on_kill: the DAG's
    failure callback finds the job the run submitted (the launch folder's job record) and ends it."""
    from types import SimpleNamespace

    from kiln.airflow.dagfactory import end_orphaned_job
    from kiln.runs import JOB_RECORD, run_dir
    from kiln.stages import cancel_live_job, submit_train

    dag_id, run_id = "kiln_sandbox", f"manual__orphan-{time.time_ns()}"
    spec = _spec(run_dir(f"{dag_id}/{run_id}") / "train", manifest, "train.steps=100000")
    plan = LaunchPlan(spec=spec, backend="slurm", options={"partition": PARTITION, "env": {"SLURM_CONF": str(cluster.conf)}})
    handle = submit_train(plan)
    assert (spec.launch_dir / JOB_RECORD).is_file()
    launcher = _launcher(cluster)
    deadline = time.monotonic() + 120  # safety net, not a timing assertion
    while launcher.poll(handle).state != "RUNNING":
        assert time.monotonic() < deadline and not launcher.poll(handle).done, launcher.logs(handle)[0][-2000:]
        time.sleep(0.2)
    end_orphaned_job({"dag": SimpleNamespace(dag_id=dag_id), "run_id": run_id})
    status = wait(launcher, handle, log=lambda _line: None, poll_s=0.5)
    assert status.state == "CANCELLED", status
    assert cancel_live_job(f"{dag_id}/{run_id}") is None  # an ended job is left as it is
    assert cancel_live_job(f"{dag_id}/manual__never-trained") is None  # nothing submitted: nothing to do


def test_trainer_fault_is_fatal_on_slurm_and_the_trigger_says_why(cluster, tmp_path):
    """Waited for the way the DAG waits (the deferrable trigger): one FATAL event naming the rank and
    the trainer's error, with the job log's tail; the result is a non-retryable TrainingFaultError.
    The fault: a shard whose bytes no longer match the manifest (a bad recipe never reaches sbatch)."""
    import json

    (tmp_path / "data").mkdir()
    tampered = stdlib_manifest(tmp_path / "data", max_chars=50_000)
    shard = Path(json.loads(tampered.read_text())["shards"][0]["path"])
    shard.write_bytes(shard.read_bytes() + b"\0")
    launcher = _launcher(cluster)
    handle = launcher.submit(_spec(tmp_path / "run", tampered))
    event = _first_event(_trigger(cluster, handle))
    assert event["state"] == "FATAL" and "exited 2" in event["reason"], event
    assert event["handle"] == handle.to_json() and event["log_tail"], event
    with pytest.raises(TrainingFaultError, match="exited 2") as info:
        launcher.result(handle)
    assert info.value.retryable is False


def test_resubmit_excluding_a_node_moves_the_job_and_resumes(cluster, manifest, tmp_path):
    """The straggler hook: the job is ended and resubmitted with --exclude=<its node>; the new job runs
    on the other node and resumes from the last committed checkpoint."""
    import re

    from kiln.launchers.slurm import resubmit_excluding

    launcher = _launcher(cluster)
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=manifest, recipe=TINY, run_key="slurm-exclude", nodes=1,
                      overrides=("train.steps=60", "checkpoint.every_steps=10", "train.log_every=10"),
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"})
    handle = launcher.submit(spec)
    deadline = time.monotonic() + 180  # safety net, not a timing assertion
    while not list((spec.run_dir / "checkpoints").glob("step-*/manifest.json")):
        assert time.monotonic() < deadline and not launcher.poll(handle).done, launcher.logs(handle)[0][-2000:]
        time.sleep(0.2)

    def node_of(job_id: str) -> str:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=cluster.env)
        return re.search(r" NodeList=(\S+)", out.stdout).group(1)

    slow = node_of(handle.job_id)
    moved, new_handle = resubmit_excluding(launcher, handle, slow)
    assert new_handle.job_id != handle.job_id and f"--exclude={slow}" in (spec.launch_dir / "job.sbatch").read_text()
    assert launcher.poll(handle).state == "CANCELLED"  # moved mid-run, not after it had finished
    lines: list[str] = []
    status = wait(moved, new_handle, log=lines.append, poll_s=0.5)
    assert status.state == "SUCCEEDED", "\n".join(lines)[-3000:]
    assert node_of(new_handle.job_id) not in (slow, "(null)")
    assert "resumed from" in "\n".join(lines)
    assert moved.result(new_handle).step == 60


def test_a_lost_node_fails_the_job_retryably_and_the_retry_resumes_to_identical_weights(
        uninterrupted, cluster, manifest, tmp_path):
    """A whole node lost mid-job (set DOWN, as slurmctld does with a node that stops answering):
    Slurm ends the job NODE_FAIL and the launcher fails it retryably, naming that state; the task's
    retry submits the same spec again and the new job resumes from the last committed checkpoint to
    the uninterrupted run's weights. (With ``requeue=True`` Slurm would restart the job itself, but
    only after its requeue delay of about two minutes; the retry's is 20 s.)"""
    from kiln.errors import LaunchError

    reference = uninterrupted[0]
    launcher, spec, handle = _submitted_past_first_checkpoint(cluster, manifest, tmp_path / "run")
    nodes = subprocess.run(["squeue", "-h", "-j", handle.job_id, "-o", "%N"], capture_output=True, text=True,
                           env=cluster.env).stdout.strip()
    lost = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                          env=cluster.env).stdout.split()[-1]
    subprocess.run(["scontrol", "update", f"NodeName={lost}", "State=DOWN", "Reason=kiln-test-node-loss"],
                   check=True, capture_output=True, env=cluster.env)
    try:
        first: list[str] = []
        status = wait(launcher, handle, log=first.append, poll_s=0.5)
        assert status.state == "FAILED" and "NODE_FAIL" in status.reason, (status, "\n".join(first)[-2000:])
        with pytest.raises(LaunchError, match="NODE_FAIL") as info:
            launcher.result(handle)
        assert info.value.retryable
        retry = launcher.submit(spec)
        assert retry.job_id != handle.job_id
        lines: list[str] = []
        status = wait(launcher, retry, log=lines.append, poll_s=0.5)
        assert status.state == "SUCCEEDED", "\n".join(lines)[-3000:]
        assert "resumed from" in "\n".join(lines)
        assert launcher.result(retry).weights_sha256 == reference.weights_sha256
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={lost}", "State=RESUME"], capture_output=True,
                       env=cluster.env)


def _wait_all_idle(cluster: SlurmCluster, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # safety net, not a timing assertion
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=cluster.env)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        if states and all(v.startswith("idle") for v in states.values()):
            return
        assert time.monotonic() < deadline, out.stdout
        time.sleep(0.5)


def test_a_slow_node_is_excluded_and_the_job_resumes_on_the_others_to_identical_weights(
        uninterrupted, cluster, manifest, tmp_path, monkeypatch):
    """Policy ``straggler_action = exclude_node``, through the train task's own code (no scheduler):
    node2 is throttled (``KILN_FAULT_SLOW_NODE``: every rank there sleeps 0.5 s a step from step 11);
    the trainer flags its rank; the trigger the task defers on fires STRAGGLER naming node2;
    ``TrainOperator.execute_complete`` ends the job, resubmits it with ``--exclude=node2`` and defers
    again; the new job resumes from the last committed checkpoint on node1 + node3 and ends with the
    uninterrupted run's weights."""
    from airflow.sdk.exceptions import TaskDeferred
    from mlflow.tracking import MlflowClient

    from kiln.airflow.dagfactory import TrainOperator
    from kiln.policy import SANDBOX
    from kiln.runs import SLURM_EXCLUDED_NODES
    from kiln.stages import straggler_watch

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = MlflowClient(tracking_uri=uri)
    mlflow_run_id = runs.create_run(runs.create_experiment("s", artifact_location=str(tmp_path / "a"))).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    policy = SANDBOX.with_launcher({"launcher": "slurm", "slurm_partition": PARTITION, "slurm_conf": str(cluster.conf),
                                    "straggler_action": "exclude_node"}, "test")
    spec = _spec(tmp_path / "run", manifest, "stragglers.every_steps=5", "stragglers.factor=3.0", "stragglers.windows=3")
    spec = LaunchSpec.from_json({**spec.to_json(), "env": {**spec.env, "KILN_FAULT_SLOW_NODE": "node2",
                                                           "KILN_FAULT_SLOW_S": "0.5", "KILN_FAULT_SLOW_FROM_STEP": "11"}})
    plan = LaunchPlan(spec=spec, backend="slurm", options=policy.launcher_options(), mlflow_run_id=mlflow_run_id)
    _wait_all_idle(cluster)  # the 2-node job lands on node[1-2]: node2 is one of its nodes
    first = SlurmLauncher(**plan.options).submit(spec)
    task = TrainOperator(task_id="train", policy=policy, snapshot={}, data={}, poll_s=0.5)

    with pytest.raises(TaskDeferred) as deferred:  # what execute() does after sbatch
        task._defer_on(plan, first, straggler_watch(policy, plan))
    event = _first_event(deferred.value.trigger)
    assert event["state"] == "STRAGGLER" and event["node"] == "node2", event
    assert "exclude node node2" in event["reason"]

    with pytest.raises(TaskDeferred) as again:
        task.execute_complete({}, event, plan=deferred.value.kwargs["plan"])
    moved_plan, trigger = again.value.kwargs["plan"], again.value.trigger
    assert trigger.handle["job_id"] != first.job_id and first.job_id not in (spec.launch_dir / "slurm-job-id").read_text()
    assert moved_plan["options"]["exclude"] == ["node2"] and trigger.stragglers["excluded"] == ["node2"]
    assert "#SBATCH --exclude=node2" in (spec.launch_dir / "job.sbatch").read_text()
    assert (spec.launch_dir / SLURM_EXCLUDED_NODES).read_text() == '["node2"]'
    assert runs.get_run(mlflow_run_id).data.tags["kiln.straggler.excluded_nodes"] == "node2"

    final = _first_event(trigger)
    assert final["state"] == "SUCCEEDED", final
    new = JobHandle.from_json(trigger.handle)
    log_text = (spec.launch_dir / f"slurm-{new.job_id}.log").read_text()
    assert "on node[1,3]" in log_text, log_text[-2000:]
    assert "resumed from" in log_text, log_text[-3000:]
    result = SlurmLauncher(**moved_plan["options"]).result(new)
    assert result.step == 60 and result.world_size == 2
    assert result.weights_sha256 == uninterrupted[0].weights_sha256

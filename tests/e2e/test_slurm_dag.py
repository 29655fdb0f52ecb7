"""The sandbox DAG training on a real 2-node Slurm cluster, under the real scheduler and triggerer.

The deployment setting ``kiln_sandbox_launcher`` (an Airflow Variable, read when the train task
starts: ``kiln.airflow.dagfactory.LAUNCHER_VARIABLE``) points the sandbox policy's training at the test's
Slurm cluster; no test-only code path exists in kiln. The train task submits with ``sbatch``, defers
(the triggerer polls squeue/scontrol), resumes with the TrainResult; evaluation and registration
follow as usual. A second run's deferred train task is killed (marked failed through the REST API,
as a user would in the UI): the trigger's ``on_kill`` cancels its Slurm job. The Variable is removed
afterwards, so the next train task runs on the local launcher again.

Needs Debian's slurm-wlm + munge and root (``kiln_devtools.slurm_cluster.slurm_unavailable``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln_devtools.slurm_cluster import PARTITION, SlurmCluster, slurm_unavailable, start_cluster, stop_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(slurm_unavailable() is not None, reason=f"no local Slurm: {slurm_unavailable()}"),
]

VARIABLE = "kiln_sandbox_launcher"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    handle = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield handle
    finally:
        stop_cluster(handle)


@pytest.fixture(scope="module")
def slurm_sandbox(stack, admin, cluster) -> Iterator[str]:
    from kiln.policy import SANDBOX

    admin.wait_for_dag(SANDBOX.dag_id)
    setting = {"launcher": "slurm", "slurm_partition": PARTITION, "slurm_conf": str(cluster.conf)}
    admin.request("POST", "/variables", json={"key": VARIABLE, "value": json.dumps(setting)}, ok=(200, 201))
    try:
        yield SANDBOX.dag_id  # read by each train task when it starts: no re-parse to wait for
    finally:
        admin.request("DELETE", f"/variables/{VARIABLE}", ok=(200, 204, 404))  # later tests train locally


def _task(admin, dag_id: str, run_id: str, task_id: str) -> dict:
    """The task instance; an api-server slow to answer on a loaded machine reads as "not yet"."""
    import requests

    try:
        return next((t for t in admin.task_instances(dag_id, run_id) if t["task_id"] == task_id), {"state": None})
    except requests.RequestException:
        return {"state": None}


def _partition(cluster: SlurmCluster, state: str) -> None:
    """DOWN: Slurm still queues submitted jobs but starts none; UP: it starts them."""
    import subprocess

    subprocess.run(["scontrol", "update", f"PartitionName={PARTITION}", f"State={state}"],
                   check=True, capture_output=True, env=cluster.env)


@pytest.fixture(scope="module")
def runs(stack, admin, slurm_sandbox, cluster) -> dict[str, str]:
    """Two runs started together while the partition is DOWN, so both Slurm jobs are queued and
    neither can finish before the kill test has cancelled one: one run whose deferred train task is
    killed, one followed to the end once the partition is UP again."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX

    corpus = kiln_settings.load().corpus_root / SANDBOX.corpus
    if not corpus.is_dir():  # the sandbox e2e test may have built it already
        build_corpus(corpus, shards=4, seed=11)
    _partition(cluster, "DOWN")
    admin.unpause(slurm_sandbox)
    conf = {"recipe": "tiny.toml", "max_steps": 20, "nodes": 2}
    return {"follow": admin.trigger(slurm_sandbox, conf={**conf, "seed": 3})["dag_run_id"],
            "kill": admin.trigger(slurm_sandbox, conf={**conf, "seed": 4})["dag_run_id"]}


def test_killing_the_deferred_train_task_cancels_its_slurm_job(stack, admin, slurm_sandbox, cluster, runs):
    """Marking the deferred task failed (a user's kill) runs the trigger's on_kill: scancel."""
    import subprocess

    from kiln.runs import run_dir

    run_id = runs["kill"]
    try:
        deadline = time.monotonic() + 600  # safety net, not a timing assertion
        while (ti := _task(admin, slurm_sandbox, run_id, "train"))["state"] != "deferred":
            assert ti["state"] not in ("failed", "upstream_failed", "success") and time.monotonic() < deadline, ti
            time.sleep(2)
        job_id = (run_dir(f"{slurm_sandbox}/{run_id}") / "train" / ".launch" / "slurm-job-id").read_text().strip()

        def slurm_state() -> str:
            out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                                 env=cluster.env)
            return (out.stdout.split("JobState=", 1)[1].split()[0]) if "JobState=" in out.stdout else "UNKNOWN"

        # Queued behind the DOWN partition, the job cannot end on its own before the kill lands.
        assert slurm_state() == "PENDING", slurm_state()
        # on_kill runs in the triggerer that runs the trigger: kill once the trigger is polling (a
        # task killed before that is the DAG failure callback's, tests/integration/test_slurm.py).
        deadline = time.monotonic() + 180  # safety net, not a timing assertion
        while f"slurm job {job_id}: PENDING" not in admin.task_log(slurm_sandbox, run_id, "train"):
            assert time.monotonic() < deadline, admin.task_log(slurm_sandbox, run_id, "train")[-3000:]
            time.sleep(1)
        admin.request("PATCH", f"/dags/{slurm_sandbox}/dagRuns/{run_id}/taskInstances/train",
                      json={"new_state": "failed"})
        deadline = time.monotonic() + 180  # safety net, not a timing assertion
        while (state := slurm_state()) != "CANCELLED":
            assert time.monotonic() < deadline, f"slurm job {job_id} is {state} after its deferred task was killed"
            time.sleep(1)
        log = admin.task_log(slurm_sandbox, run_id, "train")
        assert f"cancelled slurm job {job_id}" in log, log[-3000:]  # by the trigger's on_kill
    finally:
        _partition(cluster, "UP")  # the other run's job may start now


def test_sandbox_dag_trains_on_two_slurm_nodes_through_a_deferred_task(stack, admin, slurm_sandbox, cluster, runs):
    from kiln.runs import run_dir
    from kiln.stack.demo import follow_run

    run_id = runs["follow"]
    _partition(cluster, "UP")  # already UP when the kill test ran first
    progress: list[str] = []
    final = follow_run(admin, slurm_sandbox, run_id, timeout=780, progress=lambda line: (progress.append(line), print(line)))
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(slurm_sandbox, run_id)}
    assert final["state"] == "success", (states, progress)

    train = admin.xcom(slurm_sandbox, run_id, "train")
    assert train["completed"] and train["world_size"] == 2 and train["step"] == 20, train
    launch_dir = run_dir(f"{slurm_sandbox}/{run_id}") / "train" / ".launch"
    script = (launch_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"#SBATCH --partition={PARTITION}" in script
    job_id = (launch_dir / "slurm-job-id").read_text().strip()
    job_log = (launch_dir / f"slurm-{job_id}.log").read_text()
    assert "on node[1-2]" in job_log, job_log[-2000:]  # one torchrun agent on each Slurm node
    log = admin.task_log(slurm_sandbox, run_id, "train", try_number=1)
    assert f"launcher in force: slurm {{'slurm_partition': '{PARTITION}'" in log, log[-3000:]
    assert f"from Airflow Variable {VARIABLE}" in log, log[-3000:]
    assert f"submitted slurm job {job_id}" in log and "deferring until it ends" in log, log[-3000:]
    # Written by execute_complete, which only runs when the trigger's event resumes the task: the
    # triggerer, not a worker slot, waited for the Slurm job.
    assert f"slurm job {job_id} ended: SUCCEEDED" in log, log[-3000:]
    assert admin.xcom(slurm_sandbox, run_id, "evaluate")["weights_sha256"] == train["weights_sha256"]
    assert Path(train["checkpoint"]).is_relative_to(launch_dir.parent)

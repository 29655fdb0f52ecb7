"""The sandbox DAG training on a real 2-node Slurm cluster, under the real scheduler and triggerer.

The deployment setting ``kiln_sandbox_launcher`` (an Airflow Variable, read when the DAG file is
parsed: ``kiln.dagfactory.LAUNCHER_VARIABLE``) points the sandbox policy's training at the test's
Slurm cluster; no test-only code path exists in kiln. The train task submits with ``sbatch``, defers
(the triggerer polls squeue/scontrol), resumes with the TrainResult; evaluation and registration
follow as usual. The Variable is removed afterwards and the DAG is back on the local launcher.

Needs Debian's slurm-wlm + munge and root (``kiln.slurm_cluster.slurm_unavailable``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.slurm_cluster import PARTITION, SlurmCluster, slurm_unavailable, start_cluster, stop_cluster

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


def _launcher_in_force(admin, dag_id: str) -> str:
    doc = admin.request("GET", f"/dags/{dag_id}/details").get("doc_md") or ""
    for line in doc.splitlines():
        if line.startswith("| `launcher` |"):
            return line.split("`")[3]
    return ""


def _wait_for_launcher(admin, dag_id: str, launcher: str, timeout: float = 180) -> None:
    """Until the dag-processor has re-parsed the DAG file with the Variable's setting."""
    deadline = time.monotonic() + timeout
    while (seen := _launcher_in_force(admin, dag_id)) != launcher:
        assert time.monotonic() < deadline, f"{dag_id} still parsed with launcher {seen!r}, not {launcher!r}"
        time.sleep(2)


@pytest.fixture(scope="module")
def slurm_sandbox(stack, admin, cluster) -> Iterator[str]:
    from kiln.policy import SANDBOX

    admin.wait_for_dag(SANDBOX.dag_id)
    setting = {"launcher": "slurm", "slurm_partition": PARTITION, "slurm_conf": str(cluster.conf)}
    admin.request("POST", "/variables", json={"key": VARIABLE, "value": json.dumps(setting)}, ok=(200, 201))
    try:
        _wait_for_launcher(admin, SANDBOX.dag_id, "slurm")
        yield SANDBOX.dag_id
    finally:
        admin.request("DELETE", f"/variables/{VARIABLE}", ok=(200, 204, 404))
        _wait_for_launcher(admin, SANDBOX.dag_id, "local")  # later tests get the stock sandbox DAG


def test_sandbox_dag_trains_on_two_slurm_nodes_through_a_deferred_task(stack, admin, slurm_sandbox, cluster):
    from kiln import settings as kiln_settings
    from kiln.corpus import build_corpus
    from kiln.demo import follow_run
    from kiln.pipeline import run_dir
    from kiln.policy import SANDBOX

    s = kiln_settings.load()
    corpus = s.corpus_root / SANDBOX.corpus
    if not corpus.is_dir():  # the sandbox e2e test may have built it already
        build_corpus(corpus, shards=4, seed=11)
    admin.unpause(slurm_sandbox)
    run = admin.trigger(slurm_sandbox, conf={"recipe": "tiny.toml", "max_steps": 20, "nodes": 2, "seed": 3})
    run_id = run["dag_run_id"]
    progress: list[str] = []
    final = follow_run(admin, slurm_sandbox, run_id, timeout=780, progress=lambda line: (progress.append(line), print(line)))
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(slurm_sandbox, run_id)}
    assert final["state"] == "success", (states, progress)
    # The train task really deferred: the triggerer, not a worker slot, waited for the Slurm job.
    assert any(" train " in f" {line} " and line.rstrip().endswith("deferred") for line in progress), progress

    train = admin.xcom(slurm_sandbox, run_id, "train")
    assert train["completed"] and train["world_size"] == 2 and train["step"] == 20, train
    launch_dir = run_dir(f"{slurm_sandbox}/{run_id}") / "train" / ".launch"
    script = (launch_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"#SBATCH --partition={PARTITION}" in script
    job_id = (launch_dir / "slurm-job-id").read_text().strip()
    job_log = (launch_dir / f"slurm-{job_id}.log").read_text()
    assert "on node[1-2]" in job_log, job_log[-2000:]  # one torchrun agent on each Slurm node
    log = admin.task_log(slurm_sandbox, run_id, "train", try_number=1)
    assert f"submitted slurm job {job_id}" in log and "deferring until it ends" in log, log[-3000:]
    assert f"slurm job {job_id} ended: SUCCEEDED" in log, log[-3000:]
    assert admin.xcom(slurm_sandbox, run_id, "evaluate")["weights_sha256"] == train["weights_sha256"]
    assert Path(train["checkpoint"]).is_relative_to(launch_dir.parent)

"""Elastic shrink on a real 2-node Slurm cluster on localhost (kiln_devtools.slurm_cluster).

A 2-node job with ``min_nodes=1`` loses a whole node after its step-10 checkpoint
(``kiln_devtools.slurm_cluster.lose_node``: its slurmd and the job's processes there SIGKILLed, the
node DOWN): Slurm ends the job ``NODE_FAIL``. The next submission (what the train task's retry
does) finds fewer nodes up than the job asks for, waits ``replacement_timeout_s`` for them, and then:

* from a launcher that also excludes the other node (0 up), refuses to go on below ``min_nodes``:
  ``LaunchError`` naming it, nothing submitted;
* with the other node (1 up), goes in on that node: the new job's log starts with the launcher's line, the
  shrink is recorded, and the trainer resumes from the last committed checkpoint at world size 1
  and completes (``world_size_change`` 2 -> 1).

The final weights' tolerance against an uninterrupted 2-node run is ``test_elastic_local.py``'s
(same trainer, same resume); a second 2-node Slurm run here would cost more than the suite allows.

Needs Debian's slurm-wlm + munge (``make system-deps``) and root; skipped where
``slurm_unavailable()`` names why not.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.errors import LaunchError
from kiln.launchers import LaunchSpec, SlurmLauncher, wait
from kiln.launchers.elastic import recorded_shrinks
from kiln_devtools.slurm_cluster import (
    PARTITION,
    SlurmCluster,
    lose_node,
    slurm_unavailable,
    start_cluster,
    stop_cluster,
)

from training_manifests import stdlib_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(slurm_unavailable() is not None, reason=f"no local Slurm: {slurm_unavailable()}"),
]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
STEPS = 40
TIMEOUT_S = 2
"""The replacement timeout: short, as the test decides when nodes come back."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    handle = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        yield handle
    finally:
        stop_cluster(handle)


def _scontrol(cluster: SlurmCluster, *args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, env=cluster.env).stdout


def test_a_node_fail_resubmits_on_the_nodes_left_and_never_below_min_nodes(cluster, tmp_path):
    (tmp_path / "corpus").mkdir()
    manifest = stdlib_manifest(tmp_path / "corpus", max_chars=150_000)
    launcher = SlurmLauncher(partition=PARTITION, env={**cluster.env})
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=manifest, recipe=TINY, run_key="slurm-elastic", nodes=2,
                      max_restarts=1, min_nodes=1, replacement_timeout_s=TIMEOUT_S,
                      overrides=(f"train.steps={STEPS}", "checkpoint.every_steps=10", "train.log_every=10",
                                 "optim.warmup_steps=10"),
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"})
    first = launcher.submit(spec)
    deadline = time.monotonic() + 180  # safety net, not a timing assertion
    while not (spec.run_dir / "checkpoints" / "step-00000010" / "manifest.json").exists():
        assert time.monotonic() < deadline and not launcher.poll(first).done, launcher.logs(first)[0][-2000:]
        time.sleep(0.05)
    nodes = _scontrol(cluster, "show", "hostnames", _scontrol(cluster, "show", "job", first.job_id)
                      .split(" NodeList=")[1].split()[0]).split()
    assert nodes == ["node1", "node2"]
    lost, left = nodes  # the first node: its batch script and srun die with it
    assert lose_node(cluster, lost)
    status = wait(launcher, first, log=lambda _line: None, poll_s=0.5)
    assert status.state == "FAILED" and "NODE_FAIL" in status.reason, status

    # A launcher that also excludes the node left (a straggler's, say): 0 nodes up, below min_nodes=1.
    # It waits replacement_timeout_s for nodes, then refuses; nothing is submitted.
    with pytest.raises(LaunchError, match=rf"NODE_FAIL and after replacement_timeout_s={TIMEOUT_S} s only 0 "
                                          rf"node\(s\) of partition {PARTITION} up: none, fewer than min_nodes=1"):
        SlurmLauncher(partition=PARTITION, env={**cluster.env}, exclude=(left,)).submit(spec)
    assert (spec.launch_dir / "slurm-job-id").read_text() == first.job_id and not recorded_shrinks(spec.run_dir)

    # The retry: one node up, within min_nodes: the job goes on there.
    retry = launcher.submit(spec)
    assert retry.job_id != first.job_id
    script = (spec.launch_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in script and "--nnodes=1 " in script
    assert launcher.submit(spec) == retry  # a second retry re-attaches to the shrunk job, never cancels it
    lines: list[str] = []
    status = wait(launcher, retry, log=lines.append, poll_s=0.5)
    log_text = "\n".join(lines)
    assert status.state == "SUCCEEDED", log_text[-3000:]

    assert lines[0].startswith(f"[launcher] a node of slurm job {first.job_id} (NODE_FAIL) lost, no replacement within "
                               f"{TIMEOUT_S} s (1 node(s) of partition {PARTITION} up: {left}): shrunk 2 -> 1 node(s)"), lines[:3]
    assert f"on {left}" in log_text and "resumed at world size 1 from a checkpoint of world size 2" in log_text
    [shrink] = recorded_shrinks(spec.run_dir)
    assert (shrink.backend, shrink.job_id, shrink.from_nodes, shrink.to_nodes) == ("slurm", retry.job_id, 2, 1)
    assert status.shrinks == (shrink.in_words(),)
    result = launcher.result(retry)
    assert result.completed and result.step == STEPS and result.world_size == 1
    [change] = [e for e in result.events if e["kind"] == "world_size_change"]
    assert (change["from_world_size"], change["to_world_size"], change["accum_steps"]) == (2, 1, 2)
    assert 10 <= change["at_step"] < STEPS

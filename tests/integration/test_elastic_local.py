"""Elastic shrink on the local backend, for real: 2 torchrun agents ("nodes") x 1 worker on this host.

(a) A whole node (agent and worker) of an fsdp job SIGKILLed mid-training with no spare node slot:
the job goes on with the node left once the rendezvous has waited ``replacement_timeout_s``, SUCCEEDS on 1 node,
records the shrink (job log line, status, the run's elastic record) and the trainer's
``world_size_change`` event; its final weights are within ``WEIGHTS_ATOL`` of an uninterrupted
2-node run; the train stage's ``finish_train`` puts the launcher's reason and a metric on the
run's MLflow run. (b) A spare node slot is used once and then is gone: the next lost node cannot be
replaced and, below ``min_nodes``, the job FAILS naming min_nodes, leaving no process behind.

Kills are triggered by state (a committed checkpoint on disk, agents up), never by elapsed time.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_world_size_change import WEIGHTS_ATOL

from kiln.launchers import LaunchSpec, LocalLauncher, launch_local, wait
from kiln.launchers.elastic import recorded_shrinks
from kiln.launchers.local import agent_pids, worker_pid

from training_manifests import stdlib_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
STEPS = 80
OVERRIDES = (f"train.steps={STEPS}", "checkpoint.every_steps=10", "checkpoint.keep_last=2", "train.log_every=20",
             "optim.warmup_steps=10", "data.micro_batch_size=4", "parallel.strategy=fsdp")
"""micro 4: 2 micro-batches per rank on 2 nodes, 4 on 1 -- the same global batch of 16 summed in another order.
fsdp: the survivor reshards the 2-rank checkpoint's shards (DCP) to hold the whole state alone (a ddp
checkpoint's 2 -> 1 is tests/integration/test_world_size_change.py)."""
TIMEOUT_S = 3
"""The replacement timeout of the shrinking job: short, as nothing can replace the node here."""


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_manifest(tmp_path_factory.mktemp("corpus"), max_chars=200_000)


def _spec(run_dir: Path, manifest: Path, **elastic) -> LaunchSpec:
    return LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=TINY, run_key=f"elastic-{run_dir.parent.name}",
                      nodes=2, nproc_per_node=1, max_restarts=2, overrides=OVERRIDES,
                      # Same threads in every run: bit-identity depends on it.
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}, **elastic)


def _wait_for(predicate, what: str, limit_s: float = 180.0) -> None:
    # A generous safety net against hanging forever, not a timing assertion.
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def _committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def _final_weights(run_dir: Path):
    """The result's whole model state (a sharded checkpoint consolidated)."""
    from kiln_trainer.checkpoint import load_model_weights

    return load_model_weights(json.loads((run_dir / "result.json").read_text())["checkpoint"])[1]


def _tagged_processes(rdzv_id: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"KILN_LAUNCH_NODE={rdzv_id}.".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def reference(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    result = launch_local(_spec(run_dir, manifest), log=lambda _line: None)
    assert result.completed and result.step == STEPS and result.world_size == 2
    return run_dir


def test_a_lost_node_nobody_replaces_shrinks_the_job_to_one_node_within_tolerance(manifest, reference, tmp_path,
                                                                                   monkeypatch):
    spec = _spec(tmp_path / "run", manifest, min_nodes=1, spare_nodes=0, replacement_timeout_s=TIMEOUT_S)
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    _wait_for(lambda: len(agent_pids(spec.run_dir)) == 2 and 20 in _committed_steps(spec.run_dir),
              "the step-20 checkpoint")
    # The whole of node 0: its agent and its worker, at once (the first node: on a naive setup it
    # takes the rendezvous host with it).
    agent = agent_pids(spec.run_dir)["0"]
    worker = worker_pid(agent)
    for pid in (agent, worker):
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    lines: list[str] = []
    status = wait(launcher, handle, log=lines.append, poll_s=0.2)
    log_text = "\n".join(lines)
    assert status.state == "SUCCEEDED", f"{status}\n{log_text[-4000:]}"

    # The launcher's account: a log line, the status, the run's record.
    assert "[launcher] node 0 lost (agent killed by signal 9) and no spare node slot left" in log_text
    assert "elastic shrink 2 -> 1 node(s) (min_nodes=1)" in log_text
    assert status.restarts == 0 and len(status.shrinks) == 1
    assert f"no replacement within {TIMEOUT_S} s" in status.shrinks[0] and "shrunk 2 -> 1 node(s)" in status.shrinks[0]
    [shrink] = recorded_shrinks(spec.run_dir)
    assert (shrink.backend, shrink.from_nodes, shrink.to_nodes, shrink.timeout_s) == ("local", 2, 1, TIMEOUT_S)
    final = json.loads((spec.launch_dir / "status.json").read_text())
    assert final["nodes"] == 1 and final["lost"] == [0] and list(final["agents"]) == ["1"]

    # The trainer's account: the resume at world size 1, in result.json and metrics.jsonl.
    result = launcher.result(handle)
    assert result.completed and result.step == STEPS and result.world_size == 1
    [change] = [e for e in result.events if e["kind"] == "world_size_change"]
    assert (change["from_world_size"], change["to_world_size"]) == (2, 1) and 20 <= change["at_step"] < STEPS
    assert change["accum_steps"] == 4  # the same global batch: twice the micro-batches on one rank
    last = json.loads((Path(result.checkpoint) / "manifest.json").read_text())
    assert (last["format"], last["strategy"], last["world_size"]) == (3, "fsdp", 1)  # the survivor's own shards
    assert "resumed at world size 1 from a checkpoint of world size 2" in log_text

    # Same samples, same global batch: the weights differ from the 2-node run by float order only.
    ref, got = _final_weights(reference), _final_weights(spec.run_dir)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    print(f"elastic shrink 2 -> 1 at step {change['at_step']} of {STEPS}: max |dw| {worst:.3g} against the "
          f"uninterrupted 2-node run (tolerance {WEIGHTS_ATOL})")
    assert worst <= WEIGHTS_ATOL, f"a weight differs by {worst} from the uninterrupted 2-node run"
    assert _tagged_processes(spec.rdzv_id) == []

    # The train stage's end of it, on a real MLflow store: the launcher's reason as a tag, a metric.
    from mlflow import MlflowClient

    from kiln.launchers import LaunchPlan
    from kiln.policy import SANDBOX
    from kiln.stages import finish_train

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("elastic", artifact_location=str(tmp_path / "a"))).info.run_id
    finish_train(SANDBOX, LaunchPlan(spec=spec, backend="local", mlflow_run_id=run_id), handle)
    run = client.get_run(run_id)
    assert run.data.tags["kiln.elastic_shrink"] == f"elastic shrink: {status.shrinks[0]}"
    assert run.data.metrics["elastic_shrinks"] == 1 and run.info.status == "FINISHED"


def test_a_spare_slot_replaces_one_lost_node_and_below_min_nodes_the_job_fails(manifest, tmp_path):
    # min_nodes=2: replacing is the only way on. One spare slot: the first loss takes it; the
    # second finds none, and 1 node left is below min_nodes.
    spec = _spec(tmp_path / "run", manifest, min_nodes=2, spare_nodes=1, replacement_timeout_s=TIMEOUT_S)
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    _wait_for(lambda: len(agent_pids(spec.run_dir)) == 2, "two agents")
    first = agent_pids(spec.run_dir)["1"]
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: agent_pids(spec.run_dir).get("1") not in (None, first) or launcher.poll(handle).done,
              "the replacement agent")
    assert launcher.poll(handle).state == "RUNNING", launcher.logs(handle)[0][-3000:]
    os.kill(agent_pids(spec.run_dir)["1"], signal.SIGKILL)
    lines: list[str] = []
    status = wait(launcher, handle, log=lines.append, poll_s=0.2)
    assert status.state == "FAILED", status
    assert status.reason == ("node 1 lost (agent killed by signal 9) and no spare node slot left (spare_nodes=1, "
                             "1 used); the 1 node(s) left are fewer than min_nodes=2: not going on smaller")
    assert status.restarts == 1 and status.shrinks == ()
    assert "[launcher] node 1 lost (agent killed by signal 9): starting a replacement agent" in "\n".join(lines)
    assert recorded_shrinks(spec.run_dir) == []
    assert _tagged_processes(spec.rdzv_id) == []

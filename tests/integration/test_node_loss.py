"""Node loss on the local backend, for real: 2 torchrun agents ("nodes") × 1 worker on this host.

(a) a worker SIGKILLed mid-training, (b) a whole node's agent SIGKILLed (the launcher replaces it)
each end in a whole-group restart from the last committed checkpoint and the SAME final
weights_sha256 as an uninterrupted run; (c) with restarts exhausted the launch fails with a clear
reason and the last committed checkpoint still verifies; (d) a worker exiting 2 (trainer fault)
fails at once with the non-retryable TrainingFaultError.

Kills are triggered by state (a committed checkpoint on disk), never by elapsed time.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kiln.errors import ConfigError, LaunchError, TrainingFaultError
from kiln.launchers import JobHandle, LaunchSpec, LocalLauncher, launch_local, wait
from kiln.launchers.local import agent_pids, worker_pid

from training_manifests import stdlib_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
# Enough steps that a kill after the step-20 checkpoint lands mid-training (tiny: ~15 ms/step).
OVERRIDES = ("train.steps=150", "checkpoint.every_steps=10", "checkpoint.keep_last=3", "train.log_every=50",
             "optim.warmup_steps=10")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_manifest(tmp_path_factory.mktemp("corpus"), max_chars=300_000)


def _spec(run_dir: Path, manifest: Path, *, max_restarts: int = 2, env: dict[str, str] | None = None) -> LaunchSpec:
    return LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=TINY, run_key=f"nodeloss-{run_dir.name}",
                      nodes=2, nproc_per_node=1, max_restarts=max_restarts, overrides=OVERRIDES,
                      # Same threads in every run: bit-identity depends on it.
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def reference(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    result = launch_local(_spec(tmp_path_factory.mktemp("ref") / "run", manifest), log=lambda _line: None)
    assert result.completed and result.step == 150
    return result.weights_sha256


def _committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def _wait_for(predicate, what: str, limit_s: float = 120.0) -> None:
    # A generous safety net against hanging forever, not a timing assertion.
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)






def _worker_of(agent_pid: int) -> int:
    pid = worker_pid(agent_pid)
    if pid is None:
        raise AssertionError(f"agent {agent_pid} has no worker process")
    return pid


def _start_and_kill(spec: LaunchSpec, kill) -> tuple[LocalLauncher, JobHandle, list[str], int]:
    """Submit, wait for the step-20 checkpoint, run ``kill``, then wait for the end of the job."""
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    run_dir = spec.run_dir
    _wait_for(lambda: len(agent_pids(run_dir)) == 2 and 20 in _committed_steps(run_dir), "the step-20 checkpoint")
    killed_at = max(_committed_steps(run_dir))
    kill(run_dir)
    lines: list[str] = []
    wait(launcher, handle, log=lines.append, poll_s=0.2)
    return launcher, handle, lines, killed_at


def test_worker_killed_mid_training_resumes_to_identical_weights(manifest, reference, tmp_path):
    spec = _spec(tmp_path / "run", manifest)

    def kill_worker(run_dir: Path) -> None:
        os.kill(_worker_of(agent_pids(run_dir)["1"]), signal.SIGKILL)

    launcher, handle, lines, killed_at = _start_and_kill(spec, kill_worker)
    result = launcher.result(handle)
    log_text = "\n".join(lines)
    assert killed_at < 150, "the kill must land before the end of training"
    assert "resumed from" in log_text, log_text[-3000:]
    assert result.completed and result.step == 150
    assert result.weights_sha256 == reference


def test_node_agent_killed_is_replaced_and_resumes_to_identical_weights(manifest, reference, tmp_path):
    spec = _spec(tmp_path / "run", manifest)
    killed: dict[str, int] = {}

    def kill_node_agent(run_dir: Path) -> None:
        # node 0: the first node, whose loss takes a rendezvous host with it on a naive setup.
        killed["agent"] = agent_pids(run_dir)["0"]
        os.kill(killed["agent"], signal.SIGKILL)

    launcher, handle, lines, killed_at = _start_and_kill(spec, kill_node_agent)
    status = launcher.poll(handle)
    log_text = "\n".join(lines)
    assert status.state == "SUCCEEDED", f"{status}\n{log_text[-3000:]}"
    assert status.restarts == 1 and "node 0 lost" in log_text
    assert agent_pids(spec.run_dir)["0"] != killed["agent"]
    assert "resumed from" in log_text
    result = launcher.result(handle)
    assert result.completed and result.weights_sha256 == reference


def test_restarts_exhausted_fails_clearly_and_keeps_the_last_checkpoint(manifest, tmp_path):
    from kiln_trainer.checkpoint_manifest import latest_committed, verify_checkpoint

    spec = _spec(tmp_path / "run", manifest, max_restarts=0)

    def kill_worker(run_dir: Path) -> None:
        os.kill(_worker_of(agent_pids(run_dir)["0"]), signal.SIGKILL)

    launcher, handle, lines, _ = _start_and_kill(spec, kill_worker)
    status = launcher.poll(handle)
    assert status.state == "FAILED", status
    assert "restarts are spent (max_restarts=0)" in status.reason
    with pytest.raises(LaunchError, match="max_restarts=0") as info:
        launcher.result(handle)
    assert info.value.retryable  # a crash: a later attempt (Airflow retry) resumes
    last = latest_committed(spec.run_dir)
    assert last is not None and int(last.name.split("-")[1]) >= 20
    verify_checkpoint(last)
    assert not (spec.run_dir / "result.json").exists()


def test_trainer_fault_exit_2_is_fatal_and_not_retried(tmp_path):
    # A shard whose bytes no longer match the manifest: the trainer diagnoses it and exits 2 on
    # every rank. (A bad recipe never gets this far: the launcher refuses it before any worker.)
    tampered = stdlib_manifest(tmp_path, max_chars=50_000)
    shard = Path(json.loads(tampered.read_text())["shards"][0]["path"])
    shard.write_bytes(shard.read_bytes() + b"\0")
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tampered, recipe=TINY, run_key="nodeloss-fatal", nodes=2,
                      max_restarts=3, overrides=OVERRIDES, env={"KILN_TORCH_THREADS": "1"})
    lines: list[str] = []
    with pytest.raises(TrainingFaultError, match="exited 2.*ShardIntegrityError") as info:
        launch_local(spec, log=lines.append)
    assert info.value.retryable is False
    assert list((spec.run_dir / ".launch" / "fatal").glob("rank-*.json"))


def test_a_bad_recipe_is_refused_before_any_agent_starts(manifest, tmp_path):
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=manifest, recipe=TINY, run_key="nodeloss-recipe", nodes=2,
                      overrides=("train.no_such_field=1",))
    with pytest.raises(ConfigError, match=r"tiny\.toml: unknown key\(s\) \['train\.no_such_field'\]") as info:
        launch_local(spec, log=lambda _line: None)
    assert info.value.retryable is False
    assert not spec.run_dir.exists() and _tagged_processes(spec.rdzv_id) == []


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


def test_resubmit_reattaches_and_cancel_ends_every_process(manifest, tmp_path):
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=manifest, recipe=TINY, run_key="nodeloss-cancel", nodes=2,
                      overrides=("train.steps=100000", "checkpoint.every_steps=10"), env={"KILN_TORCH_THREADS": "1"})
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    _wait_for(lambda: bool(_committed_steps(spec.run_dir)), "the first checkpoint")
    # A retried task submits again: it gets the running job, not a second gang on the same checkpoints.
    assert launcher.submit(spec) == handle
    assert len(_tagged_processes(spec.rdzv_id)) >= 4  # 2 agents + 2 workers
    launcher.cancel(handle)
    assert launcher.poll(handle).state == "CANCELLED"
    assert _tagged_processes(spec.rdzv_id) == []

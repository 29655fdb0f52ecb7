"""The trainer end to end, as real processes: determinism, resume after stop/SIGKILL, faults, MLflow.

Every run uses the tiny recipe shrunk by ``SHORT`` and one torch thread per rank.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kiln_trainer import train as train_module
from kiln_trainer.checkpoint_manifest import latest_committed, manifest_sha256, verify_checkpoint
from trainer_fixtures import (
    REPO,
    SHORT,
    THREADS,
    TINY,
    read_result,
    run_ok,
    sigkill_tree,
    torchrun_cmd,
    train_cmd,
    trainer_env,
    two_agent_cmds,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def ref_1rank(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref1") / "run"
    run_ok([sys.executable, *train_cmd(corpus, run_dir, *SHORT)], env=trainer_env(**THREADS))
    return run_dir


@pytest.fixture(scope="session")
def ref_2rank(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref2") / "run"
    run_ok(torchrun_cmd(2, train_cmd(corpus, run_dir, *SHORT)), env=trainer_env(**THREADS))
    return run_dir


def test_result_checkpoints_and_metrics_of_a_run(ref_1rank: Path, corpus: Path) -> None:
    result = read_result(ref_1rank)
    assert result["kind"] == "kiln.TrainResult" and result["run_dir"] == str(ref_1rank.resolve())
    assert result["step"] == 24 and result["completed"] is True and result["mlflow_run_id"] == ""
    ck = Path(result["checkpoint"])
    assert ck.is_absolute() and ck.name == "step-00000024"
    manifest = verify_checkpoint(ck)
    assert result["checkpoint_manifest_sha256"] == manifest_sha256(ck)
    assert result["weights_sha256"] == manifest["weights_sha256"]
    assert manifest["training_manifest_sha256"] == json.loads(corpus.read_text())["sha256"]
    m = result["metrics"]
    assert m["steps"] == 24 and m["train_tokens"] == 24 * 8 * 64 and m["final_loss"] < 5.6
    assert m["tokens_per_s"] > 0 and m["wall_s"] > 0
    # keep_last=2: steps 8 was deleted, 16 and 24 remain.
    assert sorted(p.name for p in (ref_1rank / "checkpoints").iterdir()) == ["step-00000016", "step-00000024"]
    records = [json.loads(line) for line in (ref_1rank / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in records if "loss" in r]
    assert [r["step"] for r in lines] == [4, 8, 12, 16, 20, 24]
    # Straggler windows every 5 steps (one rank: its own compute time, never a straggler, no efficiency).
    windows = [r for r in records if "rank_step_times" in r]
    assert [w["step"] for w in windows] == [5, 10, 15, 20]
    assert all(len(w["rank_step_times"]) == 1 and w["straggler_rank"] == -1 for w in windows)
    assert not any("scaling_efficiency" in w for w in windows)
    [startup] = [r for r in records if r.get("event") == "startup"]
    assert startup["step"] == 1 and startup["resumed_from_step"] is None and startup["restart_count"] == 0
    assert startup["first_step_unix"] >= startup["process_start_unix"] > 0
    assert {"loss", "tokens_per_s", "step_time", "data_wait_frac", "ckpt_block_s", "checkpoint_lag_steps"} <= set(
        lines[-1]
    )
    assert "kiln_train_loss" in (ref_1rank / "metrics.prom").read_text()


def test_one_rank_is_deterministic(ref_1rank: Path, corpus: Path, tmp_path: Path) -> None:
    run_ok([sys.executable, *train_cmd(corpus, tmp_path / "run", *SHORT)], env=trainer_env(**THREADS))
    assert read_result(tmp_path / "run")["weights_sha256"] == read_result(ref_1rank)["weights_sha256"]


def test_two_ranks_are_deterministic_across_launch_modes(ref_2rank: Path, corpus: Path, tmp_path: Path) -> None:
    """--nproc-per-node=2 (reference) and two single-rank agents (the 2-node layout) agree bit for bit."""
    run_dir = tmp_path / "run"
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=trainer_env(**THREADS), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in two_agent_cmds(train_cmd(corpus, run_dir, *SHORT), rdzv_id="determinism")
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    result, reference = read_result(run_dir), read_result(ref_2rank)
    assert result["world_size"] == reference["world_size"] == 2
    assert result["weights_sha256"] == reference["weights_sha256"]
    files = verify_checkpoint(result["checkpoint"])["files"]
    assert {"rng-rank00000.pt", "rng-rank00001.pt"} <= set(files)


def test_stop_at_max_steps_then_resume_matches_uninterrupted(ref_1rank: Path, corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, *train_cmd(corpus, run_dir, *SHORT)]
    run_ok([*cmd, "--max-steps", "10"], env=trainer_env(**THREADS))
    partial = read_result(run_dir)
    assert partial["step"] == 10 and partial["completed"] is False  # the stop step is checkpointed
    proc = run_ok(cmd, env=trainer_env(**THREADS))
    assert "resumed from" in proc.stderr and "(step 10)" in proc.stderr
    assert read_result(run_dir)["weights_sha256"] == read_result(ref_1rank)["weights_sha256"]


def _kill_during_save(cmd: list[str], run_dir: Path, step_dir_name: str) -> None:
    """Start ``cmd`` with a slowed checkpoint writer; SIGKILL the whole tree once ``step_dir_name``
    exists, i.e. while that save is in flight (files written, manifest not yet)."""
    env = trainer_env(**THREADS, KILN_CKPT_WRITE_DELAY_S="1.5")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = run_dir / "checkpoints" / step_dir_name
    deadline = time.monotonic() + 120
    try:
        while not target.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.02)
        time.sleep(0.3)
    finally:
        sigkill_tree(proc)
    assert not (target / "manifest.json").exists(), "killed too late: the save had committed"


def test_sigkill_during_async_save_then_resume_matches_one_rank(ref_1rank: Path, corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, *train_cmd(corpus, run_dir, *SHORT)]
    _kill_during_save(cmd, run_dir, "step-00000016")
    assert latest_committed(run_dir) == run_dir / "checkpoints" / "step-00000008"
    proc = run_ok(cmd, env=trainer_env(**THREADS))
    assert "ignoring checkpoint at step 16" in proc.stderr
    assert "(step 8)" in proc.stderr
    assert read_result(run_dir)["weights_sha256"] == read_result(ref_1rank)["weights_sha256"]


def test_sigkill_during_async_save_then_resume_matches_two_ranks(ref_2rank: Path, corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(2, train_cmd(corpus, run_dir, *SHORT))
    _kill_during_save(cmd, run_dir, "step-00000016")
    proc = run_ok(cmd, env=trainer_env(**THREADS))
    assert "ignoring checkpoint at step 16" in proc.stderr
    assert read_result(run_dir)["weights_sha256"] == read_result(ref_2rank)["weights_sha256"]


# ---------------------------------------------------------------- faults (in-process: no startup cost)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_TORCH_THREADS", "1")


def _main(corpus: Path, run_dir: Path, *overrides: str, manifest: Path | None = None) -> int:
    args = ["--manifest", str(manifest or corpus), "--recipe", str(TINY), "--run-dir", str(run_dir)]
    for o in (*SHORT, *overrides):
        args += ["--set", o]
    return train_module.main(args)


@pytest.mark.usefixtures("in_process")
def test_resume_refuses_another_recipe(
    ref_1rank: Path, corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(ref_1rank, run_dir)
    assert _main(corpus, run_dir, "train.seed=7") == 2
    assert "ResumeMismatchError" in caplog.text and "recipe_sha256" in caplog.text


@pytest.mark.usefixtures("in_process")
def test_tampered_shard_is_refused(corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = json.loads(corpus.read_text())
    copy = tmp_path / Path(doc["shards"][1]["path"]).name
    shutil.copy(doc["shards"][1]["path"], copy)
    with open(copy, "ab") as fh:
        fh.write(b"\0")
    doc["shards"][1]["path"] = str(copy)
    import hashlib

    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")}
    doc["sha256"] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(doc))
    assert _main(corpus, tmp_path / "run", manifest=manifest) == 2
    assert "ShardIntegrityError" in caplog.text and "sha256 mismatch" in caplog.text
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.usefixtures("in_process")
def test_edited_training_manifest_is_refused(corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = json.loads(corpus.read_text())
    doc["quarantined"] = []
    doc["shards"].append(doc["shards"][0])
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(doc))
    assert _main(corpus, tmp_path / "run", manifest=manifest) == 2
    assert "content hash mismatch" in caplog.text


@pytest.mark.usefixtures("in_process")
def test_guard_rolls_back_then_gives_up(corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An absurd learning rate drives the loss to NaN: each time the guard rolls back (here to the
    in-memory step-0 state, nothing is committed yet) and re-draws the windows with a new data salt;
    past guard.max_rollbacks the run fails clearly instead of training on garbage."""
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, "optim.lr=50.0", "optim.min_lr=0", "guard.max_rollbacks=2") == 2
    assert "TrainingDivergedError" in caplog.text and "non-finite loss" in caplog.text
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    assert [e["data_salt"] for e in rollbacks] == [1, 2]
    assert all(e["to_step"] == 0 and e["at_step"] > 0 for e in rollbacks)


@pytest.mark.parametrize(
    ("loss", "recent", "tripped"),
    [
        (float("nan"), [], "non-finite"),
        (float("inf"), [1.0] * 5, "non-finite"),
        (2.5, [1.0] * 5, "spike"),
        (2.5, [1.0] * 4, None),  # too little history to call anything a spike
        (1.9, [1.0] * 5, None),
    ],
)
def test_guard_verdict(loss: float, recent: list[float], tripped: str | None) -> None:
    verdict = train_module.guard_verdict(loss, recent, spike_factor=2.0)
    assert (verdict is None) if tripped is None else (tripped in verdict)
    assert train_module.guard_verdict(100.0, [1.0] * 5, spike_factor=0.0) is None  # 0 disables


@pytest.mark.usefixtures("in_process")
def test_mlflow_logging_to_an_existing_run(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("kiln-test", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    assert _main(corpus, tmp_path / "run") == 0
    assert read_result(tmp_path / "run")["mlflow_run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # the trainer never ends the orchestrator's run
    assert run.data.params["model.n_layer"] == "2" and run.data.params["train.steps"] == "24"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [4, 8, 12, 16, 20, 24]
    assert {"tokens_per_s", "step_time", "checkpoint_lag_steps"} <= set(run.data.metrics)
    del mlflow


@pytest.mark.usefixtures("in_process")
def test_injected_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_the_window(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """KILN_FAULT_SPIKE_AT_STEP poisons step 12's first window: the guard rolls back to the committed
    step 8, redraws steps 9-12 with data salt 1 (clean), and the run completes with the event on record."""
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "12")
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, "guard.spike_factor=3.0", "guard.max_rollbacks=1") == 0
    result = read_result(run_dir)
    assert result["completed"] is True and result["step"] == 24
    [event] = result["events"]
    assert event["kind"] == "rollback" and "loss spike" in event["reason"]
    assert (event["at_step"], event["to_step"], event["data_salt"]) == (12, 8, 1)
    assert "rolled back to step 8" in caplog.text
    # The salt rides in every later checkpoint, so a resume keeps skipping the poisoned window.
    from kiln_trainer.checkpoint import load_checkpoint

    state = load_checkpoint(result["checkpoint"], rank=None).trainer_state
    assert state["data_salt"] == 1 and state["events"] == result["events"]


@pytest.mark.usefixtures("in_process")
def test_persistent_loss_spike_fails_after_max_rollbacks(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "12")
    monkeypatch.setenv("KILN_FAULT_SPIKE_TIMES", "99")  # every redraw of step 12 spikes too
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, "guard.spike_factor=3.0", "guard.max_rollbacks=2") == 2
    assert "TrainingDivergedError" in caplog.text and "loss spike" in caplog.text
    assert "guard.max_rollbacks = 2" in caplog.text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert [(r["at_step"], r["to_step"], r["data_salt"]) for r in rollbacks] == [(12, 8, 1), (12, 8, 2)]
    assert not (run_dir / "result.json").exists()  # a diverged run leaves no result to mistake for one


def test_spike_fault_is_off_unless_asked_and_checks_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_FAULT_SPIKE_AT_STEP", raising=False)
    assert train_module.SpikeFault.from_env() is None
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "5")
    fault = train_module.SpikeFault.from_env()
    assert fault is not None and fault.apply(2.0, 5, 0) == 2000.0
    assert fault.apply(2.0, 5, 1) == 2.0 and fault.apply(2.0, 4, 0) == 2.0
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "0")
    with pytest.raises(train_module.TrainerError, match="KILN_FAULT_SPIKE_AT_STEP"):
        train_module.SpikeFault.from_env()

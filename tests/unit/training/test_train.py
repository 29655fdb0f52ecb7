"""The trainer end to end, as real processes: determinism, resume after stop/SIGKILL, faults, MLflow,
and every bad token input refused before step 1 (exit 2, nothing trained).

Every run uses the tiny recipe shrunk by ``SHORT`` and one torch thread per rank. The world-size
proofs (the same global sample ids at 1, 2 and 4 ranks and across resumes that change it) are in
``tests/integration/test_world_size_change.py``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln_trainer import train as train_module
from kiln_trainer.checkpoint_manifest import latest_committed, manifest_sha256, verify_checkpoint
from kiln_trainer.config import load_recipe
from kiln_trainer.data import pack_run_tokens
from kiln_trainer.errors import TrainerError
from kiln_trainer.faults import SpikeFault
from kiln_trainer.packed import load_token_manifest
from kiln_trainer.tokenizer import ByteTokenizer
from kiln_trainer.training_manifest import load_training_manifest

from trainer_fixtures import (
    REPO,
    SHORT,
    THREADS,
    TINY,
    canonical_json,
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
    # The manifest named no tokens: rank 0 packed its shards under the run dir, byte tokenizer, block 64.
    [token_manifest_path] = (ref_1rank / "tokens").glob("*/*/token_manifest.json")
    token_manifest = load_token_manifest(token_manifest_path)
    assert token_manifest.block_size == 64 and token_manifest.tokenizer["sha256"] == ByteTokenizer().sha256
    assert result["token_manifest_sha256"] == manifest["token_manifest_sha256"] == token_manifest.sha256
    assert result["tokenizer_sha256"] == manifest["tokenizer_sha256"] == ByteTokenizer().sha256
    assert (ck / "tokenizer.json").read_bytes() == ByteTokenizer().to_bytes() and "tokenizer.json" in manifest["files"]
    m = result["metrics"]
    assert m["steps"] == 24 and m["train_tokens"] == 24 * 16 * 64 and m["final_loss"] < 5.6
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
    assert "resumed at world size" not in proc.stderr
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


def test_two_ranks_verify_together_and_pass_over_a_checkpoint_only_one_of_them_finds_damaged(
    ref_2rank: Path, corpus: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from kiln_trainer.checkpoint_manifest import _dealt

    run_dir = tmp_path / "run"
    shutil.copytree(ref_2rank, run_dir)
    (run_dir / "result.json").unlink()
    newest = run_dir / "checkpoints" / "step-00000024"
    names = json.loads((newest / "manifest.json").read_text())["files"]
    victim = sorted(_dealt(newest, names, (1, 2)))[0]  # a file rank 1 hashes, rank 0 does not
    data = bytearray((newest / victim).read_bytes())
    data[len(data) // 2] ^= 0x04
    (newest / victim).write_bytes(bytes(data))
    proc = run_ok(torchrun_cmd(2, train_cmd(corpus, run_dir, *SHORT)), env=trainer_env(**THREADS))
    assert f"[rank1] WARNING kiln_trainer.train: ignoring checkpoint at step 24: {newest}: file {victim!r} sha256" in proc.stderr
    assert "[rank0] WARNING kiln_trainer.train: ignoring checkpoint at step 24: another rank found it damaged" in proc.stderr
    assert "(step 16)" in proc.stderr
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
@pytest.mark.parametrize(("override", "named"), [("train.seed=7", "train.seed: 1337 -> 7"),
                                                 ("data.global_batch_size=32", "data.global_batch_size: 16 -> 32")])
def test_resume_refuses_another_recipe(
    ref_1rank: Path, corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, override: str, named: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(ref_1rank, run_dir)
    assert _main(corpus, run_dir, override) == 2
    assert "ResumeMismatchError" in caplog.text and "recipe_sha256" in caplog.text
    assert named in caplog.text, "the refusal names the recipe value that differs"


@pytest.mark.usefixtures("in_process")
def test_resume_may_change_the_micro_batch(ref_1rank: Path, corpus: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Same global batches, computed as 4 micro-batches of 4 instead of 2 of 8: allowed, and said."""
    run_dir = tmp_path / "run"
    shutil.copytree(ref_1rank, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000024")
    (run_dir / "result.json").unlink()
    with caplog.at_level(logging.INFO, logger="kiln_trainer"):
        assert _main(corpus, run_dir, "data.micro_batch_size=4") == 0
    assert "resumed from" in caplog.text and "(step 16)" in caplog.text
    assert "world size 1 x data.micro_batch_size 4, the checkpoint was made with 1 x 8" in caplog.text
    result = read_result(run_dir)
    assert result["completed"] and result["token_manifest_sha256"] == read_result(ref_1rank)["token_manifest_sha256"]


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
    in-memory step-0 state, nothing is committed yet) and skips the global batch it diverged on;
    past guard.max_rollbacks the run fails clearly instead of training on garbage."""
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, "optim.lr=50.0", "optim.min_lr=0", "guard.max_rollbacks=2") == 2
    assert "TrainingDivergedError" in caplog.text and "non-finite loss" in caplog.text
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    assert len(rollbacks) == 2 and all(e["to_step"] == 0 and e["at_step"] > 0 for e in rollbacks)
    # The batch of the failing step (0-based: at_step - 1, plus the batches skipped before it).
    assert [e["skipped_batch"] for e in rollbacks] == [rollbacks[0]["at_step"] - 1, rollbacks[1]["at_step"]]


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
    assert run.data.params["kiln.token_manifest_sha256"] == read_result(tmp_path / "run")["token_manifest_sha256"]
    # What a resume may change is a tag (params are immutable): a resume at another world size logs again.
    assert "data.micro_batch_size" not in run.data.params and "kiln.world_size" not in run.data.params
    assert run.data.tags["kiln.world_size"] == "1" and run.data.tags["kiln.micro_batch_size"] == "8"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [4, 8, 12, 16, 20, 24]
    assert {"tokens_per_s", "step_time", "checkpoint_lag_steps"} <= set(run.data.metrics)
    del mlflow


@pytest.mark.usefixtures("in_process")
def test_injected_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_the_window(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """KILN_FAULT_SPIKE_AT_STEP poisons the first batch step 12 is given (global batch 11): the guard
    rolls back to the committed step 8, replays steps 9-11 on the same batches, gives step 12 the next
    batch (12), and the run completes with the event on record."""
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "12")
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, "guard.spike_factor=3.0", "guard.max_rollbacks=1") == 0
    result = read_result(run_dir)
    assert result["completed"] is True and result["step"] == 24
    [event] = result["events"]
    assert event["kind"] == "rollback" and "loss spike" in event["reason"]
    assert (event["at_step"], event["to_step"], event["skipped_batch"]) == (12, 8, 11)
    assert "rolled back to step 8, skipping global batch 11" in caplog.text
    # The skipped batch rides in every later checkpoint, so a resume keeps skipping it.
    from kiln_trainer.checkpoint import load_checkpoint

    state = load_checkpoint(result["checkpoint"], rank=None).trainer_state
    assert state["skipped_batches"] == [11] and state["events"] == result["events"]
    assert state["loader"]["consumed_samples"] == 25 * 16  # 24 steps trained on 25 global batches


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
    assert [(r["at_step"], r["to_step"], r["skipped_batch"]) for r in rollbacks] == [(12, 8, 11), (12, 8, 12)]
    assert not (run_dir / "result.json").exists()  # a diverged run leaves no result to mistake for one


def test_spike_fault_is_off_unless_asked_and_checks_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_FAULT_SPIKE_AT_STEP", raising=False)
    assert SpikeFault.from_env() is None
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "5")
    fault = SpikeFault.from_env()
    assert fault is not None and fault.apply(2.0, 5, 0) == 2000.0
    assert fault.apply(2.0, 5, 1) == 2.0 and fault.apply(2.0, 4, 0) == 2.0
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "0")
    with pytest.raises(TrainerError, match="KILN_FAULT_SPIKE_AT_STEP"):
        SpikeFault.from_env()


# ---------------------------------------------------------------- packed tokens named by the manifest


@pytest.fixture(scope="module")
def packed(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus's shards packed as the tokenize stage would, and a manifest naming them (``tokens``)."""
    root = tmp_path_factory.mktemp("tokenize")
    manifest = load_training_manifest(corpus)
    ref = pack_run_tokens(manifest, load_recipe(TINY), run_dir=root)
    return _with_tokens(corpus, root / "manifest-with-tokens.json", ref.manifest, ref.sha256)


def _with_tokens(corpus: Path, path: Path, location: str, sha256: str) -> Path:
    import hashlib

    doc = json.loads(corpus.read_text())
    doc["tokens"] = {"manifest": location, "sha256": sha256}
    body = {k: v for k, v in doc.items() if k not in ("kind", "sha256")}
    doc["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.usefixtures("in_process")
def test_a_manifest_naming_tokens_trains_on_them_without_packing(packed: Path, ref_1rank: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _main(packed, run_dir, manifest=packed) == 0
    result, reference = read_result(run_dir), read_result(ref_1rank)
    assert not (run_dir / "tokens").exists()
    assert result["token_manifest_sha256"] == json.loads(packed.read_text())["tokens"]["sha256"]
    # The same shards, packed by the stage or by rank 0, are the same tokens: the same training.
    assert result["token_manifest_sha256"] == reference["token_manifest_sha256"]
    assert result["weights_sha256"] == reference["weights_sha256"]


def _copied_tokens(packed: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the packed directory and a re-issued manifest naming it (for the damage tests)."""
    ref = json.loads(packed.read_text())["tokens"]
    copy = tmp_path / "tokens"
    shutil.copytree(Path(ref["manifest"]).parent, copy)
    return copy, _with_tokens(packed, tmp_path / "m.json", str(copy / "token_manifest.json"), ref["sha256"])


def _truncate_a_shard(copy: Path) -> None:
    shard = sorted(copy.glob("part-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])


def _write_an_id_past_the_vocabulary(copy: Path) -> None:
    import numpy as np

    shard = sorted(copy.glob("part-*.bin"))[0]
    ids = np.fromfile(shard, dtype="<u2")
    ids[::50] = 4000  # the byte tokenizer has 257 ids; every sample of the shard is hit
    ids.tofile(shard)


def _swap_the_tokenizer_artifact(copy: Path) -> None:
    (copy / "tokenizer.json").write_bytes(ByteTokenizer(eos_id=0).to_bytes())


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("damage", "overrides", "named", "message"),
    [
        (None, ("tokenizer.eos_id=0",), "TokenizerMismatchError", "tokenizer.eos_id = 0"),
        (_swap_the_tokenizer_artifact, (), "TokenizerMismatchError", "the token manifest says sha256"),
        (_truncate_a_shard, (), "TokenShardError", "is truncated"),
        (_write_an_id_past_the_vocabulary, (), "TokenShardError", "token id 4000, at or above the vocabulary size 257"),
        (None, ("model.block_size=32",), "BlockSizeMismatchError", "the recipe asks for 32"),
        ("wrong-sha", (), "TokenManifestError", "but the training manifest names"),
    ],
    ids=["tokenizer", "tokenizer-artifact", "truncated-shard", "id-past-vocabulary", "block-size", "token-manifest"],
)
def test_bad_token_input_is_refused_before_step_1(
    packed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, overrides: tuple[str, ...], named: str,
    message: str,
) -> None:
    manifest = packed
    if damage == "wrong-sha":
        manifest = _with_tokens(packed, tmp_path / "m.json", json.loads(packed.read_text())["tokens"]["manifest"], "e" * 64)
    elif damage is not None:
        copy, manifest = _copied_tokens(packed, tmp_path)
        damage(copy)
    run_dir = tmp_path / "run"
    assert _main(packed, run_dir, *overrides, manifest=manifest) == 2
    assert named in caplog.text and message in caplog.text, caplog.text[-2000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "result.json").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    assert not [r for r in records if "loss" in r], "nothing was trained"


@pytest.mark.usefixtures("in_process")
def test_a_bpe_recipe_trains_evaluates_and_restarts_on_the_same_tokenizer(corpus: Path, tmp_path: Path) -> None:
    """tokenizer.kind = bpe, no tokens in the manifest: rank 0 trains the BPE on the training shards
    (kept next to the packed shards), packs with it, trains; the checkpoint carries it, evaluation
    scores bits per byte with it, and a second start finds both instead of training them again."""
    from kiln_trainer import evaluate
    from kiln_trainer.tokenizer import load_tokenizer

    bpe = ("tokenizer.kind=bpe", "tokenizer.vocab_size=512", "tokenizer.max_train_chars=200000")
    run_dir = tmp_path / "run"
    assert _main(corpus, run_dir, *bpe, "train.steps=8", "checkpoint.every_steps=8") == 0
    result = read_result(run_dir)
    step_dir = Path(result["checkpoint"])
    tokenizer = load_tokenizer(step_dir / "tokenizer.json")
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size <= 512 and tokenizer.sha256 == result["tokenizer_sha256"]
    assert verify_checkpoint(step_dir)["recipe"]["model"]["vocab_size"] == 512
    [cached] = (run_dir / "tokens").glob("*/bpe-*.json")
    report = evaluate.evaluate_checkpoint(step_dir, max_windows=8)
    assert report["tokenizer_sha256"] == tokenizer.sha256 and report["bytes"] > report["tokens"]  # > 1 byte a token
    mtime = cached.stat().st_mtime_ns
    assert _main(corpus, run_dir, *bpe, "train.steps=12", "checkpoint.every_steps=4") == 2  # another recipe: refused
    assert _main(corpus, run_dir, *bpe, "train.steps=8", "checkpoint.every_steps=8") == 0  # done: nothing to do
    assert cached.stat().st_mtime_ns == mtime and read_result(run_dir)["tokenizer_sha256"] == tokenizer.sha256

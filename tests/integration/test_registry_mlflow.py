"""kiln.registry against a real ``mlflow server`` (fixture in conftest.py).

Most checkpoints here are step directories in the trainer's commit format (payload files + a
``manifest.json`` with per-file sha256, written last), checked by the trainer's own
``verify_checkpoint``. Their payload bytes are not torch weights, so those tests log a tiny real
MLflow pyfunc model in place of ``kiln_trainer.export.log_model`` (fixture ``logged_models``); that
keeps the registry logic fast to test. One test writes a real tiny-GPT checkpoint with the trainer's
``CheckpointWriter`` and goes through the real export: the version loads with
``mlflow.pytorch.load_model`` and generates.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kiln import registry
from kiln.errors import ManifestError, PolicyError, RegistryError
from kiln.policy import POLICIES, PRODUCTION, PRODUCTION_MODEL, SANDBOX, Policy
from kiln.refs import EvalReport, SnapshotRef, TrainingManifest, TrainResult, sha256_file
from kiln_trainer import checkpoint_manifest

pytestmark = pytest.mark.slow


SNAPSHOT_ID = "0123456789abcdef0123456789abcdef.dir"
DVC_TEXT = f"outs:\n- md5: {SNAPSHOT_ID}\n  size: 1024\n  nfiles: 4\n  hash: md5\n  path: stdlib-py\n"


# ------------------------------------------------------------------------------------------ builders


def build_manifest(tmp: Path) -> TrainingManifest:
    # Signed by hand rather than TrainingManifest.build (which passes "kind" back into __init__).
    unsigned = TrainingManifest(
        snapshot_id=SNAPSHOT_ID,
        corpus="stdlib-py",
        contract="stdlib-py@1",
        shards=[{"path": str(tmp / "shard-000.parquet"), "sha256": "a" * 64, "rows": 10}],
        eval_shards=[{"path": str(tmp / "eval-000.parquet"), "sha256": "b" * 64, "rows": 5}],
        quarantined=[str(tmp / "shard-001.parquet"), str(tmp / "shard-002.parquet")],
    )
    return dataclasses.replace(unsigned, sha256=unsigned.content_hash())


def write_checkpoint(run_dir: Path, manifest: TrainingManifest, *, step: int = 10, seed: str = "a") -> Path:
    """A committed step directory in the trainer's format: payload files first, manifest last."""
    step_dir = run_dir / "checkpoints" / checkpoint_manifest.step_dir_name(step)
    step_dir.mkdir(parents=True)
    files = {}
    for name in sorted(checkpoint_manifest.expected_files(1)):
        (step_dir / name).write_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest() * 64)
        files[name] = sha256_file(step_dir / name)
    recipe = {"model": {"n_layer": 1}, "train": {"steps": step}}
    body = {
        "kind": checkpoint_manifest.CHECKPOINT_KIND,
        "format": 1,
        "step": step,
        "world_size": 1,
        "recipe_sha256": hashlib.sha256(checkpoint_manifest.canonical_json(recipe)).hexdigest(),
        "recipe": recipe,
        "snapshot_id": manifest.snapshot_id,
        "training_manifest_sha256": manifest.sha256,
        "files": files,
        "weights_sha256": files["model.pt"],
        "created_at": "2026-11-29T17:00:00+00:00",
    }
    checkpoint_manifest.atomic_write_bytes(step_dir / "manifest.json", json.dumps(checkpoint_manifest.seal(body)).encode())
    return step_dir


@dataclasses.dataclass
class Candidate:
    train: TrainResult
    eval_report: EvalReport
    snapshot: SnapshotRef
    manifest: TrainingManifest

    def kwargs(self) -> dict[str, Any]:
        return {"train": self.train, "eval_report": self.eval_report, "snapshot": self.snapshot,
                "manifest": self.manifest}  # fmt: skip


def make_candidate(tmp: Path, name: str, bits_per_byte: float, *, mlflow_run_id: str = "") -> Candidate:
    manifest = build_manifest(tmp)
    step_dir = write_checkpoint(tmp / name, manifest, seed=name)
    verified = checkpoint_manifest.verify_checkpoint(step_dir)
    train = TrainResult(
        run_dir=str(tmp / name),
        checkpoint=str(step_dir),
        checkpoint_manifest_sha256=sha256_file(step_dir / "manifest.json"),
        weights_sha256=verified["weights_sha256"],
        step=verified["step"],
        metrics={"final_loss": 2.1},
        mlflow_run_id=mlflow_run_id,
        world_size=verified["world_size"],
        total_steps=verified["step"],
        completed=True,
        recipe_sha256=verified["recipe_sha256"],
        snapshot_id=verified["snapshot_id"],
        training_manifest_sha256=verified["training_manifest_sha256"],
    )
    report = EvalReport(checkpoint=str(step_dir), weights_sha256=verified["weights_sha256"], split="eval",
                        bits_per_byte=bits_per_byte, loss=bits_per_byte * math.log(2), tokens=4096)  # fmt: skip
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=4, bytes=1024, dvc=DVC_TEXT,
                           remote="/tmp/dvc-remote", path="/tmp/dvc-repo/stdlib-py")  # fmt: skip
    return Candidate(train=train, eval_report=report, snapshot=snapshot, manifest=manifest)


def sandbox_policy(suffix: str) -> Policy:
    name = f"sandbox.test-{suffix}"
    return dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))


def production_policy(suffix: str) -> Policy:
    target = f"test-{suffix}"
    return dataclasses.replace(PRODUCTION, candidate_model=f"{target}.candidates", target_model=target,
                               writable_models=(f"{target}.candidates", target))  # fmt: skip


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def client(mlflow_uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_uri)


def versions(client, model: str) -> list:
    return list(client.search_model_versions(f"name = '{model}'"))


# --------------------------------------------------------------------------------------------- tests


def test_register_twice_with_the_same_run_key_makes_one_version(tmp_path, client, unique_name, logged_models):
    policy = sandbox_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    run_key = f"kiln_sandbox/manual__{unique_name}"
    lineage = {"quarantine_report": "/runs/x/quarantine.json", "kiln.extra": "yes"}

    first = registry.register_candidate(policy=policy, run_key=run_key, lineage=lineage, **cand.kwargs())
    second = registry.register_candidate(policy=policy, run_key=run_key, lineage=lineage, **cand.kwargs())

    assert first["created"] is True and second["created"] is False
    assert (first["model_name"], first["version"]) == (second["model_name"], second["version"]) == (
        policy.candidate_model, "1",
    )  # fmt: skip
    assert first["decision"]["action"] == "promote" and second["decision"] == first["decision"]
    assert json.loads(json.dumps(first)) == first  # JSON-safe for XCom
    assert len(versions(client, policy.candidate_model)) == 1
    assert len(logged_models) == 1, "a retry must not log a second model"

    mv = client.get_model_version(policy.candidate_model, "1")
    tags = mv.tags
    assert tags["kiln.run_key"] == run_key
    assert tags["kiln.snapshot_id"] == SNAPSHOT_ID and tags["kiln.dvc"] == DVC_TEXT
    assert tags["kiln.training_manifest_sha256"] == cand.manifest.sha256
    assert tags["kiln.contract"] == "stdlib-py@1" and tags["kiln.quarantined_shards"] == "2"
    assert len(tags["kiln.recipe_sha256"]) == 64
    assert tags["kiln.git_sha"]
    assert (tags["kiln.airflow.dag_id"], tags["kiln.airflow.run_id"]) == ("kiln_sandbox", f"manual__{unique_name}")
    assert tags["kiln.weights_sha256"] == cand.train.weights_sha256
    assert tags["kiln.checkpoint"] == cand.train.checkpoint
    assert tags["kiln.train.completed"] == "true" and tags["kiln.train.steps"] == "10/10"
    assert float(tags["kiln.eval.bits_per_byte"]) == 3.0 and tags["kiln.eval.split"] == "eval"
    assert tags["kiln.decision"] == "promote" and json.loads(tags["kiln.decision.reasons"])
    assert tags["kiln.quarantine_report"] == "/runs/x/quarantine.json" and tags["kiln.extra"] == "yes"
    assert "Gate: **promote**" in mv.description

    run = client.get_run(first["run_id"])
    assert run.data.tags["kiln.run_key"] == run_key
    assert run.data.metrics["eval_bits_per_byte"] == 3.0
    artifacts = {a.path for a in client.list_artifacts(first["run_id"], "evaluation")}
    assert {"evaluation/eval_report.json", "evaluation/decision.json", "evaluation/report.md"} <= artifacts
    assert run.info.status == "FINISHED"


def test_registration_logs_into_the_training_run_and_keeps_its_status(tmp_path, client, unique_name, logged_models):
    policy = sandbox_policy(unique_name)
    experiment_id = client.create_experiment(f"train-{unique_name}")
    train_run = client.create_run(experiment_id, tags={"kiln.run_key": f"kiln_sandbox/r-{unique_name}"})
    cand = make_candidate(tmp_path, "a", 3.0, mlflow_run_id=train_run.info.run_id)

    ref = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/r-{unique_name}", **cand.kwargs())

    assert ref["run_id"] == train_run.info.run_id
    assert client.get_model_version(policy.candidate_model, ref["version"]).run_id == train_run.info.run_id
    assert client.get_run(train_run.info.run_id).info.status == "RUNNING", "the DAG owns the run's lifecycle"


def _tamper_byte(step_dir: Path) -> None:
    path = step_dir / "model.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").unlink()


def _drop_file(step_dir: Path) -> None:
    (step_dir / "optimizer.pt").unlink()


def _stray_file(step_dir: Path) -> None:
    (step_dir / "model.pt.tmp").write_bytes(b"half a save")


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [(_tamper_byte, "sha256 mismatch"), (_drop_manifest, "no manifest.json"), (_drop_file, "missing"),
     (_stray_file, "extra files")],
    ids=["edited-byte", "uncommitted", "partial", "stray-file"],
)  # fmt: skip
def test_bad_checkpoint_refused_before_anything_is_registered(
    tmp_path, client, unique_name, logged_models, writes, monkeypatch, tamper, reason
):
    policy = sandbox_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    tamper(Path(cand.train.checkpoint))
    clients: list[int] = []
    real_client = registry._client
    monkeypatch.setattr(registry, "_client", lambda: clients.append(1) or real_client())

    with pytest.raises(ManifestError, match=reason) as err:
        registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **cand.kwargs())

    assert cand.train.checkpoint in str(err.value)
    assert clients == [] and writes == [] and logged_models == []
    assert versions(client, policy.candidate_model) == []
    assert client.get_experiment_by_name(registry.experiment_name(policy)) is None or not client.search_runs(
        [client.get_experiment_by_name(registry.experiment_name(policy)).experiment_id],
        filter_string=f"tags.`kiln.run_key` = 'kiln_sandbox/{unique_name}'",
    )


@pytest.mark.parametrize(
    ("ref", "change", "named"),
    [("eval_report", {"weights_sha256": "f" * 64}, "weights_sha256 (EvalReport)"),
     ("train", {"weights_sha256": "f" * 64}, "weights_sha256 (TrainResult)"),
     ("train", {"snapshot_id": "f" * 32 + ".dir"}, "snapshot_id (TrainResult)"),
     ("train", {"checkpoint_manifest_sha256": "f" * 64}, "checkpoint_manifest_sha256"),
     ("snapshot", {"id": "f" * 32 + ".dir"}, "snapshot_id")],
)  # fmt: skip
def test_refs_that_do_not_describe_the_checkpoint_are_refused(
    tmp_path, client, unique_name, logged_models, ref, change, named
):
    policy = sandbox_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    refs = {**cand.kwargs(), ref: dataclasses.replace(cand.kwargs()[ref], **change)}

    with pytest.raises(ManifestError, match=named.replace("(", r"\(").replace(")", r"\)")):
        registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)
    assert versions(client, policy.candidate_model) == [] and logged_models == []


def test_sandbox_policy_cannot_write_the_production_model(mlflow_uri, client, writes, monkeypatch):
    def no_client():
        raise AssertionError("a request was about to be sent")

    monkeypatch.setattr(registry, "_client", no_client)
    with pytest.raises(PolicyError, match="sandbox"):
        registry.rollback(PRODUCTION_MODEL, SANDBOX, "mallory", reason="forged")
    with pytest.raises(PolicyError):
        dataclasses.replace(SANDBOX, target_model=PRODUCTION_MODEL, writable_models=(PRODUCTION_MODEL,))
    assert writes == []
    assert versions(client, PRODUCTION_MODEL) == []


def test_promote_copies_tags_then_moves_alias_last_and_is_idempotent(
    tmp_path, client, unique_name, logged_models, writes, monkeypatch, capsys
):
    policy = production_policy(unique_name)
    target = policy.target_model
    assert registry.champion_report(policy) is None  # no model, no alias: first model

    # First model: no champion, no `previous`.
    a = make_candidate(tmp_path, "a", 3.0)
    ref_a = registry.register_candidate(policy=policy, run_key=f"kiln_production/a-{unique_name}", **a.kwargs())
    decision_a = registry.decide(a.eval_report, registry.champion_report(policy), policy.gate)
    record_a = registry.promote(policy=policy, candidate_version=ref_a["version"], decision=decision_a,
                                approver="alice", run_key=f"kiln_production/a-{unique_name}")  # fmt: skip
    assert (record_a.registered_model, record_a.version, record_a.alias) == (target, "1", "champion")
    assert record_a.previous_version is None
    assert registry.champion_report(policy).bits_per_byte == 3.0
    assert registry.champion_report(policy).snapshot_id == SNAPSHOT_ID  # what the champion watch reports as recorded

    # Second model beats the champion.
    b = make_candidate(tmp_path, "b", 2.9)
    key_b = f"kiln_production/b-{unique_name}"
    ref_b = registry.register_candidate(policy=policy, run_key=key_b, **b.kwargs())
    decision_b = registry.decide(b.eval_report, registry.champion_report(policy), policy.gate)
    assert decision_b.action == "promote" and decision_b.champion_bits_per_byte == 3.0
    writes.clear()
    record_b = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b,
                                approver="bob", run_key=key_b)  # fmt: skip

    assert (record_b.version, record_b.previous_version, record_b.approver) == ("2", "1", "bob")
    kinds = [w[0] for w in writes]
    assert kinds[0] == "copy_model_version"
    assert writes[-1] == ("set_registered_model_alias", target, "champion", "2"), "the alias moves last"
    assert writes[-2] == ("set_registered_model_alias", target, "previous", "1")
    assert set(kinds[1:-2]) == {"set_model_version_tag"}
    assert client.get_model_version_by_alias(target, "champion").version == "2"
    assert client.get_model_version_by_alias(target, "previous").version == "1"
    tags = client.get_model_version(target, "2").tags
    assert tags["kiln.promotion.approver"] == "bob" and tags["kiln.promotion.approved_at"] == record_b.at
    assert json.loads(tags["kiln.decision.reasons"]) == decision_b.reasons
    assert tags["kiln.run_key"] == key_b and tags["kiln.snapshot_id"] == SNAPSHOT_ID  # lineage copied along
    assert tags["kiln.source_version"] == f"{policy.candidate_model}/{ref_b['version']}"

    # Re-run after success: nothing changes.
    writes.clear()
    again = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b,
                             approver="bob", run_key=key_b)  # fmt: skip
    assert again == record_b and writes == []
    assert len(versions(client, target)) == 2

    # A crash right after the copy (before any tag or alias): the retry reuses the copy.
    c = make_candidate(tmp_path, "c", 2.8)
    key_c = f"kiln_production/c-{unique_name}"
    ref_c = registry.register_candidate(policy=policy, run_key=key_c, **c.kwargs())
    client.copy_model_version(f"models:/{policy.candidate_model}/{ref_c['version']}", target)
    decision_c = registry.decide(c.eval_report, registry.champion_report(policy), policy.gate)
    record_c = registry.promote(policy=policy, candidate_version=ref_c["version"], decision=decision_c,
                                approver="carol", run_key=key_c)  # fmt: skip
    assert (record_c.version, record_c.previous_version) == ("3", "2")
    assert len(versions(client, target)) == 3

    # Rollback: champion back to the `previous` holder, audited; a second rollback changes nothing.
    writes.clear()
    rolled = registry.rollback(target, policy, "dave", reason="INC-1 regression")
    assert (rolled.version, rolled.previous_version, rolled.approver) == ("2", "3", "dave")
    assert writes[-1] == ("set_registered_model_alias", target, "champion", "2")
    assert client.get_model_version_by_alias(target, "champion").version == "2"
    assert client.get_model_version(target, "2").tags["kiln.rollback.actor"] == "dave"
    assert client.get_model_version(target, "3").tags["kiln.rolled_back.by"] == "dave"
    writes.clear()
    assert registry.rollback(target, policy, "dave", reason="INC-1 regression") == rolled and writes == []

    # The operator CLI: roll forward to version 3 of the target model (gate: 2.8 vs champion 2.9).
    from kiln.cli import registry as cli

    monkeypatch.setitem(POLICIES, "production", policy)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["promote", target, "3", "--policy", "production", "--approver", "erin"])
    capsys.readouterr()  # drop what mlflow printed so far (run links)
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["version"] == "3"
    assert client.get_model_version_by_alias(target, "champion").version == "3"
    args = parser.parse_args(["rollback", target, "--policy", "production", "--actor", "erin", "--reason", "INC-3"])
    assert args.func(args) == 0
    assert client.get_model_version_by_alias(target, "champion").version == "2"


def test_promote_refuses_a_decision_about_other_metrics(tmp_path, client, unique_name, logged_models, writes):
    policy = production_policy(unique_name)
    a = make_candidate(tmp_path, "a", 3.0)
    ref = registry.register_candidate(policy=policy, run_key=f"kiln_production/{unique_name}", **a.kwargs())
    wrong = registry.decide(dataclasses.replace(a.eval_report, bits_per_byte=1.0), None, policy.gate)
    writes.clear()
    with pytest.raises(PolicyError, match="evaluated at"):
        registry.promote(policy=policy, candidate_version=ref["version"], decision=wrong, approver="alice",
                         run_key=f"kiln_production/{unique_name}")  # fmt: skip
    assert writes == []
    assert versions(client, policy.target_model) == []


def test_cli_promote_of_a_held_candidate_exits_3(tmp_path, client, unique_name, logged_models, monkeypatch):
    from kiln.cli import registry as cli

    policy = production_policy(unique_name)
    bad = make_candidate(tmp_path, "bad", 9.0)  # above the 7.5 bits/byte ceiling
    ref = registry.register_candidate(policy=policy, run_key=f"kiln_production/{unique_name}", **bad.kwargs())
    assert ref["decision"]["action"] == "hold"
    monkeypatch.setitem(POLICIES, "production", policy)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["promote", policy.candidate_model, ref["version"], "--approver", "alice"])
    assert args.func(args) == cli.GATE_SAID_NO
    assert versions(client, policy.target_model) == []


def test_rollback_without_previous_is_an_error(mlflow_uri, unique_name):
    policy = production_policy(unique_name)
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        registry.rollback(policy.target_model, policy, "dave", reason="INC-2")


def test_server_down_is_a_registry_error(tmp_path, unique_name, monkeypatch):
    from kiln.mlflow_server import free_port

    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "1")
    monkeypatch.delenv("KILN_REGISTRY_BACKOFF_S", raising=False)
    monkeypatch.delenv("KILN_REGISTRY_BACKOFF_MAX_S", raising=False)
    waits: list[float] = []
    monkeypatch.setattr(registry, "_sleep", waits.append)
    previous = mlflow.get_tracking_uri()
    try:
        with pytest.raises(RegistryError) as err:
            registry.champion_report(production_policy(unique_name))
    finally:
        mlflow.set_tracking_uri(previous)
    assert err.value.retryable and err.value.__cause__ is not None
    assert "after 2 attempt(s)" in str(err.value) and waits == [2.0]  # retried once, with backoff


def write_real_checkpoint(run_dir: Path, manifest: TrainingManifest, step: int = 4) -> Path:
    """A real committed checkpoint of a tiny GPT, written by the trainer's own CheckpointWriter."""
    import io

    import torch

    from kiln_trainer.checkpoint import CheckpointIdentity, CheckpointWriter
    from kiln_trainer.config import ModelConfig, Recipe
    from kiln_trainer.model import GPT

    recipe = Recipe(model=ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
    writer = CheckpointWriter(
        run_dir,
        CheckpointIdentity(world_size=1, recipe=recipe.to_dict(), recipe_sha256=recipe.sha256,
                           snapshot_id=manifest.snapshot_id, training_manifest_sha256=manifest.sha256),
        keep_last=1, async_save=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    rng = io.BytesIO()
    torch.save({}, rng)
    writer.save(step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                trainer_state={"step": step}, rng_blobs=[rng.getvalue()])  # fmt: skip
    writer.close()
    return checkpoint_manifest.latest_committed(run_dir)


def test_real_checkpoint_is_registered_as_a_pytorch_model_that_generates(tmp_path, client, unique_name):
    """No stand-in: kiln_trainer.export logs the real checkpoint; the registered version loads and generates."""
    import mlflow.pytorch

    manifest = build_manifest(tmp_path)
    step_dir = write_real_checkpoint(tmp_path / "run", manifest)
    verified = checkpoint_manifest.verify_checkpoint(step_dir)
    train = TrainResult(run_dir=str(tmp_path / "run"), checkpoint=str(step_dir),
                        checkpoint_manifest_sha256=sha256_file(step_dir / "manifest.json"),
                        weights_sha256=verified["weights_sha256"], step=verified["step"], metrics={})  # fmt: skip
    report = EvalReport(checkpoint=str(step_dir), weights_sha256=verified["weights_sha256"], split="eval",
                        bits_per_byte=7.9, loss=5.5, tokens=64)  # fmt: skip
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=4, bytes=1024, dvc=DVC_TEXT,
                           remote="/tmp/dvc-remote", path="/tmp/dvc-repo/stdlib-py")  # fmt: skip
    policy = sandbox_policy(unique_name)

    ref = registry.register_candidate(policy=policy, train=train, eval_report=report, snapshot=snapshot,
                                      manifest=manifest, run_key=f"kiln_sandbox/{unique_name}")  # fmt: skip

    assert ref["decision"]["action"] == "promote"  # sandbox gate: 8.0 bits/byte ceiling
    model = mlflow.pytorch.load_model(ref["model_uri"])
    generated = model.generate(b"def ", max_new_tokens=8)
    assert isinstance(generated, bytes) and len(generated) == 8
    tags = client.get_model_version(policy.candidate_model, ref["version"]).tags
    assert tags["kiln.weights_sha256"] == verified["weights_sha256"]
    assert tags["kiln.recipe_sha256"] == verified["recipe_sha256"]


def _write_metrics_jsonl(run_dir: Path) -> None:
    """The trainer's metrics.jsonl: steps 1-6, a rollback event, a resume that re-logs step 5-6, a torn line."""
    lines = [{"step": s, "loss": 5.0 - 0.5 * s, "lr": 0.1} for s in range(1, 7)]
    lines.insert(4, {"step": 4, "event": "rollback", "kind": "rollback", "at_step": 4, "to_step": 2})
    lines += [{"step": 5, "loss": 2.4}, {"step": 6, "loss": 2.1}, {"step": 7, "loss": None}]
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"step": 8, "lo'
    (run_dir / "metrics.jsonl").write_text(text)


def test_evaluation_report_has_loss_curve_and_metrics_against_the_champion(tmp_path, client, unique_name, logged_models):
    import mlflow.artifacts

    policy = production_policy(unique_name)
    a = make_candidate(tmp_path, "a", 3.0)
    ref_a = registry.register_candidate(policy=policy, run_key=f"kiln_production/a-{unique_name}", **a.kwargs())
    registry.promote(policy=policy, candidate_version=ref_a["version"], approver="alice",
                     decision=registry.decide(a.eval_report, None, policy.gate),
                     run_key=f"kiln_production/a-{unique_name}")  # fmt: skip
    first_report = mlflow.artifacts.load_text(ref_a["report_uri"])
    assert "No loss curve" in first_report and "none: first model" in first_report  # no history, no champion

    # Candidate b: no MLflow training run, so the curve comes from the trainer's metrics.jsonl.
    b = make_candidate(tmp_path, "b", 2.9)
    b.train = dataclasses.replace(b.train, events=[{"kind": "rollback", "at_step": 4, "to_step": 2}])
    _write_metrics_jsonl(Path(b.train.run_dir))
    ref_b = registry.register_candidate(policy=policy, run_key=f"kiln_production/b-{unique_name}", **b.kwargs())

    assert ref_b["report_uri"] == f"runs:/{ref_b['run_id']}/evaluation/report.html"
    page = mlflow.artifacts.load_text(ref_b["report_uri"])
    assert '<img alt="training loss" src="data:image/png;base64,' in page  # self-contained for the UI
    assert "champion (v1)" in page and "<td>2.9000</td><td>3.0000</td><td>-0.1000</td>" in page
    assert "metrics.jsonl; 6 steps; guard rollbacks at steps [4]" in page
    assert "regression passed" in page
    markdown = mlflow.artifacts.load_text(f"runs:/{ref_b['run_id']}/evaluation/report.md")
    assert "![training loss](loss_curve.png)" in markdown and "| bits per byte | 2.9000 | 3.0000 | -0.1000 |" in markdown
    png = Path(mlflow.artifacts.download_artifacts(f"runs:/{ref_b['run_id']}/evaluation/loss_curve.png",
                                                   dst_path=str(tmp_path / "dl")))  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    description = client.get_model_version(policy.candidate_model, ref_b["version"]).description
    assert "Gate: **promote**" in description and "champion (v1)" in description and "-0.1000" in description
    assert f"`{ref_b['run_id']}`" in description and "evaluation/report.html" in description
    assert "step 10/10, completed true" in description

    # Candidate c: its training run logged `loss` to MLflow; that history is the curve (re-logged
    # step 2 after a resume: the later value wins).
    experiment_id = client.create_experiment(f"train-{unique_name}")
    run_id = client.create_run(experiment_id).info.run_id
    for step, loss, ts in ((1, 4.0, 1000), (2, 3.9, 2000), (3, 3.5, 3000), (2, 3.6, 4000)):
        client.log_metric(run_id, "loss", loss, timestamp=ts, step=step)
    c = make_candidate(tmp_path, "c", 2.95, mlflow_run_id=run_id)
    ref_c = registry.register_candidate(policy=policy, run_key=f"kiln_production/c-{unique_name}", **c.kwargs())
    page = mlflow.artifacts.load_text(ref_c["report_uri"])
    assert f"Source: MLflow metric `loss` of run {run_id}; 3 steps" in page
    assert registry.loss_curve(client, run_id, c.train).points == [(1, 4.0), (2, 3.6), (3, 3.5)]


def test_rerun_after_rollback_needs_a_fresh_approval_and_audit_tells_the_story(
    tmp_path, client, unique_name, logged_models, writes, monkeypatch, capsys
):
    """Issue 7's re-run rule and issue 8's audit trail on a real server: an Airflow re-run of the
    promote task of a rolled-back version (same run, same old approval) is refused and moves
    nothing; only an approval given after the rollback moves it back. ``kiln audit`` then prints
    every review, promotion and rollback with who, when and what."""
    from kiln.cli import audit as audit_cli

    policy = production_policy(unique_name)
    target = policy.target_model

    def register_and_promote(name: str, bpb: float, approver: str) -> tuple[dict, Any, str, str]:
        cand = make_candidate(tmp_path, name, bpb)
        key = f"kiln_production/{name}-{unique_name}"
        ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs())
        decision = registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
        approved_at = registry.utc_now()  # the reviewer's answer, as the HITL task reports it
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, approver=approver,
                         run_key=key, approved_at=approved_at)  # fmt: skip
        registry.record_review(policy=policy, candidate_version=ref["version"], outcome="approved",
                               reviewer=approver, at=approved_at)  # fmt: skip
        return ref, decision, key, approved_at

    register_and_promote("a", 3.0, "alice")
    ref_b, decision_b, key_b, approved_b = register_and_promote("b", 2.9, "bob")
    assert client.get_model_version_by_alias(target, "champion").version == "2"
    c = make_candidate(tmp_path, "c", 2.85)
    ref_c = registry.register_candidate(policy=policy, run_key=f"kiln_production/c-{unique_name}", **c.kwargs())
    registry.record_review(policy=policy, candidate_version=ref_c["version"], outcome="rejected", reviewer="reviewer",
                           at=registry.utc_now(), comment="loss curve spikes at step 200")  # fmt: skip

    rolled = registry.rollback(target, policy, "carol", reason="INC-7: answers in the wrong language")
    assert (rolled.version, rolled.previous_version) == ("1", "2")
    tags = client.get_model_version(target, "2").tags
    assert tags["kiln.rolled_back.by"] == "carol" and tags["kiln.rolled_back.reason"].startswith("INC-7")

    # The promote task of run b cleared and re-run in Airflow: same run key, the old approval.
    writes.clear()
    with pytest.raises(PolicyError, match=r"version 2 was rolled back by carol .*INC-7.*approval given after that"):
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, approver="bob",
                         run_key=key_b, approved_at=approved_b)  # fmt: skip
    assert writes == [], "the refused re-run wrote nothing"
    assert client.get_model_version_by_alias(target, "champion").version == "1"
    with pytest.raises(PolicyError, match="rolled back"):  # nor without any approval (a policy without review)
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, approver="policy",
                         run_key=key_b)  # fmt: skip

    # A fresh approval (after the rollback) may move it back: the same version, no new copy.
    record = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, approver="erin",
                              run_key=key_b, approved_at=registry.utc_now())  # fmt: skip
    assert (record.version, record.previous_version) == ("2", "1")
    assert len(versions(client, target)) == 2

    events = registry.audit_history(target, policy)
    summary = [(e["event"], e["actor"], e.get("from_version", ""), e.get("to_version", ""), e.get("decision", ""))
               for e in events]  # fmt: skip
    assert summary == [
        ("promotion", "alice", "", "1", "promote"),
        ("review", "alice", "", "", "approved"),
        ("promotion", "bob", "1", "2", "promote"),
        ("review", "bob", "", "", "approved"),
        ("review", "reviewer", "", "", "rejected"),
        ("rollback", "carol", "2", "1", ""),
        ("promotion", "erin", "1", "2", "promote"),
    ], summary
    rejected = events[4]
    assert rejected["model"] == policy.candidate_model and rejected["comment"] == "loss curve spikes at step 200"
    assert events[5]["reason"].startswith("INC-7") and events[5]["model"] == target
    assert all(e["at"] for e in events)

    monkeypatch.setitem(POLICIES, "production", policy)
    parser = argparse.ArgumentParser()
    audit_cli.add_parser(parser.add_subparsers(dest="command"))
    capsys.readouterr()
    args = parser.parse_args(["audit", target, "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == events
    args = parser.parse_args(["audit", target])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "champion 2 -> 1: INC-7" in table and "review: rejected — loss curve spikes" in table
    with pytest.raises(RegistryError, match="does not exist"):
        registry.audit_history(f"{target}-missing")

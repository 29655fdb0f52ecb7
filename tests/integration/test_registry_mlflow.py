"""kiln.registry against a real ``mlflow server`` (fixture in conftest.py).

Most checkpoints here are step directories in the trainer's commit format (payload files + a
``manifest.json`` with per-file sha256, written last), checked by the trainer's own
``verify_checkpoint``. Their payload bytes are not torch weights, so those tests log a tiny real
MLflow pyfunc model in place of ``kiln_trainer.export.log_model`` (fixture ``logged_models``); that
keeps the registry logic fast to test. One test writes a real tiny-GPT checkpoint with the trainer's
``CheckpointWriter`` and goes through the real export: the version loads with
``mlflow.pyfunc.load_model``, turns a prompt into text, and ``mlflow models serve`` answers with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kiln import registry
from kiln.errors import ManifestError, PolicyError, ProvenanceError, RegistryError, RunMismatchError
from kiln.policy import POLICIES, PRODUCTION, PRODUCTION_MODEL, SANDBOX, Policy
from kiln.refs import Decision, EvalReport, SnapshotRef, TrainingManifest, TrainResult, sha256_file
from kiln.runs import experiment_name
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
    for name in sorted(checkpoint_manifest.expected_files(1, format_version=1)):
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
                "manifest": self.manifest}


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
                        bits_per_byte=bits_per_byte, loss=bits_per_byte * math.log(2), tokens=4096)
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=4, bytes=1024, dvc=DVC_TEXT,
                           remote="/tmp/dvc-remote", path="/tmp/dvc-repo/stdlib-py")
    return Candidate(train=train, eval_report=report, snapshot=snapshot, manifest=manifest)


def sandbox_policy(suffix: str) -> Policy:
    name = f"sandbox.test-{suffix}"
    return dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))


REVIEWERS = ("alice", "bob", "carol", "erin", "reviewer")


def production_policy(suffix: str) -> Policy:
    target = f"test-{suffix}"
    return dataclasses.replace(PRODUCTION, candidate_model=f"{target}.candidates", target_model=target,
                               writable_models=(f"{target}.candidates", target), reviewers=REVIEWERS)


def approve(policy: Policy, ref: dict[str, Any], run_key: str, reviewer: str, at: str | None = None) -> str:
    """What the run's approval task records when ``reviewer`` answers Approve; returns the time."""
    at = at or registry.utc_now()
    registry.record_review(policy=policy, candidate_version=ref["version"], run_key=run_key, outcome="approved",
                           reviewer=reviewer, at=at)
    return at


# ------------------------------------------------------------------------------------------ fixtures


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
    )
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


def test_a_version_this_run_registered_from_other_weights_is_refused_not_reused(
    tmp_path, client, unique_name, logged_models
):
    policy = sandbox_policy(unique_name)
    run_key = f"kiln_sandbox/probe_col-{unique_name}"
    registry.register_candidate(policy=policy, run_key=run_key, **make_candidate(tmp_path, "a", 3.0).kwargs())
    other = make_candidate(tmp_path, "b", 3.0)  # another checkpoint of the same recipe and data: other weights
    with pytest.raises(RunMismatchError, match=r"version 1 was registered for run .* from other inputs.*"
                                               r"kiln\.weights_sha256: registered '[0-9a-f]+', now '[0-9a-f]+'") as info:
        registry.register_candidate(policy=policy, run_key=run_key, **other.kwargs())
    assert "kiln.checkpoint:" in str(info.value) and "kiln.recipe_sha256" not in str(info.value)
    assert [mv.version for mv in versions(client, policy.candidate_model)] == ["1"]
    assert client.get_model_version(policy.candidate_model, "1").tags["kiln.weights_sha256"] != other.train.weights_sha256


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
)
def test_bad_checkpoint_refused_before_anything_is_registered(
    tmp_path, client, unique_name, logged_models, writes, monkeypatch, tamper, reason
):
    policy = sandbox_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    tamper(Path(cand.train.checkpoint))
    clients: list[int] = []
    real_client = registry.mlflow_io._client
    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: clients.append(1) or real_client())

    with pytest.raises(ManifestError, match=reason) as err:
        registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **cand.kwargs())

    assert cand.train.checkpoint in str(err.value)
    assert clients == [] and writes == [] and logged_models == []
    assert versions(client, policy.candidate_model) == []
    assert client.get_experiment_by_name(experiment_name(policy)) is None or not client.search_runs(
        [client.get_experiment_by_name(experiment_name(policy)).experiment_id],
        filter_string=f"tags.`kiln.run_key` = 'kiln_sandbox/{unique_name}'",
    )


@pytest.mark.parametrize(
    ("ref", "change", "named"),
    [("eval_report", {"weights_sha256": "f" * 64}, "weights_sha256 (EvalReport)"),
     ("train", {"weights_sha256": "f" * 64}, "weights_sha256 (TrainResult)"),
     ("train", {"snapshot_id": "f" * 32 + ".dir"}, "snapshot_id (TrainResult)"),
     ("train", {"checkpoint_manifest_sha256": "f" * 64}, "checkpoint_manifest_sha256"),
     ("snapshot", {"id": "f" * 32 + ".dir"}, "snapshot_id")],
)
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

    monkeypatch.setattr(registry.mlflow_io, "_client", no_client)
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
    approve(policy, ref_a, f"kiln_production/a-{unique_name}", "alice")
    record_a = registry.promote(policy=policy, candidate_version=ref_a["version"], decision=decision_a,
                                run_key=f"kiln_production/a-{unique_name}")
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
    approve(policy, ref_b, key_b, "bob")
    writes.clear()
    record_b = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b,
                                run_key=key_b)

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
    assert tags["kiln.promotion.approval"] == "review"
    assert json.loads(tags["kiln.decision.reasons"]) == decision_b.reasons
    assert tags["kiln.run_key"] == key_b and tags["kiln.snapshot_id"] == SNAPSHOT_ID  # lineage copied along
    assert tags["kiln.source_version"] == f"{policy.candidate_model}/{ref_b['version']}"

    # Re-run after success: nothing changes.
    writes.clear()
    again = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b,
                             run_key=key_b)
    assert again == record_b and writes == []
    assert len(versions(client, target)) == 2

    # A crash right after the copy (before any tag or alias): the retry reuses the copy.
    c = make_candidate(tmp_path, "c", 2.8)
    key_c = f"kiln_production/c-{unique_name}"
    ref_c = registry.register_candidate(policy=policy, run_key=key_c, **c.kwargs())
    client.copy_model_version(f"models:/{policy.candidate_model}/{ref_c['version']}", target)
    decision_c = registry.decide(c.eval_report, registry.champion_report(policy), policy.gate)
    approve(policy, ref_c, key_c, "carol")
    record_c = registry.promote(policy=policy, candidate_version=ref_c["version"], decision=decision_c,
                                run_key=key_c)
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
    rolled_forward = client.get_model_version(target, "3").tags
    assert (rolled_forward["kiln.promotion.approver"], rolled_forward["kiln.promotion.approval"]) == ("erin", "manual")
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
        registry.promote(policy=policy, candidate_version=ref["version"], decision=wrong,
                         run_key=f"kiln_production/{unique_name}")
    assert writes == []
    assert versions(client, policy.target_model) == []


@pytest.mark.parametrize("policy_name", ["sandbox", "production"])
def test_a_forged_promote_decision_for_a_candidate_the_gate_held_is_refused_and_writes_nothing(
    tmp_path, client, unique_name, logged_models, writes, policy_name
):
    """What the promote task gets when the model gate's XCom is forged through the REST API (any
    Airflow user with the role "user" may write it): "promote" for a candidate whose registration
    recorded "hold". Refused, whatever the policy; under production even after a reviewer's approval."""
    policy = sandbox_policy(unique_name) if policy_name == "sandbox" else production_policy(unique_name)
    held = make_candidate(tmp_path, "held", 9.0)  # above both policies' ceilings (8.0 and 7.5 bits/byte)
    key = f"{policy.dag_id}/held-{unique_name}"
    ref = registry.register_candidate(policy=policy, run_key=key, **held.kwargs())
    assert ref["decision"]["action"] == "hold"
    forged = Decision.from_json({**ref["decision"], "action": "promote"})
    if policy.requires_approval:
        approve(policy, ref, key, "reviewer")  # a reviewer, shown the forged "promote", approved
    before = _promotion_state(client, policy, ref["version"])
    writes.clear()

    with pytest.raises(PolicyError, match="says 'promote', but the gate recorded 'hold'.*threshold FAILED") as err:
        registry.promote(policy=policy, candidate_version=ref["version"], decision=forged, run_key=key)

    assert not err.value.retryable
    assert writes == [] and _promotion_state(client, policy, ref["version"]) == before
    assert before["aliases"] == {} and "kiln.promotion.approver" not in before["candidate_tags"]


def test_a_version_without_a_recorded_gate_decision_is_not_promoted(tmp_path, client, unique_name, logged_models,
                                                                    writes):
    policy = sandbox_policy(unique_name)
    a = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_sandbox/{unique_name}"
    ref = registry.register_candidate(policy=policy, run_key=key, **a.kwargs())
    client.delete_model_version_tag(policy.candidate_model, ref["version"], registry.TAGS["decision"])
    writes.clear()
    with pytest.raises(PolicyError, match="records no gate decision"):
        registry.promote(policy=policy, candidate_version=ref["version"],
                         decision=Decision.from_json(ref["decision"]), run_key=key)
    assert writes == [] and _promotion_state(client, policy, ref["version"])["aliases"] == {}


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
    import mlflow

    from kiln.stack.mlflow_server import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "1")
    monkeypatch.delenv("KILN_REGISTRY_BACKOFF_S", raising=False)
    monkeypatch.delenv("KILN_REGISTRY_BACKOFF_MAX_S", raising=False)
    waits: list[float] = []
    monkeypatch.setattr(registry.mlflow_io, "_sleep", waits.append)
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
    )
    torch.manual_seed(0)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    rng = io.BytesIO()
    torch.save({}, rng)
    writer.save(step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                trainer_state={"step": step}, rng_blobs=[rng.getvalue()])
    writer.close()
    return checkpoint_manifest.latest_committed(run_dir)


def test_real_checkpoint_is_registered_as_a_text_model_that_generates_and_serves(tmp_path, client, unique_name,
                                                                                mlflow_uri):
    """No stand-in: kiln_trainer.export logs the real checkpoint; the registered version, loaded by
    its registry name, turns prompts into text, and ``mlflow models serve`` answers a text request."""
    import subprocess
    import sys
    import time

    import mlflow.pyfunc
    import requests

    from kiln.util.net import free_port

    manifest = build_manifest(tmp_path)
    step_dir = write_real_checkpoint(tmp_path / "run", manifest)
    verified, refs = _refs_of(step_dir, manifest)
    policy = sandbox_policy(unique_name)

    ref = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)

    assert ref["decision"]["action"] == "promote"  # sandbox gate: 8.0 bits/byte ceiling
    uri = f"models:/{policy.candidate_model}/{ref['version']}"
    model = mlflow.pyfunc.load_model(uri)
    texts = model.predict(["def main("], params={"max_new_tokens": 8})
    assert len(texts) == 1 and isinstance(texts[0], str)
    tags = client.get_model_version(policy.candidate_model, ref["version"]).tags
    assert tags["kiln.weights_sha256"] == verified["weights_sha256"]
    assert tags["kiln.recipe_sha256"] == verified["recipe_sha256"]
    # the real export was signed before upload: the version verifies (files, signatures, tags, logged model)
    from kiln.registry.verify import verify_version

    checked = verify_version(client, client.get_model_version(policy.candidate_model, ref["version"]), "sandbox")
    names = {s["name"] for s in checked.statement["subject"]}
    assert {"MLmodel", "mlflow_model.py", "artifacts/hf_model/model.safetensors"} <= names
    assert not [n for n in names if n.endswith((".pkl", ".pt", ".bin", ".pth"))]

    port = free_port()
    serve_log = open(tmp_path / "serve.log", "w")  # noqa: SIM115  (closed below; a pipe could fill and stall it)
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local",
                               "--host", "127.0.0.1", "-p", str(port)], stdout=serve_log,
                              stderr=subprocess.STDOUT, text=True,
                              # serve runs `uvicorn` by name: the venv's bin, as an activated venv has it
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    try:
        deadline = time.monotonic() + 180  # a safety net, not a timing assertion
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not come up"
            time.sleep(0.5)
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", timeout=60,
                               json={"inputs": ["def main("], "params": {"max_new_tokens": 8}})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"predictions": texts}
    finally:
        server.terminate()
        server.wait(timeout=30)
        serve_log.close()


def _sharded_candidate(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A real format-3 (fsdp) checkpoint written by the trainer's sharded writer, and the refs of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trainer_fixtures", Path(__file__).resolve().parents[1] / "unit" / "training" / "trainer_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    manifest = build_manifest(tmp_path)
    fixtures.write_sharded_checkpoints(tmp_path / "run", [4], snapshot_id=manifest.snapshot_id,
                                       training_manifest_sha256=manifest.sha256)
    step_dir = checkpoint_manifest.latest_committed(tmp_path / "run")
    verified, refs = _refs_of(step_dir, manifest)
    return step_dir, verified, refs


def _refs_of(step_dir: Path, manifest: TrainingManifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The verified manifest of a real checkpoint and the refs register_candidate takes for it."""
    verified = checkpoint_manifest.verify_checkpoint(step_dir)
    train = TrainResult(run_dir=str(step_dir.parents[1]), checkpoint=str(step_dir),
                        checkpoint_manifest_sha256=sha256_file(step_dir / "manifest.json"),
                        weights_sha256=verified["weights_sha256"], step=verified["step"], metrics={})
    report = EvalReport(checkpoint=str(step_dir), weights_sha256=verified["weights_sha256"], split="eval",
                        bits_per_byte=7.9, loss=5.5, tokens=64)
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=4, bytes=1024, dvc=DVC_TEXT,
                           remote="/tmp/dvc-remote", path="/tmp/dvc-repo/stdlib-py")
    return verified, {"train": train, "eval_report": report, "snapshot": snapshot, "manifest": manifest}


def test_a_sharded_checkpoint_is_verified_then_consolidated_into_the_text_models_hf_folder(tmp_path, client, unique_name):
    import mlflow.artifacts
    import mlflow.pyfunc
    from safetensors.torch import load_file

    from kiln_trainer.checkpoint import weights_sha256
    from kiln_trainer.hf import kiln_state_dict

    step_dir, verified, refs = _sharded_candidate(tmp_path)
    assert verified["format"] == 3 and verified["strategy"] == "fsdp"
    policy = sandbox_policy(unique_name)

    ref = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)

    uri = f"models:/{policy.candidate_model}/{ref['version']}"
    texts = mlflow.pyfunc.load_model(uri).predict(["def main("], params={"max_new_tokens": 8})
    assert len(texts) == 1 and isinstance(texts[0], str)
    # The served weights are the shards consolidated: the whole model, whose safetensors map back to
    # kiln's state dict hashing to the checkpoint's weights_sha256.
    local = Path(mlflow.artifacts.download_artifacts(f"{uri}/artifacts/hf_model/model.safetensors",
                                                     dst_path=str(tmp_path / "dl")))
    served = kiln_state_dict(load_file(local), verified["recipe"]["model"])
    assert weights_sha256(served) == verified["weights_sha256"]
    assert client.get_model_version(policy.candidate_model, ref["version"]).tags["kiln.weights_sha256"] == (
        verified["weights_sha256"])


def test_a_tampered_shard_is_refused_before_any_request_reaches_mlflow(tmp_path, client, unique_name, monkeypatch):
    step_dir, _, refs = _sharded_candidate(tmp_path)
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    clients: list[int] = []
    real_client = registry.mlflow_io._client
    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: clients.append(1) or real_client())
    policy = sandbox_policy(unique_name)

    with pytest.raises(ManifestError, match=r"'__0_0.distcp' sha256 mismatch"):
        registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)
    assert clients == [] and versions(client, policy.candidate_model) == []


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
    approve(policy, ref_a, f"kiln_production/a-{unique_name}", "alice")
    registry.promote(policy=policy, candidate_version=ref_a["version"],
                     decision=registry.decide(a.eval_report, None, policy.gate),
                     run_key=f"kiln_production/a-{unique_name}")
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
                                                   dst_path=str(tmp_path / "dl")))
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
        approved_at = approve(policy, ref, key, approver)  # the reviewer's answer, as the approval task records it
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)
        return ref, decision, key, approved_at

    register_and_promote("a", 3.0, "alice")
    ref_b, decision_b, key_b, approved_b = register_and_promote("b", 2.9, "bob")
    assert client.get_model_version_by_alias(target, "champion").version == "2"
    c = make_candidate(tmp_path, "c", 2.85)
    ref_c = registry.register_candidate(policy=policy, run_key=f"kiln_production/c-{unique_name}", **c.kwargs())
    registry.record_review(policy=policy, candidate_version=ref_c["version"], run_key=f"kiln_production/c-{unique_name}",
                           outcome="rejected", reviewer="reviewer", at=registry.utc_now(),
                           comment="loss curve spikes at step 200")

    rolled = registry.rollback(target, policy, "carol", reason="INC-7: answers in the wrong language")
    assert (rolled.version, rolled.previous_version) == ("1", "2")
    tags = client.get_model_version(target, "2").tags
    assert tags["kiln.rolled_back.by"] == "carol" and tags["kiln.rolled_back.reason"].startswith("INC-7")

    # The promote task of run b cleared and re-run in Airflow: same run key, the old approval.
    writes.clear()
    old_approval = rf"version 2 was rolled back by carol .*INC-7.*approval given after that.*{approved_b[:19]}"
    with pytest.raises(PolicyError, match=old_approval):
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)
    assert writes == [], "the refused re-run wrote nothing"
    assert client.get_model_version_by_alias(target, "champion").version == "1"
    with pytest.raises(PolicyError, match="rolled back"):  # nor without any approval (a policy without review)
        registry.promote(policy=dataclasses.replace(policy, requires_approval=False), candidate_version=ref_b["version"],
                         decision=decision_b, run_key=key_b)

    # A fresh approval (run b's approval task asked again, after the rollback) may move it back:
    # the same version, no new copy.
    approve(policy, ref_b, key_b, "erin")
    record = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)
    assert (record.version, record.previous_version, record.approver) == ("2", "1", "erin")
    assert len(versions(client, target)) == 2

    events = registry.audit_history(target, policy)
    summary = [(e["event"], e["actor"], e.get("from_version", ""), e.get("to_version", ""), e.get("decision", ""))
               for e in events]
    assert summary == [
        ("promotion", "alice", "", "1", "promote"),
        ("review", "alice", "", "", "approved"),
        ("promotion", "bob", "1", "2", "promote"),
        ("review", "bob", "", "", "approved"),
        ("review", "reviewer", "", "", "rejected"),
        ("rollback", "carol", "2", "1", ""),
        ("promotion", "erin", "1", "2", "promote"),
        ("review", "erin", "", "", "approved"),
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
    printed = json.loads(capsys.readouterr().out)
    # each promotion and rollback says whether its signed attestation verifies: bob's promotion of version 2
    # too (promoted again by erin since, its tags name erin's), from the file logged for it in the run
    attested = [(e["event"], e["actor"], e["attestation"]["status"], e["attestation"].get("approver", e["actor"]))
                for e in printed[:len(events)] if "attestation" in e]
    assert attested == [("promotion", "alice", "verifies", "alice"), ("promotion", "bob", "verifies", "bob"),
                        ("rollback", "carol", "verifies", "carol"), ("promotion", "erin", "verifies", "erin")], attested
    assert [{k: v for k, v in e.items() if k != "attestation"} for e in printed[:len(events)]] == events
    # then every version it read, each agreeing with its signed statement (untouched since registration)
    checked = [(e["event"], e["model"], e["version"], e["status"]) for e in printed[len(events):]]
    assert checked == [("provenance", target, "1", "agrees"), ("provenance", target, "2", "agrees")] + [
        ("provenance", policy.candidate_model, v, "agrees") for v in ("1", "2", "3")]
    args = parser.parse_args(["audit", target])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "champion 2 -> 1: INC-7" in table and "review: rejected — loss curve spikes" in table

    # bob's earlier promotion event edited: the approval signed for it then says otherwise, and the audit fails
    [(audit_key, body)] = [(k, v) for k, v in client.get_model_version(target, "2").tags.items()
                           if k.startswith("kiln.audit.") and k.endswith(".promotion") and '"actor": "bob"' in v]
    client.set_model_version_tag(target, "2", audit_key, body.replace('"actor": "bob"', '"actor": "mallory"'))
    with pytest.raises(ProvenanceError, match=rf"{re.escape(target)}/2 \(approval attestation of {re.escape(approved_b)} "
                                              r"fails\)"):
        args.func(args)
    table = capsys.readouterr().out
    assert re.search(r"mallory .*; FAILS: approval attestation runs:/\S+ fails: the event's actor is 'mallory', the "
                     r"signed approval says 'bob'", table), table
    assert f"{target}/2  agrees" in table and f"{policy.candidate_model}/3  agrees" in table
    with pytest.raises(RegistryError, match="does not exist"):
        registry.audit_history(f"{target}-missing")


def test_a_change_of_the_reviewed_production_config_shows_in_the_audit_trail(tmp_path, client, unique_name,
                                                                             logged_models, capsys):
    """Each candidate records the production config it ran under; ``kiln audit`` shows a ``config``
    event at the first version trained after the file changed, saying what changed."""
    from kiln.cli.audit import format_table
    from kiln.policy import PRODUCTION_INPUTS

    before = production_policy(unique_name)
    edited = dataclasses.replace(PRODUCTION_INPUTS, contract="stdlib-py@2", sha256="e" * 64)
    after = dataclasses.replace(before, contract=edited.contract, config=edited)
    for policy, name, bpb in ((before, "a", 3.0), (before, "b", 2.9), (after, "c", 2.8)):
        candidate = make_candidate(tmp_path, name, bpb)
        registry.register_candidate(policy=policy, run_key=f"kiln_production/{name}-{unique_name}", **candidate.kwargs())
    tags = client.get_model_version(before.candidate_model, "1").tags
    assert json.loads(tags["kiln.policy.config"]) == PRODUCTION_INPUTS.values()
    assert tags["kiln.policy.config_sha256"] == PRODUCTION_INPUTS.sha256
    events = [e for e in registry.audit_history(before.candidate_model, before) if e["event"] == "config"]
    assert [(e["model"], e["version"], e["changes"], e["to_sha256"]) for e in events] == [
        (before.candidate_model, "3", "contract stdlib-py@1 -> stdlib-py@2", "e" * 64)]
    assert events[0]["at"] and events[0]["actor"].startswith("git ")
    assert "production config: contract stdlib-py@1 -> stdlib-py@2" in format_table(events)


# ------------------------------------------------------------------ approval: only a recorded review


def _promotion_state(client, policy, version: str) -> dict[str, Any]:
    """Everything a promotion could have written: the target model's versions and aliases, and the
    candidate's promotion and review tags."""
    tags = client.get_model_version(policy.candidate_model, version).tags
    try:
        aliases = dict(client.get_registered_model(policy.target_model).aliases)
    except Exception:  # the target model does not exist yet
        aliases = {}
    written = {k: v for k, v in tags.items() if k.startswith(("kiln.promotion", "kiln.review", "kiln.audit."))}
    return {"target_versions": [mv.version for mv in versions(client, policy.target_model)], "aliases": aliases,
            "candidate_tags": written}


def _registered(tmp_path, policy, name: str, bpb: float, unique_name: str) -> tuple[dict, Any, str]:
    cand = make_candidate(tmp_path, name, bpb)
    key = f"kiln_production/{name}-{unique_name}"
    ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs())
    return ref, registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate), key


def test_promotion_without_a_recorded_approval_is_refused_and_writes_nothing(
    tmp_path, client, unique_name, logged_models, writes
):
    """What the promote task does after its approval task was marked success by hand: no review
    was recorded, so nothing moves and nothing is written."""
    policy = production_policy(unique_name)
    ref, decision, key = _registered(tmp_path, policy, "a", 3.0, unique_name)
    before = _promotion_state(client, policy, ref["version"])
    writes.clear()

    with pytest.raises(PolicyError, match=r"requires a reviewer's approval .*no review is recorded") as err:
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)

    assert not err.value.retryable and "kiln promote" in str(err.value)
    assert writes == [] and _promotion_state(client, policy, ref["version"]) == before
    assert before["target_versions"] == [] and before["candidate_tags"] == {}


def test_an_approval_recorded_for_another_run_or_another_version_is_refused(
    tmp_path, client, unique_name, logged_models, writes
):
    policy = production_policy(unique_name)
    ref_a, decision_a, key_a = _registered(tmp_path, policy, "a", 3.0, unique_name)
    ref_b, decision_b, key_b = _registered(tmp_path, policy, "b", 2.95, unique_name)
    approve(policy, ref_a, key_a, "reviewer")  # run a's reviewer approved run a's candidate
    before = {v: _promotion_state(client, policy, v) for v in (ref_a["version"], ref_b["version"])}
    writes.clear()

    # Run b's promote task with a forged register_candidate XCom naming run a's (approved) version.
    with pytest.raises(PolicyError, match=rf"promotes only the candidate it registered.*registered by run '{key_a}'"):
        registry.promote(policy=policy, candidate_version=ref_a["version"], decision=decision_a, run_key=key_b)
    # Run b's own candidate: run a's approval is not run b's.
    with pytest.raises(PolicyError, match="no review is recorded"):
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)
    # Nor does an approval of another version count, even where it is carried along (a promoted copy
    # carries its candidate's tags): run b's version with the record of run a's review copied onto it.
    for field_name in ("outcome", "reviewer", "at", "subject"):
        tag = registry.REVIEW_TAGS["promotion"][field_name]
        client.set_model_version_tag(policy.candidate_model, ref_b["version"], tag,
                                     client.get_model_version(policy.candidate_model, ref_a["version"]).tags[tag])
    client.set_model_version_tag(policy.candidate_model, ref_b["version"], registry.TAGS["review_run_key"], key_b)
    with pytest.raises(PolicyError, match=rf"was about 'promote {policy.candidate_model} version {ref_a['version']}'"):
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)
    # And a review task may record only its own run's candidate.
    with pytest.raises(PolicyError, match=f"registered by run '{key_a}', not by '{key_b}'"):
        approve(policy, ref_a, key_b, "reviewer")

    assert writes == [], "kiln wrote nothing (the tags above were copied by this test's own client)"
    assert _promotion_state(client, policy, ref_a["version"]) == before[ref_a["version"]]
    assert versions(client, policy.target_model) == []


def test_a_rejection_or_an_approval_by_someone_no_longer_a_reviewer_is_refused(
    tmp_path, client, unique_name, logged_models, writes
):
    policy = production_policy(unique_name)
    ref, decision, key = _registered(tmp_path, policy, "a", 3.0, unique_name)
    registry.record_review(policy=policy, candidate_version=ref["version"], run_key=key, outcome="rejected",
                           reviewer="carol", at=registry.utc_now())
    with pytest.raises(PolicyError, match=r"the review recorded in this run says 'rejected' \(carol"):
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)

    approve(policy, ref, key, "carol")  # asked again: carol approves...
    without_carol = dataclasses.replace(policy, reviewers=tuple(r for r in REVIEWERS if r != "carol"))
    writes.clear()
    with pytest.raises(PolicyError, match="approved by 'carol', who is not a reviewer"):  # ...but is no reviewer now
        registry.promote(policy=without_carol, candidate_version=ref["version"], decision=decision, run_key=key)
    assert writes == [] and versions(client, policy.target_model) == []

    record = registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)
    assert (record.approver, record.version) == ("carol", "1")


def test_kiln_promote_by_a_named_person_needs_no_review_and_is_audited_as_manual(
    tmp_path, client, unique_name, logged_models, monkeypatch, capsys
):
    from kiln.cli import registry as cli

    policy = production_policy(unique_name)
    ref, _, key = _registered(tmp_path, policy, "a", 3.0, unique_name)
    monkeypatch.setitem(POLICIES, "production", policy)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["promote", policy.candidate_model, ref["version"], "--approver", "dana"])
    capsys.readouterr()
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["approver"] == "dana" and "by hand" in out.err and "manual" in out.err

    champion = client.get_model_version_by_alias(policy.target_model, "champion")
    assert (champion.tags["kiln.promotion.approver"], champion.tags["kiln.promotion.approval"]) == ("dana", "manual")
    assert champion.tags["kiln.promotion.run_key"] == f"cli/promote-{policy.candidate_model}-{ref['version']}"
    (event,) = [e for e in registry.audit_history(policy.target_model, policy) if e["event"] == "promotion"]
    assert (event["actor"], event["approval"], event["to_version"]) == ("dana", "manual", champion.version)
    assert "kiln.review" not in client.get_model_version(policy.candidate_model, ref["version"]).tags
    # The run itself still could not have promoted it: nobody reviewed it in that run.
    assert registry.recorded_review(policy, ref["version"], key) is None


def test_a_rollback_needs_the_watch_runs_recorded_approval_of_exactly_that_rollback(
    tmp_path, client, unique_name, logged_models
):
    policy = production_policy(unique_name)
    for name, bpb in (("a", 3.0), ("b", 2.9)):
        ref, decision, key = _registered(tmp_path, policy, name, bpb, unique_name)
        approve(policy, ref, key, "alice")
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)
    assert (client.get_model_version_by_alias(policy.target_model, "champion").version,
            client.get_model_version_by_alias(policy.target_model, "previous").version) == ("2", "1")
    watch = f"kiln_champion_watch/{unique_name}"

    # The champion carries its candidate's (promotion) review: it is no rollback approval.
    with pytest.raises(PolicyError, match="no review is recorded on"):
        registry.rollback_approval(policy, "2", "1", watch)
    registry.record_rollback_review(policy=policy, from_version="2", to_version="1", run_key=watch, outcome="rejected",
                                    reviewer="bob", at=registry.utc_now())
    with pytest.raises(PolicyError, match="says 'rejected'"):
        registry.rollback_approval(policy, "2", "1", watch)
    registry.record_rollback_review(policy=policy, from_version="2", to_version="1", run_key=watch, outcome="approved",
                                    reviewer="bob", at=registry.utc_now())
    with pytest.raises(PolicyError, match="was given in run"):
        registry.rollback_approval(policy, "2", "1", f"{watch}-other")
    with pytest.raises(PolicyError, match="was about 'roll .* back from version 2 to version 1'"):
        registry.rollback_approval(policy, "2", "3", watch)
    review = registry.rollback_approval(policy, "2", "1", watch)
    assert (review.reviewer, review.outcome, review.run_key) == ("bob", "approved", watch)
    # Recorded on the target version under its own keys: the promotion review it carries is untouched.
    tags = client.get_model_version(policy.target_model, "2").tags
    assert (tags["kiln.review"], tags["kiln.review.by"], tags["kiln.rollback_review.by"]) == ("approved", "alice", "bob")


def test_the_champion_watch_reuses_a_versions_evaluation_only_of_the_held_out_split_it_asks_for(
    tmp_path, client, unique_name, logged_models
):
    """A report an earlier try of a watch run left (of yesterday's held-out split) is not today's number."""
    from kiln.stages import champion_watch

    policy = sandbox_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_champion_watch/w-{unique_name}"
    version = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs())["version"]
    yesterday = build_manifest(tmp_path)
    new_split = [{"path": str(tmp_path / "eval-new.parquet"), "sha256": "c" * 64, "rows": 7}]
    today = dataclasses.replace(yesterday, eval_shards=new_split)
    today = dataclasses.replace(today, sha256=today.content_hash())
    out = tmp_path / "eval-v1.json"
    out.write_text(json.dumps({
        "kind": "kiln.EvalReport", "checkpoint": str(Path(cand.train.checkpoint).resolve()),
        "weights_sha256": cand.train.weights_sha256, "bits_per_byte": 3.5, "tokens": 100,
        "training_manifest_sha256": yesterday.sha256,
    }))
    same = champion_watch.evaluate_version(policy.candidate_model, version, yesterday.write(tmp_path / "y.json"), out)
    assert same.current_bits_per_byte == 3.5
    with pytest.raises(RunMismatchError, match=f"made '{yesterday.sha256}', asked '{today.sha256}'"):
        champion_watch.evaluate_version(policy.candidate_model, version, today.write(tmp_path / "t.json"), out)

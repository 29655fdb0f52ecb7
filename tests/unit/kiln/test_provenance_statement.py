"""The provenance statement: in-toto Statement v1 + SLSA Provenance v1, the same bytes for the same inputs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import pytest
from provenance_fixtures import H, inputs, make_artifact

from kiln.errors import ConfigError, ProvenanceError
from kiln.provenance.statement import (
    BUILD_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    TrainerIdentity,
    _digest_files,
    _tree_files,
    artifact_files,
    build_statement,
    code_sha256,
    describe,
    package_sha256,
    statement_bytes,
    trainer_package,
)


def test_same_inputs_and_files_give_the_same_bytes(tmp_path):
    a = make_artifact(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    first = statement_bytes(build_statement(a, inputs()))
    assert statement_bytes(build_statement(a, inputs())) == first
    assert statement_bytes(build_statement(b, inputs())) == first  # the directory's own path is not in it
    assert first == json.dumps(json.loads(first), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert statement_bytes(build_statement(a, inputs(seed=7))) != first
    (a / "MLmodel").write_text("other")
    assert statement_bytes(build_statement(a, inputs())) != first


def test_shape_is_in_toto_v1_with_slsa_provenance_v1(tmp_path):
    art = make_artifact(tmp_path / "a")
    (art / "model.sig").write_text("{}")
    (art / "provenance.dsse.json").write_text("{}")
    st = build_statement(art, inputs())
    assert st["_type"] == STATEMENT_TYPE == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == PREDICATE_TYPE == "https://slsa.dev/provenance/v1"
    names = [s["name"] for s in st["subject"]]
    assert names == sorted(names) == ["MLmodel", "artifacts/hf_model/config.json", "artifacts/hf_model/model.safetensors",
                                      "artifacts/recipe.json", "code/kiln_trainer/serving.py"]  # no signature file
    assert all(set(s["digest"]) == {"sha256"} and len(s["digest"]["sha256"]) == 64 for s in st["subject"])
    build = st["predicate"]["buildDefinition"]
    assert build["buildType"] == BUILD_TYPE
    assert build["externalParameters"] == {"recipe": inputs().recipe, "seed": 1337, "world_size": 2, "strategy": "ddp",
                                           "steps": 12}
    assert build["internalParameters"] == {"policy": "production", "dag_id": "kiln_production",
                                           "run_id": "manual__2026-01-01", "launcher": "local",
                                           "nodes": ["node-a", "node-b"]}
    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    assert set(deps) == {"snapshot:stdlib-py", "contract:stdlib-py@1", "quarantine-report", "training-manifest",
                         "tokenizer:byte", "token-manifest", "code:kiln", "trainer:kiln", "torch", "python", "platform"}
    assert deps["snapshot:stdlib-py"]["digest"] == {"md5": "0123456789abcdef0123456789abcdef"}
    assert deps["code:kiln"]["digest"] == {"sha256": H, "gitCommit": "f" * 40}
    assert deps["trainer:kiln"]["annotations"] == {"distribution": "kiln", "version": "0.1.0"}
    assert all(set(d) <= {"name", "uri", "digest", "annotations"} for d in deps.values())
    run = st["predicate"]["runDetails"]
    assert run["builder"] == {"id": "urn:kiln:builder:production", "version": {"kiln": "0.1.0"}}
    assert run["metadata"] == {"invocationId": "kiln_production/manual__2026-01-01",
                               "startedOn": "2026-01-01T00:00:00Z", "finishedOn": "2026-01-01T00:05:00Z"}
    assert [b["name"] for b in run["byproducts"]] == ["checkpoint-manifest", "evaluation-report", "gate-decision"]
    with_approval = build_statement(art, inputs(approval={"approver": "rev", "at": "2026-01-02T00:00:00Z"}))
    assert with_approval["predicate"]["runDetails"]["byproducts"][-1]["name"] == "approval"
    no_tokens = build_statement(art, inputs(token_manifest_sha256="", token_manifest_uri="", git_commit="unknown"))
    no_deps = {d["name"]: d for d in no_tokens["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert "token-manifest" not in no_deps and no_deps["code:kiln"]["digest"] == {"sha256": H}
    text = "\n".join(describe(st))
    assert "seed 1337, world size 2, strategy ddp" in text and "gate decision: promote (first model)" in text


@pytest.mark.parametrize(("change", "named"), [
    ({"policy": "staging"}, "policy"), ({"code_sha256": "XYZ"}, "code_sha256"), ({"world_size": 0}, "world_size"),
    ({"snapshot_id": "abc"}, "snapshot_id"), ({"dag_id": ""}, "dag_id"), ({"nodes": ["a"]}, "nodes"),
    ({"token_manifest_sha256": "1" * 63}, "token_manifest_sha256"), ({"started_on": "yesterday"}, "started_on"),
    ({"finished_on": "2026-01-01T00:00:00"}, "finished_on"), ({"run_key": "kiln_sandbox/manual__2026-01-01"}, "run_key"),
])
def test_bad_inputs_are_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=named):
        inputs(**change)


def test_a_link_in_the_artifact_is_refused(tmp_path):
    art = make_artifact(tmp_path / "a")
    os.symlink(art / "MLmodel", art / "alias")
    with pytest.raises(ProvenanceError, match="alias is a symbolic link"):
        artifact_files(art)
    with pytest.raises(ProvenanceError, match="not a directory"):
        artifact_files(tmp_path / "missing")


def test_code_digest_covers_sources_and_package_data_never_bytecode(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / "mod.py").write_text("x = 1\n")
    (root / "sub" / "recipe.toml").write_text("[train]\n")
    before = _digest_files(_tree_files(root, frozenset({".py", ".toml"})))
    (root / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / "notes.swp").write_bytes(b"\0")
    assert _digest_files(_tree_files(root, frozenset({".py", ".toml"}))) == before
    (root / "sub" / "recipe.toml").write_text("[train]\nsteps = 2\n")
    assert _digest_files(_tree_files(root, frozenset({".py", ".toml"}))) != before
    (root / "sub" / "recipe.toml").rename(root / "recipe.toml")  # same bytes under another name
    assert _digest_files(_tree_files(root, frozenset({".py", ".toml"}))) != before
    installed = code_sha256()
    assert len(installed) == 64 and code_sha256() == installed


def test_trainer_package_digest_is_of_the_entry_points_package_source(tmp_path, monkeypatch):
    assert trainer_package("kiln") == "kiln_trainer" and trainer_package("my_lm.train:main") == "my_lm"
    pkg = tmp_path / "my_lm"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def main():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = package_sha256("my_lm")
    assert len(first) == 64 and "my_lm" not in sys.modules  # found, not imported
    (pkg / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    assert package_sha256("my_lm") == first
    (pkg / "train.py").write_text("def main():\n    return 1\n")
    assert package_sha256("my_lm") != first
    assert package_sha256("no_such_trainer_package") == ""
    assert len(package_sha256("kiln_trainer")) == 64


def test_from_registration_fills_the_inputs_from_the_register_stage_refs(tmp_path):
    from kiln.provenance.statement import environment, from_registration
    from kiln.refs import Decision, EvalReport, SnapshotRef, TrainingManifest, TrainResult

    report = tmp_path / "quarantine.json"
    report.write_text('{"quarantined": []}')
    snapshot = SnapshotRef(id="0123456789abcdef0123456789abcdef.dir", corpus="stdlib-py", files=8, bytes=100,
                           dvc="outs: []", remote="/srv/remote", path="/srv/ws/stdlib-py")
    manifest = TrainingManifest.build(snapshot_id=snapshot.id, corpus="stdlib-py", contract="stdlib-py@1", shards=[],
                                      eval_shards=[]).with_tokens("/runs/r/tokens/token_manifest.json", "c" * 64)
    train = TrainResult(run_dir="/runs/r", checkpoint="/runs/r/checkpoints/step-00000012", checkpoint_manifest_sha256="d" * 64,
                        weights_sha256="e" * 64, step=12, metrics={"loss": 2.0}, world_size=2, total_steps=12)
    evaluation = EvalReport(checkpoint=train.checkpoint, weights_sha256="e" * 64, split="eval", bits_per_byte=2.5,
                            loss=1.7, tokens=4096)
    decision = Decision(action="promote", reasons=["no champion yet"], candidate_bits_per_byte=2.5)
    verified = {"world_size": 2, "recipe": {"train": {"seed": 1337, "steps": 12}, "parallel": {"strategy": "fsdp"}},
                "tokenizer": {"kind": "byte"}, "tokenizer_sha256": "f" * 64, "token_manifest_sha256": "c" * 64,
                "trainer": {"spec": "kiln", "distribution": "kiln", "version": "0.1.0"}}
    got = from_registration(
        policy="production", run_key="kiln_production/manual__1", train=train, eval_report=evaluation, snapshot=snapshot,
        manifest=manifest, verified=verified, decision=decision, contract_suite_sha256="a" * 64, quarantine_report=report,
        launcher="local", nodes=("h1", "h2"), started_on="2026-01-01T00:00:00Z", finished_on="2026-01-01T00:05:00Z")
    assert (got.dag_id, got.run_id, got.seed, got.world_size, got.strategy, got.steps) == (
        "kiln_production", "manual__1", 1337, 2, "fsdp", 12)
    assert got.training_manifest_sha256 == manifest.sha256 and got.token_manifest_uri == "/runs/r/tokens/token_manifest.json"
    assert got.quarantine_report_sha256 == hashlib.sha256(report.read_bytes()).hexdigest()
    assert got.code_sha256 == code_sha256() and got.torch_version == environment()["torch_version"]
    assert got.decision == decision.to_json() and got.eval_report == evaluation.to_json()
    assert got.trainer == TrainerIdentity(spec="kiln", distribution="kiln", version="0.1.0",
                                          sha256=package_sha256("kiln_trainer"))
    statement = build_statement(make_artifact(tmp_path / "a"), got)
    assert statement["predicate"]["runDetails"]["metadata"]["invocationId"] == "kiln_production/manual__1"

"""The sandbox DAG under a real scheduler (not `dags test`): triggered through the REST API like the
UI form, it snapshots, quarantines the poisoned shards, trains with torchrun -- with the form's
parallel strategy set to fsdp, so every rank writes its own checkpoint shards -- evaluates and
registers (the shards consolidated into the served model) + promotes under the sandbox model name
only; checked afterwards in MLflow's registry. (The production DAG's tests and the demo train ddp.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def test_sandbox_run_end_to_end(stack, admin):
    import mlflow

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION_MODEL, SANDBOX
    from kiln.stack.demo import follow_run

    s = kiln_settings.load()
    built = build_corpus(s.corpus_root / SANDBOX.corpus, shards=6, seed=3, poison=("garbage_bytes", "eval_contamination"))
    poisoned = {Path(p).name for p in built["poisoned"]}
    assert len(poisoned) == 2

    admin.wait_for_dag(SANDBOX.dag_id)
    admin.unpause(SANDBOX.dag_id)
    with pytest.raises(Exception, match="400|nodes"):  # the form's limits hold over REST too
        admin.trigger(SANDBOX.dag_id, conf={"nodes": 7})
    run = admin.trigger(SANDBOX.dag_id, conf={"recipe": "tiny.toml", "max_steps": 30, "seed": 5, "strategy": "fsdp"})
    final = follow_run(admin, SANDBOX.dag_id, run["dag_run_id"], timeout=780, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(SANDBOX.dag_id, run["dag_run_id"])}
    assert final["state"] == "success", states

    snap = admin.xcom(SANDBOX.dag_id, run["dag_run_id"], "snapshot")
    gate = admin.xcom(SANDBOX.dag_id, run["dag_run_id"], "data_gate")
    assert {q["path"] for q in gate["quarantined"]} == poisoned
    manifest = json.loads(Path(gate["manifest"]).read_text())
    assert all(Path(sh["path"]).name not in poisoned for sh in manifest["shards"])
    assert len(manifest["shards"]) == 4

    promotion = admin.xcom(SANDBOX.dag_id, run["dag_run_id"], "promote")
    assert promotion["registered_model"] == SANDBOX.target_model and promotion["alias"] == SANDBOX.alias

    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"])
    version = client.get_model_version_by_alias(SANDBOX.target_model, SANDBOX.alias)
    assert version.tags["kiln.snapshot_id"] == snap["id"]
    # The manifest it trained on is the gate's, naming the shards packed by the tokenize stage.
    tokens = admin.xcom(SANDBOX.dag_id, run["dag_run_id"], "tokens")
    assert tokens["manifest"] == gate["manifest"] and tokens["tokens"]["tokenizer_kind"] == "byte"
    assert json.loads(Path(tokens["manifest"]).read_text())["tokens"]["sha256"] == tokens["tokens"]["token_manifest_sha256"]
    assert version.tags["kiln.training_manifest_sha256"] == tokens["manifest_sha256"]
    assert version.tags["kiln.token_manifest_sha256"] == tokens["tokens"]["token_manifest_sha256"]
    assert version.tags["kiln.tokenizer_sha256"] == tokens["tokens"]["tokenizer_sha256"]
    assert version.tags["kiln.airflow.run_id"] == run["dag_run_id"]
    train = admin.xcom(SANDBOX.dag_id, run["dag_run_id"], "train")
    assert version.tags["kiln.weights_sha256"] == train["weights_sha256"]
    committed = json.loads((Path(train["checkpoint"]) / "manifest.json").read_text())
    assert (committed["format"], committed["strategy"]) == (3, "fsdp")
    assert {f"__{r}_0.distcp" for r in range(committed["world_size"])} <= set(committed["files"])  # a shard per rank
    # The champion a DAG run promoted is an MLflow pyfunc text model: prompts in, generated text out.
    import mlflow.pyfunc

    generator = mlflow.pyfunc.load_model(f"models:/{SANDBOX.target_model}@{SANDBOX.alias}")
    texts = generator.predict(["def main("], params={"max_new_tokens": 16})
    assert isinstance(texts, list) and len(texts) == 1 and isinstance(texts[0], str), texts
    for model in (PRODUCTION_MODEL, f"{PRODUCTION_MODEL}.candidates"):  # the stack is shared with production tests
        leaked = client.search_model_versions(f"name = '{model}' AND tags.`kiln.airflow.run_id` = '{run['dag_run_id']}'")
        assert not leaked, f"a sandbox run wrote a version of {model}"

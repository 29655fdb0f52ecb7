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

    # `kiln reproduce` of that champion from the kiln_reproduce DAG's form (sandbox capacity): from the signed
    # statement and the DVC remote alone, every step gives the recorded digest and the weights the same sha256,
    # at the recorded world size; the verdict is tagged on the version with a signed attestation.
    from kiln.provenance.reproduce import REPRODUCE_DAG_ID

    admin.wait_for_dag(REPRODUCE_DAG_ID)
    admin.unpause(REPRODUCE_DAG_ID)
    asked = admin.trigger(REPRODUCE_DAG_ID, conf={"version": f"{SANDBOX.target_model}@{SANDBOX.alias}"})["dag_run_id"]
    final = follow_run(admin, REPRODUCE_DAG_ID, asked, timeout=600, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(REPRODUCE_DAG_ID, asked)}
    outcome = admin.xcom(REPRODUCE_DAG_ID, asked, "reproduce")
    assert final["state"] == "success", (states, outcome)
    assert (outcome["verdict"], outcome["version"], outcome["world_size"]) == ("reproduced", version.version,
                                                                               committed["world_size"])
    weights = [c for c in outcome["comparisons"] if c["step"] == "train"]
    assert weights and weights[-1]["same"] and weights[-1]["derived"] == train["weights_sha256"]
    assert [c["step"] for c in outcome["comparisons"] if not c["same"]] == []
    assert {c["step"] for c in outcome["comparisons"]} == {"snapshot", "validate", "tokenize", "training-manifest",
                                                           "train", "evaluate", "hf-folder"}
    tags = client.get_model_version(SANDBOX.target_model, version.version).tags
    assert tags["kiln.reproduction.verdict"] == "reproduced"
    assert tags["kiln.reproduction.attestation_sha256"] == outcome["attestation_sha256"]


def test_a_teams_own_hugging_face_model_through_the_sandbox_form(stack, admin, llama_sandbox_run, tmp_path):
    """The worked example of a trainer of your own (``kiln_hf_trainer``: a ``transformers``
    ``LlamaForCausalLM`` on kiln's trainer SDK, installed in kiln's environment as a team installs its
    package) chosen in the form by its recipe, ``tiny-llama.toml``, and nothing else: kiln's stages
    run it as they run kiln's GPT. The tokenize stage trains the recipe's BPE; the trainer trains
    under FSDP2 with committed sharded checkpoints that record it and its distribution; kiln's
    evaluation scores the checkpoint through the trainer's ``evaluate`` loader; registration
    registers the trainer's export, a Hugging Face folder that ``transformers`` loads to the trained
    weights, under the sandbox model only. The run is the package's shared one (``llama_sandbox_run``,
    20 steps); about 4 min on 2 busy cores, most of it starting processes that import torch and
    transformers."""
    import mlflow
    import mlflow.artifacts
    import mlflow.pyfunc
    from transformers import AutoModelForCausalLM

    from kiln.policy import PRODUCTION_MODEL, SANDBOX
    from kiln_trainer.checkpoint import weights_sha256

    run_id = llama_sandbox_run["run_id"]
    tokens = admin.xcom(SANDBOX.dag_id, run_id, "tokens")
    assert tokens["tokens"]["tokenizer_kind"] == "bpe"
    train = admin.xcom(SANDBOX.dag_id, run_id, "train")
    assert train["completed"] and train["step"] == 20, train
    committed = json.loads((Path(train["checkpoint"]) / "manifest.json").read_text())
    assert committed["strategy"] == "fsdp"  # the recipe's
    assert committed["trainer"] == {
        "spec": "kiln_hf_trainer.train:main", "distribution": "kiln-example-hf-trainer", "version": "0.1.0",
        "evaluate": "kiln_hf_trainer.evaluate:load_for_evaluation", "export": "kiln_hf_trainer.export:main"}

    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"])
    [version] = client.search_model_versions(
        f"name = '{SANDBOX.target_model}' AND tags.`kiln.airflow.run_id` = '{run_id}'")
    assert (version.tags["kiln.trainer"], version.tags["kiln.trainer.distribution"],
            version.tags["kiln.trainer.version"]) == ("kiln_hf_trainer.train:main", "kiln-example-hf-trainer", "0.1.0")
    evaluation = admin.xcom(SANDBOX.dag_id, run_id, "evaluate")
    assert float(version.tags["kiln.eval.bits_per_byte"]) == pytest.approx(evaluation["bits_per_byte"])
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{version.name}/{version.version}", dst_path=str(tmp_path)))
    folder = local / "artifacts" / "hf_model"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert weights_sha256(AutoModelForCausalLM.from_pretrained(folder).state_dict()) == train["weights_sha256"]
    texts = mlflow.pyfunc.load_model(f"models:/{version.name}/{version.version}").predict(
        ["def main("], params={"max_new_tokens": 8})
    assert isinstance(texts, list) and len(texts) == 1 and isinstance(texts[0], str), texts
    for model in (PRODUCTION_MODEL, f"{PRODUCTION_MODEL}.candidates"):
        leaked = client.search_model_versions(f"name = '{model}' AND tags.`kiln.airflow.run_id` = '{run_id}'")
        assert not leaked, f"a sandbox run wrote a version of {model}"


def test_a_data_mixture_through_the_sandbox_form(stack, admin, llama_sandbox_run):
    """The same shared run trained the form's mixture ``code-and-prose``: each source snapshotted,
    validated in its own mapped tasks against its own contract and gated by its own threshold; the
    poisoned code shard quarantined within its source; one tokenizer packed both; the version records
    each source's snapshot, contract, weight, realized share and tokens, and its signed statement lists
    them (``kiln verify`` agrees)."""
    import mlflow

    from kiln.policy import SANDBOX
    from kiln.registry.verify import check_version

    run_id = llama_sandbox_run["run_id"]
    snap = admin.xcom(SANDBOX.dag_id, run_id, "snapshot")
    assert snap["mixture"] == "code-and-prose" and [s["name"] for s in snap["sources"]] == ["code", "prose"]
    validated = [ti for ti in admin.task_instances(SANDBOX.dag_id, run_id) if ti["task_id"] == "validate_shards"]
    assert len(validated) >= 2 and all(ti["state"] == "success" for ti in validated)  # a batch per source at least
    gate = admin.xcom(SANDBOX.dag_id, run_id, "data_gate")
    by_source = {g["name"]: g for g in gate["sources"]}
    assert (by_source["code"]["contract"], by_source["prose"]["contract"]) == ("stdlib-py@1", "web-text@1")
    assert [q["path"] for q in by_source["code"]["quarantined"]] == [llama_sandbox_run["poisoned"]]
    manifest = json.loads(Path(admin.xcom(SANDBOX.dag_id, run_id, "tokens")["manifest"]).read_text())
    assert manifest["format"] == 2 and [s["name"] for s in manifest["sources"]] == ["code", "prose"]
    assert len({s["tokens"]["tokenizer_sha256"] for s in manifest["sources"]}) == 1  # the run's one tokenizer

    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"])
    [version] = client.search_model_versions(
        f"name = '{SANDBOX.target_model}' AND tags.`kiln.airflow.run_id` = '{run_id}'")
    assert version.tags["kiln.mixture.sources"] == "code,prose" and version.tags["kiln.snapshot_id"] == snap["id"]
    for source in snap["sources"]:
        tag = f"kiln.source.{source['name']}."
        assert version.tags[tag + "snapshot_id"] == source["snapshot"]["id"]
        assert float(version.tags[tag + "weight"]) == 0.5 and 0 < float(version.tags[tag + "share"]) < 1
        assert int(version.tags[tag + "tokens"]) > 0
    check = check_version(version, "sandbox")
    assert check.status == "agrees", check.problem

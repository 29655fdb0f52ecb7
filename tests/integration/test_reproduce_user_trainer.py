"""``kiln reproduce`` of a version a trainer of the user's own made: the worked example (the Hugging Face
``LlamaForCausalLM`` trainer of ``examples/trainers/hf_causal_lm``, package ``kiln_hf_trainer``, installed
in the venv) trained by the pipeline's stages on ``training/recipes/tiny-llama.toml`` (its byte-level BPE
tokenizer), registered signed against this session's real ``mlflow server`` and re-derived from its signed
statement: the statement names the trainer's entry point and its package's digest, the re-run launches that
entry point (its checkpoint says so), the evaluation goes through the trainer's ``evaluate`` entry point and
the Hugging Face folder through its ``export``; every step gives the recorded digest, the weights the same
sha256 (``test_reproduce.py`` does the same for kiln's GPT and the other verdicts).

The trainer's ``export`` runs inside ``kiln reproduce`` and prints the folder it wrote: ``--json``'s standard
output must still be the outcome alone.

Two optimizer steps on one shard (the recipe's warm-up bounds only kiln's own trainer): the weights move
from their initialisation, and the resume machinery is not what is checked here. Cost on 2 shared cores
(niced, load about 1, 2026-12-07), the session's MLflow server already up: about 113 s registering and 51 s
reproducing. Most of it is starting processes that import transformers (about 14 s of CPU each over torch's
7 s here): the train stage's check, its rank, the evaluation, then again the reproduction's rank and
evaluation. Hence ``slow`` (it still runs in ``make test``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln import stages
from kiln.cli import main as kiln_main
from kiln.policy import SANDBOX
from kiln.provenance.reproduce import EVAL_COMPARED, EXPORT_DIR
from kiln.provenance.statement import package_sha256, subjects
from kiln.registry.export import HF_FOLDER
from kiln_trainer.contract.checkpoint_manifest import TRAINER_KEY, read_manifest

pytestmark = pytest.mark.slow

CORPUS = "repro-user-trainer"
TRAIN_SPEC = "kiln_hf_trainer.train:main"
PARAMS = {"recipe": "tiny-llama.toml", "max_steps": 2}
"""tiny-llama (2 decoder layers, 64 wide) for 2 steps on one rank."""


@dataclasses.dataclass(frozen=True)
class Registered:
    home: Path
    model: str
    version: str
    weights_sha256: str


@pytest.fixture(scope="module")
def registered(mlflow_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registered]:
    """One version the example trainer made, registered the way the pipeline does (the session's MLflow
    server; this module's own KILN_HOME and DVC remote)."""
    import mlflow

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    home = tmp_path_factory.mktemp("repro-user") / "kiln"
    name = f"sandbox.repro-hf-{uuid.uuid4().hex[:8]}"
    policy = dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))
    key = "kiln_sandbox/manual__reproduce_user_trainer"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
        for var in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "KILN_TOKENS_REMOTE", "KILN_CONTRACTS_DIR"):
            mp.delenv(var, raising=False)
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(mlflow_server.url)
        try:
            build_corpus(kiln_settings.load().corpus_root / CORPUS, shards=1, seed=3, max_bytes=65_536)
            snap = stages.snapshot_stage(policy, CORPUS)
            batches = [stages.validate_stage(policy, snap, batch, key) for batch in stages.shard_batches(policy, snap)]
            data = stages.data_gate_stage(policy, snap, batches, key)
            tokenizer = stages.tokenizer_stage(policy, data, PARAMS, key)
            for parts in stages.token_parts(policy, data):
                stages.tokenize_stage(policy, data, tokenizer, parts, PARAMS, key)
            data = stages.tokens_stage(policy, data, tokenizer, PARAMS, key)
            train = stages.train_stage(policy, snap, data, PARAMS, key, log_line=lambda _line: None)
            evaluation = stages.evaluate_stage(train, data, key)
            candidate = stages.register_stage(policy, snap, data, train, evaluation, key, lineage={})
            # verified by the reproduction itself (its first step), not here: a download and a check the less
            yield Registered(home=home, model=name, version=str(candidate.version), weights_sha256=train.weights_sha256)
        finally:
            mlflow.set_tracking_uri(previous)


def test_a_version_a_user_trainer_made_reproduces_bit_for_bit(
        registered: Registered, mlflow_uri: str, client: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kiln.provenance.statement import PROVENANCE_FILE
    from kiln.provenance.verify import verify_artifact

    monkeypatch.setenv("KILN_HOME", str(registered.home))
    for var in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "KILN_CONTRACTS_DIR"):
        monkeypatch.delenv(var, raising=False)
    work = tmp_path / "r"
    ref = f"{registered.model}/{registered.version}"
    code = kiln_main(["reproduce", ref, "--policy", "sandbox", "--workdir", str(work), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    outcome = json.loads(out)  # the standard output is the outcome alone: the trainer's export prints elsewhere
    assert outcome["verdict"] == "reproduced", outcome["reason"]
    assert outcome["code_drift"] == [] and outcome["weights_compared"] == "bitwise"
    assert all(c["same"] for c in outcome["comparisons"]), [c for c in outcome["comparisons"] if not c["same"]]

    # the signed statement (the copy the reproduction verified) names the user's entry point and its package's
    # digest, which code drift is checked against, and the registered Hugging Face folder's files
    downloaded = next((work / "version").rglob(PROVENANCE_FILE)).parent
    statement = verify_artifact(downloaded, "sandbox").statement
    deps = {d["name"].split(":", 1)[0]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["trainer"]["name"] == f"trainer:{TRAIN_SPEC}"
    assert deps["trainer"]["digest"]["sha256"] == package_sha256("kiln_hf_trainer") != ""
    folder = sorted(name.removeprefix(f"{HF_FOLDER}/") for name in subjects(statement)
                    if name.startswith(f"{HF_FOLDER}/"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(folder)

    # every step, the evaluation through the trainer's evaluate entry point and the folder through its export
    steps = [(c["step"], c["input"].split(" (")[0]) for c in outcome["comparisons"]]
    assert [s for s, _ in steps[:3]] == ["snapshot", "validate", "validate"]
    assert steps[3:] == [("tokenize", "resolved recipe"), ("tokenize", "tokenizer"), ("tokenize", "token manifest"),
                         ("training-manifest", "training manifest"), ("train", "weights"),
                         *[("evaluate", f"evaluation report {name}") for name in EVAL_COMPARED],
                         *[("hf-folder", f"{HF_FOLDER}/{name}") for name in folder]]
    weights = next(c for c in outcome["comparisons"] if c["step"] == "train")
    assert weights["recorded"] == weights["derived"] == registered.weights_sha256

    # the re-run trained with the user's entry point (the re-derived checkpoint records it), and its Hugging
    # Face folder is the trainer's export (a Llama)
    trained = json.loads((work / "derived" / "train" / "result.json").read_text())
    assert trained["weights_sha256"] == registered.weights_sha256 and trained["step"] == PARAMS["max_steps"]
    assert read_manifest(Path(trained["checkpoint"]))[TRAINER_KEY]["spec"] == TRAIN_SPEC
    config = json.loads((work / "derived" / EXPORT_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert client.get_model_version(registered.model, registered.version).tags["kiln.reproduction.verdict"] == \
        "reproduced"

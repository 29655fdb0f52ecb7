"""``kiln reproduce`` against a real ``mlflow server`` and a real DVC remote (a local directory, as on
the embedded stack): a tiny corpus (two healthy shards and a poisoned one, so the quarantine report
has something to say) goes through the pipeline's stages as the DAG runs them -- snapshot, validate,
data gate, tokenizer, tokenize, tokens, train (kiln's local launcher, real torchrun), evaluate,
register (signed) -- and the registered version is re-derived from its signed statement:

* untouched, every step gives the recorded digest and the weights the same sha256; the verdict is
  tagged on the version with a signed attestation that verifies;
* installed code other than the recorded code (a copy of kiln with one line added, run in its own
  process) is refused, and with ``--allow-code-drift`` goes on, reports the drift and, with a changed
  contract, stops at ``validate`` naming the contract and both digests;
* a tampered object on the DVC remote stops it at ``snapshot``, naming the file and both md5s;
* at another world size (2 ranks; the version trained on 1) every step before training gives the recorded
  digest, the ranks read the global batches seed and step give, and the weights are within the default
  bound of the registered ones (not bitwise); the verdict, the world size and the largest difference are
  in the tags and the signed attestation, and a weight perturbed past the bound is caught; a world size
  the recorded global batch cannot be split to is refused before anything is derived.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln import stages
from kiln.cli import main as kiln_main
from kiln.policy import SANDBOX
from kiln.provenance.attestation import REPRODUCER_POLICY, verify_attestation
from kiln.provenance.reproduce import (
    DEFAULT_TOLERANCE,
    EVAL_COMPARED,
    EXPORT_DIR,
    compare_folder,
    compare_weights,
    load_folder_weights,
    plan_from_statement,
)
from kiln.provenance.statement import artifact_files, subjects
from kiln.refs import sha256_file
from kiln.registry.export import HF_FOLDER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CORPUS = "repro-corpus"
PARAMS = {"recipe": "tiny.toml", "max_steps": 24}
"""The tiny recipe (2 layers, 64 wide) for 24 steps: past its 20 warm-up steps, a few seconds on one rank."""


@dataclasses.dataclass(frozen=True)
class Registered:
    home: Path
    model: str
    version: str
    weights_sha256: str
    statement: dict[str, Any]


@pytest.fixture(scope="module")
def registered(mlflow_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registered]:
    """One version registered the way the pipeline does, on this module's own KILN_HOME and DVC remote."""
    import mlflow

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.registry.verify import check_version

    home = tmp_path_factory.mktemp("repro") / "kiln"
    name = f"sandbox.repro-{uuid.uuid4().hex[:8]}"
    policy = dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))
    key = "kiln_sandbox/manual__reproduce"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
        for var in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "KILN_TOKENS_REMOTE", "KILN_CONTRACTS_DIR"):
            mp.delenv(var, raising=False)
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(mlflow_server.url)
        try:
            build_corpus(kiln_settings.load().corpus_root / CORPUS, shards=3, seed=2, poison=["secret"], max_bytes=65_536)
            snap = stages.snapshot_stage(policy, CORPUS)
            batches = [stages.validate_stage(policy, snap, batch, key) for batch in stages.shard_batches(policy, snap)]
            data = stages.data_gate_stage(policy, snap, batches, key)
            assert data.healthy == 2 and len(data.quarantined) == 1
            tokenizer = stages.tokenizer_stage(policy, data, PARAMS, key)
            for parts in stages.token_parts(policy, data):
                stages.tokenize_stage(policy, data, tokenizer, parts, PARAMS, key)
            data = stages.tokens_stage(policy, data, tokenizer, PARAMS, key)
            train = stages.train_stage(policy, snap, data, PARAMS, key, log_line=lambda _line: None)
            evaluation = stages.evaluate_stage(train, data, key)
            candidate = stages.register_stage(policy, snap, data, train, evaluation, key, lineage={})
            mv = mlflow.MlflowClient(mlflow_server.url).get_model_version(name, candidate.version)
            check = check_version(mv, "sandbox")
            assert check.status == "agrees", check.problem
            assert check.verified is not None
            yield Registered(home=home, model=name, version=str(candidate.version), weights_sha256=train.weights_sha256,
                             statement=check.verified.statement)
        finally:
            mlflow.set_tracking_uri(previous)


@pytest.fixture
def on_stack(registered: Registered, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> Registered:
    monkeypatch.setenv("KILN_HOME", str(registered.home))
    for var in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "KILN_CONTRACTS_DIR"):
        monkeypatch.delenv(var, raising=False)
    return registered


def _tags(client: Any, reg: Registered) -> dict[str, str]:
    return dict(client.get_model_version(reg.model, reg.version).tags)


def test_the_statement_records_what_reproducing_needs(on_stack: Registered) -> None:
    build = on_stack.statement["predicate"]["buildDefinition"]
    assert "unrecorded" not in build["internalParameters"] or set(build["internalParameters"]["unrecorded"]) <= {
        "nodes", "startedOn", "finishedOn"}
    assert build["internalParameters"]["max_quarantine_share"] == SANDBOX.max_quarantine_share
    snapshot = next(d for d in build["resolvedDependencies"] if d["name"].startswith("snapshot:"))
    assert snapshot["annotations"]["path"] == str(on_stack.home / "snapshots" / snapshot["digest"]["md5"])


def test_the_registered_version_s_datasheet_describes_the_pipeline_run(
        on_stack: Registered, client: Any, tmp_path: Path) -> None:
    """The datasheet registration logged for a version made by the pipeline's stages (docs/provenance.md):
    the corpus' import record, the real quarantine report and contract rules, every source at hand."""
    import mlflow

    run_id = client.get_model_version(on_stack.model, on_stack.version).run_id
    folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="datasheet", dst_path=str(tmp_path)))
    markdown = (folder / "datasheet.md").read_text()
    assert f"| corpus | `{CORPUS}` | statement |" in markdown
    assert "| written by | kiln corpus build | corpus.json |" in markdown  # the import record of the snapshot
    assert "| data gate outcome | pass: 1 of 3 shards quarantined" in markdown
    assert "| no\\_secrets (expect\\_column\\_values\\_to\\_not\\_match\\_regex\\_list on text):" in markdown
    assert "not at hand" not in markdown and "not shown" not in markdown
    assert sorted(p.name for p in (folder / "sources").iterdir()) == ["contract-suite.json", "corpus.json",
                                                                       "quarantine-report.json"]


def test_an_untouched_version_reproduces_with_the_same_weights_and_the_verdict_is_signed(
        on_stack: Registered, client: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ref = f"{on_stack.model}/{on_stack.version}"
    assert kiln_main(["reproduce", ref, "--policy", "sandbox", "--workdir", str(tmp_path / "r"), "--json"]) == 0, \
        capsys.readouterr().err
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["verdict"] == "reproduced" and outcome["code_drift"] == []
    steps = [(c["step"], c["input"].split(" (")[0]) for c in outcome["comparisons"]]
    snapshot_id = on_stack.statement["predicate"]["buildDefinition"]["resolvedDependencies"][0]["annotations"]["dvc_id"]
    folder = sorted(name.removeprefix(f"{HF_FOLDER}/") for name in subjects(on_stack.statement)
                    if name.startswith(f"{HF_FOLDER}/"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(folder)
    assert steps == [("snapshot", f"snapshot {snapshot_id} from the DVC remote {on_stack.home / 'dvc-remote'}"),
                     ("validate", f"contract {SANDBOX.contract}"), ("validate", "quarantine report"),
                     ("tokenize", "resolved recipe"), ("tokenize", "tokenizer"), ("tokenize", "token manifest"),
                     ("training-manifest", "training manifest"), ("train", "weights"),
                     *[("evaluate", f"evaluation report {name}") for name in EVAL_COMPARED],
                     *[("hf-folder", f"{HF_FOLDER}/{name}") for name in folder]]
    assert all(c["same"] for c in outcome["comparisons"])
    weights = outcome["comparisons"][7]
    assert weights["input"].startswith("weights") and weights["derived"] == on_stack.weights_sha256
    # the evaluation of the re-derived weights is the signed report, bit for bit: the figures themselves
    figures = {c["input"].rsplit(" ", 1)[1]: c["derived"] for c in outcome["comparisons"] if c["step"] == "evaluate"}
    signed = next(b for b in on_stack.statement["predicate"]["runDetails"]["byproducts"]
                  if b["name"] == "evaluation-report")["annotations"]["content"]
    assert figures["bits_per_byte"] == repr(signed["bits_per_byte"]) and figures["tokens"] == str(signed["tokens"])
    rebuilt = json.loads((tmp_path / "r" / "derived" / "evaluation" / "eval_report.json").read_text())
    assert rebuilt["bits_per_byte"] == signed["bits_per_byte"] and rebuilt["loss"] == signed["loss"]
    # restored afresh into the work directory's own DVC cache, never the stack's; trained by torchrun there
    assert (tmp_path / "r" / "derived" / "dvc-cache").is_dir()
    trained = json.loads((tmp_path / "r" / "derived" / "train" / "result.json").read_text())
    assert trained["weights_sha256"] == on_stack.weights_sha256 and trained["step"] == PARAMS["max_steps"]
    assert (tmp_path / "r" / "derived" / EXPORT_DIR / "config.json").is_file()

    tags = _tags(client, on_stack)
    assert tags["kiln.reproduction.verdict"] == "reproduced"
    assert tags["kiln.reproduction.attestation"] == outcome["attestation_uri"]
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(outcome["attestation_uri"], dst_path=str(tmp_path / "att")))
    assert hashlib.sha256(local.read_bytes()).hexdigest() == tags["kiln.reproduction.attestation_sha256"]
    # the version page says it: the description's last part, after the registration's own
    page = client.get_model_version(on_stack.model, on_stack.version).description
    said = page.split("Reproduction (`kiln reproduce`, the latest verdict): ")
    assert len(said) == 2 and said[0].startswith("kiln candidate from Airflow run") and "Datasheet" in said[0]
    assert said[1].startswith("**reproduced** at world size 1, the weights compared bit for bit, ")
    assert f"Signed attestation `{outcome['attestation_uri']}`" in said[1]
    attested = verify_attestation(local)
    assert attested["predicate"]["verdict"] == "reproduced"
    assert attested["predicate"]["reproducer"]["policy"] == REPRODUCER_POLICY
    assert {"name": "weights", "digest": {"sha256": on_stack.weights_sha256}} in attested["subject"]
    # the version still verifies: the verdict is beside the signed files, not in them
    assert kiln_main(["verify", ref, "--policy", "sandbox"]) == 0, capsys.readouterr().err

    # a registered folder that is not what these weights export to (its weights file swapped for other
    # bytes, and signed so: a statement verify cannot fault) differs at hf-folder, naming the file
    from safetensors.torch import save_file

    exported = tmp_path / "r" / "derived" / EXPORT_DIR
    plan = plan_from_statement(on_stack.statement, tmp_path / "r" / "version")
    other = load_folder_weights(exported)
    other[sorted(other)[0]] += 1e-3
    save_file(other, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    signed = {**plan.hf_files, "model.safetensors": sha256_file(tmp_path / "other.safetensors")}
    caught = compare_folder(signed, artifact_files(exported), prefix=HF_FOLDER)
    assert [str(c) for c in caught if not c.same] == [
        f"hf-folder: {HF_FOLDER}/model.safetensors differs: recorded {signed['model.safetensors']}, "
        f"re-derived {plan.hf_files['model.safetensors']}"]


def test_at_another_world_size_the_weights_reproduce_within_tolerance_and_say_so(
        on_stack: Registered, client: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ref = f"{on_stack.model}/{on_stack.version}"
    recorded = on_stack.statement["predicate"]["buildDefinition"]["externalParameters"]["world_size"]
    assert recorded == 1, "the version this module registers trains on one rank"
    work = tmp_path / "r"
    assert kiln_main(["reproduce", ref, "--policy", "sandbox", "--world-size", "2", "--workdir", str(work),
                      "--json"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    outcome = json.loads(captured.out)
    assert "[reproduce] train: weights at world size 2 (the version was trained at 1): largest absolute" in captured.err
    assert outcome["verdict"] == "reproduced", outcome["reason"]
    assert (outcome["world_size"], outcome["recorded_world_size"], outcome["weights_compared"], outcome["tolerance"]) \
        == (2, 1, "tolerance", DEFAULT_TOLERANCE)
    # every step before training is bitwise the recorded one; then the data order, not the weights' sha256
    steps = [(c["step"], c["input"].split(" (")[0]) for c in outcome["comparisons"]]
    assert [s for s, _ in steps] == ["snapshot", "validate", "validate", "tokenize", "tokenize", "tokenize",
                                     "training-manifest", "train"]
    assert steps[-1] == ("train", "data order") and all(c["same"] for c in outcome["comparisons"])
    weights = outcome["weights"]
    assert weights["within"] and 0.0 <= weights["max_abs_diff"] <= DEFAULT_TOLERANCE and not weights["problem"]
    assert weights["tensors"] > 0 and weights["values"] > 100_000
    print(f"world size 2 against 1: largest |difference| {weights['max_abs_diff']:.3g} in {weights['tensor']}")
    trained = json.loads((work / "derived" / "train" / "result.json").read_text())
    assert trained["world_size"] == 2 and trained["step"] == PARAMS["max_steps"]
    assert weights["derived_weights_sha256"] == trained["weights_sha256"]
    assert sorted(p.name for p in (work / "derived" / "train" / "sample-log").iterdir()) == [
        "rank-00000.jsonl", "rank-00001.jsonl"]

    tags = _tags(client, on_stack)
    assert tags["kiln.reproduction.verdict"] == "reproduced"
    assert tags["kiln.reproduction.detail"].startswith("within tolerance at world size 2: ")
    assert "bitwise" not in tags["kiln.reproduction.detail"]
    assert (tags["kiln.reproduction.world_size"], tags["kiln.reproduction.weights_compared"]) == ("2", "tolerance")
    assert float(tags["kiln.reproduction.max_abs_diff"]) == weights["max_abs_diff"]
    assert float(tags["kiln.reproduction.tolerance"]) == DEFAULT_TOLERANCE
    page = client.get_model_version(on_stack.model, on_stack.version).description
    assert page.count("Reproduction (`kiln reproduce`, the latest verdict):") == 1  # the latest replaces an earlier one
    assert "**reproduced** at world size 2, the weights within a bound (" in page
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(outcome["attestation_uri"], dst_path=str(tmp_path / "att")))
    predicate = verify_attestation(local)["predicate"]
    assert (predicate["worldSize"], predicate["recordedWorldSize"], predicate["weightsCompared"]) == (2, 1, "tolerance")
    assert predicate["weights"] == weights and predicate["verdict"] == "reproduced"

    # the comparison catches a weight perturbed past the bound: the registered folder against the re-derived one
    registered = load_folder_weights(work / "version" / "artifacts" / "hf_model")
    derived = load_folder_weights(work / "derived" / "train-export" / "hf_model")
    name = "transformer.h.0.mlp.c_proj.weight"
    derived[name] = derived[name].clone()
    derived[name][2, 7] += 10 * DEFAULT_TOLERANCE
    caught = compare_weights(registered, derived, tolerance=DEFAULT_TOLERANCE, world_size=2, recorded_world_size=1)
    assert not caught.within and (caught.tensor, caught.index) == (name, (2, 7))
    assert f"exceeds the bound {DEFAULT_TOLERANCE:g}, in {name}[2, 7]: registered " in str(caught)


def test_a_world_size_the_global_batch_cannot_be_split_to_is_refused_before_anything_is_derived(
        on_stack: Registered, client: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    before = _tags(client, on_stack)
    code = kiln_main(["reproduce", f"{on_stack.model}/{on_stack.version}", "--policy", "sandbox", "--world-size", "3",
                      "--workdir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("--world-size 3 cannot split the recorded global batch: data.global_batch_size = 16 does not divide by "
            "world size x data.micro_batch_size = 3 x 8 = 24") in err
    assert not (tmp_path / "r" / "derived").exists(), "nothing was derived"
    assert _tags(client, on_stack) == before, "a request the recipe cannot serve says nothing about the version"


def _drifted_code(into: Path) -> Path:
    """A copy of the installed kiln and kiln_trainer with one line added: other code than the recorded."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "src" / "kiln", into / "kiln", ignore=ignore)
    shutil.copytree(REPO / "training" / "kiln_trainer", into / "kiln_trainer", ignore=ignore)
    with open(into / "kiln" / "provenance" / "reproduce.py", "a") as fh:
        fh.write("# a line the recorded code does not have\n")
    return into


def _changed_contract(into: Path, contract: str) -> Path:
    """The contracts with ``contract``'s suite changed in place (same name and version, other rules)."""
    shutil.copytree(REPO / "data_contracts", into)
    name, version = contract.split("@")
    path = into / name / f"v{version}.json"
    suite = json.loads(path.read_text())
    suite["meta"]["notes"] = "changed after the run"
    path.write_text(json.dumps(suite, indent=2))
    return into


def test_code_drift_is_refused_and_with_the_flag_goes_on_to_a_changed_contract(
        on_stack: Registered, client: Any, tmp_path: Path) -> None:
    code = _drifted_code(tmp_path / "code")
    env = {**os.environ, "PYTHONPATH": str(code)}
    ref = f"{on_stack.model}/{on_stack.version}"
    argv = [sys.executable, "-m", "kiln.cli", "reproduce", ref, "--policy", "sandbox"]

    refused = subprocess.run([*argv, "--workdir", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert refused.returncode == 1, refused.stderr
    assert "refused: the installed code is not the recorded code" in refused.stderr
    assert "kiln and kiln_trainer: recorded code sha256 " in refused.stderr
    assert not (tmp_path / "a" / "derived").exists(), "nothing was re-derived"
    tags = _tags(client, on_stack)
    assert tags["kiln.reproduction.verdict"] == "refused"
    # the tags are the latest verdict's: the bound and difference of the reproduction at 2 ranks are gone
    assert tags["kiln.reproduction.world_size"] == "1" and tags["kiln.reproduction.weights_compared"] == "bitwise"
    assert "kiln.reproduction.max_abs_diff" not in tags and "kiln.reproduction.tolerance" not in tags

    contract = next(d["name"] for d in on_stack.statement["predicate"]["buildDefinition"]["resolvedDependencies"]
                    if d["name"].startswith("contract:")).split(":", 1)[1]
    env["KILN_CONTRACTS_DIR"] = str(_changed_contract(tmp_path / "contracts", contract))
    allowed = subprocess.run([*argv, "--allow-code-drift", "--workdir", str(tmp_path / "b")], env=env,
                             capture_output=True, text=True)
    assert allowed.returncode == 1, allowed.stderr
    assert "code drift: kiln and kiln_trainer: recorded code sha256" in allowed.stdout
    assert f"validate: contract {contract} (its suite's sha256) differs: recorded " in allowed.stderr
    outcome = json.loads((tmp_path / "b" / "reproduction.json").read_text())
    assert outcome["verdict"] == "differs"
    [snapshot, suite] = outcome["comparisons"]
    assert snapshot["same"] and suite["step"] == "validate" and not suite["same"]
    assert len(suite["recorded"]) == len(suite["derived"]) == 64
    assert _tags(client, on_stack)["kiln.reproduction.verdict"] == "differs"


def test_a_tampered_snapshot_on_the_remote_stops_at_the_snapshot_step(
        on_stack: Registered, client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln import settings as kiln_settings

    remote = Path(kiln_settings.load().dvc_remote)
    md5 = next(d for d in on_stack.statement["predicate"]["buildDefinition"]["resolvedDependencies"]
               if d["name"].startswith("snapshot:"))["digest"]["md5"]
    listing = json.loads((remote / "files" / "md5" / md5[:2] / f"{md5[2:]}.dir").read_bytes())
    shard = next(e for e in listing if e["relpath"].startswith("train/"))
    obj = remote / "files" / "md5" / shard["md5"][:2] / shard["md5"][2:]
    original = obj.read_bytes()
    try:
        os.chmod(obj, 0o644)
        obj.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        tampered = hashlib.md5(obj.read_bytes()).hexdigest()
        code = kiln_main(["reproduce", f"{on_stack.model}/{on_stack.version}", "--policy", "sandbox",
                          "--workdir", str(tmp_path / "r")])
    finally:
        obj.write_bytes(original)
    err = capsys.readouterr().err
    assert code == 1
    assert f"snapshot: snapshot {md5}.dir from the DVC remote {remote} differs" in err
    assert f"{shard['relpath']}: listed md5 {shard['md5']}, restored {tampered}" in err
    outcome = json.loads((tmp_path / "r" / "reproduction.json").read_text())
    assert outcome["verdict"] == "differs" and [c["step"] for c in outcome["comparisons"]] == ["snapshot"]
    assert _tags(client, on_stack)["kiln.reproduction.verdict"] == "differs"


def test_a_version_that_does_not_verify_is_refused_before_anything_is_derived(
        on_stack: Registered, client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tags = _tags(client, on_stack)
    client.set_model_version_tag(on_stack.model, on_stack.version, "kiln.snapshot_id", "0" * 32 + ".dir")
    try:
        code = kiln_main(["reproduce", f"{on_stack.model}/{on_stack.version}", "--policy", "sandbox",
                          "--workdir", str(tmp_path / "r")])
    finally:
        client.set_model_version_tag(on_stack.model, on_stack.version, "kiln.snapshot_id", tags["kiln.snapshot_id"])
    err = capsys.readouterr().err
    assert code == 1
    assert "refused: the version does not verify" in err and f"tag kiln.snapshot_id is '{'0' * 32}.dir'" in err
    assert not (tmp_path / "r" / "derived").exists()
    assert kiln_main(["reproduce", f"{on_stack.model}/{on_stack.version}", "--workdir", str(tmp_path / "r")]) == 2
    assert "is not empty: a reproduction re-derives everything afresh" in capsys.readouterr().err

"""``kiln export MODEL@ALIAS --format hf --out DIR`` against a real ``mlflow server``: the registered
version, verified against its signed provenance statement first, as a Hugging Face folder that
transformers loads, written whole or not at all. (Tampered versions: test_registry_provenance.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln import registry
from kiln.cli import main
from kiln.policy import PRODUCTION
from kiln.provenance.keys import trusted_keys
from kiln.registry.export import HF_FOLDER

from test_registry_mlflow import _refs_of, build_manifest, make_candidate, sandbox_policy, write_real_checkpoint

pytestmark = pytest.mark.slow

FOLDER = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _register_real(tmp_path: Path, client: Any, unique_name: str) -> tuple[Any, dict[str, Any], Path, dict[str, Any]]:
    """A real tiny-GPT checkpoint registered (and signed) by ``register_candidate`` for a sandbox-style
    policy, its version holding alias ``champion``: the policy, the registration ref, the step dir and
    the checkpoint's verified manifest."""
    manifest = build_manifest(tmp_path)
    step_dir = write_real_checkpoint(tmp_path / "run", manifest)
    verified, refs = _refs_of(step_dir, manifest)
    policy = sandbox_policy(unique_name)
    ref = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)
    client.set_registered_model_alias(policy.candidate_model, "champion", ref["version"])
    return policy, ref, step_dir, verified


def test_kiln_export_writes_the_versions_hf_folder_that_transformers_loads(tmp_path, mlflow_uri, client, unique_name,
                                                                          capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_trainer.evaluate import load_checkpoint_model, load_checkpoint_tokenizer
    from kiln_trainer.serving import HF_ARTIFACT

    assert f"artifacts/{HF_ARTIFACT}" == HF_FOLDER, "kiln reads the folder where the trainer's export puts it"
    policy, registered, step_dir, verified = _register_real(tmp_path, client, unique_name)
    name, version = policy.candidate_model, registered["version"]
    out = tmp_path / "exported" / "champion"
    capsys.readouterr()  # mlflow's own lines about the run

    # a model no policy owns: --policy says whose keys its versions must verify with
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out), "--policy", "sandbox"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert ref == {"model": name, "alias": "champion", "version": version, "run_id": ref["run_id"],
                   "weights_sha256": verified["weights_sha256"], "policy": "sandbox",
                   "statement_key_id": ref["statement_key_id"], "model_sig_key_id": ref["statement_key_id"],
                   "out": str(out), "files": FOLDER}
    assert ref["statement_key_id"] in trusted_keys("sandbox") and re.fullmatch("[0-9a-f]{64}", ref["statement_key_id"])
    assert sorted(p.name for p in out.iterdir()) == FOLDER
    assert [p.name for p in out.parent.iterdir()] == ["champion"], "the staging folder is gone"

    kiln_model, manifest = load_checkpoint_model(step_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def f(")["input_ids"]  # within the model's 8 positions
    assert ids == load_checkpoint_tokenizer(step_dir, manifest).encode_batch(["def f("])[0]
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out)(torch.tensor([ids])).logits
        ours = kiln_model(torch.tensor([ids]))[0]
    assert float((theirs - ours).abs().max()) <= 1e-5

    # An occupied --out is refused before any request, and left as it was.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out), "--policy", "sandbox"]) == 2
    err = capsys.readouterr().err
    assert f"kiln export: error: --out {out} is not empty" in err and "replaces nothing" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # An empty directory is taken.
    (tmp_path / "empty").mkdir()
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(tmp_path / "empty"),
                 "--policy", "sandbox"]) == 0
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == FOLDER


def test_kiln_export_refusals_name_what_is_wrong_and_write_nothing(tmp_path, mlflow_uri, client, unique_name,
                                                                  logged_models, capsys):
    import mlflow

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    # A version registered before kiln signed versions: refused, unsigned.
    name = f"kiln-export-old-{unique_name}"
    experiment = client.create_experiment(f"export-{name}")
    with mlflow.start_run(experiment_id=experiment):
        uri = mlflow.pyfunc.log_model(name="model", python_model=Echo(), pip_requirements=[]).model_uri
    old = mlflow.register_model(uri, name).version
    client.set_registered_model_alias(name, "champion", old)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out), "--policy", "sandbox"]) == 1
    err = capsys.readouterr().err
    assert f"{name} version {old} does not verify for policy sandbox: unsigned: provenance.dsse.json and model.sig " \
           "missing" in err
    # A signed version that verifies but carries no Hugging Face folder (the registry tests' stand-in model).
    policy = sandbox_policy(unique_name)
    registered = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}",
                                             **make_candidate(tmp_path / "c", "c", 3.0).kwargs())
    client.set_registered_model_alias(policy.candidate_model, "champion", registered["version"])
    capsys.readouterr()
    assert main(["export", f"{policy.candidate_model}@champion", "--format", "hf", "--out", str(out),
                 "--policy", "sandbox"]) == 1
    err = capsys.readouterr().err
    assert f"{policy.candidate_model} version {registered['version']} ({policy.candidate_model}@champion) has no " \
           "Hugging Face model folder" in err and "registered before" in err

    assert main(["export", f"{name}@nobody", "--format", "hf", "--out", str(out), "--policy", "sandbox"]) == 1
    assert f"no version of '{name}' holds alias 'nobody'" in capsys.readouterr().err
    assert main(["export", name, "--format", "hf", "--out", str(out)]) == 2
    assert "is not MODEL@ALIAS" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(tmp_path / "file"),
                 "--policy", "sandbox"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    # Whose keys: a model no policy owns needs --policy; an owned one verifies with its owner's keys only.
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out)]) == 2
    assert f"no policy owns {name}: give --policy" in capsys.readouterr().err
    owned = PRODUCTION.target_model
    assert main(["export", f"{owned}@champion", "--format", "hf", "--out", str(out), "--policy", "sandbox"]) == 2
    assert f"{owned} belongs to policy production" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "file"], "no folder, no staging left behind"

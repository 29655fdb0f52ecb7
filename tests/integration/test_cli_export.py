"""``kiln export MODEL@ALIAS --format hf --out DIR`` against a real ``mlflow server``: the registered
version's Hugging Face folder, which transformers loads, written whole or not at all."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.registry.export import HF_FOLDER

pytestmark = pytest.mark.slow

FOLDER = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture
def client(mlflow_uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_uri)


def _write_checkpoint(run_dir: Path) -> Path:
    """A real tiny-GPT checkpoint, written by the trainer's own writer (tests/unit/training's fixtures)."""
    spec = importlib.util.spec_from_file_location(
        "trainer_fixtures", Path(__file__).resolve().parents[1] / "unit" / "training" / "trainer_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    fixtures.write_checkpoints(run_dir, [2])
    return run_dir / "checkpoints" / "step-00000002"


def _register(client, name: str, log) -> str:
    """Log a model with ``log()`` in a new run, register it as a version of ``name`` holding alias
    ``champion`` (the way promotion leaves it: a copy in the target model); its version."""
    import mlflow

    experiment = client.create_experiment(f"export-{name}")
    with mlflow.start_run(experiment_id=experiment):
        uri = log()
    candidate = mlflow.register_model(uri, f"{name}.candidates", tags={"kiln.weights_sha256": "w" * 64})
    copied = client.copy_model_version(f"models:/{name}.candidates/{candidate.version}", name)
    client.set_registered_model_alias(name, "champion", copied.version)
    return str(copied.version)


def test_kiln_export_writes_the_versions_hf_folder_that_transformers_loads(tmp_path, mlflow_uri, client, unique_name,
                                                                          capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_trainer.evaluate import load_checkpoint_model, load_checkpoint_tokenizer
    from kiln_trainer.export import log_model
    from kiln_trainer.serving import HF_ARTIFACT

    assert f"artifacts/{HF_ARTIFACT}" == HF_FOLDER, "kiln reads the folder where the trainer's export puts it"
    step_dir = _write_checkpoint(tmp_path / "run")
    name = f"kiln-export-{unique_name}"
    version = _register(client, name, lambda: log_model(step_dir))
    out = tmp_path / "exported" / "champion"
    capsys.readouterr()  # mlflow's own lines about the run

    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out)]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert ref == {"model": name, "alias": "champion", "version": version, "run_id": ref["run_id"],
                   "weights_sha256": "w" * 64, "out": str(out), "files": FOLDER}
    assert sorted(p.name for p in out.iterdir()) == FOLDER
    assert [p.name for p in out.parent.iterdir()] == ["champion"], "the staging folder is gone"

    kiln_model, manifest = load_checkpoint_model(step_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def f(")["input_ids"]  # within the fixture model's 8 positions
    assert ids == load_checkpoint_tokenizer(step_dir, manifest).encode_batch(["def f("])[0]
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out)(torch.tensor([ids])).logits
        ours = kiln_model(torch.tensor([ids]))[0]
    assert float((theirs - ours).abs().max()) <= 1e-5

    # An occupied --out is refused before any request, and left as it was.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"kiln export: error: --out {out} is not empty" in err and "replaces nothing" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # An empty directory is taken.
    (tmp_path / "empty").mkdir()
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(tmp_path / "empty")]) == 0
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == FOLDER


def test_kiln_export_refusals_name_what_is_wrong_and_write_nothing(tmp_path, mlflow_uri, client, unique_name, capsys):
    import mlflow

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    name = f"kiln-export-old-{unique_name}"
    version = _register(client, name, lambda: mlflow.pyfunc.log_model(name="model", python_model=Echo(),
                                                                     pip_requirements=[]).model_uri)
    out = tmp_path / "out"

    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{name} version {version} has no {HF_FOLDER}" in err and "registered before" in err
    assert main(["export", f"{name}@nobody", "--format", "hf", "--out", str(out)]) == 1
    assert f"no version of '{name}' holds alias 'nobody'" in capsys.readouterr().err
    assert main(["export", name, "--format", "hf", "--out", str(out)]) == 2
    assert "is not MODEL@ALIAS" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["export", f"{name}@champion", "--format", "hf", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "no folder, no staging left behind"

"""Export a committed checkpoint to MLflow and get a working generator back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kiln_trainer.errors import TrainerError
from trainer_fixtures import write_checkpoints

pytestmark = pytest.mark.slow


def test_log_model_load_model_generate_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    import mlflow.pytorch
    from kiln_trainer.export import log_model

    write_checkpoints(tmp_path / "run", [2])
    step_dir = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint_manifest = json.loads((step_dir / "manifest.json").read_text())

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.create_experiment("kiln-export", artifact_location=str(tmp_path / "artifacts"))
    with pytest.raises(TrainerError, match="active MLflow run"):
        log_model(step_dir)
    with mlflow.start_run(experiment_id=experiment):
        uri = log_model(step_dir)

    model = mlflow.pytorch.load_model(uri)
    out = model.generate(b"def ", max_new_tokens=16, seed=0)
    assert isinstance(out, bytes) and len(out) == 16
    assert out == model.generate("def ", max_new_tokens=16, seed=0)

    info = mlflow.models.get_model_info(uri)
    assert info.metadata["kiln.vocab_size"] == 256 and info.metadata["kiln.tokenizer"] == "bytes"
    assert info.metadata["kiln.weights_sha256"] == checkpoint_manifest["weights_sha256"]
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "dl")))
    assert json.loads((local / "extra_files" / "tokenizer.json").read_text())["vocab_size"] == 256
    assert json.loads((local / "extra_files" / "recipe.json").read_text()) == checkpoint_manifest["recipe"]
    mlflow.set_tracking_uri("")

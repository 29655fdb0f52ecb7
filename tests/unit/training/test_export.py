"""Export a committed checkpoint to MLflow and get a text model back: prompts in, text out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln_trainer.errors import TrainerError

from trainer_fixtures import write_checkpoints

pytestmark = pytest.mark.slow


def test_log_model_then_pyfunc_predict_turns_prompts_into_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    import mlflow.pyfunc

    from kiln_trainer.export import log_model

    write_checkpoints(tmp_path / "run", [2])
    step_dir = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint_manifest = json.loads((step_dir / "manifest.json").read_text())

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        experiment = mlflow.create_experiment("kiln-export", artifact_location=str(tmp_path / "artifacts"))
        with pytest.raises(TrainerError, match="active MLflow run"):
            log_model(step_dir)
        with mlflow.start_run(experiment_id=experiment):
            uri = log_model(step_dir)

        model = mlflow.pyfunc.load_model(uri)
        texts = model.predict(["def main(", ""], params={"max_new_tokens": 16})
        assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
        assert texts == model.predict(["def main(", ""], params={"max_new_tokens": 16}), "greedy is deterministic"
        sampled = model.predict(["def "], params={"max_new_tokens": 16, "temperature": 1.0, "seed": 3})
        assert sampled == model.predict(["def "], params={"max_new_tokens": 16, "temperature": 1.0, "seed": 3})
        with pytest.raises(Exception, match="max_new_tokens"):
            model.predict(["def "], params={"max_new_tokens": -1})

        info = mlflow.models.get_model_info(uri)
        assert [c["type"] for c in info.signature.inputs.to_dict()] == ["string"]
        assert info.metadata["kiln.weights_sha256"] == checkpoint_manifest["weights_sha256"]
        assert info.metadata["kiln.vocab_size"] == checkpoint_manifest["recipe"]["model"]["vocab_size"]
        local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "dl")))
        assert json.loads((local / "artifacts" / "recipe.json").read_text()) == checkpoint_manifest["recipe"]
        assert not list(local.rglob("*.pkl")) or all(p.name == "python_model.pkl" for p in local.rglob("*.pkl"))
    finally:
        mlflow.set_tracking_uri("")

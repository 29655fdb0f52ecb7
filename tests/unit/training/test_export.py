"""Export a committed checkpoint to MLflow and get a text model back: prompts in, text out, generated
from the version's Hugging Face folder; nothing in the logged model is a pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln_trainer.errors import TrainerError

from trainer_fixtures import write_checkpoints

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tokenizer_kind", ["byte", "bpe"])
def test_log_model_then_pyfunc_predict_turns_prompts_into_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               tokenizer_kind: str) -> None:
    import mlflow
    import mlflow.pyfunc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_trainer.evaluate import load_checkpoint_model, load_checkpoint_tokenizer
    from kiln_trainer.export import log_model
    from kiln_trainer.tokenizer import train_bpe

    if tokenizer_kind == "bpe":
        bpe = train_bpe(["def main():\n    return 0\n", "def helper(x):\n    return x + 1\n"] * 30, vocab_size=300)
        write_checkpoints(tmp_path / "run", [2], tokenizer=bpe,
                          overrides=("tokenizer.kind=bpe", "tokenizer.vocab_size=300"))
    else:
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

        # Logging does not load the model back to predict its input example (a third of every
        # registration); this test loads and predicts below instead.
        # (Model.log only warns when that check raises: the calls are counted, not refused.)
        serving_checks: list[object] = []
        monkeypatch.setattr(mlflow.models.utils, "_validate_serving_input",
                            lambda **kwargs: serving_checks.append(kwargs))
        with mlflow.start_run(experiment_id=experiment):
            uri = log_model(step_dir)
        assert serving_checks == [], "log_model loaded the model to validate its serving input"

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
        assert info.flavors["python_function"]["loader_module"] == "mlflow.pyfunc.loaders.code_model"

        assert info.metadata["kiln.weights_sha256"] == checkpoint_manifest["weights_sha256"]
        # the tokenizer's vocabulary (the model's rows when the recipe follows it, as for the byte tokenizer)
        assert info.metadata["kiln.vocab_size"] == (
            bpe.vocab_size if tokenizer_kind == "bpe" else checkpoint_manifest["recipe"]["model"]["vocab_size"])
        local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "dl")))
        assert json.loads((local / "artifacts" / "recipe.json").read_text()) == checkpoint_manifest["recipe"]
        example = json.loads((local / "serving_input_example.json").read_text())
        assert model.predict(example["inputs"], params=example["params"]) == model.predict(
            ["def main("], params={"max_new_tokens": 8}), "the saved serving example is the one logged, and serves"
        # No pickle anywhere: the model is logged as code, the weights are safetensors.
        assert not [p for p in local.rglob("*") if p.suffix in (".pkl", ".pt", ".bin", ".pth")]
        assert "model_code_path" in (local / "MLmodel").read_text()

        # The folder transformers loads is what the served model generates from: kiln's own greedy
        # continuation of the prompt, decoded by kiln's own tokenizer, is the served text.
        folder = local / "artifacts" / "hf_model"
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                            "model.safetensors", "tokenizer.json",
                                                            "tokenizer_config.json"]
        assert type(AutoModelForCausalLM.from_pretrained(folder)).__name__ == "GPT2LMHeadModel"
        kiln_model, manifest = load_checkpoint_model(step_dir)
        kiln_tokenizer = load_checkpoint_tokenizer(step_dir, manifest)
        assert AutoTokenizer.from_pretrained(folder)("def main(")["input_ids"] == kiln_tokenizer.encode_batch(["def main("])[0]
        ours = kiln_model.generate_ids(kiln_tokenizer.encode_batch(["def main("])[0], max_new_tokens=16, temperature=0,
                                       stop_id=kiln_tokenizer.eos_id)
        assert texts[0] == kiln_tokenizer.decode(ours)
    finally:
        mlflow.set_tracking_uri("")


def _pickle_file(folder: Path) -> None:
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickled")


def _link(folder: Path) -> None:
    (folder / "weights.safetensors").symlink_to(folder / "model.safetensors")


def _no_safetensors(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _remote_code(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))


def _other_tokenizer(folder: Path) -> None:
    from kiln_trainer.hf import tokenizer_files
    from kiln_trainer.tokenizer import train_bpe

    bpe = train_bpe(["def main(argv):\n    return 0\n"] * 30, vocab_size=280)
    for name, data in tokenizer_files(bpe, 8).items():
        (folder / name).write_bytes(data)


def _other_eos(folder: Path) -> None:
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": 0}))


@pytest.mark.parametrize(("damage", "says"), [
    (_pickle_file, r"pytorch_model\.bin in the exported folder is a pickle format \(\.bin\)"),
    (_link, r"weights\.safetensors in the exported folder is a link"),
    (_no_safetensors, r"has no \*\.safetensors weights"),
    (_remote_code, r"names code of its own \(auto_map\)"),
    (_other_tokenizer, r"the exported tokenizer encodes .* as \[.*\], with EOS .*; the checkpoint's tokenizer as"),
    (_other_eos, r"with EOS the tokenizer's 256, generation's 0; the checkpoint's tokenizer as .*, EOS 256"),
])
def test_a_user_export_is_registered_only_as_a_folder_transformers_loads_without_pickle_or_code(
    tmp_path: Path, damage, says: str
) -> None:
    """What ``check_user_folder`` holds a trainer's export to, on a real folder (kiln's own export)."""
    from kiln_trainer.export import check_user_folder
    from kiln_trainer.hf import write_checkpoint_folder

    write_checkpoints(tmp_path / "run", [2])
    written = write_checkpoint_folder(tmp_path / "run" / "checkpoints" / "step-00000002", tmp_path / "hf")
    check_user_folder(written.path, written.tokenizer, where="trainer.export = 'mine.export:main'")
    damage(written.path)
    with pytest.raises(TrainerError, match=r"trainer\.export = 'mine\.export:main'.*" + says):
        check_user_folder(written.path, written.tokenizer, where="trainer.export = 'mine.export:main'")

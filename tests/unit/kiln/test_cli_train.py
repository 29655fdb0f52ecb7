"""`kiln train` (torchrun through the local launcher) and `kiln evaluate`, end to end on a tiny corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import build_parser, main
from kiln.cli.train import resolve_recipe
from kiln.policy import RECIPES_DIR

# The trainer tests' fixtures (real parquet shards, a TrainingManifest in kiln's wire format).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from trainer_fixtures import REPO, stdlib_sources, trainer_env, write_shard, write_training_manifest

FAST = ("train.steps=8", "checkpoint.every_steps=4", "optim.warmup_steps=2", "train.log_every=4")


@pytest.mark.parametrize("argv", [["train"], ["evaluate"]], ids=" ".join)
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint" in out if argv == ["evaluate"] else "--nproc-per-node" in out


@pytest.mark.parametrize("name", ["tiny", "tiny.toml", "production/small", "production/small.toml"])
def test_recipe_names_resolve_under_training_recipes(name: str) -> None:
    path = resolve_recipe(name)
    assert path.is_absolute() and path.is_file() and path.parent.is_relative_to(RECIPES_DIR)
    assert resolve_recipe(str(path)) == path  # an explicit path works too


def test_unknown_recipe_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text("{}")
    argv = ["train", "--recipe", "no-such-recipe", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2  # a usage error (kiln.cli: 2), like every other bad recipe
    err = capsys.readouterr().err
    assert "unknown recipe 'no-such-recipe'" in err and "tiny" in err
    assert not (tmp_path / "run").exists()  # refused before anything was launched


@pytest.mark.parametrize(("content", "named"), [
    ("", "not JSON"),
    ("{}", "kind is not 'kiln.TrainingManifest'"),
    ('{"kind": "kiln.TrainingManifest", "sha256": "0"}', "content hash mismatch"),
])
def test_a_manifest_the_trainer_would_refuse_is_a_usage_error_before_any_agent(
        content: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text(content)
    argv = ["train", "--recipe", "tiny", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kiln train: error: --manifest ") and str(manifest) in line and named in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was launched


def test_the_local_launcher_refuses_a_tampered_manifest_before_any_agent(small_manifest: Path, tmp_path: Path) -> None:
    from kiln.errors import ManifestError
    from kiln.launchers import LaunchSpec, launch_local

    doc = json.loads(small_manifest.read_text())
    doc["shards"][0]["rows"] += 1  # edited after kiln issued it: the content hash no longer matches
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tampered, recipe=RECIPES_DIR / "tiny.toml", run_key="tampered")
    with pytest.raises(ManifestError, match="content hash mismatch") as info:
        launch_local(spec, log=lambda _line: None)
    assert info.value.retryable is False and not spec.run_dir.exists()


def test_evaluate_of_a_non_checkpoint_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--report", str(tmp_path / "e.json")]) == 1
    assert "kiln evaluate: error: CheckpointError" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-corpus")
    docs = stdlib_sources(150_000)
    shards = [write_shard(root / "train-00000.parquet", docs[:-2])]
    eval_shards = [write_shard(root / "eval-00000.parquet", docs[-2:])]
    return write_training_manifest(root / "manifest.json", shards, eval_shards)


@pytest.mark.slow
def test_train_then_evaluate_end_to_end(small_manifest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "kiln.cli", "train", "--recipe", "tiny", "--manifest", str(small_manifest),
           "--run-dir", str(run_dir), "--nnodes", "1", "--nproc-per-node", "1"]
    for item in FAST:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=trainer_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout is exactly the TrainResult; the trainer's log went to stderr
    assert result["step"] == 8 and result["completed"] is True and result["world_size"] == 1
    on_disk = json.loads((run_dir / "result.json").read_text())
    assert (result["weights_sha256"], result["checkpoint"]) == (on_disk["weights_sha256"], on_disk["checkpoint"])
    assert "step 8/8" in proc.stderr

    checkpoint = Path(result["checkpoint"])
    report_path = tmp_path / "eval.json"
    # No --manifest: the run's own copy (RUN/training_manifest.json) is found and checked.
    assert main(["evaluate", "--checkpoint", str(checkpoint), "--report", str(report_path), "--max-windows", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(report_path.read_text())
    assert report["kind"] == "kiln.EvalReport" and report["weights_sha256"] == result["weights_sha256"]
    assert report["step"] == 8 and report["windows"] == 8 and report["bits_per_byte"] > 0
    assert report["training_manifest_sha256"] == result["training_manifest_sha256"]
    explicit = tmp_path / "eval2.json"
    argv = ["evaluate", "--checkpoint", str(checkpoint), "--manifest", str(small_manifest), "--report", str(explicit),
            "--max-windows", "8"]
    assert main(argv) == 0
    assert json.loads(explicit.read_text())["bits_per_byte"] == report["bits_per_byte"]

    # A run dir whose manifest copy is not the one the checkpoint was trained on is refused.
    doc = json.loads(small_manifest.read_text())
    other = write_training_manifest(tmp_path / "other.json", doc["shards"], doc["eval_shards"], corpus="other")
    (run_dir / "training_manifest.json").write_text(other.read_text())
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(checkpoint), "--report", str(tmp_path / "e3.json")]) == 1
    assert "pass the right --manifest" in capsys.readouterr().err


@pytest.mark.slow
def test_tokenize_writes_a_manifest_that_train_reads_without_packing_again(small_manifest: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    named = tmp_path / "tokenized.json"
    argv = ["tokenize", "--recipe", "tiny", "--manifest", str(small_manifest), "--out", str(tmp_path / "tokens"),
            "--manifest-out", str(named)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    doc = json.loads(named.read_text())
    assert doc["tokens"] == {"manifest": summary["token_manifest"], "sha256": summary["token_manifest_sha256"]}
    assert doc["shards"] == json.loads(small_manifest.read_text())["shards"] and doc["sha256"] == summary["manifest_sha256"]
    assert summary["tokenizer_kind"] == "byte" and summary["samples"] > 0
    assert main(argv) == 0 and json.loads(capsys.readouterr().out) == summary, "a second run reuses the packed shards"

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "kiln.cli", "train", "--recipe", "tiny", "--manifest", str(named), "--run-dir", str(run_dir)]
    for item in FAST:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=trainer_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    checkpoint = json.loads((Path(result["checkpoint"]) / "manifest.json").read_text())
    assert checkpoint["token_manifest_sha256"] == summary["token_manifest_sha256"]
    assert checkpoint["tokenizer_sha256"] == summary["tokenizer_sha256"]
    assert not (run_dir / "tokens").exists(), "the trainer packed the shards again instead of reading the named tokens"

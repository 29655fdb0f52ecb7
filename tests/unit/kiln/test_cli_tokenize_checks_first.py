"""``kiln tokenize`` checks everything that can fail before it writes anything, and honours the recipe's EOS token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kiln.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from trainer_fixtures import stdlib_sources, write_shard, write_training_manifest


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tokenize-corpus")
    docs = stdlib_sources(40_000)
    shards = [write_shard(root / "train-00000.parquet", docs[:-2])]
    return write_training_manifest(root / "manifest.json", shards, [write_shard(root / "eval-00000.parquet", docs[-2:])])


def test_a_bpe_recipe_with_its_own_eos_token_packs_and_reports(manifest: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # The summary re-read the packed tokenizer with the default EOS token: after the tokens were committed,
    # a recipe with another eos_token failed.
    argv = ["tokenize", "--recipe", "tiny-bpe", "--manifest", str(manifest), "--out", str(tmp_path / "tokens"),
            "--set", "tokenizer.eos_token=<|end|>", "--set", "tokenizer.vocab_size=300"]
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokenizer_kind"] == "bpe" and summary["eos_id"] == 0 and summary["samples"] > 0


def test_a_tokenizer_without_the_recipes_eos_token_is_refused_before_anything_is_written(
        manifest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln_trainer.tokenizer import train_bpe

    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(["some text to learn from"] * 4, 300, eos_token="<|end|>").save(tokenizer)
    out = tmp_path / "tokens"
    argv = ["tokenize", "--recipe", "tiny", "--manifest", str(manifest), "--out", str(out), "--set", "tokenizer.kind=file",
            "--set", f"tokenizer.path={tokenizer}", "--manifest-out", str(tmp_path / "named.json")]
    assert main(argv) != 0
    assert "has no token '<|endoftext|>'" in capsys.readouterr().err
    assert not (tmp_path / "named.json").exists()
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()], "written before the command failed"

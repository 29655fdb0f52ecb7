"""Held-out bits-per-byte of a committed checkpoint, scored with the checkpoint's own tokenizer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from kiln_trainer import evaluate
from kiln_trainer.checkpoint_manifest import CheckpointError, manifest_sha256
from kiln_trainer.tokenizer import ByteTokenizer, train_bpe

from trainer_fixtures import stdlib_sources, write_checkpoints, write_shard, write_training_manifest


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("eval-run")
    write_checkpoints(run_dir, [3])
    return run_dir / "checkpoints" / "step-00000003"


def test_report_is_finite_deterministic_and_bounded(step_dir: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    assert (
        evaluate.main(
            ["--checkpoint", str(step_dir), "--manifest", str(corpus), "--out", str(out), "--max-windows", "16"]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["kind"] == "kiln.EvalReport" and report["split"] == "eval"
    assert report["checkpoint"] == str(step_dir.resolve())
    assert report["checkpoint_manifest_sha256"] == manifest_sha256(step_dir)
    assert math.isfinite(report["bits_per_byte"]) and report["bits_per_byte"] > 0
    # The eval documents are longer than 16 x 8 tokens: all ASCII text, no EOS scored, bytes == tokens.
    assert report["windows"] == 16 and report["tokens"] == 16 * 8 == report["bytes"]  # block_size 8 in the fixture
    assert report["bits_per_byte"] == pytest.approx(report["loss"] * report["tokens"] / math.log(2) / report["bytes"])
    assert report["tokenizer_sha256"] == ByteTokenizer().sha256 and report["token_manifest_sha256"] == "1" * 64
    again = evaluate.evaluate_checkpoint(step_dir, corpus, max_windows=16)
    assert again["bits_per_byte"] == report["bits_per_byte"]
    assert again["weights_sha256"] == report["weights_sha256"]


def test_tampered_checkpoint_is_refused(step_dir: Path, corpus: Path, tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints" / step_dir.name
    shutil.copytree(step_dir, copy)
    with open(copy / "model.pt", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(CheckpointError, match="model.pt"):
        evaluate.evaluate_checkpoint(copy, corpus)
    assert evaluate.main(["--checkpoint", str(copy), "--manifest", str(corpus), "--out", str(tmp_path / "e.json")]) == 2
    assert not (tmp_path / "e.json").exists()


def test_without_a_manifest_the_run_copy_is_required(step_dir: Path) -> None:
    from kiln_trainer.errors import TrainingManifestError

    with pytest.raises(TrainingManifestError, match="training_manifest.json does not exist"):
        evaluate.evaluate_checkpoint(step_dir)


def test_scored_text_counts_the_utf8_bytes_it_encodes_with_any_tokenizer() -> None:
    docs = ["héllo wörld\n", "def f():\n    return 1\n", "ünïcödé " * 40]
    bpe = train_bpe(docs * 20, vocab_size=300)
    for tok in (ByteTokenizer(), ByteTokenizer(eos_id=0), bpe):
        whole = evaluate.scored_text(docs[:2], tok, max_tokens=10_000)
        assert whole.text_bytes == sum(len(d.encode()) for d in docs[:2])
        assert whole.ids == [tok.eos_id, *tok.encode_batch([docs[0]])[0], tok.eos_id, *tok.encode_batch([docs[1]])[0], tok.eos_id]
        cut = evaluate.scored_text(docs, tok, max_tokens=40)
        assert len(cut.ids) - 1 <= 40 and len(cut.ids) - 1 >= 35  # the last document cut to fit
        # The bytes are those of the text whose tokens are scored: the cut prefix decodes to that many bytes.
        assert cut.text_bytes == len(tok.decode(cut.ids).encode())  # EOS ids decode to nothing


def test_a_bpe_checkpoint_is_scored_with_its_own_tokenizer(tmp_path: Path) -> None:
    """Same text, two tokenizers: the bytes scored are the same when each fits its text in the budget."""
    docs = [text for _, text in stdlib_sources(30_000)]
    bpe = train_bpe(docs, vocab_size=320)
    shard = write_shard(tmp_path / "eval.parquet", [("a", "def f(x):\n    return x\n"), ("b", "héllo\n")])
    manifest = write_training_manifest(tmp_path / "m.json", [shard], [shard])
    reports = {}
    for name, tok, overrides in (("byte", ByteTokenizer(), ()),
                                 ("bpe", bpe, ("tokenizer.kind=bpe", "tokenizer.vocab_size=320"))):
        write_checkpoints(tmp_path / name, [1], tokenizer=tok, overrides=overrides)
        reports[name] = evaluate.evaluate_checkpoint(tmp_path / name / "checkpoints" / "step-00000001", manifest)
    assert reports["byte"]["bytes"] == reports["bpe"]["bytes"] == len(b"def f(x):\n    return x\n") + len("héllo\n".encode())
    assert reports["bpe"]["tokens"] < reports["byte"]["tokens"]  # fewer, longer tokens
    assert reports["bpe"]["tokenizer_sha256"] == bpe.sha256
    assert all(math.isfinite(r["bits_per_byte"]) and r["bits_per_byte"] > 0 for r in reports.values())

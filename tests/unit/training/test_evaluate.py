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


# -- a trainer of the user's own: its evaluate entry point loads the checkpoint, kiln scores it ----------

USER_LOADERS = """
from kiln_trainer.model import GPT


def load(checkpoint):
    model = GPT(checkpoint.recipe.model)
    model.load_state_dict(checkpoint.state, strict=True)
    model.to(checkpoint.device).eval()
    return lambda ids: model(ids)[0]


def short(checkpoint):
    model = load(checkpoint)
    return lambda ids: model(ids)[:, :-1]


def broken(checkpoint):
    raise RuntimeError("no such layer: " + checkpoint.step_dir.name)


def nothing(checkpoint):
    return 42
"""


def _as_user_trainers(step_dir: Path, into: Path, **record: str) -> Path:
    """A copy of kiln's checkpoint whose sealed record says a user trainer made it (``record``'s entry points)."""
    from kiln_trainer.contract.checkpoint_manifest import seal, verify_checkpoint

    copy = shutil.copytree(step_dir, into / step_dir.name)
    manifest = json.loads((copy / "manifest.json").read_text())
    trainer = {"spec": "userpkg_eval.train:main", "distribution": "", "version": "", **record}
    body = {k: v for k, v in manifest.items() if k != "seal_sha256"} | {"trainer": trainer}
    (copy / "manifest.json").write_text(json.dumps(seal(body)))
    verify_checkpoint(copy)
    return copy


@pytest.fixture
def user_loaders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "site" / "userpkg_eval"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "evaluate.py").write_text(USER_LOADERS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    import sys

    for name in [m for m in sys.modules if m.startswith("userpkg_eval")]:
        del sys.modules[name]


def test_a_user_trainers_loader_is_scored_exactly_as_kilns_own_model(
    step_dir: Path, corpus: Path, tmp_path: Path, user_loaders: None
) -> None:
    own = evaluate.evaluate_checkpoint(step_dir, corpus, max_windows=16)
    users = _as_user_trainers(step_dir, tmp_path / "user", evaluate="userpkg_eval.evaluate:load")
    theirs = evaluate.evaluate_checkpoint(users, corpus, max_windows=16)
    assert own["trainer"] == "kiln" and theirs["trainer"] == "userpkg_eval.train:main"
    same = ("bits_per_byte", "loss", "tokens", "bytes", "windows", "weights_sha256", "tokenizer_sha256")
    assert {k: theirs[k] for k in same} == {k: own[k] for k in same}  # the same weights, the same arithmetic
    with pytest.raises(evaluate.TrainerError, match="made by trainer 'userpkg_eval.train:main', not by kiln's"):
        evaluate.load_checkpoint_model(users)


@pytest.mark.parametrize(("loader", "says"), [
    (None, "made by trainer 'userpkg_eval.train:main', whose recipe names no evaluate entry point"),
    ("userpkg_eval.evaluate:short", r"gave \(16, 7, 257\) for token ids of shape \(16, 8\); expected logits"),
    ("userpkg_eval.evaluate:broken", "trainer.evaluate = 'userpkg_eval.evaluate:broken' failed to load the "
                                     "checkpoint: RuntimeError: no such layer: step-00000003"),
    ("userpkg_eval.evaluate:nothing", "returned a int, not a function from token ids to logits"),
    ("userpkg_eval.evaluate:missing", "module userpkg_eval.evaluate has no attribute 'missing'"),
    ("kiln_trainer.model:GPT", "kiln's own package"),
])
def test_a_user_trainers_checkpoint_that_its_loader_cannot_score_is_refused_naming_it(
    step_dir: Path, corpus: Path, tmp_path: Path, user_loaders: None, loader: str | None, says: str
) -> None:
    users = _as_user_trainers(step_dir, tmp_path / "user", **({"evaluate": loader} if loader else {}))
    with pytest.raises(evaluate.TrainerError, match=says):
        evaluate.evaluate_checkpoint(users, corpus, max_windows=16)
    out = tmp_path / "e.json"
    assert evaluate.main(["--checkpoint", str(users), "--manifest", str(corpus), "--out", str(out)]) == 2
    assert not out.exists()

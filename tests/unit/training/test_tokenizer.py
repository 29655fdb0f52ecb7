"""Tokenizers: the byte tokenizer, deterministic BPE training (across processes and thread pools), files by path."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln_trainer.errors import TokenizerError
from kiln_trainer.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

from trainer_fixtures import REPO, stdlib_sources

TEXTS = [text for _, text in stdlib_sources(300_000)]


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(TEXTS, vocab_size=600)


def test_byte_tokenizer_default_has_its_own_eos_id():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.kind) == (257, 256, "byte")
    assert tok.encode_batch(["é\x00"]) == [[0xC3, 0xA9, 0]]  # a NUL in text is text, not EOS
    assert tok.decode([104, 105, 256, 0]) == "hi\x00"


def test_byte_tokenizer_with_a_separator_byte_keeps_256_ids():
    tok = ByteTokenizer(eos_id=0)
    assert (tok.vocab_size, tok.eos_id) == (256, 0)
    assert tok.encode_documents(["ab", "c"]).tolist() == [97, 98, 0, 99, 0]


@pytest.mark.parametrize("eos", [256, 0, 10])
def test_byte_fast_path_equals_the_generic_encoding(eos):
    tok = ByteTokenizer(eos_id=eos)
    texts = TEXTS[:20] + ["", "ünïcödé"]
    generic = np.concatenate([np.array(ids + [eos], dtype=np.uint32) for ids in tok.encode_batch(texts)])
    assert np.array_equal(tok.encode_documents(texts), generic)


def test_byte_tokenizer_artifact_round_trips_and_identifies_the_eos(tmp_path):
    a, b = ByteTokenizer(), ByteTokenizer(eos_id=0)
    assert a.sha256 != b.sha256
    assert a.sha256 == ByteTokenizer().sha256
    loaded = load_tokenizer(a.save(tmp_path / "tokenizer.json"))
    assert isinstance(loaded, ByteTokenizer)
    assert loaded.sha256 == a.sha256 == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("eos", [-1, 257, True, "0"])
def test_byte_tokenizer_refuses_a_bad_eos(eos):
    with pytest.raises(TokenizerError, match="eos_id"):
        ByteTokenizer(eos_id=eos)


def test_bpe_has_the_vocabulary_asked_for_and_eos_zero(bpe):
    assert (bpe.kind, bpe.vocab_size, bpe.eos_id) == ("bpe", 600, 0)
    ids = bpe.encode_batch(["def main():\n    return 0\n"])[0]
    assert len(ids) < len("def main():\n    return 0\n")  # merges happened
    assert max(ids) < 600 and 0 not in ids


def test_bpe_round_trips_any_text_including_unseen_bytes(bpe):
    texts = ["def main(", "ünïcödé ✓ 漢字", "\x00\x01 tab\tend", ""]
    assert [bpe.decode(ids) for ids in bpe.encode_batch(texts)] == texts


def test_bpe_encode_batch_is_tokenizers_own_encode_batch(bpe):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_str(bpe.to_bytes().decode())
    assert bpe.encode_batch(TEXTS[:30]) == [e.ids for e in reference.encode_batch(TEXTS[:30], add_special_tokens=False)]


def test_encode_documents_puts_eos_after_every_document(bpe):
    stream = bpe.encode_documents(["a b", "c"])
    assert stream.dtype == np.uint32
    assert stream.tolist() == bpe.encode_batch(["a b"])[0] + [0] + bpe.encode_batch(["c"])[0] + [0]


def test_training_twice_in_one_process_gives_the_same_bytes(bpe):
    again = train_bpe(iter(TEXTS), vocab_size=600)
    assert again.to_bytes() == bpe.to_bytes()
    assert again.sha256 == bpe.sha256


_TRAIN_IN_CHILD = """
import sys
sys.path.insert(0, {training!r}); sys.path.insert(0, {fixtures!r})
from trainer_fixtures import stdlib_sources
from kiln_trainer.tokenizer import train_bpe
texts = [t for _, t in stdlib_sources(300_000)]
sys.stdout.write(train_bpe(texts, vocab_size=600).sha256)
"""


@pytest.mark.parametrize("threads", ["1", "2", "7", None])
def test_training_gives_the_same_bytes_in_another_process_and_thread_pool(bpe, threads):
    """Rust's HashMap seeds differ per process and rayon splits work by thread count: neither may show."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    if threads is not None:
        env["RAYON_NUM_THREADS"] = threads
    env["PYTHONHASHSEED"] = threads or "random"
    code = _TRAIN_IN_CHILD.format(training=str(REPO / "training"), fixtures=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == bpe.sha256


def test_bpe_training_on_a_prefix_reads_only_the_prefix(bpe):
    def texts_then_poison():
        yield from TEXTS
        raise AssertionError("read past max_chars")

    prefix = train_bpe(texts_then_poison(), vocab_size=600, max_chars=sum(map(len, TEXTS)) - len(TEXTS[-1]))
    assert prefix.to_bytes() == train_bpe(TEXTS[:-1], vocab_size=600).to_bytes()
    assert prefix.sha256 != bpe.sha256


def test_bpe_training_refuses_a_vocabulary_below_bytes_plus_eos():
    with pytest.raises(TokenizerError, match="vocab_size"):
        train_bpe(TEXTS[:3], vocab_size=256)


def test_bpe_training_names_a_non_text_document():
    with pytest.raises(TokenizerError, match="#1 is bytes"):
        train_bpe(["ok", b"bytes"], vocab_size=300)


def test_a_saved_bpe_loads_back_as_bpe(bpe, tmp_path):
    loaded = load_tokenizer(bpe.save(tmp_path / "t.json"))
    assert (loaded.kind, loaded.sha256, loaded.eos_id) == ("bpe", bpe.sha256, 0)


def _foreign_tokenizer_json(eos: str) -> str:
    """A tokenizer kiln did not train: word-level, its own special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, eos: 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([eos])
    return tok.to_str()


def test_a_tokenizer_file_by_path_keeps_its_bytes_and_names_its_eos(tmp_path):
    path = tmp_path / "foreign.json"
    path.write_text(_foreign_tokenizer_json("</s>"))
    tok = load_tokenizer(path, eos_token="</s>")
    assert (tok.kind, tok.eos_id, tok.vocab_size) == ("file", 1, 4)
    assert tok.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert tok.encode_batch(["hello world"]) == [[2, 3]]


def test_a_tokenizer_file_without_the_eos_token_is_refused_by_name(tmp_path):
    path = tmp_path / "foreign.json"
    path.write_text(_foreign_tokenizer_json("</s>"))
    with pytest.raises(TokenizerError, match=rf"{path}.*no token '{EOS_TOKEN}'"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\xff\xfe", "not JSON"), (b'{"model": 3}', "not a Hugging Face tokenizer"), (None, "cannot read")],
)
def test_unreadable_tokenizer_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_an_edited_byte_tokenizer_artifact_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kind": "kiln.ByteTokenizer", "format": 1, "eos_id": 256}, indent=2))
    with pytest.raises(TokenizerError, match="canonical"):
        load_tokenizer(path)

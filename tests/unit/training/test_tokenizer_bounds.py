"""Tokenizer inputs that the tokenizers library cannot take give kiln errors naming the cap, never an abort or a panic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln_trainer.config import MAX_BPE_VOCAB, TokenizerConfig
from kiln_trainer.errors import RecipeError, TokenizerError
from kiln_trainer.tokenizer import load_tokenizer, train_bpe


def test_a_bpe_vocabulary_above_the_cap_is_a_recipe_error_naming_it() -> None:
    assert TokenizerConfig(kind="bpe", vocab_size=MAX_BPE_VOCAB).vocab_size == MAX_BPE_VOCAB
    # 2**32 - 1 was allowed, and the tokenizers trainer then asked for ~70 GB and aborted the process.
    with pytest.raises(RecipeError, match=f"tokenizer.vocab_size = {2**32 - 1}: .*{MAX_BPE_VOCAB}.*MAX_BPE_VOCAB"):
        TokenizerConfig(kind="bpe", vocab_size=2**32 - 1)


def test_train_bpe_refuses_a_vocabulary_above_the_cap_before_training() -> None:
    with pytest.raises(TokenizerError, match=f"vocab_size = {MAX_BPE_VOCAB + 1}: .*{MAX_BPE_VOCAB}"):
        train_bpe(["hello world"], MAX_BPE_VOCAB + 1)
    assert train_bpe(["hello world"] * 4, MAX_BPE_VOCAB).vocab_size < MAX_BPE_VOCAB  # the cap itself trains


def test_a_tokenizer_file_that_makes_the_library_panic_is_a_tokenizer_error(tmp_path: Path) -> None:
    # A BPE merge whose result is not in the vocabulary panics inside the Rust library (pyo3's
    # PanicException, a BaseException): kiln names the file instead of a traceback.
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TokenizerError, match=f"{path}: .*cannot load \\(it panicked"):
        load_tokenizer(path)

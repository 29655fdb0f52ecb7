"""Tokenizers: one small interface, three sources, each an artifact with a sha256 and an EOS id.

::

    tok = ByteTokenizer()                                  # bytes; EOS 256, vocab 257
    tok = ByteTokenizer(eos_id=0)                          # today's stream: NUL between docs, vocab 256
    tok = train_bpe(iter_of_texts, vocab_size=8192)        # byte-level BPE, deterministic
    tok = load_tokenizer("path/tokenizer.json")            # a file: kiln's byte artifact or HF JSON
    tok = build_tokenizer(recipe.tokenizer, recipe_path=..., training_texts=...)   # what a recipe asks for

    tok.encode_batch(["def f():"]) -> [[...ids...]]        tok.decode(ids) -> str (EOS dropped)
    tok.encode_documents(texts) -> uint32 ids, each doc followed by tok.eos_id (what gets packed)
    tok.vocab_size, tok.eos_id, tok.kind, tok.sha256       tok.to_bytes() / tok.save(path)

``sha256`` is the sha256 of ``to_bytes()``, the artifact itself: training twice on the same
documents gives the same bytes, so the same sha256 (HF ``tokenizers`` breaks merge-count ties by
pair id and sorts its alphabet; the byte-level alphabet is given up front, so no id depends on a
hash map's order or on the Rust thread pool -- ``test_tokenizer`` proves it across processes and
``RAYON_NUM_THREADS``). A tokenizer file given by path keeps its bytes; its EOS is the token named
``eos_token`` (the packed shards' key carries the EOS id too, since one file can serve two EOS
choices). Nothing here downloads anything.
"""

from __future__ import annotations

import contextlib
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln_trainer.checkpoint_manifest import atomic_write_bytes, canonical_json
from kiln_trainer.config import BYTE_EOS_OWN_ID, DEFAULT_EOS_TOKEN, MAX_BPE_VOCAB, MAX_VOCAB, TokenizerConfig
from kiln_trainer.errors import TokenizerError
from kiln_trainer.jsonfile import read_json

__all__ = [
    "BYTE_TOKENIZER_KIND",
    "EOS_TOKEN",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "train_bpe",
]

EOS_TOKEN = DEFAULT_EOS_TOKEN
"""The EOS (document separator) token of kiln's BPE tokenizers; id 0, the first special token."""
BYTE_TOKENIZER_KIND = "kiln.ByteTokenizer"


class Tokenizer(ABC):
    """What the packer, the trainer and the served model need of a tokenizer."""

    kind: str
    """``byte``, ``bpe`` (trained here) or ``file`` (loaded from a path)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @abstractmethod
    def to_bytes(self) -> bytes:
        """The artifact: what ``save`` writes and ``load_tokenizer`` reads back."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no EOS added."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; EOS ids are document boundaries, not text, and are dropped."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def describe(self) -> dict[str, Any]:
        """The identity a token manifest, a checkpoint and a model version's tags carry."""
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """One uint32 array: each text's ids followed by ``eos_id`` (the packed stream's unit)."""
        encoded = self.encode_batch(texts)
        out = np.empty(sum(len(ids) for ids in encoded) + len(encoded), dtype=np.uint32)
        pos = 0
        for ids in encoded:
            out[pos : pos + len(ids)] = ids
            pos += len(ids)
            out[pos] = self.eos_id
            pos += 1
        return out

    def save(self, path: str | Path) -> Path:
        return atomic_write_bytes(path, self.to_bytes())


class ByteTokenizer(Tokenizer):
    """Token id == UTF-8 byte value. EOS 256 by default (vocab 257: no byte is mistaken for it);
    ``eos_id`` in 0..255 keeps the 256-id vocabulary and that byte as separator, as before tokenizers."""

    kind = "byte"

    def __init__(self, eos_id: int = BYTE_EOS_OWN_ID) -> None:
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id <= BYTE_EOS_OWN_ID:
            raise TokenizerError(f"byte tokenizer eos_id = {eos_id!r}: must be 0..255 (a separator byte) or 256")
        self._eos_id = eos_id

    @property
    def vocab_size(self) -> int:
        return 257 if self._eos_id == 256 else 256

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def to_bytes(self) -> bytes:
        return canonical_json({"kind": BYTE_TOKENIZER_KIND, "format": 1, "eos_id": self._eos_id})

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        # One join instead of a Python int per byte: the byte path must stay as cheap as it was.
        if self._eos_id < 256:
            sep = bytes([self._eos_id])
            joined = sep.join(text.encode("utf-8") for text in texts) + (sep if texts else b"")
            return np.frombuffer(joined, dtype=np.uint8).astype(np.uint32)
        parts = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        out = np.full(sum(len(p) for p in parts) + len(parts), self._eos_id, dtype=np.uint32)
        pos = 0
        for part in parts:
            out[pos : pos + len(part)] = part
            pos += len(part) + 1
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i != self._eos_id and 0 <= i < 256).decode("utf-8", errors="replace")


@contextlib.contextmanager
def _tokenizers_errors(failed: str, panicked: Callable[[str], str]) -> Iterator[None]:
    """The tokenizers library's failures as a ``TokenizerError``: ``failed`` followed by its bare
    ``Exception``'s text, or ``panicked(detail)`` for a Rust panic, which reaches Python as pyo3's
    ``PanicException``, a ``BaseException`` that ``except Exception`` does not catch."""
    try:
        yield
    except Exception as exc:
        raise TokenizerError(f"{failed}{exc}") from exc
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise TokenizerError(panicked(str(exc).strip()[:200])) from exc


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON artifact (kind ``bpe`` when trained here, else ``file``)."""

    def __init__(self, artifact: bytes, *, kind: str, eos_token: str = EOS_TOKEN, where: str = "tokenizer") -> None:
        from tokenizers import Tokenizer as RustTokenizer

        # A panic here: e.g. a BPE merge of a token not in the vocabulary.
        with _tokenizers_errors(f"{where}: not a Hugging Face tokenizer JSON: ",
                                lambda detail: f"{where}: a Hugging Face tokenizer JSON that the tokenizers library "
                                f"cannot load (it panicked: {detail})"):
            self._tok = RustTokenizer.from_str(artifact.decode("utf-8"))
        eos = self._tok.token_to_id(eos_token)
        if eos is None:
            raise TokenizerError(f"{where}: has no token {eos_token!r} to use as EOS (document separator)")
        self._artifact = artifact
        self._where = where
        self._sha256 = hashlib.sha256(artifact).hexdigest()
        self._eos_id = int(eos)
        self.kind = kind
        self.eos_token = eos_token
        size = self._tok.get_vocab_size(with_added_tokens=True)
        if size > MAX_VOCAB:
            raise TokenizerError(f"{where}: vocabulary of {size} ids does not fit uint32 token ids")
        self._vocab_size = int(size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def sha256(self) -> str:
        return self._sha256  # the artifact can be megabytes: hash it once

    def to_bytes(self) -> bytes:
        return self._artifact

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips the offsets a trainer never needs; same ids as encode_batch.
        # A panic here: a file's own regex past Oniguruma's retry limit (a backtracking Split or Replace).
        with _tokenizers_errors(f"{self._where}: the tokenizers library cannot encode with it: ",
                                lambda detail: f"{self._where}: the tokenizers library panicked encoding text with "
                                f"this tokenizer ({detail}); is one of its regexes backtracking?"):
            encoded = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    eos_token: str = EOS_TOKEN,
    max_chars: int | None = None,
) -> HFTokenizer:
    """A byte-level BPE tokenizer trained on ``texts`` (streamed once); same texts, same bytes.

    The 256 byte symbols and ``eos_token`` (id 0) are always in the vocabulary, so every text
    encodes without an unknown token; ``vocab_size`` counts them. ``max_chars`` stops after the
    documents that reach that many characters (a corpus-scale tokenizer is trained on a prefix;
    the documents' order is the manifest's, so the prefix -- and the artifact -- are fixed).
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not smallest <= vocab_size <= MAX_BPE_VOCAB:
        raise TokenizerError(f"bpe vocab_size = {vocab_size!r}: must be an int in [{smallest}, {MAX_BPE_VOCAB}] "
                             f"(MAX_BPE_VOCAB: what the tokenizers library's trainer can hold in memory)")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=sorted(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_strings(texts, max_chars), trainer=trainer)
    return HFTokenizer(tok.to_str().encode("utf-8"), kind="bpe", eos_token=eos_token)


def _strings(texts: Iterable[str], max_chars: int | None) -> Iterator[str]:
    seen = 0
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TokenizerError(f"training text #{i} is {type(text).__name__}, not str")
        yield text
        seen += len(text)
        if max_chars is not None and seen >= max_chars:
            return


def build_tokenizer(
    cfg: TokenizerConfig,
    *,
    recipe_path: str | Path | None = None,
    training_texts: Callable[[], Iterable[str]] | None = None,
) -> Tokenizer:
    """The tokenizer a recipe's ``[tokenizer]`` asks for.

    ``byte``: built; ``file``: read from ``tokenizer.path`` (relative to the recipe file);
    ``bpe``: trained on ``training_texts()`` (the training shards' documents in manifest order,
    e.g. ``packed.iter_training_texts(manifest.shards)``), the same bytes for the same texts.
    """
    if cfg.kind == "byte":
        return ByteTokenizer(cfg.eos_id)
    if cfg.kind == "file":
        return load_tokenizer(cfg.resolved_path(recipe_path), eos_token=cfg.eos_token)
    if training_texts is None:
        raise TokenizerError("a bpe tokenizer is trained on the training shards' documents, and none were given")
    return train_bpe(training_texts(), cfg.vocab_size, eos_token=cfg.eos_token, max_chars=cfg.max_train_chars or None)


def load_tokenizer(path: str | Path, *, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """A tokenizer artifact from disk: kiln's byte tokenizer JSON or a Hugging Face tokenizer JSON.

    A HF file that kiln trained comes back as kind ``bpe``; any other as ``file``.
    """
    where = str(path)
    raw, doc = read_json(path, "tokenizer file", TokenizerError)
    if isinstance(doc, dict) and doc.get("kind") == BYTE_TOKENIZER_KIND:
        tok = ByteTokenizer(doc.get("eos_id", 256))
        if tok.to_bytes() != raw:
            raise TokenizerError(f"{where}: byte tokenizer artifact is not in canonical form (edited by hand?)")
        return tok
    kind = "bpe" if _looks_trained_here(doc, eos_token) else "file"
    return HFTokenizer(raw, kind=kind, eos_token=eos_token, where=where)


def _looks_trained_here(doc: Any, eos_token: str) -> bool:
    """kiln's BPE: a byte-level BPE model whose only special token is ``eos_token`` at id 0."""
    if not isinstance(doc, dict):
        return False
    model, pre, added = doc.get("model"), doc.get("pre_tokenizer"), doc.get("added_tokens")
    if not (isinstance(model, dict) and isinstance(pre, dict) and isinstance(added, list) and added):
        return False
    if not isinstance(added[0], dict):
        return False
    return (
        model.get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and len(added) == 1
        and added[0].get("content") == eos_token
        and added[0].get("id") == 0
    )

"""The eval split's document hashes: what the contamination rule compares each training row with."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln.data.validation.shards import _decode_strings, _open_corpus_file, eval_shards
from kiln.errors import ContractError


class EvalDocHashes(frozenset):
    """sha256 hex digests of the eval split's texts, plus their UTF-8 byte lengths.

    A plain frozenset of the digests works everywhere this does; the lengths only let validation
    hash just the rows that could be equal to an eval document (same byte length)."""

    byte_lengths: frozenset[int]

    def __new__(cls, hashes: Iterable[str], byte_lengths: Iterable[int]) -> EvalDocHashes:
        self = super().__new__(cls, hashes)
        self.byte_lengths = frozenset(byte_lengths)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (EvalDocHashes, (frozenset(self), self.byte_lengths))


def eval_documents(corpus_dir: str | Path) -> Iterator[tuple[Path, list[str | None], list[str | None]]]:
    """``(path, doc ids, texts)`` of every eval shard of the corpus (``eval/*.parquet``), in path order;
    ids are None where the shard has no ``doc_id`` column. Read only from inside the corpus; a shard
    that cannot be read is a ``ContractError`` (the split could not be compared with)."""
    import pyarrow.parquet as pq

    for path in eval_shards(corpus_dir):
        try:
            with _open_corpus_file(os.path.abspath(path), os.path.abspath(corpus_dir)) as fh:
                table = pq.read_table(fh)
            texts = _decode_strings(table.column("text"))
            ids = table.column("doc_id").to_pylist() if "doc_id" in table.column_names else [None] * len(texts)
        except Exception as exc:
            raise ContractError(f"cannot read the eval split {path} for the contamination rules: {exc}") from exc
        yield path, ids, texts


def load_eval_doc_hashes(corpus_dir: str | Path) -> EvalDocHashes:
    """sha256 of every document text of the corpus' eval split (``eval/*.parquet``).

    No eval split → empty set (the contamination rule then has nothing to compare with). An eval
    split that cannot be read is a fault: contamination could not be checked.
    """
    hashes: set[str] = set()
    lengths: set[int] = set()
    for _, _, texts in eval_documents(corpus_dir):
        for text in texts:
            if text is not None:
                data = text.encode("utf-8")
                hashes.add(hashlib.sha256(data).hexdigest())
                lengths.add(len(data))
    return EvalDocHashes(hashes, lengths)

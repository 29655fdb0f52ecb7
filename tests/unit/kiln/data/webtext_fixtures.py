"""Natural-language shards in kiln's layout for the web-text tests: English prose present on every
machine (the standard library's ``pydoc_data/topics.py``, Debian's ``/usr/share/common-licenses``).

Imported by the tests as ``webtext_fixtures`` (pytest puts this directory on sys.path). When the
natural-language sample corpus builder of ``kiln corpus`` lands, ``prose_documents`` and
``write_corpus`` can give way to it; the poison kinds are already kiln's (``kiln.data.poison_text``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from kiln.data.corpus import parquet_bytes
from kiln.data.poison_text import Document, poison_documents

LICENSES = Path("/usr/share/common-licenses")
MIN_DOC_CHARS = 900
"""Paragraphs are joined until a document has at least this many characters (web pages are longer
than one paragraph; the C4 rule wants 5 sentences)."""


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs, each unwrapped onto one line (as extracted web text is); indented blocks (code
    examples, grammar) are left out."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not block.strip() or any(line.startswith("   ") for line in lines):
            continue
        out.append(" ".join(line.strip() for line in lines))
    return out


def _documents(paragraphs: list[str], source: str) -> list[Document]:
    docs: list[Document] = []
    current: list[str] = []
    for paragraph in paragraphs:
        current.append(paragraph)
        if sum(len(p) for p in current) >= MIN_DOC_CHARS:
            docs.append((f"{source}#{len(docs)}", "\n".join(current), source))
            current = []
    return docs


def prose_documents() -> list[Document]:
    """Every prose document of the two sources, in a seeded order (sources mixed across shards)."""
    import pydoc_data.topics

    docs: list[Document] = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        docs.extend(_documents(_paragraphs(text), f"pydoc:{name}"))
    if LICENSES.is_dir():
        for path in sorted(LICENSES.iterdir()):
            if path.is_file() and not path.is_symlink():
                docs.extend(_documents(_paragraphs(path.read_text(encoding="utf-8", errors="replace")), f"license:{path.name}"))
    random.Random(20).shuffle(docs)
    return docs


def table(docs: Sequence[Document]):
    import pyarrow as pa

    return pa.table({"doc_id": [d[0] for d in docs], "text": [d[1] for d in docs], "source": [d[2] for d in docs]},
                    schema=pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())]))


def write_corpus(out: Path, parts: Sequence[Sequence[Document]]) -> list[Path]:
    """``out/train/shard-NNNNN.parquet``, one per part, in kiln's layout (the sample corpus' writer)."""
    (out / "train").mkdir(parents=True, exist_ok=True)
    paths = []
    for i, docs in enumerate(parts):
        path = out / "train" / f"shard-{i:05d}.parquet"
        path.write_bytes(parquet_bytes(table(docs)))
        paths.append(path)
    return paths


def split(docs: Sequence[Document], shards: int) -> list[list[Document]]:
    size = len(docs) // shards
    return [list(docs[i * size : (i + 1) * size]) for i in range(shards)]


def poisoned(kind: str, docs: Sequence[Document], donors: Sequence[Document] = ()) -> list[Document]:
    return poison_documents(kind, docs, seed=7, donors=donors)

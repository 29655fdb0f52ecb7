"""The sample corpus: the Python standard library's own ``.py`` sources as sharded Parquet.

Real text, no download: the files under ``sysconfig.get_paths()["stdlib"]`` of the running
interpreter (tests, ``site-packages`` and build-config modules excluded). Each file is cut at line
boundaries into documents of at most ``MAX_DOC_BYTES`` UTF-8 bytes; a document is one row::

    doc_id  string   "<relative path>#<chunk index>"   unique and stable for a given stdlib
    text    string   the chunk, lines intact
    source  string   relative path of the file it came from

Layout written under ``out``::

    out/train/shard-00000.parquet ... shard-{N-1}.parquet
    out/eval/eval-00000.parquet        held-out split, never overlapping train (split by file)
    out/corpus.json                    its record (``kiln.data.corpora``): Python source, contract stdlib-py@1

Deterministic: the same arguments on the same interpreter give byte-identical files (seeded
shuffles, fixed row-group size, no timestamps, no pandas metadata). ``poison`` turns chosen shard
positions into bad shards, each breaking exactly one rule of the ``stdlib-py`` contract, so that
demos and tests exercise quarantine. Which shard got which poison is returned (and printed by the
CLI) but never written inside ``out``: that would put the answers into the snapshot.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import platform
import random
import shutil
import sysconfig
import tempfile
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.corpora import METADATA_FILE, CorpusMetadata, SplitStats, write_metadata
from kiln.errors import ConfigError, KilnError
from kiln.util.fs import atomic_write_bytes, fsync_dir, os_error_text, unusable_target_reason

MAX_DOC_BYTES = 4096
"""Upper bound of one document in UTF-8 bytes (the contract allows more: headroom, not a target)."""
MIN_DOC_CHARS = 64
"""Chunks shorter than this (e.g. a file's trailing blank lines) are dropped."""
ROW_GROUP_SIZE = 128
"""Fixed row-group size: part of what makes the bytes reproducible."""
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
"""Text budget of the whole corpus (train + eval), approximate since files are taken whole:
~4 MiB of source, ~1.3 MB of Parquet."""
EVAL_FRACTION = 0.1
"""Share of ``max_bytes`` given to the held-out evaluation split."""
COMPRESSION = "zstd"
SAMPLE_CONTRACT = "stdlib-py@1"
"""The contract the sample corpus is made for (its ``corpus.json``)."""

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
# Whitespace controls that legitimately occur in Python source (\f is used as a page break).
_ALLOWED_CONTROLS = frozenset("\t\n\r\f\v")


@dataclass(frozen=True, slots=True)
class PoisonKind:
    name: str
    rule: str
    """The contract rule (expectation type, or kiln rule id) this poison must trip, and only it."""
    column: str | None
    """The column that rule is checked on (None for table-level and read rules)."""
    description: str

    @property
    def trips(self) -> str:
        return f"{self.rule}({self.column})" if self.column else self.rule


_SHARE = "kiln_text_bad_char_share"
_EVAL = "kiln_text_in_eval_split"
_NOT_NULL = "expect_column_values_to_not_be_null"
_LENGTH = "expect_column_value_lengths_to_be_between"
_BETWEEN = "expect_column_values_to_be_between"
_READABLE = "readable_parquet"

POISON_KINDS: dict[str, PoisonKind] = {
    p.name: p
    for p in (
        PoisonKind("missing_column", "expect_table_columns_to_match_set", None, "the `text` column is dropped"),
        PoisonKind("wrong_type", "expect_column_values_to_be_of_type", "doc_id", "`doc_id` is int64, not string"),
        PoisonKind("null_ids", _NOT_NULL, "doc_id", "three rows have a null `doc_id`"),
        PoisonKind("null_text", _NOT_NULL, "text", "three rows have a null `text`"),
        PoisonKind("duplicate_ids", "expect_column_values_to_be_unique", "doc_id", "three rows reuse ids of the same shard"),
        PoisonKind(
            "duplicate_ids_across_shards", "doc_id_unique_across_shards", "doc_id", "three rows reuse ids of an earlier shard"
        ),
        PoisonKind("oversized_doc", _LENGTH, "text", "one document of 64 KiB"),
        PoisonKind("tiny_doc", _LENGTH, "text", "three documents of under 16 characters"),
        PoisonKind("invalid_utf8", _BETWEEN, _SHARE, "invalid UTF-8 bytes inside one document"),
        PoisonKind("control_chars", _BETWEEN, _SHARE, "one document full of NUL/ESC/U+FFFD characters"),
        PoisonKind(
            "secret",
            "expect_column_values_to_not_match_regex_list",
            "text",
            "a private key block, an AWS access key id and a GitHub token in three documents",
        ),
        PoisonKind(
            "eval_contamination", "expect_column_values_to_be_in_set", _EVAL, "three documents copied from the eval split"
        ),
        PoisonKind("zero_rows", "expect_table_row_count_to_be_between", None, "right schema, no rows (too few rows)"),
        PoisonKind("truncated", _READABLE, None, "a valid shard cut in half (no footer)"),
        PoisonKind("garbage_bytes", _READABLE, None, "random bytes named .parquet"),
        PoisonKind("zero_bytes", _READABLE, None, "an empty file"),
        PoisonKind("csv_file", _READABLE, None, "the shard's rows as CSV, named .parquet"),
    )
}


def shard_schema():
    """The columns of every kiln shard (train and eval), written by ``build_corpus`` and ``kiln.data.corpus_import``."""
    import pyarrow as pa

    return pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())])


@dataclass(frozen=True, slots=True)
class _Doc:
    doc_id: str
    text: str
    source: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the stdlib's .py files, sorted (the order the seed shuffles)."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith(_EXCLUDED_PREFIXES) or rel.name.startswith(_EXCLUDED_PREFIXES):
            continue
        if path.is_file():
            found.append(rel.as_posix())
    return sorted(found)


def _is_clean(text: str) -> bool:
    """A chunk the sample corpus may contain: long enough, no control or replacement characters."""
    if len(text.strip()) < MIN_DOC_CHARS:
        return False
    return not any(
        (ch == "\ufffd") or (ch not in _ALLOWED_CONTROLS and unicodedata.category(ch) == "Cc") for ch in text
    )


def _split_long_line(line: str) -> list[str]:
    pieces: list[str] = []
    piece: list[str] = []
    size = 0
    for ch in line:
        width = len(ch.encode("utf-8"))
        if size + width > MAX_DOC_BYTES:
            pieces.append("".join(piece))
            piece, size = [], 0
        piece.append(ch)
        size += width
    pieces.append("".join(piece))
    return pieces


def _chunk_file(root: Path, rel: str) -> list[_Doc]:
    """Cut one file into documents of ≤ MAX_DOC_BYTES at line boundaries."""
    try:
        text = (root / rel).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return []  # a stdlib file in another encoding: not sample material
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        width = len(line.encode("utf-8"))
        if size + width > MAX_DOC_BYTES and current:
            chunks.append("".join(current))
            current, size = [], 0
        if width > MAX_DOC_BYTES:
            chunks.extend(_split_long_line(line))
            continue
        current.append(line)
        size += width
    if current:
        chunks.append("".join(current))
    # The chunk index counts every chunk, kept or not, so ids stay stable if the filter changes.
    return [_Doc(f"{rel}#{i}", chunk, rel) for i, chunk in enumerate(chunks) if _is_clean(chunk)]


def _select(root: Path, seed: int, max_bytes: int) -> tuple[list[_Doc], list[_Doc]]:
    """Seeded split by source file (a file goes whole to one side) until ``max_bytes`` of text.

    Documents whose exact text was already taken (from any file) are dropped.

    A file goes to eval when eval would then still hold at most ``EVAL_FRACTION`` of the text taken
    so far; once train has its share of ``max_bytes``, only files that fit eval's remaining budget
    are taken, until eval holds at least half its budget.
    """
    files = _source_files(root)
    if not files:
        raise ConfigError(f"no .py files found under the stdlib directory {root}")
    random.Random(seed).shuffle(files)
    eval_budget = EVAL_FRACTION * max_bytes
    train_budget = max_bytes - eval_budget
    eval_docs: list[_Doc] = []
    train_docs: list[_Doc] = []
    eval_bytes = train_bytes = 0
    seen: set[str] = set()
    for rel in files:
        train_full = train_bytes >= train_budget
        if train_full and eval_bytes >= eval_budget / 2:
            break
        # Exact duplicates across files exist (the generated codec tables share whole chunks): keep
        # the first copy only, or a document could sit in both splits and contaminate evaluation.
        docs = []
        for doc in _chunk_file(root, rel):
            digest = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
            if digest not in seen:
                seen.add(digest)
                docs.append(doc)
        size = sum(len(d.text.encode("utf-8")) for d in docs)
        if not docs:
            continue
        fits_share = eval_bytes + size <= EVAL_FRACTION * (eval_bytes + train_bytes + size)
        if fits_share or (train_full and eval_bytes + size <= eval_budget):
            eval_docs.extend(docs)
            eval_bytes += size
        elif not train_full:
            train_docs.extend(docs)
            train_bytes += size
    return train_docs, eval_docs


def _table(docs: Sequence[_Doc]):
    import pyarrow as pa

    return pa.table(
        {
            "doc_id": pa.array([d.doc_id for d in docs], pa.string()),
            "text": pa.array([d.text for d in docs], pa.string()),
            "source": pa.array([d.source for d in docs], pa.string()),
        },
        schema=shard_schema(),
    )


def parquet_bytes(table: Any) -> bytes:
    """Serialise a table the reproducible way (same table → same bytes)."""
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_SIZE, compression=COMPRESSION)
    return sink.getvalue()


def _unchecked_string_array(values: Sequence[bytes | None]):
    """A string array holding arbitrary bytes: pyarrow validates UTF-8 on build, not on view."""
    import pyarrow as pa

    return pa.array(values, pa.binary()).view(pa.string())


# -- poisons -------------------------------------------------------------------------------------
# Each takes the shard's clean documents and returns the bytes of the poisoned shard file. They
# change only what their rule looks at, so that the shard trips that rule and no other.


def _fake_secrets(rng: random.Random) -> list[str]:
    alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    upper = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    b64 = alnum + "+/"
    key_body = "\n".join("".join(rng.choice(b64) for _ in range(64)) for _ in range(6))
    private_key = "-----BEGIN RSA " + "PRIVATE KEY-----\n" + key_body + "\n-----END RSA " + "PRIVATE KEY-----\n"
    aws_key = "AKIA" + "".join(rng.choice(upper) for _ in range(16))
    github_token = "ghp" + "_" + "".join(rng.choice(alnum) for _ in range(36))
    return [
        f'\nSIGNING_KEY = """\n{private_key}"""\n',
        f'\nAWS_ACCESS_KEY_ID = "{aws_key}"\n',
        f'\nGITHUB_TOKEN = "{github_token}"\n',
    ]


def _poisoned_shard(kind: str, docs: list[_Doc], ctx: dict[str, Any], rng: random.Random) -> bytes:
    import pyarrow as pa

    docs = list(docs)
    if kind == "missing_column":
        return parquet_bytes(_table(docs).drop_columns(["text"]))
    if kind == "wrong_type":
        table = _table(docs)
        ids = pa.array(range(1, len(docs) + 1), pa.int64())
        return parquet_bytes(table.set_column(0, pa.field("doc_id", pa.int64()), ids))
    if kind in ("null_ids", "null_text"):
        column = 0 if kind == "null_ids" else 1
        table = _table(docs)
        values = table.column(column).to_pylist()
        for i in rng.sample(range(len(values)), 3):
            values[i] = None
        return parquet_bytes(table.set_column(column, table.schema.field(column), pa.array(values, pa.string())))
    if kind == "duplicate_ids":
        picks = rng.sample(range(len(docs)), 6)
        for victim, original in zip(picks[:3], picks[3:], strict=True):
            docs[victim] = _Doc(docs[original].doc_id, docs[victim].text, docs[victim].source)
        return parquet_bytes(_table(docs))
    if kind == "duplicate_ids_across_shards":
        donor: list[_Doc] = ctx["donor_docs"]
        for victim, original in zip(rng.sample(range(len(docs)), 3), rng.sample(range(len(donor)), 3), strict=True):
            docs[victim] = _Doc(donor[original].doc_id, docs[victim].text, docs[victim].source)
        return parquet_bytes(_table(docs))
    if kind == "oversized_doc":
        i = rng.randrange(len(docs))
        big = "".join(d.text for d in docs)
        while len(big) < 64 * 1024:
            big += big
        docs[i] = _Doc(docs[i].doc_id, big[: 64 * 1024], docs[i].source)
        return parquet_bytes(_table(docs))
    if kind == "tiny_doc":
        for i, text in zip(rng.sample(range(len(docs)), 3), ("", "pass\n", "import os\n"), strict=True):
            docs[i] = _Doc(docs[i].doc_id, text, docs[i].source)
        return parquet_bytes(_table(docs))
    if kind == "invalid_utf8":
        i = rng.randrange(len(docs))
        texts: list[bytes | None] = [d.text.encode("utf-8") for d in docs]
        raw = texts[i] or b""
        texts[i] = raw[: len(raw) // 2] + b"\xff\xfe\xc3\x28" * 64 + raw[len(raw) // 2 :]
        table = _table(docs)
        return parquet_bytes(table.set_column(1, table.schema.field(1), _unchecked_string_array(texts)))
    if kind == "control_chars":
        i = rng.randrange(len(docs))
        noise = "".join(rng.choice("\x00\x1b\x07\x08\ufffd") for _ in range(512))
        text = docs[i].text
        docs[i] = _Doc(docs[i].doc_id, text[: len(text) // 2] + noise + text[len(text) // 2 :], docs[i].source)
        return parquet_bytes(_table(docs))
    if kind == "secret":
        for i, secret in zip(rng.sample(range(len(docs)), 3), _fake_secrets(rng), strict=True):
            docs[i] = _Doc(docs[i].doc_id, docs[i].text + secret, docs[i].source)
        return parquet_bytes(_table(docs))
    if kind == "eval_contamination":
        eval_docs: list[_Doc] = ctx["eval_docs"]
        copies = min(3, len(eval_docs))
        for i, original in zip(rng.sample(range(len(docs)), copies), rng.sample(range(len(eval_docs)), copies), strict=True):
            docs[i] = eval_docs[original]
        return parquet_bytes(_table(docs))
    if kind == "zero_rows":
        return parquet_bytes(_table([]))
    if kind == "truncated":
        whole = parquet_bytes(_table(docs))
        return whole[: len(whole) // 2]
    if kind == "garbage_bytes":
        return b"\x00GARBAGE" + rng.randbytes(8192)
    if kind == "zero_bytes":
        return b""
    if kind == "csv_file":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["doc_id", "text", "source"])
        writer.writerows((d.doc_id, d.text, d.source) for d in docs)
        return buf.getvalue().encode("utf-8")
    raise ConfigError(f"unknown poison kind {kind!r}; known: {', '.join(POISON_KINDS)}")


def _poison_positions(poison: Sequence[str], shards: int, seed: int) -> dict[int, str]:
    """Seeded shard positions for the poisons; a cross-shard duplicate comes after a clean donor."""
    rng = random.Random(f"kiln-poison-positions:{seed}")
    positions = rng.sample(range(shards), len(poison))
    chosen = dict(zip(positions, poison, strict=True))
    clean = [i for i in range(shards) if i not in chosen]
    for pos, kind in sorted(chosen.items()):
        # The collision is charged to the later shard, so the donor must be an earlier clean one.
        if kind == "duplicate_ids_across_shards" and not any(c < pos for c in clean):
            # Every shard before it is poisoned: move it to the first clean position (> pos),
            # which leaves ``pos`` clean and earlier.
            later = clean[0]
            chosen[later] = chosen.pop(pos)
            clean = sorted(set(clean) - {later} | {pos})
    return chosen


STAGING_PREFIX = ".kiln-build-"
"""A build writes under ``out/.kiln-build-*`` (same file system, so the swap is a rename) and swaps
``train/`` and ``eval/`` in only when every shard is written: a failure leaves no half corpus."""
_SPLITS = (("train", "shard-*.parquet"), ("eval", "eval-*.parquet"))


def _swap_in(staging: Path, out: Path) -> None:
    """Replace ``out/train``, ``out/eval`` and ``out/corpus.json`` with the staged ones; files there
    that a build does not write (anything but its shard names) move over to the new folders.

    The old folders go first and the new ``train/`` comes last; a rename that fails undoes the ones
    before it, so ``out`` holds the old corpus or the new one, never old and new shards mixed."""
    done: list[tuple[Path, Path]] = []

    def move(src: Path, dst: Path) -> None:
        os.replace(src, dst)
        done.append((src, dst))

    previous = staging / "previous"
    previous.mkdir()
    try:
        for split, ours in _SPLITS:
            old = out / split
            if not old.is_dir():
                continue
            for entry in sorted(old.iterdir()):
                if not entry.match(ours):
                    move(entry, staging / split / entry.name)
            move(old, previous / split)
        if (out / METADATA_FILE).exists():
            move(out / METADATA_FILE, previous / METADATA_FILE)
        move(staging / METADATA_FILE, out / METADATA_FILE)
        move(staging / "eval", out / "eval")
        move(staging / "train", out / "train")  # LAST: the commit point
    except BaseException:
        for src, dst in reversed(done):
            with contextlib.suppress(OSError):
                os.replace(dst, src)
        raise
    fsync_dir(out)


def _metadata(shards: int, seed: int, train_docs: list[_Doc], eval_docs: list[_Doc]) -> CorpusMetadata:
    """The corpus' record: Python source for the stdlib-py contract. Which shard got which poison
    stays out of it, like everything else inside ``out`` (the snapshot would hold the answers)."""
    return CorpusMetadata(
        kind="python-source",
        contract=SAMPLE_CONTRACT, producer="kiln corpus build",
        source={"format": "python-stdlib", "input": "the running interpreter's standard library",
                "python": platform.python_version(), "files": len({d.source for d in train_docs + eval_docs})},
        split={"rule": "by source file, a seeded shuffle; eval holds about eval_fraction of the text", "seed": seed,
               "eval_fraction": EVAL_FRACTION},
        train=SplitStats(shards=shards, documents=len(train_docs),
                         text_bytes=sum(len(d.text.encode("utf-8")) for d in train_docs)),
        eval=SplitStats(shards=1, documents=len(eval_docs), text_bytes=sum(len(d.text.encode("utf-8")) for d in eval_docs)),
    )


def build_corpus(
    out: Path,
    shards: int = 8,
    seed: int = 0,
    poison: Sequence[str] = (),
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    stdlib_dir: Path | None = None,
) -> dict[str, Any]:
    """Write the sample corpus under ``out`` and return a JSON-safe summary.

    The summary's ``poisoned`` maps each poisoned shard (path relative to ``out``) to its kind; it
    exists only in the return value. Re-running with the same arguments rewrites identical bytes
    (and removes shard files of an earlier build with more shards).
    """
    out = Path(out)
    poison = list(poison)
    problem = unusable_target_reason(out, directory=True)
    if problem:
        raise ConfigError(f"corpus directory {out}: {problem}")
    if shards < 1:
        raise ConfigError(f"shards must be >= 1, got {shards}")
    if max_bytes < 64 * 1024:
        raise ConfigError(f"max_bytes must be >= 65536, got {max_bytes}")
    unknown = [k for k in poison if k not in POISON_KINDS]
    if unknown:
        raise ConfigError(f"unknown poison kind(s) {unknown}; known: {', '.join(POISON_KINDS)}")
    if len(poison) > shards:
        raise ConfigError(f"{len(poison)} poisons need at least as many shards, got shards={shards}")
    if "duplicate_ids_across_shards" in poison and len(poison) >= shards:
        raise ConfigError("poison duplicate_ids_across_shards needs at least one clean shard to copy ids from")

    root = Path(stdlib_dir) if stdlib_dir is not None else stdlib_root()
    train_docs, eval_docs = _select(root, seed, max_bytes)
    if not eval_docs:
        raise ConfigError(f"max_bytes={max_bytes} leaves no file for the eval split: raise max_bytes")
    per_shard_min = 6 if poison else 1  # the row-level poisons touch up to 6 distinct rows
    if len(train_docs) < shards * per_shard_min:
        raise ConfigError(
            f"{len(train_docs)} training documents cannot fill {shards} shards "
            f"(≥{per_shard_min} each): raise max_bytes or lower shards"
        )
    base, extra = divmod(len(train_docs), shards)
    parts: list[list[_Doc]] = []
    start = 0
    for i in range(shards):
        size = base + (1 if i < extra else 0)
        parts.append(train_docs[start : start + size])
        start += size

    chosen = _poison_positions(poison, shards, seed)
    clean_positions = [i for i in range(shards) if i not in chosen]

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for leftover in out.glob(STAGING_PREFIX + "*"):  # of a build that was killed
            shutil.rmtree(leftover)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    except OSError as exc:
        raise KilnError(f"cannot write the corpus to {out}: {os_error_text(exc)}") from exc
    train_paths: list[str] = []
    poisoned: dict[str, str] = {}
    total = 0
    try:
        (staging / "train").mkdir()
        (staging / "eval").mkdir()
        for i, docs in enumerate(parts):
            name = f"train/shard-{i:05d}.parquet"
            if i in chosen:
                kind = chosen[i]
                donor = max((c for c in clean_positions if c < i), default=None)
                ctx = {"eval_docs": eval_docs, "donor_docs": parts[donor] if donor is not None else []}
                data = _poisoned_shard(kind, docs, ctx, random.Random(f"kiln-poison:{seed}:{i}:{kind}"))
                poisoned[name] = kind
            else:
                data = parquet_bytes(_table(docs))
            atomic_write_bytes(staging / name, data)
            train_paths.append(str(out / name))
            total += len(data)
        eval_data = parquet_bytes(_table(eval_docs))
        atomic_write_bytes(staging / "eval" / "eval-00000.parquet", eval_data)
        total += len(eval_data)
        metadata = _metadata(shards, seed, train_docs, eval_docs)
        total += len(write_metadata(staging, metadata).read_bytes())
        _swap_in(staging, out)
    except OSError as exc:
        raise KilnError(
            f"cannot write the corpus to {out}: {os_error_text(exc)}; "
            f"{'nothing was written' if created else 'the corpus there was left as it was'}"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    eval_path = out / "eval" / "eval-00000.parquet"
    return {
        "out": str(out),
        "seed": seed,
        "shards": shards,
        "train": train_paths,
        "eval": [str(eval_path)],
        "documents": {"train": len(train_docs), "eval": len(eval_docs)},
        "text_bytes": {
            "train": sum(len(d.text.encode("utf-8")) for d in train_docs),
            "eval": sum(len(d.text.encode("utf-8")) for d in eval_docs),
        },
        "bytes": total,
        "poisoned": poisoned,
        "stdlib": str(root),
    }

"""Which entries of a corpus are shards, and reading one: a regular file inside the corpus, never a link.

What else lies in ``train/`` is named (``SkippedEntry``); a shard that cannot be read is a quarantined report.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kiln.data.contracts import Contract
from kiln.data.validation.reasons import _quarantined
from kiln.refs import ShardReport
from kiln.util.fs import file_kind, open_regular_file

TRAIN_GLOB = "train/*.parquet"
EVAL_GLOB = "eval/*.parquet"
"""Corpus layout written by ``kiln.data.corpus.build_corpus``."""

READABLE_RULE = "readable_parquet"
"""Reason id of a shard that could not be read as Parquet at all."""


def train_shards(corpus_dir: str | Path) -> list[Path]:
    """Every ``train/*.parquet`` entry, whatever its kind: validation judges each one."""
    return sorted(Path(corpus_dir).glob(TRAIN_GLOB))


def eval_shards(corpus_dir: str | Path) -> list[Path]:
    return sorted(Path(corpus_dir).glob(EVAL_GLOB))


@dataclass(frozen=True, slots=True)
class SkippedEntry:
    """An entry of a corpus' ``train/`` folder that is not a shard: never validated, never trained on."""

    path: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def skipped_train_entries(corpus_dir: str | Path) -> list[SkippedEntry]:
    """What ``train_shards`` leaves out of ``train/`` (other names, folders), so a report can name it.

    One ``lstat`` per entry, no open: a FIFO here is named, not read."""
    train = Path(corpus_dir) / os.path.dirname(TRAIN_GLOB)
    shards = set(train_shards(corpus_dir))
    try:
        entries = sorted(train.iterdir())
    except OSError:  # no train/ at all: there is nothing to skip (and no shard either)
        return []
    skipped = []
    for entry in entries:
        if entry in shards:
            continue
        try:
            kind = file_kind(os.lstat(entry).st_mode)
        except OSError as exc:
            kind = f"entry that cannot be examined ({exc.strerror or exc})"
        where = "train/*.parquet only, not below train/" if kind == "directory" else "train/*.parquet only"
        reason = f"a {kind} that is not a shard (shards are {where}): not validated, not trained on"
        skipped.append(SkippedEntry(os.path.abspath(entry), reason))
    return skipped


class _NotAShardFile(Exception):
    """A corpus path that is not opened at all: not a regular file, or reached through a symlink."""


def _symlink_refused(path: str) -> _NotAShardFile:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return _NotAShardFile(f"{path} is a symlink (-> {target}); a shard must be a regular file inside the corpus")


def _open_corpus_file(path: str, root: str | None = None) -> BinaryIO:
    """Open a shard (or eval file) for reading: a regular file, never through a symlink.

    A FIFO would block the reader for ever and a link could bring bytes from outside the corpus
    into training, so neither is opened. Given ``root`` (the corpus directory ``path`` lies under),
    a path through a symlinked directory is refused too. ``O_NOFOLLOW | O_NONBLOCK`` keep that true
    for a file swapped in after the ``lstat``. Raises ``_NotAShardFile`` or ``OSError``.
    """
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _symlink_refused(path)
    if not stat.S_ISREG(mode):
        raise _NotAShardFile(f"{path} is a {file_kind(mode)}, not a regular file; a shard must be a regular file")
    if root is not None:
        real, abs_root = os.path.realpath(path), os.path.abspath(root)
        real_root = os.path.realpath(abs_root)
        if os.path.commonpath([abs_root, os.path.abspath(path)]) != abs_root:
            raise _NotAShardFile(f"{path} is not inside the corpus {abs_root}")
        if real != os.path.join(real_root, os.path.relpath(path, abs_root)):
            outside = "" if real.startswith(real_root + os.sep) else f", outside the corpus {abs_root}"
            raise _NotAShardFile(f"{path} is reached through a symlinked directory (resolves to {real}{outside}); "
                                 "a shard must be a regular file inside the corpus")
    try:
        return open_regular_file(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink_refused(path) from exc
        if exc.errno == errno.EINVAL:  # open_regular_file's "is a FIFO, not a regular file"
            raise _NotAShardFile(f"{path} {exc.strerror}; a shard must be a regular file") from None
        raise


def _decode_strings(column: Any) -> list[str | None]:
    """Parquet strings as Python str; invalid UTF-8 decodes to U+FFFD (the encoding rule counts it)."""
    import pyarrow as pa

    try:
        column.validate(full=True)  # checks UTF-8 in C++; valid text needs no per-value decode
    except pa.ArrowInvalid:
        raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        return [None if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()]
    return column.to_pylist()


def _read_table(data: bytes) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data))


@dataclass(frozen=True, slots=True)
class _LoadedShard:
    """A shard read as an Arrow table, not yet judged."""

    path: str
    sha256: str
    table: Any

    @property
    def rows(self) -> int:
        return int(self.table.num_rows)

    @property
    def schema_key(self) -> tuple[tuple[str, str, bool], ...]:
        """Shards with the same key can be stacked into one table (``pa.concat_tables``)."""
        return tuple((f.name, str(f.type), f.nullable) for f in self.table.schema)


def _unreadable(path: str, sha256: str, contract: Contract, exc: BaseException) -> ShardReport:
    error = f"{type(exc).__name__}: {exc}"[:500]
    return _quarantined(path, sha256, 0, contract, [{"expectation": READABLE_RULE, "error": error}])


def _load_shard(path: str | Path, contract: Contract, root: str | None = None) -> ShardReport | _LoadedShard:
    """Read one shard. Unreadable → its quarantined report (never raises for bad data, never blocks)."""
    abspath = os.path.abspath(path)
    try:
        with _open_corpus_file(abspath, root) as fh:
            data = fh.read()
    except _NotAShardFile as exc:
        return _quarantined(abspath, "", 0, contract, [{"expectation": READABLE_RULE, "error": str(exc)}])
    except OSError as exc:
        return _quarantined(abspath, "", 0, contract, [{"expectation": READABLE_RULE, "error": f"{type(exc).__name__}: {exc}"}])
    sha256 = hashlib.sha256(data).hexdigest()  # of exactly the bytes validated
    try:
        table = _read_table(data)
    except Exception as exc:  # pyarrow raises many types for truncated/garbage/foreign files
        return _unreadable(abspath, sha256, contract, exc)
    return _LoadedShard(path=abspath, sha256=sha256, table=table)

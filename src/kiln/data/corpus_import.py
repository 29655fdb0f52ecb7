"""``kiln corpus import``: a corpus of your own text, in kiln's layout (``kiln.data.corpora``).

Input, by ``ImportConfig.format``:

- ``jsonl``: one JSON object per line (``.jsonl``, ``.ndjson``, ``.json``; gzip or zstd compressed
  too, told by their magic bytes). The document is the string field ``text_field``; blank lines
  are skipped. A file, or a directory tree of them.
- ``parquet``: the string column ``text_field`` of ``.parquet`` files (a file or a tree).
- ``text``: every regular file of a directory tree (hidden ones left out) is one document, UTF-8.

What is read: only regular files, each where it is. Inside a directory tree a symlink (to a file or
a folder, inside the tree or out of it, dangling or not) is never followed: it is skipped and named
(``skipped`` of the summary). A FIFO, socket or device is refused naming the file and its kind, and
so is a file or folder name that is not UTF-8 (a row's ``source`` is text). The input named on the
command line is taken as given, through a link too. A file is opened once, without following a link
and without blocking, and must be the very file that was listed (same device and inode).

Caps, each named in its error: a JSON line of at most ``MAX_LINE_BYTES``; a text file of at most
``MAX_TEXT_FILE_BYTES``; a compressed file that decompresses to at most
``MAX_DECOMPRESSION_RATIO`` times its size (and never less than ``MIN_DECOMPRESSED_CAP``).

Each document becomes one row ``doc_id, text, source``: ``source`` is the input file's path
relative to the input (its name for a single file); ``doc_id`` is the value of ``id_field`` (a
string, or an integer written in decimal), else ``source:LINE`` (jsonl), ``source#ROW`` (parquet,
from 1) or ``source`` (text). Ids are taken as given: the contracts' unique-id rules judge them.

The held-out split: a document goes to ``eval/`` when the keyed blake2b-64 hash of its UTF-8 text
(key ``kiln-eval-split:<seed>``) falls below ``eval_fraction`` of the hash space. It depends on the
text alone, so two copies of one text always land on the same side: eval never overlaps train.

Shards: rows go, in input order, to ``train/shard-NNNNN.parquet`` or ``eval/eval-NNNNN.parquet``;
a file ends after the row that brings it to ``shard_bytes`` of text (or ``MAX_SHARD_ROWS`` rows),
and its row groups end the same way at ``ROW_GROUP_TEXT_BYTES`` / ``ROW_GROUP_MAX_ROWS``. Every cut
depends on the rows alone, never on how they were read, so the same input gives byte-identical
files (Parquet without statistics or timestamps, zstd).

Memory is bounded whatever the input size: one chunk of input (``CHUNK_BYTES``, or the longest
line, or one text file up to ``MAX_TEXT_FILE_BYTES``, or one row group of an input Parquet file)
and one pending row group per split.

Bad input is a ``CorpusInputError`` naming the file and the line (jsonl, text) or row (parquet) and
the field, raised before anything is put in place: the import writes into a hidden staging folder
beside the target and renames it into place only when every shard and ``corpus.json`` are written
and synced. A failed import leaves nothing; an existing corpus is replaced only with ``replace``.

Speed: JSON lines are parsed by pyarrow's JSON reader a chunk at a time; a chunk it refuses, or
whose rows break a rule, is read again line by line with the standard library's ``json`` to name
the line (or, where pyarrow is stricter than the rules here, e.g. integer and string ids mixed,
to import it the slow way). Compressed input is decompressed by pyarrow's own gzip and zstd codecs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.data.corpora import (
    METADATA_FILE,
    TEXT_KINDS,
    CorpusMetadata,
    SplitStats,
    default_contract,
    pinned_contract,
    read_metadata,
    write_metadata,
)
from kiln.data.corpus import COMPRESSION as SHARD_COMPRESSION
from kiln.data.corpus import shard_schema
from kiln.data.snapshot import CORPUS_NAME
from kiln.errors import ConfigError, CorpusInputError, KilnError
from kiln.util.fs import (
    exchange_paths,
    file_kind,
    fsync_dir,
    lies_inside,
    open_regular_file,
    os_error_text,
    parse_json,
    unusable_target_reason,
)

if TYPE_CHECKING:
    import pyarrow as pa

Format = Literal["jsonl", "parquet", "text"]
FORMATS: tuple[Format, ...] = ("jsonl", "parquet", "text")
DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
"""Text per training shard (UTF-8 bytes, before compression): few, large shards suit DVC and validation."""
MIN_SHARD_BYTES = 1024
MAX_SHARD_ROWS = 1_000_000
"""No shard holds more rows: the row bound of the shipped contracts."""
ROW_GROUP_TEXT_BYTES = 8 * 1024 * 1024
ROW_GROUP_MAX_ROWS = 65_536
CHUNK_BYTES = 8 * 1024 * 1024
"""JSON lines are read and parsed this many bytes at a time (whole lines: a longer line is read whole)."""
MAX_TEXT_FILE_BYTES = 64 * 1024 * 1024
"""Largest file the ``text`` format takes as one document."""
MAX_LINE_BYTES = MAX_TEXT_FILE_BYTES
"""Longest JSON line (one document and its fields): a longer one is refused, not read on into memory."""
MAX_DECOMPRESSION_RATIO = 200
"""A gzip or zstd file may decompress to this many times its own size (text compresses 3-20x) ..."""
MIN_DECOMPRESSED_CAP = 1024 * 1024 * 1024
"""... or to this many bytes, whichever is more; beyond it the file is refused as a decompression bomb."""
DEFAULT_EVAL_FRACTION = 0.01
SPLIT_RULE = "blake2b-64 of the UTF-8 text, key 'kiln-eval-split:<seed>', below eval_fraction of 2**64 -> eval"
STAGING_PREFIX = ".kiln-import-"
STAGING_SEPARATOR = "~"
"""Hidden folders beside the target: ``.kiln-import-NAME~new~XXXXXXXX`` being written, ``~old~`` the
corpus being replaced. No corpus name holds a ``~`` (``CORPUS_NAME``), so the folders of corpus ``a``
are never those of corpus ``a.new-b``, and each is recognised by an exact match, never a prefix."""

_SUFFIXES = {"jsonl": (".jsonl", ".ndjson", ".json"), "parquet": (".parquet",)}
_COMPRESSED = (".gz", ".zst")
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportConfig:
    """How ``import_corpus`` reads its input and cuts the corpus."""

    name: str
    """Corpus name: a safe identifier (``[a-z0-9][a-z0-9_.-]*``, at most 64 characters)."""
    format: Format
    """``jsonl``, ``parquet`` or ``text``."""
    text_field: str = "text"
    """The JSON field or Parquet column holding the document (jsonl, parquet)."""
    id_field: str | None = None
    """The field or column holding each document's id; None: ids from file and line or row."""
    shard_bytes: int = DEFAULT_SHARD_BYTES
    """A shard ends after the row that brings its text to this many UTF-8 bytes."""
    eval_fraction: float = DEFAULT_EVAL_FRACTION
    """Share of the hash space that goes to the held-out split, in (0, 0.5]."""
    seed: int = 0
    """Key of the split hash: another seed, another (equally sized) split."""
    kind: str = "natural-language"
    """Kind of text (``kiln.data.corpora.TEXT_KINDS``): which contracts fit the corpus."""
    contract: str | None = None
    """``NAME[@VERSION]`` of the contract the corpus is made for; None: the one made for ``kind``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not CORPUS_NAME.fullmatch(self.name):
            raise ConfigError(f"name {self.name!r} is not a safe corpus name: lower-case letters, digits and "
                              "'_' '.' '-', starting with a letter or digit, at most 64 characters")
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        for field_name in ("text_field", "id_field"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{field_name} must be a non-empty field name, got {value!r}")
        if self.id_field is not None and self.id_field == self.text_field:
            raise ConfigError(f"id_field and text_field are both {self.text_field!r}")
        if self.format == "text" and (self.id_field is not None or self.text_field != "text"):
            raise ConfigError("text_field and id_field apply to jsonl and parquet; a text file is one document, "
                              "its id its path")
        if isinstance(self.shard_bytes, bool) or not isinstance(self.shard_bytes, int) or self.shard_bytes < MIN_SHARD_BYTES:
            raise ConfigError(f"shard_bytes must be an integer >= {MIN_SHARD_BYTES}, got {self.shard_bytes!r}")
        if not isinstance(self.eval_fraction, int | float) or not 0 < self.eval_fraction <= 0.5:
            raise ConfigError(f"eval_fraction must be within (0, 0.5], got {self.eval_fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer within [0, 2**63), got {self.seed!r}")
        if self.kind not in TEXT_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(TEXT_KINDS)}, got {self.kind!r}")


# -- reading --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _InputFile:
    path: Path
    rel: str
    """Path relative to the input (its name for a single file), POSIX: the rows' ``source``."""
    identity: tuple[int, int]
    """``(st_dev, st_ino)`` when listed: the file opened later must be this one."""
    given: bool = False
    """The input named on the command line itself (a link there is followed: the caller chose it)."""


@dataclass(frozen=True, slots=True)
class SkippedInput:
    """An entry of the input tree that was not read, and why (a symlink)."""

    path: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def printable_path(path: str | Path) -> str:
    """``path`` with the bytes of a name that is not UTF-8 written as ``\\xNN``: safe to print and store."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _refuse_undecodable_name(path: Path) -> None:
    """A name the file system gave as bytes that are not UTF-8 (Python holds them as surrogate escapes)."""
    bad = next((ord(ch) - 0xDC00 for ch in os.fspath(path) if 0xDC80 <= ord(ch) <= 0xDCFF), None)
    if bad is not None:
        raise CorpusInputError(f"{printable_path(path)}: the name is not UTF-8 (byte 0x{bad:02x}); a document's source "
                               "is its path, which must be text: rename it")


def _link_skipped(path: Path) -> SkippedInput:
    try:
        target = printable_path(os.readlink(path))
    except OSError:
        target = "?"
    return SkippedInput(printable_path(path), f"a symlink (-> {target}): kiln reads no file through a link inside an "
                                              "input; copy the file into the input to import it")


def _input_files(src: Path, fmt: Format) -> tuple[list[_InputFile], int, list[SkippedInput]]:
    """The files to read, sorted by relative path, how many other files were left aside, and the
    symlinks skipped."""
    try:
        st = os.stat(src)
    except OSError as exc:
        raise CorpusInputError(f"{printable_path(src)}: cannot read the input: {exc.strerror or exc}") from exc
    if stat.S_ISREG(st.st_mode):
        _refuse_undecodable_name(Path(src.name))
        if fmt == "text" and st.st_size > MAX_TEXT_FILE_BYTES:
            _too_large(src, st.st_size)
        return [_InputFile(src, src.name, (st.st_dev, st.st_ino), given=True)], 0, []
    if not stat.S_ISDIR(st.st_mode):
        raise CorpusInputError(f"{printable_path(src)}: the input is a {file_kind(st.st_mode)}, neither a regular file "
                               "nor a directory")
    found: list[_InputFile] = []
    skipped: list[SkippedInput] = []
    ignored = 0

    def walk_error(exc: OSError) -> None:
        raise CorpusInputError(f"{printable_path(exc.filename)}: cannot read the input directory: "
                               f"{exc.strerror or exc}") from exc

    for dirpath, dirnames, filenames in os.walk(src, onerror=walk_error):  # never into a linked folder
        kept = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                skipped.append(_link_skipped(Path(dirpath) / d))
            else:
                _refuse_undecodable_name(Path(dirpath) / d)
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            try:
                fst = os.lstat(path)
            except OSError as exc:
                raise CorpusInputError(f"{printable_path(path)}: cannot read: {exc.strerror or exc}") from exc
            if stat.S_ISLNK(fst.st_mode):
                skipped.append(_link_skipped(path))
                continue
            if fmt != "text" and not _has_suffix(name, fmt):
                ignored += 1
                continue
            _refuse_undecodable_name(path)
            if not stat.S_ISREG(fst.st_mode):
                raise CorpusInputError(f"{path}: not a regular file but a {file_kind(fst.st_mode)}; an input holds "
                                       "regular files only")
            if fmt == "text" and fst.st_size > MAX_TEXT_FILE_BYTES:
                _too_large(path, fst.st_size)
            found.append(_InputFile(path, path.relative_to(src).as_posix(), (fst.st_dev, fst.st_ino)))
    found.sort(key=lambda f: f.rel)
    if not found:
        what = "files" if fmt == "text" else " or ".join(f"*{s}" for s in _SUFFIXES[fmt]) + " files"
        links = f", {len(skipped)} symlink(s) skipped" if skipped else ""
        raise CorpusInputError(f"{printable_path(src)}: empty input: no {what} under it ({ignored} other file(s) left "
                               f"aside{links})")
    return found, ignored, skipped


def _has_suffix(name: str, fmt: Format) -> bool:
    lowered = name.lower()
    for comp in ("", *_COMPRESSED) if fmt == "jsonl" else ("",):
        if comp and not lowered.endswith(comp):
            continue
        stem = lowered[: len(lowered) - len(comp)] if comp else lowered
        if stem.endswith(_SUFFIXES[fmt]):
            return True
    return False


def _too_large(path: Path, size: int) -> None:
    raise CorpusInputError(f"{path}: {size} bytes is more than one document may be ({MAX_TEXT_FILE_BYTES} bytes); "
                           "split it, or import it as JSON lines")


def _open_listed(file: _InputFile) -> Any:
    """The listed file, opened as itself: a regular file, not through a link (unless it is the
    input named on the command line), the same device and inode as when it was listed."""
    try:
        fh = open_regular_file(file.path, follow_link=file.given)
    except OSError as exc:
        raise CorpusInputError(f"{file.path}: cannot read: {exc.strerror or exc}") from exc
    st = os.fstat(fh.fileno())
    if (st.st_dev, st.st_ino) != file.identity:
        fh.close()
        raise CorpusInputError(f"{file.path}: the file was replaced while the input was read; import it again")
    return fh


@dataclass(slots=True)
class _Stream:
    """One input file's bytes, decompressed when its magic bytes say gzip or zstd, with the cap
    that decompression may reach (None: a plain file, bounded by its size on disk)."""

    source: Any
    cap: int | None
    read_bytes: int = 0


@contextlib.contextmanager
def _open_input(file: _InputFile) -> Iterator[_Stream]:
    import pyarrow as pa

    fh = _open_listed(file)
    try:
        try:
            magic = fh.read(4)
            fh.seek(0)
            size = os.fstat(fh.fileno()).st_size
        except OSError as exc:
            raise CorpusInputError(f"{file.path}: cannot read: {os_error_text(exc)}") from exc
        raw = pa.PythonFile(fh, mode="r")
        cap = max(MIN_DECOMPRESSED_CAP, MAX_DECOMPRESSION_RATIO * size)
        if magic.startswith(_GZIP_MAGIC):
            yield _Stream(pa.CompressedInputStream(raw, "gzip"), cap)
        elif magic.startswith(_ZSTD_MAGIC):
            yield _Stream(pa.CompressedInputStream(raw, "zstd"), cap)
        else:
            yield _Stream(raw, None)
    finally:
        fh.close()


def _read(stream: _Stream, size: int, path: Path, line: int) -> bytes:
    try:
        data = bytes(stream.source.read(size))
    except OSError as exc:  # pyarrow's codecs: "Truncated compressed stream", "zlib inflate failed: ..."
        raise CorpusInputError(f"{path}: cannot read past line {line}: {exc}") from exc
    stream.read_bytes += len(data)
    if stream.cap is not None and stream.read_bytes > stream.cap:
        raise CorpusInputError(
            f"{path}: decompresses to more than {stream.cap} bytes (the cap: {MAX_DECOMPRESSION_RATIO}x the compressed "
            f"size, at least {MIN_DECOMPRESSED_CAP}), read past line {line}: refused as a decompression bomb; "
            "decompress it yourself to import it")
    return data


def _line_chunks(stream: _Stream, path: Path) -> Iterator[tuple[int, bytes]]:
    """``(number of the first line, bytes of whole lines)``; a UTF-8 BOM at the start is dropped.
    A line longer than ``MAX_LINE_BYTES`` is refused once that many bytes of it are read."""
    line = 1
    carry = b""
    first = True
    while True:
        block = _read(stream, CHUNK_BYTES, path, line)
        if first:
            block = block.removeprefix(_BOM)
            first = False
        if not block:
            if carry:
                yield line, carry
            return
        # Only the line carried over can be longer than a block: it ends at the block's first newline,
        # or not yet (checked before the two are joined, and whatever chunk its newline comes in).
        ends = block.find(b"\n")
        if len(carry) + (ends if ends >= 0 else len(block)) > MAX_LINE_BYTES:
            raise CorpusInputError(f"{path}:{line}: the line is longer than {MAX_LINE_BYTES} bytes, the cap on one "
                                   "JSON line (one document); split the document")
        data = carry + block if carry else block
        cut = data.rfind(b"\n")
        if cut < 0:
            carry = data  # one line longer than a chunk: read on
            continue
        chunk, carry = data[: cut + 1], data[cut + 1 :]
        yield line, chunk
        line += chunk.count(b"\n")


def _check_utf8(data: bytes, path: Path, first_line: int) -> None:
    """``CorpusInputError`` naming the line and column of the first byte that is not UTF-8."""
    import pyarrow as pa

    offsets = pa.py_buffer(len(data).to_bytes(8, "little").rjust(16, b"\0"))
    array = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(data)])
    try:
        array.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = data.rfind(b"\n", 0, exc.start) + 1
        line = first_line + data.count(b"\n", 0, exc.start)
        raise CorpusInputError(
            f"{path}:{line}: bytes that are not UTF-8 (0x{data[exc.start]:02x} at column {exc.start - start + 1}: "
            f"{exc.reason})"
        ) from None


class _Rows:
    """Documents of one input file, in input order: ``doc_id`` and ``text`` string arrays."""

    __slots__ = ("doc_id", "text")

    def __init__(self, doc_id: pa.Array, text: pa.Array):
        self.doc_id, self.text = doc_id, text


def _jsonl_rows(file: _InputFile, config: ImportConfig) -> Iterator[_Rows]:
    with _open_input(file) as stream:
        for first_line, chunk in _line_chunks(stream, file.path):
            _check_utf8(chunk, file.path, first_line)
            rows = _jsonl_chunk_fast(chunk, first_line, file, config)
            yield rows if rows is not None else _jsonl_chunk_lines(chunk, first_line, file, config)


def _jsonl_chunk_fast(chunk: bytes, first_line: int, file: _InputFile, config: ImportConfig) -> _Rows | None:
    """The chunk parsed by pyarrow, or None when it must be read line by line (an error to name, or
    input pyarrow takes differently than the rules here)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    table = None
    for id_type in (pa.string(), pa.int64()) if config.id_field else (None,):
        fields = [(config.text_field, pa.string())] + ([(config.id_field, id_type)] if config.id_field else [])
        try:
            table = pj.read_json(
                pa.BufferReader(chunk),
                read_options=pj.ReadOptions(use_threads=True, block_size=max(1 << 20, len(chunk) // 2 + 1)),
                parse_options=pj.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"),
            )
            break
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    if table is None:
        return None
    text = table.column(config.text_field).combine_chunks()
    if text.null_count:
        return None
    try:
        text.validate(full=True)  # a lone surrogate escape would be bytes that are not UTF-8
    except pa.ArrowInvalid:
        return None
    # One row per non-blank line, or the lines were not one object each (pyarrow also takes two
    # objects on one line); pyarrow skips blank lines, so then number the others.
    lines = chunk.count(b"\n") + (0 if chunk.endswith(b"\n") else 1)
    if table.num_rows == lines:
        numbers = np.arange(first_line, first_line + lines, dtype=np.int64)
    else:
        numbers = np.array([first_line + i for i, raw in enumerate(chunk.split(b"\n")) if raw.strip()], dtype=np.int64)
        if len(numbers) != table.num_rows:
            return None
    if config.id_field:
        ids = table.column(config.id_field).combine_chunks()
        if ids.null_count:
            return None
        ids = ids.cast(pa.string())
        if pc.any(pc.equal(pc.binary_length(ids), 0)).as_py():
            return None
    else:
        ids = pc.binary_join_element_wise(pa.scalar(file.rel + ":"), pa.array(numbers).cast(pa.string()), "")
    return _Rows(ids, text)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _jsonl_chunk_lines(chunk: bytes, first_line: int, file: _InputFile, config: ImportConfig) -> _Rows:
    """The chunk read line by line: the reference rules, and the error that names the line."""
    import pyarrow as pa

    path = file.path
    watched = {config.text_field, config.id_field} - {None}

    def no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in watched and key in seen:
                raise _Twice(key)
            seen.add(key)
        return dict(pairs)

    ids: list[str] = []
    texts: list[str] = []
    for i, raw in enumerate(chunk.split(b"\n")):
        line = first_line + i
        if not raw.strip():
            continue
        where = f"{path}:{line}"
        try:
            record = parse_json(raw, "", _BadLine, object_pairs_hook=no_twice)  # bounded depth and numbers
        except _Twice as twice:
            raise CorpusInputError(f"{where}: field {twice.args[0]!r} appears twice in the object") from None
        except _BadLine as exc:
            detail = str(exc).removeprefix(": ").removeprefix("not JSON: ")
            raise CorpusInputError(f"{where}: not valid JSON ({detail})") from None
        if not isinstance(record, dict):
            raise CorpusInputError(f"{where}: a line must hold one JSON object, not {_json_type(record)}")
        text = _field(record, config.text_field, where)
        if not isinstance(text, str):
            raise CorpusInputError(f"{where}: field {config.text_field!r} is {_json_type(text)}, not a string")
        _encodable(text, config.text_field, where)
        if config.id_field:
            doc_id = _field(record, config.id_field, where)
            if isinstance(doc_id, int) and not isinstance(doc_id, bool):
                doc_id = str(doc_id)
            elif not isinstance(doc_id, str):
                raise CorpusInputError(f"{where}: field {config.id_field!r} is {_json_type(doc_id)}, not a string "
                                       "or an integer")
            if not doc_id:
                raise CorpusInputError(f"{where}: field {config.id_field!r} is empty")
            _encodable(doc_id, config.id_field, where)
        else:
            doc_id = f"{file.rel}:{line}"
        ids.append(doc_id)
        texts.append(text)
    return _Rows(pa.array(ids, pa.string()), pa.array(texts, pa.string()))


class _BadLine(ValueError):
    """A JSON line that ``parse_json`` refused (its message is the detail)."""


class _Twice(Exception):
    """A watched key twice in one JSON object (control flow inside this module)."""


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) + (", …" if len(record) > 8 else "")
        raise CorpusInputError(f"{where}: no field {name!r} (the object has {fields or 'no fields'})")
    return record[name]


def _encodable(value: str, name: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CorpusInputError(f"{where}: field {name!r} holds a lone surrogate escape (U+{ord(value[exc.start]):04X}), "
                               "which is not UTF-8 text") from None


def _parquet_rows(file: _InputFile, config: ImportConfig) -> Iterator[_Rows]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = file.path
    fh = _open_listed(file)
    try:
        reader = pq.ParquetFile(fh)
    except OSError as exc:
        fh.close()
        raise CorpusInputError(f"{path}: cannot read: {os_error_text(exc)}") from exc
    except (pa.ArrowException, ValueError) as exc:
        fh.close()
        raise CorpusInputError(f"{path}: not a readable Parquet file: {exc}") from exc
    with fh, reader:
        schema = reader.schema_arrow
        columns = [config.text_field] + ([config.id_field] if config.id_field else [])
        for name in columns:
            if name not in schema.names:
                raise CorpusInputError(f"{path}: no column {name!r} (columns: {', '.join(schema.names) or 'none'})")
            if schema.names.count(name) > 1:
                raise CorpusInputError(f"{path}: column {name!r} appears {schema.names.count(name)} times; a document's "
                                       "column must be one")
        text_type = schema.field(config.text_field).type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_binary(text_type)
                or pa.types.is_large_binary(text_type)):
            raise CorpusInputError(f"{path}: column {config.text_field!r} is {text_type}, not a string")
        if config.id_field:
            id_type = schema.field(config.id_field).type
            if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
                raise CorpusInputError(f"{path}: column {config.id_field!r} is {id_type}, not a string or an integer")
        row = 1
        batches = reader.iter_batches(batch_size=ROW_GROUP_MAX_ROWS, columns=columns, use_threads=True)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as exc:
                raise CorpusInputError(f"{path}: cannot read rows from row {row} on: {exc}") from exc
            text = _utf8_column(batch.column(config.text_field), path, row, config.text_field)
            if config.id_field:
                ids = batch.column(config.id_field)
                ids = _utf8_column(ids, path, row, config.id_field) if not pa.types.is_integer(ids.type) else ids
                if ids.null_count:
                    raise CorpusInputError(f"{path}: row {row + _first_null(ids)}: column {config.id_field!r} is null")
                ids = ids.cast(pa.string())
                empty = pc.equal(pc.binary_length(ids), 0)
                if pc.any(empty).as_py():
                    first = pc.index(empty, True).as_py()
                    raise CorpusInputError(f"{path}: row {row + first}: column {config.id_field!r} is empty")
            else:
                numbers = pa.array(range(row, row + batch.num_rows), pa.int64()).cast(pa.string())
                ids = pc.binary_join_element_wise(pa.scalar(file.rel + "#"), numbers, "")
            yield _Rows(ids, text)
            row += batch.num_rows


def _first_null(values: pa.Array) -> int:
    import pyarrow.compute as pc

    return int(pc.index(pc.is_null(values), True).as_py())


def _utf8_column(values: pa.Array, path: Path, row: int, name: str) -> pa.Array:
    """A Parquet string column as a checked ``string`` array (Parquet readers do not check UTF-8)."""
    import pyarrow as pa

    if values.null_count:
        raise CorpusInputError(f"{path}: row {row + _first_null(values)}: column {name!r} is null")
    as_binary = values.cast(pa.large_binary()) if not pa.types.is_large_binary(values.type) else values
    try:
        checked = as_binary.cast(pa.large_string())
        checked.validate(full=True)
    except pa.ArrowInvalid:
        for i, value in enumerate(as_binary.to_pylist()):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusInputError(f"{path}: row {row + i}: column {name!r} holds bytes that are not UTF-8 "
                                       f"(0x{value[exc.start]:02x} at byte {exc.start + 1})") from None
        raise
    return checked.cast(pa.string())


def _text_rows(files: list[_InputFile]) -> Iterator[tuple[_InputFile, _Rows]]:
    """Text files, one document each (an empty or blank file is no document), in batches."""
    import pyarrow as pa

    for file in files:
        with _open_listed(file) as fh:
            try:
                data = fh.read(MAX_TEXT_FILE_BYTES + 1)
            except OSError as exc:
                raise CorpusInputError(f"{file.path}: cannot read: {exc.strerror or exc}") from exc
        if len(data) > MAX_TEXT_FILE_BYTES:  # grew since it was listed
            _too_large(file.path, len(data))
        data = data.removeprefix(_BOM)
        _check_utf8(data, file.path, 1)
        text = data.decode("utf-8")
        if not text.strip():
            continue
        yield file, _Rows(pa.array([file.rel], pa.string()), pa.array([text], pa.string()))


# -- splitting and writing ------------------------------------------------------------------------


def _eval_mask(text: pa.Array, key: bytes, threshold: int):  # -> numpy bool array
    """True where the keyed hash of the document's UTF-8 bytes is below ``threshold`` (of 2**64)."""
    import numpy as np
    import pyarrow as pa

    if text.type != pa.string():
        text = text.cast(pa.string())
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)[text.offset : text.offset + len(text) + 1].tolist()
    data = memoryview(text.buffers()[2] or b"")
    blake2b = hashlib.blake2b
    mask = np.empty(len(text), dtype=bool)
    for i in range(len(text)):
        digest = blake2b(data[offsets[i] : offsets[i + 1]], digest_size=8, key=key).digest()
        mask[i] = int.from_bytes(digest, "little") < threshold
    return mask


class _SplitWriter:
    """Writes one split's rows into ``<prefix>-NNNNN.parquet`` files under ``folder``, cutting row
    groups and files after the row that reaches their size (the cuts depend on the rows alone)."""

    def __init__(self, folder: Path, prefix: str, shard_bytes: int):
        self.folder, self.prefix, self.shard_bytes = folder, prefix, shard_bytes
        self.pending: list[Any] = []
        self.group_bytes = self.group_rows = 0
        self.shard_text = self.shard_rows = 0
        self.writer: Any = None
        self.files: list[Path] = []
        self.documents = self.text_bytes = 0

    def add(self, table: Any) -> None:
        import numpy as np
        import pyarrow.compute as pc

        if table.num_rows == 0:
            return
        lengths = pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)
        cumulative = np.cumsum(lengths)
        self.documents += table.num_rows
        self.text_bytes += int(cumulative[-1])
        start = 0
        while start < table.num_rows:
            base = int(cumulative[start - 1]) if start else 0
            rows_left = table.num_rows - start
            # Index (relative to start) of the first row that fills the row group or the shard.
            cut = min(
                _first_reaching(cumulative, start, base, ROW_GROUP_TEXT_BYTES - self.group_bytes),
                _first_reaching(cumulative, start, base, self.shard_bytes - self.shard_text),
                ROW_GROUP_MAX_ROWS - self.group_rows - 1,
                MAX_SHARD_ROWS - self.shard_rows - 1,
            )
            if cut >= rows_left:
                self._take(table.slice(start), int(cumulative[-1]) - base)
                return
            end = start + cut + 1
            self._take(table.slice(start, end - start), int(cumulative[end - 1]) - base)
            self._flush_group()
            if self.shard_text >= self.shard_bytes or self.shard_rows >= MAX_SHARD_ROWS:
                self._close_shard()
            start = end

    def _take(self, part: Any, text_bytes: int) -> None:
        self.pending.append(part)
        self.group_rows += part.num_rows
        self.group_bytes += text_bytes
        self.shard_rows += part.num_rows
        self.shard_text += text_bytes

    def _flush_group(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.pending:
            return
        group = pa.concat_tables(self.pending).combine_chunks()
        if self.writer is None:
            path = self.folder / f"{self.prefix}-{len(self.files):05d}.parquet"
            self.writer = pq.ParquetWriter(str(path), shard_schema(), compression=SHARD_COMPRESSION, use_dictionary=["source"],
                                           write_statistics=False)
            self.files.append(path)
        self.writer.write_table(group, row_group_size=group.num_rows)
        self.pending = []
        self.group_bytes = self.group_rows = 0

    def _close_shard(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            _fsync_file(self.files[-1])
        self.shard_text = self.shard_rows = 0

    def close(self) -> SplitStats:
        self._flush_group()
        self._close_shard()
        return SplitStats(shards=len(self.files), documents=self.documents, text_bytes=self.text_bytes)

    def abort(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            self.writer = None


def _first_reaching(cumulative: Any, start: int, base: int, budget: int) -> int:
    """Relative index of the first row from ``start`` whose running text total reaches ``budget``
    (a large number when none does)."""
    import numpy as np

    if budget <= 0:
        return 0
    index = int(np.searchsorted(cumulative[start:], base + budget, side="left"))
    return index if index < len(cumulative) - start else len(cumulative)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the import -----------------------------------------------------------------------------------


def import_corpus(src: str | Path, out: str | Path, config: ImportConfig, *, replace: bool = False) -> dict[str, Any]:
    """Import ``src`` as corpus ``config.name`` into ``out``; a JSON-safe summary.

    ``out`` must not exist unless ``replace``; then it must be a corpus kiln wrote (``kiln_corpus_problem``),
    and it is swapped for the new one in one step. ``out`` must not lie inside ``src``.
    ``CorpusInputError`` for bad input, ``ConfigError`` for bad arguments, both before anything is put
    in place; ``KilnError`` for a write that fails (full disk): nothing is left behind, and a corpus
    already at ``out`` is kept as it was.
    """
    import pyarrow as pa

    src, out = Path(src), Path(out)
    contract = pinned_contract(config.contract) if config.contract else default_contract(config.kind)
    _restore_interrupted_replace(out)
    _check_target(out, replace)
    if lies_inside(out, src):
        raise ConfigError(f"corpus directory {out} lies inside the input {printable_path(src)}: the import would write "
                          "into what it reads; write the corpus elsewhere")
    files, ignored, skipped = _input_files(src, config.format)
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for leftover in _staging_folders(out, "new"):  # of an import that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(out, "new"), dir=parent))
    except OSError as exc:
        raise KilnError(f"cannot write the corpus to {out}: {os_error_text(exc)}") from exc
    writers: list[_SplitWriter] = []
    try:
        (staging / "train").mkdir()
        (staging / "eval").mkdir()
        train = _SplitWriter(staging / "train", "shard", config.shard_bytes)
        held_out = _SplitWriter(staging / "eval", "eval", config.shard_bytes)
        writers = [train, held_out]
        key = f"kiln-eval-split:{config.seed}".encode()
        threshold = int(config.eval_fraction * 2**64)
        for file, rows in _rows(files, config):
            source = pa.repeat(pa.scalar(file.rel, pa.string()), len(rows.text))
            table = pa.Table.from_arrays([rows.doc_id, rows.text, source], schema=shard_schema())
            mask = _eval_mask(rows.text, key, threshold)
            held_out.add(table.filter(pa.array(mask)))
            train.add(table.filter(pa.array(~mask)))
        train_stats, eval_stats = train.close(), held_out.close()
        if train_stats.documents + eval_stats.documents == 0:
            raise CorpusInputError(f"{src}: empty input: {len(files)} file(s) hold no document")
        if eval_stats.documents == 0 or train_stats.documents == 0:
            side = "held-out" if eval_stats.documents == 0 else "training"
            raise CorpusInputError(
                f"{src}: {train_stats.documents + eval_stats.documents} document(s) leave the {side} split empty "
                f"at eval_fraction={config.eval_fraction}: import more documents or change --eval-fraction"
            )
        metadata = CorpusMetadata(
            kind=config.kind, contract=contract, producer="kiln corpus import",
            source={"format": config.format, "input": printable_path(src.name), "files": len(files),
                    "files_left_aside": ignored, "symlinks_skipped": len(skipped),
                    "text_field": config.text_field if config.format != "text" else None, "id_field": config.id_field},
            split={"rule": SPLIT_RULE, "seed": config.seed, "eval_fraction": config.eval_fraction,
                   "shard_bytes": config.shard_bytes},
            train=train_stats, eval=eval_stats,
        )
        write_metadata(staging, metadata)
        for folder in (staging / "train", staging / "eval", staging):
            fsync_dir(folder)
        _put_in_place(staging, out, replace)
    except OSError as exc:
        for writer in writers:
            writer.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise KilnError(f"cannot write the corpus to {out}: {os_error_text(exc)}; nothing was written"
                        + (" (the corpus there was left as it was)" if out.exists() else "")) from exc
    except BaseException:
        for writer in writers:
            writer.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {
        "name": config.name, "out": str(out), "kind": config.kind, "contract": contract, "format": config.format,
        "files": len(files), "files_left_aside": ignored, "skipped": [entry.to_json() for entry in skipped],
        "train": {"shards": [str(out / "train" / p.name) for p in train.files], "documents": train_stats.documents,
                  "text_bytes": train_stats.text_bytes},
        "eval": {"shards": [str(out / "eval" / p.name) for p in held_out.files], "documents": eval_stats.documents,
                 "text_bytes": eval_stats.text_bytes},
    }


def _rows(files: list[_InputFile], config: ImportConfig) -> Iterator[tuple[_InputFile, _Rows]]:
    if config.format == "text":
        yield from _text_rows(files)
        return
    read = _jsonl_rows if config.format == "jsonl" else _parquet_rows
    for file in files:
        for rows in read(file, config):
            if len(rows.text):
                yield file, rows


def _check_target(out: Path, replace: bool) -> None:
    problem = unusable_target_reason(out, directory=True)
    if problem:
        raise ConfigError(f"corpus directory {out}: {problem}")
    if not os.path.lexists(out):
        return
    if not replace:
        raise ConfigError(f"corpus directory {out} exists: pass --replace to replace it (the same input gives the "
                          "same bytes)")
    problem = kiln_corpus_problem(out)
    if problem:
        raise ConfigError(f"{out} is not a kiln corpus: {problem}; refusing to replace it (kiln deletes only what it wrote)")


_SPLIT_FILE = {"train": re.compile(r"shard-\d{5,}\.parquet"), "eval": re.compile(r"eval-\d{5,}\.parquet")}


def kiln_corpus_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a corpus kiln wrote, or None: a kiln corpus is recognised by its own
    record, a readable ``corpus.json``, and holds nothing else than that record and its shards
    (``train/shard-NNNNN.parquet``, ``eval/eval-NNNNN.parquet``). A folder of someone's own files,
    even with a ``train/`` in it, is not one: ``--replace`` would delete those files."""
    if os.path.islink(folder):
        return "it is a symlink"
    record = folder / METADATA_FILE
    try:
        mode = os.lstat(record).st_mode
    except FileNotFoundError:
        return f"no {METADATA_FILE}, the record kiln writes in every corpus"
    except OSError as exc:
        return f"{record}: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return f"its {METADATA_FILE} is a {file_kind(mode)}, not the record kiln writes"
    try:
        read_metadata(folder)
    except (CorpusInputError, OSError) as exc:
        return f"its record cannot be read ({exc})"
    foreign: list[str] = []
    try:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name == METADATA_FILE:
                continue
            if entry.name not in _SPLIT_FILE or not entry.is_dir(follow_symlinks=False):
                foreign.append(printable_path(entry.name))
                continue
            with os.scandir(entry.path) as inner:
                foreign += [f"{entry.name}/{printable_path(f.name)}" for f in sorted(inner, key=lambda e: e.name)
                            if not (_SPLIT_FILE[entry.name].fullmatch(f.name) and f.is_file(follow_symlinks=False))]
    except OSError as exc:
        return f"it cannot be listed ({exc.strerror or exc})"
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"it holds files kiln did not write there ({shown})"
    return None


def _staging_prefix(out: Path, role: Literal["new", "old"]) -> str:
    return f"{STAGING_PREFIX}{out.name}{STAGING_SEPARATOR}{role}{STAGING_SEPARATOR}"


def _staging_folders(out: Path, role: Literal["new", "old"]) -> list[Path]:
    """The staging (``new``) or aside (``old``) folders of corpus ``out`` beside it, by an exact match of
    the whole name (a ``tempfile`` suffix after the prefix), sorted."""
    pattern = re.compile(re.escape(_staging_prefix(out, role)) + r"[a-z0-9_]+")
    try:
        names = sorted(e.name for e in os.scandir(out.parent) if pattern.fullmatch(e.name))
    except OSError:
        return []
    return [out.parent / name for name in names]


def _restore_interrupted_replace(out: Path) -> None:
    """A replace killed between the two renames of its fallback left the old corpus aside: put it
    back; one killed after its commit left the old one aside with the new in place: remove it."""
    asides = _staging_folders(out, "old")
    if not os.path.lexists(out):
        for old in asides:
            with contextlib.suppress(OSError):
                os.replace(old, out)
                asides.remove(old)
                break
    for old in asides:
        shutil.rmtree(old, ignore_errors=True)


_NO_EXCHANGE = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def _put_in_place(staging: Path, out: Path, replace: bool) -> None:
    """Rename the staged corpus to ``out``. An existing one is swapped with it in one atomic step
    (``exchange_paths``): at every instant ``out`` is the old corpus or the new, never neither. Where
    the file system cannot swap, the old one is renamed aside first (a crash between the two renames
    leaves it aside, and the next import puts it back)."""
    if replace and os.path.lexists(out):
        try:
            exchange_paths(staging, out)  # LAST: the commit point; staging now holds the old corpus
        except OSError as exc:
            if exc.errno not in _NO_EXCHANGE:
                raise
        else:
            fsync_dir(out.parent)
            shutil.rmtree(staging, ignore_errors=True)
            return
        aside = Path(tempfile.mkdtemp(prefix=_staging_prefix(out, "old"), dir=out.parent))
        aside.rmdir()  # a unique name, for the rename
        os.replace(out, aside)
        try:
            os.replace(staging, out)  # the commit point
        except OSError:
            os.replace(aside, out)
            raise
        fsync_dir(out.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.replace(staging, out)  # the commit point
    fsync_dir(out.parent)


_BYTE_SIZE = re.compile(r"^\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*$")


def parse_byte_size(text: str) -> int:
    """``"64M"`` / ``"64MiB"`` / ``"1048576"`` → bytes (powers of 1024); ``ConfigError`` naming the text."""
    m = _BYTE_SIZE.match(str(text))
    if not m:
        raise ConfigError(f"not a byte size: {text!r} (e.g. 1048576, 64M, 1G)")
    unit = m.group(2).upper()
    return int(m.group(1)) * (1024 ** ("KMGT".index(unit) + 1) if unit else 1)

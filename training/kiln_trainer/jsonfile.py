"""The one JSON reader for everything kiln and its trainer read. Standard library only.

Every JSON file kiln reads may come from a stranger: an import line, a manifest, a contract, a
tokenizer file, a corpus or snapshot record. Python's ``json`` alone turns hostile structure into a
traceback (a ``RecursionError`` for deep nesting, a ``ValueError`` for an integer over 4300 digits)
or into a read until memory runs out (``/dev/zero``). This reader bounds all of it before the parser
runs, and every refusal is the caller's error class with a message naming the file and what is wrong:

* size: at most ``max_bytes`` are read, from a regular file only (a FIFO or a device is refused);
* depth: arrays and objects nest at most ``MAX_DEPTH`` levels;
* numbers: at most ``MAX_NUMBER_DIGITS`` digits in a row; ``NaN`` and ``Infinity`` (not JSON) are refused;
* text: UTF-8, and a JSON document (a ``JSONDecodeError`` names line and column).

The bounds are checked by a linear scan in C (a regex that drops string literals, ``bytes.translate``
and ``itertools.accumulate``), so a large manifest costs about one extra pass over its bytes.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted; kiln's own files nest at most 6 levels."""

MAX_NUMBER_DIGITS = 100
"""Longest run of digits in a number; kiln's own numbers have at most 20 (a 64-bit integer)."""

DEFAULT_MAX_BYTES = 1 << 30
"""A file larger than this is refused before it is read (1 GiB: a TrainingManifest of 10^4 shards
with their dropped rows stays far below it); readers of small records pass a smaller bound."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_NUMBER = re.compile(rb"[0-9]{%d,}" % (MAX_NUMBER_DIGITS + 1))
_OPENERS_CLOSERS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_structure(raw: bytes, where: str, error: type[Exception]) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` and numbers longer than ``MAX_NUMBER_DIGITS`` digits,
    without recursion: strings are dropped first, so brackets and digits inside them do not count."""
    outside_strings = _STRING.sub(b'""', raw)
    if _LONG_NUMBER.search(outside_strings):
        raise error(f"{where}: a number has more than {MAX_NUMBER_DIGITS} digits")
    brackets = outside_strings.translate(_OPENERS_CLOSERS, _NOT_BRACKETS)
    if brackets:
        depth = max(itertools.accumulate(memoryview(brackets).cast("b")))
        if depth > MAX_DEPTH:
            raise error(f"{where}: nested deeper than {MAX_DEPTH} levels of arrays and objects")


def parse_json(raw: bytes | str, where: str, error: type[Exception], *,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """The JSON document in ``raw`` (read from ``where``), or ``error`` naming ``where`` and the fault.

    ``object_pairs_hook`` is ``json.loads``'s (e.g. to refuse a key given twice); a ``ValueError`` it
    raises becomes ``error`` too."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    _check_structure(data, where, error)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not JSON: not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{where}: not JSON: {exc}") from None


def open_regular_file(path: str | Path, *, follow_link: bool = False, max_bytes: int | None = None) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file: never a FIFO (which would block for
    ever), a device (``/dev/zero`` never ends), a socket or a directory, and, unless ``follow_link``,
    never through a symlink as its last component.

    One ``open`` with ``O_NOFOLLOW | O_NONBLOCK`` and an ``fstat`` of what was opened, so a file
    swapped in after a check cannot slip through. Refusals are ``OSError``s naming ``path``: ``ELOOP``
    for a link, ``EINVAL`` for another kind of file ("is a FIFO, not a regular file"), ``EFBIG`` for
    one larger than ``max_bytes``.
    For a whole small file, JSON above all, ``read_bounded`` is the reader.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_link else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_link and os.path.islink(name):
            raise OSError(errno.ELOOP, "is a symlink; kiln reads no file through a link here", name) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"is a {file_kind(st.st_mode)}, not a regular file", name)
        if max_bytes is not None and st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"is {st.st_size} bytes, more than the {max_bytes} bytes allowed", name)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | Path, what: str, error: type[Exception], *, max_bytes: int,
                 follow_link: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them, or ``error`` naming the
    path and the ``what`` it should have been. The kind is checked on the opened file (``fstat``), so
    a FIFO or device swapped in after a check is still refused, and nothing blocks on opening one.
    Without ``follow_link``, a symlink as the last component is refused (a file inside an input that
    points out of it)."""
    try:
        with open_regular_file(path, follow_link=follow_link) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                raise error(f"{path}: {what} is {size:,} bytes, over the {max_bytes:,}-byte limit")
            raw = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from exc
    if len(raw) > max_bytes:  # grew while it was read
        raise error(f"{path}: {what} is over the {max_bytes:,}-byte limit")
    return raw


def file_kind(mode: int) -> str:
    """What an ``lstat`` mode is, in words: "regular file", "directory", "symlink", "FIFO", ..."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def read_json(path: str | Path, what: str, error: type[Exception], *,
              max_bytes: int = DEFAULT_MAX_BYTES, follow_link: bool = True) -> tuple[bytes, Any]:
    """The bytes of ``path`` and the JSON document they hold, or ``error`` naming the path and the
    ``what`` it should have been (missing, not a regular file, too large, not JSON, too deep)."""
    raw = read_bounded(path, what, error, max_bytes=max_bytes, follow_link=follow_link)
    return raw, parse_json(raw, str(path), error)


class JSONDocumentError(ValueError):
    """A file kiln wrote itself holds no bounded JSON document (``read_own_json``)."""


def parse_own_json(raw: bytes | str, where: str) -> Any:
    """``parse_json`` for a line or value kiln wrote itself (a JSONL log line, an MLflow tag, an API
    value): hostile structure is a ``JSONDocumentError``, a ``ValueError``, like ``json.loads``' own."""
    return parse_json(raw, where, JSONDocumentError)


def read_own_json(path: str | Path) -> Any:
    """The JSON document of a record kiln wrote itself (a launch spec, a status, a report in a run
    directory): an ``OSError`` as ``open`` raises it (a missing file stays ``FileNotFoundError``), and
    hostile structure a ``JSONDocumentError`` (a ``ValueError``) naming the file, never a traceback."""
    with open(path, "rb") as fh:
        raw = fh.read(DEFAULT_MAX_BYTES + 1)
    if len(raw) > DEFAULT_MAX_BYTES:
        raise JSONDocumentError(f"{path}: over the {DEFAULT_MAX_BYTES:,}-byte limit")
    return parse_json(raw, str(path), JSONDocumentError)


def load_json(path: str | Path, what: str, error: type[Exception], *, max_bytes: int = DEFAULT_MAX_BYTES,
              follow_link: bool = True) -> Any:
    """``read_json`` without the bytes."""
    return read_json(path, what, error, max_bytes=max_bytes, follow_link=follow_link)[1]

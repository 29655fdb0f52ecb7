"""Crash-safe file writes: tmp file in the same directory, fsync, rename, directory fsync."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln_trainer.contract import atomic_write_bytes as _atomic_write_bytes
from kiln_trainer.contract import (  # one owner, the trainer contract (stdlib only); kiln imports them here
    file_kind,
    fsync_dir,
    load_json,
    naming_path,
    open_regular_file,
    os_error_text,
    parse_json,
    parse_own_json,
    read_bounded,
    read_json,
    read_own_json,
)

__all__ = ["BAD_PATH_ERRNOS", "atomic_write_bytes", "atomic_write_text", "check_file_target", "exchange_paths", "exclusive_lock",
           "file_kind", "fsync_dir", "lies_inside", "load_json", "names_a_bad_path", "naming_path", "open_regular_file",
           "os_error_cause", "os_error_text", "parse_json", "parse_own_json", "read_bounded", "read_json", "read_own_json",
           "unusable_target_reason", "write_private"]


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Readers see either the old file or the whole new one, never a torn write: the trainer's
    writer (tmp in the same directory, fsync, rename, directory fsync) with the mode a plain
    ``open()`` would give (umask applied), so workers running as another user can read shards,
    reports and manifests."""
    umask = os.umask(0)
    os.umask(umask)
    return _atomic_write_bytes(path, data, mode=0o666 & ~umask)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_private(path: str | Path, text: str) -> Path:
    """Create or replace ``path`` with mode 0600 from the first byte on (no world-readable window):
    for generated credentials."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


# -- reading a file someone else put there ----------------------------------------------------------


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created, with its folder), waiting for another holder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def lies_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` (existing or not) is ``folder`` or below it, after every link is resolved."""
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


# -- replacing a directory ---------------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: str | Path, b: str | Path) -> None:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader,
    or a crash, sees both before or both after, never one missing.

    ``OSError`` with ``ENOSYS`` / ``EINVAL`` / ``EOPNOTSUPP`` where the system or the file system
    cannot (not Linux, an old glibc, NFS): the caller falls back to two renames."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here", os.fspath(a), None, os.fspath(b))
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


# -- checking a target before the work that will write it ------------------------------------------

BAD_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG,
     errno.ELOOP, errno.EEXIST, errno.EINVAL, errno.ENXIO}
)
"""Errors that say the caller named a path that cannot be written (a usage error); any other
(no space, quota, I/O error) is a fault of the machine."""


def names_a_bad_path(exc: OSError) -> bool:
    """True when ``exc`` is about the path the caller chose, not about the machine (disk full, I/O)."""
    return exc.errno in BAD_PATH_ERRNOS


def check_file_target(path: str | Path) -> Path:
    """Raise now the ``OSError`` an ``atomic_write_*`` to ``path`` would meet later, so a command can
    refuse before its work rather than after it. Its ``filename`` is the path at fault.

    Refused: a parent that is missing or not a directory (nothing is created), a target that exists
    and is not a regular file (a directory, a device such as /dev/full, a FIFO: the atomic rename
    would replace the node itself), a parent that does not take a new file (read-only, no access;
    tested by creating and removing an empty file, which also holds for root). A full disk shows
    only when the bytes are written.
    """
    target = Path(path)
    parent = target.parent
    if "\0" in str(target):  # the OS cannot even be asked (Python raises ValueError)
        raise OSError(errno.EINVAL, "a path cannot contain a NUL byte", str(target))
    if not stat.S_ISDIR(os.stat(parent).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
    try:
        mode = os.stat(target).st_mode  # through a link: what a reader of the path gets
    except FileNotFoundError:  # absent, or a dangling link the rename replaces
        pass
    else:
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is a {file_kind(mode)}, not a regular file", str(target))
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".probe")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(parent)) from exc
    os.close(fd)
    os.unlink(probe)
    return target


def os_error_cause(exc: OSError, target: str | Path) -> str:
    """``exc`` in words for a message about writing ``target``: the path it names is added unless it
    is ``target`` itself or the write's own temp file (which no longer exists)."""
    cause = exc.strerror or str(exc)
    name = exc.filename
    if name is None:
        return cause
    name = os.fsdecode(name)
    if os.path.abspath(name) == os.path.abspath(target) or os.path.basename(name).startswith(f".{Path(target).name}."):
        return cause
    return f"{name}: {cause}"


def unusable_target_reason(path: str | Path, *, directory: bool) -> str | None:
    """Why kiln could not create or write ``path`` (a directory when ``directory``, else a file), or
    None: checked before the work starts, so a bad target fails in a second, not after it.

    Writability is tested by creating and removing a probe file, in ``path`` when it is an existing
    directory, else in its nearest existing ancestor: permission bits say nothing for root, and
    only a write finds a read-only mount. (A full disk still shows only when the data is written.)
    """
    path = Path(path)
    if path.is_symlink() or path.exists():
        if directory and not path.is_dir():
            return f"{path} exists and is not a directory"
        if not directory and path.is_dir():
            return f"{path} is a directory"
    where = path if directory and path.is_dir() else path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"{where} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".kiln-probe-")
    except OSError as exc:
        return f"cannot write in {where}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None

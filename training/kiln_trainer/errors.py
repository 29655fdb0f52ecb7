"""Exceptions the trainer raises. Standard library only.

::

    TrainerError(Exception)
    ├── RecipeError(TrainerError, ValueError)            a recipe/override field (or a setting from one) is invalid
    ├── TrainingManifestError(TrainerError, ValueError)  TrainingManifest unreadable or its hash is wrong
    │   └── TokenManifestError                           a token manifest is malformed or its hash is wrong
    ├── ShardIntegrityError(TrainerError, ValueError)    a shard's bytes do not match the manifest sha256
    │   └── TokenShardError                              a packed token shard is truncated, altered or out of vocabulary
    ├── TokenizerError(TrainerError, ValueError)         a tokenizer artifact is unreadable or unusable (no EOS, ...)
    │   └── TokenizerMismatchError                       the tokenizer is not the one the shards were packed with
    ├── BlockSizeMismatchError(TrainerError, ValueError) the recipe's block size differs from the shards'
    ├── RemoteObjectError(TrainerError)                  a remote object is missing or corrupt (retryable)
    ├── CheckpointError(TrainerError, ValueError)        a checkpoint is missing, partial or tampered
    ├── ResumeMismatchError(TrainerError)                the run dir belongs to another recipe/manifest/world
    ├── TrainingDivergedError(TrainerError)              the loss guard gave up after its rollback budget
    └── StorageError(TrainerError)                       a write under the run dir failed (disk full, read-only)

No name here is also a name in ``kiln.errors``: a module that sees both trees (the launchers, the
pipeline) reads which side raised an error from its name alone.

Command-line entry points turn a ``TrainerError`` into a one-line message and exit status 2, so a
launcher can tell a fault the trainer diagnosed from a crash. An error whose class says
``retryable = True`` (only ``RemoteObjectError``: the object store may heal) is a fault a retry can
fix: an entry point should exit 1 for it, like a crash, so the launcher retries.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""

    retryable: ClassVar[bool] = False
    """True when a retry of the same job can succeed (the fault is outside the job's inputs)."""


class RecipeError(TrainerError, ValueError):
    """A recipe field (``section.key``) has an invalid value or is unknown, or a component setting
    built from one (loader, sample order, packing) is out of range."""


class TrainingManifestError(TrainerError, ValueError):
    """The TrainingManifest is malformed or its content hash does not match."""


class ShardIntegrityError(TrainerError, ValueError):
    """A shard listed in the manifest is missing or its sha256 differs."""


class CheckpointError(TrainerError, ValueError):
    """A checkpoint directory is not a whole, committed, untampered checkpoint."""


class ResumeMismatchError(TrainerError):
    """The newest checkpoint in the run dir was made with another recipe, manifest or world size."""


class TrainingDivergedError(TrainerError):
    """The loss stayed non-finite/spiking after the allowed number of rollbacks."""


class TokenShardError(ShardIntegrityError):
    """A packed token shard is missing, truncated, altered, or holds a token id outside the vocabulary."""


class TokenManifestError(TrainingManifestError):
    """A token manifest is malformed, or its content hash does not match its body."""


class TokenizerError(TrainerError, ValueError):
    """A tokenizer artifact cannot be read or used (bad JSON, no EOS token, vocabulary too small)."""


class TokenizerMismatchError(TokenizerError):
    """The tokenizer given is not the one the token shards were packed with (sha256 or EOS id differ)."""


class BlockSizeMismatchError(TrainerError, ValueError):
    """The block size asked for differs from the one the token shards were packed with."""


class RemoteObjectError(TrainerError):
    """A remote object is missing, unreadable or does not match its manifest sha256; names the URL."""

    retryable: ClassVar[bool] = True
class StorageError(TrainerError):
    """A write under the run directory failed for a reason a restart meets again (a full or read-only
    disk, a quota): names the path and the cause."""


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM})
"""Write failures that a restart on the same storage repeats: a fault to report, not a crash to retry."""


def os_error_text(exc: OSError) -> str:
    """``PATH: cause`` (both paths of a rename), or the cause alone when the OS named no path."""
    cause = exc.strerror or str(exc)
    if exc.filename is None:
        return cause
    paths = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{paths}: {cause}"


@contextlib.contextmanager
def naming_path(path: str | Path) -> Iterator[None]:
    """An ``OSError`` raised inside that names no file is re-raised naming ``path``: a failed
    ``write`` or ``fsync`` names none, and "No space left on device" alone does not say where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc

"""Exceptions the trainer raises. Standard library only.

::

    TrainerError(Exception)
    ├── ConfigError(TrainerError, ValueError)          a recipe/override field is invalid (names it)
    ├── ManifestError(TrainerError, ValueError)        TrainingManifest unreadable or its hash is wrong
    ├── ShardIntegrityError(TrainerError, ValueError)  a shard's bytes do not match the manifest sha256
    ├── CheckpointError(TrainerError, ValueError)      a checkpoint is missing, partial or tampered
    ├── ResumeMismatchError(TrainerError)              the run dir belongs to another recipe/manifest/world
    └── TrainingDivergedError(TrainerError)            the loss guard gave up after its rollback budget

Command-line entry points turn a ``TrainerError`` into a one-line message and exit status 2, so a
launcher can tell a fault the trainer diagnosed from a crash.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""


class ConfigError(TrainerError, ValueError):
    """A recipe field (``section.key``) has an invalid value or is unknown."""


class ManifestError(TrainerError, ValueError):
    """The TrainingManifest is malformed or its content hash does not match."""


class ShardIntegrityError(TrainerError, ValueError):
    """A shard listed in the manifest is missing or its sha256 differs."""


class CheckpointError(TrainerError, ValueError):
    """A checkpoint directory is not a whole, committed, untampered checkpoint."""


class ResumeMismatchError(TrainerError):
    """The newest checkpoint in the run dir was made with another recipe, manifest or world size."""


class TrainingDivergedError(TrainerError):
    """The loss stayed non-finite/spiking after the allowed number of rollbacks."""

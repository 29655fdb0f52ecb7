"""Every error kiln raises on purpose.

    KilnError                      base; ``retryable`` tells Airflow whether a retry can help
    ├── ConfigError                bad recipe / params / settings (names the bad field)
    ├── SnapshotError              DVC add/push/restore failed, unknown snapshot id
    │   └── SnapshotMismatchError  the bytes found are not the snapshot an asset event announced (no retry)
    ├── ContractError              unknown contract, malformed suite JSON
    │   └── DataGateError          quarantined share above the policy threshold (no retry)
    ├── ManifestError              TrainingManifest / checkpoint manifest missing, tampered, partial
    ├── LaunchError                the training job could not start or ended in failure
    │   └── TrainingFaultError     the trainer diagnosed a fault a retry cannot fix (exit 2) — kiln.launchers
    ├── RegistryError              MLflow registration / alias move failed
    └── PolicyError                a policy forbids this (sandbox → production name…) (no retry)

Third-party errors are translated at the boundary: ``raise SnapshotError(...) from exc``.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base class. ``retryable`` is False for faults that a retry cannot fix."""

    retryable: bool = True


class ConfigError(KilnError):
    retryable = False


class SnapshotError(KilnError):
    pass


class SnapshotMismatchError(SnapshotError):
    """The bytes found are not the snapshot an asset event announced; a retry finds the same bytes."""

    retryable = False


class ContractError(KilnError):
    retryable = False


class DataGateError(ContractError):
    retryable = False


class ManifestError(KilnError):
    retryable = False


class LaunchError(KilnError):
    pass


class RegistryError(KilnError):
    pass


class PolicyError(KilnError):
    retryable = False

"""Every error kiln raises on purpose.

    KilnError                      base; ``retryable`` tells Airflow whether a retry can help
    ├── ConfigError                bad recipe / params / settings (names the bad field)
    │   ├── CorpusInputError       input to ``kiln corpus import`` that cannot become a corpus (names the
    │   │                          file and line or row, and the field)
    │   └── MixtureError           a data mixture that cannot be trained (names the file and the field)
    ├── SnapshotError              DVC add/push/restore failed, unknown snapshot id
    │   └── SnapshotMismatchError  the bytes found are not the snapshot an asset event announced (no retry)
    ├── ContractError              unknown contract, malformed suite JSON
    │   ├── DataGateError          quarantined share above the policy threshold (no retry)
    │   └── PatternNotLinear       a contract's regex that RE2 cannot run with Python's meaning (also a ValueError)
    ├── ManifestError              TrainingManifest / checkpoint manifest missing, tampered, partial
    │   ├── RunReadError           a run directory's record (result, metrics, sample log) that cannot be read
    │   │                          as the trainer contract says (names the file; the conformance kit)
    │   └── ProvenanceError        a signed artifact whose signature, statement or bytes do not verify, or a
    │                              signing key that is missing, unreadable or trusted by two policies (no retry)
    ├── LaunchError                the training job could not start or ended in failure
    │   └── TrainingFaultError     the trainer diagnosed a fault a retry cannot fix (exit 2)
    ├── RegistryError              MLflow registration / alias move failed
    ├── AirflowAPIError            the Airflow REST API refused a request (``status``: its HTTP status)
    ├── StackError                 a service of the embedded or production-like stack did not start or answer
    ├── DemoError                  ``kiln demo`` could not run the production DAG to its end
    ├── RunMismatchError           a run directory or version holds another run, or a result made from
    │                              other inputs than this run asks for (no retry)
    └── PolicyError                a policy forbids this (sandbox → production name…) (no retry)

Third-party errors are translated at the boundary: ``raise SnapshotError(...) from exc``.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base class. ``retryable`` is False for faults that a retry cannot fix."""

    retryable: bool = True


class ConfigError(KilnError):
    retryable = False


class MixtureError(ConfigError):
    """A data mixture (``training/mixtures/NAME.toml``) that cannot be trained: the message names the
    file and the field (``sources[1] ('code').weight``)."""


class CorpusInputError(ConfigError):
    """A file given to ``kiln corpus import`` is unreadable, lacks a field, holds bytes that are not
    UTF-8, or the input holds no document: the message names the file and the line or row."""


class SnapshotError(KilnError):
    pass


class SnapshotMismatchError(SnapshotError):
    """The bytes found are not the snapshot an asset event announced; a retry finds the same bytes."""

    retryable = False


class ContractError(KilnError):
    retryable = False


class DataGateError(ContractError):
    retryable = False


class PatternNotLinear(ContractError, ValueError):
    """A Python regex kiln cannot run on RE2 (linear time) with the same meaning; the message says why."""


class ManifestError(KilnError):
    retryable = False


class RunReadError(ManifestError):
    """A run directory's record cannot be read as the trainer contract says (the message names the file)."""


class ProvenanceError(ManifestError):
    """A model artifact's signature (``model.sig``), its signed provenance statement or its bytes do not
    verify for the policy asked, or the policy's keys are unusable: the message names the file, signature or
    key at fault. A retry finds the same bytes."""

    retryable = False


class LaunchError(KilnError):
    pass


class RegistryError(KilnError):
    pass


class TrainingFaultError(LaunchError):
    """A worker exited 2: the trainer diagnosed a fault (bad recipe, tampered data or checkpoint,
    resume mismatch, divergence) that a restart or a retry would only repeat."""

    retryable = False


class AirflowAPIError(KilnError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class StackError(KilnError):
    pass


class DemoError(KilnError):
    pass


class RunMismatchError(KilnError):
    """What a run's directory or registry holds was made by another run, or from other inputs than
    the run asks for: reusing it would hand one run's result to another, and a retry finds the same."""

    retryable = False


class PolicyError(KilnError):
    retryable = False

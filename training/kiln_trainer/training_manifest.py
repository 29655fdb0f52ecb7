"""The TrainingManifest reader under its former name: it is the trainer contract's now
(``kiln_trainer.contract.training_manifest``, one definition), and the trainer's modules, tools and tests that
import it here get the same objects."""

from __future__ import annotations

from kiln_trainer.contract.training_manifest import (
    MIXTURE_FORMAT,
    SOURCE_NAME,
    TRAINING_MANIFEST_FORMATS,
    TRAINING_MANIFEST_KIND,
    ManifestSource,
    ShardEntry,
    TokensRef,
    TrainingManifest,
    check_training_manifest,
    load_training_manifest,
    metric_name,
    mixture_summary,
    mixture_tokens_sha256,
)

__all__ = [
    "MIXTURE_FORMAT",
    "ManifestSource",
    "SOURCE_NAME",
    "ShardEntry",
    "TRAINING_MANIFEST_FORMATS",
    "TRAINING_MANIFEST_KIND",
    "TokensRef",
    "TrainingManifest",
    "check_training_manifest",
    "load_training_manifest",
    "metric_name",
    "mixture_summary",
    "mixture_tokens_sha256",
]

"""The TrainingManifest reader under its former name: it is the trainer contract's now
(``kiln_trainer.contract.training_manifest``, one definition), and the trainer's modules, tools and tests that
import it here get the same objects."""

from __future__ import annotations

from kiln_trainer.contract.training_manifest import (
    TRAINING_MANIFEST_KIND,
    ShardEntry,
    TokensRef,
    TrainingManifest,
    load_training_manifest,
)

__all__ = [
    "ShardEntry",
    "TRAINING_MANIFEST_KIND",
    "TokensRef",
    "TrainingManifest",
    "load_training_manifest",
]

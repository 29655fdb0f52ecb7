"""kiln_trainer: the trainer that runs on every node under torchrun.

Modules (one concern each)::

    config               recipe dataclasses, TOML loading, ``--set`` overrides, recipe hash
    data                 TrainingManifest parsing, shard verification, byte stream, rank split
    model                the byte-level decoder-only transformer (``GPT``) and ``generate``
    checkpoint           saving/loading full training state, async writer, retention
    checkpoint_manifest  torch-free commit protocol: ``verify_checkpoint``, ``latest_committed``
    metrics              metrics.jsonl + optional MLflow batch logging (rank 0 only)
    train                the torchrun entry point
    evaluate             bits-per-byte of a committed checkpoint on the eval split
    export               log a committed checkpoint as an MLflow pytorch model

This package never imports Airflow or the ``kiln`` orchestration library. Importing the
package itself (and ``errors``, ``checkpoint_manifest``) is torch-free, so the orchestration side
can verify checkpoints without loading torch.
"""

__all__ = ["BYTE_VOCAB_SIZE"]

BYTE_VOCAB_SIZE = 256
"""The tokenizer is the identity on bytes: token id == byte value."""

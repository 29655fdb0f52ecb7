"""kiln_trainer: the trainer that runs on every node under torchrun.

Its own distribution, ``kiln-trainer`` (``training/pyproject.toml``): torch, numpy, pyarrow and
tokenizers, no Airflow; extras ``mlflow``, ``s3`` and ``export`` (docs/trainer-contract.md,
"Installing the trainer side alone"). It never imports ``kiln``, the orchestration side.

Modules (one concern each)::

    contract             what kiln and a trainer share, written once (standard library only): run dir names,
                         manifest hash, result, exit codes, the ranks' environment, the straggler rule; and
      .training_manifest   TrainingManifest parsing and its content-hash check
      .checkpoint_manifest the commit protocol of both checkpoint formats: ``seal``, ``verify_checkpoint``, ``latest_committed``
      .entrypoint          which trainer a recipe names, the argv every rank gets, loading and checking an entry point
    errors               the trainer's exception tree (standard library only; no name shared with kiln.errors)
    config               recipe dataclasses, TOML loading, ``--set`` overrides, recipe hash
    training_manifest    ``contract.training_manifest`` under its former name
    data                 a run's training data: the packed tokens its manifest names, or rank 0 packs them; the checks
    tokenizer            byte / BPE / file tokenizers: one interface, an artifact with a sha256 and an EOS id
    packed               packed token shards: writer, token manifest, checks, random-access reader
    sample_order         the per-epoch Feistel bijection from stream positions to sample ids
    loader               world-size-independent global batches, read per rank, prefetched; tiny state
    remote               packed shards streamed from S3 into a bounded, hash-checked local cache
    distributed          rank and world from torchrun's environment, process group, threads, seeds, collectives
    model                the decoder-only transformer (``GPT``), ``generate_ids`` and, for bytes, ``generate``
    optim                AdamW and its learning-rate schedule (warmup, then cosine)
    parallel             ``[parallel] strategy``: ddp (replicated) or fsdp (FSDP2 per block and root, bf16 policy on CUDA)
    checkpoint           the ddp strategy's checkpoints (rank 0's async writer), retention, what both formats share
    sharded_checkpoint   the fsdp strategy's: every rank's shards through DCP; either format into either strategy
    checkpoint_manifest  ``contract.checkpoint_manifest`` under its former name
    metrics              metrics.jsonl + optional MLflow batch logging (rank 0 only)
    timing               in-step marks, the DDP gradient-ready hook, the start-up profile, peak FLOP/s and MFU
    stragglers           torch-free straggler monitor: a rank slower than the others' median for K windows
    faults               chaos-test fault hooks (loss spike, slow rank or node), off unless their variable is set
    sdk                  the trainer SDK: a ``Session`` keeps every guarantee around any torch model (start,
                         loader, ``wrap`` in the strategy, resume and save, ``report``, ``finish``); ``sdk.run``
                         is an entry point's ``main`` (exit codes, teardown)
      .hooks               ``StepHook`` and kiln's hooks, one module each: faults, guard, startup, stragglers, interval_log
    train                kiln's torchrun entry point on the SDK: the GPT, its optimizer, the loop
    evaluate             bits per byte of a committed checkpoint on the eval split, with its own tokenizer
    hf                   a committed checkpoint as a Hugging Face folder (GPT2LMHeadModel, safetensors, tokenizer files)
    export               log a committed checkpoint as an MLflow text model (pyfunc as code, the Hugging Face folder)
    serving              that model: ``transformers`` over the folder behind ``predict(prompts) -> texts``
    mlflow_model         the file MLflow logs as the version's model code (models from code: no pickle)

This package never imports Airflow or the ``kiln`` orchestration library. The orchestration side
imports ``contract`` (and a few listed exceptions, ``tests/unit/kiln/test_layout.py``). Importing the
package itself (and ``contract``, ``errors``, ``config``, ``stragglers`` and the data path: ``tokenizer``,
``packed``, ``sample_order``, ``loader``, ``remote``, ``data``) is torch-free, so the orchestration
side can check recipes and manifests, verify checkpoints and tokenize without loading torch.
"""

__all__ = ["BYTE_VOCAB_SIZE"]

BYTE_VOCAB_SIZE = 256
"""The byte values: ids 0..255 of the byte tokenizer (``tokenizer.ByteTokenizer``, which adds EOS 256 by default)."""

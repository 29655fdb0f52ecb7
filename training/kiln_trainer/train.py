"""Train the GPT on a TrainingManifest's packed tokens; resumable, checkpointed, deterministic.

Single process (world size 1, no torchrun needed)::

    python -m kiln_trainer.train --manifest M.json --recipe training/recipes/tiny.toml --run-dir RUN

One node, 2 ranks (gloo on CPU, NCCL + bf16 autocast on GPU)::

    torchrun --standalone --nproc-per-node=2 -m kiln_trainer.train \\
        --manifest M.json --recipe training/recipes/small.toml --run-dir RUN

Two nodes (run on each node; on one machine, two agents play the two nodes)::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=RUN_KEY \\
        -m kiln_trainer.train --manifest M.json --recipe R.toml --run-dir RUN

Options: ``--set section.key=value`` (repeatable, over the recipe), ``--max-steps N`` (stop this
invocation after step N, still checkpointed; a later start continues to ``train.steps``),
``--sample-log`` (or ``KILN_SAMPLE_LOG=1``: each rank appends the global sample ids it consumed per
step to ``RUN/sample-log/rank-NNNNN.jsonl``; off by default, and not part of the recipe, so it can
be switched on for a resume). ``RUN`` must be one directory every rank sees (a shared filesystem
across nodes).

Data (``kiln_trainer.data``, ``loader``): every rank opens the packed token shards the manifest's
``tokens`` names -- a local directory, or an ``s3://`` prefix streamed into a bounded per-rank cache
-- and checks them before step 1 (the token manifest's sha256, the recipe's tokenizer, block size,
vocabulary, shard sizes). A manifest without ``tokens`` is packed by rank 0 with the recipe's
tokenizer into ``RUN/tokens/`` (content-addressed, reused on a restart) while the other ranks wait.
The global batch of step ``s`` is ``data.global_batch_size`` samples whose ids depend only on the
seed, the shards and ``s`` (a seeded permutation per epoch: each sample once per epoch); rank ``r``
of ``W`` reads its contiguous ``1/W`` of it as ``data.global_batch_size / (W x data.micro_batch_size)``
micro-batches, accumulating gradients. So the world size may change between invocations: a
checkpoint of 2 ranks resumes on 1 (and back) and continues the same global sample sequence, with
the same global batch (a resume with another ``data.global_batch_size``, seed, training manifest or
token manifest is refused, naming it; ``data.micro_batch_size`` may change). The loss is the mean
over the global batch at any ``W``, so the training is the same up to float summation order: at the
same world size a resumed run is bit-identical, across a world-size change it ends within float
tolerance (``tests/integration/test_world_size_change.py`` measures it).

Rank and world size come from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE). Only rank 0 writes shared state: ``metrics.jsonl``, ``metrics.prom``,
``result.json``, and the checkpoints under ``parallel.strategy = "ddp"``; under ``"fsdp"`` (FSDP2,
``kiln_trainer.parallel``) every rank writes its own shards of each checkpoint and rank 0 commits it
(``kiln_trainer.sharded_checkpoint``). A checkpoint of either strategy resumes into either. Torch
uses ``max(1, cpus // LOCAL_WORLD_SIZE)`` threads per rank unless ``KILN_TORCH_THREADS`` says
otherwise (set it to 1 when several single-rank agents share a host).

A start resumes from the newest committed checkpoint in ``RUN/checkpoints`` (directories without a
valid manifest are ignored and logged; every rank hashes its share of a candidate's files); with
the same manifest, recipe, seed and world size the resumed run ends with the same
``weights_sha256`` as an uninterrupted one. At another world size it logs ``resumed at world size 1
from a checkpoint of world size 2``; ranks the checkpoint did not have seed their RNGs from (seed,
rank, step). At the end rank 0 writes ``RUN/result.json`` (kind ``kiln.TrainResult``). Exit status
2 means the trainer diagnosed a fault (bad recipe, tampered manifest/shard, mismatched tokens,
mismatched resume, divergence, a full or read-only run directory): retrying will not help. A
missing or corrupt object in the S3 token store exits 1, like a crash: the store may heal, and a
restart resumes.
Rank 0 also keeps a copy of the TrainingManifest as ``RUN/training_manifest.json``, so a checkpoint
can be evaluated without being told which manifest made it.

Loss guard (``[guard]`` in the recipe): a non-finite step loss, or one above ``spike_factor`` times
the mean of the recent losses, is never applied; the run rolls back to the newest committed
checkpoint, replays the same batches up to the offending one and skips that global batch on every
rank (``TokenLoader.skip_step``; the skipped batch indices are checkpointed, so a resume skips it
too), and records a ``rollback`` event (``metrics.jsonl``, every later checkpoint,
``result.json``). Past ``max_rollbacks`` it fails with exit status 2.

Fault injection, for chaos tests only (never set in production): ``kiln_trainer.faults``.

Stragglers and scaling (``[stragglers]`` in the recipe): every ``every_steps`` steps the ranks
all-gather their compute time per step (step time minus the time blocked in collectives); rank 0
records ``rank_step_times``, ``straggler_rank`` (-1 when none) and ``scaling_efficiency`` and flags a
rank slower than ``factor`` x the other ranks' median for ``windows`` windows (log line, a
``straggler`` event in metrics.jsonl, MLflow tags ``kiln.straggler_rank``/``kiln.straggler``).
Rank 0 also records where each invocation's start-up time went (``startup`` event and log line).

This file is the model and the loop; every guarantee above is the SDK's (``kiln_trainer.sdk``): the
session, its loader, strategy and checkpoints, and the step hooks (``sdk.hooks``: fault injection,
the guard, the startup profile, the straggler watch, interval logging).
"""

from __future__ import annotations

import argparse
import sys
import time

_IMPORT_T0 = time.time()  # startup profile: the heavy imports below (absent when preloaded)

import torch

from kiln_trainer import sdk
from kiln_trainer.model import GPT
from kiln_trainer.optim import make_optimizer, make_scheduler
from kiln_trainer.sdk.hooks import default_hooks
from kiln_trainer.sdk.hooks.guard import guard_verdict

_IMPORT_T1 = time.time()

__all__ = ["guard_verdict", "main", "parse_args", "train"]

PROG = "python -m kiln_trainer.train"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return sdk.parse_args(argv, prog=PROG, description=__doc__.split("\n")[0])


def train(session: sdk.Session) -> None:
    """The loop, on every rank: build the model, resume, then step until ``session.target_step``."""
    cfg = session.recipe
    # The same seed on every rank (Session.start): the same initial weights everywhere.
    gpt = GPT(cfg.model).to(session.device)
    model = session.wrap(gpt, blocks=gpt.transformer.h)  # DDP, or FSDP2 sharded in place
    optimizer = make_optimizer(gpt, cfg.optim)  # after wrap: under fsdp it holds the shards
    scheduler = make_scheduler(optimizer, cfg)
    session.resume(optimizer, scheduler)  # the newest committed checkpoint, or step 0
    model.train()
    while session.step < session.target_step:
        step = session.step + 1
        batch = session.next_batch()  # this rank's part of the global batch
        loss_sum = torch.zeros((), device=session.device)
        for x, y in session.micro_batches(batch):  # DDP all-reduces on the last one only
            with session.autocast():
                _, loss = model(x, y)
                loss = loss / session.accum_steps
            loss.backward()
            loss_sum += loss.detach()
        loss_value = session.mean_loss(loss_sum)  # over every rank (the guard's input)
        if session.rejects(loss_value, batch):  # rolled back to the last commit; the batch is skipped
            continue
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        session.report(step, loss_value)  # counted, checkpointed when due, stragglers, log line


def main(argv: list[str] | None = None) -> int:
    hooks = default_hooks(import_window=(_IMPORT_T0, _IMPORT_T1))
    return sdk.run(train, argv, prog=PROG, description=__doc__.split("\n")[0], hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())

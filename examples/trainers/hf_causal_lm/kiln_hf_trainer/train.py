"""Train a Hugging Face ``LlamaForCausalLM`` on a TrainingManifest's packed tokens, through kiln.

kiln runs it: a recipe names it (``[trainer] train = "kiln_hf_trainer.train:main"``) and kiln's
launchers call ``main(argv)`` on every rank under torchrun::

    kiln train --recipe training/recipes/tiny-llama.toml \\
        --manifest M.json --run-dir RUN --nproc-per-node 2

It also runs alone, with the arguments kiln hands every rank (``docs/trainer-contract.md``)::

    torchrun --standalone --nproc-per-node=2 -m kiln_hf_trainer.train \\
        --manifest M.json --recipe tiny-llama.toml --run-dir RUN [--set section.key=value ...]

The model, its optimizer (torch's AdamW, no decay on norms) and its schedule (transformers' cosine
with warmup down to ``optim.min_lr``) are what a Hugging Face training script has; kiln's SDK keeps
the rest: the streaming loader (the same global batches at any world size), FSDP2 on each decoder
layer (or DDP, as ``parallel.strategy`` says), committed sharded checkpoints with the RNGs and the
loader's position, the resume from them (bitwise at the same world size), the loss guard, the
metrics, stragglers and ``result.json``.

The loss is the next-token cross-entropy on kiln's packed samples: the loader already splits each
sample of ``block_size + 1`` ids into inputs and targets shifted by one, so the targets are not
passed as ``labels`` (the model would shift them a second time).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from kiln_hf_trainer.model import build_model
from kiln_trainer import sdk

PROG = "python -m kiln_hf_trainer.train"


def main(argv: list[str] | None = None) -> int:
    """What kiln calls on every rank: the contract's exit code."""
    return sdk.run(train, argv, prog=PROG, description=__doc__.split("\n")[0])


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on the matrices only, none on the RMSNorm weights (as transformers' Trainer does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def train(session: sdk.Session) -> None:
    """The loop, on every rank: build the model, resume, then step until ``session.target_step``."""
    cfg = session.recipe
    # The same seed on every rank (Session.start): the same initial weights everywhere.
    with session.device:  # built in place on the rank's device
        model = build_model(cfg, session.data.tokenizer)
    wrapped = session.wrap(model, blocks=model.model.layers)  # FSDP2 on each decoder layer, or DDP
    opt = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, opt.weight_decay), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                  eps=opt.eps)  # after wrap: under fsdp it holds the shards
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=opt.warmup_steps, num_training_steps=cfg.train.steps, min_lr=opt.min_lr)
    session.resume(optimizer, scheduler)  # the newest committed checkpoint, or step 0
    wrapped.train()
    while session.step < session.target_step:
        step = session.step + 1
        batch = session.next_batch()  # this rank's part of the global batch
        loss_sum = torch.zeros((), device=session.device)
        for input_ids, targets in session.micro_batches(batch):  # DDP all-reduces on the last one only
            with session.autocast():
                logits = wrapped(input_ids=input_ids).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / session.accum_steps
            loss.backward()
            loss_sum += loss.detach()
        loss_value = session.mean_loss(loss_sum)  # over every rank (the guard's input)
        if session.rejects(loss_value, batch):  # rolled back to the last commit; the batch is skipped
            continue
        if opt.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        session.report(step, loss_value)  # counted, checkpointed when due, stragglers, log line


if __name__ == "__main__":
    sys.exit(main())

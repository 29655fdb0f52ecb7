"""The baseline of ``trainer_loop``: a bare nanoGPT-style training loop (Karpathy's ``train.py``, CPU path).

Same model class, optimizer (AdamW with the decay / no-decay split), warmup + cosine schedule,
gradient clipping, token stream (the recipe's tokenizer over the same documents, EOS between them)
and batch geometry (``data.global_batch_size`` as micro-batches of ``data.micro_batch_size`` on one
rank) as kiln_trainer, and nothing else: no guard, no rank logic, no metrics files, no checkpoints,
no loader thread, batches drawn with ``torch.randint`` as nanoGPT's ``get_batch`` does.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from kiln_trainer.config import Recipe
from kiln_trainer.model import GPT


def bare_train(recipe: Recipe, stream: np.ndarray, steps: int) -> dict[str, Any]:
    """Train a fresh model for ``steps`` optimizer steps: the loop's wall and CPU seconds, each step's
    CPU seconds (``step_cpu_s``), the last loss."""
    m, d, o = recipe.model, recipe.data, recipe.optim
    accum = d.accum_steps(1)
    torch.manual_seed(recipe.train.seed)
    model = GPT(m)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    data = torch.from_numpy(stream.astype(np.int64))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - m.block_size - 1, (d.micro_batch_size,))
        x = torch.stack([data[i : i + m.block_size] for i in ix]).long()
        y = torch.stack([data[i + 1 : i + 1 + m.block_size] for i in ix]).long()
        return x, y

    def get_lr(it: int) -> float:
        if it < o.warmup_steps:
            return o.lr * (it + 1) / o.warmup_steps
        progress = min(1.0, (it - o.warmup_steps) / max(1, recipe.train.steps - o.warmup_steps))
        return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)

    model.train()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    x, y = get_batch()
    loss = torch.zeros(())
    step_cpu: list[float] = []
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        for _ in range(accum):
            _, loss = model(x, y)
            loss = loss / accum
            x, y = get_batch()  # nanoGPT fetches the next batch while the device works
            loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % recipe.train.log_every == 0:
            lossf = loss.item() * accum  # nanoGPT's only host sync (a no-op on CPU)
            del lossf
        step_cpu.append(time.thread_time())
    loop_s, cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
    step_cpu_s = [b - a for a, b in zip([cpu0, *step_cpu[:-1]], step_cpu, strict=True)]
    return {"loop_s": loop_s, "cpu_s": cpu_s, "step_cpu_s": step_cpu_s, "last_loss": float(loss.item()) * accum}

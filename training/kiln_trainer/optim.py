"""The optimiser and its learning-rate schedule: AdamW (no decay on biases and norms), linear warmup
then cosine decay to ``optim.min_lr`` at ``train.steps``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kiln_trainer.config import OptimConfig, Recipe
from kiln_trainer.model import GPT


def make_optimizer(model: GPT, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_multiplier(recipe: Recipe) -> Callable[[int], float]:
    """LambdaLR factor for 0-based scheduler index i (optimizer step i+1): warmup, then cosine."""
    opt, total = recipe.optim, recipe.train.steps

    def factor(i: int) -> float:
        if i < opt.warmup_steps:
            return (i + 1) / opt.warmup_steps
        span = max(1, total - opt.warmup_steps)
        progress = min(1.0, (i - opt.warmup_steps) / span)
        lr = opt.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (opt.lr - opt.min_lr)
        return lr / opt.lr

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(recipe))

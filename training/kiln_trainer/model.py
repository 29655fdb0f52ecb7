"""A small decoder-only transformer over bytes (nanoGPT class, vocabulary 256).

Token id == byte value, so there is no tokenizer file: ``generate`` takes ``bytes`` (or ``str``,
encoded as UTF-8) and returns ``bytes``. The module keeps its ``ModelConfig`` as a plain dict
attribute so that a pickled module (the MLflow model format, see ``export``) rebuilds without the
recipe machinery.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_trainer.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx, targets=None) -> (logits, loss | None)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config: dict[str, Any] = asdict(cfg)
        self.block_size = cfg.block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (as GPT-2): fewer parameters, and it trains better at this size.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B estimate: 6N + 12·L·H·Q·T), for MFU."""
        cfg = self.config
        n = self.num_parameters()
        return 6 * n + 12 * cfg["n_layer"] * cfg["n_head"] * (cfg["n_embd"] // cfg["n_head"]) * cfg["block_size"]

    @torch.no_grad()
    def generate(
        self,
        prompt: bytes | str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = 0,
    ) -> bytes:
        """Sample ``max_new_tokens`` bytes after ``prompt``; returns only the new bytes.

        ``temperature == 0`` is greedy. Sampling uses its own ``torch.Generator`` seeded with
        ``seed`` so that generation never perturbs (or depends on) the global RNG.
        """
        if isinstance(prompt, str):
            prompt = prompt.encode("utf-8")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        gen = torch.Generator(device=device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        # An empty prompt starts from a newline, the most common document boundary in text.
        ids = list(prompt) or [10]
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        out: list[int] = []
        try:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.block_size :])
                logits = logits[:, -1, :].float()
                if temperature <= 0:
                    nxt = torch.argmax(logits, dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=gen)
                idx = torch.cat([idx, nxt], dim=1)
                out.append(int(nxt.item()))
        finally:
            self.train(was_training)
        return bytes(out)


def build_model(cfg: ModelConfig) -> GPT:
    return GPT(cfg)

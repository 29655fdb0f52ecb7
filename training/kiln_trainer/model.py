"""A small decoder-only transformer (nanoGPT class) over the token ids of the run's tokenizer.

``generate_ids(ids) -> ids`` samples token ids (encode and decode with the checkpoint's
``tokenizer.json``, ``kiln_trainer.tokenizer.load_tokenizer``). For the byte tokenizer ``generate``
takes ``bytes`` (or ``str``, encoded as UTF-8) and returns ``bytes``: ids are byte values and the
EOS id (256) is never sampled. The module keeps its ``ModelConfig`` as a plain dict attribute
(``config``), which ``kiln_trainer.hf`` maps onto a ``GPT2Config``: a registered version carries the
weights as a Hugging Face folder of safetensors (docs/registry.md), never a pickled module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_trainer.config import ModelConfig

if TYPE_CHECKING:

    class _Trunk(nn.ModuleDict):
        """What ``GPT.transformer`` holds, declared for the type checker (a ModuleDict's entries are
        untyped attributes)."""

        wte: nn.Embedding
        wpe: nn.Embedding
        drop: nn.Dropout
        h: nn.ModuleList
        ln_f: nn.LayerNorm


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
    """Decoder-only GPT. ``forward(idx, targets=None) -> (logits, loss | None)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("model.vocab_size is 0 (follow the tokenizer): build from a Recipe, which resolves it")
        self.config: dict[str, Any] = asdict(cfg)
        self.block_size = cfg.block_size
        # A plain ModuleDict at run time (parameter names transformer.wte.weight, ...; exported models
        # pickle it as one): _Trunk only names its entries' types.
        self.transformer = cast("_Trunk", nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        ))
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
        _, seq_len = idx.shape
        if seq_len > self.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.block_size}")
        pos = torch.arange(seq_len, dtype=torch.long, device=idx.device)
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
    def generate_ids(
        self,
        ids: Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = 0,
        *,
        stop_id: int | None = None,
    ) -> list[int]:
        """Sample up to ``max_new_tokens`` token ids after ``ids`` (non-empty); returns only the new ids,
        ending before ``stop_id`` if it is sampled (e.g. the tokenizer's EOS).

        ``temperature == 0`` is greedy. Sampling uses its own ``torch.Generator`` seeded with
        ``seed`` so that generation never perturbs (or depends on) the global RNG.
        """
        return self._sample(list(ids), max_new_tokens, temperature, top_k, seed, stop_id=stop_id, id_limit=None)

    @torch.no_grad()
    def generate(
        self,
        prompt: bytes | str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = 0,
    ) -> bytes:
        """Byte tokenizer: sample ``max_new_tokens`` bytes after ``prompt``; returns only the new bytes.

        Only byte ids (0..255) are sampled, so the result has exactly ``max_new_tokens`` bytes.
        """
        if isinstance(prompt, str):
            prompt = prompt.encode("utf-8")
        # An empty prompt starts from a newline, the most common document boundary in text.
        out = self._sample(list(prompt) or [10], max_new_tokens, temperature, top_k, seed, stop_id=None, id_limit=256)
        return bytes(out)

    def _sample(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        seed: int | None,
        *,
        stop_id: int | None,
        id_limit: int | None,
    ) -> list[int]:
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if not ids:
            raise ValueError("generation needs at least one prompt token")
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        gen = torch.Generator(device=device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        out: list[int] = []
        try:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.block_size :])
                logits = logits[:, -1, :].float()
                if id_limit is not None:
                    logits[:, id_limit:] = float("-inf")
                if temperature <= 0:
                    nxt = torch.argmax(logits, dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=gen)
                token = int(nxt.item())
                if token == stop_id:
                    break
                idx = torch.cat([idx, nxt], dim=1)
                out.append(token)
        finally:
            self.train(was_training)
        return out


def build_model(cfg: ModelConfig) -> GPT:
    return GPT(cfg)

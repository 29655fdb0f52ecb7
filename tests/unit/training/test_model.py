"""The byte-level GPT: shapes, loss, generate."""

from __future__ import annotations

import pytest
import torch

from kiln_trainer.config import ModelConfig
from kiln_trainer.model import GPT

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256)


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert loss is not None and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert model(idx)[1] is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_weights_are_tied() -> None:
    model = GPT(CFG)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_generate_returns_new_bytes_deterministically_without_touching_global_rng() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    model.train()
    before = torch.get_rng_state()
    out = model.generate(b"def f():", max_new_tokens=40, seed=3)
    assert torch.equal(before, torch.get_rng_state())
    assert isinstance(out, bytes) and len(out) == 40
    assert out == model.generate("def f():", max_new_tokens=40, seed=3)
    assert model.training  # mode restored
    assert model.generate(b"", max_new_tokens=5, temperature=0) == model.generate(b"", max_new_tokens=5, temperature=0)
    assert len(model.generate(b"x", max_new_tokens=3, top_k=5)) == 3
    with pytest.raises(ValueError):
        model.generate(b"x", max_new_tokens=-1)

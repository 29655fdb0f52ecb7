"""The model: ``transformers.LlamaForCausalLM`` from the recipe's ``[model]`` table.

The table is the trainer's own (kiln reads only ``block_size`` and ``vocab_size``); its other keys are
``LlamaConfig`` fields, the architecture alone (``ARCHITECTURE_KEYS``). The rest of the config comes
from the run: the vocabulary is the recipe's resolved ``model.vocab_size`` (0 in the file follows the
run's tokenizer), the positions are the packed samples' ``block_size``, and BOS and EOS are the
tokenizer's EOS (a document starts after one; kiln has no other special ids). The training and
the export build the same config, so the exported ``config.json`` is the one the weights trained under.
"""

from __future__ import annotations

from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig, LlamaForCausalLM

from kiln_trainer.config import Recipe
from kiln_trainer.errors import RecipeError
from kiln_trainer.tokenizer import Tokenizer

ARCHITECTURE_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
    "attention_dropout", "mlp_bias", "initializer_range",
})
"""The ``[model]`` keys this trainer takes besides kiln's ``block_size`` and ``vocab_size``. ``LlamaConfig``
accepts any keyword silently, so a misspelt key is refused here rather than ignored."""


def llama_config(recipe: Recipe, tokenizer: Tokenizer, *, use_cache: bool = False) -> LlamaConfig:
    """The ``LlamaConfig`` of ``recipe`` on ``tokenizer``'s ids. ``use_cache``: off for training (no
    KV cache is built for a forward over a whole sample), on in an exported folder (generation).
    ``RecipeError`` (exit 2 before step 1) naming the key for an unknown or invalid value."""
    arch: dict[str, Any] = dict(recipe.user_model)
    unknown = sorted(set(arch) - ARCHITECTURE_KEYS)
    if unknown:
        raise RecipeError(f"model: unknown key(s) {unknown} for a LlamaForCausalLM; known: "
                          f"{sorted([*ARCHITECTURE_KEYS, 'block_size', 'vocab_size'])}")
    if "rope_theta" in arch:
        arch["rope_parameters"] = {"rope_type": "default", "rope_theta": float(arch.pop("rope_theta"))}
    eos = tokenizer.eos_id
    try:
        return LlamaConfig(
            **arch,
            vocab_size=recipe.model.vocab_size,
            max_position_embeddings=recipe.model.block_size,
            bos_token_id=eos,
            eos_token_id=eos,
            # No pad_token_id: the embedding would make it a padding_idx, a row that never trains, and
            # kiln's EOS is a real token of every sample (generation pads with it: generation_config).
            use_cache=use_cache,
        )
    except (StrictDataclassError, TypeError, ValueError) as exc:
        raise RecipeError(f"model: not a valid LlamaConfig: {exc}") from exc


def build_model(recipe: Recipe, tokenizer: Tokenizer) -> LlamaForCausalLM:
    """A freshly initialised model (the torch RNG decides the weights: the same seed gives the same model)."""
    return LlamaForCausalLM(llama_config(recipe, tokenizer))


def trained_model(recipe: Recipe, tokenizer: Tokenizer, state: dict[str, torch.Tensor], *,
                  use_cache: bool = False) -> LlamaForCausalLM:
    """The model a checkpoint's whole state makes (loaded strictly: a missing or extra key is an error),
    in eval mode, on the CPU: what the evaluation and the export start from."""
    model = LlamaForCausalLM(llama_config(recipe, tokenizer, use_cache=use_cache))
    model.load_state_dict(state, strict=True)
    return model.eval()

"""How kiln loads a checkpoint of this trainer to evaluate it: the recipe's
``[trainer] evaluate = "kiln_hf_trainer.evaluate:load_for_evaluation"``.

kiln's evaluation (``python -m kiln_trainer.evaluate``, the pipeline's evaluate stage, ``kiln
evaluate``) verifies the checkpoint, consolidates its shards and checks its weights and tokenizer,
then calls this with what it verified (a ``kiln_trainer.evaluate.EvalCheckpoint``). It returns the
trained model as a function from token ids to logits; kiln scores the eval split with it, bits per
byte, exactly as it scores its own GPT.
"""

from __future__ import annotations

import torch

from kiln_hf_trainer.model import trained_model
from kiln_trainer.evaluate import EvalCheckpoint, Logits


def load_for_evaluation(checkpoint: EvalCheckpoint) -> Logits:
    """The checkpoint's ``LlamaForCausalLM`` (its weights loaded strictly, eval mode) on the device, as
    ``input_ids (batch, T) -> logits (batch, T, vocab)``."""
    model = trained_model(checkpoint.recipe, checkpoint.tokenizer, checkpoint.state).to(checkpoint.device)

    def logits(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids).logits

    return logits

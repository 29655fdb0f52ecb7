"""The served model: text in, generated text out, as an MLflow ``python_function`` model.

    model = mlflow.pyfunc.load_model("models:/kiln-stdlib-lm@champion")
    model.predict(["def main("])                                   # -> ["<generated text>"]
    model.predict(["def main("], params={"max_new_tokens": 32, "temperature": 0.8, "seed": 7})

    mlflow models serve -m models:/kiln-stdlib-lm@champion --env-manager local -p 5001
    curl -d '{"inputs": ["def main("], "params": {"max_new_tokens": 32}}' \\
        -H 'Content-Type: application/json' 127.0.0.1:5001/invocations
    # -> {"predictions": ["<generated text>"]}

It generates from the version's Hugging Face model folder (``artifacts/hf_model``, written by
``kiln_trainer.hf``): ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load it, weights
from ``model.safetensors``, so loading runs no pickled code. The model itself is logged as code
(``kiln_trainer/mlflow_model.py``, MLflow's models from code), never as a pickled instance.
Generation stops after ``max_new_tokens`` tokens or at the end-of-document token; ``temperature`` 0
(the default) is greedy, so a prompt always gets the same text; above 0 the draw is seeded by
``seed`` alone, never by the global RNG. The context slides: only the last ``n_positions`` tokens
are fed, as kiln's own ``GPT.generate_ids`` does.
"""

from __future__ import annotations

from typing import Any

from mlflow.pyfunc import PythonModel

HF_ARTIFACT = "hf_model"
"""The model folder's key among the logged model's artifacts (and its folder under ``artifacts/``)."""
PARAMS: dict[str, tuple[str, Any]] = {
    "max_new_tokens": ("long", 64),
    "temperature": ("double", 0.0),
    "seed": ("long", 0),
}
"""The request parameters a served model takes: name -> (MLflow type, default)."""


def signature() -> Any:
    """Text in (one string per prompt), text out, and the generation parameters."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # unnamed: a request is a plain list of prompts
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec(name, kind, default) for name, (kind, default) in PARAMS.items()]),
    )


class TextGenerator(PythonModel):
    """A Hugging Face causal LM folder and its tokenizer behind ``predict(prompts) -> texts``."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.artifacts[HF_ARTIFACT]
        self.model = AutoModelForCausalLM.from_pretrained(folder)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.eos_id = int(self.model.generation_config.eos_token_id)
        self.block_size = int(self.model.config.max_position_embeddings)

    # No type hint on model_input: MLflow would infer a signature from it and drop the parameters.
    def predict(self, context, model_input, params=None):
        prompts = _prompts(model_input)
        given = params or {}
        unknown = sorted(set(given) - set(PARAMS))
        if unknown:
            raise ValueError(f"unknown generation parameter(s) {unknown}; known: {sorted(PARAMS)}")
        options = {name: given.get(name, default) for name, (_kind, default) in PARAMS.items()}
        max_new_tokens, temperature, seed = int(options["max_new_tokens"]), float(options["temperature"]), int(options["seed"])
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) and temperature ({temperature}) must be >= 0")
        return [self.generate(p, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed) for p in prompts]

    def generate(self, prompt: str, *, max_new_tokens: int, temperature: float, seed: int) -> str:
        import torch
        import torch.nn.functional as F

        eos = self.eos_id
        # An empty prompt starts a new document: the end-of-document token is what precedes one.
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] or [eos]
        gen = torch.Generator().manual_seed(seed)
        idx = torch.tensor([ids], dtype=torch.long)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = self.model(idx[:, -self.block_size:], use_cache=False).logits
                last = logits[:, -1, :].float()
                if temperature == 0:
                    nxt = torch.argmax(last, dim=-1, keepdim=True)
                else:
                    nxt = torch.multinomial(F.softmax(last / temperature, dim=-1), num_samples=1, generator=gen)
                token = int(nxt.item())
                if token == eos:
                    break
                out.append(token)
                idx = torch.cat([idx, nxt], dim=1)
        # Rows past the tokenizer's vocabulary (a padded embedding) are no text.
        known = len(self.tokenizer)
        return str(self.tokenizer.decode([i for i in out if i < known], skip_special_tokens=True))


def _prompts(model_input: Any) -> list[str]:
    """The prompts of a request: a list of strings, or a frame with one string column."""
    if hasattr(model_input, "columns"):  # MLflow hands a schema-checked pandas frame
        if len(model_input.columns) != 1:
            raise ValueError(f"expected one column of prompts, got {list(model_input.columns)}")
        model_input = model_input.iloc[:, 0].tolist()
    if isinstance(model_input, str) or not all(isinstance(p, str) for p in model_input):
        raise ValueError("expected a list of prompt strings")
    return list(model_input)

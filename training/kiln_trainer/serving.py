"""The served model: text in, generated text out, as an MLflow ``python_function`` model.

    model = mlflow.pyfunc.load_model("models:/kiln-stdlib-lm@champion")
    model.predict(["def main("])                                   # -> ["<generated text>"]
    model.predict(["def main("], params={"max_new_tokens": 32, "temperature": 0.8, "seed": 7})

    mlflow models serve -m models:/kiln-stdlib-lm@champion --env-manager local -p 5001
    curl -d '{"inputs": ["def main("], "params": {"max_new_tokens": 32}}' \\
        -H 'Content-Type: application/json' 127.0.0.1:5001/invocations
    # -> {"predictions": ["<generated text>"]}

What a model version holds (``kiln_trainer.export.log_model`` writes it): the weights alone
(``weights.pt``, a state dict: loaded with ``weights_only=True``, so loading runs no pickled
code), the model's shape (``model_config.json``), the tokenizer artifact the checkpoint was
trained with (``tokenizer.json``, its sha256 in the metadata) and this module's package as code,
so the model loads where kiln is not installed. Generation stops after ``max_new_tokens`` tokens
or at the end-of-document token; ``temperature`` 0 (the default) is greedy, so a prompt always
gets the same text; above 0 the draw is seeded by ``seed`` alone, never by the global RNG.
"""

from __future__ import annotations

from typing import Any

from mlflow.pyfunc import PythonModel

WEIGHTS_FILE = "weights.pt"
MODEL_CONFIG_FILE = "model_config.json"
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
    """A kiln GPT and its tokenizer behind ``predict(prompts) -> texts``."""

    def load_context(self, context: Any) -> None:
        import torch

        from kiln_trainer.config import ModelConfig
        from kiln_trainer.jsonfile import read_own_json
        from kiln_trainer.model import GPT
        from kiln_trainer.tokenizer import load_tokenizer

        artifacts = context.artifacts
        config = read_own_json(artifacts["model_config"])
        self.model = GPT(ModelConfig(**config))
        self.model.load_state_dict(torch.load(artifacts["weights"], map_location="cpu", weights_only=True))
        self.model.eval()
        self.tokenizer = load_tokenizer(artifacts["tokenizer"])

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

        eos = self.tokenizer.eos_id
        # An empty prompt starts a new document: the end-of-document token is what precedes one.
        ids = self.tokenizer.encode_batch([prompt])[0] or [eos]
        gen = torch.Generator().manual_seed(seed)
        block = self.model.block_size
        idx = torch.tensor([ids], dtype=torch.long)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self.model(idx[:, -block:])
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
        return self.tokenizer.decode(out)


def _prompts(model_input: Any) -> list[str]:
    """The prompts of a request: a list of strings, or a frame with one string column."""
    if hasattr(model_input, "columns"):  # MLflow hands a schema-checked pandas frame
        if len(model_input.columns) != 1:
            raise ValueError(f"expected one column of prompts, got {list(model_input.columns)}")
        model_input = model_input.iloc[:, 0].tolist()
    if isinstance(model_input, str) or not all(isinstance(p, str) for p in model_input):
        raise ValueError("expected a list of prompt strings")
    return list(model_input)

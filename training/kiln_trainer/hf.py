"""kiln's GPT as a Hugging Face model folder that ``transformers`` loads, written from a committed checkpoint.

::

    from kiln_trainer.hf import write_checkpoint_folder
    write_checkpoint_folder("RUN/checkpoints/step-00000300", "out/")      # verified, then written

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/")                  # a GPT2LMHeadModel
    tokenizer = AutoTokenizer.from_pretrained("out/")                     # the ids kiln trained on

The folder holds ``config.json`` (a ``GPT2Config``), ``model.safetensors``, ``generation_config.json``
and the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``). Weights are safetensors
only: plain tensors and a JSON header, so loading them runs no pickled code.

kiln's GPT is GPT-2's architecture (nanoGPT), with these differences the mapping settles:

- kiln's projections are ``nn.Linear`` (weight ``[out, in]``); GPT-2's are ``Conv1D`` (weight
  ``[in, out]``): ``c_attn``, ``c_proj`` and ``c_fc`` weights are transposed.
- ``model.bias = false`` leaves kiln's Linear and LayerNorm layers without a bias; GPT-2 always has
  one: those biases are written as zeros, which computes the same function.
- GELU: kiln uses ``nn.GELU()`` (the exact erf form), GPT-2's default is the tanh approximation
  (``gelu_new``): the config names ``gelu``. LayerNorm eps is 1e-5 on both sides; the output head
  is tied to the token embedding on both sides (``lm_head.weight`` is not stored).

The tokenizer is the checkpoint's own. A BPE artifact (Hugging Face ``tokenizers`` JSON) is copied
byte for byte. kiln's byte tokenizer (id = UTF-8 byte value, EOS 256) has no ``tokenizers`` form,
so one is built here: a BPE model without merges over GPT-2's byte-to-character alphabet, each byte
at its own value, EOS an added special token at 256 (``split_special_tokens`` keeps text that spells
the EOS token as bytes, as kiln does). ``test_hf`` holds that both give kiln's ids.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln_trainer.checkpoint_manifest import atomic_write_bytes
from kiln_trainer.errors import TrainerError
from kiln_trainer.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG_FILE",
    "CheckpointFolder",
    "FOLDER_FILES",
    "GENERATION_CONFIG_FILE",
    "SAFETENSORS_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_JSON",
    "byte_tokenizer_json",
    "gpt2_config",
    "gpt2_state_dict",
    "kiln_state_dict",
    "write_checkpoint_folder",
    "write_folder",
]

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
FOLDER_FILES = (CONFIG_FILE, SAFETENSORS_FILE, GENERATION_CONFIG_FILE, TOKENIZER_JSON, TOKENIZER_CONFIG_FILE)
"""Every file of a model folder; nothing else is written."""

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
"""kiln's ``nn.Linear`` weights that GPT-2 holds as ``Conv1D`` (transposed)."""
_TIED = "lm_head.weight"


def _bias_shapes(model_config: Mapping[str, Any]) -> dict[str, int]:
    """Every bias GPT-2 has, by parameter name, and its length."""
    n_embd = int(model_config["n_embd"])
    shapes = {"transformer.ln_f.bias": n_embd}
    for layer in range(int(model_config["n_layer"])):
        prefix = f"transformer.h.{layer}."
        shapes.update({prefix + "ln_1.bias": n_embd, prefix + "attn.c_attn.bias": 3 * n_embd,
                       prefix + "attn.c_proj.bias": n_embd, prefix + "ln_2.bias": n_embd,
                       prefix + "mlp.c_fc.bias": 4 * n_embd, prefix + "mlp.c_proj.bias": n_embd})
    return shapes


def gpt2_state_dict(state: Mapping[str, torch.Tensor], model_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """kiln's GPT state dict as ``GPT2LMHeadModel``'s (same parameter names): Linear weights
    transposed, absent biases as zeros, the tied head left out. Raises ``TrainerError`` for a state
    that is not this config's GPT."""
    import torch

    expected = _kiln_names(model_config)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise TrainerError(f"not the state of a kiln GPT of this shape: missing {missing[:5]}, unexpected {extra[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == _TIED:
            continue
        tensor = tensor.detach().to("cpu")
        out[name] = (tensor.t() if name.endswith(_TRANSPOSED) else tensor).contiguous()
    dtype = state["transformer.wte.weight"].dtype
    for name, size in _bias_shapes(model_config).items():
        if name not in out:
            out[name] = torch.zeros(size, dtype=dtype)
    return out


def kiln_state_dict(tensors: Mapping[str, torch.Tensor], model_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of ``gpt2_state_dict``: a folder's tensors back as kiln's GPT state dict (whose
    ``weights_sha256`` is the checkpoint's). Raises ``TrainerError`` where a bias kiln's GPT does not
    have is not zero: such weights compute another function than any kiln GPT."""
    out = {}
    for name in _kiln_names(model_config):
        source = "transformer.wte.weight" if name == _TIED else name
        if source not in tensors:
            raise TrainerError(f"the folder's weights have no {source!r}")
        tensor = tensors[source]
        out[name] = (tensor.t() if name.endswith(_TRANSPOSED) else tensor).contiguous()
    if not model_config["bias"]:
        for name in _bias_shapes(model_config):
            if name in tensors and bool(tensors[name].any()):
                raise TrainerError(f"{name} is not zero, and the model has bias = false")
    return out


def _kiln_names(model_config: Mapping[str, Any]) -> set[str]:
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", _TIED}
    for layer in range(int(model_config["n_layer"])):
        prefix = f"transformer.h.{layer}."
        names |= {prefix + part + ".weight" for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc",
                                                          "mlp.c_proj")}
    if model_config["bias"]:
        names |= set(_bias_shapes(model_config))
    return names


def gpt2_config(model_config: Mapping[str, Any], tokenizer: Tokenizer, dtype: str = "float32") -> dict[str, Any]:
    """``config.json``: the ``GPT2Config`` that computes what kiln's GPT of ``model_config`` does, as
    ``GPT2Config(...).to_dict()`` writes it. Built here rather than by ``transformers``: importing
    it takes seconds, and every registration writes this file in a fresh task process.
    ``test_hf`` holds that this is ``GPT2Config``'s own dictionary for the pinned ``transformers``."""
    n_embd = int(model_config["n_embd"])
    dropout = float(model_config["dropout"])
    config: dict[str, Any] = {
        **_GPT2_DEFAULTS,
        "vocab_size": int(model_config["vocab_size"]),
        "n_positions": int(model_config["block_size"]),
        "n_embd": n_embd,
        "n_layer": int(model_config["n_layer"]),
        "n_head": int(model_config["n_head"]),
        "n_inner": 4 * n_embd,
        "activation_function": "gelu",  # nn.GELU(): the exact erf form, not GPT-2's tanh approximation
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        # kiln trains with model.dropout; what is served and fine-tuned from here starts with the same
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "bos_token_id": tokenizer.eos_id,  # a document starts after an EOS: kiln has no other BOS
        "eos_token_id": tokenizer.eos_id,
        "tie_word_embeddings": True,
        "architectures": ["GPT2LMHeadModel"],
        "dtype": dtype,
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        config["transformers_version"] = importlib.metadata.version("transformers")
    return config


_GPT2_DEFAULTS: dict[str, Any] = {
    "_name_or_path": "", "add_cross_attention": False, "chunk_size_feed_forward": 0,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "model_type": "gpt2", "output_attentions": False,
    "output_hidden_states": False, "pad_token_id": None, "problem_type": None, "reorder_and_upcast_attn": False,
    "return_dict": True, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
    "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True, "use_cache": True,
}
"""The rest of ``GPT2Config().to_dict()`` (transformers 5.25): its defaults, which kiln's GPT does not change."""


def generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """``generation_config.json``: stop at kiln's EOS (the end of a document); greedy unless a caller samples."""
    return {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.eos_id,
            "do_sample": False}


def byte_tokenizer_json(eos_id: int, eos_token: str = EOS_TOKEN) -> bytes:
    """kiln's byte tokenizer as a ``tokenizers`` JSON: id = UTF-8 byte value; EOS ``eos_id`` (256: an
    added special token named ``eos_token``; 0..255: that byte)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    alphabet = _bytes_to_unicode()
    tok = RustTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eos_id == 256:
        tok.add_special_tokens([AddedToken(eos_token, special=True, normalized=False)])
    return tok.to_str().encode("utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (what ``pre_tokenizers.ByteLevel`` maps each byte to): printable
    bytes map to themselves, the others to characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_files(tokenizer: Tokenizer, block_size: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer`` (``PreTrainedTokenizerFast``)."""
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                                "clean_up_tokenization_spaces": False}
    if isinstance(tokenizer, ByteTokenizer):
        artifact = byte_tokenizer_json(tokenizer.eos_id)
        eos_token = EOS_TOKEN if tokenizer.eos_id == 256 else _bytes_to_unicode()[tokenizer.eos_id]
        # kiln encodes every character of the text as its bytes, the EOS token's spelling included
        settings["split_special_tokens"] = True
    elif isinstance(tokenizer, HFTokenizer):
        artifact, eos_token = tokenizer.to_bytes(), tokenizer.eos_token
    else:
        raise TrainerError(f"no Hugging Face form for a {type(tokenizer).__name__}")
    settings.update(eos_token=eos_token, bos_token=eos_token, pad_token=eos_token)
    return {TOKENIZER_JSON: artifact, TOKENIZER_CONFIG_FILE: _json(settings)}


def write_folder(
    out_dir: str | Path, state: Mapping[str, torch.Tensor], model_config: Mapping[str, Any], tokenizer: Tokenizer,
) -> Path:
    """Write the model folder of kiln GPT weights ``state`` into ``out_dir`` (created; existing
    folder files are replaced). The same inputs give the same bytes. (The safetensors header holds
    ``format`` alone: safetensors writes its metadata in hash-map order, so a second key would make
    the bytes differ from one write to the next; the lineage is the registered version's.)"""
    from safetensors.torch import save

    if tokenizer.vocab_size > int(model_config["vocab_size"]):
        raise TrainerError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's "
                           f"{model_config['vocab_size']}")
    tensors = gpt2_state_dict(state, model_config)
    dtype = str(tensors["transformer.wte.weight"].dtype).removeprefix("torch.")
    block_size = int(model_config["block_size"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        CONFIG_FILE: _json(gpt2_config(model_config, tokenizer, dtype)),
        GENERATION_CONFIG_FILE: _json(generation_config(tokenizer)),
        **tokenizer_files(tokenizer, block_size),
        SAFETENSORS_FILE: save(dict(sorted(tensors.items())), metadata={"format": "pt"}),
    }
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
    return out


@dataclass(frozen=True, slots=True)
class CheckpointFolder:
    """A model folder written from a committed checkpoint, and what it was written from."""

    path: Path
    manifest: dict[str, Any]
    """The checkpoint's verified manifest."""
    tokenizer: Tokenizer
    """The tokenizer the checkpoint was trained with."""


def write_checkpoint_folder(step_dir: str | Path, out_dir: str | Path) -> CheckpointFolder:
    """Verify the committed checkpoint ``step_dir`` (every file's sha256, the weights' hash) and write
    its model folder into ``out_dir``, with the checkpoint's tokenizer."""
    from kiln_trainer.evaluate import load_checkpoint_model
    from kiln_trainer.export import checkpoint_tokenizer

    step_dir = Path(step_dir)
    model, manifest = load_checkpoint_model(step_dir, device="cpu")
    tokenizer = checkpoint_tokenizer(step_dir, manifest)
    path = write_folder(out_dir, model.state_dict(), model.config, tokenizer)
    return CheckpointFolder(path=path, manifest=manifest, tokenizer=tokenizer)


def _json(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")

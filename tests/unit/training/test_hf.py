"""kiln's GPT as a Hugging Face folder: transformers loads it, its logits are kiln's, its tokenizer gives kiln's ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln_trainer.errors import TrainerError

from trainer_fixtures import stdlib_sources, write_checkpoints

pytestmark = pytest.mark.slow  # imports transformers (seconds)

TEXTS = [
    "def main():\n    return 1\n",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀, RTL עברית",
    "a<|endoftext|>b",  # the EOS token spelled out inside a document
    "Ā ġ Ċ",  # characters of GPT-2's byte alphabet, as text
    "\x00\x01\x7f\t\r\n  trailing  ",
    "",
    " leading space and\u00a0nbsp\u200b zero width",
    "x" * 3000,
]


def _gpt(bias: bool, vocab_size: int = 300) -> Any:
    import torch

    from kiln_trainer.config import ModelConfig
    from kiln_trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, bias=bias, vocab_size=vocab_size))
    with torch.no_grad():  # every parameter away from its init and large enough that a wrong detail shows
        gen = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.normal_(0.0, 0.3, generator=gen)
    return model.eval()


def _logits_gap(kiln_model: Any, hf_model: Any) -> float:
    import torch

    idx = torch.randint(0, kiln_model.config["vocab_size"], (3, kiln_model.block_size),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = kiln_model(idx)[0]
        theirs = hf_model(idx).logits
    assert ours.dtype == theirs.dtype == torch.float32
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize(("eos_id", "dropout", "dtype"), [(256, 0.0, "float32"), (0, 0.1, "bfloat16")])
def test_config_json_is_gpt2configs_own_dictionary(eos_id: int, dropout: float, dtype: str) -> None:
    """kiln writes config.json without importing transformers (seconds in every registration task);
    this holds it to what GPT2Config itself writes for the pinned transformers, key for key."""
    import importlib.metadata

    from transformers import GPT2Config

    from kiln_trainer.hf import gpt2_config
    from kiln_trainer.tokenizer import ByteTokenizer

    model = {"vocab_size": 300, "block_size": 32, "n_embd": 16, "n_layer": 2, "n_head": 2, "dropout": dropout}
    ours = gpt2_config(model, ByteTokenizer(eos_id=eos_id), dtype)
    theirs = GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=2, n_head=2, n_inner=64,
                        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True,
                        architectures=["GPT2LMHeadModel"], dtype=dtype).to_dict()
    assert json.loads(json.dumps(ours)) == json.loads(json.dumps(theirs)), "config.json's content"
    assert ours["transformers_version"] == importlib.metadata.version("transformers")
    assert GPT2Config.from_dict(ours).to_dict() == theirs


@pytest.mark.parametrize("bias", [False, True], ids=["bias-false", "bias-true"])
def test_gpt2lmheadmodel_from_the_folder_gives_kilns_logits(tmp_path: Path, bias: bool) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from kiln_trainer.hf import FOLDER_FILES, write_folder
    from kiln_trainer.tokenizer import ByteTokenizer

    model = _gpt(bias)
    write_folder(tmp_path, model.state_dict(), model.config, ByteTokenizer())

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FOLDER_FILES)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, GPT2LMHeadModel) and not loaded.training
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr(), "the head stays tied"
    assert _logits_gap(model, loaded) <= 1e-5
    # The tolerance is tight enough to tell GELU's two forms apart: a wrong mapping detail fails here.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_new"}))
    assert _logits_gap(model, AutoModelForCausalLM.from_pretrained(tmp_path)) > 1e-5


def test_greedy_generate_of_transformers_continues_as_kilns_generate_ids(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_trainer.hf import write_folder
    from kiln_trainer.tokenizer import ByteTokenizer

    model = _gpt(bias=False, vocab_size=257)
    write_folder(tmp_path, model.state_dict(), model.config, ByteTokenizer())
    prompt = list(b"def main(")
    ours = model.generate_ids(prompt, max_new_tokens=12, temperature=0, stop_id=256)
    output = AutoModelForCausalLM.from_pretrained(tmp_path).generate(torch.tensor([prompt]), max_new_tokens=12)
    theirs = output[0, len(prompt):].tolist()
    assert 0 < len(ours) < 12 and theirs == [*ours, 256], "both stop at EOS (generation_config.json)"


@pytest.mark.parametrize("eos_id", [256, 0], ids=["eos-256", "eos-nul"])
def test_autotokenizer_gives_the_byte_tokenizers_ids(tmp_path: Path, eos_id: int) -> None:
    from transformers import AutoTokenizer

    from kiln_trainer.hf import write_folder
    from kiln_trainer.tokenizer import ByteTokenizer

    kiln = ByteTokenizer(eos_id=eos_id)
    model = _gpt(bias=False, vocab_size=kiln.vocab_size)
    write_folder(tmp_path, model.state_dict(), model.config, kiln)
    theirs = AutoTokenizer.from_pretrained(tmp_path)

    assert len(theirs) == kiln.vocab_size and theirs.eos_token_id == eos_id
    for text in TEXTS:
        ids = theirs(text)["input_ids"]  # add_special_tokens defaults to True: nothing is added
        assert ids == kiln.encode_batch([text])[0], text
        assert theirs.decode(ids) == text
        # kiln's decode drops the EOS (with eos_id 0, the NUL byte): so does theirs, skipping special tokens
        assert theirs.decode(ids, skip_special_tokens=True) == kiln.decode(ids)
    assert theirs.decode([*b"ab", eos_id, *b"c"], skip_special_tokens=True) == "abc" == kiln.decode([*b"ab", eos_id, *b"c"])


def test_autotokenizer_gives_the_bpe_tokenizers_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kiln_trainer.hf import TOKENIZER_JSON, write_folder
    from kiln_trainer.tokenizer import train_bpe

    docs = [text for _, text in stdlib_sources(60_000)] + TEXTS
    kiln = train_bpe(docs, vocab_size=400)
    model = _gpt(bias=False, vocab_size=kiln.vocab_size)
    write_folder(tmp_path, model.state_dict(), model.config, kiln)
    theirs = AutoTokenizer.from_pretrained(tmp_path)

    assert (tmp_path / TOKENIZER_JSON).read_bytes() == kiln.to_bytes(), "the trained artifact, byte for byte"
    assert len(theirs) == kiln.vocab_size and theirs.eos_token_id == kiln.eos_id == 0
    for text in [*TEXTS, *docs[:5]]:
        ids = theirs(text)["input_ids"]
        assert ids == kiln.encode_batch([text])[0], text[:80]
        assert theirs.decode(ids, skip_special_tokens=True) == kiln.decode(ids)


def test_the_folder_maps_back_to_the_checkpoints_weights_and_holds_no_pickle(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kiln_trainer.checkpoint import weights_sha256
    from kiln_trainer.hf import FOLDER_FILES, SAFETENSORS_FILE, kiln_state_dict, write_checkpoint_folder

    write_checkpoints(tmp_path / "run", [2])
    step_dir = tmp_path / "run" / "checkpoints" / "step-00000002"
    written = write_checkpoint_folder(step_dir, tmp_path / "a")
    again = write_checkpoint_folder(step_dir, tmp_path / "b")

    assert sorted(p.name for p in written.path.iterdir()) == sorted(FOLDER_FILES)
    for name in FOLDER_FILES:
        assert (written.path / name).read_bytes() == (again.path / name).read_bytes(), f"{name} is not reproducible"
    with safe_open(written.path / SAFETENSORS_FILE, framework="pt") as f:
        header = f.metadata()
    assert header == {"format": "pt"}
    tensors = load_file(written.path / SAFETENSORS_FILE)
    assert "lm_head.weight" not in tensors, "tied to the embedding, stored once"
    back = kiln_state_dict(tensors, written.manifest["recipe"]["model"])
    assert weights_sha256(back) == written.manifest["weights_sha256"]


def test_a_bpe_checkpoint_with_its_own_eos_token_gets_a_folder_whose_eos_is_that_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kiln_trainer.hf import write_checkpoint_folder
    from kiln_trainer.tokenizer import train_bpe

    bpe = train_bpe(["def main():\n    return 0\n"] * 20, vocab_size=270, eos_token="<eod>")
    write_checkpoints(tmp_path / "run", [1], tokenizer=bpe,
                      overrides=("tokenizer.kind=bpe", "tokenizer.vocab_size=270", "tokenizer.eos_token=<eod>"))
    written = write_checkpoint_folder(tmp_path / "run" / "checkpoints" / "step-00000001", tmp_path / "hf")

    assert written.tokenizer.eos_token == "<eod>" and written.tokenizer.eos_id == 0
    theirs = AutoTokenizer.from_pretrained(written.path)
    assert theirs.eos_token == "<eod>" and theirs.eos_token_id == 0
    assert json.loads((written.path / "generation_config.json").read_text())["eos_token_id"] == 0


def test_a_state_that_is_not_the_configs_gpt_is_refused() -> None:
    from kiln_trainer.hf import gpt2_state_dict, kiln_state_dict

    model = _gpt(bias=False)
    state = model.state_dict()
    with pytest.raises(TrainerError, match=r"missing \['transformer.h.1.attn.c_attn.weight'\]"):
        gpt2_state_dict({k: v for k, v in state.items() if k != "transformer.h.1.attn.c_attn.weight"}, model.config)
    with pytest.raises(TrainerError, match="unexpected"):
        gpt2_state_dict(state, {**model.config, "n_layer": 1})
    tensors = gpt2_state_dict(state, model.config)
    tensors["transformer.h.0.mlp.c_fc.bias"][3] = 0.5
    with pytest.raises(TrainerError, match=r"transformer.h.0.mlp.c_fc.bias is not zero, and the model has bias = false"):
        kiln_state_dict(tensors, model.config)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path: Path) -> None:
    from kiln_trainer.hf import write_folder
    from kiln_trainer.tokenizer import ByteTokenizer

    model = _gpt(bias=False, vocab_size=256)
    with pytest.raises(TrainerError, match="tokenizer vocabulary 257 exceeds the model's 256"):
        write_folder(tmp_path / "out", model.state_dict(), model.config, ByteTokenizer())
    assert not (tmp_path / "out").exists()

"""Which modules fsdp shards one by one when ``wrap`` is given no ``blocks=``
(``kiln_trainer.parallel.fsdp_blocks``): kiln's GPT's ``transformer.h``; for any other model the
outermost submodules of the classes its ``_no_split_modules`` names, as transformers and accelerate
auto-wrap a ``PreTrainedModel``; a ``TypeError`` naming the class otherwise. Then a real FSDP2 wrap
(one rank, gloo) of a tiny ``transformers.LlamaForCausalLM``: its decoder layers and the root, and a
checkpoint saved with the layers named explicitly resumes into the same model wrapped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln_trainer.parallel import fsdp_blocks

from trainer_fixtures import FIXTURE_MODEL, group_of_one


class Block(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.inner = inner


class BlockNorm(torch.nn.Module):
    """A class whose name starts with a listed one's: not a match (names are compared whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))


class Other(torch.nn.Module):
    def __init__(self, *children: torch.nn.Module) -> None:
        super().__init__()
        self.items = torch.nn.ModuleList(children)


class Tree(torch.nn.Module):
    """A model's shape with matches at several depths: a block at the top, blocks in a list inside
    another module, a block nested inside a block, an ``Extra`` inside a block, a near-miss name."""

    def __init__(self, no_split: Any) -> None:
        super().__init__()
        if no_split is not None:
            self._no_split_modules = no_split
        self.embed = torch.nn.Embedding(8, 4)
        self.first = Block()
        self.body = Other(Block(inner=Block()), BlockNorm(), Other(Block(inner=Other(Extra()))))
        self.last = Extra()


class Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


def _names(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[str]:
    where = {id(m): name for name, m in model.named_modules()}
    return [where[id(b)] for b in blocks]


def test_no_split_modules_selects_the_outermost_matches_in_module_order() -> None:
    model = Tree(["Block"])
    assert _names(model, fsdp_blocks(model)) == ["first", "body.items.0", "body.items.2.items.0"]
    # Two listed classes, one inside the other (Extra inside body.items.2.items.0): that block only;
    # a set, as transformers 5 keeps _no_split_modules, works as a list does.
    model = Tree({"Block", "Extra"})
    assert _names(model, fsdp_blocks(model)) == ["first", "body.items.0", "body.items.2.items.0", "last"]
    model = Tree(("Extra",))
    assert _names(model, fsdp_blocks(model)) == ["body.items.2.items.0.inner.items.0", "last"]


def test_the_root_itself_is_never_a_block() -> None:
    class Root(Block):
        _no_split_modules = ["Root", "Block"]

    model = Root(inner=Block())
    assert _names(model, fsdp_blocks(model)) == ["inner"]


def test_no_match_is_refused_naming_the_class_and_the_names_searched() -> None:
    with pytest.raises(TypeError, match=r"shard_model of a Tree: no submodule .*\['Missing', 'Other2'\].*blocks="):
        fsdp_blocks(Tree(["Other2", "Missing"]))


@pytest.mark.parametrize("no_split", [None, [], ()], ids=["absent", "empty-list", "empty-tuple"])
def test_a_model_without_no_split_modules_is_refused_as_before(no_split: Any) -> None:
    with pytest.raises(TypeError, match=r"shard_model of a Tree: name its blocks \(blocks=model.layers"):
        fsdp_blocks(Tree(no_split))


def test_kilns_gpt_shards_its_transformer_h() -> None:
    from kiln_trainer.config import ModelConfig
    from kiln_trainer.model import GPT

    gpt = GPT(ModelConfig(n_layer=3, n_head=1, n_embd=8, block_size=8, vocab_size=16))
    blocks = fsdp_blocks(gpt)
    assert len(blocks) == 3 and all(a is b for a, b in zip(blocks, gpt.transformer.h, strict=True))


# ------------------------------------------------------------------- a real FSDP2 wrap (one rank)


def _tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True, use_cache=False,
    ))


def _fsdp_recipe_env() -> tuple[Any, Any]:
    from kiln_trainer.config import load_recipe
    from kiln_trainer.distributed import DistEnv

    recipe = load_recipe(None, (*FIXTURE_MODEL, "parallel.strategy=fsdp"))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    return recipe, env


def _sharded(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


LAYERS_AND_ROOT = ["", "model.layers.0", "model.layers.1", "model.layers.2"]


@pytest.mark.slow  # imports transformers (seconds)
def test_a_llama_wrapped_without_blocks_shards_its_decoder_layers_and_the_root() -> None:
    from kiln_trainer.parallel import shard_model

    recipe, env = _fsdp_recipe_env()
    with group_of_one():
        model = _tiny_llama(0)
        shard_model(model, recipe, env)
        assert _sharded(model) == LAYERS_AND_ROOT
        # It trains: a forward and a backward through the sharded layers.
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        # Named blocks win over _no_split_modules.
        named = _tiny_llama(0)
        shard_model(named, recipe, env, blocks=[named.model.layers[1]])
        assert _sharded(named) == ["", "model.layers.1"]


@pytest.mark.slow  # imports transformers (seconds)
def test_a_checkpoint_of_explicit_blocks_resumes_into_a_wrap_without_them(tmp_path: Path) -> None:
    """The hf example names ``blocks=model.model.layers``; a trainer dropping the argument shards the
    same modules, and its checkpoint (keyed on parameter names, which FSDP2 keeps) resumes."""
    import json

    from kiln_trainer.checkpoint import CheckpointIdentity, _torch_save_bytes, capture_rng_state
    from kiln_trainer.parallel import shard_model
    from kiln_trainer.sharded_checkpoint import ShardedCheckpointWriter, load_model_and_optimizer
    from kiln_trainer.tokenizer import ByteTokenizer

    recipe, env = _fsdp_recipe_env()
    identity = CheckpointIdentity(world_size=1, recipe=recipe.to_dict(), recipe_sha256=recipe.sha256,
                                  snapshot_id="abc.dir", training_manifest_sha256="0" * 64,
                                  token_manifest_sha256="1" * 64, tokenizer=ByteTokenizer())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with group_of_one():
        saved = _tiny_llama(0)
        shard_model(saved, recipe, env, blocks=saved.model.layers)
        saved_opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
        saved(input_ids=ids, labels=ids).loss.backward()
        saved_opt.step()
        writer = ShardedCheckpointWriter(tmp_path, identity, keep_last=2, async_save=False, env=env)
        writer.save(step=1, model=saved, optimizer=saved_opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
            saved_opt, lambda i: 1.0), trainer_state={"step": 1}, rng_blobs=[_torch_save_bytes(capture_rng_state())])
        step_dir = writer.wait()
        writer.close()
        assert step_dir is not None

        resumed = _tiny_llama(1)  # other initial weights: all of them must come from the checkpoint
        shard_model(resumed, recipe, env)
        assert _sharded(resumed) == _sharded(saved) == LAYERS_AND_ROOT
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        load_model_and_optimizer(step_dir, json.loads((step_dir / "manifest.json").read_text()), resumed,
                                 resumed_opt, sharded=True)
        for (name, a), (_, b) in zip(saved.named_parameters(), resumed.named_parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor()), name
        # The next step is the same step: the optimizer's moments came back too.
        for model, opt in ((saved, saved_opt), (resumed, resumed_opt)):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        for (name, a), (_, b) in zip(saved.named_parameters(), resumed.named_parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor()), name

"""Recipe loading: precedence, validation naming the bad field, hashing, the shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln_trainer.config import Recipe, load_recipe, parse_override, recipe_sha256
from kiln_trainer.errors import RecipeError

from trainer_fixtures import RECIPES


def test_precedence_defaults_then_toml_then_overrides(tmp_path: Path) -> None:
    recipe_file = tmp_path / "r.toml"
    recipe_file.write_text("[model]\nn_layer = 3\nn_embd = 96\n[train]\nsteps = 50\n")
    recipe = load_recipe(recipe_file, ["train.steps=7", "optim.warmup_steps=2", "train.device=cpu"])
    assert recipe.model.n_layer == 3  # from TOML
    assert recipe.model.n_head == 4  # default
    assert recipe.train.steps == 7  # override beats TOML
    assert recipe.train.device == "cpu"  # bare string accepted
    assert recipe.optim.warmup_steps == 2


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model.n_embd=100", "model.n_head=3"], "model.n_embd"),
        (["model.dropout=1.5"], "model.dropout"),
        (["model.vocab_size=200"], "model.vocab_size"),
        (["model.vocab_size=1"], "model.vocab_size"),
        (["tokenizer.kind='wordpiece'"], "tokenizer.kind"),
        (["tokenizer.eos_id=300"], "tokenizer.eos_id"),
        (["tokenizer.vocab_size=300"], "tokenizer.vocab_size"),
        (["tokenizer.kind='bpe'"], "tokenizer.vocab_size"),
        (["tokenizer.kind='bpe'", "tokenizer.vocab_size=100"], "tokenizer.vocab_size"),
        (["tokenizer.kind='bpe'", "tokenizer.vocab_size=300", "tokenizer.eos_id=0"], "tokenizer.eos_id"),
        (["tokenizer.kind='file'"], "tokenizer.path"),
        (["tokenizer.path='/x.json'"], "tokenizer.path"),
        (["tokenizer.eos_token='</s>'"], "tokenizer.eos_token"),
        (["tokenizer.max_train_chars=10"], "tokenizer.max_train_chars"),
        (["tokenizer.kind='bpe'", "tokenizer.vocab_size=4096", "model.vocab_size=1024"], "model.vocab_size"),
        (["data.global_batch_size=12", "data.micro_batch_size=8"], "data.global_batch_size"),
        (["data.micro_batch_size=0"], "data.micro_batch_size"),
        (["data.window_shards=-1"], "data.window_shards"),
        (["data.prefetch_steps=0"], "data.prefetch_steps"),
        (["optim.min_lr=1.0"], "optim.min_lr"),
        (["train.device='tpu'"], "train.device"),
        (["train.steps=0"], "train.steps"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
        (["guard.spike_factor=0.5"], "guard.spike_factor"),
        (["train.steps='ten'"], "train.steps"),
        (["train.compile=1"], "train.compile"),
        (["train.steps=true"], "train.steps"),
        (["train.steps=5", "optim.warmup_steps=10"], "optim.warmup_steps"),
    ],
)
def test_invalid_field_is_named(overrides: list[str], named: str) -> None:
    with pytest.raises(RecipeError, match=named.replace(".", r"\.")):
        load_recipe(None, overrides)


def test_unknown_section_and_key_are_errors(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="model.n_layers"):
        load_recipe(None, ["model.n_layers=2"])
    with pytest.raises(RecipeError, match="modle"):
        load_recipe(None, ["modle.n_layer=2"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nn_layer = 2\n")
    with pytest.raises(RecipeError, match="invalid TOML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "missing.toml")
    with pytest.raises(RecipeError, match="section.key"):
        parse_override("steps=3")


def test_int_is_accepted_for_float_fields_and_normalised() -> None:
    recipe = load_recipe(None, ["optim.lr=1", "optim.min_lr=0"])
    assert isinstance(recipe.optim.lr, float) and recipe.optim.lr == 1.0
    # Normalising the type keeps the hash independent of how a number was written.
    assert recipe.sha256 == load_recipe(None, ["optim.lr=1.0", "optim.min_lr=0.0"]).sha256


def test_recipe_hash_is_stable_and_sensitive() -> None:
    a, b = load_recipe(None), Recipe()
    assert recipe_sha256(a) == recipe_sha256(b)
    assert len(a.sha256) == 64
    assert load_recipe(None, ["train.seed=1"]).sha256 != a.sha256
    assert Recipe.from_dict(a.to_dict()) == a


def test_config_is_frozen() -> None:
    recipe = Recipe()
    with pytest.raises(AttributeError):
        recipe.train.steps = 3  # type: ignore[misc]


def test_model_vocabulary_follows_the_tokenizer_and_a_smaller_one_names_both_fields(tmp_path: Path) -> None:
    assert load_recipe(None).model.vocab_size == 257  # byte, EOS 256 of its own
    assert load_recipe(None, ["tokenizer.eos_id=0"]).model.vocab_size == 256  # NUL separates documents
    assert load_recipe(None, ["tokenizer.kind=bpe", "tokenizer.vocab_size=4096"]).model.vocab_size == 4096
    assert load_recipe(None, ["model.vocab_size=320"]).model.vocab_size == 320  # padded
    # Written out and read back (a checkpoint's recipe), the resolved value is explicit and the hash the same.
    resolved = load_recipe(None)
    assert Recipe.from_dict(resolved.to_dict()).sha256 == resolved.sha256 == load_recipe(None, ["model.vocab_size=257"]).sha256
    named = r"model\.vocab_size = 256 is smaller .*\(tokenizer\.kind = 'byte', tokenizer\.eos_id = 256"
    with pytest.raises(RecipeError, match=named):
        load_recipe(None, ["model.vocab_size=256"])


def test_a_file_tokenizer_is_read_relative_to_the_recipe(tmp_path: Path) -> None:
    from kiln_trainer.tokenizer import train_bpe

    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 50, vocab_size=280)
    (tmp_path / "tok").mkdir()
    tok.save(tmp_path / "tok" / "tokenizer.json")
    recipe_file = tmp_path / "r.toml"
    recipe_file.write_text('[tokenizer]\nkind = "file"\npath = "tok/tokenizer.json"\n')
    recipe = load_recipe(recipe_file)
    assert recipe.model.vocab_size == tok.vocab_size
    assert recipe.tokenizer.resolved_path(recipe_file) == tmp_path / "tok" / "tokenizer.json"
    assert recipe.tokenizer.path == "tok/tokenizer.json"  # as written: the hash does not depend on the checkout
    with pytest.raises(RecipeError, match="tokenizer.path = 'nope.json'"):
        load_recipe(recipe_file, ["tokenizer.path='nope.json'"])


def test_batch_geometry_is_world_size_independent_and_refuses_what_does_not_divide() -> None:
    data = load_recipe(None, ["data.global_batch_size=16", "data.micro_batch_size=4"]).data
    assert [data.accum_steps(w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(RecipeError, match=r"data\.global_batch_size = 16 does not divide by world size x "
                                          r"data\.micro_batch_size = 8 x 4"):
        data.accum_steps(8)
    with pytest.raises(RecipeError, match="world size x data.micro_batch_size = 3 x 4"):
        data.accum_steps(3)


def test_resume_identity_ignores_only_how_the_same_batches_are_computed() -> None:
    from kiln_trainer.config import resume_identity

    base = load_recipe(None).to_dict()
    assert resume_identity(load_recipe(None, ["data.micro_batch_size=4", "data.prefetch_steps=5"]).to_dict()) == \
        resume_identity(base)
    for change in ("data.global_batch_size=16", "train.seed=1", "data.window_shards=2", "tokenizer.eos_id=0"):
        assert resume_identity(load_recipe(None, [change]).to_dict()) != resume_identity(base), change


@pytest.mark.parametrize("name", ["tiny.toml", "small.toml", "gpt2-small.toml", "production/small.toml",
                                  "production/small-fsdp.toml", "production/staging.toml"])
def test_shipped_recipes_load(name: str) -> None:
    recipe = load_recipe(RECIPES / name)
    assert recipe.tokenizer.kind == "byte" and recipe.model.vocab_size >= 257
    assert recipe.data.accum_steps(1) >= 1 and recipe.data.accum_steps(2) >= 1  # 1 and 2 ranks both divide


def test_production_small_is_pinned_to_small() -> None:
    assert load_recipe(RECIPES / "production" / "small.toml").sha256 == load_recipe(RECIPES / "small.toml").sha256


def test_the_staging_recipe_is_production_small_with_fewer_steps_and_checkpoints() -> None:
    """What a staging deployment (kiln's end-to-end tests) trains is the production model, batch and
    optimizer: only the length of the run and the checkpoint interval differ."""
    small, staging = (load_recipe(RECIPES / "production" / name).to_dict() for name in ("small.toml", "staging.toml"))
    assert (small["train"]["steps"], staging["train"]["steps"]) == (300, 60)
    assert (small["checkpoint"]["every_steps"], staging["checkpoint"]["every_steps"]) == (50, 20)
    for section in (small, staging):
        section["train"].pop("steps"), section["checkpoint"].pop("every_steps")
    assert staging == small


def test_the_llama_staging_recipe_is_tiny_llama_with_fewer_steps_and_checkpoints() -> None:
    """What the production-like test deployment trains (a team's own model: the HF worked example)
    is the sandbox's tiny-llama: the same trainer, model, batch and optimizer; only the run's length,
    its checkpoints and production's evaluation window differ."""
    tiny, staging = load_recipe(RECIPES / "tiny-llama.toml").to_dict(), load_recipe(
        RECIPES / "production" / "llama-staging.toml").to_dict()
    assert staging["trainer"]["train"] == "kiln_hf_trainer.train:main" and staging["parallel"]["strategy"] == "fsdp"
    assert (tiny["train"].pop("steps"), staging["train"].pop("steps")) == (400, 60)
    assert (tiny["checkpoint"], staging["checkpoint"]) == ({"every_steps": 100, "keep_last": 2, "async_save": True},
                                                          {"every_steps": 20, "keep_last": 3, "async_save": True})
    assert (tiny["eval"]["max_windows"], staging["eval"]["max_windows"]) == (64, 128)
    for section in (tiny, staging):
        section.pop("checkpoint"), section.pop("eval")
    assert staging == tiny


def test_the_production_fsdp_variant_differs_only_in_its_parallel_strategy() -> None:
    from kiln_trainer.config import resume_identity

    ddp, fsdp = (load_recipe(RECIPES / "production" / name).to_dict() for name in ("small.toml", "small-fsdp.toml"))
    assert fsdp["parallel"] == {"strategy": "fsdp", "reshard_after_forward": True}
    assert {k: v for k, v in fsdp.items() if k != "parallel"} == {k: v for k, v in ddp.items() if k != "parallel"}
    assert resume_identity(fsdp) == resume_identity(ddp)  # a run may move between them at a resume


def test_parallel_strategy_is_checked_and_a_checkpoint_from_before_the_section_still_matches() -> None:
    from kiln_trainer.config import resume_identity

    with pytest.raises(RecipeError, match=r"parallel\.strategy = 'zero3': must be one of ddp, fsdp"):
        load_recipe(None, ["parallel.strategy=zero3"])
    with pytest.raises(RecipeError, match=r"parallel\.reshard_after_forward: expected bool"):
        load_recipe(None, ["parallel.reshard_after_forward=1"])
    now = load_recipe(None).to_dict()
    before = {k: v for k, v in now.items() if k != "parallel"}  # a recipe recorded before [parallel] existed
    assert resume_identity(before) == resume_identity(now)


def test_gpt2_small_is_a_gpu_bf16_gpt2_shape() -> None:
    r = load_recipe(RECIPES / "gpt2-small.toml")
    assert (r.model.n_layer, r.model.n_head, r.model.n_embd, r.model.block_size) == (12, 12, 768, 1024)
    assert (r.train.device, r.train.dtype) == ("cuda", "bfloat16")
    assert r.data.global_batch_size * r.model.block_size == 524_288 and r.data.accum_steps(8) == 4

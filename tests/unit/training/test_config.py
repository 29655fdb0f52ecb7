"""Recipe loading: precedence, validation naming the bad field, hashing, the shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
from kiln_trainer.config import Recipe, load_recipe, parse_override, recipe_sha256
from kiln_trainer.errors import ConfigError
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
        (["model.vocab_size=512"], "model.vocab_size"),
        (["data.doc_separator=300"], "data.doc_separator"),
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
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_recipe(None, overrides)


def test_unknown_section_and_key_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.n_layers"):
        load_recipe(None, ["model.n_layers=2"])
    with pytest.raises(ConfigError, match="modle"):
        load_recipe(None, ["modle.n_layer=2"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nn_layer = 2\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="section.key"):
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


@pytest.mark.parametrize("name", ["tiny.toml", "small.toml", "gpt2-small.toml", "production/small.toml"])
def test_shipped_recipes_load(name: str) -> None:
    recipe = load_recipe(RECIPES / name)
    assert recipe.model.vocab_size == 256


def test_production_small_is_pinned_to_small() -> None:
    assert load_recipe(RECIPES / "production" / "small.toml").sha256 == load_recipe(RECIPES / "small.toml").sha256


def test_gpt2_small_is_a_gpu_bf16_gpt2_shape() -> None:
    r = load_recipe(RECIPES / "gpt2-small.toml")
    assert (r.model.n_layer, r.model.n_head, r.model.n_embd, r.model.block_size) == (12, 12, 768, 1024)
    assert (r.train.device, r.train.dtype) == ("cuda", "bfloat16")

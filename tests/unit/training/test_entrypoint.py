"""``kiln_trainer.contract.entrypoint``: a recipe names its trainer; kiln resolves, validates and records
it without starting a worker. The user's packages here are real packages written under tmp_path and put
on ``sys.path`` (one with a ``.dist-info``, as pip installs it)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kiln_trainer.config import Recipe, load_recipe
from kiln_trainer.contract.entrypoint import (
    KILN_TRAINER,
    EntrypointError,
    TrainerArgs,
    TrainerSpec,
    _packages_distributions,
    parse_trainer,
    parse_trainer_args,
    read_recipe_trainer,
    trainer_record,
    validate_entrypoint,
    validate_trainer,
)
from kiln_trainer.errors import RecipeError

RECIPES = Path(__file__).resolve().parents[3] / "training" / "recipes"


def write_package(root: Path, name: str, modules: dict[str, str], *, version: str | None = None) -> Path:
    """A package ``name`` under ``root`` with ``modules`` (``{"train": source}``); with ``version``, the
    ``.dist-info`` pip would write for distribution ``name`` (METADATA, RECORD, top_level.txt)."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for module, source in modules.items():
        (package / f"{module}.py").write_text(textwrap.dedent(source))
    if version is not None:
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{name}\n")
        record = [f"{name}/__init__.py,,", *(f"{name}/{m}.py,," for m in modules), f"{info.name}/METADATA,,"]
        (info / "RECORD").write_text("\n".join(record) + "\n")
    return package


@pytest.fixture
def user_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` for the test's packages (and a fresh view of installed distributions)."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    _packages_distributions.cache_clear()
    yield root
    _packages_distributions.cache_clear()
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        del sys.modules[name]


GOOD = """
    def main(argv):
        return 0

    def two(argv, extra):
        return 0

    answer = 42

    class Runner:
        @staticmethod
        def run(argv: list[str]) -> int:
            return 0
"""


# -- the spec ---------------------------------------------------------------------------------------


def test_a_recipe_names_kiln_unless_it_says_otherwise():
    assert parse_trainer(None) == parse_trainer("kiln") == parse_trainer({"train": "kiln"}) == TrainerSpec()
    assert TrainerSpec().is_kiln and TrainerSpec().entrypoints() == {"train": "kiln_trainer.train:main"}
    spec = parse_trainer({"train": "my_lm.train:main", "export": "my_lm.export:main"})
    assert spec.entrypoints() == {"train": "my_lm.train:main", "export": "my_lm.export:main"}
    assert spec.to_recipe_value() == {"train": "my_lm.train:main", "export": "my_lm.export:main"}
    assert parse_trainer("my_lm.train:Runner.run").to_recipe_value() == "my_lm.train:Runner.run"


@pytest.mark.parametrize(("value", "says"), [
    ("my_lm.train", "not an entry point"),
    ("my_lm.train:", "not an entry point"),
    ("my-lm.train:main", "not an entry point"),
    ("", "not an entry point"),
    (3, "must be a string or a table"),
    ({"evaluate": "a.b:c"}, "no train entry point"),
    ({"train": "a.b:c", "serve": "a.b:d"}, "unknown key(s) ['serve']"),
    ({"train": "kiln", "evaluate": "a.b:c"}, "only with a trainer of your own"),
    ({"train": 1}, "trainer.train = 1: must be a string"),
])
def test_a_malformed_spec_is_refused_naming_it(value, says):
    with pytest.raises(EntrypointError, match="trainer") as caught:
        parse_trainer(value)
    assert says in str(caught.value)
    assert isinstance(caught.value, RecipeError)  # kiln maps it like any recipe fault: no retry


# -- the recipe -------------------------------------------------------------------------------------


def test_kiln_recipes_keep_their_hash_and_name_no_trainer(tmp_path: Path):
    tiny = RECIPES / "tiny.toml"
    named = tmp_path / "named.toml"
    named.write_text('trainer = "kiln"\n' + tiny.read_text())
    assert load_recipe(named).sha256 == load_recipe(tiny).sha256
    assert "trainer" not in load_recipe(tiny).to_dict()
    assert load_recipe(tiny).trainer.is_kiln


def test_a_user_trainer_recipe_keeps_its_model_table_and_kilns_sections(tmp_path: Path):
    recipe_file = tmp_path / "hf.toml"
    recipe_file.write_text(textwrap.dedent("""
        [trainer]
        train = "my_lm.train:main"
        evaluate = "my_lm.evaluate:main"
        [model]
        architecture = "LlamaForCausalLM"
        hidden_size = 64
        rope = {theta = 10000.0}
        block_size = 32
        [train]
        steps = 12
        [checkpoint]
        every_steps = 4
    """))
    recipe = load_recipe(recipe_file)
    assert recipe.trainer == TrainerSpec(train="my_lm.train:main", evaluate="my_lm.evaluate:main")
    assert recipe.user_model == {"architecture": "LlamaForCausalLM", "hidden_size": 64, "rope": {"theta": 10000.0}}
    assert (recipe.model.block_size, recipe.model.vocab_size, recipe.train.steps) == (32, 257, 12)
    wire = recipe.to_dict()
    assert wire["trainer"] == {"train": "my_lm.train:main", "evaluate": "my_lm.evaluate:main"}
    assert wire["model"] == {"architecture": "LlamaForCausalLM", "hidden_size": 64, "rope": {"theta": 10000.0},
                             "block_size": 32, "vocab_size": 257}
    assert Recipe.from_dict(wire).sha256 == recipe.sha256
    assert load_recipe(recipe_file, ["model.hidden_size=65"]).sha256 != recipe.sha256
    # the same recipe under kiln's trainer: [model] is kiln's schema again
    with pytest.raises(RecipeError, match="architecture"):
        load_recipe(recipe_file, ["trainer.train=kiln", "trainer.evaluate=''"])


def test_overrides_name_the_trainer_as_the_worker_reads_it(tmp_path: Path):
    recipe_file = tmp_path / "r.toml"
    recipe_file.write_text('trainer = "my_lm.train:main"\n[train]\nsteps = 5\n')
    for overrides in ([], ["trainer.train='other.mod:go'"], ["trainer.export=my_lm.export:main"]):
        assert load_recipe(recipe_file, overrides).trainer == read_recipe_trainer(recipe_file, overrides)
    assert read_recipe_trainer(recipe_file, ["trainer.train='other.mod:go'"]).train == "other.mod:go"
    assert read_recipe_trainer(RECIPES / "tiny.toml").is_kiln
    recipe_file.write_text('trainer = "my_lm.train"\n')
    with pytest.raises(EntrypointError, match=rf"recipe file {recipe_file}: trainer.train = 'my_lm.train'"):
        read_recipe_trainer(recipe_file)
    with pytest.raises(RecipeError, match="not found"):
        read_recipe_trainer(tmp_path / "missing.toml")


# -- validation: the module is imported, no worker starts ---------------------------------------------


def test_a_good_entrypoint_resolves_to_its_function(user_path: Path):
    write_package(user_path, "userpkg_good", {"train": GOOD})
    assert validate_entrypoint("userpkg_good.train:main")(["--x"]) == 0
    assert validate_entrypoint("userpkg_good.train:Runner.run")([]) == 0
    roles = validate_trainer(TrainerSpec(train="userpkg_good.train:main", export="userpkg_good.train:Runner.run"))
    assert set(roles) == {"train", "export"}
    assert validate_trainer(TrainerSpec()) == {}  # kiln's: found, not imported (that would import torch)


@pytest.mark.parametrize(("spec", "says"), [
    ("userpkg_nope.train:main", "no module named 'userpkg_nope'"),
    ("userpkg_bad.missing:main", "no module named 'userpkg_bad.missing'"),
    ("userpkg_bad.broken:main", "importing userpkg_bad.broken failed: ZeroDivisionError: division by zero"),
    ("userpkg_bad.needs:main", "importing userpkg_bad.needs failed: No module named 'not_installed_anywhere'"),
    ("userpkg_bad.train:nothing", "module userpkg_bad.train has no attribute 'nothing'"),
    ("userpkg_bad.train:answer", "userpkg_bad.train.answer is not callable (a int)"),
    ("userpkg_bad.train:two", "cannot be called as main(argv)"),
    ("kiln_trainer.train:main", "kiln's own package"),
    ("kiln.launchers.worker:main", "kiln's own package"),
])
def test_a_bad_entrypoint_is_refused_naming_the_spec_and_what_is_wrong(user_path: Path, spec: str, says: str):
    write_package(user_path, "userpkg_bad", {
        "train": GOOD, "broken": "x = 1 / 0\n", "needs": "import not_installed_anywhere\n",
    })
    with pytest.raises(EntrypointError) as caught:
        validate_trainer(TrainerSpec(train=spec))
    assert f"trainer.train = {spec!r}" in str(caught.value) and says in str(caught.value)
    with pytest.raises(EntrypointError, match=r"trainer\.export = "):
        validate_trainer(TrainerSpec(train="userpkg_bad.train:main", export=spec))


def test_each_role_is_checked_against_how_kiln_calls_it(user_path: Path):
    write_package(user_path, "userpkg_roles", {"train": GOOD})
    roles = validate_trainer(TrainerSpec(train="userpkg_roles.train:main", evaluate="userpkg_roles.train:main",
                                         export="userpkg_roles.train:main"))
    assert set(roles) == {"train", "evaluate", "export"}
    with pytest.raises(EntrypointError, match=r"trainer\.evaluate = 'userpkg_roles\.train:two': cannot be called "
                                              r"as load\(checkpoint\)"):
        validate_trainer(TrainerSpec(train="userpkg_roles.train:main", evaluate="userpkg_roles.train:two"))
    with pytest.raises(EntrypointError, match=r"trainer\.export = 'userpkg_roles\.train:two': cannot be called "
                                              r"as main\(argv\)"):
        validate_trainer(TrainerSpec(train="userpkg_roles.train:main", export="userpkg_roles.train:two"))


def test_the_record_names_the_distribution_and_its_version(user_path: Path):
    write_package(user_path, "userpkg_dist", {"train": GOOD}, version="1.4.2")
    write_package(user_path, "userpkg_loose", {"train": GOOD})
    assert trainer_record(TrainerSpec(train="userpkg_dist.train:main", export="userpkg_dist.train:main")) == {
        "spec": "userpkg_dist.train:main", "distribution": "userpkg_dist", "version": "1.4.2",
        "export": "userpkg_dist.train:main"}
    assert trainer_record(TrainerSpec(train="userpkg_loose.train:main")) == {
        "spec": "userpkg_loose.train:main", "distribution": "", "version": ""}
    import importlib.metadata

    kiln = trainer_record(TrainerSpec())
    assert kiln == {"spec": KILN_TRAINER, "distribution": "kiln-trainer", "version": importlib.metadata.version("kiln-trainer")}


# -- the arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--manifest", "m.json", "--recipe", "r.toml", "--run-dir", "run"],
    ["--manifest=m.json", "--recipe", "r.toml", "--run-dir", "run", "--set", "train.steps=3", "--set", "a.b=c",
     "--max-steps", "7", "--sample-log"],
])
def test_the_contracts_parser_reads_argv_as_kilns_trainer_does(argv, monkeypatch: pytest.MonkeyPatch):
    from kiln_trainer.train import parse_args  # kiln's trainer: switch it to parse_trainer_args

    for sample_log in ("", "1"):
        monkeypatch.setenv("KILN_SAMPLE_LOG", sample_log)
        assert vars(parse_trainer_args(argv)) == vars(parse_args(argv))
    args = TrainerArgs.from_namespace(parse_trainer_args(argv))
    assert (args.manifest, args.recipe, args.run_dir) == (Path("m.json"), Path("r.toml"), Path("run"))


def test_a_missing_argument_exits_2_as_kilns_trainer_does():
    with pytest.raises(SystemExit) as caught:
        parse_trainer_args(["--manifest", "m.json"])
    assert caught.value.code == 2

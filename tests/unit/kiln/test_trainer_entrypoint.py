"""The trainer a recipe names, on kiln's side: refused before any worker starts when it does not resolve
(the launchers' check, ``kiln train``, the run's input check, production's rule), and called by kiln's
worker instead of kiln's own trainer. The user's trainers are real packages written under tmp_path."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.cli import main as kiln_main
from kiln.errors import ConfigError, PolicyError
from kiln.launchers import LaunchSpec, worker
from kiln.launchers.base import check_recipe
from kiln.policy import PRODUCTION, SANDBOX
from kiln.stages.inputs import check_run_trainer
from kiln_trainer.config import load_recipe
from kiln_trainer.contract import EXIT_FATAL, FATAL_SUBDIR, LAUNCH_SUBDIR
from kiln_trainer.contract.entrypoint import _packages_distributions

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "training" / "recipes" / "tiny.toml"

TRAIN = """
    import json, logging, os, sys
    from pathlib import Path

    log = logging.getLogger("usertrain")

    def main(argv):
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "called.json").write_text(json.dumps(argv))
        if os.environ.get("USERTRAIN_FAIL"):
            log.error("the user's diagnosis: bad data")
            return 2
        return 0

    def takes_nothing():
        return 0
"""


@pytest.fixture
def user_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``usertrain`` (a package with ``usertrain.train:main``) on sys.path; ``installed`` adds the
    ``.dist-info`` pip would write for version 2.0.1."""
    root = tmp_path / "site"
    (root / "usertrain").mkdir(parents=True)
    (root / "usertrain" / "__init__.py").write_text("")
    (root / "usertrain" / "train.py").write_text(textwrap.dedent(TRAIN))
    monkeypatch.syspath_prepend(str(root))
    _packages_distributions.cache_clear()

    def installed() -> None:
        info = root / "usertrain-2.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: usertrain\nVersion: 2.0.1\n")
        (info / "top_level.txt").write_text("usertrain\n")
        (info / "RECORD").write_text("usertrain/__init__.py,,\nusertrain/train.py,,\n")
        _packages_distributions.cache_clear()

    yield installed
    _packages_distributions.cache_clear()
    for name in [m for m in sys.modules if m.startswith("usertrain")]:
        del sys.modules[name]


def recipe_naming(tmp_path: Path, trainer: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(f"trainer = {json.dumps(trainer)}\n[model]\nblock_size = 64\n[train]\nsteps = 4\n")
    return path


def spec_for(tmp_path: Path, recipe: Path, overrides: tuple[str, ...] = ()) -> LaunchSpec:
    return LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json", recipe=recipe, run_key="t",
                      overrides=overrides)


@pytest.mark.parametrize(("trainer", "says"), [
    ("usertrain.nope:main", "no module named 'usertrain.nope'"),
    ("usertrain.train:missing", "has no attribute 'missing'"),
    ("usertrain.train:takes_nothing", "cannot be called as main(argv)"),
    ("kiln_trainer.train:main", "kiln's own package"),
    ("usertrain.train", "not an entry point"),
])
def test_the_launchers_refuse_a_bad_trainer_before_any_worker_naming_it(tmp_path, user_trainer, trainer, says):
    recipe = recipe_naming(tmp_path, trainer)
    with pytest.raises(ConfigError) as caught:
        check_recipe(spec_for(tmp_path, recipe))
    assert str(caught.value).startswith(f"recipe {recipe}: ") and repr(trainer) in str(caught.value)
    assert says in str(caught.value)
    assert not caught.value.retryable
    assert not (tmp_path / "run").exists()


def test_the_launchers_accept_kiln_and_a_good_user_trainer(tmp_path, user_trainer):
    check_recipe(spec_for(tmp_path, TINY))
    check_recipe(spec_for(tmp_path, recipe_naming(tmp_path, "usertrain.train:main")))
    with pytest.raises(ConfigError, match="trainer.train = 'usertrain.train:gone'"):  # an override is checked too
        check_recipe(spec_for(tmp_path, TINY, ("trainer.train='usertrain.train:gone'",)))


def test_kiln_train_refuses_a_bad_trainer_with_exit_2_before_any_agent(tmp_path, user_trainer, capsys):
    manifest = tmp_path / "m.json"
    manifest.write_text("{}")
    run_dir = tmp_path / "run"
    code = kiln_main(["train", "--recipe", str(TINY), "--manifest", str(manifest), "--run-dir", str(run_dir),
                      "--trainer", "usertrain.train:missing"])
    assert code == 2
    assert "trainer.train = 'usertrain.train:missing'" in capsys.readouterr().err
    assert not (run_dir / LAUNCH_SUBDIR).exists()  # no agent was started


def test_a_run_trainer_resolves_and_production_takes_only_an_installed_release(tmp_path, user_trainer):
    recipe = recipe_naming(tmp_path, "usertrain.train:main")
    trainer = load_recipe(recipe).trainer
    assert check_run_trainer(SANDBOX, recipe, trainer) == {"spec": "usertrain.train:main", "distribution": "",
                                                           "version": ""}
    with pytest.raises(PolicyError, match="'usertrain.train:main', which is not an installed distribution"):
        check_run_trainer(PRODUCTION, recipe, trainer)
    user_trainer()  # pip-installed: a release with a version
    assert check_run_trainer(PRODUCTION, recipe, trainer)["version"] == "2.0.1"
    assert check_run_trainer(PRODUCTION, TINY, load_recipe(TINY).trainer)["spec"] == "kiln"
    bad = recipe_naming(tmp_path, "usertrain.train:missing")
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        check_run_trainer(SANDBOX, bad, load_recipe(bad).trainer)


def test_the_worker_calls_the_recipes_entrypoint_with_the_trainers_argv(tmp_path, user_trainer):
    run_dir = tmp_path / "run"
    argv = ["--manifest", str(tmp_path / "m.json"), "--recipe", str(recipe_naming(tmp_path, "usertrain.train:main")),
            "--run-dir", str(run_dir), "--set", "train.seed=3"]
    assert worker.main(argv) == 0
    assert json.loads((run_dir / "called.json").read_text()) == argv
    assert not (run_dir / LAUNCH_SUBDIR).exists()


def test_the_worker_marks_a_user_trainers_exit_2_fatal(tmp_path, user_trainer, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("USERTRAIN_FAIL", "1")
    monkeypatch.setenv("RANK", "3")
    argv = ["--manifest", "m.json", "--recipe", str(recipe_naming(tmp_path, "usertrain.train:main")),
            "--run-dir", str(run_dir)]
    assert worker.main(argv) == EXIT_FATAL
    marker = json.loads((run_dir / LAUNCH_SUBDIR / FATAL_SUBDIR / "rank-3.json").read_text())
    assert marker["error"] == "the user's diagnosis: bad data"
    assert "[kiln fatal] rank 3: the user's diagnosis: bad data" in capsys.readouterr().err


def test_the_worker_refuses_a_spec_that_does_not_resolve_with_the_fatal_marker(tmp_path, user_trainer):
    run_dir = tmp_path / "run"
    argv = ["--manifest", "m.json", "--recipe", str(recipe_naming(tmp_path, "usertrain.train:missing")),
            "--run-dir", str(run_dir)]
    assert worker.main(argv) == EXIT_FATAL
    marker = json.loads((run_dir / LAUNCH_SUBDIR / FATAL_SUBDIR / "rank-0.json").read_text())
    assert "EntrypointError" in marker["error"] and "trainer.train = 'usertrain.train:missing'" in marker["error"]


def test_a_model_version_records_the_trainer_its_checkpoint_names():
    from kiln.registry.register import trainer_tags

    record = {"spec": "usertrain.train:main", "distribution": "usertrain", "version": "2.0.1"}
    assert trainer_tags({"trainer": record}) == {"kiln.trainer": "usertrain.train:main",
                                                 "kiln.trainer.distribution": "usertrain",
                                                 "kiln.trainer.version": "2.0.1"}
    # sealed before checkpoints named their trainer: kiln's, of a version nobody recorded
    assert trainer_tags({}) == {"kiln.trainer": "kiln", "kiln.trainer.distribution": "", "kiln.trainer.version": ""}


def test_the_sandbox_forms_recipe_with_a_bad_trainer_fails_the_runs_first_task(tmp_path, user_trainer):
    import dataclasses

    from kiln.stages.inputs import check_run_conf

    policy = dataclasses.replace(SANDBOX, recipes_dir=tmp_path)  # the form offers the recipes under it
    recipe = recipe_naming(tmp_path, "usertrain.train:missing")
    params = {"recipe": str(recipe), "max_steps": 4}
    with pytest.raises(ConfigError, match="trainer.train = 'usertrain.train:missing'") as caught:
        check_run_conf(policy, params, {"recipe", "max_steps"}, params)
    assert not caught.value.retryable
    recipe_naming(tmp_path, "usertrain.train:main")  # the same recipe file, naming a trainer that resolves
    check_run_conf(policy, params, {"recipe", "max_steps"}, params)

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.errors import PolicyError
from kiln.policy import PRODUCTION, PRODUCTION_MODEL, SANDBOX, GatePolicy, Policy, get_policy


def test_sandbox_can_never_write_a_production_name():
    with pytest.raises(PolicyError, match=PRODUCTION_MODEL):
        SANDBOX.check_model_write(PRODUCTION_MODEL)
    with pytest.raises(PolicyError):
        SANDBOX.check_model_write(PRODUCTION.candidate_model)
    SANDBOX.check_model_write(SANDBOX.candidate_model)


def test_a_sandbox_policy_that_lists_the_production_model_is_refused():
    with pytest.raises(PolicyError, match="sandbox policy may never write"):
        Policy(**{**{f: getattr(SANDBOX, f) for f in SANDBOX.__dataclass_fields__},
                  "writable_models": (SANDBOX.candidate_model, PRODUCTION_MODEL)})


def test_production_accepts_only_pinned_recipes():
    assert PRODUCTION.resolve_recipe(None).name == "small.toml"
    with pytest.raises(PolicyError, match="allows only recipes under"):
        PRODUCTION.resolve_recipe("tiny.toml")
    with pytest.raises(PolicyError, match="allows only recipes under"):
        SANDBOX.resolve_recipe("../../pyproject.toml")
    with pytest.raises(PolicyError, match="does not exist"):
        SANDBOX.resolve_recipe("nope.toml")


def test_gate_policy_names_the_bad_field():
    with pytest.raises(PolicyError, match="max_bits_per_byte"):
        GatePolicy(max_bits_per_byte=0, max_regression=0.1)
    with pytest.raises(PolicyError, match="max_regression"):
        GatePolicy(max_bits_per_byte=1, max_regression=-1)


def test_policies_differ_where_they_must():
    assert PRODUCTION.requires_approval and not SANDBOX.requires_approval
    assert PRODUCTION.priority_weight > SANDBOX.priority_weight
    assert PRODUCTION.pool != SANDBOX.pool
    assert PRODUCTION.max_quarantine_share < SANDBOX.max_quarantine_share
    assert PRODUCTION.pinned_inputs and not SANDBOX.pinned_inputs
    assert PRODUCTION.max_active_runs == 1
    assert SANDBOX.schedule_cron is None and not SANDBOX.schedule_on_corpus_asset
    assert get_policy("sandbox") is SANDBOX
    with pytest.raises(PolicyError, match="unknown policy"):
        get_policy("staging")


def test_doc_lists_the_coded_settings_and_where_each_run_time_override_is_read():
    from kiln.policy import SANDBOX

    assert "read at run time" not in SANDBOX.doc_md()
    doc = SANDBOX.doc_md([("kiln_sandbox_launcher", "where training runs", "`train`: log line `launcher in force: …`")])
    assert "| `launcher` | `local` |" in doc and "(as coded)" in doc
    assert ("| `kiln_sandbox_launcher` (or `AIRFLOW_VAR_KILN_SANDBOX_LAUNCHER`) | where training runs | "
            "`train`: log line `launcher in force: …` |") in doc
    assert "never when this file is parsed" in doc and "without retry" in doc


# ------------------------------------------------------------------ the reviewed production config


def _config(tmp_path, text: str):
    from kiln.policy import load_production_config

    path = tmp_path / "production.toml"
    path.write_text(text)
    return load_production_config(path)


GOOD = 'corpus = "acme-web"\ncontract = "stdlib-py@1"\nmodel = "acme-lm"\n'


def test_production_reads_corpus_contract_and_model_from_the_reviewed_file():
    import tomllib

    from kiln.policy import PRODUCTION_CONFIG, PRODUCTION_INPUTS

    shipped = tomllib.loads(PRODUCTION_CONFIG.read_text())
    assert (PRODUCTION.corpus, PRODUCTION.contract, PRODUCTION.target_model) == (
        shipped["corpus"], shipped["contract"], shipped["model"])
    assert PRODUCTION.candidate_model == f"{shipped['model']}.candidates" and shipped["model"] == PRODUCTION_MODEL
    assert PRODUCTION.config == PRODUCTION_INPUTS and PRODUCTION_INPUTS.source == "config/production.toml"
    assert "from the reviewed `config/production.toml`" in PRODUCTION.doc_md()
    from kiln.data.contracts import load_contract

    load_contract(PRODUCTION.contract)  # the shipped file names a contract that exists


def test_the_config_pins_production_s_recipe_and_a_deployment_points_at_its_own_file(tmp_path, monkeypatch):
    from kiln.policy import DEFAULT_PRODUCTION_RECIPE, PRODUCTION_CONFIG_ENV, build_production_policy, load_production_config

    assert PRODUCTION.default_recipe == DEFAULT_PRODUCTION_RECIPE == "production/small.toml"
    config = _config(tmp_path, GOOD + 'recipe = "production/staging.toml"\n')
    production = build_production_policy(config)
    assert production.default_recipe == "production/staging.toml"
    assert production.resolve_recipe(None).name == "staging.toml"
    assert config.values()["recipe"] == "production/staging.toml"  # recorded on every version it trains
    assert "recipe" not in _config(tmp_path, GOOD).values()  # the default records what it always did
    with pytest.raises(PolicyError, match="allows only recipes under"):
        production.resolve_recipe("tiny.toml")  # a run still cannot name another recipe
    monkeypatch.setenv(PRODUCTION_CONFIG_ENV, str(tmp_path / "production.toml"))
    assert load_production_config().source == str(tmp_path / "production.toml")
    monkeypatch.setenv(PRODUCTION_CONFIG_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(PolicyError, match="missing.toml: cannot read the production config"):
        load_production_config()
    monkeypatch.delenv(PRODUCTION_CONFIG_ENV)
    assert load_production_config().source == "config/production.toml"


def test_kiln_s_end_to_end_deployment_differs_from_the_shipped_config_only_in_its_recipe_and_schedules():
    import tomllib

    from kiln.policy import PRODUCTION_CONFIG, build_production_policy, load_production_config

    # tests/e2e deploys kiln's own model; tests/e2e_prodlike a team's own (the HF worked example).
    for folder, recipe in (("e2e", "production/staging.toml"), ("e2e_prodlike", "production/llama-staging.toml")):
        e2e_file = Path(__file__).parents[2] / folder / "production.toml"
        shipped, e2e = tomllib.loads(PRODUCTION_CONFIG.read_text()), tomllib.loads(e2e_file.read_text())
        assert e2e.pop("recipe") == recipe and e2e == shipped | {"schedule": "", "champion_watch_schedule": ""}
        config = load_production_config(e2e_file)
        assert config.recipe == recipe
        production = build_production_policy(config)  # nothing on the clock in the tests' deployments
        assert production.schedule_cron is None and production.champion_watch_cron is None
        assert production.schedule_on_corpus_asset and production.champion_watch_dag_id == "kiln_champion_watch"


def test_the_config_sets_when_production_retrains_and_when_the_champion_is_watched(tmp_path):
    from kiln.policy import build_production_policy

    assert (PRODUCTION.schedule_cron, PRODUCTION.champion_watch_cron) == ("0 3 * * 1", "30 5 * * *")
    assert "schedule" not in _config(tmp_path, GOOD).values()  # the defaults record what they always did
    config = _config(tmp_path, GOOD + 'schedule = "0 4 * * 2"\nchampion_watch_schedule = ""\n')
    production = build_production_policy(config)
    assert (production.schedule_cron, production.champion_watch_cron) == ("0 4 * * 2", None)
    assert config.values()["schedule"] == "0 4 * * 2" and config.values()["champion_watch_schedule"] == ""
    with pytest.raises(PolicyError, match="champion_watch_cron needs champion_watch_dag_id"):
        Policy(**{**{f: getattr(production, f) for f in production.__dataclass_fields__},
                  "champion_watch_dag_id": None, "champion_watch_cron": "30 5 * * *"})


def test_another_config_moves_production_and_the_sandbox_still_cannot_write_its_names(tmp_path):
    from kiln.policy import build_production_policy, build_sandbox_policy

    config = _config(tmp_path, GOOD)
    production, sandbox = build_production_policy(config), build_sandbox_policy(config)
    assert (production.corpus, production.target_model, production.candidate_model) == (
        "acme-web", "acme-lm", "acme-lm.candidates")
    assert sandbox.writable_models == ("sandbox.acme-lm",) and sandbox.corpus == "acme-web"
    for name in production.writable_models:
        with pytest.raises(PolicyError, match="may not write"):
            sandbox.check_model_write(name)
    with pytest.raises(PolicyError, match="sandbox policy may never write a name outside sandbox"):
        Policy(**{**{f: getattr(sandbox, f) for f in sandbox.__dataclass_fields__},
                  "writable_models": (sandbox.candidate_model, "acme-lm")})
    with pytest.raises(PolicyError, match="never write a name in the sandbox's namespace"):
        Policy(**{**{f: getattr(production, f) for f in production.__dataclass_fields__},
                  "writable_models": (*production.writable_models, "sandbox.acme-lm")})


@pytest.mark.parametrize("text,message", [
    (GOOD.replace('"acme-lm"', '"sandbox.acme-lm"'), "production.toml: model 'sandbox.acme-lm' is in the sandbox's namespace"),
    (GOOD.replace('"acme-lm"', '"Sandbox.X"'), "is in the sandbox's namespace"),
    (GOOD.replace('"stdlib-py@1"', '"stdlib-py"'), "production.toml: contract 'stdlib-py' must pin a version"),
    (GOOD.replace('"acme-web"', '"../etc"'), "production.toml: corpus '../etc' is not a corpus name"),
    (GOOD.replace('"acme-lm"', '"a b"'), "production.toml: model 'a b' is not a registered-model name"),
    (GOOD + 'recipe = "tiny.toml"\n', "production.toml: recipe 'tiny.toml' is not one of the reviewed production "
                                       "recipes under training/recipes/production/ (production/llama-staging.toml, "
                                       "production/small-fsdp.toml, "),
    (GOOD + 'recipe = "production/../tiny.toml"\n', "recipe 'production/../tiny.toml' is not one of the reviewed"),
    (GOOD + 'recipe = "production/none.toml"\n', "recipe 'production/none.toml' is not one of the reviewed"),
    (GOOD + 'recipe = "/etc/passwd"\n', "recipe '/etc/passwd' is not one of the reviewed"),
    (GOOD + "recipe = 3\n", "production.toml: recipe must be a string, got 3"),
    (GOOD + 'recipes = "production/small.toml"\n', "production.toml: unknown key(s) recipes; the file sets corpus, "
                                                   "contract, model (or model and a [mixture] table) and "
                                                   "optionally recipe, schedule, "
                                                   "champion_watch_schedule"),
    (GOOD + 'schedule = "0 3 * *"\n', "production.toml: schedule '0 3 * *' is not a cron expression of five fields"),
    (GOOD + 'schedule = "@weekly"\n', "production.toml: schedule '@weekly' is not a cron expression of five fields"),
    (GOOD + 'champion_watch_schedule = "61 5 * * *"\n', "champion_watch_schedule '61 5 * * *' is not a cron"),
    (GOOD + "schedule = 3\n", "production.toml: schedule must be a string, got 3"),
    ('corpus = "acme-web"\nmodel = "acme-lm"\n', "production.toml: missing key(s) contract"),
    (GOOD + 'model = "again"\n', "production.toml: not valid TOML: Cannot overwrite a value (at line 4"),
    (GOOD.replace('"acme-lm"', "7"), "production.toml: model must be a string, got 7"),
])
def test_a_bad_production_config_is_refused_naming_the_file_and_the_key_or_line(tmp_path, text, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        _config(tmp_path, text)


# ------------------------------------------------------------------ production's mixture
MIXED = """model = "acme-lm"

[mixture]
description = "code and prose"

[[mixture.sources]]
name = "code"
corpus = "stdlib-py"
contract = "stdlib-py@1"
weight = 0.7

[[mixture.sources]]
name = "prose"
corpus = "prose"
contract = "prose-wrapped@1"
weight = 0.3
max_quarantine_share = 0.4
"""


def test_production_trains_the_mixture_its_reviewed_file_declares(tmp_path):
    """A ``[mixture]`` table instead of corpus and contract: every run of the production policy trains
    it (a run's ``mixture`` parameter is refused), any source's announcement starts one, and what a
    version records of the config changes when a weight or a contract does."""
    import json

    from kiln.airflow.dagfactory import corpus_asset, policy_assets
    from kiln.errors import ConfigError
    from kiln.policy import build_production_policy, build_sandbox_policy
    from kiln.stages.mixture import run_mixture

    config = _config(tmp_path, MIXED)
    production = build_production_policy(config)
    mixture = production.mixture
    assert mixture is not None and mixture.name == "production" and "[mixture]" in mixture.origin
    assert [(s.name, s.corpus, s.contract, s.weight) for s in mixture.sources] == [
        ("code", "stdlib-py", "stdlib-py@1", 0.7), ("prose", "prose", "prose-wrapped@1", 0.3)]
    assert mixture.sources[1].max_quarantine_share == 0.4
    # What reads one corpus (the sandbox form's default) reads the first source's.
    assert (config.corpus, config.contract) == ("stdlib-py", "stdlib-py@1")
    sandbox = build_sandbox_policy(config)
    assert sandbox.mixture is None and sandbox.corpus == "stdlib-py"
    assert run_mixture(production, {}) is mixture and run_mixture(production, {"mixture": None}) is mixture
    with pytest.raises(ConfigError, match="production runs take no 'mixture' parameter: their inputs are pinned"):
        run_mixture(production, {"mixture": "code-and-prose"})
    assert run_mixture(sandbox, {}) is None
    # Any source's announcement starts a run: AssetAny, not a list (which would wait for all of them).
    assets = policy_assets(production)
    assert not isinstance(assets, list)
    assert list(assets.objects) == [corpus_asset("stdlib-py"), corpus_asset("prose")]
    assert policy_assets(PRODUCTION) == [corpus_asset(PRODUCTION.corpus)]
    # Recorded on every version: the sources as declared, so an edited weight is a changed config.
    values = config.values()
    assert set(values) == {"mixture", "model"}
    assert [s["weight"] for s in json.loads(values["mixture"])] == [0.7, 0.3]
    reweighted = _config(tmp_path, MIXED.replace("weight = 0.7", "weight = 0.6"))
    assert reweighted.values() != values and reweighted.sha256 != config.sha256
    summary = production.summary()
    assert summary["corpus"] is None and summary["contract"] is None
    assert summary["mixture"] == "code: stdlib-py under stdlib-py@1 x0.7, prose: prose under prose-wrapped@1 x0.3"
    assert "prose: prose under prose-wrapped@1 x0.3" in production.doc_md()


@pytest.mark.parametrize("text,message", [
    ('corpus = "stdlib-py"\n' + MIXED, "production.toml: corpus beside a [mixture] table: production trains one corpus "
                                        "(corpus, contract) or a mixture"),
    ('contract = "stdlib-py@1"\n' + MIXED, "production.toml: contract beside a [mixture] table"),
    (MIXED.replace('contract = "prose-wrapped@1"\n', ""),
     "production.toml: mixture.sources[1] ('prose'): contract None must pin a version"),
    (MIXED.replace('"prose-wrapped@1"', '"prose-wrapped"'),
     "production.toml [mixture]): sources[1] ('prose').contract = 'prose-wrapped': must be NAME@VERSION"),
    (MIXED.replace("weight = 0.3", "weight = -1"), "production.toml [mixture]): sources[1]"),
    (MIXED.replace('"prose-wrapped@1"', '"no-such@1"'), "production.toml [mixture]): sources[1]"),
    (MIXED.replace('model = "acme-lm"\n', ""), "production.toml: missing key(s) model"),
    ('model = "acme-lm"\nmixture = "code-and-prose"\n', "production.toml [mixture]): must be a table, got str"),
])
def test_a_bad_production_mixture_is_refused_naming_the_file_and_the_field(tmp_path, text, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        _config(tmp_path, text)


def test_the_shipped_config_s_commented_mixture_is_one_production_accepts(tmp_path):
    """Uncommented, with corpus and contract removed as it says, the example loads."""
    from kiln.policy import PRODUCTION_CONFIG

    lines = PRODUCTION_CONFIG.read_text().splitlines()
    start = lines.index("# [mixture]")
    kept = [ln for ln in lines[:start] if not ln.startswith(("corpus =", "contract ="))]
    config = _config(tmp_path, "\n".join(kept + [ln.removeprefix("# ") for ln in lines[start:]]) + "\n")
    assert config.mixture is not None and [s.name for s in config.mixture.sources] == ["code", "docs"]
    assert config.model == PRODUCTION_MODEL

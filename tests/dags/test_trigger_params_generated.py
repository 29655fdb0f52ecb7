"""Generated trigger confs (issue 16, "the class, not the instances"): whatever a user sends as a
run's conf from the UI form or the REST API, the run is refused with an error that names the bad
key, or it trains on exactly what the conf asked for. Never another exception, never a silent default.

Each conf goes through what a real trigger goes through, in order:

1. the api-server: the serialized DAG's params, ``deep_merge(conf).validate()``
   (``ParamValidationError`` naming the param);
2. the ``snapshot`` task, the run's first: ``kiln.stages.check_run_conf`` (``ConfigError`` naming
   unknown keys, or the keys whose values do not make a valid recipe);
3. the ``train`` task: ``kiln.stages.train_inputs`` and the recipe the launcher checks
   (``load_recipe`` with the overrides) and the ``LaunchSpec`` it builds.

The counts tried are in docs/reliability.md ("Generated bad input").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kiln.errors import ConfigError, PolicyError
from kiln.policy import POLICIES, RECIPES_DIR
from kiln.stages import check_run_conf, train_inputs

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
POLICY_DAGS = {p.dag_id: p for p in POLICIES.values()}

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=80),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=8)


RECIPE_NAMES = sorted(str(p.relative_to(RECIPES_DIR)) for p in RECIPES_DIR.rglob("*.toml"))
ESCAPES = ["../../etc/passwd.toml", "production/../tiny.toml", "tiny", "TINY.toml", "", ".", "..", "stdlib-py/../x",
           "Bad Name!", "a" * 65, "-x", "x\n", "x\x00"]
NEAR_MISSES: dict[str, st.SearchStrategy[Any]] = {
    # Values close to what the form takes: the edges of its ranges, its choices misspelt or escaping
    # their folder, and the right value in the wrong JSON type.
    "nodes": st.one_of(st.integers(min_value=-1, max_value=4), st.sampled_from([1.0, 2.5, "2", True, None])),
    "max_steps": st.one_of(st.none(), st.integers(min_value=-1, max_value=40), st.integers(min_value=4990, max_value=5010),
                           st.sampled_from([100.0, "100", False])),
    "seed": st.one_of(st.integers(min_value=-2, max_value=2**31 + 2), st.sampled_from([10**30, 7.0, "7", None])),
    "recipe": st.one_of(st.sampled_from(RECIPE_NAMES), st.sampled_from(ESCAPES)),
    "corpus": st.one_of(st.sampled_from(["stdlib-py", "web.text_2", "x" * 64]), st.sampled_from(ESCAPES)),
    "reason": st.one_of(st.text(max_size=210), st.sampled_from(["x" * 200, "x" * 201, 7, None])),
}


def _confs(form_keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Half near the form (its own keys, values at its edges), half anything JSON can carry."""
    near_form = st.fixed_dictionaries({}, optional={k: NEAR_MISSES.get(k, json_values) for k in form_keys})
    keys = st.one_of(st.sampled_from(form_keys), st.sampled_from(["max_step", "Recipe", "nodes ", "", "steps",
                                                                  "train.steps", "__class__"]),
                     st.text(max_size=12))
    anything = st.dictionaries(keys, json_values, max_size=6)
    return st.one_of(near_form, anything)


@pytest.fixture(scope="module")
def served_dags():
    """The DAGs as the api-server sees them: serialized, then deserialized."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    bag = DagBag(dag_folder=str(DAGS), known_pools={p.pool for p in POLICIES.values()} | {"default_pool"})
    return {dag_id: DagSerialization.from_dict(DagSerialization.to_dict(bag.dags[dag_id])) for dag_id in POLICY_DAGS}


TRIED: dict[str, int] = {}


@pytest.mark.parametrize("dag_id", sorted(POLICY_DAGS))
def test_every_conf_is_refused_by_name_or_trains_on_what_it_asked(served_dags, dag_id):
    from airflow.sdk.exceptions import ParamValidationError

    from kiln.launchers import LaunchSpec
    from kiln_trainer.config import load_recipe
    from kiln_trainer.errors import RecipeError

    policy, dag = POLICY_DAGS[dag_id], served_dags[dag_id]
    form_keys = sorted(dag.params.keys())
    outcomes = {"refused by the form": 0, "refused by kiln": 0, "trains": 0}

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_confs(form_keys))
    @example({})
    @example({"max_step": 10})
    @example({"nodes": True})
    @example({"recipe": "production/../tiny.toml"})
    @example({"seed": 2**31 - 1, "max_steps": 5000})
    @example({"max_steps": 1})  # below the recipe's warm-up: found by this test, refused in the first task
    def check(conf: dict[str, Any]) -> None:
        conf = json.loads(json.dumps(conf))  # what survives the REST API's JSON body
        try:
            resolved = dag.params.deep_merge(conf).validate()
        except ParamValidationError as exc:
            bad = [k for k in conf if f"param {k}:" in str(exc)]
            assert bad, f"the form's refusal names no key of {conf!r}: {exc}"
            outcomes["refused by the form"] += 1
            return
        try:
            check_run_conf(policy, conf, set(dag.params.keys()), resolved)
        except ConfigError as exc:
            unknown = sorted(set(conf) - set(form_keys))
            named = unknown or [k for k in conf if repr(k) in str(exc)]
            assert named and all(repr(k) in str(exc) or k in str(exc) for k in named), (conf, str(exc))
            outcomes["refused by kiln"] += 1
            return
        assert set(conf) <= set(form_keys)
        try:
            recipe, nodes, overrides = train_inputs(policy, resolved)
        except PolicyError as exc:  # the form's enum allows only the policy's recipes: never expected
            raise AssertionError(f"the form let {conf!r} through, the policy refused it: {exc}") from exc
        assert recipe.is_file() and policy.recipes_dir.resolve() in recipe.parents
        try:
            resolved_recipe = load_recipe(recipe, overrides)
        except RecipeError as exc:
            raise AssertionError(f"the form let {conf!r} through, the recipe refused it: {exc}") from exc
        spec = LaunchSpec(run_dir=Path("/nonexistent/run"), manifest=Path("/nonexistent/m.json"), recipe=recipe,
                          run_key="generated", nodes=nodes, overrides=tuple(overrides))
        # Trains on what was asked: nothing dropped, nothing replaced by a default in disguise.
        if "max_steps" in conf and conf["max_steps"] is not None:
            assert resolved_recipe.train.steps == conf["max_steps"]
        if "seed" in conf:
            assert resolved_recipe.train.seed == conf["seed"]
        if "nodes" in conf:
            assert spec.nodes == conf["nodes"]
        if "recipe" in conf:
            assert recipe == (RECIPES_DIR / conf["recipe"]).resolve()
        outcomes["trains"] += 1

    check()
    TRIED[dag_id] = sum(outcomes.values())
    print(f"{dag_id}: {outcomes}")
    # The strategy reaches every outcome the form allows (production's form takes only a reason).
    assert outcomes["refused by the form"] > 0 and outcomes["refused by kiln"] > 0 and outcomes["trains"] > 0, outcomes


def test_a_corpus_name_the_form_accepts_stays_inside_the_corpus_root(served_dags):
    """The sandbox form's corpus pattern is the only guard between a conf and a path under the
    corpus root: whatever it accepts names a folder directly inside it."""
    from airflow.sdk.exceptions import ParamValidationError

    dag = served_dags[POLICIES["sandbox"].dag_id]
    root = Path("/srv/kiln/corpora")

    @settings(max_examples=500, deadline=None)
    @given(st.one_of(st.text(max_size=70), st.from_regex(r"[a-z0-9.][a-z0-9_./-]{0,66}", fullmatch=True)))
    @example("..")
    @example("a/../..")
    @example("a..")
    def check(name: str) -> None:
        try:
            corpus = dag.params.deep_merge({"corpus": name}).validate()["corpus"]
        except ParamValidationError:
            return
        assert (root / corpus).resolve().parent == root, name

    check()

"""What a run asks for: its conf checked in its first task, the contract its shards are validated
with, and the training inputs its params make."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, PolicyError
from kiln.policy import Policy
from kiln.refs import SnapshotRef

log = logging.getLogger("kiln.stages")

CONTRACT_PARAM = "contract"
"""The run parameter naming the contract (sandbox form); ``""`` or absent: the corpus' own."""


def check_run_conf(policy: Policy, conf: dict[str, Any], allowed: set[str], params: dict[str, Any] | None = None) -> None:
    """Refuse, in the run's first task, a run configuration that could not train.

    Airflow validates the values of known params but accepts unknown keys; a typo (``max_step``)
    or an attempt to override a pinned input (``recipe`` on production) must not pass silently.
    With ``params`` (the form's values, as Airflow resolved them) the recipe they ask for is
    resolved too: values the form allows one by one may still not make a recipe (``max_steps``
    below the recipe's warm-up), and that is refused here rather than after validation.
    """
    unknown = sorted(set(conf or {}) - allowed)
    if unknown:
        raise ConfigError(
            f"{policy.dag_id} does not take run parameter(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed)) or 'none'}"
        )
    if params is not None:
        recipe, _nodes, overrides = train_inputs(policy, params)
        asked = {k: conf[k] for k in sorted(conf or {}) if k in TRAIN_PARAMS}
        try:
            resolved = load_run_recipe(recipe, overrides)
        except ConfigError as exc:
            raise ConfigError(f"{policy.dag_id}: run parameters {asked or 'as defaulted'} do not make a valid "
                              f"recipe: {exc}") from exc
        check_run_trainer(policy, recipe, resolved.trainer)


TRAIN_PARAMS = ("recipe", "nodes", "seed", "max_steps", "strategy")
"""The run parameters ``train_inputs`` reads."""


def train_inputs(policy: Policy, params: dict[str, Any]) -> tuple[Path, int, list[str]]:
    """What a run's params (the DAG's form, validated by Airflow) ask training for: the recipe (one
    the policy allows, else ``PolicyError``), the node count and the recipe overrides."""
    recipe = policy.resolve_recipe(params.get("recipe"))
    nodes = int(params.get("nodes") or policy.nodes)
    overrides = []
    if params.get("seed") is not None:
        overrides.append(f"train.seed={int(params['seed'])}")
    if params.get("max_steps") is not None:
        overrides.append(f"train.steps={int(params['max_steps'])}")
    if params.get("strategy") is not None:
        overrides.append(f"parallel.strategy={str(params['strategy'])!r}")
    return recipe, nodes, overrides


def load_run_recipe(recipe: Path, overrides: list[str]):  # -> kiln_trainer.config.Recipe
    """The recipe with a run's overrides, as the trainer will resolve it; ``ConfigError`` naming the
    field the trainer would refuse."""
    from kiln_trainer.config import load_recipe
    from kiln_trainer.contract import RecipeError

    try:
        return load_recipe(recipe, overrides)
    except RecipeError as exc:
        raise ConfigError(f"recipe {recipe} with {overrides or 'no overrides'}: {exc}") from exc


def check_run_trainer(policy: Policy, recipe: Path, trainer: Any) -> dict[str, str]:  # trainer: TrainerSpec
    """Refuse, before any worker starts, a trainer the recipe names that does not resolve
    (``ConfigError`` naming the recipe and the spec: no such module or function, not a function of
    ``argv``, inside kiln's source tree), and on a pinned policy (production) one that is not kiln's
    and not an installed distribution with a version (``PolicyError``): a production version must
    record which release of the trainer made it. Returns the trainer's record (``trainer_record``)."""
    from kiln_trainer.contract import RecipeError
    from kiln_trainer.contract.entrypoint import trainer_record, validate_trainer

    try:
        validate_trainer(trainer)
    except RecipeError as exc:
        raise ConfigError(f"recipe {recipe}: {exc}") from exc
    record = trainer_record(trainer)
    if policy.pinned_inputs and not trainer.is_kiln and not (record["distribution"] and record["version"]):
        raise PolicyError(f"policy {policy.name!r}: recipe {recipe} names trainer {trainer.train!r}, which is not "
                          "an installed distribution with a version; production trains kiln's trainer or an "
                          "installed release of yours (pip install it where the workers run)")
    return record


def run_policy(policy: Policy, params: dict[str, Any], snapshot: SnapshotRef) -> Policy:
    """``policy`` with the contract this run validates with (``kiln.data.corpora.run_contract``):
    the run's ``contract`` parameter, else the contract the corpus' ``corpus.json`` names — read from
    kiln's pinned copy of ``snapshot``, so every task of the run finds the same — else the policy's.
    A pinned policy (production) keeps its reviewed contract and refuses a corpus made for another
    family. ``ConfigError`` for a contract that does not fit the corpus, ``ContractError`` for one
    that does not exist: both before any shard is read."""
    from kiln.data.contracts import load_contract
    from kiln.data.corpora import read_metadata, run_contract
    from kiln.stages.records import recorded_snapshot

    metadata = read_metadata(recorded_snapshot(snapshot.id).path)
    contract = run_contract(params.get(CONTRACT_PARAM), metadata, policy.contract, corpus=snapshot.corpus,
                            pinned=policy.pinned_inputs)
    load_contract(contract)
    if contract != policy.contract:
        log.info("contract in force: %s (%s)", contract,
                 "asked for by the run" if params.get(CONTRACT_PARAM) else f"named by corpus {snapshot.corpus}'s corpus.json")
        return replace(policy, contract=contract)
    return policy

"""The ``kiln_reproduce`` DAG: ``kiln reproduce`` from the Airflow form, by hand, in sandbox capacity.

Loaded by the dag-processor's ``DagBag`` as the other DAGs are (tests/dags/test_dag_integrity.py). The form
is checked twice, as the command checks its arguments: by Airflow against each Param's schema when a run is
triggered, and in the run's first task (``request``) by ``kiln.cli.reproduce.resolve_request``. The task
bodies run here with the context Airflow would hand them (``get_current_context``: the real DAG, the conf,
the params as Airflow resolves them from the form); the re-derivation itself, against a real MLflow server,
is the end-to-end test's.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, ParamValidationError

from kiln.airflow import dagfactory
from kiln.errors import PolicyError
from kiln.policy import POLICIES, PRODUCTION, SANDBOX
from kiln.provenance.attestation import NOT_ON_VERSION
from kiln.provenance.reproduce import REPRODUCE_DAG_ID

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS), known_pools={p.pool for p in POLICIES.values()} | {"default_pool"})
    assert bag.import_errors == {}
    return bag.dags[REPRODUCE_DAG_ID]


def test_it_is_manual_only_in_sandbox_capacity(dag):
    from kiln.cluster_policy import task_policy

    assert type(dag.timetable).__name__ == "NullTimetable"
    assert {str(getattr(t, "value", t)) for t in dag.allowed_run_types} == {"manual"}
    assert [t.task_id for t in dag.topological_sort()] == ["request", "reproduce", "outcome"]
    for t in dag.tasks:
        assert (t.owner, t.pool, t.pool_slots, t.priority_weight, t.retries) == (
            SANDBOX.owner, SANDBOX.pool, SANDBOX.pool_slots, SANDBOX.priority_weight, SANDBOX.retries), t.task_id
        assert t.pool != PRODUCTION.pool
        routed = SimpleNamespace(dag_id=dag.dag_id, queue="default")
        task_policy(routed)  # the production-like stacks' cluster policy: the sandbox worker, its identity
        assert routed.queue == "kiln-sandbox"
        assert getattr(t, "multiple_outputs", False) is False
    assert set(SANDBOX.tags) | {"reproduce"} <= set(dag.tags)
    assert "sandbox capacity" in dag.doc_md and "403" in dag.doc_md and "Policy `sandbox`" in dag.doc_md
    with pytest.raises(PolicyError, match="sandbox capacity, not policy 'production'"):
        dagfactory.build_reproduce_dag(PRODUCTION)


def test_the_form_has_the_command_s_arguments_with_titles_and_descriptions(dag):
    params = dag.params
    assert set(params.keys()) == {"version", "policy", "world_size", "tolerance", "allow_code_drift"}
    for name in params:
        schema = params.get_param(name).schema
        assert schema.get("title") and params.get_param(name).description, name
    assert params.get_param("policy").schema["enum"] == [None, "production", "sandbox"]
    assert params.get_param("allow_code_drift").value is False
    assert params.get_param("world_size").value is None and params.get_param("tolerance").value is None


@pytest.mark.parametrize("name,value", [("world_size", 0), ("world_size", "two"), ("tolerance", -1e-3),
                                        ("policy", "prod"), ("version", "")])
def test_the_form_refuses_a_bad_value_naming_it(dag, name, value):
    with pytest.raises(ParamValidationError, match=re.escape(repr(value) if isinstance(value, str) else str(value))):
        dag.params.get_param(name).resolve(value)


def test_the_form_needs_a_version(dag):
    with pytest.raises(ParamValidationError, match="version"):
        dag.params.validate()


def _context(dag, conf: dict[str, Any], *, try_number: int = 1, run_id: str = "manual__2026-12-07T16:00:00+00:00"):
    """What Airflow hands a task of a run triggered with ``conf``: the params resolved from the form (as the
    task runner resolves them: ``process_params``, which merges unknown conf keys in too)."""
    from airflow.sdk.definitions.param import process_params

    # A copy of the form: the task runner merges the conf into Param objects it shares with the DAG it was
    # handed (a DAG deserialized for that task); this module's one DAG must keep its defaults.
    params = process_params(SimpleNamespace(params=copy.deepcopy(dag.params)), SimpleNamespace(params=None), conf,
                            suppress_exception=False)
    return {"dag": dag, "dag_run": SimpleNamespace(conf=conf), "params": params, "run_id": run_id,
            "ti": SimpleNamespace(try_number=try_number)}


def _request(dag, monkeypatch, conf: dict[str, Any]) -> dict[str, Any]:
    monkeypatch.setattr(dagfactory, "get_current_context", lambda: _context(dag, conf))
    return dag.get_task("request").python_callable()


@pytest.mark.parametrize("conf,message", [
    ({"version": "kiln-stdlib-lm"}, "'kiln-stdlib-lm' is neither MODEL@ALIAS"),
    ({"version": "kiln-stdlib-lm/three"}, "'kiln-stdlib-lm/three' is neither MODEL@ALIAS"),
    ({"version": "kiln-stdlib-lm/3", "tolerance": 0.01}, "--tolerance bounds .* give --world-size N"),
    ({"version": "kiln-stdlib-lm/3", "world-size": 2}, "kiln_reproduce does not take run parameter.s. world-size"),
])
def test_the_first_task_refuses_what_the_command_refuses_naming_it_without_retry(dag, monkeypatch, conf, message):
    with pytest.raises(AirflowFailException, match=message):
        _request(dag, monkeypatch, conf)


def test_the_first_task_defaults_the_policy_to_the_model_s_owner_as_the_command_does(dag, monkeypatch):
    asked = _request(dag, monkeypatch, {"version": f"{PRODUCTION.target_model}@champion"})
    assert asked == {"model": PRODUCTION.target_model, "by": "alias", "name": "champion", "policy": "production",
                     "world_size": None, "tolerance": None, "allow_code_drift": False}
    asked = _request(dag, monkeypatch, {"version": f"{SANDBOX.target_model}/3", "world_size": 2, "tolerance": 0.01,
                                        "allow_code_drift": True})
    assert asked == {"model": SANDBOX.target_model, "by": "version", "name": "3", "policy": "sandbox",
                     "world_size": 2, "tolerance": 0.01, "allow_code_drift": True}
    assert _request(dag, monkeypatch, {"version": "someone-elses-lm/1"})["policy"] == "production"
    assert _request(dag, monkeypatch, {"version": f"{PRODUCTION.target_model}/1", "policy": "sandbox"})["policy"] == \
        "sandbox"


def test_the_reproduce_task_runs_as_sandbox_with_the_run_s_key_in_a_fresh_directory_per_try(dag, monkeypatch,
                                                                                              tmp_path):
    """What ``reproduce`` is called with (it is kiln's own function, replaced by a recorder here: the
    re-derivation is the end-to-end test's), and which MLflow identity the call sees: the sandbox's, even
    where the worker's environment carries production's."""
    from kiln.provenance import reproduce as reproduce_module
    from kiln.provenance.reproduce import Reproduction

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    for name in (SANDBOX.mlflow_conn_id, PRODUCTION.mlflow_conn_id):
        monkeypatch.delenv(f"AIRFLOW_CONN_{str(name).upper()}", raising=False)
    monkeypatch.setenv("KILN_MLFLOW_SANDBOX_USERNAME", "kiln-sandbox")
    monkeypatch.setenv("KILN_MLFLOW_SANDBOX_PASSWORD", "sandbox-password-1")
    monkeypatch.setenv("KILN_MLFLOW_PRODUCTION_USERNAME", "kiln-production")
    monkeypatch.setenv("KILN_MLFLOW_PRODUCTION_PASSWORD", "production-password-1")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "kiln-production")
    calls: list[dict[str, Any]] = []

    def recorded(model: str, name: str, **kwargs: Any) -> Reproduction:
        calls.append({"model": model, "name": name, **kwargs, "as": os.environ.get("MLFLOW_TRACKING_USERNAME")})
        kwargs["workdir"].mkdir(parents=True)
        (kwargs["workdir"] / "leftover").write_text("a try's work")  # what a failed try leaves behind
        return Reproduction(model=model, version="3", policy=kwargs["policy"], verdict="reproduced",
                            workdir=str(kwargs["workdir"]))

    monkeypatch.setattr(reproduce_module, "reproduce", recorded)
    asked = {"model": "kiln-stdlib-lm", "by": "version", "name": "3", "policy": "production", "world_size": 2,
             "tolerance": None, "allow_code_drift": False}
    run_id = "manual__2026-12-07T16:00:00+00:00"
    for try_number in (1, 2):
        monkeypatch.setattr(dagfactory, "get_current_context",
                            lambda n=try_number: _context(dag, {"version": "kiln-stdlib-lm/3"}, try_number=n, run_id=run_id))
        result = dag.get_task("reproduce").python_callable(asked)
        assert result["verdict"] == "reproduced" and result["model"] == "kiln-stdlib-lm"
    first, second = calls
    assert first["as"] == second["as"] == "kiln-sandbox"
    assert first["run_key"] == second["run_key"] == f"{REPRODUCE_DAG_ID}/{run_id}"
    assert first["record"] is True and first["by"] == "version" and first["policy"] == "production"
    assert first["world_size"] == 2 and first["tolerance"] is None and first["allow_code_drift"] is False
    assert first["workdir"] != second["workdir"] and first["workdir"].parent == second["workdir"].parent
    assert (first["workdir"].name, second["workdir"].name) == ("try-1", "try-2")
    assert first["workdir"].is_relative_to(tmp_path / "home")
    assert os.environ.get("MLFLOW_TRACKING_USERNAME") == "kiln-production"  # the task's identity is put back


def _outcome(verdict: str, *, reason: str = "", notes: tuple[str, ...] = (), uri: str = "runs:/abc123/reproduction/"
             "reproduction.dsse.json") -> dict[str, Any]:
    from kiln.provenance.reproduce import Reproduction

    return {**Reproduction(model="kiln-stdlib-lm", version="3", policy="production", verdict=verdict,  # type: ignore[arg-type]
                           reason=reason, notes=notes).to_json(), "attestation_uri": uri}


def test_the_outcome_says_where_the_verdict_is_recorded(dag):
    outcome = dag.get_task("outcome").python_callable
    said = outcome(_outcome("reproduced"))
    assert said == {"model": "kiln-stdlib-lm", "version": "3", "verdict": "reproduced", "recorded_on_version": True,
                    "attestation_uri": "runs:/abc123/reproduction/reproduction.dsse.json"}
    note = f"{NOT_ON_VERSION}: MLflow refused MLflow identity 'kiln-sandbox' (403 PERMISSION_DENIED): ..."
    said = outcome(_outcome("reproduced", notes=("torch 2.13 recorded, 2.13 here", note)))
    assert said["recorded_on_version"] is False


@pytest.mark.parametrize("verdict", ["differs", "refused"])
def test_a_verdict_other_than_reproduced_fails_the_run_without_retry_after_it_was_recorded(dag, verdict):
    note = f"{NOT_ON_VERSION}: MLflow refused MLflow identity 'kiln-sandbox' (403 PERMISSION_DENIED): ..."
    with pytest.raises(AirflowFailException, match=rf"kiln-stdlib-lm version 3 .*: {verdict}: train: weights .*"
                                                   r"Recorded in MLflow run abc123 of experiment kiln-sandbox, not on "
                                                   r"the version .*; signed attestation runs:/abc123/"):
        dag.get_task("outcome").python_callable(_outcome(verdict, reason="train: weights differ", notes=(note,)))
    with pytest.raises(AirflowFailException, match=r"Recorded on the version's kiln.reproduction.\* tags and in MLflow "
                                                   "run abc123"):
        dag.get_task("outcome").python_callable(_outcome(verdict, reason="train: weights differ"))

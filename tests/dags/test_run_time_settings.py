"""The deployment settings (launcher, review timeout) reach the tasks at run time (issue 21).

Each is an Airflow Variable read by the task that needs it when it starts (a template field that
Airflow renders before ``execute``), here given in its environment form (``AIRFLOW_VAR_<NAME>``,
which ``Variable.get`` reads first): the value in force is logged, a bad one fails the task
without retry naming the Variable, and the DAG file parses the same whatever the Variables say.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskAwaitingInput, TaskDeferred

from kiln import stages
from kiln.airflow import dagfactory
from kiln.launchers import JobHandle, LaunchPlan, LaunchSpec
from kiln.policy import PRODUCTION, SANDBOX
from kiln.refs import DataGateResult, PinnedSnapshot, StragglerWatchPlan

pytestmark = pytest.mark.filterwarnings("ignore::airflow.exceptions.RemovedInAirflow4Warning")

TIMEOUT_VAR = "AIRFLOW_VAR_KILN_PRODUCTION_APPROVAL_TIMEOUT_S"
LAUNCHER_VAR = "AIRFLOW_VAR_KILN_SANDBOX_LAUNCHER"


class Lines:
    """A ``log_line`` that keeps what it was told, formatted."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, fmt: str, *args: Any) -> None:
        self.lines.append(fmt % args)


@pytest.fixture
def no_variables(monkeypatch):
    for name in (TIMEOUT_VAR, LAUNCHER_VAR):
        monkeypatch.delenv(name, raising=False)


SETTING_FIELDS = ("launcher_setting", "review_timeout_setting", "op_kwargs")


def started(task, context: dict[str, Any] | None = None):
    """What Airflow does with the task's deployment-setting template fields when it starts (the
    template rendered with the real Variable accessor, so ``Variable.get``: the environment form
    first); the other fields (the review body's XCom lookups) are left alone."""
    from airflow.sdk.execution_time.context import VariableAccessor

    ctx = {"var": {"value": VariableAccessor(deserialize_json=False), "json": VariableAccessor(deserialize_json=True)},
           **(context or {})}
    for field in SETTING_FIELDS:
        if field in task.template_fields:
            setattr(task, field, task.render_template(getattr(task, field), ctx))
    return task


# ----------------------------------------------------------------------------- review timeout


def test_the_review_timeout_in_force_is_logged_with_where_it_came_from():
    said = Lines()
    assert dagfactory.review_timeout_in_force(PRODUCTION, "", said).approval_timeout_s == PRODUCTION.approval_timeout_s
    assert said.lines == [f"review timeout in force: {24 * 3600} s (the policy's own: Airflow Variable "
                          "kiln_production_approval_timeout_s is not set)"]
    said = Lines()
    assert dagfactory.review_timeout_in_force(PRODUCTION, " 90 ", said).approval_timeout_s == 90
    assert said.lines == ["review timeout in force: 90 s (from Airflow Variable kiln_production_approval_timeout_s)"]


@pytest.mark.parametrize("bad,message", [("0", r"within \[60, 2592000\] seconds, got 0"),
                                          ("1 day", "whole number of seconds, got '1 day'"),
                                          (str(31 * 24 * 3600), r"within \[60, 2592000\]")])
def test_a_bad_review_timeout_fails_the_task_without_retry_naming_the_variable(bad, message):
    with pytest.raises(AirflowFailException,
                       match=f"PolicyError: Airflow Variable kiln_production_approval_timeout_s must be .*{message}"):
        dagfactory.review_timeout_in_force(PRODUCTION, bad)


def test_the_dag_parses_with_the_coded_timeout_whatever_the_variable_says(monkeypatch):
    for value in ("90", "1 day"):
        monkeypatch.setenv(TIMEOUT_VAR, value)
        dag = dagfactory.build_dag(PRODUCTION)
        assert dag.get_task("approval").response_timeout == timedelta(seconds=PRODUCTION.approval_timeout_s)
        assert dagfactory.build_champion_watch_dag(PRODUCTION).get_task("rollback_approval").response_timeout == \
            timedelta(seconds=PRODUCTION.approval_timeout_s)


@pytest.fixture
def hitl_requests(monkeypatch) -> list[dict[str, Any]]:
    """The stock HITL execute's write of the request (to the API server in a real task), recorded."""
    from airflow.providers.standard.operators import hitl

    written: list[dict[str, Any]] = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kwargs: written.append(kwargs))
    return written


@pytest.mark.parametrize("dag_of,task_id", [("pipeline", "approval"), ("watch", "rollback_approval")])
def test_a_review_asks_with_the_timeout_in_force_when_it_starts(monkeypatch, hitl_requests, dag_of, task_id):
    """The stock execute turns ``response_timeout`` into the request's deadline (Airflow 3.3:
    ``TaskAwaitingInput(timeout=...)``, which the scheduler's sweep enforces): it must already be
    the deployment's when that happens."""
    monkeypatch.delenv(TIMEOUT_VAR, raising=False)
    build = dagfactory.build_dag if dag_of == "pipeline" else dagfactory.build_champion_watch_dag
    review = build(PRODUCTION).get_task(task_id)
    monkeypatch.setenv(TIMEOUT_VAR, "120")  # set after the parse: the next review asks with it
    context = {"task_instance": SimpleNamespace(id=uuid.uuid4())}
    with pytest.raises(TaskAwaitingInput) as parked:
        started(review, context).execute(context)
    assert parked.value.timeout == timedelta(seconds=120)
    assert review.hitl_summary["timeout_datetime"] is not None and len(hitl_requests) == 1

    monkeypatch.setenv(TIMEOUT_VAR, "soon")
    with pytest.raises(AirflowFailException, match="kiln_production_approval_timeout_s must be a whole number"):
        started(build(PRODUCTION).get_task(task_id), context).execute(context)
    assert len(hitl_requests) == 1, "a bad timeout fails the task before anyone is asked"


@pytest.mark.parametrize("dag_of,task_id", [("pipeline", "outcome"), ("watch", "watch_outcome")])
def test_the_outcome_tasks_take_the_review_timeout_in_force_too(monkeypatch, dag_of, task_id):
    """Their words about a review nobody answered name the timeout the review waited."""
    monkeypatch.setenv(TIMEOUT_VAR, "75")
    build = dagfactory.build_dag if dag_of == "pipeline" else dagfactory.build_champion_watch_dag
    task = started(build(PRODUCTION).get_task(task_id))
    assert task.op_kwargs == {"review_timeout_setting": "75"}
    assert "review_timeout_setting" not in repr(dagfactory.build_dag(SANDBOX).get_task("outcome").op_kwargs)


# ----------------------------------------------------------------------------------- launcher


def test_the_launcher_in_force_is_logged_with_where_it_came_from():
    said = Lines()
    assert dagfactory.launcher_in_force(SANDBOX, "", said) is SANDBOX
    assert said.lines == ["launcher in force: local (the policy's own: Airflow Variable kiln_sandbox_launcher is not set)"]
    said = Lines()
    assert dagfactory.launcher_in_force(SANDBOX, '{"launcher": "slurm", "slurm_partition": "gpu"}', said).launcher == "slurm"
    assert said.lines == ["launcher in force: slurm {'slurm_partition': 'gpu'} (from Airflow Variable kiln_sandbox_launcher)"]


@pytest.mark.parametrize("bad,message", [('{"launcher": "k8s"}', "launcher must be one of local, slurm, kubernetes"),
                                          ("slurm", "Airflow Variable kiln_sandbox_launcher must be a JSON object"),
                                          ('{"pool": "kiln_production"}', "kiln_sandbox_launcher may set only .*; not pool")])
def test_a_bad_launcher_setting_fails_the_task_without_retry(bad, message):
    with pytest.raises(AirflowFailException, match=f"PolicyError: .*{message}"):
        dagfactory.launcher_in_force(SANDBOX, bad)


@pytest.fixture
def train_task(monkeypatch):
    """The sandbox train task with its stages recorded instead of run (no job, no MLflow)."""
    calls: list[tuple[str, Any]] = []
    spec = LaunchSpec(run_dir=Path("/nonexistent/run"), manifest=Path("/nonexistent/m.json"),
                      recipe=Path("/nonexistent/r.toml"), run_key="kiln_sandbox/r1")

    def prepare_train(policy, snapshot, data, params, key):
        calls.append(("prepare_train", policy))
        return LaunchPlan(spec=spec, backend=policy.launcher, options={"partition": "gpu"}, mlflow_run_id="r")

    def handle(p: LaunchPlan, job_id: str) -> JobHandle:
        return JobHandle(backend=p.backend, job_id=job_id, run_dir=str(p.spec.run_dir))

    monkeypatch.setattr(stages, "prepare_train", prepare_train)
    monkeypatch.setattr(stages, "submit_train", lambda p: handle(p, "7"))
    monkeypatch.setattr(stages, "straggler_watch", lambda policy, p: StragglerWatchPlan(action=policy.straggler_action))
    monkeypatch.setattr(stages, "exclude_straggler", lambda policy, p, job, node: calls.append(("exclude", policy))
                        or (p.with_options(exclude=["node2"]), handle(p, "8"),
                            StragglerWatchPlan(action=policy.straggler_action)))
    monkeypatch.setattr(dagfactory, "_key", lambda: "kiln_sandbox/r1")
    monkeypatch.setattr(dagfactory, "_mlflow_identity", lambda policy: None)
    task = dagfactory.build_dag(SANDBOX).get_task("train")
    # The upstream XComs, as Airflow renders them into the task's snapshot and data fields.
    task.snapshot = PinnedSnapshot(id="a.dir", corpus="c", files=1, bytes=1, dvc="", remote="", path="/nonexistent",
                                   shards=[]).to_json()
    task.data = DataGateResult(manifest="/nonexistent/m.json", manifest_sha256="0" * 64, healthy=1, quarantined=[],
                               quarantine_rate=0.0, report="", report_html="").to_json()
    return task, calls


def test_the_train_task_submits_with_the_launcher_in_force_and_keeps_it_across_deferrals(monkeypatch, train_task):
    task, calls = train_task
    assert task.policy.launcher == "local", "the DAG file was parsed without the Variable"
    monkeypatch.setenv(LAUNCHER_VAR, '{"launcher": "slurm", "slurm_partition": "gpu", "straggler_action": "exclude_node"}')
    with pytest.raises(TaskDeferred) as deferred:
        started(task).execute({"params": {}})
    (_, policy), = calls
    assert (policy.launcher, policy.slurm_partition, policy.straggler_action) == ("slurm", "gpu", "exclude_node")
    assert deferred.value.trigger.backend == "slurm"
    assert StragglerWatchPlan.from_json(deferred.value.trigger.stragglers) == StragglerWatchPlan(action="exclude_node")
    settings = deferred.value.kwargs["launcher_settings"]

    # The Variable changes while the job runs (the resumed task renders it again): this try's
    # straggler handling does not.
    monkeypatch.setenv(LAUNCHER_VAR, '{"launcher": "local"}')
    event = {"state": "STRAGGLER", "handle": deferred.value.trigger.handle, "node": "node2", "reason": "rank 1 slow"}
    with pytest.raises(TaskDeferred) as again:
        started(task).execute_complete({}, event, deferred.value.kwargs["plan"], launcher_settings=settings)
    assert calls[-1][1].straggler_action == "exclude_node"
    assert StragglerWatchPlan.from_json(again.value.trigger.stragglers) == StragglerWatchPlan(action="exclude_node")
    assert again.value.kwargs["launcher_settings"] == settings
    # on_kill cancels the job the plan names (the launcher recorded in it, not the Variable's).
    assert task._submitted[0].backend == "slurm"


def test_a_bad_launcher_variable_fails_the_train_task_before_anything_runs(monkeypatch, train_task):
    task, calls = train_task
    monkeypatch.setenv(LAUNCHER_VAR, '{"launcher": "slurm", "slurm_partiton": "gpu"}')
    with pytest.raises(AirflowFailException, match="kiln_sandbox_launcher may set only .*; not slurm_partiton"):
        started(task).execute({"params": {}})
    assert calls == []

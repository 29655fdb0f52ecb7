"""DAG integrity: the DagBag loads cleanly, DAG files stay light, every task carries its policy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.dagfactory import end_orphaned_job
from kiln.policy import POLICIES

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
HEAVY = ("torch", "great_expectations", "mlflow", "dvc", "pandas")


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS), known_pools={p.pool for p in POLICIES.values()} | {"default_pool"})


def test_dagbag_has_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    watches = {p.champion_watch_dag_id for p in POLICIES.values() if p.champion_watch_dag_id}
    assert set(dagbag.dag_ids) == {p.dag_id for p in POLICIES.values()} | watches


def test_dag_files_import_no_heavy_library():
    """Parse-time cost: importing every DAG file pulls in none of the heavy libraries."""
    code = (
        "import importlib.util, sys, pathlib\n"
        f"for f in sorted(pathlib.Path({str(DAGS)!r}).glob('*.py')):\n"
        "    spec = importlib.util.spec_from_file_location(f.stem, f); m = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(m)\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"DAG files imported heavy libraries at parse time: {out.stdout.strip()}"


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=lambda p: p.name)
def test_every_task_has_owner_retries_and_its_policy_pool(dagbag, policy):
    dag = dagbag.dags[policy.dag_id]
    assert set(policy.tags) <= set(dag.tags)
    assert dag.doc_md and policy.name in dag.doc_md
    for t in dag.tasks:
        assert t.owner == policy.owner, t.task_id
        assert t.pool == policy.pool, t.task_id
        assert t.priority_weight == policy.priority_weight, t.task_id
        if t.task_id != "approval":  # a human answer is not retried
            assert t.retries == policy.retries, t.task_id
    # A failed run never leaves its training job behind (a task killed before its trigger ran).
    assert dag.on_failure_callback is end_orphaned_job


def test_no_task_splits_its_result_into_one_xcom_per_key(dagbag):
    """A ``-> dict`` annotation would make ``@task`` push every key as an XCom of its own, next to
    ``return_value``: rows nobody reads, and copies of values (checkpoint paths, run ids) to keep."""
    for dag_id in (*(p.dag_id for p in POLICIES.values()), "kiln_champion_watch"):
        for t in dagbag.dags[dag_id].tasks:
            assert getattr(t, "multiple_outputs", False) is False, f"{dag_id}.{t.task_id}"


def test_production_is_pinned_gated_and_one_at_a_time(dagbag):
    prod = dagbag.dags["kiln_production"]
    assert prod.max_active_runs == 1
    assert type(prod.timetable).__name__ == "AssetOrTimeSchedule", "scheduled AND corpus-asset triggered"
    assert prod.timetable.timetable.expression == "0 3 * * 1"
    assert "approval" in prod.task_ids
    assert prod.get_task("promote").upstream_task_ids >= {"approval"}
    assert set(prod.params.keys()) == {"reason"}, "production must not accept recipe/corpus/step overrides"
    assert {str(t.value if hasattr(t, "value") else t) for t in prod.allowed_run_types} == {"manual", "scheduled", "asset_triggered"}


def test_sandbox_is_manual_with_a_bounded_form(dagbag):
    sandbox = dagbag.dags["kiln_sandbox"]
    assert type(sandbox.timetable).__name__ == "NullTimetable", "sandbox runs start only by hand"
    assert {str(getattr(t, "value", t)) for t in sandbox.allowed_run_types} == {"manual"}
    assert "approval" not in sandbox.task_ids
    params = sandbox.params
    assert params.get_param("nodes").schema["maximum"] == 2
    assert "tiny.toml" in params.get_param("recipe").schema["enum"]


@pytest.mark.parametrize(
    "name,value",
    [("nodes", 9), ("nodes", 0), ("recipe", "../../etc/passwd.toml"), ("max_steps", 10**6), ("corpus", "Bad Name!")],
)
def test_sandbox_form_rejects_bad_input(dagbag, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    param = dagbag.dags["kiln_sandbox"].params.get_param(name)
    with pytest.raises(ParamValidationError, match=re.escape(repr(value) if isinstance(value, str) else str(value))):
        param.resolve(value)


def test_sandbox_form_accepts_its_defaults(dagbag):
    resolved = dagbag.dags["kiln_sandbox"].params.validate()
    assert resolved["recipe"] == "tiny.toml" and resolved["nodes"] == 1


def test_champion_watch_is_scheduled_reviewed_and_runs_in_the_production_pool(dagbag):
    from kiln.policy import PRODUCTION

    watch = dagbag.dags[PRODUCTION.champion_watch_dag_id]
    assert watch.timetable.expression == PRODUCTION.champion_watch_cron and watch.max_active_runs == 1
    assert {str(getattr(t, "value", t)) for t in watch.allowed_run_types} == {"manual", "scheduled"}
    for t in watch.tasks:
        assert (t.owner, t.pool, t.priority_weight) == (PRODUCTION.owner, PRODUCTION.pool, PRODUCTION.priority_weight), t.task_id
    review = watch.get_task("rollback_approval")
    assert [u["id"] for u in review.assigned_users] == list(PRODUCTION.reviewers)
    assert review.defaults == ["Reject"], "a review nobody answers must not roll back"
    assert watch.get_task("rollback").upstream_task_ids >= {"rollback_approval"}
    assert watch.get_task("watch_outcome").trigger_rule == "none_failed"


def test_linked_tasks_carry_their_extra_links(dagbag):
    from kiln.links import LINK_NAMES, TASK_LINKS

    for policy in POLICIES.values():
        dag = dagbag.dags[policy.dag_id]
        for task_id, kinds in TASK_LINKS.items():
            names = [link.name for link in dag.get_task(task_id).operator_extra_links]
            assert names == [LINK_NAMES[k] for k in kinds], (policy.name, task_id)
        assert not dag.get_task("snapshot").operator_extra_links


@pytest.mark.parametrize("dag_id", ["kiln_production", "kiln_champion_watch"])
@pytest.mark.parametrize("minutes_late", [1, 17, 60 * 16])
def test_a_dag_deployed_just_after_its_cron_time_waits_for_the_next_one(dagbag, monkeypatch, dag_id, minutes_late):
    """A stack that comes up (or a DAG unpaused) shortly after the cron time must not start that
    run: Airflow's CronTriggerTimetable treats ``run_immediately=False`` like None (a run that is
    less than a tenth of the period late still starts: 16.8 h for a weekly schedule), so the DAGs
    pass ``timedelta(0)``. Checked on the timetable the scheduler deserializes."""
    from datetime import datetime, timedelta, timezone

    import airflow.timetables.trigger as trigger
    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable
    from airflow.timetables.base import TimeRestriction

    timetable = decode_timetable(encode_timetable(dagbag.dags[dag_id].timetable))
    cron = next(t for t in (getattr(timetable, "timetable", None), timetable) if isinstance(t, trigger.CronTriggerTimetable))
    fire = cron._align_to_prev(trigger.coerce_datetime(datetime(2026, 11, 30, 12, tzinfo=timezone.utc)))
    now = trigger.coerce_datetime(fire + timedelta(minutes=minutes_late))
    monkeypatch.setattr(trigger, "utcnow", lambda: now)
    info = timetable.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=TimeRestriction(earliest=None, latest=None, catchup=False))
    assert info is not None and info.run_after > now, (fire, now, info)

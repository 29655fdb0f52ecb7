"""The production DAG under a real scheduler: pinned inputs, a human approval through the HITL
REST endpoint (only assigned reviewers may answer), the champion alias moved with full lineage —
a rejected review that ends the run without promotion, saying so, champion untouched — and a
review nobody answers: with the operator's timeout setting (an Airflow Variable, read when the
review task starts) the scheduler applies the default (Reject) and the run says so in its outcome,
its log and the candidate's MLflow tags. ``kiln audit`` then shows all three reviews.

Runs against either stack mode: with ``KILN_MLFLOW_AUTH=basic`` the tasks act as the production
MLflow identity and this test reads MLflow as the admin."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _run_production(admin, login, answer: str, conf: dict) -> tuple[str, dict]:
    from kiln.errors import AirflowAPIError
    from kiln.policy import PRODUCTION
    from kiln.stack.demo import follow_run

    run_id = admin.trigger(PRODUCTION.dag_id, conf=conf)["dag_run_id"]
    refused: dict[str, int] = {}

    def review(ti):
        if ti["task_id"] != "approval":
            return
        try:  # a user who is not an assigned reviewer cannot answer
            login("sandbox-user").answer_hitl(PRODUCTION.dag_id, run_id, "approval", ["Approve"])
        except AirflowAPIError as exc:
            refused["status"] = exc.status
        login("reviewer").answer_hitl(PRODUCTION.dag_id, run_id, "approval", [answer])

    # Generous: on a loaded 2-core machine one production run (then 300 steps on 2 agents) took 11 min.
    final = follow_run(admin, PRODUCTION.dag_id, run_id, on_awaiting_input=review, timeout=1500, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert final["state"] == "success", states
    assert refused.get("status") == 403, "a sandbox user was able to answer a production approval"
    return run_id, states


def _read_mlflow_as_admin(monkeypatch) -> None:
    """Under basic-auth the test reads MLflow as the admin (after the stack started, so no Airflow
    process inherits it); without auth there is nothing to do."""
    from kiln.stack import embedded as kiln_stack

    if kiln_stack.mlflow_auth_enabled():
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", kiln_stack.MLFLOW_ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", kiln_stack.mlflow_passwords()[kiln_stack.MLFLOW_ADMIN])


def _patient(stack):
    """``login(user)`` with a long HTTP timeout: on a loaded 2-core machine the api-server has
    taken more than 30 s to answer a poll."""
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    return lambda user: AirflowClient(stack["airflow"], user, kiln_stack.passwords()[user], timeout=180)


@pytest.mark.timeout(3600)  # two full production runs and a review left to time out
def test_production_approve_reject_and_timeout(stack, monkeypatch):
    """About 4 min on 2 cores, the slowest test: two full production runs (each trains the pinned
    60-step staging recipe on two agents) and a review left to time out (the
    60 s floor of the timeout Variable). Approve and reject need their own runs: one run is reviewed
    once; the timeout reuses the rejected run's review, asked again."""
    login = _patient(stack)
    admin = login("admin")
    import mlflow

    from kiln import registry
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION
    from kiln.stack.demo import follow_run

    _read_mlflow_as_admin(monkeypatch)
    import datetime as dt

    started = dt.datetime.now(dt.UTC)  # the audit trail below is read from here on: other e2e tests
    # on this shared stack (browser, champion watch) promote and review production models too

    s = kiln_settings.load()
    build_corpus(s.corpus_root / PRODUCTION.corpus, shards=8, seed=11, poison=("null_text", "zero_bytes"))
    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"], registry_uri=stack["mlflow"])

    # 1. approved: champion moves, with lineage and the reviewer's name
    run_id, states = _run_production(admin, login, "Approve", {"reason": "e2e approve"})
    assert states["promote"] == "success" and states["outcome"] == "success"
    snap = admin.xcom(PRODUCTION.dag_id, run_id, "snapshot")
    champion = client.get_model_version_by_alias(PRODUCTION.target_model, "champion")
    tags = champion.tags
    assert tags["kiln.snapshot_id"] == snap["id"] and tags["kiln.dvc"] == snap["dvc"]
    assert tags["kiln.promotion.approver"] == "reviewer"
    assert tags["kiln.airflow.run_id"] == run_id and tags["kiln.contract"] == PRODUCTION.contract
    assert tags["kiln.quarantined_shards"] == "2"
    candidate = admin.xcom(PRODUCTION.dag_id, run_id, "register_candidate")
    candidate_tags = client.get_model_version(PRODUCTION.candidate_model, str(candidate["version"])).tags
    assert candidate_tags["kiln.review"] == "approved"
    # The test deployment's reviewed config (tests/e2e/production.toml, KILN_PRODUCTION_CONFIG) pins
    # the staging recipe: every process of the stack read it, and the version records it.
    train = admin.xcom(PRODUCTION.dag_id, run_id, "train")
    assert train["completed"] and train["world_size"] == 2 and train["step"] == 60, train
    assert json.loads(candidate_tags["kiln.policy.config"])["recipe"] == "production/staging.toml"

    # 2. rejected: the run succeeds without promotion, says so, and the champion does not move
    run2, states2 = _run_production(admin, login, "Reject", {"reason": "e2e reject"})
    assert states2["promote"] == "skipped" and states2["outcome"] == "success"
    outcome = admin.xcom(PRODUCTION.dag_id, run2, "outcome")
    assert outcome["promoted"] is False and "rejected by reviewer" in outcome["message"]
    assert client.get_model_version_by_alias(PRODUCTION.target_model, "champion").version == champion.version
    candidate2 = admin.xcom(PRODUCTION.dag_id, run2, "register_candidate")
    assert client.get_model_version(PRODUCTION.candidate_model, str(candidate2["version"])).tags["kiln.review"] == "rejected"
    approval1 = admin.hitl_detail(PRODUCTION.dag_id, run_id, "approval")
    assert registry.tags._parse_time(tags["kiln.promotion.approved_at"]) == registry.tags._parse_time(approval1["responded_at"])

    # 3. nobody answers: the operator shortens the timeout (Variable, bounded, read when the review
    # task starts), the review of run 2 is asked again (cleared in Airflow) and left alone until it times out.
    variable = f"kiln_{PRODUCTION.name}_approval_timeout_s"
    admin.request("POST", "/variables", json={"key": variable, "value": "60"}, ok=(200, 201))
    try:
        admin.request("POST", f"/dags/{PRODUCTION.dag_id}/clearTaskInstances", json={
            "dry_run": False, "dag_run_id": run2, "task_ids": ["approval"], "include_downstream": True,
            "only_failed": False, "reset_dag_runs": True, "run_on_latest_version": True,
            "note": "e2e: the review is asked again and left unanswered",
        })
        final = follow_run(admin, PRODUCTION.dag_id, run2, timeout=600, progress=print)  # nobody answers
    finally:
        admin.request("DELETE", f"/variables/{variable}", ok=(200, 204, 404))
    states3 = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run2)}
    assert final["state"] == "success", states3
    assert states3["approval"] == "success" and states3["promote"] == "skipped" and states3["outcome"] == "success"
    detail = admin.hitl_detail(PRODUCTION.dag_id, run2, "approval")
    assert detail["chosen_options"] == ["Reject"] and not detail.get("responded_by_user"), detail
    approval_try = next(ti for ti in admin.task_instances(PRODUCTION.dag_id, run2) if ti["task_id"] == "approval")
    approval_log = admin.task_log(PRODUCTION.dag_id, run2, "approval", try_number=approval_try["try_number"])
    assert f"review timeout in force: 60 s (from Airflow Variable {variable})" in approval_log, approval_log[-3000:]
    outcome3 = admin.xcom(PRODUCTION.dag_id, run2, "outcome")
    assert outcome3["promoted"] is False and outcome3["review"] == "timed out"
    assert "the review timed out" in outcome3["message"] and "within 60 s" in outcome3["message"]
    outcome_try = next(ti for ti in admin.task_instances(PRODUCTION.dag_id, run2) if ti["task_id"] == "outcome")
    assert "NOT promoted: the review timed out" in admin.task_log(PRODUCTION.dag_id, run2, "outcome",
                                                                 try_number=outcome_try["try_number"])
    tags2 = client.get_model_version(PRODUCTION.candidate_model, str(candidate2["version"])).tags
    assert tags2["kiln.review"] == "timed out" and tags2["kiln.review.by"].startswith("nobody")
    assert client.get_model_version_by_alias(PRODUCTION.target_model, "champion").version == champion.version

    # The audit trail tells it all: one promotion, and the three reviews in order.
    events = [e for e in registry.audit_history(PRODUCTION.target_model, PRODUCTION)
              if (registry.tags._parse_time(e.get("at")) or started) >= started]
    assert [(e["event"], e.get("decision")) for e in events] == [
        ("promotion", "promote"), ("review", "approved"), ("review", "rejected"), ("review", "timed out"),
    ], events
    assert events[0]["actor"] == "reviewer" and events[0]["to_version"] == champion.version


def test_production_refuses_overrides_of_pinned_inputs(stack, admin):
    from kiln.policy import PRODUCTION
    from kiln.stack.demo import follow_run

    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    run_id = admin.trigger(PRODUCTION.dag_id, conf={"reason": "sneaky", "recipe": "tiny.toml"})["dag_run_id"]
    final = follow_run(admin, PRODUCTION.dag_id, run_id, timeout=300, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert final["state"] == "failed" and states["snapshot"] == "failed" and states["train"] == "upstream_failed"
    snapshot_ti = next(ti for ti in admin.task_instances(PRODUCTION.dag_id, run_id) if ti["task_id"] == "snapshot")
    assert snapshot_ti["try_number"] == 1, "a pinned-input violation must fail without retry"
    assert "does not take run parameter(s) recipe" in admin.task_log(PRODUCTION.dag_id, run_id, "snapshot")

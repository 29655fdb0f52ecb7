"""The production DAG under a real scheduler: pinned inputs, a human approval through the HITL
REST endpoint (only assigned reviewers may answer), the champion alias moved with full lineage —
and a rejected review that ends the run without promotion, saying so, champion untouched."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _run_production(admin, login, answer: str, conf: dict) -> tuple[str, dict]:
    from kiln.airflow_client import AirflowAPIError
    from kiln.demo import follow_run
    from kiln.policy import PRODUCTION

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

    final = follow_run(admin, PRODUCTION.dag_id, run_id, on_awaiting_input=review, timeout=780, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert final["state"] == "success", states
    assert refused.get("status") == 403, "a sandbox user was able to answer a production approval"
    return run_id, states


def test_production_approve_then_reject(stack, admin, login):
    import mlflow

    from kiln import settings as kiln_settings
    from kiln.corpus import build_corpus
    from kiln.policy import PRODUCTION

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
    assert client.get_model_version(PRODUCTION.candidate_model, str(candidate["version"])).tags["kiln.review"] == "approved"

    # 2. rejected: the run succeeds without promotion, says so, and the champion does not move
    run2, states2 = _run_production(admin, login, "Reject", {"reason": "e2e reject"})
    assert states2["promote"] == "skipped" and states2["outcome"] == "success"
    outcome = admin.xcom(PRODUCTION.dag_id, run2, "outcome")
    assert outcome["promoted"] is False and "rejected by reviewer" in outcome["message"]
    assert client.get_model_version_by_alias(PRODUCTION.target_model, "champion").version == champion.version
    candidate2 = admin.xcom(PRODUCTION.dag_id, run2, "register_candidate")
    assert client.get_model_version(PRODUCTION.candidate_model, str(candidate2["version"])).tags["kiln.review"] == "rejected"


def test_production_refuses_overrides_of_pinned_inputs(stack, admin):
    from kiln.demo import follow_run
    from kiln.policy import PRODUCTION

    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    run_id = admin.trigger(PRODUCTION.dag_id, conf={"reason": "sneaky", "recipe": "tiny.toml"})["dag_run_id"]
    final = follow_run(admin, PRODUCTION.dag_id, run_id, timeout=300, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert final["state"] == "failed" and states["snapshot"] == "failed" and states["train"] == "upstream_failed"
    snapshot_ti = next(ti for ti in admin.task_instances(PRODUCTION.dag_id, run_id) if ti["task_id"] == "snapshot")
    assert snapshot_ti["try_number"] == 1, "a pinned-input violation must fail without retry"
    assert "does not take run parameter(s) recipe" in admin.task_log(PRODUCTION.dag_id, run_id, "snapshot")

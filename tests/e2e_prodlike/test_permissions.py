"""Per-DAG Airflow permissions (FAB auth manager) on the production-like stack, through the REST
API as distinct users: sandbox users see production but can neither trigger it (directly or by
posting the corpus Asset event that schedules it) nor change it; they can trigger sandbox;
reviewers cannot trigger production. The HITL side (a sandbox user's approval refused, a
reviewer's accepted) is proven on a real run in test_production_prodlike.py."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _status(call) -> int:
    from kiln.errors import AirflowAPIError

    try:
        call()
    except AirflowAPIError as exc:
        return exc.status or 0
    return 200


def test_per_dag_permissions(prodlike, login):
    from kiln.airflow.dagfactory import corpus_asset
    from kiln.cli.snapshot import find_asset_id
    from kiln.policy import PRODUCTION, SANDBOX

    admin, sandbox_user, reviewer = login("admin"), login("sandbox-user"), login("reviewer")
    admin.wait_for_dag(PRODUCTION.dag_id, timeout=600)
    admin.wait_for_dag(SANDBOX.dag_id, timeout=600)
    # A paused DAG accepts runs but does not start them: the allowed trigger below costs nothing.
    admin.request("PATCH", f"/dags/{SANDBOX.dag_id}", json={"is_paused": True})

    # everyone sees both DAGs
    for client in (sandbox_user, reviewer):
        assert client.get_dag(PRODUCTION.dag_id)["dag_id"] == PRODUCTION.dag_id
        assert client.get_dag(SANDBOX.dag_id)["dag_id"] == SANDBOX.dag_id

    # sandbox user: no production trigger, no pausing production, no asset event that would start it
    assert _status(lambda: sandbox_user.trigger(PRODUCTION.dag_id, conf={"reason": "not allowed"})) == 403
    assert _status(lambda: sandbox_user.request("PATCH", f"/dags/{PRODUCTION.dag_id}", json={"is_paused": True})) == 403
    asset = corpus_asset(PRODUCTION.corpus)
    asset_id = find_asset_id(admin, asset.name, asset.uri)
    body = {"asset_id": asset_id, "extra": {"snapshot_id": "0" * 32 + ".dir", "corpus": PRODUCTION.corpus}}
    assert _status(lambda: sandbox_user.request("POST", "/assets/events", json=body, ok=(200, 201))) == 403
    # reviewer: approves (see the production test) but never starts production
    assert _status(lambda: reviewer.trigger(PRODUCTION.dag_id, conf={"reason": "not allowed"})) == 403

    # sandbox user may trigger sandbox; the run is there, queued behind the pause, and then removed
    run = sandbox_user.trigger(SANDBOX.dag_id, conf={"max_steps": 5})
    assert run["state"] == "queued" and run["dag_id"] == SANDBOX.dag_id
    admin.request("DELETE", f"/dags/{SANDBOX.dag_id}/dagRuns/{run['dag_run_id']}", ok=(204,))
    assert not admin.request("GET", f"/dags/{PRODUCTION.dag_id}/dagRuns")["dag_runs"], \
        "a refused call started a production run"
    admin.request("PATCH", f"/dags/{SANDBOX.dag_id}", json={"is_paused": False})

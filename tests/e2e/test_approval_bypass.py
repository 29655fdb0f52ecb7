"""A production run's approval cannot be forged through the Airflow REST API (issue 16, bug 1).

Under the embedded stack's auth manager (SimpleAuthManager: roles, no per-DAG permissions) any
user with the role "user" may set task states and write XComs in ANY DAG. So, on a real scheduler:

* a production run waiting at ``approval`` whose task is set to ``success`` by hand (no HITL answer)
  goes on to ``promote``, which refuses without retry: ``champion`` does not move, nothing is written
  to MLflow (no copy, no promotion or review tag, no audit event);
* an XCom planted on the approval task that claims an "Approve" by a reviewer is refused the same way;
* asked again, a reviewer (who now has only the role "user", the least that may answer) approves
  through the HITL endpoint and the same run promotes, naming the reviewer;
* a sandbox run (no approval required) whose candidate the gate held: its ``model_gate`` XCom
  rewritten to "promote" and ``promote`` cleared to run on it, promote refuses without retry
  (the verdict is the one registration recorded on the version), and nothing is written.

Each run is a full production run (the test deployment's pinned 60-step staging recipe on two agents): a few minutes each."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(3600)]


def _patient(stack):
    """``login(user)`` with a long HTTP timeout (the api-server has stalled > 30 s on 2 loaded cores)."""
    from kiln.stack import embedded as kiln_stack
    from kiln.stack.airflow_client import AirflowClient

    return lambda user: AirflowClient(stack["airflow"], user, kiln_stack.passwords()[user], timeout=180)


@pytest.fixture
def production(stack, monkeypatch):
    """The production DAG, unpaused, with its corpus; MLflow read as the admin under basic-auth."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION
    from kiln.stack import embedded as kiln_stack

    if kiln_stack.mlflow_auth_enabled():
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", kiln_stack.MLFLOW_ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", kiln_stack.mlflow_passwords()[kiln_stack.MLFLOW_ADMIN])
    build_corpus(kiln_settings.load().corpus_root / PRODUCTION.corpus, shards=8, seed=11,
                 poison=("null_text", "zero_bytes"))
    login = _patient(stack)
    admin = login("admin")
    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    return login


def _mlflow(stack):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=stack["mlflow"], registry_uri=stack["mlflow"])


def _champion(client) -> str | None:
    from kiln.policy import PRODUCTION

    try:
        return client.get_model_version_by_alias(PRODUCTION.target_model, PRODUCTION.alias).version
    except Exception:  # no model or no alias yet: nobody is champion
        return None


def _task(admin, run_id: str, task_id: str) -> dict:
    from kiln.policy import PRODUCTION

    return next(ti for ti in admin.task_instances(PRODUCTION.dag_id, run_id) if ti["task_id"] == task_id)


def _mark_success(client, run_id: str, task_id: str) -> None:
    """What the UI's "Mark as success" sends: the task's state, set by hand."""
    from kiln.policy import PRODUCTION

    client.request("PATCH", f"/dags/{PRODUCTION.dag_id}/dagRuns/{run_id}/taskInstances/{task_id}",
                   json={"new_state": "success"})


def _run_until_promote_ends(admin, run_id: str, at_approval) -> dict:
    """Follow the run; ``at_approval`` acts once the approval task waits for its answer."""
    from kiln.policy import PRODUCTION
    from kiln.stack.demo import follow_run

    def act(ti):
        if ti["task_id"] == "approval":
            at_approval()

    return follow_run(admin, PRODUCTION.dag_id, run_id, on_awaiting_input=act, timeout=1800, progress=print)


def _assert_refused_and_nothing_written(admin, client, run_id: str, champion_before: str | None) -> None:
    from kiln.policy import PRODUCTION

    promote = _task(admin, run_id, "promote")
    assert promote["state"] == "failed", promote
    assert promote["try_number"] == 1, "a promotion without an approval must fail without retry"
    log = admin.task_log(PRODUCTION.dag_id, run_id, "promote", try_number=promote["try_number"])
    assert "PolicyError" in log and "approval" in log, log[-3000:]
    assert _champion(client) == champion_before, "champion moved without a reviewer's approval"
    key = f"{PRODUCTION.dag_id}/{run_id}"
    copies = client.search_model_versions(f"name = '{PRODUCTION.target_model}' AND tags.`kiln.run_key` = '{key}'")
    assert copies == [], "the candidate was copied into the production model"
    candidate = admin.xcom(PRODUCTION.dag_id, run_id, "register_candidate")
    tags = client.get_model_version(PRODUCTION.candidate_model, str(candidate["version"])).tags
    written = sorted(k for k in tags if k.startswith(("kiln.review", "kiln.promotion", "kiln.audit.")))
    assert written == [], f"refused, yet MLflow holds {written}"


def test_a_task_marked_success_is_no_approval_and_a_reviewer_still_approves(stack, production):
    """About 2 min on 2 cores: a full production run (the test deployment's pinned 60-step staging recipe on two agents),
    refused at promote, then its review asked again and approved."""
    from kiln.errors import AirflowAPIError
    from kiln.policy import PRODUCTION
    from kiln.stack.demo import follow_run

    login = production
    admin, sandbox_user, reviewer = login("admin"), login("sandbox-user"), login("reviewer")
    client = _mlflow(stack)
    champion_before = _champion(client)

    run_id = admin.trigger(PRODUCTION.dag_id, conf={"reason": "e2e: approval marked success by hand"})["dag_run_id"]
    final = _run_until_promote_ends(admin, run_id, lambda: _mark_success(sandbox_user, run_id, "approval"))
    assert final["state"] == "failed", {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert _task(admin, run_id, "approval")["state"] == "success"  # the hand-set state: it counts for nothing
    _assert_refused_and_nothing_written(admin, client, run_id, champion_before)

    # The least role that may answer is enough: the reviewer cannot edit Variables (role "op" could:
    # the launcher and the approval timeout of production live there).
    with pytest.raises(AirflowAPIError) as denied:
        reviewer.request("POST", "/variables", json={"key": "kiln_e2e_probe", "value": "1"}, ok=(200, 201))
    assert denied.value.status == 403

    # Asked again, a reviewer approves through the HITL endpoint, and this run promotes.
    admin.request("POST", f"/dags/{PRODUCTION.dag_id}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": ["approval"], "include_downstream": True,
        "only_failed": False, "reset_dag_runs": True, "run_on_latest_version": True,
        "note": "e2e: the review is asked again",
    })
    refused: dict[str, int] = {}

    def review(ti):
        if ti["task_id"] != "approval":
            return
        try:
            sandbox_user.answer_hitl(PRODUCTION.dag_id, run_id, "approval", ["Approve"])
        except AirflowAPIError as exc:
            refused["status"] = exc.status
        reviewer.answer_hitl(PRODUCTION.dag_id, run_id, "approval", ["Approve"])

    final = follow_run(admin, PRODUCTION.dag_id, run_id, on_awaiting_input=review, timeout=900, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(PRODUCTION.dag_id, run_id)}
    assert final["state"] == "success", states
    assert refused.get("status") == 403, "a sandbox user was able to answer a production approval"
    candidate = admin.xcom(PRODUCTION.dag_id, run_id, "register_candidate")
    champion = client.get_model_version_by_alias(PRODUCTION.target_model, PRODUCTION.alias)
    assert champion.tags["kiln.source_version"] == f"{PRODUCTION.candidate_model}/{candidate['version']}"
    assert champion.tags["kiln.promotion.approver"] == "reviewer"
    assert champion.tags["kiln.promotion.approval"] == "review"
    reviewed = client.get_model_version(PRODUCTION.candidate_model, str(candidate["version"])).tags
    assert (reviewed["kiln.review"], reviewed["kiln.review.by"]) == ("approved", "reviewer")
    assert reviewed["kiln.review.run_key"] == f"{PRODUCTION.dag_id}/{run_id}"


def test_a_forged_approval_xcom_is_no_approval(stack, production):
    """About 1.5 min on 2 cores: a full production run, up to the promote it refuses."""
    from kiln.policy import PRODUCTION

    login = production
    admin, sandbox_user = login("admin"), login("sandbox-user")
    client = _mlflow(stack)
    champion_before = _champion(client)
    run_id = admin.trigger(PRODUCTION.dag_id, conf={"reason": "e2e: forged approval XCom"})["dag_run_id"]
    base = f"/dags/{PRODUCTION.dag_id}/dagRuns/{run_id}/taskInstances/approval/xcomEntries"
    reviewer = {"id": "reviewer", "name": "reviewer"}

    def forge():
        # What the approval task would have pushed had the reviewer approved: its return value and
        # kiln's `review` record. Written by the sandbox user; then the task is marked done.
        at = "2026-12-01T12:00:00+00:00"
        sandbox_user.request("POST", base, ok=(200, 201), json={"key": "return_value", "value": {
            "chosen_options": ["Approve"], "params_input": {}, "responded_at": at, "responded_by_user": reviewer}})
        sandbox_user.request("POST", base, ok=(200, 201), json={"key": "review", "value": {
            "chosen_options": ["Approve"], "responded_by_user": reviewer, "timed_out": False, "responded_at": at}})
        _mark_success(sandbox_user, run_id, "approval")

    final = _run_until_promote_ends(admin, run_id, forge)
    assert final["state"] == "failed"
    assert admin.xcom(PRODUCTION.dag_id, run_id, "approval")["chosen_options"] == ["Approve"]  # the forgery is there
    _assert_refused_and_nothing_written(admin, client, run_id, champion_before)


def _corpus_the_gate_holds(name: str):
    """A sandbox corpus whose held-out split no model trained on its Python can predict (random
    control characters): the candidate lands above the sandbox ceiling of 8 bits per byte (about
    9.8 after 30 steps, more after 60), so the model gate holds it."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    built = build_corpus(kiln_settings.load().corpus_root / name, shards=4, seed=16)
    (path,) = built["eval"]
    table = pq.read_table(path)
    rng = random.Random(16)
    alphabet = [chr(c) for c in range(1, 32) if chr(c) not in "\t\n\r\x0b\x0c"]
    texts = ["".join(rng.choice(alphabet) for _ in range(len(t.as_py()))) for t in table.column("text")]
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts, pa.string())), path)


def test_a_forged_model_gate_xcom_does_not_promote_a_candidate_the_gate_held(stack):
    """Sandbox promotes without a review, so the gate's verdict is all that stands in the way."""
    from kiln.errors import AirflowAPIError
    from kiln.policy import SANDBOX
    from kiln.stack.demo import follow_run

    admin, sandbox_user = _patient(stack)("admin"), _patient(stack)("sandbox-user")
    client = _mlflow(stack)
    corpus = "held-eval"
    _corpus_the_gate_holds(corpus)
    admin.wait_for_dag(SANDBOX.dag_id)
    admin.unpause(SANDBOX.dag_id)

    def sandbox_champion() -> str | None:
        try:
            return client.get_model_version_by_alias(SANDBOX.target_model, SANDBOX.alias).version
        except Exception:  # no model or no alias yet
            return None

    champion_before = sandbox_champion()
    run_id = sandbox_user.trigger(SANDBOX.dag_id, conf={"recipe": "tiny.toml", "max_steps": 60, "seed": 16,
                                                        "corpus": corpus})["dag_run_id"]
    final = follow_run(admin, SANDBOX.dag_id, run_id, timeout=780, progress=print)
    states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(SANDBOX.dag_id, run_id)}
    assert final["state"] == "success" and states["promote"] == "skipped", states
    candidate = admin.xcom(SANDBOX.dag_id, run_id, "register_candidate")
    assert candidate["decision"]["action"] == "hold", candidate["decision"]
    version = client.get_model_version(SANDBOX.candidate_model, str(candidate["version"]))
    assert version.tags["kiln.decision"] == "hold"

    # The forgery, all as the sandbox user: the gate's answer written as "promote" (the held
    # candidate's own metrics, so only the verdict lies), its record of what it skipped emptied (or
    # the scheduler skips promote again), then promote cleared so that it runs on them.
    entries = f"/dags/{SANDBOX.dag_id}/dagRuns/{run_id}/taskInstances/model_gate/xcomEntries"

    def write_xcom(key: str, value) -> None:
        try:  # a gate that held pushed no answer: create it, or else rewrite it
            sandbox_user.request("POST", entries, ok=(200, 201), json={"key": key, "value": value})
        except AirflowAPIError as exc:
            assert exc.status == 409, exc
            sandbox_user.request("PATCH", f"{entries}/{key}", json={"value": value, "map_index": -1})

    write_xcom("return_value", {**candidate["decision"], "action": "promote"})
    write_xcom("skipmixin_key", {"skipped": []})
    assert admin.xcom(SANDBOX.dag_id, run_id, "model_gate")["action"] == "promote"  # the forgery is there
    skipped_try = next(ti for ti in admin.task_instances(SANDBOX.dag_id, run_id) if ti["task_id"] == "promote")["try_number"]
    sandbox_user.request("POST", f"/dags/{SANDBOX.dag_id}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": ["promote"], "include_downstream": True,
        "only_failed": False, "reset_dag_runs": True, "note": "forged: promote on a rewritten gate answer",
    })
    final = follow_run(admin, SANDBOX.dag_id, run_id, timeout=600, progress=print)

    promote = next(ti for ti in admin.task_instances(SANDBOX.dag_id, run_id) if ti["task_id"] == "promote")
    assert final["state"] == "failed" and promote["state"] == "failed", promote
    log = admin.task_log(SANDBOX.dag_id, run_id, "promote", try_number=promote["try_number"])
    assert "PolicyError" in log and "the gate recorded 'hold'" in log, log[-3000:]
    assert promote["try_number"] == skipped_try + 1, "a refused promotion must fail without retry"
    assert sandbox_champion() == champion_before, "a held candidate became the sandbox champion"
    tags = client.get_model_version(SANDBOX.candidate_model, str(candidate["version"])).tags
    written = sorted(k for k in tags if k.startswith(("kiln.promotion", "kiln.audit.")))
    assert written == [] and tags["kiln.decision"] == "hold", f"refused, yet MLflow holds {written}"

"""The production DAG on the production-like topology, started as its schedule starts it.

A corpus snapshot is pushed to the S3 remote (moto) and announced as the corpus Asset event by
the ``corpus-publisher`` user; the scheduler starts an ``asset_triggered`` production run; its
tasks run on the production Celery worker; a sandbox user's approval is refused (403) and the
reviewer approves through the HITL REST endpoint; the ``champion`` alias and lineage tags are then
read through MLflow's REST API with basic-auth, and the artifacts are in S3.

The deployment's reviewed config (``tests/e2e_prodlike/production.toml``) pins a team's own model:
the worked example's Hugging Face ``LlamaForCausalLM`` on kiln's trainer SDK
(``production/llama-staging.toml``). So this run is also a user's trainer through production's
gate, its human approval and its promotion; the champion records which trainer, from which
distribution at which version, made it.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1500)]


def _asset_triggered_run(admin, dag_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = admin.request("GET", f"/dags/{dag_id}/dagRuns")["dag_runs"]
        if runs:
            assert len(runs) == 1, runs
            return runs[0]
        time.sleep(2)
    raise AssertionError(f"no run of {dag_id} started within {timeout:.0f}s of the asset event")


def test_asset_triggered_production_run_approved_by_reviewer(prodlike, login):
    """About 1.5 min on 2 cores: a full production run (the test deployment's pinned 60-step HF staging recipe on two agents)
    on the production-like stack, which is started for this package alone."""
    from kiln import settings as kiln_settings
    from kiln.cli.snapshot import announce_snapshot
    from kiln.data.corpus import build_corpus
    from kiln.data.snapshot import create_snapshot
    from kiln.policy import PRODUCTION

    s = kiln_settings.load()
    admin, publisher = login("admin"), login("corpus-publisher")
    admin.wait_for_dag(PRODUCTION.dag_id, timeout=600)

    # 1. a new corpus snapshot lands on the S3 remote and is announced: that is what starts production
    build_corpus(s.corpus_root / PRODUCTION.corpus, shards=4, seed=5)
    ref = create_snapshot(s.corpus_root / PRODUCTION.corpus, name=PRODUCTION.corpus).to_json()
    assert ref["remote"].startswith("s3://"), ref
    announce_snapshot(publisher, ref)
    run = _asset_triggered_run(admin, PRODUCTION.dag_id)
    assert run["run_type"] == "asset_triggered", run
    _approve_and_check(prodlike, login, run["dag_run_id"], ref)


def _approve_and_check(prodlike, login, run_id: str, ref: dict) -> None:
    import boto3

    from kiln import settings as kiln_settings
    from kiln.errors import AirflowAPIError
    from kiln.policy import PRODUCTION
    from kiln.stack import prodlike as prodlike_stack
    from kiln.stack.demo import follow_run

    s = kiln_settings.load()
    st = prodlike_stack.state(s)
    admin = login("admin")
    refused: dict[str, int] = {}

    def review(ti):
        if ti["task_id"] != "approval":
            return
        try:
            login("sandbox-user").answer_hitl(PRODUCTION.dag_id, run_id, "approval", ["Approve"])
        except AirflowAPIError as exc:
            refused["status"] = exc.status
        login("reviewer").answer_hitl(PRODUCTION.dag_id, run_id, "approval", ["Approve"])

    final = follow_run(admin, PRODUCTION.dag_id, run_id, on_awaiting_input=review, timeout=1200, progress=print)
    tis = admin.task_instances(PRODUCTION.dag_id, run_id)
    states = {ti["task_id"]: ti["state"] for ti in tis}
    assert final["state"] == "success", states
    assert states["promote"] == "success", states
    assert refused.get("status") == 403, "a sandbox user was able to answer a production approval"
    # every task went through Celery to the production queue (and so the production identity's worker)
    assert {ti["queue"] for ti in tis if ti["state"] == "success"} == {"kiln-production"}
    worker_log = (prodlike_stack.root(s) / "logs" / "worker-production.log").read_text(errors="replace")
    assert run_id in worker_log, "the production worker did not run this run's tasks"

    # 2. MLflow through its REST API, with basic-auth: no credentials -> 401
    api = f"{prodlike['mlflow']}/api/2.0/mlflow"
    query = {"name": PRODUCTION.target_model, "alias": "champion"}
    assert requests.get(f"{api}/registered-models/alias", params=query, timeout=30).status_code == 401
    reader = (prodlike_stack.MLFLOW_IDENTITIES["sandbox"], st["mlflow_passwords"][prodlike_stack.MLFLOW_IDENTITIES["sandbox"]])
    resp = requests.get(f"{api}/registered-models/alias", params=query, auth=reader, timeout=30)
    assert resp.status_code == 200, resp.text
    version = resp.json()["model_version"]
    tags = {t["key"]: t["value"] for t in version.get("tags", [])}
    snap = admin.xcom(PRODUCTION.dag_id, run_id, "snapshot")
    assert snap["id"] == ref["id"] == tags["kiln.snapshot_id"]
    assert tags["kiln.dvc"] == snap["dvc"] and tags["kiln.contract"] == PRODUCTION.contract
    assert tags["kiln.airflow.run_id"] == run_id
    assert tags["kiln.promotion.approver"] == "reviewer"
    assert (tags["kiln.trainer"], tags["kiln.trainer.distribution"]) == ("kiln_hf_trainer.train:main",
                                                                         "kiln-example-hf-trainer")
    assert json.loads(tags["kiln.policy.config"])["recipe"] == "production/llama-staging.toml"
    # the sandbox identity reads production but cannot move its alias
    moved = requests.post(f"{api}/registered-models/alias", auth=reader, timeout=30,
                          json={"name": PRODUCTION.target_model, "alias": "champion", "version": version["version"]})
    assert moved.status_code == 403, moved.text
    # the "kiln run" view (an api-server plugin) finds the run's MLflow run as the read-only kiln-reader
    from kiln.links import run_view_url

    view = requests.get(run_view_url(PRODUCTION.dag_id, run_id, prodlike["airflow"]), timeout=60)
    train_run = admin.xcom(PRODUCTION.dag_id, run_id, "train")["mlflow_run_id"]
    assert view.status_code == 200 and train_run in view.text, view.text[-2000:]

    # 3. artifacts and snapshots are in S3 (moto)
    s3 = boto3.client("s3", endpoint_url=prodlike["s3"], region_name="us-east-1",
                      aws_access_key_id=st["s3_access_key_id"], aws_secret_access_key=st["s3_secret_access_key"])
    for bucket in st["buckets"].values():
        assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) > 0, f"nothing in s3://{bucket}"

    # 4. signed with the deployment's key: the champion and its approval verify for production with the
    #    key the stack keeps in its secrets (the production worker's connection kiln_signing_production),
    #    the only key production trusts; no private key of production under KILN_HOME/keys or in a log
    from mlflow import MlflowClient

    from kiln.mlflow_auth import MlflowIdentity, use_identity
    from kiln.provenance import keys
    from kiln.registry.verify import check_version

    pem = st["signing_keys"]["production"]
    deployed = keys.key_id(keys.parse_private_key(pem, "state.json signing_keys.production").public_key())
    assert set(keys.trusted_keys("production", s.home)) == {deployed}
    assert keys.key_from_deployment("production", s.home)
    with use_identity(MlflowIdentity(*reader, source="the sandbox identity (reads production)")):
        mv = MlflowClient(prodlike["mlflow"]).get_model_version(PRODUCTION.target_model, version["version"])
        check = check_version(mv, "production", home=s.home)
    verified = check.require_verified()
    check.require_attested()
    assert verified.statement_key_id == verified.model_sig_key_id == deployed
    approval = check.attestation("approval")
    assert approval is not None and approval.status == "verifies", approval
    assert approval.predicate["approver"] == "reviewer", approval.predicate
    key_files = [p for p in (s.home / "keys").rglob("*") if p.is_file()]
    assert not [p for p in key_files if b"PRIVATE KEY" in p.read_bytes()], key_files
    assert not (s.home / "keys" / "production" / keys.PRIVATE_KEY_FILE).exists()
    line = pem.strip().splitlines()[1]  # 64 characters of the key's base64
    leaked = [p for p in prodlike_stack.root(s).rglob("*.log") if line in p.read_text(errors="replace")]
    assert not leaked, f"production's private key in {leaked}"

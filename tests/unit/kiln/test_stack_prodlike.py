"""kiln.stack.prodlike without services: routing and credential separation of the Celery workers."""

from __future__ import annotations

import json
import stat
from types import SimpleNamespace

import pytest

from kiln import settings as kiln_settings
from kiln.policy import PRODUCTION, SANDBOX
from kiln.stack import prodlike


def test_task_policy_routes_each_policy_dag_to_its_queue():
    for dag_id, queue in ((PRODUCTION.dag_id, "kiln-production"), (SANDBOX.dag_id, "kiln-sandbox")):
        task = SimpleNamespace(dag_id=dag_id, queue="default")
        prodlike.task_policy(task)
        assert task.queue == queue
    # The champion watch is a production DAG: on the sandbox worker it would have no production identity.
    watch = SimpleNamespace(dag_id=PRODUCTION.champion_watch_dag_id, queue="default")
    prodlike.task_policy(watch)
    assert watch.queue == "kiln-production"
    other = SimpleNamespace(dag_id="someone_elses_dag", queue="default")
    prodlike.task_policy(other)
    assert other.queue == "default"


def test_state_is_private_and_workers_hold_only_their_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.setattr(prodlike, "_free_redis_db", lambda: 7)
    s = kiln_settings.load()
    with pytest.raises(Exception, match="no production-like stack"):
        prodlike.state(s)
    st = prodlike.state(s, create=True)
    path = prodlike.root(s) / "state.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(prodlike.root(s).stat().st_mode) == 0o700
    assert json.loads(path.read_text())["tag"] == st["tag"] and st["tag"] in st["databases"]["airflow"]
    services = {svc.name: svc for svc in prodlike.services(s, st)}
    prod_pw = st["mlflow_passwords"]["kiln-production"]
    sandbox_pw = st["mlflow_passwords"]["kiln-sandbox"]
    prod_env = json.dumps(services["worker-production"].env)
    sandbox_env = json.dumps(services["worker-sandbox"].env)
    assert prod_pw in prod_env and sandbox_pw not in prod_env
    assert sandbox_pw in sandbox_env and prod_pw not in sandbox_env
    assert "kiln-production" in services["worker-production"].argv
    # The api-server reads (the "kiln run" view) as kiln-reader; no other component holds an MLflow identity.
    reader_pw = st["mlflow_passwords"][prodlike.MLFLOW_READER]
    assert services["api-server"].env["MLFLOW_TRACKING_USERNAME"] == "kiln-reader"
    for name, svc in services.items():
        held = [pw for pw in (prod_pw, sandbox_pw, reader_pw, st["mlflow_passwords"]["admin"]) if pw in json.dumps(svc.env)]
        allowed = {"worker-production": [prod_pw], "worker-sandbox": [sandbox_pw], "api-server": [reader_pw]}
        if name == "mlflow":  # the server itself knows its admin (to bootstrap the auth database)
            continue
        assert held == allowed.get(name, []), name
    # no credential on any command line
    secrets = [st["pg_password"], st["s3_secret_access_key"], *st["mlflow_passwords"].values(),
               *st["airflow_passwords"].values()]
    for svc in services.values():
        assert not any(secret in arg for secret in secrets for arg in svc.argv), svc.name


def test_productions_signing_key_lives_in_the_stacks_secrets_and_reaches_its_worker_only(tmp_path, monkeypatch):
    """Generated once into state.json (0600), given to the production worker alone as the connection
    kiln_signing_production, its public half trusted; no private key of production under KILN_HOME/keys,
    and a signing key in the caller's environment reaches no Airflow process. Rotation keeps the old key
    trusted and gives the worker the new one."""
    from kiln.provenance import keys

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.setattr(prodlike, "_free_redis_db", lambda: 7)
    caller_pem = keys.generate_private_pem()
    monkeypatch.setenv("KILN_PRODUCTION_SIGNING_KEY", caller_pem)
    monkeypatch.setenv("AIRFLOW_CONN_KILN_SIGNING_SANDBOX", json.dumps({"password": caller_pem}))
    s = kiln_settings.load()
    st = prodlike.state(s, create=True)
    pem = st["signing_keys"]["production"]
    assert set(st["signing_keys"]) == {"production"} and json.loads((prodlike.root(s) / "state.json").read_text()) == st
    kid = prodlike.provision_signing_keys(s, st)["production"]
    assert kid == keys.key_id(keys.parse_private_key(pem, "state").public_key())
    assert set(keys.trusted_keys("production", s.home)) == {kid} and keys.key_from_deployment("production", s.home)
    assert prodlike.provision_signing_keys(s, st) == {"production": kid}  # idempotent: the same key
    held = [p for p in (s.home / "keys").rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]
    assert held == []
    body = "".join(pem.strip().splitlines()[1:-1])  # the key's base64, however a process's env encodes newlines
    services = {svc.name: svc for svc in prodlike.services(s, st)}
    conn = json.loads(services["worker-production"].env["AIRFLOW_CONN_KILN_SIGNING_PRODUCTION"])
    assert conn["password"] == pem
    airflow = prodlike.airflow_env(s, st)
    for name, svc in services.items():
        text = "".join(v.replace("\\n", "").replace("\n", "") for v in {**airflow, **svc.env}.values())
        assert (body in text) == (name == "worker-production"), name
        assert caller_pem.strip().splitlines()[1] not in text, f"{name} got the caller's signing key"
    for svc in services.values():
        assert not any(body[:40] in arg for arg in svc.argv), svc.name

    new = prodlike.rotate_signing_key("production")
    st = prodlike.state(s)
    assert new != kid and set(keys.trusted_keys("production", s.home)) == {kid, new}
    worker = {svc.name: svc for svc in prodlike.services(s, st)}["worker-production"]
    rotated = json.loads(worker.env["AIRFLOW_CONN_KILN_SIGNING_PRODUCTION"])["password"]
    assert keys.key_id(keys.parse_private_key(rotated, "state").public_key()) == new
    assert stat.S_IMODE((prodlike.root(s) / "state.json").stat().st_mode) == 0o600
    with pytest.raises(Exception, match="keeps no signing key of policy 'sandbox'"):
        prodlike.rotate_signing_key("sandbox")

"""A policy's private signing key from the deployment (an Airflow connection or KILN_<POLICY>_SIGNING_KEY):
parsed and refused by name, trusted before it signs, never written under KILN_HOME, never reachable
from another policy's stage, and no key made in its place once the deployment says it is its own."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from provenance_fixtures import inputs, make_artifact

from kiln.errors import ConfigError, ProvenanceError
from kiln.policy import PRODUCTION, SANDBOX
from kiln.provenance import keys, sign_artifact, verify_artifact
from kiln.provenance.approval import sign_approval

PROD_CONN = "AIRFLOW_CONN_KILN_SIGNING_PRODUCTION"
SANDBOX_CONN = "AIRFLOW_CONN_KILN_SIGNING_SANDBOX"
PROD_PEM, PROD_FILE = keys.signing_key_env_names("production")
PROD_DIR = keys.trusted_keys_env_name("production")


@pytest.fixture(autouse=True)
def _no_deployment_keys_from_the_caller(monkeypatch):
    for name in (PROD_CONN, SANDBOX_CONN, PROD_PEM, PROD_FILE, *keys.signing_key_env_names("sandbox"), PROD_DIR,
                 keys.trusted_keys_env_name("sandbox")):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def _conn(pem: str, field: str = "password") -> str:
    if field == "password":
        return json.dumps({"conn_type": "generic", "password": pem})
    return json.dumps({"conn_type": "generic", "extra": {field: pem}})


def _in_task(policy):
    """``use_policy_key`` as ``dagfactory._run`` enters it: the connection read through the Airflow adapter."""
    from kiln.airflow.dagfactory import signing_connection

    return keys.use_policy_key(policy, signing_connection)


def _private_files(home: Path) -> list[Path]:
    """Every file under the kiln home that holds a private key (by content, whatever its name)."""
    return [p for p in home.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]


def test_refusals_name_the_source_and_what_is_wrong():
    source = "connection kiln_signing_production"
    private = ec.generate_private_key(ec.SECP256R1())
    public = keys.public_pem(private.public_key()).decode()
    rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    p384 = ec.generate_private_key(ec.SECP384R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    encrypted = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"a passphrase")).decode()
    truncated = keys.generate_private_pem()[:120] + "\n-----END PRIVATE KEY-----\n"
    cases = {
        "": "connection kiln_signing_production: empty",
        "hunter2hunter2": r"connection kiln_signing_production: not an unencrypted PEM private key \(no '-----BEGIN",
        public: "connection kiln_signing_production: holds a public key, not the private key signing needs",
        encrypted: "connection kiln_signing_production: an encrypted private key",
        rsa_pem: "connection kiln_signing_production: a RSAPrivateKey key; kiln signs with ECDSA P-256",
        p384: "connection kiln_signing_production: an EC key on curve secp384r1; kiln signs with ECDSA P-256",
        truncated: "connection kiln_signing_production: not an unencrypted PEM private key",
    }
    for pem, message in cases.items():
        with pytest.raises(ProvenanceError, match=message):
            keys.parse_private_key(pem, source)
    good = keys.generate_private_pem()
    assert keys.key_id(keys.parse_private_key(good, source).public_key()) == \
        keys.key_id(keys.parse_private_key(good.encode(), source).public_key())


def test_an_environment_key_signs_once_trusted_and_is_never_written(tmp_path, home, monkeypatch):
    pem = keys.generate_private_pem()
    monkeypatch.setenv(PROD_PEM, pem)
    with pytest.raises(ProvenanceError, match=f"environment variable {PROD_PEM}: key [0-9a-f]{{64}} is not in policy "
                                              "production's trusted set"):
        keys.signing_key("production", home)
    kid = keys.trust_deployment_key("production", pem, home, source=f"environment variable {PROD_PEM}")
    key = keys.signing_key("production", home)
    assert (key.key_id, key.path, key.source) == (kid, None, f"environment variable {PROD_PEM}")
    assert pem not in repr(key) and "PRIVATE" not in repr(key)
    art = make_artifact(tmp_path / "art")
    signed = sign_artifact(art, inputs(), home=home)  # model.sig through the memory file
    verified = verify_artifact(art, "production", home=home)
    assert signed.key_id == verified.statement_key_id == verified.model_sig_key_id == kid
    assert _private_files(home) == [] and not (home / "keys" / "production" / keys.PRIVATE_KEY_FILE).exists()
    assert set(keys.trusted_keys("production", home)) == {kid}
    # the public half only is in the trusted set; the marker names the sources and holds no key
    marker = json.loads((home / "keys" / "production" / keys.DEPLOYMENT_MARKER).read_text())
    assert marker["connection"] == "kiln_signing_production" and marker["environment"] == [PROD_PEM, PROD_FILE]


def test_a_key_file_from_the_deployment_must_be_private(tmp_path, home, monkeypatch):
    pem = keys.generate_private_pem()
    path = tmp_path / "secrets" / "production.pem"
    path.parent.mkdir()
    path.write_text(pem)
    path.chmod(0o644)
    keys.trust_deployment_key("production", pem, home)
    monkeypatch.setenv(PROD_FILE, str(path))
    with pytest.raises(ProvenanceError, match="mode 0644 lets others read it"):
        keys.signing_key("production", home)
    path.chmod(0o600)
    assert keys.signing_key("production", home).path == path
    monkeypatch.setenv(PROD_PEM, pem)
    with pytest.raises(ConfigError, match=f"set {PROD_PEM} or {PROD_FILE}, not both"):
        keys.signing_key("production", home)


def test_once_the_deployment_holds_the_key_none_is_made_under_kiln_home(home):
    pem = keys.generate_private_pem()
    keys.trust_deployment_key("production", keys.public_pem(keys.parse_private_key(pem, "t").public_key()), home)
    assert keys.key_from_deployment("production", home) and not keys.key_from_deployment("sandbox", home)
    with pytest.raises(ConfigError, match="policy production's signing key comes from the deployment .* none reached "
                                          f"this process: .*neither {PROD_PEM} nor {PROD_FILE} is set"):
        keys.signing_key("production", home)
    with pytest.raises(ConfigError, match="comes from the deployment .*: rotate it there"):
        keys.rotate_signing_key("production", home)
    assert _private_files(home) == []
    # sandbox, not provisioned from the deployment, still gets its key made under KILN_HOME
    assert keys.signing_key("sandbox", home).path == home / "keys" / "sandbox" / keys.PRIVATE_KEY_FILE


def test_in_a_task_the_policys_connection_comes_first_and_other_policies_are_refused(tmp_path, home, monkeypatch):
    """As a production worker's environment carries it: the connection (password, or extra private_key)
    is production's key in a production stage; a sandbox stage in the same process cannot sign as
    production, nor sees production's variables, even though the environment carries both."""
    conn_pem, env_pem = keys.generate_private_pem(), keys.generate_private_pem()
    conn_kid = keys.trust_deployment_key("production", conn_pem, home)
    env_kid = keys.trust_deployment_key("production", env_pem, home)
    monkeypatch.setenv(PROD_CONN, _conn(conn_pem))
    monkeypatch.setenv(PROD_PEM, env_pem)
    assert keys.signing_key("production", home).key_id == env_kid  # outside a task: no connection is read
    with _in_task(PRODUCTION):
        key = keys.signing_key("production", home)
        assert (key.key_id, key.source) == (conn_kid, "connection kiln_signing_production")
        with pytest.raises(ProvenanceError, match="this stage acts as policy production: it may not sign as policy sandbox"):
            keys.signing_key("sandbox", home)
    monkeypatch.setenv(PROD_CONN, _conn(conn_pem, keys.PRIVATE_KEY_EXTRA))
    with _in_task(PRODUCTION):
        assert keys.signing_key("production", home).key_id == conn_kid
    monkeypatch.setenv(PROD_CONN, _conn(keys.public_pem(keys.parse_private_key(conn_pem, "t").public_key()).decode()))
    with _in_task(PRODUCTION), pytest.raises(
            ProvenanceError, match="connection kiln_signing_production: holds a public key, not the private key"):
        keys.signing_key("production", home)
    monkeypatch.setenv(PROD_CONN, json.dumps({"conn_type": "generic", "login": "nobody"}))
    with _in_task(PRODUCTION), pytest.raises(
            ProvenanceError, match="connection kiln_signing_production: holds no private key"):
        keys.signing_key("production", home)
    monkeypatch.setenv(PROD_CONN, _conn(conn_pem))

    for scope, acts in ((SANDBOX, "acts as policy sandbox"), (None, "acts as no policy")):
        with _in_task(scope):
            assert PROD_CONN not in os.environ and PROD_PEM not in os.environ  # nor in a process started here
            with pytest.raises(ProvenanceError, match=f"this stage {acts}: it may not sign as policy production"):
                keys.signing_key("production", home)
            with pytest.raises(ProvenanceError, match=f"this stage {acts}"):
                sign_approval({"anything": 1}, "production", home=home)
        assert os.environ[PROD_CONN] == _conn(conn_pem) and os.environ[PROD_PEM] == env_pem  # back afterwards
    with _in_task(SANDBOX):  # sandbox signs with its own key (made under KILN_HOME: none deployed)
        sandbox = keys.signing_key("sandbox", home)
    assert sandbox.path is not None and sandbox.key_id not in (conn_kid, env_kid)
    assert [p.name for p in _private_files(home)] == [keys.PRIVATE_KEY_FILE]  # sandbox's, none of production's
    assert not (home / "keys" / "production" / keys.PRIVATE_KEY_FILE).exists()


def test_a_configured_connection_without_a_trusted_key_fails_closed(home, monkeypatch):
    keys.trust_deployment_key("production", keys.generate_private_pem(), home)
    monkeypatch.setenv(PROD_CONN, _conn(keys.generate_private_pem()))  # a key nobody trusted
    with _in_task(PRODUCTION), pytest.raises(
            ProvenanceError, match="connection kiln_signing_production: key [0-9a-f]{64} is not in policy production's "
                                   "trusted set"):
        keys.signing_key("production", home)
    monkeypatch.delenv(PROD_CONN)
    with _in_task(PRODUCTION), pytest.raises(
            ConfigError, match=f"none reached this process: no Airflow connection kiln_signing_production and neither "
                               f"{PROD_PEM} nor {PROD_FILE} is set"):
        keys.signing_key("production", home)
    assert _private_files(home) == []


def test_the_airflow_adapter_scopes_each_stage_to_its_policy(home, monkeypatch):
    """``dagfactory._run``: a stage run for sandbox (or with no policy) on a worker whose environment holds
    production's key cannot sign as production; the same stage run for production signs with the connection."""
    from kiln.airflow import dagfactory

    pem = keys.generate_private_pem()
    kid = keys.trust_deployment_key("production", pem, home)
    monkeypatch.setenv(PROD_CONN, _conn(pem))
    monkeypatch.setenv(PROD_PEM, pem)

    def stage() -> str:
        return keys.signing_key("production", home).key_id

    assert dagfactory._run(stage, mlflow_as=PRODUCTION) == kid
    for policy in (SANDBOX, None):
        with pytest.raises(Exception, match="it may not sign as policy production"):
            dagfactory._run(stage, mlflow_as=policy)
    assert os.environ[PROD_CONN] == _conn(pem)


def test_rotation_of_a_deployment_key_keeps_old_versions_verifying(tmp_path, home, monkeypatch):
    old_pem, new_pem = keys.generate_private_pem(), keys.generate_private_pem()
    old = keys.trust_deployment_key("production", old_pem, home)
    monkeypatch.setenv(PROD_CONN, _conn(old_pem))
    before = make_artifact(tmp_path / "before")
    with _in_task(PRODUCTION):
        sign_artifact(before, inputs(), home=home)
    new = keys.trust_deployment_key("production", new_pem, home)  # provisioning trusts the new key first
    monkeypatch.setenv(PROD_CONN, _conn(new_pem))
    after = make_artifact(tmp_path / "after", salt="after rotation")
    with _in_task(PRODUCTION):
        sign_artifact(after, inputs(run_id="later"), home=home)
    assert verify_artifact(before, "production", home=home).statement_key_id == old
    assert verify_artifact(after, "production", home=home).model_sig_key_id == new
    assert set(keys.trusted_keys("production", home)) == {old, new} and _private_files(home) == []
    for path in (home / "keys" / "production").rglob("*"):
        assert path.is_dir() or stat.S_IMODE(path.stat().st_mode) & 0o022 == 0


def test_with_the_deployments_trusted_set_a_deployment_key_signs_only_when_it_is_in_the_directory(tmp_path, home,
                                                                                                  monkeypatch):
    """KILN_PRODUCTION_TRUSTED_KEYS_DIR: the key must be in the directory; trusting it under KILN_HOME (what
    a task on a shared volume could do) does not let it sign, and nothing is written under KILN_HOME."""
    pem = keys.generate_private_pem()
    public = keys.public_pem(keys.parse_private_key(pem, "t").public_key())
    kid = keys.key_id(keys.parse_private_key(pem, "t").public_key())
    keys.trust_deployment_key("production", public, home)  # under KILN_HOME, before the directory took over
    folder = tmp_path / "trusted"
    folder.mkdir()
    (folder / "another.pem").write_bytes(keys.public_pem(ec.generate_private_key(ec.SECP256R1()).public_key()))
    monkeypatch.setenv(PROD_DIR, str(folder))
    monkeypatch.setenv(PROD_PEM, pem)
    with pytest.raises(ProvenanceError, match=f"environment variable {PROD_PEM}: key {kid} is not in policy "
                                              f"production's trusted set \\({folder}\\).*a PEM file of it in {folder}, "
                                              f"{PROD_DIR}"):
        keys.signing_key("production", home)
    with _in_task(PRODUCTION), pytest.raises(ProvenanceError, match=f"key {kid} is not in policy production's trusted"):
        sign_artifact(make_artifact(tmp_path / "refused"), inputs(), home=home)
    (folder / "production-signing-key.pub.pem").write_bytes(public)  # the deployment adds it: it signs
    before = sorted(p.relative_to(home).as_posix() for p in home.rglob("*"))
    art = make_artifact(tmp_path / "art")
    signed = sign_artifact(art, inputs(), home=home)
    verified = verify_artifact(art, "production", home=home)
    assert signed.key_id == verified.statement_key_id == verified.model_sig_key_id == kid
    monkeypatch.setenv(PROD_CONN, _conn(pem))
    with _in_task(PRODUCTION):
        assert keys.signing_key("production", home).source == "connection kiln_signing_production"
    assert _private_files(home) == [] and sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == before

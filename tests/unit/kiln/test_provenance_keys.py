"""Per-policy signing keys: made once, 0600 from the first byte, disjoint trusted sets, rotation; a
policy's trusted set from the deployment's directory (KILN_<POLICY>_TRUSTED_KEYS_DIR)."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from provenance_fixtures import inputs, make_artifact

from kiln.errors import ConfigError, ProvenanceError
from kiln.provenance import keys, sign_artifact, verify_artifact

PROD_DIR = keys.trusted_keys_env_name("production")
SANDBOX_DIR = keys.trusted_keys_env_name("sandbox")


@pytest.fixture(autouse=True)
def _no_trusted_dirs_from_the_caller(monkeypatch):
    for name in (PROD_DIR, SANDBOX_DIR, *keys.signing_key_env_names("production"),
                 *keys.signing_key_env_names("sandbox")):
        monkeypatch.delenv(name, raising=False)


def test_key_is_created_0600_from_its_first_byte_in_a_0700_folder(tmp_path, monkeypatch):
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *args, **kwargs):
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    old_umask = os.umask(0)  # a plain create would now give 0666: only the creation mode keeps it private
    try:
        key = keys.signing_key("production", tmp_path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(key.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(key.path.parent).st_mode) == 0o700
    creates = [(p, mode) for p, flags, mode in opened if flags & os.O_CREAT and "signing-key" in p]
    assert creates and all(mode == 0o600 for _, mode in creates)
    assert all(flags & os.O_EXCL for p, flags, _ in opened if flags & os.O_CREAT and "signing-key" in p)
    assert b"PRIVATE KEY" in key.path.read_bytes()


def test_key_is_made_once_and_its_public_half_trusted(tmp_path):
    first = keys.signing_key("production", tmp_path)
    pem = first.path.read_bytes()
    again = keys.signing_key("production", tmp_path)
    assert again.key_id == first.key_id and first.path.read_bytes() == pem
    assert list(keys.trusted_keys("production", tmp_path)) == [first.key_id]
    assert keys.key_id(first.load().public_key()) == first.key_id
    assert keys.trusted_key_file("production", first.key_id, tmp_path).is_file()


def test_trusted_sets_are_disjoint(tmp_path):
    sandbox = keys.signing_key("sandbox", tmp_path)
    production = keys.signing_key("production", tmp_path)
    assert sandbox.key_id != production.key_id
    assert keys.trusting_policy(sandbox.key_id, tmp_path) == "sandbox"
    pem = keys.trusted_key_file("sandbox", sandbox.key_id, tmp_path).read_bytes()
    with pytest.raises(ProvenanceError, match=f"key {sandbox.key_id} is trusted by policy sandbox"):
        keys.add_trusted_key("production", pem, tmp_path)
    # planted by hand: both sets are refused, not just one
    keys.trusted_key_file("production", sandbox.key_id, tmp_path).write_bytes(pem)
    for policy in ("production", "sandbox"):
        with pytest.raises(ProvenanceError, match="trusted by both"):
            keys.trusted_keys(policy, tmp_path)


def test_rotation_adds_a_key_and_keeps_the_old_ones(tmp_path):
    old = keys.signing_key("production", tmp_path)
    new = keys.rotate_signing_key("production", tmp_path)
    assert new.key_id != old.key_id and keys.signing_key("production", tmp_path).key_id == new.key_id
    assert set(keys.trusted_keys("production", tmp_path)) == {old.key_id, new.key_id}
    assert stat.S_IMODE(os.stat(new.path).st_mode) == 0o600


def test_a_trusted_file_must_hold_the_key_its_name_says(tmp_path):
    a = keys.signing_key("production", tmp_path)
    b = keys.rotate_signing_key("production", tmp_path)
    keys.trusted_key_file("production", a.key_id, tmp_path).write_bytes(
        keys.trusted_key_file("production", b.key_id, tmp_path).read_bytes())
    with pytest.raises(ProvenanceError, match=f"{a.key_id}.pem: holds key {b.key_id}"):
        keys.trusted_keys("production", tmp_path)


def test_unknown_policy_and_unusable_key_are_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown policy 'staging'"):
        keys.signing_key("staging", tmp_path)
    key = keys.signing_key("sandbox", tmp_path)
    key.path.write_text("not a key")
    with pytest.raises(ProvenanceError, match="signing-key.pem: not an unencrypted PEM private key"):
        keys.signing_key("sandbox", tmp_path)


def test_a_private_key_others_can_read_is_refused(tmp_path):
    key = keys.signing_key("production", tmp_path)
    key.path.chmod(0o640)
    with pytest.raises(ProvenanceError, match="mode 0640 lets others read it; it must be 0600"):
        keys.signing_key("production", tmp_path)


def _first_key(home):
    return keys.signing_key("production", home).key_id


def test_concurrent_first_signers_make_one_key(tmp_path):
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(4) as pool:
        ids = pool.map(_first_key, [tmp_path] * 8)
    assert len(set(ids)) == 1 and list(keys.trusted_keys("production", tmp_path)) == ids[:1]


# ------------------------------------------------------------------------ a trusted set from the deployment


def _public(key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    return keys.public_pem((key or ec.generate_private_key(ec.SECP256R1())).public_key())


def test_the_variable_is_named_like_the_signing_key_variables():
    assert PROD_DIR == "KILN_PRODUCTION_TRUSTED_KEYS_DIR" and SANDBOX_DIR == "KILN_SANDBOX_TRUSTED_KEYS_DIR"
    assert keys.signing_key_env_names("production")[0] == "KILN_PRODUCTION_SIGNING_KEY"
    assert keys.deployment_trusted_dir("production", {}) is None
    assert keys.deployment_trusted_dir("production", {PROD_DIR: ""}) is None
    with pytest.raises(ConfigError, match=f"{PROD_DIR}=trusted: not an absolute path"):
        keys.deployment_trusted_dir("production", {PROD_DIR: "trusted"})


def test_a_directory_set_is_what_verifies_and_kiln_homes_extra_key_is_not_trusted(tmp_path, monkeypatch, caplog):
    home = tmp_path / "home"
    a = keys.signing_key("production", home)
    signed_a = make_artifact(tmp_path / "a")
    sign_artifact(signed_a, inputs(), home=home)
    b = keys.rotate_signing_key("production", home)  # under KILN_HOME only (as a task could plant it there)
    signed_b = make_artifact(tmp_path / "b", salt="b")
    sign_artifact(signed_b, inputs(run_id="b"), home=home)
    folder = tmp_path / "deployment-trusted"
    folder.mkdir()
    (folder / "production-signing-key.pub.pem").write_bytes(  # any name: the id is computed
        keys.trusted_key_file("production", a.key_id, home).read_bytes())
    (folder / "README.md").write_text("not a .pem: not read")
    monkeypatch.setenv(PROD_DIR, str(folder))

    with caplog.at_level(logging.WARNING, logger="kiln.provenance.keys"):
        assert set(keys.trusted_keys("production", home)) == {a.key_id}
    assert [r for r in caplog.records if b.key_id in r.getMessage() and str(folder) in r.getMessage()], caplog.text
    assert keys.ignored_home_keys("production", home) == [b.key_id]
    assert keys.trusted_dir("production", home) == folder
    assert keys.trusted_key_file("production", a.key_id, home) == folder / "production-signing-key.pub.pem"
    assert keys.trusting_policy(a.key_id, home) == "production" and keys.trusting_policy(b.key_id, home) is None
    verified = verify_artifact(signed_a, "production", home=home)  # model.sig checked against the directory's file
    assert verified.statement_key_id == verified.model_sig_key_id == a.key_id
    with pytest.raises(ProvenanceError, match=f"signed by key {b.key_id} \\(a key no policy trusts\\), which policy "
                                              "production does not trust"):
        verify_artifact(signed_b, "production", home=home)
    # unset, the set under KILN_HOME is production's again
    monkeypatch.delenv(PROD_DIR)
    assert verify_artifact(signed_b, "production", home=home).statement_key_id == b.key_id


def test_a_directory_file_that_is_no_p256_public_key_or_a_missing_directory_is_refused_by_name(tmp_path, monkeypatch):
    home = tmp_path / "home"
    folder = tmp_path / "trusted"
    monkeypatch.setenv(PROD_DIR, str(folder))
    with pytest.raises(ProvenanceError, match=f"{PROD_DIR}={folder}: not a directory"):
        keys.trusted_keys("production", home)
    with pytest.raises(ProvenanceError, match=f"{PROD_DIR}={folder}: not a directory"):
        keys.trusted_keys("sandbox", home)  # sandbox's disjointness check reads production's set: fails closed too
    folder.mkdir()
    assert keys.trusted_keys("production", home) == {}
    (folder / "ok.pem").write_bytes(_public())
    cases = {"garbage.pem": (b"hunter2\n", "not a PEM public key"),
             "private.pem": (keys.generate_private_pem().encode(), "not a PEM public key"),
             "p384.pem": (_public(ec.generate_private_key(ec.SECP384R1())), "an EC key on curve secp384r1")}
    for name, (data, message) in cases.items():
        (folder / name).write_bytes(data)
        with pytest.raises(ProvenanceError, match=f"{folder / name} \\({PROD_DIR}\\): {message}"):
            keys.trusted_keys("production", home)
        (folder / name).unlink()
    assert len(keys.trusted_keys("production", home)) == 1


def test_writing_into_a_deployment_held_set_is_refused_naming_the_variable(tmp_path, monkeypatch):
    home = tmp_path / "home"
    folder = tmp_path / "trusted"
    folder.mkdir()
    held = _public()
    (folder / "held.pem").write_bytes(held)
    monkeypatch.setenv(PROD_DIR, str(folder))
    newcomer = _public()
    calls = {"add_trusted_key": lambda: keys.add_trusted_key("production", newcomer, home),
             "trust_deployment_key": lambda: keys.trust_deployment_key("production", newcomer, home),
             "trust_deployment_key(private)": lambda: keys.trust_deployment_key("production",
                                                                                keys.generate_private_pem(), home),
             "rotate_signing_key": lambda: keys.rotate_signing_key("production", home)}
    for name, call in calls.items():
        with pytest.raises(ConfigError) as refused:
            call()
        assert f"policy production's trusted keys are the deployment's ({PROD_DIR}={folder}): kiln does not write " \
               "them" in str(refused.value), (name, str(refused.value))
    assert [p.name for p in folder.iterdir()] == ["held.pem"] and (folder / "held.pem").read_bytes() == held
    assert not (home / "keys" / "production").exists(), "nothing written under KILN_HOME for production"
    kid = keys.add_trusted_key("sandbox", newcomer, home)  # the other policy's set, under KILN_HOME, is writable
    assert set(keys.trusted_keys("sandbox", home)) == {kid}


def test_disjointness_spans_a_directory_set_and_a_kiln_home_set(tmp_path, monkeypatch):
    home = tmp_path / "home"
    sandbox = keys.signing_key("sandbox", home)
    folder = tmp_path / "trusted"
    folder.mkdir()
    production = ec.generate_private_key(ec.SECP256R1())
    (folder / "production.pem").write_bytes(_public(production))
    pid = keys.key_id(production.public_key())
    monkeypatch.setenv(PROD_DIR, str(folder))
    assert keys.trusting_policy(pid, home) == "production" and keys.trusting_policy(sandbox.key_id, home) == "sandbox"
    with pytest.raises(ProvenanceError, match=f"key {pid} is trusted by policy production; it cannot also be trusted "
                                              "by sandbox"):
        keys.add_trusted_key("sandbox", _public(production), home)
    # planted by hand on either side: both sets are refused
    planted = keys.trusted_key_file("sandbox", pid, home)
    planted.write_bytes(_public(production))
    for policy in ("production", "sandbox"):
        with pytest.raises(ProvenanceError, match=f"key {pid} is trusted by both"):
            keys.trusted_keys(policy, home)
    planted.unlink()
    (folder / "sandbox-key.pem").write_bytes(keys.trusted_key_file("sandbox", sandbox.key_id, home).read_bytes())
    for policy in ("production", "sandbox"):
        with pytest.raises(ProvenanceError, match=f"key {sandbox.key_id} is trusted by both"):
            keys.trusted_keys(policy, home)


def test_with_a_directory_set_no_key_is_made_under_kiln_home_nor_the_old_one_used(tmp_path, monkeypatch):
    home = tmp_path / "home"
    old = keys.signing_key("production", home)  # made before the deployment held the set
    folder = tmp_path / "trusted"
    folder.mkdir()
    (folder / "old.pem").write_bytes(keys.public_pem(old.load().public_key()))
    monkeypatch.setenv(PROD_DIR, str(folder))
    assert keys.key_from_deployment("production", home) and not keys.key_from_deployment("sandbox", home)
    with pytest.raises(ConfigError, match=f"policy production's trusted keys are the deployment's \\({PROD_DIR}="
                                          f"{folder}\\), so its signing key must come from the deployment too, and "
                                          "none reached this process: .*kiln makes none under KILN_HOME"):
        keys.signing_key("production", home)
    old.path.unlink()
    with pytest.raises(ConfigError, match="none reached this process"):
        keys.signing_key("production", home)
    assert not old.path.exists(), "kiln made a production key under KILN_HOME"
    # sandbox, whose set is not the deployment's, still gets its key made under KILN_HOME
    assert keys.signing_key("sandbox", home).path == home / "keys" / "sandbox" / keys.PRIVATE_KEY_FILE

"""``kiln keys trust|list``: provisioning of a key the deployment holds, as docker/README.md has the operator do it.

The pair is made by the real ``openssl`` binary with the README's commands; the public half is trusted
with ``kiln keys trust``; a statement is then signed with ``KILN_PRODUCTION_SIGNING_KEY_FILE`` naming the
0400 private key and verified with production's trusted keys. Every refusal is one error line naming
the file, with the CLI's exit code, and writes nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from provenance_fixtures import inputs, make_artifact

from kiln.cli import main
from kiln.errors import ConfigError, ProvenanceError
from kiln.provenance import keys, sign_artifact, verify_artifact

PROD_PEM, PROD_FILE = keys.signing_key_env_names("production")
PROD_DIR = keys.trusted_keys_env_name("production")

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl binary is not installed")


@pytest.fixture(autouse=True)
def _no_deployment_keys_from_the_caller(monkeypatch):
    for name in (PROD_PEM, PROD_FILE, *keys.signing_key_env_names("sandbox"), "AIRFLOW_CONN_KILN_SIGNING_PRODUCTION",
                 "AIRFLOW_CONN_KILN_SIGNING_SANDBOX", PROD_DIR, keys.trusted_keys_env_name("sandbox")):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    return tmp_path / "kiln"


def openssl(*argv: str) -> None:
    subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=60)


def make_pair(folder: Path, name: str = "production-signing-key", curve: str = "P-256") -> tuple[Path, Path]:
    """docker/README.md's commands: the private key, its public half, the private key 0400."""
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", f"ec_paramgen_curve:{curve}", "-out", str(private))
    openssl("pkey", "-in", str(private), "-pubout", "-out", str(public))
    private.chmod(0o400)
    return private, public


def kiln(capsys, *argv: str) -> tuple[int, dict | list | None, list[str]]:
    """``kiln`` in this process: exit code, its JSON on stdout (None when none), its stderr lines."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err.splitlines()


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def private_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]


def test_trusted_with_kiln_keys_a_0400_key_file_signs_and_verifies_as_production(tmp_path, home, monkeypatch, capsys):
    private, public = make_pair(tmp_path / "secrets")
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "production", str(public))
    assert code == 0 and err == [], err
    kid = out["key_id"]
    assert out == {"policy": "production", "key_id": kid, "deployment": True}
    assert keys.key_from_deployment("production", home) and set(keys.trusted_keys("production", home)) == {kid}
    marker = json.loads((home / "keys" / "production" / keys.DEPLOYMENT_MARKER).read_text())
    assert marker["source"] == str(public)

    monkeypatch.setenv(PROD_FILE, str(private))
    art = make_artifact(tmp_path / "art")
    signed = sign_artifact(art, inputs(), home=home)
    verified = verify_artifact(art, "production", home=home)
    assert signed.key_id == verified.statement_key_id == verified.model_sig_key_id == kid
    assert verified.statement["predicate"]["buildDefinition"]["internalParameters"]["policy"] == "production"
    assert private_files(home) == [], "kiln wrote a private key under KILN_HOME"

    code, listed, _ = kiln(capsys, "keys", "list")
    assert code == 0 and {e["policy"]: e for e in listed}["production"] == {
        "policy": "production", "deployment": True, "trusted": [kid], "private_key_in_kiln_home": False}
    code, listed, _ = kiln(capsys, "keys", "list", "--policy", "sandbox")
    assert listed == [{"policy": "sandbox", "deployment": False, "trusted": [], "private_key_in_kiln_home": False}]


def test_trusting_the_private_key_writes_its_public_half_only(tmp_path, home, capsys):
    private, public = make_pair(tmp_path / "secrets")
    code, by_private, _ = kiln(capsys, "keys", "trust", "--policy", "production", str(private))
    assert code == 0 and private_files(home) == []
    before = tree(home)
    code, by_public, _ = kiln(capsys, "keys", "trust", "--policy", "production", str(public))
    assert code == 0 and by_public["key_id"] == by_private["key_id"]
    trusted = keys.trusted_key_file("production", by_public["key_id"], home).read_bytes()
    assert trusted == public.read_bytes()
    assert {k for k in tree(home) if not k.endswith(keys.DEPLOYMENT_MARKER)} == \
        {k for k in before if not k.endswith(keys.DEPLOYMENT_MARKER)}  # the same key: nothing new trusted


def test_a_key_file_others_can_read_is_refused(tmp_path, home, monkeypatch, capsys):
    private, public = make_pair(tmp_path / "secrets")
    assert kiln(capsys, "keys", "trust", "--policy", "production", str(public))[0] == 0
    private.chmod(0o440)
    monkeypatch.setenv(PROD_FILE, str(private))
    with pytest.raises(ProvenanceError, match=f"signing key {private}: mode 0440 lets others read it"):
        sign_artifact(make_artifact(tmp_path / "art"), inputs(), home=home)
    private.chmod(0o400)
    assert keys.signing_key("production", home).path == private


def test_an_untrusted_key_file_is_refused_and_none_is_made_in_its_place(tmp_path, home, monkeypatch, capsys):
    _, public = make_pair(tmp_path / "secrets")
    other, _ = make_pair(tmp_path / "elsewhere")
    assert kiln(capsys, "keys", "trust", "--policy", "production", str(public))[0] == 0
    monkeypatch.setenv(PROD_FILE, str(other))
    with pytest.raises(ProvenanceError, match=rf"{PROD_FILE} \({other}\): key [0-9a-f]{{64}} is not in policy "
                                              "production's trusted set"):
        sign_artifact(make_artifact(tmp_path / "art"), inputs(), home=home)
    monkeypatch.delenv(PROD_FILE)
    with pytest.raises(ConfigError, match="comes from the deployment .* none reached this process"):
        keys.signing_key("production", home)
    assert private_files(home) == []


def _garbage(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.pem"
    path.write_bytes(b"hunter2 hunter2\n")
    return path


def _encrypted(tmp_path: Path) -> Path:
    private, _ = make_pair(tmp_path / "enc")
    path = tmp_path / "encrypted.pem"
    openssl("pkey", "-in", str(private), "-aes256", "-passout", "pass:a passphrase", "-out", str(path))
    return path


def _p384(tmp_path: Path) -> Path:
    return make_pair(tmp_path / "p384", curve="P-384")[1]


def _certificate(tmp_path: Path) -> Path:
    private, _ = make_pair(tmp_path / "cert")
    path = tmp_path / "cert.pem"
    openssl("req", "-new", "-x509", "-key", str(private), "-subj", "/CN=kiln", "-days", "1", "-out", str(path))
    return path


@pytest.mark.parametrize("make,message", [
    (lambda t: t / "missing.pem", "No such file or directory"),
    (_garbage, "not a PEM key"),
    (_encrypted, "an encrypted private key"),
    (_p384, "an EC key on curve secp384r1; kiln signs with ECDSA P-256"),
    (_certificate, "holds a certificate"),
], ids=["missing", "garbage", "encrypted", "p384", "certificate"])
def test_trust_refuses_what_is_no_p256_key_naming_the_file_exit_2_nothing_written(tmp_path, home, capsys, make,
                                                                                   message):
    path = make(tmp_path)
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "production", str(path))
    assert (code, out) == (2, None)
    assert len(err) == 1 and err[0].startswith(f"kiln keys trust: error: {path}: ") and message in err[0], err
    assert tree(home) == {}


def test_trust_refuses_a_key_the_other_policy_trusts_exit_1_nothing_written(tmp_path, home, capsys):
    _, public = make_pair(tmp_path / "secrets")
    assert kiln(capsys, "keys", "trust", "--policy", "sandbox", str(public))[0] == 0
    before = tree(home)
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "production", str(public))
    assert (code, out) == (1, None)
    assert len(err) == 1 and err[0].startswith(f"kiln keys trust: error: {public}: key ") and \
        "is trusted by policy sandbox" in err[0], err
    assert tree(home) == before and not keys.key_from_deployment("production", home)


def test_trust_notes_a_private_key_kiln_made_under_kiln_home_before(tmp_path, home, capsys):
    """A stack upgraded to a deployment key: the key its workers made under KILN_HOME is still there."""
    old = keys.signing_key("production", home)
    _, public = make_pair(tmp_path / "secrets")
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "production", str(public))
    assert code == 0 and out["deployment"] is True
    assert len(err) == 1 and err[0].startswith(f"kiln keys trust: note: {old.path} still holds a private key"), err
    code, listed, _ = kiln(capsys, "keys", "list", "--policy", "production")
    assert listed[0]["private_key_in_kiln_home"] is True and set(listed[0]["trusted"]) == {old.key_id, out["key_id"]}


def _deployment_folder(tmp_path: Path) -> tuple[Path, Path, Path]:
    """docker/README.md's layout: the private key in secrets/, its public half in secrets/production-trusted/."""
    private, public = make_pair(tmp_path / "secrets")
    folder = tmp_path / "secrets" / "production-trusted"
    folder.mkdir()
    trusted = folder / public.name
    public.rename(trusted)
    return private, trusted, folder


def test_with_the_deployments_trusted_folder_a_0400_key_file_signs_and_list_names_the_folder(tmp_path, home,
                                                                                              monkeypatch, capsys):
    old = keys.signing_key("production", home)  # a key a stack made under KILN_HOME before: now ignored
    private, _trusted, folder = _deployment_folder(tmp_path)
    monkeypatch.setenv(PROD_DIR, str(folder))
    monkeypatch.setenv(PROD_FILE, str(private))
    art = make_artifact(tmp_path / "art")
    signed = sign_artifact(art, inputs(), home=home)
    assert verify_artifact(art, "production", home=home).model_sig_key_id == signed.key_id != old.key_id

    code, listed, err = kiln(capsys, "keys", "list")
    assert code == 0
    entries = {e["policy"]: e for e in listed}
    assert entries["production"] == {
        "policy": "production", "deployment": True, "trusted": [signed.key_id], "private_key_in_kiln_home": True,
        "trusted_from": PROD_DIR, "trusted_dir": str(folder), "ignored_in_kiln_home": [old.key_id]}
    assert "trusted_from" not in entries["sandbox"]
    assert f"kiln keys list: policy production trusts the keys in {folder} ({PROD_DIR}, the deployment's)" in err, err
    assert f"kiln keys list: policy sandbox trusts the keys in {home / 'keys' / 'sandbox' / 'trusted'} (KILN_HOME)" \
        in err, err


def test_trust_into_the_deployments_trusted_folder_is_refused_one_line_exit_2_nothing_written(tmp_path, home,
                                                                                               capsys, monkeypatch):
    _private, trusted, folder = _deployment_folder(tmp_path)
    _, newcomer = make_pair(tmp_path / "newcomer")
    monkeypatch.setenv(PROD_DIR, str(folder))
    before = tree(folder)
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "production", str(newcomer))
    assert (code, out) == (2, None)
    assert len(err) == 1 and err[0].startswith(f"kiln keys trust: error: policy production's trusted keys are the "
                                               f"deployment's ({PROD_DIR}={folder})") and str(newcomer) in err[0], err
    assert tree(folder) == before and tree(home) == {}
    # the other policy's set is still trusted with kiln keys, and a key the folder holds is refused for it
    code, out, err = kiln(capsys, "keys", "trust", "--policy", "sandbox", str(trusted))
    assert (code, out) == (1, None) and "is trusted by policy production" in err[0], err
    assert kiln(capsys, "keys", "trust", "--policy", "sandbox", str(newcomer))[0] == 0

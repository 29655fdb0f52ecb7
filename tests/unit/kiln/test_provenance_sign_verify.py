"""Signing and verifying an artifact directory with real keys (model-signing's model.sig and kiln's DSSE
envelope): every tamper fails, and the message names it."""

from __future__ import annotations

import base64
import json
import shutil

import pytest
from provenance_fixtures import inputs, make_artifact

from kiln.cli import main
from kiln.errors import ProvenanceError
from kiln.provenance import keys, sign_artifact, verify_artifact
from kiln.provenance.sign import PAYLOAD_TYPE, pae
from kiln.provenance.statement import MODEL_SIGNATURE_FILE, PROVENANCE_FILE, build_statement


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def signed(tmp_path, home):
    art = make_artifact(tmp_path / "art")
    sign_artifact(art, inputs(), home=home)
    return art


def test_pae_is_dsse_v1():
    assert pae("http://example.com/HelloWorld", b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    from securesystemslib.dsse import Envelope  # an independent implementation of the spec

    payload = "é ünicode".encode()
    envelope = Envelope(payload=payload, payload_type=PAYLOAD_TYPE, signatures={})
    assert envelope.pae() == pae(PAYLOAD_TYPE, payload)


def test_sign_then_verify_returns_the_statement(signed, home):
    verified = verify_artifact(signed, "production", home=home)
    assert verified.statement == build_statement(signed, inputs())
    only_key = keys.signing_key("production", home).key_id
    assert verified.statement_key_id == verified.model_sig_key_id == only_key
    envelope = json.loads((signed / PROVENANCE_FILE).read_bytes())
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    assert envelope["signatures"][0]["keyid"] == only_key
    assert json.loads(base64.b64decode(envelope["payload"])) == verified.statement
    bundle = json.loads((signed / MODEL_SIGNATURE_FILE).read_bytes())
    signed_files = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert PROVENANCE_FILE in {s["name"] for s in signed_files["predicate"]["resources"]}  # model.sig covers it


def test_a_changed_byte_names_the_file(signed, home):
    weights = signed / "artifacts" / "hf_model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ProvenanceError, match=r"artifacts/hf_model/model.safetensors changed \(signed sha256"):
        verify_artifact(signed, "production", home=home)


def test_an_added_file_is_named(signed, home):
    (signed / "code" / "kiln_trainer" / "evil.py").write_text("import os\n")
    with pytest.raises(ProvenanceError, match=r"code/kiln_trainer/evil.py added \(not in the signed statement\)"):
        verify_artifact(signed, "production", home=home)


def test_a_removed_file_is_named(signed, home):
    (signed / "artifacts" / "recipe.json").unlink()
    with pytest.raises(ProvenanceError, match="artifacts/recipe.json missing"):
        verify_artifact(signed, "production", home=home)


def test_a_missing_signature_is_named(signed, home):
    (signed / MODEL_SIGNATURE_FILE).unlink()
    with pytest.raises(ProvenanceError, match="unsigned: model.sig missing"):
        verify_artifact(signed, "production", home=home)


def test_a_model_sig_from_another_signing_is_refused(tmp_path, signed, home):
    other = make_artifact(tmp_path / "other", salt="another checkpoint")
    sign_artifact(other, inputs(run_id="other"), home=home)  # same policy, same key
    shutil.copy(other / MODEL_SIGNATURE_FILE, signed / MODEL_SIGNATURE_FILE)
    expected = (r"model.sig \(key [0-9a-f]{64}, policy production\) does not match the files of .*: "
                r"MLmodel changed \(signed sha256 [0-9a-f]{64}, now [0-9a-f]{64}\); artifacts/hf_model/model.safetensors changed")
    with pytest.raises(ProvenanceError, match=expected):
        verify_artifact(signed, "production", home=home)


def test_a_statement_of_another_artifact_is_refused(tmp_path, signed, home):
    other = make_artifact(tmp_path / "other", salt="another checkpoint")
    sign_artifact(other, inputs(run_id="other"), home=home)
    shutil.copy(other / PROVENANCE_FILE, signed / PROVENANCE_FILE)
    with pytest.raises(ProvenanceError, match="does not match its signed statement: MLmodel changed"):
        verify_artifact(signed, "production", home=home)


def test_an_edited_statement_fails_its_signature(signed, home):
    envelope = json.loads((signed / PROVENANCE_FILE).read_bytes())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["buildDefinition"]["externalParameters"]["seed"] = 1
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (signed / PROVENANCE_FILE).write_text(json.dumps(envelope))
    with pytest.raises(ProvenanceError, match=r"provenance.dsse.json: the signature by key [0-9a-f]{64} \(policy "
                                              r"production\) does not verify"):
        verify_artifact(signed, "production", home=home)


def test_sandbox_signed_is_not_production(tmp_path, home):
    art = make_artifact(tmp_path / "sandbox-art")
    sign_artifact(art, inputs(policy="sandbox", dag_id="kiln_sandbox"), home=home)
    with pytest.raises(ProvenanceError, match="policy production trusts no key: .*/keys/production/trusted holds no"):
        verify_artifact(art, "production", home=home)
    keys.signing_key("production", home)  # production has keys, just not this one
    assert verify_artifact(art, "sandbox", home=home).policy == "sandbox"
    sandbox_kid = keys.signing_key("sandbox", home).key_id
    with pytest.raises(ProvenanceError, match=f"provenance.dsse.json is signed by key {sandbox_kid} "
                                              r"\(a key of policy sandbox\), which policy production does not trust"):
        verify_artifact(art, "production", home=home)


def test_a_sandbox_model_sig_beside_a_production_statement_is_named(tmp_path, signed, home):
    twin = tmp_path / "twin"
    shutil.copytree(signed, twin)
    sign_artifact(twin, inputs(policy="sandbox", dag_id="kiln_sandbox"), home=home)
    shutil.copy(twin / MODEL_SIGNATURE_FILE, signed / MODEL_SIGNATURE_FILE)
    with pytest.raises(ProvenanceError, match=r"model.sig is signed by key [0-9a-f]{64} \(a key of policy sandbox\)"):
        verify_artifact(signed, "production", home=home)


def test_a_rotated_key_still_verifies_old_signatures(tmp_path, signed, home):
    old = keys.signing_key("production", home).key_id
    new = keys.rotate_signing_key("production", home).key_id
    fresh = make_artifact(tmp_path / "fresh", salt="after rotation")
    sign_artifact(fresh, inputs(run_id="later"), home=home)
    assert verify_artifact(signed, "production", home=home).statement_key_id == old
    assert verify_artifact(fresh, "production", home=home).statement_key_id == new
    keys.trusted_key_file("production", old, home).unlink()  # retiring the old key
    with pytest.raises(ProvenanceError, match=f"signed by key {old} \\(a key no policy trusts\\)"):
        verify_artifact(signed, "production", home=home)


def test_cli_prints_the_lineage_and_fails_closed_with_one_error_line(signed, home, monkeypatch, capsys):
    monkeypatch.setenv("KILN_HOME", str(home))
    assert main(["verify", "--dir", str(signed), "--policy", "production"]) == 0
    out = capsys.readouterr().out
    assert "verified for policy production" in out
    assert "trained 12 steps, seed 1337, world size 2, strategy ddp" in out
    assert "from snapshot snapshot:stdlib-py (md5 0123456789abcdef0123456789abcdef)" in out
    assert main(["verify", "--dir", str(signed), "--policy", "production", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicateType"] == "https://slsa.dev/provenance/v1"
    (signed / "MLmodel").write_text("changed")
    assert main(["verify", "--dir", str(signed), "--policy", "production"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln verify: error: ") and "MLmodel changed" in lines[0]


def _edit_bundle(art, edit):
    bundle = json.loads((art / MODEL_SIGNATURE_FILE).read_bytes())
    edit(bundle)
    (art / MODEL_SIGNATURE_FILE).write_text(json.dumps(bundle))


def test_an_edited_model_sig_fails_closed(signed, home):
    original = (signed / MODEL_SIGNATURE_FILE).read_bytes()

    def drop_a_file(bundle):
        envelope = bundle["dsseEnvelope"]
        payload = json.loads(base64.b64decode(envelope["payload"]))
        payload["predicate"]["resources"] = payload["predicate"]["resources"][1:]
        envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()

    _edit_bundle(signed, drop_a_file)
    with pytest.raises(ProvenanceError, match="model.sig: the signature by key .* does not verify"):
        verify_artifact(signed, "production", home=home)
    (signed / MODEL_SIGNATURE_FILE).write_bytes(original)
    _edit_bundle(signed, lambda bundle: bundle["dsseEnvelope"].update(signatures=[]))
    with pytest.raises(ProvenanceError, match=r"model.sig: not a valid model-signing bundle \(IndexError"):
        verify_artifact(signed, "production", home=home)
    (signed / MODEL_SIGNATURE_FILE).write_bytes(original)
    _edit_bundle(signed, lambda bundle: bundle.pop("dsseEnvelope"))
    with pytest.raises(ProvenanceError, match="model.sig: model-signing refused it") as refused:
        verify_artifact(signed, "production", home=home)
    assert "\n" not in str(refused.value)
    (signed / PROVENANCE_FILE).write_text("not json")
    with pytest.raises(ProvenanceError, match="provenance.dsse.json: not JSON"):
        verify_artifact(signed, "production", home=home)
    (signed / PROVENANCE_FILE).write_text('{"payload": 1, "payloadType": "application/vnd.in-toto+json"}')
    with pytest.raises(ProvenanceError, match="provenance.dsse.json: not a DSSE envelope"):
        verify_artifact(signed, "production", home=home)


def test_a_statement_of_another_policy_signed_with_this_policys_key_is_refused(signed, home):
    from kiln.provenance.sign import dsse_envelope
    from kiln.provenance.statement import statement_bytes
    from kiln_trainer.contract import canonical_json

    statement = build_statement(signed, inputs(policy="sandbox", dag_id="kiln_sandbox"))
    envelope = dsse_envelope(statement_bytes(statement), keys.signing_key("production", home))
    (signed / PROVENANCE_FILE).write_bytes(canonical_json(envelope))
    with pytest.raises(ProvenanceError, match="the statement is of a sandbox build, verified as production"):
        verify_artifact(signed, "production", home=home)


@pytest.mark.parametrize(("ref", "parsed"), [
    ("kiln-stdlib-lm@champion", ("kiln-stdlib-lm", "alias", "champion")),
    ("kiln-stdlib-lm.candidates/12", ("kiln-stdlib-lm.candidates", "version", "12")),
    ("team/model@prod", ("team/model", "alias", "prod")),
])
def test_cli_reads_both_registry_reference_forms(ref, parsed):
    from kiln.cli.verify import parse_version_ref

    assert parse_version_ref(ref) == parsed


@pytest.mark.parametrize("argv", [["verify", "model"], ["verify", "model/v1"], ["verify", "@champion"],
                                  ["verify"], ["verify", "--dir", "."], ["verify", "m/1", "--dir", "."]])
def test_cli_refuses_a_bad_reference_or_both_forms_before_any_request(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("kiln verify: error: ")

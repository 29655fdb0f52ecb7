"""Signed provenance wired into the registry, against a real ``mlflow server``: registration signs
every version before upload, ``promote`` refuses a candidate that does not verify (nothing moves),
``kiln verify MODEL@ALIAS|MODEL/VERSION`` names each mismatch, ``kiln audit`` reports every
version's tags against its signed statement, and ``kiln export`` (the text model a user loads)
verifies first. The tampering is done where an attacker with write access would: in the server's
artifact store and on the version's tags."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kiln import registry
from kiln.cli import main as kiln_main
from kiln.errors import ProvenanceError
from kiln.policy import POLICIES
from kiln.provenance import from_registration, sign_artifact, verify_artifact
from kiln.provenance.keys import signing_key
from kiln.provenance.statement import MODEL_SIGNATURE_FILE, PROVENANCE_FILE
from kiln.refs import sha256_file
from kiln.registry.verify import logged_model_id, verify_version
from kiln_trainer import checkpoint_manifest

from test_registry_mlflow import (  # tests/integration is on sys.path
    _refs_of,
    approve,
    build_manifest,
    make_candidate,
    production_policy,
    sandbox_policy,
    write_real_checkpoint,
)


def _register(tmp_path: Path, policy: Any, name: str, bpb: float, unique: str, **kw: Any) -> tuple[Any, dict, str]:
    cand = make_candidate(tmp_path, name, bpb)
    key = f"kiln_production/{name}-{unique}"
    ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs(), **kw)
    return cand, ref, key


def _stored_dir(mlflow_server: Any, client: Any, model: str, version: str) -> Path:
    """The version's model directory in the server's artifact store (what an attacker with write access edits)."""
    model_id = logged_model_id(client.get_model_version(model, version))
    assert model_id.startswith("m-"), model_id
    found = [p for p in Path(mlflow_server.artifacts).rglob(model_id) if p.is_dir()]
    assert len(found) == 1, found
    stored = found[0] / "artifacts"
    assert (stored / "MLmodel").is_file(), sorted(p.name for p in found[0].iterdir())
    return stored


def _promote(policy: Any, cand: Any, ref: dict, key: str) -> Any:
    decision = registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
    return registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)


def _download(client: Any, model: str, version: str, into: Path) -> Path:
    import mlflow

    return Path(mlflow.artifacts.download_artifacts(f"models:/{model}/{version}", dst_path=str(into)))


def test_registration_signs_the_model_directory_before_upload(tmp_path, client, unique_name, logged_models):
    policy = production_policy(unique_name)
    report = tmp_path / "quarantine-report.json"
    report.write_text(json.dumps({"kind": "kiln.QuarantineReport", "contract_sha256": "c" * 64}))
    cand, ref, key = _register(tmp_path, policy, "a", 3.0, unique_name, records=registry.RunRecords(
        quarantine_report=str(report), contract_suite_sha256="c" * 64, launcher="local"))
    local = _download(client, policy.candidate_model, ref["version"], tmp_path / "dl")
    assert (local / PROVENANCE_FILE).is_file() and (local / MODEL_SIGNATURE_FILE).is_file()
    (local / "registered_model_meta").unlink()  # written by MLflow's registration, after upload
    verified = verify_artifact(local, "production")  # the uploaded bytes are the signed ones
    statement = verified.statement
    assert {"MLmodel", "python_model.pkl"} <= {s["name"] for s in statement["subject"]}
    build = statement["predicate"]["buildDefinition"]
    assert build["internalParameters"]["policy"] == "production"
    # what the stages do not record yet; this checkpoint (format 1) records no tokenizer digest
    assert build["internalParameters"]["unrecorded"] == ["tokenizer_sha256", "nodes", "startedOn", "finishedOn"]
    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    assert deps["quarantine-report"]["digest"] == {"sha256": sha256_file(report)}
    assert deps["contract:stdlib-py@1"]["digest"] == {"sha256": "c" * 64}
    assert statement["predicate"]["runDetails"]["metadata"]["invocationId"] == key
    mv = client.get_model_version(policy.candidate_model, ref["version"])
    # the signed MLmodel is this version's logged model, and the tags agree with the statement
    checked = verify_version(client, mv, "production")
    assert checked.statement == statement
    assert mv.tags["kiln.weights_sha256"] == cand.train.weights_sha256


def test_a_version_registered_without_the_stage_records_says_what_is_unrecorded(
        tmp_path, client, unique_name, logged_models):
    policy = production_policy(unique_name)
    _cand, ref, _key = _register(tmp_path, policy, "a", 3.0, unique_name)
    local = _download(client, policy.candidate_model, ref["version"], tmp_path / "dl")
    (local / "registered_model_meta").unlink()
    statement = verify_artifact(local, "production").statement
    unrecorded = statement["predicate"]["buildDefinition"]["internalParameters"]["unrecorded"]
    # this checkpoint (format 1, the byte stream before tokenizers) records no tokenizer digest either
    assert unrecorded == ["contract_suite_sha256", "quarantine_report", "tokenizer_sha256", "nodes", "startedOn",
                          "finishedOn"]
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["quarantine-report"]["digest"] == {} and deps["quarantine-report"]["annotations"] == {"recorded": False}


def _edit_a_stored_file(stored: Path, **_: Any) -> None:
    with open(stored / "MLmodel", "a") as fh:
        fh.write("# edited\n")


def _swap_model_sig(stored: Path, other: Path, **_: Any) -> None:
    shutil.copyfile(other / MODEL_SIGNATURE_FILE, stored / MODEL_SIGNATURE_FILE)


def _sign_as_sandbox(stored: Path, cand: Any, key: str, **_: Any) -> None:
    """Re-sign the stored directory with sandbox's key and a sandbox statement of the same inputs."""
    for name in (MODEL_SIGNATURE_FILE, PROVENANCE_FILE):
        (stored / name).unlink()
    step_dir = cand.train.checkpoint
    decision = registry.decide(cand.eval_report, None, production_policy("x").gate)
    inputs = from_registration(
        policy="sandbox", run_key=key, train=cand.train, eval_report=cand.eval_report, snapshot=cand.snapshot,
        manifest=cand.manifest, verified=checkpoint_manifest.verify_checkpoint(step_dir), decision=decision,
        contract_suite_sha256="", quarantine_report=None, launcher="local", nodes=(), started_on="", finished_on="")
    sign_artifact(stored, inputs)


@pytest.mark.parametrize(("tamper", "names"), [
    (_edit_a_stored_file, r"MLmodel changed \(signed sha256 [0-9a-f]{64}, now [0-9a-f]{64}\)"),
    (_swap_model_sig, r"model\.sig .*does not match the files"),
    (_sign_as_sandbox, r"signed by key [0-9a-f]{64} \(a key of policy sandbox\), which policy production does not trust"),
    ("tag", r"tag kiln\.snapshot_id is '0{32}\.dir', the signed statement says '[0-9a-f]{32}\.dir'"),
])
def test_promote_refuses_a_candidate_that_does_not_verify_and_moves_nothing(
        tmp_path, client, unique_name, logged_models, mlflow_server, writes, tamper, names):
    policy = production_policy(unique_name)
    other_cand, other_ref, _ = _register(tmp_path / "o", policy, "other", 3.1, unique_name)
    cand, ref, key = _register(tmp_path, policy, "a", 3.0, unique_name)
    stored = _stored_dir(mlflow_server, client, policy.candidate_model, ref["version"])
    if tamper == "tag":
        client.set_model_version_tag(policy.candidate_model, ref["version"], "kiln.snapshot_id", "0" * 32 + ".dir")
    else:
        tamper(stored, other=_stored_dir(mlflow_server, client, policy.candidate_model, other_ref["version"]),
               cand=cand, key=key)
    approve(policy, ref, key, "alice")
    writes.clear()
    with pytest.raises(ProvenanceError, match=names):
        _promote(policy, cand, ref, key)
    assert writes == [], "nothing moves"
    assert registry.champion_report(policy) is None
    assert not list(client.search_model_versions(f"name = '{policy.target_model}'"))


def test_an_untouched_candidate_promotes_and_the_champion_verifies(
        tmp_path, client, unique_name, logged_models, capsys):
    policy = production_policy(unique_name)
    cand, ref, key = _register(tmp_path, policy, "a", 3.0, unique_name)
    approve(policy, ref, key, "alice")
    record = _promote(policy, cand, ref, key)
    capsys.readouterr()
    for reference in (f"{policy.target_model}@champion", f"{policy.target_model}/{record.version}",
                      f"{policy.candidate_model}/{ref['version']}"):
        assert kiln_main(["verify", reference]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "verified for policy production" in out and "its tags and logged model agree" in out
        assert f"run {key.split('/', 1)[1]}" in out and "gate decision: promote" in out
    signing_key("sandbox")  # as on a stack where sandbox has registered: a key of its own, trusted by it only
    assert kiln_main(["verify", f"{policy.target_model}@champion", "--policy", "sandbox"]) == 1
    assert "a key of policy production" in capsys.readouterr().err


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert kiln_main(argv) == 1
    return capsys.readouterr().err


def test_kiln_verify_names_each_mismatch(tmp_path, client, unique_name, logged_models, mlflow_server, capsys):
    policy = production_policy(unique_name)
    model = policy.candidate_model
    _a, ref_a, _ = _register(tmp_path / "a", policy, "a", 3.0, unique_name)
    _b, ref_b, _ = _register(tmp_path / "b", policy, "b", 3.1, unique_name)
    _c, ref_c, key_c = _register(tmp_path / "c", policy, "c", 3.2, unique_name)
    _d, ref_d, _ = _register(tmp_path / "d", policy, "d", 3.3, unique_name)
    a, b, c, d = (ref["version"] for ref in (ref_a, ref_b, ref_c, ref_d))
    capsys.readouterr()

    # an edited tag
    client.set_model_version_tag(model, a, "kiln.weights_sha256", "f" * 64)
    assert f"tag kiln.weights_sha256 is '{'f' * 64}', the signed statement says" in _cli_error(
        capsys, ["verify", f"{model}/{a}"])
    # a changed byte in the artifact store
    stored_b = _stored_dir(mlflow_server, client, model, b)
    pkl = stored_b / "python_model.pkl"
    data = bytearray(pkl.read_bytes())
    data[len(data) // 2] ^= 1
    pkl.write_bytes(bytes(data))
    assert "python_model.pkl changed (signed sha256" in _cli_error(capsys, ["verify", f"{model}/{b}"])
    # a statement (and all files) of another version: everything verifies but the records
    stored_c, stored_d = (_stored_dir(mlflow_server, client, model, v) for v in (c, d))
    shutil.rmtree(stored_c)
    shutil.copytree(stored_d, stored_c)
    err = _cli_error(capsys, ["verify", f"{model}/{c}"])
    assert f"tag kiln.run_key is '{key_c}', the signed statement says" in err and "the signed MLmodel is of logged model" in err
    # a model.sig of another version
    shutil.copyfile(_stored_dir(mlflow_server, client, model, a) / MODEL_SIGNATURE_FILE, stored_d / MODEL_SIGNATURE_FILE)
    assert "model.sig (key" in _cli_error(capsys, ["verify", f"{model}/{d}"])
    # references that are not one
    assert kiln_main(["verify", f"{model}@nobody"]) == 1
    assert "has no version with alias 'nobody'" in capsys.readouterr().err
    assert kiln_main(["verify", "no-ref-here"]) == 2
    assert kiln_main(["verify", f"{model}/{a}", "--dir", str(tmp_path)]) == 2


# ------------------------------------------------------------------------------------- kiln audit


def _register_unsigned(client: Any, model: str) -> str:
    """A version as registered before kiln signed versions: a logged pyfunc model, no signature files."""
    import mlflow

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    experiment = client.create_experiment(f"unsigned-{model}")
    with mlflow.start_run(experiment_id=experiment):
        uri = mlflow.pyfunc.log_model(name="model", python_model=Echo(), pip_requirements=[]).model_uri
    return str(mlflow.register_model(uri, model).version)


def test_kiln_audit_reports_each_versions_provenance_and_fails_on_a_disagreement(
        tmp_path, client, unique_name, logged_models, mlflow_server, monkeypatch, capsys):
    policy = production_policy(unique_name)
    monkeypatch.setitem(POLICIES, "production", policy)  # the policy that owns the test's model names
    target, candidates = policy.target_model, policy.candidate_model
    cand_a, ref_a, key_a = _register(tmp_path / "a", policy, "a", 3.0, unique_name)
    _b, ref_b, _ = _register(tmp_path / "b", policy, "b", 3.1, unique_name)
    approve(policy, ref_a, key_a, "alice")
    champion = _promote(policy, cand_a, ref_a, key_a).version
    old = _register_unsigned(client, candidates)
    a, b = ref_a["version"], ref_b["version"]
    capsys.readouterr()

    # Untouched: each signed version agrees; the one from before signing is reported, and passes.
    assert kiln_main(["audit", target]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "champion - -> 1" in out and "review: approved" in out, "the events, as before"
    assert re.findall(r"^  (\S+)  (\w+)", out, re.M) == [
        (f"{target}/{champion}", "agrees"), (f"{candidates}/{a}", "agrees"), (f"{candidates}/{b}", "agrees"),
        (f"{candidates}/{old}", "unsigned")]
    assert kiln_main(["audit", target, "--require-signed"]) == 1
    assert f"kiln audit: error: 1 version(s) failed the provenance audit: {candidates}/{old} (unsigned)" in (
        capsys.readouterr().err)

    # Tampered: a tag edited on the champion, a byte changed in candidate b's stored files.
    client.set_model_version_tag(target, champion, "kiln.weights_sha256", "f" * 64)
    with open(_stored_dir(mlflow_server, client, candidates, b) / "MLmodel", "a") as fh:
        fh.write("# edited\n")
    assert kiln_main(["audit", target]) == 1
    captured = capsys.readouterr()
    assert "champion - -> 1" in captured.out, "the whole report is printed"
    assert (f"{target}/{champion}  DISAGREES with its signed statement:\n      tag kiln.weights_sha256 is "
            f"'{'f' * 64}', the signed statement says '{cand_a.train.weights_sha256}'") in captured.out
    assert re.search(rf"^  {re.escape(candidates)}/{b}  DOES NOT VERIFY: models:/{re.escape(candidates)}/{b} does not "
                     r"match its signed statement: MLmodel changed \(signed sha256 [0-9a-f]{64}, now", captured.out, re.M)
    assert f"{candidates}/{a}  agrees" in captured.out and f"{candidates}/{old}  unsigned" in captured.out
    assert captured.err.count("error:") == 1 and (
        f"2 version(s) failed the provenance audit: {target}/{champion} (disagrees), {candidates}/{b} "
        "(does-not-verify)") in captured.err

    # --json carries the same, after the events.
    assert kiln_main(["audit", target, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert [e["event"] for e in printed] == ["promotion", "review"] + ["provenance"] * 4
    entries = {(e["model"], e["version"]): e for e in printed[2:]}
    # the champion's signed approval still verifies: its approval tags were not edited
    assert [(a["kind"], a["status"]) for a in entries[(target, champion)].pop("attestations")] == [
        ("approval", "verifies")]
    assert printed[0]["attestation"]["status"] == "verifies" and printed[0]["attestation"]["approver"] == "alice"
    assert entries[(target, champion)] == {
        "event": "provenance", "model": target, "version": champion, "policy": "production", "status": "disagrees",
        "mismatches": [{"record": "kiln.weights_sha256", "version_says": "f" * 64,
                        "signed_says": cand_a.train.weights_sha256,
                        "text": f"tag kiln.weights_sha256 is '{'f' * 64}', the signed statement says "
                                f"'{cand_a.train.weights_sha256}'"}],
        "problem": ""}
    assert [entries[(candidates, v)]["status"] for v in (a, b, old)] == ["agrees", "does-not-verify", "unsigned"]
    assert "MLmodel changed" in entries[(candidates, b)]["problem"] and not entries[(candidates, b)]["mismatches"]


def test_kiln_audit_of_a_model_no_policy_owns_says_provenance_was_not_checked(
        tmp_path, client, unique_name, logged_models, capsys):
    policy = production_policy(unique_name)  # not in POLICIES: nobody owns its names
    _register(tmp_path, policy, "a", 3.0, unique_name)
    client.set_model_version_tag(policy.candidate_model, "1", "kiln.weights_sha256", "f" * 64)
    capsys.readouterr()
    assert kiln_main(["audit", policy.candidate_model]) == 0
    assert f"provenance not checked: no policy owns {policy.candidate_model}" in capsys.readouterr().out
    assert kiln_main(["audit", policy.candidate_model, "--require-signed"]) == 2
    # --policy names whose keys: then the edited tag is found
    assert kiln_main(["audit", policy.candidate_model, "--policy", "production"]) == 1
    assert f"tag kiln.weights_sha256 is '{'f' * 64}'" in capsys.readouterr().out


# ---------------------------------------------------------- signed approvals and rollbacks, checked


def _attestation_file(mlflow_server: Any, uri: str) -> Path:
    """The attestation a ``runs:/`` URI names, in the server's artifact store."""
    run_id, rest = uri.removeprefix("runs:/").split("/", 1)
    found = [p for p in Path(mlflow_server.artifacts).rglob(Path(rest).name) if run_id in p.parts]
    assert len(found) == 1, found
    return found[0]


def _forge_approval(client: Any, tmp_path: Path, policy: Any, mv: Any, statement: dict) -> str:
    """What an attacker holding production's key (but not the version's statement) can log: an approval
    of another statement, put in the version's run, its sha256 tag edited to match. Returns its name."""
    import hashlib

    from kiln.provenance.approval import approval_statement, sign_approval

    other = dict(statement, subject=[{"name": "x", "digest": {"sha256": "0" * 64}}])
    forged = sign_approval(approval_statement(
        other, policy="production", candidate=mv.tags["kiln.source_version"], target=f"{mv.name}/{mv.version}",
        alias="champion", previous="", approver="alice", approved_at=mv.tags["kiln.promotion.approved_at"],
        approval="review", run_key=mv.tags["kiln.promotion.run_key"], decision={"action": "promote", "reasons": []}),
        "production")
    (tmp_path / "forged").mkdir()
    (tmp_path / "forged" / "forged.dsse.json").write_bytes(forged)
    client.log_artifact(mv.run_id, str(tmp_path / "forged" / "forged.dsse.json"), "approval")
    client.set_model_version_tag(mv.name, mv.version, "kiln.promotion.attestation",
                                 f"runs:/{mv.run_id}/approval/forged.dsse.json")
    client.set_model_version_tag(mv.name, mv.version, "kiln.promotion.attestation_sha256",
                                 hashlib.sha256(forged).hexdigest())
    return "forged.dsse.json"


def test_kiln_verify_and_audit_check_the_champion_s_signed_approval(
        tmp_path, client, unique_name, logged_models, mlflow_server, monkeypatch, capsys):
    """The approval promote signed: verified by ``kiln verify`` (printed) and ``kiln audit``; an edited
    attestation file, an edited approval tag, an approval of another statement signed with production's
    own key, and a champion whose attestation tags were removed each fail, naming what is wrong."""
    from kiln.provenance.approval import statement_sha256

    policy = production_policy(unique_name)
    monkeypatch.setitem(POLICIES, "production", policy)
    target = policy.target_model
    cand, ref, key = _register(tmp_path, policy, "a", 3.0, unique_name)
    approve(policy, ref, key, "alice")
    record = _promote(policy, cand, ref, key)
    champion = f"{target}@champion"
    mv = client.get_model_version(target, record.version)
    tags = dict(mv.tags)
    capsys.readouterr()
    assert kiln_main(["verify", champion]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert (f"signed approval: alice (review) at {record.at}, decision promote, promoted "
            f"{policy.candidate_model}/{ref['version']} as {target}/{record.version} (champion; before it none); "
            f"{tags['kiln.promotion.attestation']}") in out

    # the logged file edited in the artifact store: its bytes are not the ones the tag names
    stored = _attestation_file(mlflow_server, tags["kiln.promotion.attestation"])
    original = stored.read_bytes()
    stored.write_bytes(original.replace(b'"sig":"', b'"sig":"A', 1))
    err = _cli_error(capsys, ["verify", champion])
    assert re.search(rf"approval attestation {re.escape(tags['kiln.promotion.attestation'])} fails: the logged file "
                     rf"\S+ has sha256 [0-9a-f]{{64}}, tag kiln.promotion.attestation_sha256 says "
                     rf"{tags['kiln.promotion.attestation_sha256']}", err), err
    stored.write_bytes(original)

    # an approval tag edited: the signed approval says otherwise
    client.set_model_version_tag(target, record.version, "kiln.promotion.approver", "mallory")
    assert ("tag kiln.promotion.approver is 'mallory', the signed approval says 'alice'"
            in _cli_error(capsys, ["verify", champion]))
    assert kiln_main(["audit", target]) == 1
    captured = capsys.readouterr()
    assert "approval attestation FAILS" in captured.out and "the signed approval says 'alice'" in captured.out
    assert f"{target}/{record.version} (approval attestation fails)" in captured.err
    client.set_model_version_tag(target, record.version, "kiln.promotion.approver", "alice")

    # an approval of another statement, signed with production's own key, named in its place
    check_statement = verify_version(client, client.get_model_version(target, record.version), "production").statement
    name = _forge_approval(client, tmp_path, policy, mv, check_statement)
    other = dict(check_statement, subject=[{"name": "x", "digest": {"sha256": "0" * 64}}])
    err = _cli_error(capsys, ["verify", champion])
    assert (f"approval attestation {name} approves statement sha256 {statement_sha256(other)}, "
            f"not this version's {statement_sha256(check_statement)}") in err, err
    assert kiln_main(["audit", target, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    (promotion,) = [e for e in printed if e["event"] == "promotion"]
    assert promotion["attestation"]["status"] == "fails" and "not this version's" in promotion["attestation"]["problem"]

    # no attestation named at all: under production (approval required) the champion is missing one
    for tag in ("kiln.promotion.attestation", "kiln.promotion.attestation_sha256"):
        client.delete_model_version_tag(target, record.version, tag)
    assert ("no signed approval: it records a promotion (kiln.promotion.run_key, kiln.promotion.approver, "
            "kiln.promotion.approved_at) under policy production, which requires approval, but names no approval "
            "attestation") in _cli_error(capsys, ["verify", champion])
    assert kiln_main(["audit", target]) == 0, "missing is reported; it fails the audit with --require-signed"
    assert "approval attestation MISSING" in capsys.readouterr().out
    assert kiln_main(["audit", target, "--require-signed"]) == 1
    assert f"{target}/{record.version} (approval attestation missing)" in capsys.readouterr().err
    # the original tags back: it verifies again
    for tag in ("kiln.promotion.attestation", "kiln.promotion.attestation_sha256"):
        client.set_model_version_tag(target, record.version, tag, tags[tag])
    assert kiln_main(["verify", champion]) == 0, capsys.readouterr().err


def test_rollback_signs_what_it_restores_and_refuses_one_whose_approval_fails(
        tmp_path, client, unique_name, logged_models, mlflow_server, writes, monkeypatch, capsys):
    """A rollback signs an attestation naming the restored version's statement, the version rolled back
    from, who, why and when; ``kiln verify`` and ``kiln audit`` check it, and an edited rollback tag fails
    both. A rollback to a version whose signed approval fails is refused before anything moves."""
    policy = production_policy(unique_name)
    monkeypatch.setitem(POLICIES, "production", policy)
    target = policy.target_model
    for name, bpb in (("a", 3.0), ("b", 2.9)):
        cand, ref, key = _register(tmp_path / name, policy, name, bpb, unique_name)
        approve(policy, ref, key, "alice")
        _promote(policy, cand, ref, key)
    # version 1, about to be restored, with an edited approval tag: refused, nothing written
    client.set_model_version_tag(target, "1", "kiln.promotion.approver", "mallory")
    writes.clear()
    with pytest.raises(ProvenanceError, match=f"{re.escape(target)} version 1: approval attestation .* fails: tag "
                                              "kiln.promotion.approver is 'mallory', the signed approval says 'alice'"):
        registry.rollback(target, policy, "carol", reason="INC-7: wrong language")
    assert writes == [] and client.get_model_version_by_alias(target, "champion").version == "2"
    client.set_model_version_tag(target, "1", "kiln.promotion.approver", "alice")

    rolled = registry.rollback(target, policy, "carol", reason="INC-7: wrong language")
    assert (rolled.version, rolled.previous_version) == ("1", "2")
    assert writes[-1] == ("set_registered_model_alias", target, "champion", "1"), "the alias moves last"
    restored = client.get_model_version(target, "1")
    uri = restored.tags["kiln.rollback.attestation"]
    assert uri.startswith(f"runs:/{restored.run_id}/approval/rollback-")
    capsys.readouterr()
    assert kiln_main(["verify", f"{target}@champion"]) == 0, capsys.readouterr().err
    assert (f"signed rollback: carol at {rolled.at} moved champion back to it from version 2: INC-7: wrong language; "
            f"{uri}") in capsys.readouterr().out
    assert kiln_main(["audit", target, "--json"]) == 0, capsys.readouterr().err
    (event,) = [e for e in json.loads(capsys.readouterr().out) if e["event"] == "rollback"]
    assert event["attestation"] == {"kind": "rollback", "status": "verifies", "uri": uri,
                                    "sha256": restored.tags["kiln.rollback.attestation_sha256"], "actor": "carol",
                                    "rolled_back_at": rolled.at, "from_version": "2", "reason": "INC-7: wrong language"}
    # the signed file names the restored statement and the version rolled back from
    from kiln.provenance.approval import statement_sha256, verify_rollback

    statement = verify_version(client, restored, "production").statement
    predicate = verify_rollback(_attestation_file(mlflow_server, uri), statement)
    assert (predicate["target"], predicate["fromVersion"], predicate["actor"]) == (f"{target}/1", "2", "carol")
    assert statement_sha256(statement)  # the subject: verify_rollback compared it

    # the rollback's reason edited on the version: it disagrees with what was signed
    client.set_model_version_tag(target, "1", "kiln.rollback.reason", "routine")
    assert ("rollback attestation " + uri + " fails: tag kiln.rollback.reason is 'routine', the signed rollback says "
            "'INC-7: wrong language'") in _cli_error(capsys, ["verify", f"{target}/1"])
    assert kiln_main(["audit", target]) == 1
    assert f"{target}/1 (rollback attestation fails)" in capsys.readouterr().err


# ------------------------------------------------------------------------ kiln export verifies first


def test_kiln_export_verifies_the_version_first_and_refuses_a_tampered_one(
        tmp_path, client, unique_name, mlflow_server, capsys):
    """The text model a user loads through kiln (``kiln export``): a version whose tags or bytes differ
    from its signed statement is refused with a ProvenanceError naming what differs, and nothing is
    written; the untouched version exports."""
    manifest = build_manifest(tmp_path)
    _verified, refs = _refs_of(write_real_checkpoint(tmp_path / "run", manifest), manifest)
    policy = sandbox_policy(unique_name)
    model = policy.candidate_model
    version = registry.register_candidate(policy=policy, run_key=f"kiln_sandbox/{unique_name}", **refs)["version"]
    client.set_registered_model_alias(model, "champion", version)
    exports = tmp_path / "exports"
    exports.mkdir()

    def export(out: str, policy_name: str = "sandbox") -> int:
        return kiln_main(["export", f"{model}@champion", "--format", "hf", "--out", str(exports / out),
                          "--policy", policy_name])

    def refused(out: str, policy_name: str = "sandbox") -> str:
        capsys.readouterr()
        assert export(out, policy_name) == 1
        assert not (exports / out).exists() and [p.name for p in exports.iterdir() if p.name != "good"] == [], (
            "nothing written, no staging left")
        err = capsys.readouterr().err
        assert err.count("error:") == 1
        return err

    # an edited tag
    weights = client.get_model_version(model, version).tags["kiln.weights_sha256"]
    client.set_model_version_tag(model, version, "kiln.weights_sha256", "f" * 64)
    assert f"kiln export: error: {model} version {version}: its records disagree with its signed statement: tag " \
           f"kiln.weights_sha256 is '{'f' * 64}', the signed statement says '{weights}'" in refused("tag")
    # untouched again: it verifies, then exports
    client.set_model_version_tag(model, version, "kiln.weights_sha256", weights)
    capsys.readouterr()
    assert export("good") == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["policy"] == "sandbox"
    assert (exports / "good" / "model.safetensors").is_file()
    # a sandbox-signed version presented as production
    assert re.search(r"does not verify for policy production: .* signed by key [0-9a-f]{64} \(a key of policy "
                     r"sandbox\), which policy production does not trust", refused("as-production", "production"))
    # a changed byte of the weights in the artifact store
    weights_file = _stored_dir(mlflow_server, client, model, version) / "artifacts" / "hf_model" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1
    weights_file.write_bytes(bytes(data))
    assert re.search(r"artifacts/hf_model/model\.safetensors changed \(signed sha256 [0-9a-f]{64}, now",
                     refused("bytes"))

"""``kiln verify``'s and ``kiln audit``'s checks of the signed approval and rollback attestations a version
names (``kiln.registry.verify.attestation_checks``), without a server: the version is MLflow's own
``ModelVersion`` with the tags promotion and rollback write, the attestation a real signed file read
through ``mlflow.artifacts.download_artifacts`` (a local URI instead of ``runs:/``), real keys and a real
statement. Each refusal names what is wrong. Against a real MLflow server:
tests/integration/test_registry_provenance.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag
from provenance_fixtures import inputs, make_artifact

from kiln.cli.audit import failed_versions, format_provenance
from kiln.errors import ProvenanceError
from kiln.provenance.approval import approval_statement, rollback_statement, sign_attestation, statement_sha256
from kiln.provenance.statement import build_statement
from kiln.registry.audit import attested_events
from kiln.registry.verify import VersionCheck, attestation_checks

AT = "2026-12-07T10:00:00.000001+00:00"
ROLLED_AT = "2026-12-07T11:00:00.000001+00:00"
DECISION = {"action": "promote", "reasons": ["first model"], "candidate_bits_per_byte": 2.5}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Keys under a kiln home of the test's own (verification reads the trusted sets there)."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def statement(tmp_path):
    return build_statement(make_artifact(tmp_path / "a"), inputs())


def _approval(statement: dict, **changes: Any) -> dict:
    fields = {"policy": "production", "candidate": "m.candidates/3", "target": "m/1", "alias": "champion",
              "previous": "", "approver": "alice", "approved_at": AT, "approval": "review",
              "run_key": "kiln_production/r1", "decision": DECISION}
    return approval_statement(statement, **{**fields, **changes})


def _rollback(statement: dict, **changes: Any) -> dict:
    fields = {"policy": "production", "target": "m/1", "from_version": "2", "alias": "champion", "actor": "carol",
              "rolled_back_at": ROLLED_AT, "reason": "INC-7"}
    return rollback_statement(statement, **{**fields, **changes})


def _logged(tmp_path: Path, name: str, attestation: dict, policy: str = "production") -> tuple[str, str]:
    """The attestation signed and written where a URI reaches it: (its URI, its sha256)."""
    path = tmp_path / "store" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(sign_attestation(attestation, policy))
    return path.as_uri(), hashlib.sha256(path.read_bytes()).hexdigest()


def _promotion_tags(uri: str = "", sha: str = "") -> dict[str, str]:
    tags = {"kiln.promotion.run_key": "kiln_production/r1", "kiln.promotion.approver": "alice",
            "kiln.promotion.approved_at": AT, "kiln.promotion.approval": "review",
            "kiln.promotion.previous_version": "", "kiln.source_version": "m.candidates/3",
            "kiln.decision": "promote", "kiln.decision.reasons": json.dumps(["first model"])}
    if uri:
        tags["kiln.promotion.attestation"] = uri
    if sha:
        tags["kiln.promotion.attestation_sha256"] = sha
    return tags


def _rollback_tags(uri: str, sha: str) -> dict[str, str]:
    return {"kiln.rollback.actor": "carol", "kiln.rollback.at": ROLLED_AT, "kiln.rollback.from_version": "2",
            "kiln.rollback.reason": "INC-7", "kiln.rollback.attestation": uri, "kiln.rollback.attestation_sha256": sha}


def _version(tags: dict[str, str], name: str = "m", version: str = "1", aliases: list[str] | None = None) -> ModelVersion:
    return ModelVersion(name, version, 0, tags=[ModelVersionTag(k, v) for k, v in tags.items()], aliases=aliases or [])


def _one(mv: ModelVersion, statement: dict, policy: str = "production", kinds=("approval", "rollback")):
    (check,) = attestation_checks(mv, statement, policy, kinds)
    return check


def test_a_signed_approval_and_rollback_of_this_version_verify(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement))
    r_uri, r_sha = _logged(tmp_path, "rollback.dsse.json", _rollback(statement))
    mv = _version(_promotion_tags(uri, sha) | _rollback_tags(r_uri, r_sha), aliases=["champion"])
    approval, rollback = attestation_checks(mv, statement, "production")
    assert (approval.kind, approval.status, approval.at, approval.uri) == ("approval", "verifies", AT, uri)
    assert approval.predicate["approver"] == "alice" and approval.predicate["decision"]["action"] == "promote"
    assert (rollback.kind, rollback.status, rollback.at) == ("rollback", "verifies", ROLLED_AT)
    assert rollback.predicate["reason"] == "INC-7" and rollback.predicate["fromVersion"] == "2"
    # the promoted copy's candidate carries the same statement: the approval names it too
    assert _one(_version(_promotion_tags(uri, sha), name="m.candidates", version="3"), statement).status == "verifies"


def test_a_forged_approval_signed_with_another_policy_s_key_fails(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement), policy="sandbox")
    check = _one(_version(_promotion_tags(uri, sha)), statement)
    assert check.status == "fails"
    assert "approval attestation approval.dsse.json: " in check.problem and "policy sandbox" in check.problem


def test_an_approval_of_another_statement_fails(tmp_path, home, statement):
    other = build_statement(make_artifact(tmp_path / "b", salt="other"), inputs())
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(other))
    check = _one(_version(_promotion_tags(uri, sha)), statement)
    assert check.status == "fails"
    assert check.problem == (f"approval attestation approval.dsse.json approves statement sha256 "
                             f"{statement_sha256(other)}, not this version's {statement_sha256(statement)}")


def test_an_attestation_whose_file_is_not_the_one_the_tag_names_fails(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement))
    check = _one(_version(_promotion_tags(uri, "0" * 64)), statement)
    assert check.status == "fails"
    assert check.problem == f"the logged file {uri} has sha256 {sha}, tag kiln.promotion.attestation_sha256 says {'0' * 64}"
    gone = (tmp_path / "store" / "nothing.dsse.json").as_uri()
    assert _one(_version(_promotion_tags(gone, sha)), statement).problem == (
        f"{gone} (tag kiln.promotion.attestation) is not in the artifact store")
    half = _one(_version(_promotion_tags(uri)), statement)
    assert half.status == "fails" and half.problem.startswith("kiln.promotion.attestation_sha256 is not set")


def test_an_edited_approval_tag_disagrees_with_the_signed_approval(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement))
    check = _one(_version(_promotion_tags(uri, sha) | {"kiln.promotion.approver": "mallory"}), statement)
    assert check.status == "fails" and not check.problem
    assert [str(m) for m in check.mismatches] == [
        "tag kiln.promotion.approver is 'mallory', the signed approval says 'alice'"]
    assert "approval attestation" in str(check) and "the signed approval says 'alice'" in str(check)


def test_an_approval_of_another_version_with_the_same_statement_fails(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement))
    check = _one(_version(_promotion_tags(uri, sha), version="7"), statement)
    assert check.status == "fails"
    assert check.problem == "the signed approval is of m.candidates/3 and m/1, not this version m/7"


def test_an_edited_rollback_tag_or_a_foreign_rollback_fails(tmp_path, home, statement):
    r_uri, r_sha = _logged(tmp_path, "rollback.dsse.json", _rollback(statement))
    edited = _one(_version(_rollback_tags(r_uri, r_sha) | {"kiln.rollback.reason": "routine"}), statement,
                  kinds=("rollback",))
    assert [str(m) for m in edited.mismatches] == ["tag kiln.rollback.reason is 'routine', the signed rollback says 'INC-7'"]
    other = build_statement(make_artifact(tmp_path / "b", salt="other"), inputs())
    f_uri, f_sha = _logged(tmp_path, "foreign.dsse.json", _rollback(other))
    foreign = _one(_version(_rollback_tags(f_uri, f_sha)), statement, kinds=("rollback",))
    assert foreign.status == "fails" and "restores statement sha256 " + statement_sha256(other) in foreign.problem


def test_a_promoted_version_without_an_approval_is_missing_one_under_a_policy_that_requires_approval(home, statement):
    promoted = _version(_promotion_tags())
    check = _one(promoted, statement)
    assert (check.status, check.at) == ("missing", AT)
    assert str(check) == ("no signed approval: it records a promotion (kiln.promotion.run_key, kiln.promotion.approver, "
                          "kiln.promotion.approved_at) under policy production, which requires approval, but names no "
                          "approval attestation (kiln.promotion.attestation is not set)")
    # the alias alone is a promotion too (set by hand, no kiln.promotion.* tags)
    assert "it holds alias 'champion'" in _one(_version({}, aliases=["champion"]), statement).problem
    rolled_to = _version({"kiln.rollback.actor": "carol", "kiln.rollback.at": ROLLED_AT})
    assert "it records a rollback to it (kiln.rollback.actor, kiln.rollback.at)" in _one(
        rolled_to, statement, kinds=("rollback",)).problem
    # sandbox requires no approval; a version never promoted needs none
    assert attestation_checks(promoted, statement, "sandbox") == ()
    assert attestation_checks(_version({}), statement, "production") == ()


def _check_of(mv: ModelVersion, statement: dict) -> VersionCheck:
    from kiln.provenance.verify import VerifiedArtifact

    verified = VerifiedArtifact(directory=Path("."), statement=statement, statement_key_id="k", model_sig_key_id="k",
                                policy="production")
    return VersionCheck(model=mv.name, version=str(mv.version), policy="production", status="agrees",
                        verified=verified, attestations=attestation_checks(mv, statement, "production"))


def test_verify_refuses_and_audit_fails_on_an_attestation_that_fails(tmp_path, home, statement):
    other = build_statement(make_artifact(tmp_path / "b", salt="other"), inputs())
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(other))
    check = _check_of(_version(_promotion_tags(uri, sha)), statement)
    with pytest.raises(ProvenanceError, match=r"^m version 1: approval attestation file://\S+ fails: approval "
                                              r"attestation approval.dsse.json approves statement sha256"):
        check.require_attested()
    assert failed_versions([check], require_signed=False) == [check]
    assert "      approval attestation FAILS: approval attestation file://" in format_provenance([check], "production")
    events = [{"event": "promotion", "at": AT, "model": "m", "version": "1", "actor": "alice"},
              {"event": "review", "at": AT, "model": "m.candidates", "version": "3", "actor": "alice"}]
    annotated = attested_events(events, [check])
    assert annotated[1] == events[1], "a review records no attestation"
    assert annotated[0]["attestation"]["status"] == "fails"
    assert "approves statement sha256" in annotated[0]["attestation"]["problem"]


def test_audit_fails_on_a_missing_approval_only_when_signed_versions_are_required(home, statement):
    check = _check_of(_version(_promotion_tags()), statement)
    with pytest.raises(ProvenanceError, match="no signed approval: it records a promotion"):
        check.require_attested()
    assert failed_versions([check], require_signed=False) == []
    assert failed_versions([check], require_signed=True) == [check]


def test_audit_says_who_approved_and_on_what_as_signed(tmp_path, home, statement):
    uri, sha = _logged(tmp_path, "approval.dsse.json", _approval(statement))
    check = _check_of(_version(_promotion_tags(uri, sha)), statement)
    check.require_attested()
    assert failed_versions([check], require_signed=True) == []
    earlier = {"event": "promotion", "at": "2026-12-01T00:00:00+00:00", "model": "m", "version": "1"}
    now = {"event": "promotion", "at": AT, "model": "m", "version": "1"}
    first, latest = attested_events([earlier, now], [check])
    assert latest["attestation"] == {"kind": "approval", "status": "verifies", "uri": uri, "sha256": sha,
                                     "approver": "alice", "approval": "review", "approved_at": AT,
                                     "decision": "promote"}
    # an earlier promotion is checked from the file logged in the version's run: this check names no run
    assert first["attestation"]["status"] == "unchecked"
    assert first["attestation"]["problem"] == ("no approval attestation was logged for this promotion in the "
                                               "version's run (made before kiln signed them)")

"""A promotion's approval attestation: it names the provenance statement by its sha256, is signed with the
policy's key and verifies for that statement only; the datasheet shows it as signed, and says why when one
the version names was not used. Real keys, real statements; promotion itself against a real MLflow server:
tests/integration/test_registry_datasheet.py."""

from __future__ import annotations

import base64
import json

import pytest
from provenance_fixtures import inputs, make_artifact

from kiln.errors import ProvenanceError
from kiln.provenance.approval import (
    APPROVAL_PREDICATE_TYPE,
    ROLLBACK_PREDICATE_TYPE,
    approval_statement,
    attestation_name,
    rollback_attestation_name,
    rollback_statement,
    sign_approval,
    sign_attestation,
    statement_sha256,
    verify_approval,
    verify_rollback,
)
from kiln.provenance.datasheet import FROM_APPROVAL, FROM_TAGS, DatasheetSources, build_datasheet
from kiln.provenance.statement import build_statement, statement_bytes

DECISION = {"action": "promote", "reasons": ["first model"], "candidate_bits_per_byte": 2.5}


def _approval(statement, **changes):
    fields = {"policy": "production", "candidate": "m.candidates/3", "target": "m/1", "alias": "champion",
              "previous": "", "approver": "alice", "approved_at": "2026-12-07T10:00:00+00:00", "approval": "review",
              "run_key": "kiln_production/manual__1", "decision": DECISION}
    return approval_statement(statement, **{**fields, **changes})


@pytest.fixture
def statement(tmp_path):
    return build_statement(make_artifact(tmp_path / "a"), inputs())


def test_an_approval_names_the_statement_and_verifies_for_it(tmp_path, statement):
    approval = _approval(statement)
    assert approval["predicateType"] == APPROVAL_PREDICATE_TYPE
    assert approval["subject"] == [{"name": "models:/m.candidates/3 provenance statement",
                                    "digest": {"sha256": statement_sha256(statement)}}]
    path = tmp_path / attestation_name("m/1", "2026-12-07T10:00:00+00:00")
    assert path.name == "m_1-2026-12-07T10_00_00_00_00.dsse.json"
    path.write_bytes(sign_approval(approval, "production", home=tmp_path))
    # the statement as a verifier has it: read back from its signed bytes
    predicate = verify_approval(path, json.loads(statement_bytes(statement)), home=tmp_path)
    assert predicate == approval["predicate"] and predicate["approver"] == "alice"


def test_an_approval_of_another_statement_is_refused(tmp_path, statement):
    other = build_statement(make_artifact(tmp_path / "b", salt="other"), inputs())
    path = tmp_path / "approval.dsse.json"
    path.write_bytes(sign_approval(_approval(other), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match=f"approves statement sha256 {statement_sha256(other)}, not this "
                                              f"version's {statement_sha256(statement)}"):
        verify_approval(path, statement, home=tmp_path)


def test_an_approval_signed_by_another_policy_or_edited_is_refused(tmp_path, statement):
    path = tmp_path / "approval.dsse.json"
    path.write_bytes(sign_approval(_approval(statement), "sandbox", home=tmp_path))
    with pytest.raises(ProvenanceError, match="approval attestation approval.dsse.json: .*policy sandbox"):
        verify_approval(path, statement, home=tmp_path)
    path.write_bytes(sign_approval(_approval(statement), "production", home=tmp_path))
    envelope = json.loads(path.read_bytes())
    edited = json.loads(base64.b64decode(envelope["payload"]))
    edited["predicate"]["approver"] = "mallory"
    envelope["payload"] = base64.b64encode(statement_bytes(edited)).decode()
    path.write_text(json.dumps(envelope))
    with pytest.raises(ProvenanceError, match="does not verify"):
        verify_approval(path, statement, home=tmp_path)


def test_an_approval_of_another_policy_s_statement_is_refused(tmp_path, statement):
    path = tmp_path / "approval.dsse.json"
    path.write_bytes(sign_approval(_approval(statement, policy="sandbox"), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match="says policy 'sandbox', the statement 'production'"):
        verify_approval(path, statement, home=tmp_path)


def _section(sheet, title):
    return next(s for s in sheet.sections if s.title == title)


def test_the_datasheet_shows_a_verified_approval_as_signed(statement):
    sheet = build_datasheet(statement, DatasheetSources(approval=_approval(statement)["predicate"],
                                                        approval_tags={"kiln.promotion.approver": "alice"}))
    facts = {f.label: (f.value, f.source) for f in _section(sheet, "Who approved it").facts}
    assert facts["approved by"] == ("alice", FROM_APPROVAL)
    assert facts["promoted as"] == ("m/1 (champion; before it none)", FROM_APPROVAL)
    assert facts["gate decision promoted on"] == ("promote: first model", FROM_APPROVAL)
    assert "kiln.promotion.approver" not in facts


def test_the_datasheet_says_why_an_approval_was_not_used(statement):
    sheet = build_datasheet(statement, DatasheetSources(approval_tags={"kiln.promotion.approver": "alice"},
                                                        approval_problem="it does not verify"))
    section = _section(sheet, "Who approved it")
    assert [(f.label, f.source) for f in section.facts] == [("kiln.promotion.approver", FROM_TAGS)]
    assert "The approval attestation was not used: it does not verify." in section.notes


# ------------------------------------------------------------------------------------------- rollback


def _rollback(statement, **changes):
    fields = {"policy": "production", "target": "m/1", "from_version": "2", "alias": "champion", "actor": "carol",
              "rolled_back_at": "2026-12-07T11:00:00.000001+00:00", "reason": "INC-7: wrong language"}
    return rollback_statement(statement, **{**fields, **changes})


def test_a_rollback_names_the_restored_statement_and_verifies_for_it(tmp_path, statement):
    rollback = _rollback(statement)
    assert rollback["predicateType"] == ROLLBACK_PREDICATE_TYPE
    assert rollback["subject"] == [{"name": "models:/m/1 provenance statement",
                                    "digest": {"sha256": statement_sha256(statement)}}]
    path = tmp_path / rollback_attestation_name("m/1", "2026-12-07T11:00:00.000001+00:00")
    assert path.name == "rollback-m_1-2026-12-07T11_00_00.000001_00_00.dsse.json"
    path.write_bytes(sign_attestation(rollback, "production", home=tmp_path))
    predicate = verify_rollback(path, json.loads(statement_bytes(statement)), home=tmp_path)
    assert predicate == rollback["predicate"]
    assert (predicate["actor"], predicate["fromVersion"], predicate["reason"]) == ("carol", "2", "INC-7: wrong language")


def test_a_rollback_of_another_statement_another_key_or_edited_is_refused(tmp_path, statement):
    other = build_statement(make_artifact(tmp_path / "b", salt="other"), inputs())
    path = tmp_path / "rollback.dsse.json"
    path.write_bytes(sign_attestation(_rollback(other), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match=f"rollback attestation rollback.dsse.json restores statement sha256 "
                                              f"{statement_sha256(other)}, not this version's {statement_sha256(statement)}"):
        verify_rollback(path, statement, home=tmp_path)
    path.write_bytes(sign_attestation(_rollback(statement), "sandbox", home=tmp_path))
    with pytest.raises(ProvenanceError, match="rollback attestation rollback.dsse.json: .*policy sandbox"):
        verify_rollback(path, statement, home=tmp_path)
    path.write_bytes(sign_attestation(_rollback(statement), "production", home=tmp_path))
    envelope = json.loads(path.read_bytes())
    edited = json.loads(base64.b64decode(envelope["payload"]))
    edited["predicate"]["reason"] = "nothing happened"
    envelope["payload"] = base64.b64encode(statement_bytes(edited)).decode()
    path.write_text(json.dumps(envelope))
    with pytest.raises(ProvenanceError, match="does not verify"):
        verify_rollback(path, statement, home=tmp_path)
    path.write_bytes(sign_attestation(_rollback(statement, policy="sandbox"), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match="says policy 'sandbox', the statement 'production'"):
        verify_rollback(path, statement, home=tmp_path)


def test_an_approval_is_no_rollback_nor_a_rollback_an_approval(tmp_path, statement):
    """The predicate type is checked: a signed approval of this statement put where a rollback is named
    (or the other way round) is refused, naming both types."""
    path = tmp_path / "swapped.dsse.json"
    path.write_bytes(sign_approval(_approval(statement), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match=f"not a kiln rollback attestation \\(predicate type "
                                              f"'{APPROVAL_PREDICATE_TYPE}', expected '{ROLLBACK_PREDICATE_TYPE}'\\)"):
        verify_rollback(path, statement, home=tmp_path)
    path.write_bytes(sign_attestation(_rollback(statement), "production", home=tmp_path))
    with pytest.raises(ProvenanceError, match="not a kiln approval attestation"):
        verify_approval(path, statement, home=tmp_path)

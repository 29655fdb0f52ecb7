"""The datasheet of a registered version, against a real ``mlflow server``: registration logs it (Markdown
and HTML, with the sources it read) to the version's run, beside the signed model directory and never in
it; the version's description links it; ``kiln datasheet MODEL/VERSION`` makes it again from the verified
statement, with the review recorded since, and refuses a version whose tags disagree with its statement."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kiln import registry
from kiln.cli import main as kiln_main
from kiln.data.contracts import load_contract
from kiln.data.validation.report import quarantine_report, quarantine_report_text
from kiln.provenance.datasheet import DATASHEET_DIR
from kiln.refs import ShardReport
from kiln.registry.verify import check_version

from test_registry_mlflow import approve, make_candidate, production_policy  # tests/integration is on sys.path


def _quarantine_report(path: Path, contract: Any, snapshot: str) -> Path:
    """A report as the data gate writes it: one healthy shard, one quarantined for a leaked secret."""
    reports = [
        ShardReport(path=f"{snapshot}/train/shard-000.parquet", sha256="a" * 64, rows=10, verdict="healthy",
                    contract=contract.ref),
        ShardReport(path=f"{snapshot}/train/shard-001.parquet", sha256="c" * 64, rows=12, verdict="quarantined",
                    contract=contract.ref, reasons=[{"expectation": "expect_column_values_to_not_match_regex_list",
                                                     "column": "text", "unexpected_count": 1, "sample": ["[REDACTED]"]}]),
    ]
    body = quarantine_report(reports, snapshot_id="x.dir", max_quarantine_share=0.5, contract=contract)
    path.write_text(quarantine_report_text(body))
    return path


def test_a_registered_version_carries_its_datasheet_beside_its_signed_files(
        tmp_path, client, unique_name, logged_models, capsys):
    import mlflow

    contract = load_contract("stdlib-py@1")
    policy = production_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    report = _quarantine_report(tmp_path / "quarantine-report.json", contract, cand.snapshot.path)
    key = f"kiln_production/a-{unique_name}"
    ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs(), records=registry.RunRecords(
        quarantine_report=str(report), contract_suite_sha256=contract.sha256, launcher="local"))
    mv = client.get_model_version(policy.candidate_model, ref["version"])

    logged = {a.path for a in client.list_artifacts(mv.run_id, DATASHEET_DIR)}
    assert logged == {"datasheet/datasheet.md", "datasheet/datasheet.html", "datasheet/sources"}
    sources = {a.path for a in client.list_artifacts(mv.run_id, "datasheet/sources")}
    assert sources == {"datasheet/sources/quarantine-report.json", "datasheet/sources/contract-suite.json"}
    folder = Path(mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=DATASHEET_DIR,
                                                      dst_path=str(tmp_path / "dl")))
    assert hashlib.sha256((folder / "sources" / "quarantine-report.json").read_bytes()).hexdigest() == \
        hashlib.sha256(report.read_bytes()).hexdigest()
    markdown = (folder / "datasheet.md").read_text()
    for fact in (f"Datasheet of the model of run {key}".replace("_", "\\_"), "| corpus | `stdlib-py` | statement |",
                 "| data gate outcome | pass: 1 of 2 shards quarantined (share 0.5) | quarantine report |",
                 "| train/shard-001.parquet | 12 | no\\_secrets (expect\\_column\\_values\\_to\\_not\\_match\\_regex\\_list "
                 "on text): 1 |"):
        assert fact in markdown, fact
    assert "shard-001.parquet" in (folder / "datasheet.html").read_text()

    # the signed model directory is untouched: the version verifies, and no datasheet file is among its subjects
    check = check_version(mv, "production")
    assert check.status == "agrees", check.problem
    assert check.verified is not None
    assert not [s["name"] for s in check.verified.statement["subject"] if "datasheet" in s["name"]]
    experiment = client.get_run(mv.run_id).info.experiment_id
    assert (f"[`datasheet/datasheet.html`](#/experiments/{experiment}/runs/{mv.run_id}/artifacts/datasheet/datasheet.html)"
            in mv.description)

    # kiln datasheet: made again from the verified statement, with the review recorded since (not signed)
    approve(policy, ref, key, "alice")
    ref_text = f"{policy.candidate_model}/{ref['version']}"
    capsys.readouterr()  # what registration printed
    assert kiln_main(["datasheet", ref_text, "--policy", "production"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert printed.startswith(f"# Datasheet of {ref_text}".replace("_", "\\_"))
    assert "| kiln.review.by | alice | version tags |" in printed
    assert "| data gate outcome | pass: 1 of 2 shards quarantined (share 0.5) | quarantine report |" in printed
    assert kiln_main(["datasheet", ref_text, "--policy", "production", "--html"]) == 0
    assert capsys.readouterr().out.startswith("<!doctype html>")

    client.set_model_version_tag(policy.candidate_model, ref["version"], "kiln.weights_sha256", "f" * 64)
    assert kiln_main(["datasheet", ref_text, "--policy", "production"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "tag kiln.weights_sha256 is 'ffff" in captured.err and "the signed statement says" in captured.err


def test_promotion_signs_the_approval_and_the_run_s_datasheet_shows_it(
        tmp_path, client, unique_name, logged_models, capsys):
    """The statement is signed before anyone reviews the version; promote signs the approval (an attestation
    naming the statement by its sha256, the policy's key) and logs the run's datasheet again with it."""
    import mlflow

    from kiln.provenance.approval import approval_statement, sign_approval, statement_sha256, verify_approval

    contract = load_contract("stdlib-py@1")
    policy = production_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    report = _quarantine_report(tmp_path / "quarantine-report.json", contract, cand.snapshot.path)
    key = f"kiln_production/a-{unique_name}"
    ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs(), records=registry.RunRecords(
        quarantine_report=str(report), contract_suite_sha256=contract.sha256, launcher="local"))
    approve(policy, ref, key, "alice")
    decision = registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
    record = registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)

    mv = client.get_model_version(policy.target_model, record.version)
    uri, sha = mv.tags["kiln.promotion.attestation"], mv.tags["kiln.promotion.attestation_sha256"]
    assert uri.startswith(f"runs:/{mv.run_id}/approval/")
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "approval")))
    assert hashlib.sha256(local.read_bytes()).hexdigest() == sha
    check = check_version(mv, "production")
    assert check.status == "agrees", check.problem  # the signed model directory is untouched
    assert check.verified is not None
    statement = check.verified.statement
    approval = verify_approval(local, statement)
    assert (approval["approver"], approval["approvedAt"], approval["approval"]) == ("alice", record.at, "review")
    assert approval["target"] == f"{policy.target_model}/{record.version}" and approval["alias"] == "champion"
    assert approval["candidate"] == f"{policy.candidate_model}/{ref['version']}" and approval["runKey"] == key
    assert approval["decision"]["action"] == "promote" and approval["policy"] == "production"

    # the run's datasheet, logged again at promotion: the signed approval, no longer "no approval is recorded"
    folder = Path(mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=DATASHEET_DIR,
                                                      dst_path=str(tmp_path / "dl")))
    markdown = (folder / "datasheet.md").read_text()
    assert "| approved by | alice | approval attestation |" in markdown
    assert f"| promoted as | `{policy.target_model}/{record.version} (champion; before it none)` | approval " \
           "attestation |" in markdown
    assert "No approval is recorded" not in markdown
    assert "| data gate outcome | pass: 1 of 2 shards quarantined (share 0.5) | quarantine report |" in markdown
    ref_text = f"{policy.target_model}@champion"
    capsys.readouterr()
    assert kiln_main(["datasheet", ref_text, "--policy", "production"]) == 0, capsys.readouterr().err
    assert "| approved by | alice | approval attestation |" in capsys.readouterr().out

    # an approval of another statement, signed with production's own key and put in its place (the sha256
    # tag, which is not signed, edited to match) is not shown as signed: the tags are, with why not
    other = dict(statement, subject=[{"name": "x", "digest": {"sha256": "0" * 64}}])
    forged = sign_approval(approval_statement(other, policy="production", candidate=approval["candidate"],
                                              target=approval["target"], alias="champion", previous="",
                                              approver="mallory", approved_at=record.at, approval="review",
                                              run_key=key, decision=approval["decision"]), "production")
    (tmp_path / "forged").mkdir()
    (tmp_path / "forged" / local.name).write_bytes(forged)
    client.log_artifact(mv.run_id, str(tmp_path / "forged" / local.name), "approval")
    client.set_model_version_tag(policy.target_model, record.version, "kiln.promotion.attestation_sha256",
                                 hashlib.sha256(forged).hexdigest())
    assert kiln_main(["datasheet", ref_text, "--policy", "production"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "| approved by |" not in printed and "mallory" not in printed
    assert "| kiln.promotion.approver | alice | version tags |" in printed
    assert (f"The approval attestation was not used: approval attestation {local.name} approves statement "
            f"sha256 {statement_sha256(other)}, not this version's {statement_sha256(statement)}") \
        .replace("_", "\\_") in printed

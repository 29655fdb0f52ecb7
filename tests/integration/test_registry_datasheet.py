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

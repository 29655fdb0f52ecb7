"""``kiln.data.validation.report``: the JSON report, the HTML page (escaped, redacted), their publication to MLflow."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln import runs
from kiln.data import validation
from kiln.data.corpus import POISON_KINDS
from kiln.data.validation import write_quarantine_report

from shard_fixtures import fake_report


def test_quarantine_report_lists_every_shard_and_is_reproducible(poisoned_reports, tmp_path: Path) -> None:
    first = write_quarantine_report(poisoned_reports, tmp_path / "a.json", snapshot_id="x.dir", max_quarantine_share=0.25)
    second = write_quarantine_report(list(reversed(poisoned_reports)), tmp_path / "b.json", snapshot_id="x.dir",
                                     max_quarantine_share=0.25)
    assert first.read_bytes() == second.read_bytes()
    body = json.loads(first.read_text())
    assert body["shards"] == len(poisoned_reports) == len(body["reports"])
    assert len(body["quarantined"]) == len(POISON_KINDS) and body["gate"] == "fail"
    assert body["quarantined_share"] == pytest.approx(len(POISON_KINDS) / len(poisoned_reports), abs=1e-6)
    assert {"path", "sha256", "verdict", "reasons", "contract", "rows"} <= set(body["reports"][0])


def test_html_report_shows_every_shard_and_escapes_samples(poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    path = validation.write_quarantine_html(poisoned_reports, tmp_path / "q.html", snapshot_id="x.dir", max_quarantine_share=0.25)
    page = path.read_text()
    assert page.count("<tr class=") == len(poisoned_reports)
    assert page.count("<tr class='quarantined'>") == len(POISON_KINDS)
    assert "Data gate: <b>fail</b>" in page and "[REDACTED]" in page
    for pattern in stdlib_contract.secret_patterns:
        assert not re.search(pattern, page)
    odd = fake_report("<script>.parquet", "quarantined")
    odd = dataclasses.replace(odd, reasons=[{"expectation": "x", "column": "text", "unexpected_count": 1, "sample": ["<b>"]}])
    assert "<script>" not in validation.render_quarantine_html([odd]) and "&lt;b&gt;" in validation.render_quarantine_html([odd])


# -- the quarantine page and its publication ---------------------------------------------------------


def test_html_page_with_the_contract_shows_rules_snapshot_and_every_shard(poisoned_reports, stdlib_contract) -> None:
    page = validation.render_quarantine_html(
        poisoned_reports, snapshot_id="abc.dir", max_quarantine_share=0.25, contract=stdlib_contract
    )
    assert "<code>abc.dir</code>" in page and stdlib_contract.sha256 in page and "stdlib-py@1" in page
    for report in poisoned_reports:
        assert f"title='{report.path}'" in page and f"title='{report.sha256}'" in page
    for expectation in stdlib_contract.expectations:
        assert html.escape(expectation["description"]) in page
    for kind in POISON_KINDS.values():
        assert kind.rule in page
    verdicts = re.findall(r"<tr class='(\w+)'>", page)
    assert verdicts == sorted(verdicts, key=lambda v: v == "healthy")  # quarantined shards first
    assert page == validation.render_quarantine_html(
        list(reversed(poisoned_reports)), snapshot_id="abc.dir", max_quarantine_share=0.25, contract=stdlib_contract
    )


def test_html_page_redacts_secrets_even_in_old_reports(stdlib_contract) -> None:
    leaked = "AKIA" + "ABCDEFGHIJKLMNOP"
    old = dataclasses.replace(
        fake_report("old.parquet", "quarantined"),
        reasons=[{"expectation": "expect_column_values_to_not_match_regex_list", "column": "text", "unexpected_count": 1,
                  "sample": [f"key = {leaked}"]}],
    )
    assert leaked in validation.render_quarantine_html([old])  # without the contract nothing says what a secret is
    page = validation.render_quarantine_html([old], contract=stdlib_contract)
    assert leaked not in page and "[REDACTED]" in page


def test_publish_writes_json_and_html_without_mlflow(poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    published = validation.publish_quarantine_report(
        poisoned_reports, tmp_path / "run", snapshot_id="abc.dir", contract="stdlib-py@1", max_quarantine_share=0.25
    )
    assert set(published) == {"json", "html"}
    body = json.loads(Path(published["json"]).read_text())
    assert body["snapshot_id"] == "abc.dir" and body["contract_sha256"] == stdlib_contract.sha256 and body["gate"] == "fail"
    assert Path(published["html"]).read_text().count("<tr class=") == len(poisoned_reports)


def test_publish_logs_both_files_to_the_mlflow_run(poisoned_reports, stdlib_contract, tmp_path: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("kiln-quarantine", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    kwargs = {"snapshot_id": "abc.dir", "contract": stdlib_contract, "max_quarantine_share": 0.25, "mlflow_run_id": run_id}
    published = validation.publish_quarantine_report(poisoned_reports, tmp_path / "out", **kwargs)
    again = validation.publish_quarantine_report(poisoned_reports, tmp_path / "out", **kwargs)  # a retried task
    assert again == published
    artifacts = sorted(a.path for a in client.list_artifacts(run_id, runs.QUARANTINE_ARTIFACT_DIR))
    assert artifacts == ["quarantine/quarantine-report.html", "quarantine/quarantine-report.json"]
    for key in ("json", "html"):
        assert published[f"{key}_uri"].endswith(f"/quarantine/quarantine-report.{key}")
        logged = Path(client.download_artifacts(run_id, f"quarantine/quarantine-report.{key}", str(tmp_path / key)))
        assert logged.read_bytes() == Path(published[key]).read_bytes()


def test_publish_translates_mlflow_failures(poisoned_reports, stdlib_contract, tmp_path: Path, monkeypatch) -> None:
    import mlflow
    from mlflow.exceptions import MlflowException

    from kiln.errors import RegistryError

    class DownClient:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_artifact(self, *args: Any, **kwargs: Any) -> None:
            raise MlflowException("tracking server unreachable")

    monkeypatch.setattr(mlflow, "MlflowClient", DownClient)
    with pytest.raises(RegistryError, match="run r1: tracking server unreachable") as info:
        validation.publish_quarantine_report(
            poisoned_reports, tmp_path, snapshot_id="abc.dir", contract=stdlib_contract, max_quarantine_share=0.25,
            mlflow_run_id="r1",
        )
    assert info.value.retryable and (tmp_path / runs.QUARANTINE_HTML).is_file()  # written before MLflow was tried

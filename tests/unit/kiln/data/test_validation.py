"""``kiln.data.validation`` end to end: quarantine per poison kind, unreadable shards in a batch, ``kiln validate``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from kiln.data import validation
from kiln.data.corpus import POISON_KINDS
from kiln.data.validation import (
    READABLE_RULE,
    load_eval_doc_hashes,
    validate_directory,
    validate_shard,
    write_quarantine_report,
)
from kiln.data.validation.reasons import SAMPLE_CHARS, SAMPLE_SIZE
from kiln.refs import SnapshotRef, TrainingManifest, sha256_file

from shard_fixtures import by_path, shard_of, validated_one_by_one, write_file


def test_importing_the_library_modules_stays_cheap() -> None:
    code = (
        "import sys, kiln.data.validation, kiln.data.contracts, kiln.data.corpus, kiln.cli.validate, kiln.cli.corpus\n"
        "heavy = [m for m in ('great_expectations', 'pandas', 'torch', 'airflow', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- clean and poisoned corpora ---------------------------------------------------------------------


def test_clean_corpus_quarantines_nothing(clean_corpus: dict[str, Any], stdlib_contract) -> None:
    reports = validate_directory(clean_corpus["out"], stdlib_contract)
    assert [Path(r.path).name for r in reports] == [Path(p).name for p in clean_corpus["train"]]
    assert all(r.verdict == "healthy" and r.reasons == [] for r in reports), [r.reasons for r in reports]
    assert sum(r.rows for r in reports) == clean_corpus["documents"]["train"]
    for r in reports:
        assert r.sha256 == sha256_file(r.path) and r.contract == "stdlib-py@1" and Path(r.path).is_absolute()


@pytest.mark.parametrize("kind", list(POISON_KINDS))
def test_each_poison_is_quarantined_for_exactly_its_rule(kind: str, poisoned_corpus, poisoned_reports) -> None:
    report = by_path(poisoned_reports)[shard_of(poisoned_corpus, kind)]
    assert report.verdict == "quarantined"
    poison = POISON_KINDS[kind]
    assert {r["expectation"] for r in report.reasons} == {poison.rule}, report.reasons
    assert {r.get("column") for r in report.reasons} == {poison.column}, report.reasons
    for reason in report.reasons:
        if reason["expectation"] == READABLE_RULE:
            assert reason["error"] and report.rows == 0
        else:
            assert reason["unexpected_count"] >= 1
            assert 1 <= len(reason["sample"]) <= SAMPLE_SIZE
            assert all(isinstance(s, str) and len(s) <= 2 * SAMPLE_CHARS for s in reason["sample"])


@pytest.mark.parametrize(
    "kind, column, count",
    [
        ("null_ids", "doc_id", 3),
        ("null_text", "text", 3),
        ("duplicate_ids", "doc_id", 6),  # both rows of each of the 3 colliding pairs
        ("tiny_doc", "text", 3),
        ("oversized_doc", "text", 1),
        ("secret", "text", 3),
        ("eval_contamination", "kiln_text_in_eval_split", 3),
        ("invalid_utf8", "kiln_text_bad_char_share", 1),
        ("control_chars", "kiln_text_bad_char_share", 1),
        ("wrong_type", "doc_id", None),
        ("duplicate_ids_across_shards", "doc_id", 3),
    ],
)
def test_reasons_name_the_column_and_count(kind: str, column: str, count: int | None, poisoned_corpus, poisoned_reports) -> None:
    report = by_path(poisoned_reports)[shard_of(poisoned_corpus, kind)]
    (reason,) = report.reasons
    assert reason["column"] == column
    assert reason["unexpected_count"] == (report.rows if count is None else count)


def test_missing_column_reason_names_the_column(poisoned_corpus, poisoned_reports) -> None:
    (reason,) = by_path(poisoned_reports)[shard_of(poisoned_corpus, "missing_column")].reasons
    assert reason["sample"] == ["missing column 'text'"]


def test_unpoisoned_shards_of_a_poisoned_corpus_stay_healthy(poisoned_corpus, poisoned_reports) -> None:
    poisoned = {str(Path(poisoned_corpus["out"]) / rel) for rel in poisoned_corpus["poisoned"]}
    clean = [r for r in poisoned_reports if r.path not in poisoned]
    assert len(clean) == len(poisoned_reports) - len(POISON_KINDS) > 0
    assert all(r.verdict == "healthy" for r in clean)


def test_reports_never_contain_the_secrets(poisoned_corpus, poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    texts = pq.read_table(shard_of(poisoned_corpus, "secret")).column("text").to_pylist()
    secret_lines = [
        line.strip().strip('"')
        for t in texts
        for line in t.splitlines()
        if any(re.search(p, line) for p in stdlib_contract.secret_patterns) or re.fullmatch(r"[A-Za-z0-9+/]{64}", line)
    ]
    assert len(secret_lines) >= 3 + 6  # PEM header, AWS key, token + the 6 key body lines
    path = write_quarantine_report(poisoned_reports, tmp_path / "report.json")
    dumped = path.read_text()
    assert "[REDACTED]" in dumped
    for pattern in stdlib_contract.secret_patterns:
        assert not re.search(pattern, dumped), pattern
    for line in secret_lines:
        assert line not in dumped


def test_contamination_uses_the_eval_split(poisoned_corpus, stdlib_contract) -> None:
    hashes = load_eval_doc_hashes(poisoned_corpus["out"])
    assert len(hashes) == poisoned_corpus["documents"]["eval"]
    shard = shard_of(poisoned_corpus, "eval_contamination")
    assert validate_shard(shard, stdlib_contract, frozenset()).verdict == "healthy"  # no eval split known → undetectable
    assert validate_shard(shard, stdlib_contract, hashes).verdict == "quarantined"


# -- kiln validate -----------------------------------------------------------------------------------


def test_cli_clean_corpus_exits_0_and_writes_the_manifest(kiln_cli, clean_corpus, tmp_path: Path, capsys) -> None:
    code = kiln_cli(
        ["validate", clean_corpus["out"], "--contract", "stdlib-py@1", "--report", str(tmp_path / "r.json"),
         "--manifest-out", str(tmp_path / "m.json")]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["gate"] == "pass" and summary["healthy"] == 8 and summary["quarantined"] == []
    manifest = TrainingManifest.read(tmp_path / "m.json")
    assert len(manifest.shards) == 8 and manifest.snapshot_id.startswith("unversioned:")
    assert summary["manifest_sha256"] == manifest.sha256
    assert len(json.loads((tmp_path / "r.json").read_text())["reports"]) == 8


def test_cli_poisoned_corpus_exits_3_without_a_manifest(kiln_cli, poisoned_corpus, tmp_path: Path, capsys) -> None:
    argv = ["validate", poisoned_corpus["out"], "--contract", "stdlib-py", "--report", str(tmp_path / "r.json"),
            "--manifest-out", str(tmp_path / "m.json")]
    assert kiln_cli(argv) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["gate"] == "fail" and "data gate" in captured.err
    assert not (tmp_path / "m.json").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["shards"] == 20 and len(report["quarantined"]) == len(POISON_KINDS)
    # The same corpus passes under a lenient enough threshold.
    assert kiln_cli([*argv, "--max-quarantine-share", "0.9"]) == 0
    assert len(TrainingManifest.read(tmp_path / "m.json").shards) == 20 - len(POISON_KINDS)


def test_cli_resolves_a_snapshot_id(kiln_cli, clean_corpus, tmp_path: Path, monkeypatch, capsys) -> None:
    import kiln.data.snapshot

    snapshot_id = "0123456789abcdef0123456789abcdef.dir"
    seen = []

    def fake_checkout(sid: str) -> SnapshotRef:
        seen.append(sid)
        return SnapshotRef(id=sid, corpus="stdlib-py", files=9, bytes=1, dvc="", remote="", path=clean_corpus["out"])

    monkeypatch.setattr(kiln.data.snapshot, "checkout_snapshot", fake_checkout)
    code = kiln_cli(["validate", snapshot_id, "--contract", "stdlib-py@1", "--report", str(tmp_path / "r.json"),
                     "--manifest-out", str(tmp_path / "m.json")])
    assert (code, seen) == (0, [snapshot_id])
    manifest = TrainingManifest.read(tmp_path / "m.json")
    assert (manifest.snapshot_id, manifest.corpus) == (snapshot_id, "stdlib-py")


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{corpus}", "--report", "{tmp}/r.json"],  # --contract missing
        ["validate", "{corpus}", "--contract", "stdlib-py@1"],  # --report missing
        ["validate", "{corpus}", "--contract", "stdlib-py@1", "--report", "{tmp}/r.json", "--max-quarantine-share", "1.5"],
    ],
)
def test_cli_argparse_usage_errors_exit_2(kiln_cli, argv, clean_corpus, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        kiln_cli([a.format(corpus=clean_corpus["out"], tmp=tmp_path) for a in argv])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "target, contract, message",
    [
        ("{corpus}", "no-such-contract@1", "unknown contract"),
        ("{corpus}", "stdlib-py@9", "no version 9"),
        ("{tmp}/nowhere", "stdlib-py@1", "neither a corpus directory nor a snapshot id"),
        ("{tmp}", "stdlib-py@1", "no training shards"),
    ],
)
def test_cli_bad_targets_and_contracts_exit_2(kiln_cli, target, contract, message, clean_corpus, tmp_path: Path, capsys) -> None:
    code = kiln_cli(["validate", target.format(corpus=clean_corpus["out"], tmp=tmp_path), "--contract", contract,
                     "--report", str(tmp_path / "r.json")])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_unreadable_shards_in_a_batch_are_quarantined_one_by_one(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    good = clean_corpus["train"][:2]
    paths = [good[0], write_file(tmp_path / "zero.parquet", b""), tmp_path / "missing.parquet", tmp_path, good[1]]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert [Path(r.path).name for r in reports] == [Path(p).name for p in paths]
    assert [r.verdict for r in reports] == ["healthy", "quarantined", "quarantined", "quarantined", "healthy"]
    assert all([x["expectation"] for x in r.reasons] == [READABLE_RULE] for r in reports[1:4])
    assert reports == validated_one_by_one(paths, stdlib_contract, frozenset())

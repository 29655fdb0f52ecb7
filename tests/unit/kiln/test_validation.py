"""``kiln.validation``: quarantine per poison kind, unreadable shards, the gate, manifest, report, CLI."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln import validation
from kiln.corpus import POISON_KINDS, parquet_bytes
from kiln.errors import ContractError, DataGateError, ManifestError
from kiln.refs import ShardReport, SnapshotRef, TrainingManifest, sha256_file
from kiln.validation import (
    CROSS_SHARD_RULE,
    READABLE_RULE,
    build_training_manifest,
    cross_shard_duplicates,
    gate,
    load_eval_doc_hashes,
    validate_directory,
    validate_shard,
    write_quarantine_report,
)


def _shard_of(summary: dict[str, Any], kind: str) -> str:
    rel = next(rel for rel, k in summary["poisoned"].items() if k == kind)
    return str(Path(summary["out"]) / rel)


def _by_path(reports: list[ShardReport]) -> dict[str, ShardReport]:
    return {r.path: r for r in reports}


def _report(name: str, verdict: str = "healthy", contract: str = "stdlib-py@1") -> ShardReport:
    return ShardReport(path=f"/c/train/{name}", sha256="0" * 64, rows=10, verdict=verdict, reasons=[], contract=contract)  # type: ignore[arg-type]


def test_importing_the_library_modules_stays_cheap() -> None:
    code = (
        "import sys, kiln.validation, kiln.contracts, kiln.corpus, kiln.cli.validate, kiln.cli.corpus\n"
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
    report = _by_path(poisoned_reports)[_shard_of(poisoned_corpus, kind)]
    assert report.verdict == "quarantined"
    poison = POISON_KINDS[kind]
    assert {r["expectation"] for r in report.reasons} == {poison.rule}, report.reasons
    assert {r.get("column") for r in report.reasons} == {poison.column}, report.reasons
    for reason in report.reasons:
        if reason["expectation"] == READABLE_RULE:
            assert reason["error"] and report.rows == 0
        else:
            assert reason["unexpected_count"] >= 1
            assert 1 <= len(reason["sample"]) <= validation.SAMPLE_SIZE
            assert all(isinstance(s, str) and len(s) <= 2 * validation.SAMPLE_CHARS for s in reason["sample"])


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
    report = _by_path(poisoned_reports)[_shard_of(poisoned_corpus, kind)]
    (reason,) = report.reasons
    assert reason["column"] == column
    assert reason["unexpected_count"] == (report.rows if count is None else count)


def test_missing_column_reason_names_the_column(poisoned_corpus, poisoned_reports) -> None:
    (reason,) = _by_path(poisoned_reports)[_shard_of(poisoned_corpus, "missing_column")].reasons
    assert reason["sample"] == ["missing column 'text'"]


def test_unpoisoned_shards_of_a_poisoned_corpus_stay_healthy(poisoned_corpus, poisoned_reports) -> None:
    poisoned = {str(Path(poisoned_corpus["out"]) / rel) for rel in poisoned_corpus["poisoned"]}
    clean = [r for r in poisoned_reports if r.path not in poisoned]
    assert len(clean) == len(poisoned_reports) - len(POISON_KINDS) > 0
    assert all(r.verdict == "healthy" for r in clean)


def test_reports_never_contain_the_secrets(poisoned_corpus, poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    texts = pq.read_table(_shard_of(poisoned_corpus, "secret")).column("text").to_pylist()
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
    shard = _shard_of(poisoned_corpus, "eval_contamination")
    assert validate_shard(shard, stdlib_contract, frozenset()).verdict == "healthy"  # no eval split known → undetectable
    assert validate_shard(shard, stdlib_contract, hashes).verdict == "quarantined"


def test_one_ge_context_per_process(clean_corpus, stdlib_contract) -> None:
    first = validation._great_expectations()
    validate_shard(clean_corpus["train"][0], stdlib_contract)
    validate_shard(clean_corpus["train"][1], "stdlib-py@1")
    assert validation._great_expectations() is first
    context = first.batch_definition.data_asset.datasource.data_context
    assert [ds.name for ds in context.data_sources.all().values()] == ["kiln_shards"]


# -- unreadable shards never raise -------------------------------------------------------------------


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "make",
    [
        lambda d: _write(d / "zero.parquet", b""),
        lambda d: _write(d / "garbage.parquet", b"PAR1" + bytes(range(256)) * 8 + b"PAR1"),
        lambda d: _write(d / "csv.parquet", b"doc_id,text,source\na,b,c\n"),
        lambda d: _write(d / "trunc.parquet", parquet_bytes(pa.table({"doc_id": ["a"] * 50, "text": ["x" * 40] * 50, "source": ["s"] * 50}))[:-9]),
        lambda d: d / "does-not-exist.parquet",
        lambda d: d,  # a directory
    ],
    ids=["zero-bytes", "garbage-with-magic", "csv", "footer-cut", "missing", "directory"],
)
def test_unreadable_shards_are_quarantined_not_raised(make, tmp_path: Path, stdlib_contract) -> None:
    report = validate_shard(make(tmp_path), stdlib_contract)
    assert report.verdict == "quarantined"
    assert [r["expectation"] for r in report.reasons] == [READABLE_RULE]
    assert report.reasons[0]["error"]


@pytest.mark.parametrize(
    "table, rules",
    [
        (pa.table({"doc_id": ["a", "b"], "text": [["x" * 20], ["y" * 20]], "source": ["s", "s"]}), {"expect_column_values_to_be_of_type"}),
        (pa.table({"doc_id": ["a"], "text": [b"x" * 20], "source": ["s"]}), {"expect_column_values_to_be_of_type"}),
        (pa.table({"other": [1, 2]}), {"expect_table_columns_to_match_set"}),
        (pa.table({c: pa.array([], pa.string()) for c in ("doc_id", "text", "source")}), {"expect_table_row_count_to_be_between"}),
    ],
    ids=["text-is-a-list", "text-is-binary", "no-expected-columns", "zero-rows"],
)
def test_unexpected_schemas_are_quarantined_with_schema_reasons(table, rules, tmp_path: Path, stdlib_contract) -> None:
    report = validate_shard(_write(tmp_path / "odd.parquet", parquet_bytes(table)), stdlib_contract)
    assert report.verdict == "quarantined"
    assert {r["expectation"] for r in report.reasons} == rules, report.reasons


def test_a_broken_contract_is_a_fault_not_a_quarantine(clean_corpus, stdlib_contract) -> None:
    suite = json.loads(json.dumps(stdlib_contract.suite))
    suite["expectations"][8]["kwargs"]["no_such_kwarg"] = 1
    broken = dataclasses.replace(stdlib_contract, suite=suite)
    with pytest.raises(ContractError, match="not a valid GE suite"):
        validate_shard(clean_corpus["train"][0], broken)


# -- cross-shard rule and the gate -------------------------------------------------------------------


def test_cross_shard_duplicates_blame_the_later_shard_in_any_input_order(poisoned_corpus, poisoned_reports) -> None:
    dup = _shard_of(poisoned_corpus, "duplicate_ids_across_shards")
    (reason,) = _by_path(poisoned_reports)[dup].reasons
    donor = Path(reason["sample"][0].split("(also in ")[1].rstrip(")")).name
    assert donor < Path(dup).name
    assert _by_path(poisoned_reports)[str(Path(dup).with_name(donor))].verdict == "healthy"
    # Order of arrival does not matter: feed the un-crossed reports reversed.
    uncrossed = [dataclasses.replace(r, verdict="healthy", reasons=[]) if r.path == dup else r for r in poisoned_reports]
    again = cross_shard_duplicates(list(reversed(uncrossed)))
    assert [r.path for r in again] == [r.path for r in reversed(uncrossed)]
    assert {r.path: r.verdict for r in again} == {r.path: r.verdict for r in poisoned_reports}


def test_cross_shard_duplicates_ignore_quarantined_shards(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    first = validate_shard(clean_corpus["train"][0], stdlib_contract)
    copy = Path(tmp_path / "shard-99999.parquet")
    copy.write_bytes(Path(first.path).read_bytes())
    second = dataclasses.replace(first, path=str(copy))
    crossed = cross_shard_duplicates([first, second])
    assert [r.verdict for r in crossed] == ["healthy", "quarantined"]
    assert crossed[1].reasons[0]["expectation"] == CROSS_SHARD_RULE
    assert crossed[1].reasons[0]["unexpected_count"] == first.rows
    quarantined_first = dataclasses.replace(first, verdict="quarantined", reasons=[{"expectation": "x"}])
    assert [r.verdict for r in cross_shard_duplicates([quarantined_first, second])] == ["quarantined", "healthy"]


def test_gate_passes_at_or_below_the_threshold() -> None:
    reports = [_report(f"s{i}") for i in range(3)] + [_report("s3", "quarantined")]
    gate(reports, 0.25)
    gate(reports, 0.5)


def test_gate_fails_above_the_threshold_naming_shards_and_share() -> None:
    reports = [_report("s0"), _report("bad-1", "quarantined"), _report("bad-2", "quarantined")]
    with pytest.raises(DataGateError, match=r"2/3 shards quarantined \(66\.7%\) exceeds the maximum 50\.0%: bad-1, bad-2") as info:
        gate(reports, 0.5)
    assert info.value.retryable is False


@pytest.mark.parametrize(
    "reports, kwargs, message",
    [
        ([], {}, "no shards were validated"),
        ([_report("bad", "quarantined")], {}, "no healthy shard"),
        ([_report("s0")], {"expected_paths": ["/c/train/s0", "/c/train/s1"]}, "never validated: s1"),
    ],
)
def test_gate_fails_without_healthy_or_unvalidated_shards(reports, kwargs, message) -> None:
    with pytest.raises(DataGateError, match=message):
        gate(reports, 1.0, **kwargs)


def test_gate_rejects_a_bad_threshold() -> None:
    with pytest.raises(DataGateError, match="within"):
        gate([_report("s0")], 1.5)


# -- manifest and report -----------------------------------------------------------------------------


def test_manifest_lists_only_healthy_shards_and_verifies(poisoned_corpus, poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    eval_path = poisoned_corpus["eval"][0]
    manifest = build_training_manifest("d" * 32 + ".dir", "stdlib-py", stdlib_contract, poisoned_reports, [eval_path])
    healthy = sorted(r.path for r in poisoned_reports if r.verdict == "healthy")
    assert [s["path"] for s in manifest.shards] == healthy
    assert sorted(manifest.quarantined) == sorted(r.path for r in poisoned_reports if r.verdict == "quarantined")
    for entry in manifest.shards:
        assert entry["sha256"] == sha256_file(entry["path"]) and entry["rows"] == pq.read_metadata(entry["path"]).num_rows
    assert manifest.eval_shards == [{"path": eval_path, "sha256": sha256_file(eval_path), "rows": poisoned_corpus["documents"]["eval"]}]
    assert manifest.contract == "stdlib-py@1" and manifest.sha256 == manifest.content_hash()
    path = manifest.write(tmp_path / "manifest.json")
    assert TrainingManifest.read(path) == manifest
    tampered = json.loads(path.read_text())
    tampered["shards"].append(tampered["shards"][0])
    path.write_text(json.dumps(tampered))
    with pytest.raises(ManifestError):
        TrainingManifest.read(path)


def test_manifest_refuses_reports_of_another_contract_version() -> None:
    with pytest.raises(ContractError, match="stdlib-py@2"):
        build_training_manifest("x.dir", "stdlib-py", "stdlib-py@1", [_report("a"), _report("b", contract="stdlib-py@2")])


def test_quarantine_report_lists_every_shard_and_is_reproducible(poisoned_reports, tmp_path: Path) -> None:
    first = write_quarantine_report(poisoned_reports, tmp_path / "a.json", snapshot_id="x.dir", max_quarantine_share=0.25)
    second = write_quarantine_report(list(reversed(poisoned_reports)), tmp_path / "b.json", snapshot_id="x.dir", max_quarantine_share=0.25)
    assert first.read_bytes() == second.read_bytes()
    body = json.loads(first.read_text())
    assert body["shards"] == len(poisoned_reports) == len(body["reports"])
    assert len(body["quarantined"]) == len(POISON_KINDS) and body["gate"] == "fail"
    assert body["quarantined_share"] == pytest.approx(len(POISON_KINDS) / len(poisoned_reports), abs=1e-6)
    assert {"path", "sha256", "verdict", "reasons", "contract", "rows"} <= set(body["reports"][0])


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
    import kiln.snapshot

    snapshot_id = "0123456789abcdef0123456789abcdef.dir"
    seen = []

    def fake_checkout(sid: str) -> SnapshotRef:
        seen.append(sid)
        return SnapshotRef(id=sid, corpus="stdlib-py", files=9, bytes=1, dvc="", remote="", path=clean_corpus["out"])

    monkeypatch.setattr(kiln.snapshot, "checkout_snapshot", fake_checkout)
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


def test_html_report_shows_every_shard_and_escapes_samples(poisoned_reports, stdlib_contract, tmp_path: Path) -> None:
    path = validation.write_quarantine_html(poisoned_reports, tmp_path / "q.html", snapshot_id="x.dir", max_quarantine_share=0.25)
    page = path.read_text()
    assert page.count("<tr class=") == len(poisoned_reports)
    assert page.count("<tr class='quarantined'>") == len(POISON_KINDS)
    assert "Data gate: <b>fail</b>" in page and "[REDACTED]" in page
    for pattern in stdlib_contract.secret_patterns:
        assert not re.search(pattern, page)
    odd = _report("<script>.parquet", "quarantined")
    odd = dataclasses.replace(odd, reasons=[{"expectation": "x", "column": "text", "unexpected_count": 1, "sample": ["<b>"]}])
    assert "<script>" not in validation.render_quarantine_html([odd]) and "&lt;b&gt;" in validation.render_quarantine_html([odd])


# -- one GE run per batch: identical to one shard at a time -------------------------------------------


def _alone(paths: list[str] | list[Path], contract, hashes: frozenset[str]) -> list[ShardReport]:
    return [validate_shard(p, contract, hashes) for p in paths]


@pytest.mark.parametrize("corpus", ["clean_corpus", "poisoned_corpus"])
def test_batched_validation_equals_one_shard_at_a_time(corpus: str, request, stdlib_contract) -> None:
    summary = request.getfixturevalue(corpus)
    paths = validation.train_shards(summary["out"])
    hashes = load_eval_doc_hashes(summary["out"])
    alone = _alone(paths, stdlib_contract, hashes)
    assert validation.validate_shards(paths, stdlib_contract, hashes) == alone  # the whole corpus in one batch
    in_fours = [r for i in range(0, len(paths), 4) for r in validation.validate_shards(paths[i : i + 4], stdlib_contract, hashes)]
    assert in_fours == alone  # the DAG's batches
    assert any(r.verdict == "quarantined" for r in alone) == (corpus == "poisoned_corpus")


def test_a_batch_runs_ge_once_and_alone_only_for_odd_schemas(poisoned_corpus, stdlib_contract, monkeypatch) -> None:
    stacks, alone = [], []
    real_stack, real_alone = validation._validate_stack, validation._validate_alone
    monkeypatch.setattr(validation, "_validate_stack", lambda group, *a: stacks.append(len(group)) or real_stack(group, *a))
    monkeypatch.setattr(validation, "_validate_alone", lambda loaded, *a: alone.append(loaded.path) or real_alone(loaded, *a))
    paths = validation.train_shards(poisoned_corpus["out"])
    validation.validate_shards(paths, stdlib_contract, load_eval_doc_hashes(poisoned_corpus["out"]))
    odd = sorted(_shard_of(poisoned_corpus, k) for k in ("missing_column", "wrong_type"))
    unreadable = sum(POISON_KINDS[k].rule == READABLE_RULE for k in POISON_KINDS)
    assert sorted(alone) == odd  # every other readable shard went through the one stacked run
    assert stacks == [len(paths) - unreadable - len(odd)]


def test_the_shipped_contract_runs_entirely_in_the_stacked_run(stdlib_contract) -> None:
    classes = {e["type"]: validation._batch_class(e) for e in stdlib_contract.expectations}
    assert "alone" not in classes.values(), classes


def test_ids_repeated_across_shards_of_one_batch_are_not_an_in_shard_duplicate(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    table = pq.read_table(clean_corpus["train"][0])
    copy = _write(tmp_path / "copy.parquet", parquet_bytes(table))
    ids = table.column("doc_id").to_pylist()
    dup = _write(tmp_path / "dup.parquet", parquet_bytes(table.set_column(0, "doc_id", pa.array([ids[1], *ids[1:]]))))
    paths = [clean_corpus["train"][0], copy, dup]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert reports == _alone(paths, stdlib_contract, frozenset())
    assert [r.verdict for r in reports] == ["healthy", "healthy", "quarantined"]
    (reason,) = reports[2].reasons
    assert (reason["expectation"], reason["unexpected_count"]) == ("expect_column_values_to_be_unique", 2)


def _variant(contract, **changes: Any):
    """``contract`` with expectations' kwargs changed: {expectation index: {kwarg: value}}."""
    suite = json.loads(json.dumps(contract.suite))
    for index, kwargs in changes.items():
        suite["expectations"][int(index.lstrip("e"))]["kwargs"].update(kwargs)
    return dataclasses.replace(contract, suite=suite)


def test_batched_equals_alone_for_every_evaluation_class(clean_corpus, poisoned_corpus, stdlib_contract, tmp_path: Path) -> None:
    """Schema rules failing in a stack, per-shard row-count bounds (strict too), ``mostly`` (alone)."""
    clean = [Path(p) for p in clean_corpus["train"][:4]]
    rows = [pq.read_metadata(p).num_rows for p in clean]
    extra = pq.read_table(clean[0])
    extra = _write(tmp_path / "extra-column.parquet", parquet_bytes(extra.append_column("lang", pa.array(["py"] * extra.num_rows))))
    paths = [*clean, extra, *(_shard_of(poisoned_corpus, k) for k in ("null_ids", "tiny_doc", "zero_rows", "truncated"))]
    hashes = load_eval_doc_hashes(poisoned_corpus["out"])

    def at(kind: str, column: str | None = None) -> str:
        return next(f"e{i}" for i, x in enumerate(stdlib_contract.expectations) if (x["type"], x["kwargs"].get("column")) == (kind, column))

    count = at("expect_table_row_count_to_be_between")
    variants = [
        _variant(stdlib_contract, **{at("expect_table_columns_to_match_set"): {"exact_match": True}}),
        _variant(stdlib_contract, **{count: {"min_value": min(rows), "strict_min": True, "max_value": sorted(rows)[-2]}}),
        _variant(stdlib_contract, **{count: {"max_value": max(rows), "strict_max": True}}),
        _variant(stdlib_contract, **{at("expect_column_values_to_not_be_null", "doc_id"): {"mostly": 0.5}}),
    ]
    unchanged = validation.validate_shards(paths, stdlib_contract, hashes)
    for contract in variants:
        batched = validation.validate_shards(paths, contract, hashes)
        assert batched == _alone(paths, contract, hashes), contract.suite["expectations"]
        assert [r.reasons for r in batched] != [r.reasons for r in unchanged]  # the variant does change verdicts


def test_unreadable_shards_in_a_batch_are_quarantined_one_by_one(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    good = clean_corpus["train"][:2]
    paths = [good[0], _write(tmp_path / "zero.parquet", b""), tmp_path / "missing.parquet", tmp_path, good[1]]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert [Path(r.path).name for r in reports] == [Path(p).name for p in paths]
    assert [r.verdict for r in reports] == ["healthy", "quarantined", "quarantined", "quarantined", "healthy"]
    assert all([x["expectation"] for x in r.reasons] == [READABLE_RULE] for r in reports[1:4])
    assert reports == _alone(paths, stdlib_contract, frozenset())


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
        _report("old.parquet", "quarantined"),
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
    artifacts = sorted(a.path for a in client.list_artifacts(run_id, validation.QUARANTINE_ARTIFACT_DIR))
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
    assert info.value.retryable and (tmp_path / validation.QUARANTINE_HTML).is_file()  # written before MLflow was tried


def test_validation_leaves_the_contract_untouched(clean_corpus) -> None:
    from kiln.contracts import load_contract

    contract = load_contract("stdlib-py@1")
    before = json.loads(json.dumps(contract.suite)), contract.sha256
    validation.validate_shards(clean_corpus["train"][:2], contract)
    validate_shard(clean_corpus["train"][0], contract)
    assert (contract.suite, contract.sha256) == before
    assert contract.suite == json.loads(contract.path.read_text())


# -- the vectorised parts of the stacked run ------------------------------------------------------------


def test_every_shipped_secret_pattern_has_required_literals(stdlib_contract) -> None:
    """Otherwise the stacked run falls back to GE's regexes over every row (correct, but slow)."""
    found = {p: validation.required_literals(p) for p in stdlib_contract.secret_patterns}
    assert all(found.values()), found
    assert found["(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\\b"] == {"AKIA", "ASIA", "ABIA", "ACCA"}
    assert found["-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"] == {"PRIVATE KEY-----"}


@pytest.mark.parametrize("pattern", ["a|bcd", "(?i)secret", "x(?i:abc)y", ".*", "\\w{20}", "[^a]{5}", "ab", "(?:abc)?z"])
def test_required_literals_give_up_where_a_match_needs_no_literal(pattern: str) -> None:
    assert validation.required_literals(pattern) is None


def test_required_literals_are_sound_on_random_patterns_and_texts() -> None:
    """Whenever Python's ``re`` finds a match, the text holds one of the required literals."""
    import random

    rng = random.Random(4)
    atoms = ["ab", "abc", "b", "c", "[abc]", "[a-c]", "[^a]", ".", "\\w", "\\b", "(?:ab|ca)", "(?:abc|cab)", "a+", "(?:bc)+", "c*", "(?:ab)?", "x{2,3}", "(a)\\1"]
    checked = 0
    for _ in range(1000):
        pattern = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.2:
            pattern = f"{pattern}|{rng.choice(atoms)}{rng.choice(atoms)}"
        literals = validation.required_literals(pattern)
        if literals is None:
            continue
        compiled = re.compile(pattern)
        for _ in range(80):
            text = "".join(rng.choice("abcx ") for _ in range(rng.randint(0, 12)))
            if compiled.search(text):
                checked += 1
                assert any(lit in text for lit in literals), (pattern, text, literals)
    assert checked > 200  # the property was exercised, not vacuous


def test_char_share_in_arrow_equals_python(stdlib_contract) -> None:
    pattern = stdlib_contract.derived_columns["kiln_text_bad_char_share"]["pattern"]
    texts = ["", "plain", "tab\tand\nnewline", "bell\x07x", "\ufffd" * 3 + "abc", "c1 \x85 and é ü", "\x00", None, "日本語\x9f"]
    arrow = validation._char_share(pa.chunked_array([pa.array(texts, pa.string())]), pattern)
    bad = re.compile(pattern)
    expected = [float("nan") if t is None else (len(bad.findall(t)) / len(t) if t else 0.0) for t in texts]
    assert validation._re2_char_class(pattern) is not None  # the RE2 path ran
    assert [None if v != v else v for v in arrow.tolist()] == [None if v != v else v for v in expected]
    assert validation._re2_char_class("[\\w]") is None and validation._re2_char_class("ab") is None


def test_stacked_run_checks_literal_hits_with_ge_and_matches_alone(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    """A literal without a match stays healthy; a real match is found, sampled and redacted."""
    table = pq.read_table(clean_corpus["train"][0])
    texts = table.column("text").to_pylist()
    near = _write(tmp_path / "near.parquet", parquet_bytes(table.set_column(1, "text", pa.array([texts[0] + " AKIA is a prefix", *texts[1:]]))))
    key = "AKIA" + "QWERTYUIOPASDFGH"
    hit = _write(tmp_path / "hit.parquet", parquet_bytes(table.set_column(1, "text", pa.array([*texts[:-1], texts[-1] + f" {key} "]))))
    paths = [clean_corpus["train"][1], near, hit]
    reports = validation.validate_shards(paths, stdlib_contract)
    assert reports == _alone(paths, stdlib_contract, frozenset())
    assert [r.verdict for r in reports] == ["healthy", "healthy", "quarantined"]
    (reason,) = reports[2].reasons
    assert (reason["expectation"], reason["column"], reason["unexpected_count"]) == ("expect_column_values_to_not_match_regex_list", "text", 1)
    assert key not in json.dumps(reason) and validation.REDACTED in reason["sample"][0]


def test_eval_lengths_only_narrow_which_rows_are_hashed(poisoned_corpus, stdlib_contract) -> None:
    hashes = load_eval_doc_hashes(poisoned_corpus["out"])
    assert isinstance(hashes, validation.EvalDocHashes) and hashes.byte_lengths
    paths = [_shard_of(poisoned_corpus, "eval_contamination"), _shard_of(poisoned_corpus, "secret")]
    narrowed = validation.validate_shards(paths, stdlib_contract, hashes)
    assert narrowed == validation.validate_shards(paths, stdlib_contract, frozenset(hashes))
    assert [r.reasons[0]["column"] for r in narrowed] == ["kiln_text_in_eval_split", "text"]
